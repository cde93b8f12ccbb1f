"""A cluster's network and a workload's gradient traffic for the simulator; the replayer's
``--comm-model netsim:p50|p99``.

The fabric (:func:`cluster_network`): every device is a host; every node of a group is a
leaf switch with one link per device at the device's intra-node bandwidth (NVLink or PCIe,
half the cluster's intra-node hop latency each way); every leaf has one uplink to each of
``spines`` spine switches, the uplinks together carrying the cluster's inter-node
bandwidth (a node's NICs), half the inter-node hop latency each. One node alone has no
spines. Ranks are the groups' devices in order, node by node.

Scenarios: ``ring`` -- ring all-reduce in rank order (a ring hop leaves a node only at its
ends); ``incast`` -- a parameter server (its own leaf, one NIC of the inter-node bandwidth)
that every rank pushes each bucket to; ``oversubscribed`` -- ring all-reduce with the ranks
interleaved across nodes (as a scheduler placing ranks round-robin would), so every hop
crosses the fabric and each node's devices share its uplinks (devices-per-node flows on
them at once). ``hierarchical`` (a pattern, not a scenario of the CLI's three) is
available in :func:`run_iterations`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.costs.devices import get_device
from qsync_opt.costs.roofline import estimate
from qsync_opt.documents.schemas import ClusterSpec, CostTable, GradBucket, ModelGraph, Plan
from qsync_opt.netsim.engine import DEFAULT_MAX_EVENTS, NetsimLimit
from qsync_opt.netsim.topology import Topology
from qsync_opt.netsim.traffic import (
    POLICIES,
    SCENARIOS,
    Bucket,
    IterationResult,
    NetConfig,
    quantile,
    simulate_iteration,
)
from qsync_opt.replayer import Replayer
from qsync_opt.replayer.timeline import Timeline
from qsync_opt.strategy.modes import parse_transport

#: A plan as the replayer takes it: a Plan, or group -> op -> precision.
PlanLike = Plan | Mapping[str, Mapping[str, Precision | str]]

SCENARIO_PATTERN = {"ring": "ring", "incast": "ps", "oversubscribed": "ring"}
DEFAULT_BUFFER_BYTES = 4 << 20
#: the most devices a simulated cluster has (checked before anything is built: a ring over
#: n ranks is 2(n - 1) n messages per bucket, so far fewer already pass the event cap)
MAX_HOSTS = 4096
COMM_MODEL_HELP = ("analytic (the ring formula, default) or netsim:p50|p99[,scenario=ring|incast|"
                   "oversubscribed][,policy=fifo+tcp|priority+bounded|fifo+bounded|priority+tcp]"
                   "[,routing=hash|spray]"
                   "[,iterations=100][,cell_kib=256][,p=0.05][,seed=0]")


def limit_message(exc: NetsimLimit, cell: str, events: str | None) -> str:
    """``exc`` in a command's own names: ``cell`` (e.g. ``--cell-kib``), ``events`` (the
    event cap's flag, or None where it has none)."""
    sep = "" if cell.endswith("=") else " "
    fix = f"use {cell}{sep}{exc.cell_kib} or more" if exc.cell_kib else f"raise {cell}"
    return f"{exc.core}; {fix}" + (f", or raise {events}" if events else "")


@dataclass(frozen=True)
class Network:
    topo: Topology
    ranks: list[int]  # host id of each rank, in the pattern's order
    rank_group: list[int]  # each rank's group index (for ready times)
    nodes: list[list[int]]  # host ids per node (for the hierarchical pattern)
    ps: int | None


def check_hosts(cluster: ClusterSpec) -> None:
    """Refuse a cluster of more than :data:`MAX_HOSTS` devices, before any work."""
    if cluster.world_size > MAX_HOSTS:
        raise QsyncInputError(f"cluster: the packet simulator takes at most {MAX_HOSTS:,} "
                              f"devices, got {cluster.world_size:,}")


def cluster_network(cluster: ClusterSpec, scenario: str = "ring", *, spines: int = 2,
                    buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> Network:
    """The fabric of ``cluster`` and the rank order of ``scenario`` (module docstring)."""
    if scenario not in SCENARIOS:
        raise QsyncInputError(f"scenario: expected one of {', '.join(SCENARIOS)}, got {scenario!r}")
    check_hosts(cluster)
    t = Topology()
    hosts: list[int] = []
    groups: list[int] = []
    nodes: list[list[int]] = []
    node_bw: list[float] = []
    for gi, g in enumerate(cluster.groups):
        bw = (g.intra_node_bandwidth_gb_per_s if g.intra_node_bandwidth_gb_per_s is not None
              else get_device(g.device).intra_node_bandwidth_gb_per_s) * 8
        for j in range(g.count):
            if j % g.devices_per_node == 0:
                nodes.append([])
                node_bw.append(bw)
            h = t.host(f"{g.name}{j}")
            hosts.append(h)
            groups.append(gi)
            nodes[-1].append(h)
    ps = t.host("ps") if scenario == "incast" else None
    leaves = [t.switch(f"node{i}") for i in range(len(nodes))]
    multi = len(nodes) > 1 or ps is not None
    intra_us = cluster.intra_node_latency_us / 2
    inter_us = cluster.inter_node_latency_us / 2
    inter_gbps = cluster.inter_node_bandwidth_gb_per_s * 8
    for i, members in enumerate(nodes):
        for h in members:
            t.connect(h, leaves[i], node_bw[i], intra_us, buffer_bytes)
    if multi:
        sp = [t.switch(f"spine{s}") for s in range(spines)]
        uplinked = list(leaves)
        if ps is not None:
            xleaf = t.switch("psnode")
            t.connect(ps, xleaf, inter_gbps, intra_us, buffer_bytes)
            uplinked.append(xleaf)
        for leaf in uplinked:
            for s in sp:
                t.connect(leaf, s, inter_gbps / spines, inter_us, buffer_bytes)
    order = list(range(len(hosts)))
    if scenario == "oversubscribed" and len(nodes) > 1:
        where = {h: (ni, j) for ni, members in enumerate(nodes) for j, h in enumerate(members)}
        order.sort(key=lambda r: (where[hosts[r]][1], where[hosts[r]][0]))
    return Network(topo=t, ranks=[hosts[r] for r in order], rank_group=[groups[r] for r in order],
                   nodes=nodes, ps=ps)


def workload_buckets(graph: ModelGraph, buckets: Sequence[GradBucket],
                     itemsize: int = 4) -> list[Bucket]:
    """The cost table's DDP buckets with each op's gradient bytes on the wire (FP32: 4 bytes
    an element; an fp16 transport: 2) and its position."""
    index = {op.name: i for i, op in enumerate(graph.ops)}
    last = max(1, len(graph.ops) - 1)
    out = []
    for b in buckets:
        layers = tuple((name, graph.ops[index[name]].param_count * itemsize, index[name] / last)
                       for name in b.ops if graph.ops[index[name]].param_count > 0)
        if not layers:
            layers = ((b.ops[0], max(1, b.bytes), index.get(b.ops[0], 0) / last),)
        out.append(Bucket(layers))
    return out


def estimate_events(net: Network, buckets: Sequence[Bucket], pattern: str, cell: int) -> int:
    """An upper estimate of the events one iteration takes (packets x hops x 2, plus acks)."""
    n = len(net.ranks)
    total = sum(b.bytes for b in buckets)
    if pattern == "ring":
        wire = 2 * (n - 1) * total  # every rank sends 2(n-1)/n of each bucket
        msgs = 2 * (n - 1) * n * len(buckets)
    else:
        wire = 2 * n * total
        msgs = 2 * n * len(buckets)
    packets = wire / cell + msgs
    return int(packets * (2 * 4 + 1))


def check_events(net: Network, buckets: Sequence[Bucket], pattern: str, cfg: NetConfig) -> None:
    est = estimate_events(net, buckets, pattern, cfg.cell_bytes)
    if est > cfg.max_events:
        need = cfg.cell_bytes * est / cfg.max_events
        suggest = 1 << max(10, math.ceil(math.log2(need)) - 10) if need > 0 else 1
        raise NetsimLimit(
            f"netsim: an iteration needs about {est:,} events at a {cfg.cell_bytes >> 10} KiB "
            f"cell, above the cap of {cfg.max_events:,}", suggest)


def group_ready_ms(graph: ModelGraph, cluster: ClusterSpec, costs: CostTable,
                   plan: PlanLike | None = None, optimizer: str = "sgd"
                   ) -> tuple[list[list[float]], Timeline]:
    """Each group's bucket ready times (ms) from the replayer's compute timeline of ``plan``
    (default: every group at its highest precision) and that timeline."""
    rep = Replayer(graph, cluster, costs, optimizer=optimizer)
    tl = rep.simulate(plan if plan is not None else rep.uniform("highest"), events=False)
    return tl.bucket_ready_ms, tl


def run_iterations(net: Network, buckets: Sequence[Bucket], group_ready: Sequence[Sequence[float]],
                   cfg: NetConfig, *, pattern: str, iterations: int, seed: int = 0,
                   keep_bins: bool = False) -> list[IterationResult]:
    """``iterations`` seeded iterations (seed, seed + 1, ...); ready times per rank from its
    group's row (jittered per iteration by ``cfg.jitter``)."""
    if iterations < 1:
        raise QsyncInputError(f"iterations: expected >= 1, got {iterations}")
    check_events(net, buckets, pattern, cfg)
    ready = [list(group_ready[g]) for g in net.rank_group]
    return [simulate_iteration(net.topo, net.ranks, buckets, ready, cfg, pattern=pattern,
                               seed=seed + i, ps=net.ps, nodes=net.nodes,
                               keep_bins=keep_bins and i == 0)
            for i in range(iterations)]


def params_bucket(numels: Sequence[int]) -> Bucket:
    """One bucket of FP32 parameters ``numels`` (the model's order), in DDP's wire order
    (last parameter first); layer names are the parameter indices."""
    last = max(1, len(numels) - 1)
    return Bucket(tuple((str(i), int(numels[i]) * 4, i / last)
                        for i in range(len(numels) - 1, -1, -1)))


#: DDP's bucket sizes (torch's defaults: the first bucket 1 MiB, then 25 MiB each)
DDP_FIRST_BUCKET_BYTES = 1 << 20
DDP_BUCKET_BYTES = 25 << 20


def ddp_buckets(numels: Sequence[int], cap: int = DDP_BUCKET_BYTES,
                first: int = DDP_FIRST_BUCKET_BYTES) -> list[Bucket]:
    """FP32 parameters ``numels`` (the model's order) in DDP's buckets: last parameter
    first, a bucket closed once it holds ``first`` (the first) or ``cap`` bytes; layer names
    are the parameter indices (as :func:`params_bucket`, which is one bucket of them all)."""
    last = max(1, len(numels) - 1)
    out: list[Bucket] = []
    cur: list[tuple[str, int, float]] = []
    size, limit = 0, first
    for i in range(len(numels) - 1, -1, -1):
        cur.append((str(i), int(numels[i]) * 4, i / last))
        size += int(numels[i]) * 4
        if size >= limit:
            out.append(Bucket(tuple(cur)))
            cur, size, limit = [], 0, cap
    if cur:
        out.append(Bucket(tuple(cur)))
    return out


def rank_cluster(cluster: ClusterSpec, rank_groups: Sequence[str]) -> tuple[ClusterSpec, list[int]]:
    """The part of ``cluster`` a training run's ranks use (each group cut to its ranks'
    count) and each rank's device index in it (its group's devices in rank order)."""
    counts: dict[str, int] = {}
    for g in rank_groups:
        counts[g] = counts.get(g, 0) + 1
    known = {g.name for g in cluster.groups}
    bad = sorted(set(counts) - known)
    if bad:
        raise QsyncInputError(f"rank_groups: the cluster has no group {bad[0]!r}")
    groups = [g.model_copy(update={"count": counts[g.name]}) for g in cluster.groups
              if counts.get(g.name)]
    start: dict[str, int] = {}
    acc = 0
    for grp in groups:
        start[grp.name] = acc
        acc += grp.count
    seen: dict[str, int] = {}
    device = []
    for name in rank_groups:
        device.append(start[name] + seen.get(name, 0))
        seen[name] = seen.get(name, 0) + 1
    return cluster.model_copy(update={"groups": groups}), device


def param_bucket_ready_ms(graph: ModelGraph, cluster: ClusterSpec, names: Sequence[str],
                          buckets: Sequence[Bucket], plan: PlanLike | None = None
                          ) -> list[list[float]]:
    """Per group of ``cluster``, per bucket of ``buckets`` (:func:`ddp_buckets`: layer names
    are indices into the parameter names ``names``): when the backward has computed its
    last gradient (ms), on the replayer's compute timeline of ``plan`` (default, or a plan
    of another graph: every group at its highest precision). A parameter's gradient is
    ready when the backward of its op ends (the op: the longest dotted prefix of its name
    that names one of ``graph``'s ops); one no op claims, at the end of the backward."""
    cl = cluster.with_default_batch(graph.batch_size)
    rep = Replayer(graph, cl, _estimate(graph, cl))
    mine = plan is not None and getattr(plan, "graph_hash", None) == graph.structure_hash()
    tl = rep.simulate(plan if mine and plan is not None else rep.uniform("highest"),
                      events=True)
    out = []
    for g in cl.groups:
        done = {e.name: e.end_ms for e in tl.events if e.group == g.name and e.kind == "bwd"}
        end = max(done.values(), default=0.0)

        def ready(name: str, done: dict[str, float] = done, end: float = end) -> float:
            parts = name.split(".")
            for k in range(len(parts) - 1, 0, -1):
                t = done.get(".".join(parts[:k]))
                if t is not None:
                    return t
            return done.get(name, end)
        out.append([max(ready(names[int(i)]) for i, _, _ in b.layers) for b in buckets])
    return out


def _estimate(graph: ModelGraph, cluster: ClusterSpec) -> CostTable:
    return estimate(graph, cluster)


@dataclass(frozen=True)
class CommModelSpec:
    """A ``--comm-model`` text: ``analytic`` or ``netsim:QUANTILE,...``."""

    kind: str = "analytic"
    quantile: float = 0.5
    scenario: str = "ring"
    config: NetConfig = NetConfig(cell_bytes=256 << 10)
    iterations: int = 100
    seed: int = 0

    def describe(self) -> str:
        if self.kind == "analytic":
            return "analytic ring all-reduce"
        c = self.config
        return (f"netsim p{round(self.quantile * 100)} of {self.iterations} iterations, "
                f"{self.scenario}, {c.policy}" + (f" p={c.p:g}" if c.bounded else "")
                + f", {c.routing}, {c.cell_bytes >> 10} KiB cells")


def parse_comm_model(text: str | None) -> CommModelSpec:
    if text is None or text.strip() in ("", "analytic"):
        return CommModelSpec()
    head, _, rest = text.strip().partition(",")
    kind, _, q = head.partition(":")
    if kind != "netsim" or q not in ("p50", "p99"):
        raise QsyncInputError(f"comm-model: expected {COMM_MODEL_HELP}, got {text!r}")
    fields: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, sep, val = item.partition("=")
        if not sep or key in fields:
            raise QsyncInputError(f"comm-model: {item!r} is not KEY=VALUE (once each); "
                                  f"expected {COMM_MODEL_HELP}")
        fields[key] = val
    known = {"scenario", "policy", "routing", "iterations", "cell_kib", "p", "seed"}
    bad = sorted(set(fields) - known)
    if bad:
        raise QsyncInputError(f"comm-model: unknown key {bad[0]!r}; expected {COMM_MODEL_HELP}")
    scenario = fields.get("scenario", "ring")
    if scenario not in SCENARIOS:
        raise QsyncInputError(f"comm-model: scenario: expected one of {', '.join(SCENARIOS)}, "
                              f"got {scenario!r}")
    policy = fields.get("policy", "fifo+tcp")
    if policy not in POLICIES:
        raise QsyncInputError(f"comm-model: policy: expected one of {', '.join(POLICIES)}, "
                              f"got {policy!r}")
    routing = fields.get("routing", "hash")
    if routing not in ("hash", "spray"):
        raise QsyncInputError(f"comm-model: routing: expected hash or spray, got {routing!r}")

    def number(key: str, default: float, lo: float, hi: float, integer: bool) -> float:
        raw = fields.get(key)
        if raw is None:
            return default
        try:
            v = int(raw) if integer else float(raw)
        except ValueError:
            v = math.nan
        if not (lo <= v <= hi):
            raise QsyncInputError(f"comm-model: {key}: expected a number in [{lo:g}, {hi:g}], "
                                  f"got {raw!r}")
        return v
    iterations = int(number("iterations", 100, 1, 100_000, True))
    cell = int(number("cell_kib", 256, 1, 1 << 20, True)) << 10
    p = number("p", 0.05, 0, 0.5, False)
    seed = int(number("seed", 0, 0, 2**31 - 1, True))
    cfg = NetConfig(policy=policy, routing=routing, p=p, cell_bytes=cell,
                    max_events=DEFAULT_MAX_EVENTS)
    return CommModelSpec(kind="netsim", quantile=0.5 if q == "p50" else 0.99, scenario=scenario,
                         config=cfg, iterations=iterations, seed=seed)


def bucket_times_ms(graph: ModelGraph, cluster: ClusterSpec, costs: CostTable,
                    spec: CommModelSpec, itemsize: int = 4) -> list[float]:
    """Per bucket, the quantile over iterations of the time it adds to the communication
    when every bucket is ready at once and they run in order (the replayer's serial bucket
    stream): bucket k's share is its end minus bucket k-1's end."""
    cl = cluster.with_default_batch(graph.batch_size)
    check_hosts(cl)
    net = cluster_network(cl, spec.scenario)
    buckets = workload_buckets(graph, costs.buckets, itemsize)
    zero = [[0.0] * len(buckets) for _ in cl.groups]
    runs = run_iterations(net, buckets, zero, spec.config, pattern=SCENARIO_PATTERN[spec.scenario],
                          iterations=spec.iterations, seed=spec.seed)
    out = []
    for k in range(len(buckets)):
        shares = [r.bucket_end_ms[k] - (r.bucket_end_ms[k - 1] if k else 0.0) for r in runs]
        out.append(max(0.0, quantile(shares, spec.quantile)))
    return out


def with_netsim_comm(graph: ModelGraph, cluster: ClusterSpec, costs: CostTable,
                     spec: CommModelSpec, itemsize: int = 4) -> CostTable:
    """``costs`` with every bucket's all-reduce time from the simulator (``spec``), the
    gradients sent at ``itemsize`` bytes an element (4: FP32; 2: an fp16 transport)."""
    if spec.kind == "analytic" or cluster.world_size <= 1 or not costs.buckets:
        return costs
    try:
        times = bucket_times_ms(graph, cluster, costs, spec, itemsize)
    except NetsimLimit as exc:
        raise QsyncInputError("comm-model: " + limit_message(exc, "cell_kib=", None)) from None
    except QsyncInputError as exc:
        raise QsyncInputError(f"comm-model: {exc}") from None
    buckets = [b.model_copy(update={"allreduce_ms": t})
               for b, t in zip(costs.buckets, times, strict=True)]
    note = (f"bucket all-reduce times from the packet simulator: {spec.describe()} (the "
            f"analytic ring gave {sum(b.allreduce_ms for b in costs.buckets):.3f} ms in all, "
            f"the simulator {sum(times):.3f} ms)")
    return costs.model_copy(update={"buckets": buckets, "notes": [*costs.notes, note]})



def transport_costs(graph: ModelGraph, cluster: ClusterSpec, costs: CostTable,
                    transport: str, spec: CommModelSpec) -> CostTable:
    """``costs`` with every DDP bucket priced for ``transport``: fp16 sends 2 bytes an
    element; under the packet simulator a dlcp transport runs its bounded-loss priority
    queues at its bound p (the analytic ring loses nothing, so dlcp costs what fp32 does)."""
    comm = parse_transport(transport)
    itemsize = 2 if comm.kind == "fp16" else 4
    if spec.kind == "analytic":
        if itemsize == 4:
            return costs
        buckets = [b.model_copy(update={"allreduce_ms": costs.comm.allreduce_ms(b.bytes // 2)})
                   for b in costs.buckets]
        return costs.model_copy(update={"buckets": buckets})
    if comm.kind == "dlcp":
        spec = dataclasses.replace(spec, config=dataclasses.replace(
            spec.config, policy="priority+bounded", p=comm.p))
    return with_netsim_comm(graph, cluster.with_default_batch(graph.batch_size), costs, spec,
                            itemsize)


__all__ = ["COMM_MODEL_HELP", "DDP_BUCKET_BYTES", "DDP_FIRST_BUCKET_BYTES", "MAX_HOSTS", "SCENARIOS", "SCENARIO_PATTERN", "CommModelSpec", "Network", "transport_costs",
           "bucket_times_ms", "check_events", "check_hosts", "cluster_network", "limit_message", "ddp_buckets", "rank_cluster", "params_bucket", "estimate_events", "param_bucket_ready_ms",
           "group_ready_ms", "parse_comm_model", "run_iterations",
           "with_netsim_comm", "workload_buckets"]
