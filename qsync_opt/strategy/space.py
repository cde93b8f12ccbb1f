"""The strategy space a user allows (``--allow``) and the candidates in it.

``--allow`` is repeatable, one knob per item, values comma-separated:

``sync=ddp,local:2-8,qsr``
    ``ddp``; ``local:H`` or a range ``local:A-B`` (the powers of two from A to B, and A and
    B themselves); ``qsr:alpha=A,h_base=H0[,power=P]``, or bare ``qsr``: alpha twice the
    run's base learning rate (``--lr``), h_base 2, so that the round is 4 steps at the peak
    rate and grows as the rate decays (QSR's rule, :func:`qsync_opt.strategy.modes.qsr_period`).
``transport=fp32,fp16,dlcp:0.01-0.05``
    ``fp32`` (DDP's own all-reduce), ``fp16``, ``dlcp:P`` or ``dlcp:A-B`` (the bound p at A
    and at B), or any ``--comm`` form of dlcp (``dlcp:p=0.02,policy=random``).
``pipeline=1-4``
    stage counts (1: no pipeline), a single count or a range.

The default (no ``--allow``) is today's single strategy: ddp, fp32, no pipeline. A knob not
named keeps its default. Only combinations the runtime runs are candidates
(:data:`~qsync_opt.strategy.modes.COMPATIBLE`: a gradient transport needs ddp; a pipeline
runs ddp over fp32), each listed once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.limits import parse_float, parse_int
from qsync_opt.strategy.modes import (
    COMPATIBLE,
    MAX_DROP,
    MAX_PERIOD,
    parse_sync,
    parse_transport,
    transport_text,
)

__all__ = ["ALLOW_SYNTAX", "Candidate", "StrategySpace", "candidates", "parse_allow"]

ALLOW_SYNTAX = ("sync=ddp,local:H|local:A-B,qsr[:alpha=A,h_base=H0]; "
                "transport=fp32,fp16,dlcp:P|dlcp:A-B; pipeline=N|A-B (1: none)")
#: At most this many candidates in one search (a typo such as local:1-1000000 stays small:
#: its powers of two are 21).
MAX_CANDIDATES = 256
#: The most pipeline stages a search may consider (the runtime's limit).
MAX_STAGES = 64
#: Knobs and their defaults (today's strategy).
KNOBS = ("sync", "transport", "pipeline")


@dataclass(frozen=True)
class Candidate:
    """One strategy: a sync text, a transport text (as a plan writes them) and a number of
    pipeline stages (1: none)."""

    sync: str = "ddp"
    transport: str = "fp32"
    stages: int = 1

    @property
    def risk_rank(self) -> tuple[int, float, int, float]:
        """Ties between equally fast strategies go to the one that changes training least:
        ddp before Local SGD (shorter periods first) before QSR; fp32 before fp16 before
        dlcp (smaller bounds first); no pipeline first."""
        mode = parse_sync(self.sync)
        comm = parse_transport(self.transport)
        sync_rank = {"ddp": 0, "local": 1, "qsr": 2}[mode.kind]
        comm_rank = {"allreduce": 0, "fp16": 1, "dlcp": 2}[comm.kind]
        return (sync_rank * 10 + comm_rank, float(mode.period) + comm.p, self.stages, 0.0)

    def describe(self) -> str:
        pipe = "" if self.stages == 1 else f", {self.stages} stages"
        return f"{self.sync} / {self.transport}{pipe}"


@dataclass(frozen=True)
class StrategySpace:
    """The allowed values of each knob (texts as the plan writes them)."""

    sync: tuple[str, ...] = ("ddp",)
    transport: tuple[str, ...] = ("fp32",)
    stages: tuple[int, ...] = (1,)
    given: tuple[str, ...] = field(default=(), compare=False)

    @property
    def is_default(self) -> bool:
        return self.sync == ("ddp",) and self.transport == ("fp32",) and self.stages == (1,)

    def describe(self) -> str:
        return (f"sync={','.join(self.sync)} transport={','.join(self.transport)} "
                f"pipeline={','.join(map(str, self.stages))}")


def _range(text: str, knob: str, integer: bool) -> tuple[float, float]:
    lo_s, sep, hi_s = text.partition("-")
    parse = parse_int if integer else parse_float
    lo = parse(lo_s)
    hi = parse(hi_s) if sep else lo
    if lo is None or hi is None or not lo <= hi:
        raise QsyncInputError(f"allow: {knob}: expected a number or a range A-B (A <= B, "
                              f"ASCII digits), got {text!r}")
    return float(lo), float(hi)


def _periods(lo: float, hi: float) -> list[int]:
    if not 1 <= lo <= hi <= MAX_PERIOD:
        raise QsyncInputError(f"allow: sync: local's period must be from 1 to {MAX_PERIOD}, "
                              f"got {lo:g}-{hi:g}")
    out = {int(lo), int(hi)}
    p = 1
    while p <= hi:
        if p >= lo:
            out.add(p)
        p *= 2
    return sorted(out)


def _sync_values(value: str, lr: float) -> list[str]:
    v = value.strip().lower()
    if v == "qsr":
        return [parse_sync(f"qsr:alpha={2 * lr:g},h_base=2").describe()]
    if v.startswith("local:") and "-" in v:
        lo, hi = _range(v.partition(":")[2], "sync", integer=True)
        return [f"local:{h}" for h in _periods(lo, hi)]
    try:
        return [parse_sync(value).describe()]
    except QsyncInputError as exc:
        raise QsyncInputError(f"allow: sync: {str(exc).partition(': ')[2]}") from None


def _transport_values(value: str) -> list[str]:
    v = value.strip().lower()
    head, _, rest = v.partition(":")
    if head == "dlcp" and rest and "=" not in rest and "," not in rest:
        lo, hi = _range(rest, "transport", integer=False)
        if not 0 < lo <= hi <= MAX_DROP:
            raise QsyncInputError(f"allow: transport: dlcp's bound must be in (0, "
                                  f"{MAX_DROP:g}], got {rest!r}")
        return [transport_text(parse_transport(f"dlcp:p={p:g}")) for p in sorted({lo, hi})]
    try:
        return [transport_text(parse_transport(value))]
    except QsyncInputError as exc:
        raise QsyncInputError(f"allow: transport: {str(exc).partition(': ')[2]}") from None


def _stage_values(value: str) -> list[int]:
    lo, hi = _range(value.strip(), "pipeline", integer=True)
    if not 1 <= lo <= hi <= MAX_STAGES:
        raise QsyncInputError(f"allow: pipeline: stages must be from 1 (no pipeline) to "
                              f"{MAX_STAGES}, got {value.strip()!r}")
    return list(range(int(lo), int(hi) + 1))


def _split_values(text: str) -> list[str]:
    """``local:2-8,qsr:alpha=0.1,h_base=2,fp16`` -> items; a ``key=value`` after a qsr or
    dlcp item belongs to it."""
    out: list[str] = []
    for part in text.split(","):
        if "=" in part and out and out[-1].split(":")[0].strip().lower() in ("qsr", "dlcp") \
                and ":" in out[-1]:
            out[-1] += "," + part
        elif "=" in part and out and out[-1].strip().lower() in ("qsr", "dlcp"):
            out[-1] += ":" + part
        else:
            out.append(part)
    return [x for x in out if x.strip()]


def parse_allow(items: list[str] | None, *, lr: float = 0.05) -> StrategySpace:
    """``--allow`` items -> :class:`StrategySpace` (a bad item: one line naming it)."""
    if not items:
        return StrategySpace()
    values: dict[str, list[object]] = {}
    for item in items:
        knob, sep, text = item.partition("=")
        knob = knob.strip().lower()
        if not sep or knob not in KNOBS or not text.strip():
            raise QsyncInputError(f"allow: expected KNOB=VALUES with KNOB one of "
                                  f"{', '.join(KNOBS)} ({ALLOW_SYNTAX}), got {item!r}")
        if knob in values:
            raise QsyncInputError(f"allow: {knob} given twice (list its values in one item)")
        got: list[object] = []
        for v in _split_values(text):
            new = (_sync_values(v, lr) if knob == "sync" else _transport_values(v)
                   if knob == "transport" else _stage_values(v))
            got += [x for x in new if x not in got]
        values[knob] = got
    space = StrategySpace(
        sync=tuple(str(x) for x in values.get("sync", ["ddp"])),
        transport=tuple(str(x) for x in values.get("transport", ["fp32"])),
        stages=tuple(int(str(x)) for x in values.get("pipeline", [1])), given=tuple(items))
    n = len(candidates(space))
    if n == 0:
        raise QsyncInputError(
            f"allow: no strategy of {space.describe()} runs: a gradient transport other than "
            "fp32 needs sync ddp (Local SGD and QSR average FP32 parameters), and a pipeline "
            "runs ddp over fp32; allow ddp or fp32")
    if n > MAX_CANDIDATES:
        raise QsyncInputError(f"allow: {n} strategies; at most {MAX_CANDIDATES} (narrow a "
                              "range)")
    return space


def candidates(space: StrategySpace) -> list[Candidate]:
    """Every strategy of the space the runtime runs, in the order of :attr:`risk_rank`."""
    out: list[Candidate] = []
    for s in space.sync:
        kind = parse_sync(s).kind
        for t in space.transport:
            if not COMPATIBLE.get((kind, parse_transport(t).kind), False):
                continue
            for n in space.stages:
                if n > 1 and (kind != "ddp" or t != "fp32"):
                    continue
                out.append(Candidate(s, t, n))
    return sorted(out, key=lambda c: c.risk_rank)
