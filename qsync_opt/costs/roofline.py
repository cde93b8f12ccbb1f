"""Cost estimates: ModelGraph + ClusterSpec -> CostTable, from a roofline over the catalog.

Per device type, per-device batch, op and precision::

    t = max(FLOPs / (peak[compute dtype] * eff_compute), bytes / (bandwidth * eff_memory))
        + launch overhead

FLOPs and activation bytes scale linearly with the batch from the traced graph (parameter
bytes do not). Backward runs the op's backward FLOPs at its backward compute dtype and moves
twice its forward bytes (read the output gradient and the saved input, write the input
gradient and the FP32 weight gradient). A cast of ``numel`` elements costs ``a * numel + b``
with ``a`` the bytes read and written over the effective bandwidth and ``b`` one launch; a
quantization (to int8, int4 or fp8) costs ``quantize_cast_factor`` casts (abs-max pass and scale,
QSync's "about 5x"). Gradients are FP32 and bucketed like DDP (a 1 MiB first bucket, then
``bucket_cap_bytes``, in reverse order of first use), each bucket a ring all-reduce over the
whole cluster through its bottleneck link.

The efficiencies are named defaults (:class:`~qsync_opt.documents.schemas.Efficiencies`, provenance in
docs/COSTS.md), overridable per call; for a measured device (the ``cpu`` entry, whose peaks
are the rates torch achieved here) compute and memory efficiencies are 1. Every entry says
``source="estimated"``; the profiler (measurement issue) writes the same schema with
``source="measured"``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from qsync_opt.core.precision import ACTIVATION_DTYPES, DType, Precision
from qsync_opt.costs.devices import get_device
from qsync_opt.costs.rules import PASS_PRECISION, allowed_on
from qsync_opt.documents.schemas import (
    CastCost,
    ClusterSpec,
    CommModel,
    CostTable,
    DeviceSpec,
    Efficiencies,
    GradBucket,
    ModelGraph,
    OpCost,
    OpNode,
    OpRole,
    OptimizerCost,
)

log = logging.getLogger(__name__)

MiB = 1024**2
DDP_BUCKET_CAP_BYTES = 25 * MiB  # torch DDP bucket_cap_mb default
DDP_FIRST_BUCKET_BYTES = 1 * MiB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
#: FP32 bytes read+written per parameter by one optimizer step (w, g, state in; w, state out).
OPTIMIZER_BYTES_PER_PARAM = {"sgd": 5 * 4, "adam": 7 * 4}
OPTIMIZER_STATE_BYTES_PER_PARAM = {"sgd": 4, "adam": 8}


class _Roofline:
    def __init__(self, dev: DeviceSpec, eff: Efficiencies) -> None:
        self.dev = dev
        self.eff = eff
        measured = dev.measured
        self.mem_bps = dev.memory_bandwidth_gb_per_s * 1e9 * (1.0 if measured else eff.memory)
        self.launch_ms = eff.launch_overhead_us * 1e-3
        self.measured = measured

    def compute_eff(self, dtype: DType) -> float:
        if self.measured:
            return 1.0
        if dtype == DType.fp32:
            return self.eff.fp32_gemm
        if dtype in (DType.int8, DType.int4):  # the integer tensor-core path, one efficiency
            return self.eff.int8_gemm
        return self.eff.tensor_core_gemm

    def rate(self, dtype: DType) -> float:
        """FLOP/s of a compute dtype: the runtime's recorded rate on this card where the
        catalog has one (already an achieved rate: no efficiency), else peak x efficiency."""
        got = None if self.measured else self.dev.runtime_flops(dtype)
        return got if got is not None else self.dev.peak_flops(dtype) * self.compute_eff(dtype)

    def ms(self, flops: float, nbytes: float, dtype: DType, kernels: int = 1) -> float:
        if flops <= 0 and nbytes <= 0:
            return 0.0
        t_compute = flops / self.rate(dtype) if flops else 0.0
        t_memory = nbytes / self.mem_bps
        return max(t_compute, t_memory) * 1e3 + kernels * self.launch_ms


def op_precisions(op: OpNode, dev: DeviceSpec) -> list[Precision]:
    if op.role == OpRole.choosable:
        return allowed_on(op, dev.precisions)
    if op.role == OpRole.pinned:
        return list(op.allowed_precisions)
    # Pass-through and promoting ops run in whatever float dtype reaches them.
    return [PASS_PRECISION[d] for d in ACTIVATION_DTYPES if dev.supports(PASS_PRECISION[d])]


def _op_cost(op: OpNode, p: Precision, scale: float, roof: _Roofline) -> tuple[float, float]:
    """(fwd_ms, bwd_ms) of ``op`` at precision ``p`` with activations scaled by ``scale``."""
    info = p.info
    weight_numel = 0
    if op.weight_shape is not None:
        weight_numel = 1
        for s in op.weight_shape:
            weight_numel *= s
    if op.role == OpRole.choosable:
        in_size, out_size = info.takes_in.itemsize, info.gives_out.itemsize
        w_size = (info.weight_dtype or DType.fp32).itemsize
    else:
        in_size = out_size = info.gives_out.itemsize
        w_size = 4
    act_bytes = (op.input_numel * in_size + op.output_numel * out_size) * scale
    fwd_bytes = act_bytes + weight_numel * w_size
    fwd_flops = op.fwd_flops * scale
    bwd_flops = op.bwd_flops * scale
    fwd_kernels = 1 if (fwd_flops or fwd_bytes) else 0
    fwd = roof.ms(fwd_flops, fwd_bytes, info.fwd_compute, fwd_kernels) if op.fwd_bytes else 0.0
    if op.bwd_flops == 0 and op.role != OpRole.choosable:
        # Reshapes and ops without inputs needing grad: backward is a view or nothing.
        return fwd, 0.0
    n_bwd_kernels = 2 if (op.role == OpRole.choosable and op.needs_input_grad) else 1
    bwd = roof.ms(bwd_flops, 2 * fwd_bytes, info.bwd_compute, n_bwd_kernels)
    return fwd, bwd


def cast_pairs(dev: DeviceSpec) -> list[tuple[DType, DType]]:
    floats = [d for d in ACTIVATION_DTYPES if dev.supports(PASS_PRECISION[d])]
    pairs = [(a, b) for a in floats for b in floats if a != b]
    if dev.supports(Precision.int8):
        pairs += [(a, DType.int8) for a in floats]
    if dev.supports(Precision.int4):
        pairs += [(a, DType.int4) for a in floats]
    if dev.supports(Precision.fp8):
        pairs += [(a, DType.fp8_e4m3) for a in floats] + [(a, DType.fp8_e5m2) for a in floats]
    return pairs


def _comm_model(cluster: ClusterSpec, eff: Efficiencies) -> CommModel:
    if cluster.nodes > 1:
        bw = cluster.inter_node_bandwidth_gb_per_s
        latency = cluster.inter_node_latency_us
        where = f"inter-node link ({bw:g} GB/s per direction, {cluster.nodes} nodes)"
    else:
        g = min(cluster.groups, key=lambda x: _intra_bw(x.device, x.intra_node_bandwidth_gb_per_s))
        bw = _intra_bw(g.device, g.intra_node_bandwidth_gb_per_s)
        latency = cluster.intra_node_latency_us
        where = f"intra-node link of group {g.name} ({bw:g} GB/s per direction)"
    return CommModel(world_size=cluster.world_size, bandwidth_gb_per_s=bw * eff.network,
                     latency_us=latency, bottleneck=where, source="estimated")


def _intra_bw(device: str, override: float | None) -> float:
    return override if override is not None else get_device(device).intra_node_bandwidth_gb_per_s


def gradient_buckets(graph: ModelGraph, comm: CommModel,
                     bucket_cap_bytes: int = DDP_BUCKET_CAP_BYTES,
                     first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES) -> list[GradBucket]:
    """DDP's bucketing: FP32 gradients in reverse order of first use, first bucket 1 MiB."""
    buckets: list[GradBucket] = []
    cur_ops: list[str] = []
    cur_bytes = 0
    cap = min(first_bucket_bytes, bucket_cap_bytes)
    for op in reversed(graph.ops):
        if op.param_count == 0:
            continue
        cur_ops.append(op.name)
        cur_bytes += op.param_count * 4
        if cur_bytes >= cap:
            buckets.append(GradBucket(index=len(buckets), ops=cur_ops, bytes=cur_bytes,
                                      allreduce_ms=comm.allreduce_ms(cur_bytes)))
            cur_ops, cur_bytes, cap = [], 0, bucket_cap_bytes
    if cur_ops:
        buckets.append(GradBucket(index=len(buckets), ops=cur_ops, bytes=cur_bytes,
                                  allreduce_ms=comm.allreduce_ms(cur_bytes)))
    return buckets


def estimate(
    graph: ModelGraph,
    cluster: ClusterSpec,
    *,
    efficiencies: Efficiencies | None = None,
    batches: Iterable[int] = (),
    bucket_cap_bytes: int = DDP_BUCKET_CAP_BYTES,
) -> CostTable:
    """Roofline estimates for every (device type, per-device batch) of ``cluster``.

    Groups without a per-device batch use the graph's traced batch. ``batches`` adds more
    per-device batches for every device type (for batch-split studies).
    """
    eff = efficiencies or Efficiencies()
    cluster = cluster.with_default_batch(graph.batch_size)
    wanted: dict[str, set[int]] = {}
    for g in cluster.groups:
        wanted.setdefault(g.device, set()).add(int(g.batch_per_device or graph.batch_size))
    for b in batches:
        for dev_batches in wanted.values():
            dev_batches.add(int(b))
    entries: list[OpCost] = []
    casts: list[CastCost] = []
    optimizer: list[OptimizerCost] = []
    for device, dev_batches in wanted.items():
        dev = get_device(device)
        roof = _Roofline(dev, eff)
        for b in sorted(dev_batches):
            scale = b / graph.batch_size
            for op in graph.ops:
                for p in op_precisions(op, dev):
                    fwd, bwd = _op_cost(op, p, scale, roof)
                    entries.append(OpCost(device=device, batch_size=b, op=op.name, precision=p,
                                          fwd_ms=fwd, bwd_ms=bwd, source="estimated"))
        for src, dst in cast_pairs(dev):
            a = (src.itemsize + dst.itemsize) / roof.mem_bps * 1e3
            if dst in (DType.int8, DType.int4, DType.fp8_e4m3, DType.fp8_e5m2):
                a *= eff.quantize_cast_factor
            casts.append(CastCost(device=device, src=src, dst=dst, a_ms_per_element=a,
                                  b_ms=roof.launch_ms, source="estimated"))
        for kind, per_param in OPTIMIZER_BYTES_PER_PARAM.items():
            ms = graph.param_count * per_param / roof.mem_bps * 1e3 + roof.launch_ms
            optimizer.append(OptimizerCost(
                device=device, optimizer=kind, ms=ms,
                state_bytes=graph.param_count * OPTIMIZER_STATE_BYTES_PER_PARAM[kind]))
    comm = _comm_model(cluster, eff)
    buckets = gradient_buckets(graph, comm, bucket_cap_bytes)
    notes = [
        "roofline estimates from catalog datasheet peaks (dense) and DRAM bandwidth, scaled by "
        "the efficiencies recorded here; not measurements",
    ]
    if any(get_device(d).measured for d in wanted):
        notes.append("cpu: peaks are torch's achieved matmul rates on this machine, so its "
                     "compute and memory efficiencies are 1")
    return CostTable(
        workload=graph.workload, graph_hash=graph.structure_hash(), entries=entries,
        casts=casts, comm=comm, buckets=buckets, bucket_cap_bytes=bucket_cap_bytes,
        optimizer=optimizer, efficiencies=eff, notes=notes,
    )


def group_summary(graph: ModelGraph, cluster: ClusterSpec, costs: CostTable,
                  optimizer: str = "sgd") -> list[dict[str, float | int | str]]:
    """Per group: compute time at FP32 and the per-op fastest precisions, comm, memory.

    Serial sums of the table, for people: the replayer (next stage) overlaps communication
    with backward and adds casts; "fastest" ignores casts, so it is a lower bound.
    """
    cluster = cluster.with_default_batch(graph.batch_size)
    table = costs.lookup()
    comm_ms = sum(b.allreduce_ms for b in costs.buckets)
    rows: list[dict[str, float | int | str]] = []
    for g in cluster.groups:
        dev = get_device(g.device)
        b = int(g.batch_per_device or graph.batch_size)
        ref = fast = 0.0
        for op in graph.ops:
            opts = [table[(g.device, b, op.name, p)] for p in op_precisions(op, dev)
                    if (g.device, b, op.name, p) in table]
            if not opts:
                continue
            fp32 = next((c for c in opts if c.precision == Precision.fp32), opts[0])
            ref += fp32.fwd_ms + fp32.bwd_ms
            fast += min(c.fwd_ms + c.bwd_ms for c in opts)
        opt = next(o for o in costs.optimizer if o.device == g.device and o.optimizer == optimizer)
        act = graph.saved_activation_bytes * b / graph.batch_size
        mem = graph.param_bytes * 2 + opt.state_bytes + act
        rows.append({
            "group": g.name, "device": g.device, "count": g.count, "batch_per_device": b,
            "compute_fp32_ms": ref, "compute_fastest_ms": fast, "allreduce_ms": comm_ms,
            "optimizer_ms": opt.ms, "memory_fp32_bytes": int(mem),
            "capacity_bytes": dev.usable_memory_bytes,
        })
    return rows
