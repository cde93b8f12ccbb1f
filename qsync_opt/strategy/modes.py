"""Sync modes and gradient transports: what ``--sync`` and ``--comm`` mean, as pure functions.

Sync modes (``--sync``, ``TrainConfig.sync``)

``ddp``
    Every step, DDP's bucketed all-reduce of the FP32 gradients in backward (the default).
``local:H``
    Local SGD: every rank steps on its own gradient; every ``H`` steps the parameters are
    averaged (weighted by the ranks' batch shares).
``qsr:alpha=A,h_base=H0[,power=2]``
    Local SGD under the quadratic synchronisation rule (QSR, Gu et al., ICLR 2024): at the
    start of each round the round's length is ``H = max(H0, floor((A / lr) ** power))`` with
    ``lr`` the learning rate of that step (:mod:`.schedule`); ``H0`` during the warm-up;
    ``A = 0`` gives the constant ``H0``.

Every round is cut at the run's last step, so the last step always ends with a sync and the
replicas finish identical (torch's ``PeriodicModelAverager`` alone would leave them
different after its last period). :func:`round_length` and :func:`sync_steps` are the rule;
the trainer and the replayer's sync model call them, so they cannot drift.

Gradient transports (``--comm``, ``TrainConfig.comm``), composed into the one DDP hook chain

``allreduce``
    FP32 gradients (DDP's own all-reduce; the default).
``fp16``
    Gradients sent as fp16 (torch's ``fp16_compress_hook``: divided by the world size, cast,
    all-reduced, cast back), in the emulation too.
``dlcp[:p=P][,policy=priority|random|unbiased][,chunk_kib=64][,scenario=ring|incast|oversubscribed][,iterations=4][,buffer_kib=4096]``
    Bounded-loss priority communication (DLCP), by default **from the network**: each rank
    zero-fills the chunks (of ``chunk_kib`` KiB) that the packet simulator
    (:func:`qsync_opt.sync.netloss.dlcp_masks`) says the plan's cluster, cut to the run's
    ranks, loses of that rank's messages under the bounded-loss transport (``priority``:
    DLCP's priority queues; ``random``, ``unbiased``: FIFO queues), in ``scenario`` with
    switch buffers of ``buffer_kib`` KiB, every DDP bucket ready at once; ``iterations``
    seeded iterations are simulated once, up front, and step ``s`` uses iteration
    ``s mod iterations``. At most a fraction ``P`` (default 0.05, the simulator's bound too)
    of each gradient tensor is dropped; a network that loses nothing drops nothing.
``dlcp:p=P,stress[,policy=priority|random|unbiased][,chunk_kib=64][,layer_bias=1]``
    The **stress** mode: a fraction ``P`` of each tensor dropped on every step, congested or
    not, the chunks chosen by ``policy`` (:mod:`qsync_opt.strategy.droppolicy`).

Both run before the FP32 all-reduce, in DDP's own buckets (the bound is per tensor, as DLCP
bounds each message, so per bucket). They emulate the network's losses for their effect on
quality; the time saved is the packet simulator's prediction.

Which combine is :data:`COMPATIBLE`; :func:`check_combination` refuses the others with one
line (a gradient transport needs gradients on the wire: Local SGD and QSR send parameters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.limits import parse_float
from qsync_opt.strategy.schedule import LRSchedule, parse_options

__all__ = ["COMM_KINDS", "COMM_SYNTAX", "COMPATIBLE", "CommMode", "POLICIES", "QSR_KEYS", "SYNC_KINDS", "SYNC_SYNTAX",
           "SyncMode", "check_combination", "parse_comm", "parse_sync", "parse_transport", "qsr_period",
           "round_count", "round_length", "rounds", "sync_steps", "transport_text"]

SYNC_KINDS = ("ddp", "local", "qsr")
#: DLCP's drop policies (:mod:`qsync_opt.strategy.droppolicy` implements them).
POLICIES = ("priority", "random", "unbiased")
COMM_KINDS = ("allreduce", "fp16", "dlcp")

#: (sync kind, comm kind) pairs that run; docs/CLI.md's table is checked against it.
COMPATIBLE: dict[tuple[str, str], bool] = {
    ("ddp", "allreduce"): True, ("ddp", "fp16"): True, ("ddp", "dlcp"): True,
    ("local", "allreduce"): True, ("local", "fp16"): False, ("local", "dlcp"): False,
    ("qsr", "allreduce"): True, ("qsr", "fp16"): False, ("qsr", "dlcp"): False,
}

#: QSR's keys (``qsr:alpha=A,h_base=H0[,power=P]``) and their types.
QSR_KEYS: dict[str, type] = {"alpha": float, "h_base": int, "power": float}
#: Every sync mode and every key :func:`parse_sync` takes, as the help texts show them.
SYNC_SYNTAX = "ddp, local:H or qsr:alpha=A,h_base=H0[,power=P]"

#: ``dlcp``'s largest ``p`` (more than half a gradient lost is not a bounded loss).
MAX_DROP = 0.5
#: ``dlcp``'s bound without ``p=`` (from-the-network mode; the simulator's default too).
DEFAULT_DROP = 0.05
#: ``dlcp``'s simulated iterations by default, and at most (each is simulated up front).
DEFAULT_NET_ITERATIONS = 4
MAX_NET_ITERATIONS = 64
#: The fabrics a cluster's network is simulated on (``netsim``), the scenarios of the
#: from-the-network mode: a ring over the leaf/spine fabric, incast to a parameter server,
#: an oversubscribed spine.
NET_SCENARIOS = ("ring", "incast", "oversubscribed")
#: ``--comm``'s syntax, in its refusals and train's --help
COMM_SYNTAX = ("allreduce, fp16, dlcp[:p=P][,policy=priority|random|unbiased][,chunk_kib=K]"
               "[,scenario=ring|incast|oversubscribed][,iterations=N][,buffer_kib=B] (drops "
               "from the simulated network) or dlcp:p=P,stress[,policy=...][,chunk_kib=K]"
               "[,layer_bias=B] (a fraction P every step)")

#: A round never exceeds this many steps (``(A / lr) ** 2`` of a tiny lr is astronomic).
MAX_PERIOD = 1 << 40


@dataclass(frozen=True)
class SyncMode:
    """A parsed ``--sync`` (module docstring). ``period``: H of ``local``, H0 of ``qsr``."""

    kind: str = "ddp"
    period: int = 1
    alpha: float = 0.0
    power: float = 2.0

    @property
    def averages_parameters(self) -> bool:
        """True for Local SGD and QSR (parameters averaged every round, no gradient
        all-reduce)."""
        return self.kind != "ddp"

    def describe(self) -> str:
        if self.kind == "ddp":
            return "ddp"
        if self.kind == "local":
            return f"local:{self.period}"
        p = "" if self.power == 2 else f",power={self.power:g}"
        return f"qsr:alpha={self.alpha:g},h_base={self.period}{p}"


@dataclass(frozen=True)
class CommMode:
    """A parsed ``--comm``."""

    kind: str = "allreduce"
    #: dlcp: the bound on the dropped fraction, the policy, the chunk size, the layer bias
    p: float = 0.0
    policy: str = "priority"
    chunk_kib: float = 64.0
    layer_bias: float = 1.0
    #: dlcp: True: the fixed-p stress mode; False: the drops the simulated network loses
    stress: bool = False
    scenario: str = "ring"
    iterations: int = DEFAULT_NET_ITERATIONS
    buffer_kib: float = 4096.0

    @property
    def chunk_elems(self) -> int:
        """dlcp's chunk in fp32 elements."""
        return max(1, int(self.chunk_kib * 1024) // 4)

    def describe(self) -> str:
        if self.kind != "dlcp":
            return self.kind
        if self.stress:
            return (f"dlcp:p={self.p:g},stress,policy={self.policy},chunk_kib={self.chunk_kib:g}"
                    + ("" if self.layer_bias == 1 else f",layer_bias={self.layer_bias:g}"))
        return (f"dlcp:p={self.p:g},policy={self.policy},chunk_kib={self.chunk_kib:g},"
                f"scenario={self.scenario},iterations={self.iterations}"
                + ("" if self.buffer_kib == 4096 else f",buffer_kib={self.buffer_kib:g}"))


def parse_sync(text: str) -> SyncMode:
    """``--sync`` text -> :class:`SyncMode` (QsyncInputError names the field)."""
    raw = text.strip()
    kind, _, rest = raw.partition(":")
    kind = kind.strip().lower()
    if kind == "ddp":
        if rest.strip():
            raise QsyncInputError(f"sync: ddp takes no options, got {raw!r}")
        return SyncMode()
    if kind == "local":
        h = parse_float(rest)  # ASCII digits: never '٣' or '²'
        if h is None or not (h.is_integer() and 1 <= h <= MAX_PERIOD):
            raise QsyncInputError(f"sync: local:H needs an integer H from 1 to {MAX_PERIOD} "
                                  f"(steps between parameter averages), got {raw!r}")
        return SyncMode("local", int(h))
    if kind == "qsr":
        _, opts = parse_options(raw, "sync", QSR_KEYS)
        if "alpha" not in opts or "h_base" not in opts:
            raise QsyncInputError(f"sync: qsr needs alpha=A and h_base=H0 "
                                  f"(qsr:alpha=0.2,h_base=4), got {raw!r}")
        alpha, h0, power = opts["alpha"], int(opts["h_base"]), opts.get("power", 2.0)
        if alpha < 0:
            raise QsyncInputError(f"sync: qsr's alpha must be >= 0, got {alpha:g}")
        if not 1 <= h0 <= MAX_PERIOD:
            raise QsyncInputError(f"sync: qsr's h_base must be an integer >= 1, got {h0}")
        if not power > 0:
            raise QsyncInputError(f"sync: qsr's power must be > 0, got {power:g}")
        return SyncMode("qsr", h0, float(alpha), float(power))
    raise QsyncInputError(f"sync: expected {SYNC_SYNTAX}, got {raw!r}")


def parse_comm(text: str) -> CommMode:
    """``--comm`` text -> :class:`CommMode`."""
    raw = text.strip()
    kind = raw.partition(":")[0].strip().lower()
    if kind == "dlcp":
        return _parse_dlcp(raw)
    if kind not in COMM_KINDS or ":" in raw:
        raise QsyncInputError(f"comm: expected {COMM_SYNTAX}, got {raw!r}")
    return CommMode(kind)


def parse_transport(text: str) -> CommMode:
    """A plan's ``transport`` (or ``--allow transport=``'s item) -> :class:`CommMode`: the
    ``--comm`` forms, with ``fp32`` the name of ``allreduce`` (DDP's own FP32 all-reduce)."""
    raw = text.strip()
    if raw.lower() == "fp32":
        return CommMode("allreduce")
    return parse_comm(raw)


def transport_text(comm: CommMode) -> str:
    """A transport as a plan writes it: ``fp32`` for ``allreduce``, else ``--comm``'s form."""
    return "fp32" if comm.kind == "allreduce" else comm.describe()


def _word(items: list[str], key: str) -> tuple[str | None, list[str]]:
    """The value of ``key=WORD`` among ``items`` (None: absent; given twice: refused) and
    the other items."""
    mine = [x for x in items if x.partition("=")[0].strip().lower() == key]
    if len(mine) > 1:
        raise QsyncInputError(f"comm: {key} given twice")
    rest = [x for x in items if x not in mine]
    return (mine[0].partition("=")[2].strip().lower() if mine else None), rest


def _parse_dlcp(raw: str) -> CommMode:
    head, _, rest = raw.partition(":")
    items = [x for x in rest.split(",") if x.strip()]
    flags = [x for x in items if x.strip().lower() == "stress"]
    if len(flags) > 1:
        raise QsyncInputError("comm: stress given twice")
    items = [x for x in items if x not in flags]
    stress = bool(flags)
    pol, items = _word(items, "policy")
    pol = pol or "priority"
    if pol not in POLICIES:
        raise QsyncInputError(f"comm: dlcp's policy: expected one of {', '.join(POLICIES)}, "
                              f"got {pol!r}")
    scenario, items = _word(items, "scenario")
    if scenario is not None and scenario not in NET_SCENARIOS:
        raise QsyncInputError(f"comm: dlcp's scenario: expected one of "
                              f"{', '.join(NET_SCENARIOS)}, got {scenario!r}")
    keys: dict[str, type] = ({"p": float, "chunk_kib": float, "layer_bias": float} if stress
                             else {"p": float, "chunk_kib": float, "iterations": int,
                                   "buffer_kib": float})
    if stress and scenario is not None:
        raise QsyncInputError("comm: dlcp's scenario is of the network mode; stress drops a "
                              "fixed fraction without a network (leave out one of them)")
    others = ",".join(items)
    _, opts = parse_options(f"dlcp:{others}" if others else "dlcp", "comm", keys)
    if stress and "p" not in opts:
        raise QsyncInputError(f"comm: dlcp's stress mode needs p=P, the fraction of each "
                              f"gradient tensor dropped every step (dlcp:p=0.05,stress), "
                              f"got {raw!r}")
    p, kib = opts.get("p", DEFAULT_DROP), opts.get("chunk_kib", 64.0)
    if not 0 <= p <= MAX_DROP:
        raise QsyncInputError(f"comm: dlcp's p must be in [0, {MAX_DROP:g}], got {p:g}")
    if not 1 / 256 <= kib <= 1 << 20:
        raise QsyncInputError(f"comm: dlcp's chunk_kib must be in [1/256, 2^20] KiB, got {kib:g}")
    bias = opts.get("layer_bias", 1.0)
    if bias < 0:
        raise QsyncInputError(f"comm: dlcp's layer_bias must be >= 0, got {bias:g}")
    its = int(opts.get("iterations", DEFAULT_NET_ITERATIONS))
    if not 1 <= its <= MAX_NET_ITERATIONS:
        raise QsyncInputError(f"comm: dlcp's iterations must be an integer in [1, "
                              f"{MAX_NET_ITERATIONS}], got {its}")
    buf = opts.get("buffer_kib", 4096.0)
    if not 1 <= buf <= 1 << 20:
        raise QsyncInputError(f"comm: dlcp's buffer_kib must be in [1, 2^20] KiB, got {buf:g}")
    return CommMode("dlcp", float(p), pol, float(kib), float(bias), stress,
                    scenario or "ring", its, float(buf))


def check_combination(sync: SyncMode, comm: CommMode) -> None:
    """Refuse a sync/comm pair that cannot run, in one line naming both flags."""
    if not COMPATIBLE.get((sync.kind, comm.kind), False):
        raise QsyncInputError(
            f"--sync {sync.describe()} with --comm {comm.describe()}: {comm.kind} is a "
            f"gradient transport (DDP's all-reduce), and {sync.kind} sends no gradients (it "
            "averages FP32 parameters every round); use --comm allreduce, or --sync ddp")


def qsr_period(lr: float, alpha: float, h_base: int, power: float = 2.0) -> int:
    """QSR's round length at learning rate ``lr``: max(H0, floor((alpha / lr) ** power));
    ``alpha = 0``: H0. Never above :data:`MAX_PERIOD`."""
    if alpha == 0:
        return h_base
    if not lr > 0:
        return MAX_PERIOD
    try:
        x = (alpha / lr) ** power
    except OverflowError:
        return MAX_PERIOD
    if not math.isfinite(x) or x >= MAX_PERIOD:
        return MAX_PERIOD
    # (0.2 / 0.02) ** 2 is 99.99999999999997 in floating point: a relative 1e-9 keeps the
    # floor of an exact square where it belongs.
    return max(int(h_base), int(math.floor(x * (1 + 1e-9))))


def round_length(mode: SyncMode, schedule: LRSchedule, start: int, total: int) -> int:
    """Steps of the round starting at step ``start`` of a ``total``-step run (cut at the
    last step, so the run always ends with a sync)."""
    remaining = total - start
    if remaining <= 0:
        return 0
    if mode.kind == "ddp":
        h = 1
    elif mode.kind == "local":
        h = mode.period
    elif schedule.in_warmup(start):
        h = mode.period
    else:
        h = qsr_period(schedule.lr_at(start), mode.alpha, mode.period, mode.power)
    return max(1, min(h, remaining))


def rounds(mode: SyncMode, schedule: LRSchedule, total: int) -> list[tuple[int, int]]:
    """Every round of a run as (first step, length), in order (one item per round:
    :func:`round_count` counts them without the list)."""
    out = []
    s = 0
    while s < total:
        h = round_length(mode, schedule, s, total)
        out.append((s, h))
        s += h
    return out


def _length_at(mode: SyncMode, schedule: LRSchedule, start: int) -> int:
    """The length of a round starting at ``start``, before the cut at the run's end."""
    if mode.kind == "ddp":
        return 1
    if mode.kind == "local" or schedule.in_warmup(start):
        return mode.period
    return qsr_period(schedule.lr_at(start), mode.alpha, mode.period, mode.power)


def round_count(mode: SyncMode, schedule: LRSchedule, total: int) -> int:
    """``len(rounds(mode, schedule, total))`` without enumerating the rounds: a run of
    rounds of one length is counted at once. A round's length is non-decreasing in its
    start (H0 in the warm-up, then QSR's rule of a non-increasing learning rate), so the
    last start of each length is found by bisection: O(distinct lengths x log total), at
    most ~45,000 lengths for a run of :data:`~qsync_opt.core.limits.MAX_STEPS` steps."""
    n, s = 0, 0
    while s < total:
        h = _length_at(mode, schedule, s)
        lo, hi = s, total - 1  # the last start whose round is h steps long
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _length_at(mode, schedule, mid) <= h:
                lo = mid
            else:
                hi = mid - 1
        k = (lo - s) // h + 1
        n += k
        s += k * h
    return n


def sync_steps(mode: SyncMode, schedule: LRSchedule, total: int) -> list[int]:
    """The steps after whose optimizer step the replicas synchronise (each round's last)."""
    return [s + h - 1 for s, h in rounds(mode, schedule, total)]
