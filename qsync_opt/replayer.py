"""Replayer: simulate one mixed-precision hybrid data-parallel iteration.

QSync's predictor of time and memory (docs/PAPERS.md, QSync replayer paragraph). For every device
group of the cluster (all devices of a group run the same plan, so one represents it):

* **Dtype flow** (the neighbourhood-aware cost mapper). A choosable op at precision ``p``
  takes in ``p.takes_in`` and gives out ``p.gives_out``; pinned ops take and give fp32;
  pass-through ops (relu, dropout, pooling, reshapes) carry their input's dtype; promoting
  ops (add, cat) run in the widest float input dtype, as autocast promotes (fp16 with bf16
  gives fp32). Only floating edges carry dtypes.
* **Casts.** Where an edge's producer gives out a dtype its consumer does not take in, a
  cast of that tensor runs before the consumer's forward (a quantization, with its abs-max
  pass, when the target is int8 or fp8). In backward the consumer's input gradient has its
  backward dtype and is cast back to the producer's dtype when they differ. Every
  low-precision op casts its FP32 master weight once per iteration and casts its weight
  gradient back to FP32; int8_full and fp8 ops quantize their incoming output gradient.
  Choosable ops reading the model input cast it from fp32.
* **Compute.** One compute stream per device: forward in topological order, backward in
  reverse, each op at its CostTable entry for that device, per-device batch and precision.
* **Communication** behind :class:`SyncModel`. :class:`AllReduceSync` is DDP: FP32 gradient
  buckets in reverse order of first use, each a ring all-reduce over the whole cluster that
  starts when the slowest group has the bucket ready and the previous bucket is done. The
  iteration ends, per group, when its backward and all buckets are done and its optimizer
  step has run; the iteration time is the latest group's end.
* **Memory** per device: FP32 weights, FP32 gradients, optimizer state, low-precision weight
  copies, activations saved for backward at their chosen dtypes (a low-precision op saves
  its own cast copy; without a cast it shares its producer's tensor), the largest single op's
  working set, and a context reserve.

Two implementations answer the same question. :meth:`Replayer.simulate` is an event loop
that builds every event (the oracle, and the source of traces). :class:`IncrementalReplay`
keeps per-op forward/backward items in Fenwick trees, so changing one op's precision
re-costs only the op, the ops its output dtype flows through and their consumers, and
re-schedules the few buckets: the greedy allocator's "what if" in well under a millisecond.
Tests hold the two equal.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .costs import DDP_BUCKET_CAP_BYTES, gradient_buckets
from .devices import get_device
from .errors import QsyncInputError
from .precision import DType, Precision
from .schemas import ClusterSpec, CostTable, ModelGraph, OpKind, OpRole, Plan

log = logging.getLogger(__name__)

MiB = 1024**2
#: Reserve per GPU for the CUDA context and library workspaces (cuBLAS/cuDNN handles). A
#: default, not a measurement: drivers report 300-500 MiB of context on recent GPUs.
DEFAULT_CONTEXT_BYTES = 512 * MiB

_FLOAT = {"float32": DType.fp32, "float16": DType.fp16, "bfloat16": DType.bf16,
          "float64": DType.fp32}
_DTYPE_PRECISION = {DType.fp32: Precision.fp32, DType.fp16: Precision.fp16,
                    DType.bf16: Precision.bf16}
#: Dtype of the input gradient an op produces in backward, per precision.
GRAD_DTYPE = {
    Precision.fp32: DType.fp32, Precision.tf32: DType.fp32, Precision.bf16: DType.bf16,
    Precision.fp16: DType.fp16, Precision.int8: DType.fp16, Precision.int8_full: DType.fp16,
    Precision.fp8: DType.bf16,
}


def widest(dtypes: Sequence[DType]) -> DType:
    """Autocast's promotion among float dtypes: fp32 if any, or if fp16 meets bf16."""
    kinds = set(dtypes)
    if not kinds:
        return DType.fp32
    if len(kinds) == 1:
        return next(iter(kinds))
    return DType.fp32


# ----------------------------------------------------------------------------- sync models


@dataclass(frozen=True)
class SyncSchedule:
    """When each gradient bucket's communication starts and ends (ms from iteration start)."""

    start_ms: list[float]
    end_ms: list[float]

    @property
    def comm_end_ms(self) -> float:
        return self.end_ms[-1] if self.end_ms else 0.0


class SyncModel(Protocol):
    """How groups synchronise gradients. Local SGD, pipeline transfers and packet-level
    networks plug in here with the same inputs: per-group bucket ready times."""

    name: str

    def schedule(self, ready_ms: Sequence[Sequence[float]], bucket_ms: Sequence[float]) -> SyncSchedule:
        """``ready_ms[g][k]``: when group g has bucket k's gradients; ``bucket_ms[k]``: its cost."""
        ...


@dataclass(frozen=True)
class AllReduceSync:
    """DDP: bucket k starts when every group has it ready and bucket k-1 is done."""

    name: str = "allreduce"

    def schedule(self, ready_ms: Sequence[Sequence[float]], bucket_ms: Sequence[float]) -> SyncSchedule:
        start: list[float] = []
        end: list[float] = []
        prev = 0.0
        for k, cost in enumerate(bucket_ms):
            s = max(prev, max(r[k] for r in ready_ms))
            start.append(s)
            prev = s + cost
            end.append(prev)
        return SyncSchedule(start, end)


# ----------------------------------------------------------------------------- results


@dataclass(slots=True)
class Event:
    group: str
    stream: str  # "compute" or "comm"
    kind: str  # fwd, bwd, cast, weight_cast, grad_cast, allreduce, optimizer
    name: str
    start_ms: float
    dur_ms: float
    args: dict[str, Any] | None = None

    @property
    def end_ms(self) -> float:
        return self.start_ms + self.dur_ms


@dataclass
class GroupTimeline:
    name: str
    device: str
    batch_per_device: int
    forward_ms: float
    backward_ms: float
    cast_ms: float
    n_casts: int
    optimizer_ms: float
    end_ms: float
    exposed_comm_ms: float  # communication after the slowest group's backward ended
    straggler_wait_ms: float  # this group idle, waiting for the slowest group's compute
    memory: dict[str, int]
    peak_memory_bytes: int
    capacity_bytes: int

    @property
    def compute_ms(self) -> float:
        """Forward plus backward, casts included."""
        return self.forward_ms + self.backward_ms

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.capacity_bytes


@dataclass
class Timeline:
    """One simulated iteration: per-group times and memory, buckets, critical path, events."""

    iteration_ms: float
    groups: dict[str, GroupTimeline]
    bucket_start_ms: list[float]
    bucket_end_ms: list[float]
    critical_path: list[dict[str, Any]]
    events: list[Event] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return all(g.fits for g in self.groups.values())

    @property
    def straggler(self) -> str:
        """The group whose iteration ends last (``end_ms``: its compute, waits, exposed
        all-reduce and optimizer step); among groups ending within 1e-9 of the last, the one
        with the most compute. The one definition the report and the demo use too."""
        last = max(g.end_ms for g in self.groups.values())
        ending = [g for g in self.groups.values() if g.end_ms >= last - 1e-9 * max(last, 1.0)]
        return max(ending, key=lambda g: g.compute_ms).name

    def summary(self) -> dict[str, Any]:
        """JSON-able summary (no events)."""
        return {
            "iteration_ms": self.iteration_ms,
            "fits": self.fits,
            "straggler": self.straggler,
            "groups": {
                n: {
                    "device": g.device, "batch_per_device": g.batch_per_device,
                    "compute_ms": g.compute_ms, "forward_ms": g.forward_ms,
                    "backward_ms": g.backward_ms, "cast_ms": g.cast_ms, "n_casts": g.n_casts,
                    "optimizer_ms": g.optimizer_ms, "end_ms": g.end_ms,
                    "exposed_comm_ms": g.exposed_comm_ms,
                    "straggler_wait_ms": g.straggler_wait_ms,
                    "peak_memory_bytes": g.peak_memory_bytes,
                    "capacity_bytes": g.capacity_bytes, "fits": g.fits, "memory": g.memory,
                }
                for n, g in self.groups.items()
            },
            "buckets": [{"start_ms": s, "end_ms": e}
                        for s, e in zip(self.bucket_start_ms, self.bucket_end_ms, strict=True)],
            "critical_path": self.critical_path,
            "notes": self.notes,
        }

    def chrome_trace(self) -> dict[str, Any]:
        """Chrome/Perfetto trace: a process per group, threads for compute and comm."""
        pids = {name: i + 1 for i, name in enumerate(self.groups)}
        tids = {"compute": 1, "comm": 2}
        out: list[dict[str, Any]] = []
        for name, pid in pids.items():
            g = self.groups[name]
            out.append({"ph": "M", "pid": pid, "name": "process_name",
                        "args": {"name": f"{name} ({g.device}, batch {g.batch_per_device})"}})
            for stream, tid in tids.items():
                out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                            "args": {"name": stream}})
        for ev in self.events:
            item = {"ph": "X", "pid": pids[ev.group], "tid": tids[ev.stream], "name": ev.name,
                    "cat": ev.kind, "ts": ev.start_ms * 1e3, "dur": ev.dur_ms * 1e3}
            if ev.kind in ("cast", "weight_cast", "grad_cast"):
                item["cname"] = "terrible"  # casts stand out in red
            if ev.args:
                item["args"] = ev.args
            out.append(item)
        return {"traceEvents": out, "displayTimeUnit": "ms",
                "otherData": {"iteration_ms": self.iteration_ms}}

    def chrome_trace_json(self) -> str:
        return json.dumps(self.chrome_trace())


# ----------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class _Group:
    name: str
    device: str
    batch: int
    scale: float
    capacity: int
    fwd: list[dict[Precision, float]]
    bwd: list[dict[Precision, float]]
    casts: dict[tuple[DType, DType], tuple[float, float]]
    optimizer_ms: float
    optimizer_state_bytes: int
    menu: frozenset[Precision]


class Replayer:
    """Prepared simulation of one (graph, cluster, costs): build once, replay many plans.

    ``optimizer`` is ``"sgd"`` (momentum) or ``"adam"``; ``sync`` the synchronisation model
    (DDP all-reduce by default); ``bucket_cap_bytes`` re-buckets the gradients (default: the
    CostTable's buckets); ``context_bytes`` is reserved per GPU device (0 on the CPU).
    """

    def __init__(
        self,
        graph: ModelGraph,
        cluster: ClusterSpec,
        costs: CostTable,
        *,
        optimizer: str = "sgd",
        sync: SyncModel | None = None,
        bucket_cap_bytes: int | None = None,
        context_bytes: int = DEFAULT_CONTEXT_BYTES,
        enforce_ties: bool = True,
    ) -> None:
        if costs.graph_hash != graph.structure_hash():
            raise QsyncInputError(
                f"costs: made for graph {costs.graph_hash}, not this graph "
                f"({graph.structure_hash()}, {graph.workload})")
        if optimizer not in ("sgd", "adam"):
            raise QsyncInputError(f"optimizer: expected sgd or adam, got {optimizer!r}")
        self.graph = graph
        self.enforce_ties = enforce_ties  # False: tie groups are advisory (calls of one module stay tied)
        self.cluster = cluster.with_default_batch(graph.batch_size)
        self.costs = costs
        #: False for tables profiled on qsync-opt's runtime (``activation_flow="fp32"``): its
        #: layers cast in and out, so activations stay fp32 and casts are inside op costs.
        self.native_flow = costs.activation_flow == "native"
        #: The runtime's per-step bookkeeping collectives (tables profiled on it): a 32-byte
        #: all-reduce of the step's statistics before the optimizer, and a broadcast of the
        #: buffers after it (qsync_opt.runtime.train). Zero for one rank and for estimates.
        comm = costs.comm
        self.stats_sync_ms = 0.0 if self.native_flow else comm.allreduce_ms(32)
        self.buffer_sync_ms = (0.0 if self.native_flow or not graph.buffer_bytes
                               else comm.broadcast_ms(graph.buffer_bytes))
        self.step_sync_ms = self.stats_sync_ms + self.buffer_sync_ms
        self.optimizer = optimizer
        self.sync: SyncModel = sync or AllReduceSync()
        ops = graph.ops
        self.ops = ops
        self.n = len(ops)
        self.index = {o.name: i for i, o in enumerate(ops)}
        self.role = [o.role for o in ops]
        # Float edges only: (producer index, numel) per consumer; consumers per producer.
        self.in_edges: list[list[tuple[int, int]]] = [[] for _ in ops]
        self.out_edges: list[list[int]] = [[] for _ in ops]
        for e in graph.edges:
            if not e.is_float:
                continue
            u, v = self.index[e.src], self.index[e.dst]
            self.in_edges[v].append((u, e.numel))
            self.out_edges[u].append(v)
        self.weight_numel = []
        for o in ops:
            n = 0
            if o.weight_shape is not None:
                n = 1
                for s in o.weight_shape:
                    n *= s
            self.weight_numel.append(n)
        # Gradient buckets: the op indices whose gradients each bucket holds.
        buckets = costs.buckets if bucket_cap_bytes is None else gradient_buckets(
            graph, costs.comm, bucket_cap_bytes)
        self.bucket_cap_bytes = bucket_cap_bytes or costs.bucket_cap_bytes or DDP_BUCKET_CAP_BYTES
        for k, b in enumerate(buckets):  # a cost table is a data file: check what it names
            unknown = next((n for n in b.ops if n not in self.index), None)
            if unknown is not None or not b.ops:
                raise QsyncInputError(
                    f"costs: buckets.{k}.ops "
                    + (f"names op {unknown!r}, which graph {graph.workload!r} lacks"
                       if unknown is not None else "is empty")
                    + " (the table was made for another graph)")
        self.bucket_ops = [[self.index[n] for n in b.ops] for b in buckets]
        self.bucket_first = [min(ix) for ix in self.bucket_ops]  # its last gradient ready
        self.bucket_ms = [b.allreduce_ms for b in buckets]
        self.groups = [self._prepare_group(g) for g in self.cluster.groups]
        self.context = {g.name: (context_bytes if get_device(g.device).compute_capability else 0)
                        for g in self.cluster.groups}
        self.grads = self._module_grads()
        #: How many memory terms :meth:`_mem_terms` gives per op on this flow.
        self.n_mem_terms = 3 if self.native_flow else 4

    def _prepare_group(self, g: Any) -> _Group:
        dev = get_device(g.device)
        b = int(g.batch_per_device or self.graph.batch_size)
        fwd: list[dict[Precision, float]] = [dict() for _ in self.ops]
        bwd: list[dict[Precision, float]] = [dict() for _ in self.ops]
        found = False
        for c in self.costs.entries:
            if c.device == g.device and c.batch_size == b:
                i = self.index.get(c.op)
                if i is not None:
                    fwd[i][c.precision] = c.fwd_ms
                    bwd[i][c.precision] = c.bwd_ms
                    found = True
        if not found:
            have = sorted({(c.device, c.batch_size) for c in self.costs.entries})
            raise QsyncInputError(
                f"costs: no entries for group {g.name} (device {g.device}, batch {b}); the "
                f"table has {', '.join(f'{d}@{x}' for d, x in have)} (estimate with batches=[{b}])")
        casts = {(c.src, c.dst): (c.a_ms_per_element, c.b_ms)
                 for c in self.costs.casts if c.device == g.device}
        opt = next((o for o in self.costs.optimizer
                    if o.device == g.device and o.optimizer == self.optimizer), None)
        if opt is None:
            raise QsyncInputError(f"costs: no {self.optimizer} optimizer cost for {g.device}")
        return _Group(name=g.name, device=g.device, batch=b, scale=b / self.graph.batch_size,
                      capacity=dev.usable_memory_bytes, fwd=fwd, bwd=bwd, casts=casts,
                      optimizer_ms=opt.ms, optimizer_state_bytes=opt.state_bytes,
                      menu=frozenset(dev.precisions))

    # ------------------------------------------------------------------ plan handling

    def precisions_for(self, plan: Plan | Mapping[str, Mapping[str, Precision | str]]
                       ) -> list[list[Precision | None]]:
        """Validate a plan and return, per group, each op's precision (None: not choosable).

        Choosable ops the plan leaves out run at fp32. Refused: an op the graph lacks, a
        pinned op set to anything but its pin, a precision the op or the card cannot run,
        tied ops with different precisions.
        """
        if isinstance(plan, Plan):
            if plan.graph_hash != self.graph.structure_hash():
                raise QsyncInputError(
                    f"plan: made for graph {plan.graph_hash} ({plan.workload}), not "
                    f"{self.graph.structure_hash()} ({self.graph.workload})")
            table = {name: gp.precisions for name, gp in plan.groups.items()}
        else:
            table = {name: dict(v) for name, v in plan.items()}
        unknown_groups = set(table) - {g.name for g in self.groups}
        if unknown_groups:
            raise QsyncInputError(
                f"plan: no group {', '.join(sorted(unknown_groups))} in the cluster "
                f"(groups: {', '.join(g.name for g in self.groups)})")
        out: list[list[Precision | None]] = []
        for grp in self.groups:
            row: list[Precision | None] = [
                Precision.fp32 if r == OpRole.choosable else None for r in self.role]
            for name, value in table.get(grp.name, {}).items():
                i = self.index.get(name)
                if i is None:
                    raise QsyncInputError(
                        f"plan: group {grp.name} names op {name!r}, which graph "
                        f"{self.graph.workload} lacks")
                try:
                    p = Precision(value)
                except ValueError:
                    raise QsyncInputError(
                        f"plan: group {grp.name}, op {name}: unknown precision {value!r}") from None
                op = self.ops[i]
                allowed = [q for q in op.allowed_precisions if q in grp.menu]
                if op.role != OpRole.choosable:
                    if op.role == OpRole.pinned and p in op.allowed_precisions:
                        continue
                    raise QsyncInputError(
                        f"plan: group {grp.name}, op {name} is {op.role.value}"
                        + (f" ({op.pin_reason})" if op.pin_reason else "")
                        + f"; its precision cannot be set to {p.value}")
                if p not in allowed:
                    raise QsyncInputError(
                        f"plan: group {grp.name} ({grp.device}), op {name}: {p.value} is not "
                        f"allowed; allowed: {', '.join(q.value for q in allowed)}")
                row[i] = p
            ties: dict[str, tuple[str, Precision]] = {}
            for i, op in enumerate(self.ops):
                if op.tie_group and row[i] is not None and (
                        self.enforce_ties or op.tie_group.startswith("module:")):
                    seen = ties.setdefault(op.tie_group, (op.name, row[i]))  # type: ignore[arg-type]
                    if seen[1] != row[i]:
                        raise QsyncInputError(
                            f"plan: group {grp.name}: ops {seen[0]} and {op.name} share tie group "
                            f"{op.tie_group} but get {seen[1].value} and {row[i].value}")  # type: ignore[union-attr]
            out.append(row)
        return out

    def uniform(self, choose: str = "highest") -> dict[str, dict[str, Precision]]:
        """Every group at its highest (or lowest, by fidelity) precision on every op."""
        from .precision import PRECISION_INFO

        plan: dict[str, dict[str, Precision]] = {}
        for grp in self.groups:
            row = {}
            for op in self.ops:
                if op.role != OpRole.choosable:
                    continue
                allowed = [q for q in op.allowed_precisions if q in grp.menu]
                ranked = sorted(allowed, key=lambda q: PRECISION_INFO[q].rank)
                row[op.name] = ranked[-1] if choose == "highest" else ranked[0]
            plan[grp.name] = row
        return plan

    # ------------------------------------------------------------------ shared rules

    def _dtypes(self, prec: Sequence[Precision | None]) -> tuple[list[DType], list[DType]]:
        """(dtype each op takes in, dtype it gives out) for one group's precisions."""
        n = self.n
        din: list[DType] = [DType.fp32] * n
        dout: list[DType] = [DType.fp32] * n
        for i in range(n):
            din[i], dout[i] = self._op_dtypes(i, prec, dout)
        return din, dout

    def takes_in(self, p: Precision) -> DType:
        """The dtype an op at ``p`` takes on its activation edges (fp32 in the fp32 flow)."""
        return p.info.takes_in if self.native_flow else DType.fp32

    def gives_out(self, p: Precision) -> DType:
        """The dtype an op at ``p`` gives out (fp32 in the fp32 flow)."""
        return p.info.gives_out if self.native_flow else DType.fp32

    def _op_dtypes(self, i: int, prec: Sequence[Precision | None],
                   dout: Sequence[DType]) -> tuple[DType, DType]:
        role = self.role[i]
        p = prec[i]
        if p is not None:
            return self.takes_in(p), self.gives_out(p)
        if role == OpRole.pinned:
            return DType.fp32, DType.fp32
        ins = [dout[u] for u, _ in self.in_edges[i]]
        if not ins:
            return DType.fp32, DType.fp32
        d = ins[0] if role == OpRole.pass_through else widest(ins)
        return d, d

    def _cast_ms(self, grp: _Group, src: DType, dst: DType, numel: float) -> float:
        if src == dst or numel <= 0:
            return 0.0
        ab = grp.casts.get((src, dst))
        if ab is None:  # e.g. bf16 -> fp8_e5m2 not tabled: go through fp32
            a1 = grp.casts.get((src, DType.fp32))
            a2 = grp.casts.get((DType.fp32, dst))
            if a1 is None or a2 is None:
                raise QsyncInputError(
                    f"costs: no cast model {src.value} -> {dst.value} for {grp.device}")
            return a1[0] * numel + a1[1] + a2[0] * numel + a2[1]
        return ab[0] * numel + ab[1]

    def _compute_ms(self, grp: _Group, i: int, prec: Precision | None, d: DType
                    ) -> tuple[float, float]:
        key = prec if prec is not None else _DTYPE_PRECISION.get(d, Precision.fp32)
        if self.role[i] == OpRole.pinned:
            key = self.ops[i].allowed_precisions[0]
        try:
            return grp.fwd[i][key], grp.bwd[i][key]
        except KeyError:
            raise QsyncInputError(
                f"costs: no {key.value} entry for op {self.ops[i].name} on {grp.device} at "
                f"batch {grp.batch}") from None

    def _op_items(self, grp: _Group, i: int, prec: Sequence[Precision | None],
                  din: Sequence[DType], dout: Sequence[DType],
                  edges: Sequence[tuple[int, int]] | None = None,
                  ) -> tuple[list[tuple[str, str, float, dict[str, Any] | None]],
                             list[tuple[str, str, float, dict[str, Any] | None]]]:
        """Forward and backward work items of op i: (kind, name, ms, args).

        ``edges`` restricts the per-input-edge casts to those edges (default: all of op i's
        float in-edges); the items are additive over edges, which the linear model of
        :mod:`qsync_opt.problem` uses to split an op's cost into per-edge pair terms.
        """
        op = self.ops[i]
        p = prec[i]
        fwd_items: list[tuple[str, str, float, dict[str, Any] | None]] = []
        bwd_items: list[tuple[str, str, float, dict[str, Any] | None]] = []
        takes = din[i]
        if edges is None:
            edges = self.in_edges[i]
        if not self.native_flow:
            # Profiled on the runtime: the op's casts (input, weight, output, gradients) are
            # inside its measured cost.
            f_ms, b_ms = self._compute_ms(grp, i, p, dout[i])
            fwd_items.append(("fwd", op.name, f_ms, {"precision": (p or _DTYPE_PRECISION.get(
                dout[i], Precision.fp32)).value}))
            bwd_items.append(("bwd", op.name, b_ms, None))
            return fwd_items, bwd_items
        if p is not None and not self.in_edges[i] and op.input_numel:
            # A choosable op on the model input: the input arrives in fp32.
            ms = self._cast_ms(grp, DType.fp32, takes, op.input_numel * grp.scale)
            if ms:
                fwd_items.append(("cast", f"cast input fp32->{takes.value} > {op.name}", ms,
                                  {"numel": op.input_numel * grp.scale}))
        for u, numel in edges:
            src = dout[u]
            if src != takes and (p is not None or self.role[i] == OpRole.pinned
                                 or self.role[i] == OpRole.promote):
                ms = self._cast_ms(grp, src, takes, numel * grp.scale)
                fwd_items.append(("cast", f"cast {src.value}->{takes.value} "
                                  f"{self.ops[u].name} > {op.name}", ms,
                                  {"numel": numel * grp.scale}))
        wdt = p.info.weight_dtype if p is not None else None
        wn = self.weight_numel[i]
        if wdt is not None and wn:
            fwd_items.append(("weight_cast", f"weight fp32->{wdt.value} {op.name}",
                              self._cast_ms(grp, DType.fp32, wdt, wn), {"numel": wn}))
        f_ms, b_ms = self._compute_ms(grp, i, p, dout[i])
        fwd_items.append(("fwd", op.name, f_ms, {"precision": (p or _DTYPE_PRECISION.get(
            dout[i], Precision.fp32)).value}))
        # Backward: quantize the output gradient (int8_full, fp8), the op, weight gradient
        # back to FP32, then input gradients cast to what each producer gives out.
        if p is not None and p.info.bwd_compute in (DType.int8, DType.fp8_e5m2):
            bwd_items.append(("grad_cast", f"grad {p.info.gives_out.value}->"
                              f"{p.info.bwd_compute.value} {op.name}",
                              self._cast_ms(grp, p.info.gives_out, p.info.bwd_compute,
                                            op.output_numel * grp.scale), None))
        bwd_items.append(("bwd", op.name, b_ms, None))
        if wdt is not None and wn:
            gdt = GRAD_DTYPE[p]  # type: ignore[index]
            ms = self._cast_ms(grp, gdt, DType.fp32, wn)
            if ms:
                bwd_items.append(("grad_cast", f"weight grad {gdt.value}->fp32 {op.name}", ms,
                                  None))
        if b_ms > 0 or p is not None:
            gin = GRAD_DTYPE[p] if p is not None else takes
            for u, numel in edges:
                if dout[u] != gin:
                    ms = self._cast_ms(grp, gin, dout[u], numel * grp.scale)
                    bwd_items.append(("cast", f"grad cast {gin.value}->{dout[u].value} "
                                      f"{op.name} > {self.ops[u].name}", ms,
                                      {"numel": numel * grp.scale}))
        return fwd_items, bwd_items

    def _runtime_memory(self, grp: _Group, i: int, p: Precision | None
                        ) -> tuple[float, float, float, float]:
        """Op i on qsync-opt's runtime layers (the fp32 flow): (saved bytes, weight-copy bytes,
        forward transient, backward transient), as the runtime really allocates them.

        Measured against the exact allocator trace (:mod:`qsync_opt.runtime.memory`): an fp32
        op saves what the trace measured (shared storage once); a bf16/fp16 layer saves new
        16-bit copies of its inputs and weight; an int8 Linear/Conv2d saves its int8 input and
        weight with their scales, and its forward holds the int32 accumulator (a conv also the
        fp32 and int8 im2col columns); an int8 or fp8 attention matmul fake-quantizes, so it
        saves fp32 copies. Transients are what lives only while the op runs (its output, input
        gradient, accumulators, 16-bit gradient copies).
        """
        op = self.ops[i]
        s = grp.scale
        wn = self.weight_numel[i]
        inb = op.input_numel * 4 * s
        outb = op.output_numel * 4 * s
        gin = inb if op.needs_input_grad else 0.0
        if p is None or p in (Precision.fp32, Precision.tf32):
            return op.unique_saved_bytes * s, 0.0, inb + outb, outb + gin
        if p in (Precision.bf16, Precision.fp16):
            return (op.saved_bytes * s / 2, 2.0 * wn, inb + 1.5 * outb,
                    1.5 * outb + 1.5 * gin + 2 * wn)
        if p in (Precision.int8, Precision.int8_full) and op.kind != OpKind.matmul \
                and op.weight_shape:
            cout = op.weight_shape[0]
            fwd = inb + 2 * outb
            if op.kind == OpKind.conv and len(op.weight_shape) == 4:
                cols = op.output_numel * s / cout * (op.weight_shape[1] * op.weight_shape[2]
                                                     * op.weight_shape[3])
                fwd = max(inb + 9 * cols, inb + cols + 3 * outb)
            return (op.saved_bytes * s / 4 + 4, wn + 4.0 * cout, fwd,
                    1.5 * outb + inb / 2 + 1.5 * gin + 4 * wn)
        if p == Precision.fp8:
            return op.saved_bytes * s, 4.0 * wn, inb + 2 * outb, outb + gin
        return op.saved_bytes * s, 0.0, inb + outb, outb + gin  # int8 matmul: fp32 copies

    def _module_grads(self) -> list[float]:
        """Per op, the fp32 gradient bytes it brings into being in backward: a module's
        gradient once, at its first call (the runtime's timeline)."""
        grads = [0.0] * self.n
        seen: set[str] = set()
        for i, op in enumerate(self.ops):
            if op.module_name not in seen:
                seen.add(op.module_name)
                grads[i] = op.param_count * 4.0
        return grads

    def _mem_terms(self, grp: _Group, i: int, prec: Sequence[Precision | None],
                   din: Sequence[DType], dout: Sequence[DType]) -> tuple[float, ...]:
        """Op i's memory terms, the input of :meth:`_memory`: (saved, weight copy, working
        set) on the native flow; (saved, weight copy, forward transient, backward transient)
        on the fp32 flow (:meth:`_runtime_memory`)."""
        if self.native_flow:
            return self._op_memory(grp, i, prec, din, dout)
        return self._runtime_memory(grp, i, prec[i])

    def _memory(self, grp: _Group, cols: Sequence[Sequence[float]]) -> dict[str, int]:
        """A group's memory components at its peak from every op's terms, column-wise
        (``cols[c][i]`` is term c of op i, :meth:`_mem_terms`).

        The one memory computation: :meth:`simulate` and :class:`IncrementalReplay` both
        call it, so they report the same bytes on both flows. Native flow: a sum (every
        saved activation and weight copy, plus the largest working set). fp32 flow: the
        runtime's timeline, :meth:`_runtime_peak`.
        """
        if not self.native_flow:
            return self._runtime_peak(grp, cols)
        saved, wcopy, work = cols
        mem = self._static_memory(grp)
        mem["weight_copies"] = int(sum(wcopy))
        mem["activations"] = int(sum(saved))
        mem["workspace"] = int(max(work, default=0.0))
        return mem

    def _runtime_peak(self, grp: _Group, cols: Sequence[Sequence[float]]) -> dict[str, int]:
        """Memory components at the peak of one step on the runtime (the fp32 flow), from
        the ops' :meth:`_runtime_memory` terms, column-wise.

        A timeline, not a sum: in forward, op i holds the activations and weight copies saved
        up to it plus its transient; in backward (gradients set to None before the step, as
        the runtime does) op i holds what was saved up to it, the fp32 gradients of the ops
        from i on, and its transient. The peak is the largest of these.
        """
        saved, wcopy, fwd_t, bwd_t = cols
        grads = self.grads
        best = (-1.0, 0.0, 0.0, 0.0, 0.0)  # total, activations, copies, grads, workspace
        acts = copies = 0.0
        for a, w, f in zip(saved, wcopy, fwd_t, strict=True):
            acts += a
            copies += w
            if acts + copies + f > best[0]:
                best = (acts + copies + f, acts, copies, 0.0, f)
        g_after = 0.0
        for i in range(self.n - 1, -1, -1):
            g_after += grads[i]
            b = bwd_t[i]
            total = acts + copies + g_after + b
            if total > best[0]:
                best = (total, acts, copies, g_after, b)
            acts -= saved[i]
            copies -= wcopy[i]
        mem = self._static_memory(grp)
        mem["grads_fp32"] = int(best[3])
        mem["weight_copies"] = int(best[2])
        mem["activations"] = int(best[1])
        mem["workspace"] = int(best[4])
        return mem

    def _op_memory(self, grp: _Group, i: int, prec: Sequence[Precision | None],
                   din: Sequence[DType], dout: Sequence[DType]) -> tuple[float, float, float]:
        """(saved activation bytes, low-precision weight copy bytes, working-set bytes)."""
        op = self.ops[i]
        p = prec[i]
        if not self.native_flow:
            saved, wcopy, f, b = self._runtime_memory(grp, i, p)
            return saved, wcopy, max(f, b)
        s = grp.scale
        if p is not None:
            kept = p.info.saved_dtype
        elif self.role[i] == OpRole.pinned:
            kept = DType.fp32
        else:
            kept = dout[i]
        # A cast on the way in makes a new tensor, which the op saves on its own; without
        # one it saves its producer's tensor, shared as the trace measured.
        edges = self.in_edges[i]
        if not self.native_flow:
            # The runtime's layer casts its fp32 input itself: a new tensor when p is not fp32.
            cast_in = p is not None and p.info.takes_in != DType.fp32
        elif edges:
            cast_in = any(dout[u] != din[i] for u, _ in edges)
        else:
            cast_in = p is not None and din[i] != DType.fp32
        base = op.saved_bytes if cast_in else op.unique_saved_bytes
        saved = base * kept.itemsize / 4 * s
        wdt = p.info.weight_dtype if p is not None else None
        wcopy = self.weight_numel[i] * wdt.itemsize if wdt is not None else 0
        work = (op.input_numel * din[i].itemsize + op.output_numel * dout[i].itemsize) * s
        return saved, float(wcopy), work

    def _static_memory(self, grp: _Group) -> dict[str, int]:
        mem = {
            "weights_fp32": self.graph.param_bytes,
            "grads_fp32": self.graph.param_bytes,
            "optimizer_state": grp.optimizer_state_bytes,
            "buffers": self.graph.buffer_bytes,
            "context": self.context[grp.name],
        }
        if not self.native_flow and self.cluster.world_size > 1:
            # The runtime's DDP keeps its FP32 gradient buckets for the run: one more copy
            # of the gradients (measured: +param bytes per rank, digits_cnn and tiny_gpt).
            mem["ddp_buckets"] = self.graph.param_bytes
        return mem

    # ------------------------------------------------------------------ the event loop

    def simulate(self, plan: Plan | Mapping[str, Mapping[str, Precision | str]],
                 *, events: bool = True) -> Timeline:
        """Simulate one iteration (the event-loop oracle); ``events=False`` skips the list."""
        precs = self.precisions_for(plan)
        all_events: list[Event] = []
        ready: list[list[float]] = []
        per_group: list[dict[str, Any]] = []
        for grp, prec in zip(self.groups, precs, strict=True):
            din, dout = self._dtypes(prec)
            t = 0.0
            cast_ms = 0.0
            n_casts = 0
            done_bwd = [0.0] * self.n
            items = [self._op_items(grp, i, prec, din, dout) for i in range(self.n)]
            # Forward in order, then backward in reverse, on one compute stream; every item
            # that is not the op itself is a cast.
            for phase, order, op_kind in ((0, range(self.n), "fwd"),
                                          (1, range(self.n - 1, -1, -1), "bwd")):
                for i in order:
                    for kind, name, ms, args in items[i][phase]:
                        if events:
                            all_events.append(Event(grp.name, "compute", kind, name, t, ms, args))
                        if kind != op_kind:
                            cast_ms += ms
                            n_casts += 1
                        t += ms
                    if phase == 1:
                        done_bwd[i] = t
                if phase == 0:
                    fwd_end = t
            ready.append([done_bwd[f] for f in self.bucket_first])
            terms = [self._mem_terms(grp, i, prec, din, dout) for i in range(self.n)]
            mem = self._memory(grp, [[t[c] for t in terms] for c in range(self.n_mem_terms)])
            per_group.append({"fwd": fwd_end, "bwd": t - fwd_end, "end_bwd": t,
                              "cast": cast_ms, "n_casts": n_casts, "mem": mem})
        sched = self.sync.schedule(ready, self.bucket_ms)
        ev_list: list[Event] | None = all_events if events else None
        if events:
            for grp in self.groups:
                for k, (s, e) in enumerate(zip(sched.start_ms, sched.end_ms, strict=True)):
                    all_events.append(Event(grp.name, "comm", "allreduce", f"bucket {k}", s, e - s,
                                            {"bytes": self.costs.buckets[k].bytes
                                             if k < len(self.costs.buckets) else None}))
        return self._finish(per_group, ready, sched, ev_list)

    def _finish(self, per_group: list[dict[str, Any]], ready: list[list[float]],
                sched: SyncSchedule, events: list[Event] | None) -> Timeline:
        comm_end = sched.comm_end_ms
        slowest_bwd = max(pg["end_bwd"] for pg in per_group)
        groups: dict[str, GroupTimeline] = {}
        for grp, pg in zip(self.groups, per_group, strict=True):
            start_opt = max(pg["end_bwd"], comm_end) + self.stats_sync_ms
            end = start_opt + grp.optimizer_ms + self.buffer_sync_ms
            if events is not None:
                events.append(Event(grp.name, "compute", "optimizer", f"{self.optimizer} step",
                                    start_opt, grp.optimizer_ms, None))
            mem = pg["mem"]
            groups[grp.name] = GroupTimeline(
                name=grp.name, device=grp.device, batch_per_device=grp.batch,
                forward_ms=pg["fwd"], backward_ms=pg["bwd"], cast_ms=pg["cast"],
                n_casts=pg["n_casts"], optimizer_ms=grp.optimizer_ms, end_ms=end,
                exposed_comm_ms=max(0.0, comm_end - max(pg["end_bwd"], slowest_bwd)),
                straggler_wait_ms=slowest_bwd - pg["end_bwd"],
                memory=mem, peak_memory_bytes=int(sum(mem.values())), capacity_bytes=grp.capacity)
        iteration = max(g.end_ms for g in groups.values())
        return Timeline(iteration_ms=iteration, groups=groups, bucket_start_ms=sched.start_ms,
                        bucket_end_ms=sched.end_ms,
                        critical_path=self._critical_path(groups, ready, sched),
                        events=events if events is not None else [])

    def _critical_path(self, groups: dict[str, GroupTimeline], ready: list[list[float]],
                       sched: SyncSchedule) -> list[dict[str, Any]]:
        """The chain of work that sets the iteration time, latest first then reversed."""
        last = max(groups.values(), key=lambda g: g.end_ms)
        path: list[dict[str, Any]] = [{"kind": "optimizer", "group": last.name,
                                       "start_ms": last.end_ms - last.optimizer_ms,
                                       "end_ms": last.end_ms}]
        comm_end = sched.comm_end_ms
        bwd_end = last.compute_ms
        if not sched.end_ms or bwd_end >= comm_end:
            path.append({"kind": "compute", "group": last.name, "start_ms": 0.0,
                         "end_ms": bwd_end})
            return list(reversed(path))
        k = len(sched.end_ms) - 1
        while k >= 0:
            path.append({"kind": "allreduce", "bucket": k, "start_ms": sched.start_ms[k],
                         "end_ms": sched.end_ms[k]})
            g_idx = max(range(len(ready)), key=lambda g: ready[g][k])
            prev_end = sched.end_ms[k - 1] if k > 0 else 0.0
            if ready[g_idx][k] >= prev_end:
                path.append({"kind": "compute", "group": self.groups[g_idx].name,
                             "start_ms": 0.0, "end_ms": ready[g_idx][k],
                             "until": f"backward of {self.ops[self.bucket_first[k]].name}"})
                break
            k -= 1
        return list(reversed(path))

    def incremental(self, plan: Plan | Mapping[str, Mapping[str, Precision | str]]
                    ) -> IncrementalReplay:
        """A stateful replay of ``plan`` that answers one-op changes quickly."""
        return IncrementalReplay(self, plan)


def simulate(graph: ModelGraph, cluster: ClusterSpec, costs: CostTable,
             plan: Plan | Mapping[str, Mapping[str, Precision | str]], **kw: Any) -> Timeline:
    """Simulate one training iteration of ``plan`` (see :class:`Replayer` for options)."""
    return Replayer(graph, cluster, costs, **kw).simulate(plan)


# ----------------------------------------------------------------------------- fast path


class _Fenwick:
    """Prefix sums with point updates, O(log n) each."""

    __slots__ = ("n", "tree", "vals")

    def __init__(self, values: Sequence[float]) -> None:
        self.n = len(values)
        self.vals = list(values)
        tree = [0.0] * (self.n + 1)
        for i, v in enumerate(values, start=1):
            tree[i] += v
            j = i + (i & -i)
            if j <= self.n:
                tree[j] += tree[i]
        self.tree = tree

    def set(self, i: int, value: float) -> None:
        delta = value - self.vals[i]
        if delta == 0.0:
            return
        self.vals[i] = value
        j = i + 1
        while j <= self.n:
            self.tree[j] += delta
            j += j & -j

    def prefix(self, i: int) -> float:
        """Sum of values[0:i]."""
        s = 0.0
        j = i
        while j > 0:
            s += self.tree[j]
            j -= j & -j
        return s

    def total(self) -> float:
        return self.prefix(self.n)


@dataclass
class Change:
    """The replay's state after a change: what :meth:`Replayer.simulate` would report as
    ``iteration_ms``, ``fits``, every group's ``peak_memory_bytes`` and ``compute_ms``
    (forward plus backward, casts included: ``GroupTimeline.compute_ms``)."""

    iteration_ms: float
    fits: bool
    peak_memory_bytes: dict[str, int]
    compute_ms: dict[str, float] = field(default_factory=dict)


class IncrementalReplay:
    """A plan held in per-op arrays; :meth:`set` changes one op and re-costs what it touches.

    Forward items (input casts, weight cast, op) and backward items (gradient quantize, op,
    weight-gradient cast, input-gradient casts) live in Fenwick trees per group, so a bucket's
    ready time is the forward total plus a suffix of the backward items. Changing op o on a
    group re-derives dtypes from o through the pass-through/promote ops its output reaches,
    and re-costs o, those ops and their consumers: its neighbourhood, not the graph.

    Memory: every op's memory terms (``mem[g][c][i]``, :meth:`Replayer._mem_terms`) are kept
    and re-costed with its time; :meth:`state` gives them to :meth:`Replayer._memory`, the
    computation :meth:`Replayer.simulate` makes, so the two report the same bytes on both
    flows (a sum on the native flow, the runtime's timeline on the fp32 flow; O(ops) per
    state, in C sums on the native flow and one Python pass each way on the fp32 flow).
    """

    def __init__(self, rep: Replayer, plan: Plan | Mapping[str, Mapping[str, Precision | str]]
                 ) -> None:
        self.rep = rep
        self.prec = rep.precisions_for(plan)
        self.din: list[list[DType]] = []
        self.dout: list[list[DType]] = []
        self.fwd: list[_Fenwick] = []
        self.bwd: list[_Fenwick] = []
        #: Per group, per memory term, per op (columns of :meth:`Replayer._mem_terms`).
        self.mem: list[list[list[float]]] = []
        for grp, prec in zip(rep.groups, self.prec, strict=True):
            din, dout = rep._dtypes(prec)
            self.din.append(din)
            self.dout.append(dout)
            f_vals, b_vals = [], []
            cols: list[list[float]] = [[] for _ in range(rep.n_mem_terms)]
            for i in range(rep.n):
                fi, bi = rep._op_items(grp, i, prec, din, dout)
                f_vals.append(sum(x[2] for x in fi))
                b_vals.append(sum(x[2] for x in bi))
                for col, v in zip(cols, rep._mem_terms(grp, i, prec, din, dout), strict=True):
                    col.append(v)
            self.fwd.append(_Fenwick(f_vals))
            self.bwd.append(_Fenwick(b_vals))
            self.mem.append(cols)
        self.calls = 0

    def precision(self, group: str, op: str) -> Precision | None:
        return self.prec[self._g(group)][self.rep.index[op]]

    def _g(self, group: str) -> int:
        for gi, g in enumerate(self.rep.groups):
            if g.name == group:
                return gi
        raise QsyncInputError(f"no group {group!r}")

    def set(self, group: str, op: str, precision: Precision) -> Change:
        """Change one op's precision on one group (validated) and return the new state."""
        self._set(group, op, precision)
        return self.state()

    def set_ops(self, group: str, ops: Sequence[str], precision: Precision) -> Change:
        """Change several ops (a tie group) to one precision; the state once, at the end."""
        for op in ops:
            self._set(group, op, precision)
        return self.state()

    def _set(self, group: str, op: str, precision: Precision) -> None:
        rep = self.rep
        gi = self._g(group)
        try:
            precision = Precision(precision)
        except ValueError:
            raise QsyncInputError(f"unknown precision {precision!r}") from None
        i = rep.index.get(op)
        if i is None:
            raise QsyncInputError(f"no op {op!r} in graph {rep.graph.workload}")
        grp = rep.groups[gi]
        node = rep.ops[i]
        allowed = [q for q in node.allowed_precisions if q in grp.menu]
        if node.role != OpRole.choosable or precision not in allowed:
            raise QsyncInputError(
                f"group {group} ({grp.device}), op {op}: {precision.value} is not "
                f"allowed; allowed: {', '.join(q.value for q in allowed) or 'none (not choosable)'}")
        self.calls += 1
        prec, din, dout = self.prec[gi], self.din[gi], self.dout[gi]
        prec[i] = precision
        # Re-derive dtypes downstream while they change (through pass-through/promote ops).
        touched = {i}
        stack = [i]
        while stack:
            j = stack.pop()
            new_in, new_out = rep._op_dtypes(j, prec, dout)
            changed = new_out != dout[j]
            din[j], dout[j] = new_in, new_out
            if changed or j == i:
                for v in rep.out_edges[j]:
                    touched.add(v)
                    if prec[v] is None and rep.role[v] in (OpRole.pass_through, OpRole.promote):
                        stack.append(v)
        for j in touched:
            fi, bi = rep._op_items(grp, j, prec, din, dout)
            self.fwd[gi].set(j, sum(x[2] for x in fi))
            self.bwd[gi].set(j, sum(x[2] for x in bi))
            for col, v in zip(self.mem[gi], rep._mem_terms(grp, j, prec, din, dout),
                              strict=True):
                col[j] = v

    def what_if(self, group: str, op: str, precision: Precision) -> Change:
        """The state if ``op`` ran at ``precision`` on ``group``; the plan is left as it was."""
        old = self.precision(group, op)
        result = self.set(group, op, precision)
        if old is not None and old != precision:
            self._set(group, op, old)
            self.calls -= 1
        return result

    def group_end_bwd(self, gi: int) -> float:
        return self.fwd[gi].total() + self.bwd[gi].total()

    def state(self) -> Change:
        rep = self.rep
        ready: list[list[float]] = []
        ends: list[float] = []
        for gi in range(len(rep.groups)):
            f = self.fwd[gi].total()
            b = self.bwd[gi]
            btot = b.total()
            ready.append([f + btot - b.prefix(first) for first in rep.bucket_first])
            ends.append(f + btot)
        compute = {g.name: e for g, e in zip(rep.groups, ends, strict=True)}
        sched = rep.sync.schedule(ready, rep.bucket_ms)
        comm_end = sched.comm_end_ms
        it = max(max(e, comm_end) + g.optimizer_ms for e, g in zip(ends, rep.groups, strict=True)
                 ) + rep.step_sync_ms
        peaks = {}
        fits = True
        for gi, g in enumerate(rep.groups):
            peak = int(sum(rep._memory(g, self.mem[gi]).values()))
            peaks[g.name] = peak
            fits = fits and peak <= g.capacity
        return Change(iteration_ms=it, fits=fits, peak_memory_bytes=peaks, compute_ms=compute)

    def plan(self) -> dict[str, dict[str, Precision]]:
        return {g.name: {self.rep.ops[i].name: p for i, p in enumerate(row) if p is not None}
                for g, row in zip(self.rep.groups, self.prec, strict=True)}
