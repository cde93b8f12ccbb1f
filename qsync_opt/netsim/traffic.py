"""Collective traffic on the simulator: ring all-reduce, parameter server (incast),
hierarchical; one iteration's buckets emitted at their ready times; many seeded iterations.

A bucket is its FP32 gradient bytes in DDP's order (the model's last layers first), with the
layer each byte belongs to and that layer's position in the model (0: the first layer). A
packet's priority class is its layer's position (``floor(pos * classes)``: the front layers,
which the next forward needs first, highest), as DLCP ranks packets; the simulator has no
gradient values, so magnitude (the runtime's other term) does not enter here.

Patterns (every rank r is a host; ``ready_s[r][k]``: when rank r has bucket k):

- ``ring``: NCCL-style ring all-reduce, store-and-forward per step: the bucket in n chunks,
  2(n - 1) steps; rank r sends its step-s message to rank r+1 once it has received step s-1
  from rank r-1 (step 0: once bucket k is ready and rank r has finished bucket k-1).
- ``ps``: every rank pushes the whole bucket to one parameter server, which sends the sum
  back to every rank once all pushes have arrived (the push is the incast).
- ``hierarchical``: ranks on one leaf (node) send the bucket to their first rank, those
  leaders ring-all-reduce it, and each leader sends the sum back to its node's ranks.

Under the bounded-loss transport a message completes at ``(1 - p)`` of its packets; the
missing packets are zero-filled and counted as lost bytes of their layers.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from qsync_opt.netsim.engine import (
    DEFAULT_MAX_EVENTS,
    DEFAULT_MIN_RTO_MS,
    DETECT,
    Connection,
    Message,
    Sim,
)
from qsync_opt.netsim.topology import Topology
from qsync_opt.strategy.modes import NET_SCENARIOS

PATTERNS = ("ring", "ps", "hierarchical")
#: The fabrics a cluster's network is simulated on (:data:`qsync_opt.strategy.modes.NET_SCENARIOS`)
SCENARIOS = NET_SCENARIOS
# queue discipline + transport; the two mixed ones separate what each half does
POLICIES = {"fifo+tcp": ("fifo", None), "priority+bounded": ("priority", "bounded"),
            "fifo+bounded": ("fifo", "bounded"), "priority+tcp": ("priority", None)}


@dataclass(frozen=True)
class Bucket:
    """One gradient bucket: ``layers`` as (name, bytes, position in [0, 1]) in wire order."""

    layers: tuple[tuple[str, int, float], ...]

    @property
    def bytes(self) -> int:
        return sum(b for _, b, _ in self.layers)

    @functools.cached_property
    def _ends(self) -> list[int]:
        return list(itertools.accumulate(b for _, b, _ in self.layers))

    def layer_at(self, offset: int) -> int:
        """Index into :attr:`layers` of the byte at ``offset``."""
        return min(bisect.bisect_right(self._ends, offset), len(self.layers) - 1)


@dataclass(frozen=True)
class NetConfig:
    """How the network behaves: queues + transport (``policy``), routing, cells, TCP."""

    policy: str = "fifo+tcp"
    routing: str = "hash"
    p: float = 0.05
    cell_bytes: int = 64 << 10
    header_bytes: int = 40
    init_cwnd: int = 10
    min_rto_ms: float = DEFAULT_MIN_RTO_MS
    detect: str = "rack"
    classes: int = 8
    jitter: float = 0.0
    start_jitter_us: float = 0.0
    max_events: int = DEFAULT_MAX_EVENTS
    bin_us: float = 100.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: expected one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not 0 <= self.p < 1:
            raise ValueError(f"p: expected a fraction in [0, 1), got {self.p}")
        if self.cell_bytes < 1:
            raise ValueError(f"cell_bytes: expected >= 1, got {self.cell_bytes}")
        if self.detect not in DETECT:
            raise ValueError(f"detect: expected one of {', '.join(DETECT)}, got {self.detect!r}")
        if not self.jitter >= 0 or not self.start_jitter_us >= 0:
            raise ValueError("jitter, start_jitter_us: expected >= 0")

    @property
    def bounded(self) -> float | None:
        return self.p if POLICIES[self.policy][1] == "bounded" else None

    @property
    def queue(self) -> str:
        return POLICIES[self.policy][0]


@dataclass
class IterationResult:
    """One simulated iteration. Times in ms from the iteration's start."""

    bucket_end_ms: list[float]
    bucket_start_ms: list[float]
    ready_end_ms: float
    lost_bytes: dict[str, int]
    sent_bytes: dict[str, int]
    drops: int
    retransmits: int
    timeouts: int
    events: int
    link_bytes: list[int]
    link_busy_s: list[float]
    link_bins: list[dict[int, int]] = field(default_factory=list)
    #: (bucket, byte offset in the bucket's wire order, bytes) of every packet zero-filled
    lost_ranges: list[tuple[int, int, int]] = field(default_factory=list)
    #: (sending host, receiving host) of each of :attr:`lost_ranges`' packets, in order
    lost_ends: list[tuple[int, int]] = field(default_factory=list)

    @property
    def comm_end_ms(self) -> float:
        return max(self.bucket_end_ms) if self.bucket_end_ms else 0.0

    @property
    def exposed_ms(self) -> float:
        """Communication after the last gradient was ready."""
        return max(0.0, self.comm_end_ms - self.ready_end_ms)


def _prio(bucket: Bucket, classes: int, offset: int, cell: int) -> Callable[[int, int], int]:
    def f(i: int, n: int) -> int:
        pos = bucket.layers[bucket.layer_at(offset + i * cell)][2]
        return min(classes - 1, int(pos * classes))
    return f


class _Run:
    """The state of one iteration on one :class:`Sim`."""

    def __init__(self, sim: Sim, topo: Topology, ranks: Sequence[int], buckets: Sequence[Bucket],
                 cfg: NetConfig, leaders: dict[int, list[int]] | None = None,
                 ps: int | None = None) -> None:
        self.sim, self.topo, self.ranks, self.buckets, self.cfg = sim, topo, list(ranks), buckets, cfg
        self.n = len(self.ranks)
        self.ps = ps
        self.leaders = leaders or {}
        self.end_s = [0.0] * len(buckets)
        self.start_s = [math.inf] * len(buckets)
        self.msgs: list[tuple[int, int, int, Message]] = []  # (bucket, offset, bytes, message)
        self.ends: list[tuple[int, int]] = []  # (sender, receiver) of each of msgs

    def conn(self, a: int, b: int) -> Connection:
        cfg = self.cfg
        return self.sim.connection(a, b, mss=cfg.cell_bytes, header=cfg.header_bytes,
                                   init_cwnd=cfg.init_cwnd, min_rto_ms=cfg.min_rto_ms,
                                   bounded=cfg.bounded, detect=cfg.detect)

    def send(self, a: int, b: int, k: int, offset: int, nbytes: int,
             on_done: Callable[[float], None]) -> None:
        cfg = self.cfg
        self.start_s[k] = min(self.start_s[k], self.sim.now)
        prio = (_prio(self.buckets[k], cfg.classes, offset, cfg.cell_bytes)
                if cfg.queue == "priority" else None)
        m = self.conn(a, b).send(max(1, nbytes), prio=prio, on_done=on_done)
        self.msgs.append((k, offset, max(1, nbytes), m))
        self.ends.append((a, b))

    def finish(self, k: int, t: float) -> None:
        self.end_s[k] = max(self.end_s[k], t)


def _chunks(nbytes: int, n: int) -> list[tuple[int, int]]:
    base, rest = divmod(nbytes, n)
    out, off = [], 0
    for j in range(n):
        size = base + (1 if j < rest else 0)
        out.append((off, size))
        off += size
    return out


def _ring(run: _Run, members: list[int], k: int, start: Callable[[int, Callable[[], None]], None],
          done: Callable[[int, float], None]) -> None:
    """Ring all-reduce of bucket k over ``members`` (host ids); ``start(i, go)`` calls
    ``go()`` when member i may begin; ``done(i, t)`` when member i has the sum."""
    n = len(members)
    if n == 1:
        start(0, lambda: done(0, run.sim.now))
        return
    chunks = _chunks(run.buckets[k].bytes, n)
    steps = 2 * (n - 1)

    def step(i: int, s: int) -> None:
        j = (i - s) % n if s < n - 1 else (i + 1 - (s - (n - 1))) % n
        off, size = chunks[j]
        nxt = (i + 1) % n

        def arrived(t: float, nxt: int = nxt, s: int = s) -> None:
            if s + 1 < steps:
                step(nxt, s + 1)
            else:
                done(nxt, t)
        run.send(members[i], members[nxt], k, off, size, arrived)

    for i in range(n):
        start(i, functools.partial(step, i, 0))


def _jittered_ready(ready_ms: Sequence[Sequence[float]], cfg: NetConfig,
                    seed: int) -> list[list[float]]:
    """Each rank's bucket ready times in seconds, jittered (``cfg.jitter``, a relative
    Gaussian; ``cfg.start_jitter_us``, a uniform delay) and made non-decreasing."""
    rng = random.Random(seed * 7919 + 17)
    ready = []
    for row in ready_ms:
        prev, out = 0.0, []
        for t in row:
            t = t * (1 + cfg.jitter * rng.gauss(0.0, 1.0)) if cfg.jitter else t
            if cfg.start_jitter_us:
                t += rng.uniform(0.0, cfg.start_jitter_us) * 1e-3
            prev = max(prev, t, 0.0)
            out.append(prev * 1e-3)
        ready.append(out)
    return ready


class _Gates:
    """Member i may start bucket k once it is ready and it has finished bucket k-1."""

    def __init__(self, run: _Run, ready: list[list[float]], n: int, nb: int) -> None:
        self.run, self.ready = run, ready
        self.fin = [[False] * nb for _ in range(n)]
        self.waiting: dict[tuple[int, int], Callable[[], None]] = {}

    def gate(self, i: int, k: int, go: Callable[[], None]) -> None:
        def check() -> None:
            if k == 0 or self.fin[i][k - 1]:
                go()
            else:
                self.waiting[(i, k - 1)] = go
        self.run.sim.at(self.ready[i][k], check)

    def member_done(self, i: int, k: int, t: float) -> None:
        self.fin[i][k] = True
        self.run.finish(k, t)
        go = self.waiting.pop((i, k), None)
        if go is not None:
            go()


def _start_ring(run: _Run, gates: _Gates, ranks: Sequence[int], nb: int) -> None:
    """Every bucket a ring all-reduce over all the ranks."""
    n = len(ranks)
    for k in range(nb):
        def ring_start(i: int, go: Callable[[], None], k: int = k) -> None:
            gates.gate(i, k, go)

        def ring_done(i: int, t: float, k: int = k) -> None:
            gates.member_done(i, k, t)
        _ring(run, [ranks[i] for i in range(n)], k, ring_start, ring_done)


def _start_ps(run: _Run, gates: _Gates, ranks: Sequence[int], buckets: Sequence[Bucket],
              ps: int | None) -> None:
    """Every bucket pushed to the parameter server ``ps``, sent back once all have come."""
    if ps is None:
        raise ValueError("pattern ps: a parameter-server host is needed")
    n = len(ranks)
    for k in range(len(buckets)):
        count = [0]
        size = buckets[k].bytes

        def pushed(t: float, k: int = k, count: list[int] = count, size: int = size) -> None:
            count[0] += 1
            if count[0] == n:
                for i in range(n):
                    run.send(ps, ranks[i], k, 0, size, functools.partial(gates.member_done, i, k))
        for i in range(n):
            gates.gate(i, k, functools.partial(run.send, ranks[i], ps, k, 0, buckets[k].bytes,
                                               pushed))


def _start_hierarchical(run: _Run, gates: _Gates, ranks: Sequence[int],
                        buckets: Sequence[Bucket],
                        nodes: Sequence[Sequence[int]] | None) -> None:
    """Every bucket reduced to each node's leader, a ring over the leaders, then sent back
    to the node's members."""
    n = len(ranks)
    groups = [list(g) for g in (nodes or [list(range(n))])]
    index = {r: i for i, r in enumerate(ranks)}
    for k in range(len(buckets)):
        leaders = [g[0] for g in groups]
        reduced = [0] * len(groups)

        def at_leader(gi: int, go: Callable[[], None], k: int = k, reduced: list[int] = reduced
                      ) -> None:
            g = groups[gi]

            def one(*_: float) -> None:  # the leader's own bucket, then each member's
                reduced[gi] += 1
                if reduced[gi] == len(g):
                    go()
            gates.gate(index[g[0]], k, one)
            for h in g[1:]:
                gates.gate(index[h], k, functools.partial(run.send, h, g[0], k, 0,
                                                          buckets[k].bytes, one))

        def leader_done(gi: int, t: float, k: int = k) -> None:
            g = groups[gi]
            gates.member_done(index[g[0]], k, t)
            for h in g[1:]:
                run.send(g[0], h, k, 0, buckets[k].bytes,
                         functools.partial(gates.member_done, index[h], k))
        _ring(run, leaders, k, at_leader, leader_done)


def _losses(run: _Run, buckets: Sequence[Bucket], cell: int
            ) -> tuple[dict[str, int], dict[str, int], list[tuple[int, int, int]],
                       list[tuple[int, int]]]:
    """Per layer the bytes lost and sent, and each lost cell's (bucket, offset, bytes) and
    (sender, receiver)."""
    lost: dict[str, int] = {}
    sent: dict[str, int] = {}
    ranges: list[tuple[int, int, int]] = []
    ends: list[tuple[int, int]] = []
    for (k, off, nbytes, m), ab in zip(run.msgs, run.ends, strict=True):
        b = buckets[k]
        missing = set(m.missing)
        for q in range(m.first, m.first + m.n):
            i = q - m.first
            name = b.layers[b.layer_at(off + i * cell)][0]
            size = min(cell, nbytes - i * cell)
            sent[name] = sent.get(name, 0) + size
            if q in missing:
                lost[name] = lost.get(name, 0) + size
                ranges.append((k, off + i * cell, size))
                ends.append(ab)
    return lost, sent, ranges, ends


def simulate_iteration(topo: Topology, ranks: Sequence[int], buckets: Sequence[Bucket],
                       ready_ms: Sequence[Sequence[float]], cfg: NetConfig, *,
                       pattern: str = "ring", seed: int = 0, ps: int | None = None,
                       nodes: Sequence[Sequence[int]] | None = None,
                       keep_bins: bool = False) -> IterationResult:
    """One iteration: bucket k of rank r becomes ready at ``ready_ms[r][k]`` (ms); the
    collective named by ``pattern`` runs on ``topo`` under ``cfg``; seeded."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern: expected one of {', '.join(PATTERNS)}, got {pattern!r}")
    if len(ready_ms) != len(ranks) or any(len(r) != len(buckets) for r in ready_ms):
        raise ValueError("ready_ms: expected one row per rank, one time per bucket")
    sim = Sim(topo, queue=cfg.queue, routing=cfg.routing, seed=seed, classes=cfg.classes,
              bin_us=cfg.bin_us if keep_bins else None, max_events=cfg.max_events,
              cell_bytes=cfg.cell_bytes)
    ready = _jittered_ready(ready_ms, cfg, seed)
    run = _Run(sim, topo, ranks, buckets, cfg, ps=ps)
    n, nb = len(ranks), len(buckets)
    gates = _Gates(run, ready, n, nb)
    if pattern == "ring":
        _start_ring(run, gates, ranks, nb)
    elif pattern == "ps":
        _start_ps(run, gates, ranks, buckets, ps)
    else:
        _start_hierarchical(run, gates, ranks, buckets, nodes)
    sim.run()
    lost, sent, ranges, ends = _losses(run, buckets, cfg.cell_bytes)
    unfinished = [k for k in range(nb) if not all(gates.fin[i][k] for i in range(n))]
    if unfinished:
        raise RuntimeError(f"netsim: buckets {unfinished} never completed (a deadlock in the "
                           "pattern: please report it)")
    conns = list(sim.connections.values())
    return IterationResult(
        bucket_end_ms=[e * 1e3 for e in run.end_s],
        bucket_start_ms=[s * 1e3 if s < math.inf else 0.0 for s in run.start_s],
        ready_end_ms=max(max(r) for r in ready) * 1e3 if ready and nb else 0.0,
        lost_bytes=lost, sent_bytes=sent,
        drops=sum(c.dropped for c in conns), retransmits=sum(c.retransmits for c in conns),
        timeouts=sum(c.timeouts for c in conns), events=sim.events,
        link_bytes=[s.bytes for s in sim.stats], link_busy_s=[s.busy_s for s in sim.stats],
        link_bins=[s.bins for s in sim.stats] if keep_bins else [], lost_ranges=ranges,
        lost_ends=ends)


def quantile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile (linear interpolation; numpy's default)."""
    s = sorted(xs)
    if not s:
        raise ValueError("quantile of nothing")
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def layer_bytes(results: Sequence[IterationResult]) -> tuple[dict[str, int], dict[str, int]]:
    """(lost, sent) gradient bytes per layer, summed over ``results``."""
    lost: dict[str, int] = {}
    sent: dict[str, int] = {}
    for r in results:
        for k, v in r.lost_bytes.items():
            lost[k] = lost.get(k, 0) + v
        for k, v in r.sent_bytes.items():
            sent[k] = sent.get(k, 0) + v
    return lost, sent


def summarise(results: Sequence[IterationResult]) -> dict[str, Any]:
    """p50/p99 of the communication end and the exposed time over iterations, loss."""
    ends = [r.comm_end_ms for r in results]
    exp = [r.exposed_ms for r in results]
    lost = sum(sum(r.lost_bytes.values()) for r in results)
    sent = sum(sum(r.sent_bytes.values()) for r in results)
    return {"iterations": len(results),
            "comm_end_ms": {"p50": quantile(ends, 0.5), "p99": quantile(ends, 0.99),
                            "mean": statistics.fmean(ends)},
            "exposed_ms": {"p50": quantile(exp, 0.5), "p99": quantile(exp, 0.99)},
            "lost_fraction": lost / sent if sent else 0.0,
            "drops": sum(r.drops for r in results),
            "retransmits": sum(r.retransmits for r in results),
            "timeouts": sum(r.timeouts for r in results)}
