"""The cost-and-memory rules: what an op costs in time and memory at a precision, given its
neighbours. One module, read by the replayer (its event loop and its incremental path), the
problem compiler (:mod:`qsync_opt.problem.program` derives the integer program's coefficients from
these rules, op by op) and the diagnosis.

The rules, pure functions and two small classes over (graph, device, costs), no event loop:

* **Precisions here.** :func:`allowed_on` is "allowed by the op and on the card's menu";
  :data:`PASS_PRECISION` / :func:`pass_precision` is the one map from an activation dtype to
  the precision a pass-through op runs at (and :func:`widest`, :func:`widest_precision`
  autocast's promotion); :data:`GRAD_DTYPE` the dtype of an op's input gradient.
* **Dtype flow** (:meth:`CostRules.op_dtypes`, :meth:`CostRules.dtypes`). A choosable op at
  ``p`` takes in ``p.takes_in`` and gives out ``p.gives_out`` (fp32 and fp32 on the fp32
  flow, tables profiled on qsync-opt's runtime, whose layers cast in and out); pinned ops
  take and give fp32; pass-through ops carry their first input's dtype; promoting ops run in
  the widest float input dtype.
* **Casts between neighbours and compute** (:meth:`CostRules.op_items`): an op's forward and
  backward work items, additive over its float in-edges: input casts where the producer
  gives out what the op does not take in, the weight cast, the op at its CostTable entry
  (:meth:`CostRules.compute_ms`), the output-gradient quantize, the weight-gradient cast and
  the input-gradient casts back to each producer's dtype. A cast costs ``a * numel + b``
  (:meth:`CostRules.cast_ms`; an untabled pair goes through fp32).
* **Memory.** Per op, :meth:`CostRules.op_memory` (saved activations, low-precision weight
  copy, working set) and :meth:`CostRules.runtime_op_memory` (the runtime's allocations);
  per group, :meth:`CostRules.static_memory` (fp32 weights, gradients, optimizer state,
  buffers, context, and the runtime's DDP buckets).

Three memory views, different on purpose, built from the same per-op terms:

* :meth:`CostRules.summed_memory` (the native flow, estimated or natively profiled tables):
  static memory plus every saved activation and weight copy plus the largest working set.
  The replayer reports it, and the integer program's rows (``GroupModel.memory_bytes``)
  reproduce it exactly (tests hold them equal), one unary or pair term per op.
* :meth:`CostRules.timeline_memory` (the fp32 flow, tables profiled on the runtime): the
  runtime's peak over one step's timeline (forward: what was saved so far plus the op's
  transient; backward: what is still saved, the fp32 gradients made so far and the op's
  transient). The replayer reports it (:meth:`CostRules.peak_memory` picks the view by
  flow). It is checked against the runtime's measured peak (:mod:`qsync_opt.runtime.memory`,
  a measurement, not a model) within 5%.
* The linear bound on the fp32 flow: the integer program cannot express a maximum over a
  timeline as unary and pair terms, so its rows sum the same terms as the native flow
  (static memory with every fp32 gradient, all saved activations and weight copies, the
  largest of each op's forward and backward transients): an upper bound of
  :meth:`CostRules.timeline_memory`, so a plan the program accepts fits in the replayer.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import PRECISION_INFO, DType, Precision
from qsync_opt.costs.devices import get_device
from qsync_opt.documents.schemas import (
    ClusterSpec,
    CostTable,
    DeviceGroup,
    ModelGraph,
    OpKind,
    OpNode,
    OpRole,
)

MiB = 1024**2
#: Reserve per GPU for the CUDA context and library workspaces (cuBLAS/cuDNN handles). A
#: default, not a measurement: drivers report 300-500 MiB of context on recent GPUs.
DEFAULT_CONTEXT_BYTES = 512 * MiB

#: The precision an op runs at when it carries an activation of this dtype (pass-through and
#: promoting ops, and the reference of dtype-keyed lookups): the one dtype -> precision map.
PASS_PRECISION: dict[DType, Precision] = {
    DType.fp32: Precision.fp32, DType.fp16: Precision.fp16, DType.bf16: Precision.bf16}

#: Dtype of the input gradient an op produces in backward, per precision.
GRAD_DTYPE: dict[Precision, DType] = {
    Precision.fp32: DType.fp32, Precision.tf32: DType.fp32, Precision.bf16: DType.bf16,
    Precision.fp16: DType.fp16, Precision.int8: DType.fp16, Precision.int8_full: DType.fp16,
    Precision.fp8: DType.bf16, Precision.int4: DType.fp16,
}

#: How many times backward quantizes an op's output gradient: int8_full twice (one scale
#: per row for the input-gradient GEMM, one per output channel for the weight-gradient GEMM:
#: two abs-max passes and two int8 copies, ``qsync_opt.ops.NUMERICS``); others once.
GRAD_QUANTIZE_PASSES: dict[Precision, int] = {Precision.int8_full: 2}

#: One work item of an op: (kind, name, ms, args). Kinds: fwd, bwd, cast, weight_cast,
#: grad_cast.
WorkItem = tuple[str, str, float, dict[str, Any] | None]


def pass_precision(d: DType) -> Precision:
    """The precision an op carrying dtype ``d`` runs at (fp32 for any other dtype)."""
    return PASS_PRECISION.get(d, Precision.fp32)


def fidelity(p: Precision) -> int:
    """How exact ``p`` is (higher: more exact); choices are ranked by it."""
    return PRECISION_INFO[p].rank


def widest(dtypes: Iterable[DType]) -> DType:
    """Autocast's promotion among float dtypes: fp32 if any, or if fp16 meets bf16."""
    kinds = set(dtypes)
    if not kinds:
        return DType.fp32
    if len(kinds) == 1:
        return next(iter(kinds))
    return DType.fp32


def widest_precision(dtypes: set[DType]) -> Precision:
    """The precision a promoting op fed these (non-empty) dtypes runs at."""
    return pass_precision(widest(dtypes))


def allowed_on(op: OpNode, menu: Collection[Precision]) -> list[Precision]:
    """The precisions ``op`` allows that the card runs (its menu), in the op's order."""
    return [p for p in op.allowed_precisions if p in menu]


def check_plan_entry(op: OpNode, p: Precision, allowed: Collection[Precision], where: str,
                     name: str, device: str) -> bool:
    """The rule for one op's precision in a plan's group: a pass-through op is not set, a
    pinned op keeps a precision it allows (True: nothing to set), a choosable op gets one of
    ``allowed`` (False: set it). Refused in one line otherwise; ``where`` names the group
    (``plan: group NAME``), ``name`` the op as shown, ``device`` the group's card."""
    if op.role != OpRole.choosable:
        if op.role == OpRole.pinned and p in op.allowed_precisions:
            return True
        raise QsyncInputError(
            f"{where}, op {name} is {op.role.value}"
            + (f" ({op.pin_reason})" if op.pin_reason else "")
            + f"; its precision cannot be set to {p.value}")
    if p not in allowed:
        raise QsyncInputError(
            f"{where} ({device}), op {name}: {p.value} is not allowed; "
            f"allowed: {', '.join(q.value for q in allowed) or 'none'}")
    return False


def check_tie(ties: dict[str, tuple[str, Precision]], tie_group: str, name: str, p: Precision,
              where: str, show: Callable[[str], str] = str) -> None:
    """The rule that ops of one tie group get one precision: ``ties`` holds, per tie group
    seen so far, its first op and precision; refused in one line naming both ops (names
    passed through ``show`` for the message)."""
    first = ties.setdefault(tie_group, (name, p))
    if first[1] != p:
        raise QsyncInputError(
            f"{where}: ops {show(first[0])} and {show(name)} share tie group "
            f"{show(tie_group)} but get {first[1].value} and {p.value}")


@dataclass(frozen=True)
class GroupCosts:
    """One device group's side of the rules: its batch, capacity, menu and cost lookups
    (``fwd[i][p]``/``bwd[i][p]``: op i's CostTable entry at this device and batch)."""

    name: str
    device: str
    batch: int
    scale: float  # per-device batch / the graph's traced batch
    capacity: int
    fwd: list[dict[Precision, float]]
    bwd: list[dict[Precision, float]]
    casts: dict[tuple[DType, DType], tuple[float, float]]
    optimizer_ms: float
    optimizer_state_bytes: int
    menu: frozenset[Precision]
    context_bytes: int = 0

    def allowed(self, op: OpNode) -> list[Precision]:
        """:func:`allowed_on` this group's menu."""
        return allowed_on(op, self.menu)


class CostRules:
    """The rules over one (graph, cluster with batches, costs): indexed once, asked per op.

    ``prec``, ``din`` and ``dout`` are per-op lists for one group (a plan row: None for an
    op that is not choosable; the dtypes from :meth:`dtypes`). ``optimizer`` picks the
    optimizer cost; ``context_bytes`` is reserved per GPU device (0 on the CPU).
    """

    def __init__(self, graph: ModelGraph, cluster: ClusterSpec, costs: CostTable, *,
                 optimizer: str = "sgd", context_bytes: int = DEFAULT_CONTEXT_BYTES) -> None:
        self.graph = graph
        self.cluster = cluster.with_default_batch(graph.batch_size)
        self.costs = costs
        self.optimizer = optimizer
        #: False for tables profiled on qsync-opt's runtime (``activation_flow="fp32"``): its
        #: layers cast in and out, so activations stay fp32 and casts are inside op costs.
        self.native_flow = costs.activation_flow == "native"
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
        self.weight_numel: list[int] = []
        for o in ops:
            n = 0
            if o.weight_shape is not None:
                n = 1
                for s in o.weight_shape:
                    n *= s
            self.weight_numel.append(n)
        self.groups = [self._group_costs(g, context_bytes) for g in self.cluster.groups]
        self.grads = self._module_grads()
        #: How many memory terms :meth:`mem_terms` gives per op on this flow.
        self.n_mem_terms = 3 if self.native_flow else 4

    def _group_costs(self, g: DeviceGroup, context_bytes: int) -> GroupCosts:
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
        return GroupCosts(name=g.name, device=g.device, batch=b, scale=b / self.graph.batch_size,
                          capacity=dev.usable_memory_bytes, fwd=fwd, bwd=bwd, casts=casts,
                          optimizer_ms=opt.ms, optimizer_state_bytes=opt.state_bytes,
                          menu=frozenset(dev.precisions),
                          context_bytes=context_bytes if dev.compute_capability else 0)

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

    # ------------------------------------------------------------------ dtype flow

    def takes_in(self, p: Precision) -> DType:
        """The dtype an op at ``p`` takes on its activation edges (fp32 in the fp32 flow)."""
        return p.info.takes_in if self.native_flow else DType.fp32

    def gives_out(self, p: Precision) -> DType:
        """The dtype an op at ``p`` gives out (fp32 in the fp32 flow)."""
        return p.info.gives_out if self.native_flow else DType.fp32

    def op_dtypes(self, i: int, prec: Sequence[Precision | None],
                  dout: Sequence[DType]) -> tuple[DType, DType]:
        """(dtype op i takes in, dtype it gives out), its producers giving out ``dout``."""
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

    def plan_row(self, unit_ops: Sequence[Sequence[str]], chosen: Sequence[Precision]
                 ) -> list[Precision | None]:
        """One group's precisions per op (the ``prec`` of the methods here) from a choice per
        unit: every op of unit ``u`` (``unit_ops[u]``, names) at ``chosen[u]``; None for an
        op no unit holds (not choosable)."""
        prec: list[Precision | None] = [None] * self.n
        for ops, p in zip(unit_ops, chosen, strict=True):
            for op in ops:
                prec[self.index[op]] = p
        return prec

    def dtypes(self, prec: Sequence[Precision | None]) -> tuple[list[DType], list[DType]]:
        """(dtype each op takes in, dtype it gives out) for one group's precisions."""
        n = self.n
        din: list[DType] = [DType.fp32] * n
        dout: list[DType] = [DType.fp32] * n
        for i in range(n):
            din[i], dout[i] = self.op_dtypes(i, prec, dout)
        return din, dout

    # ------------------------------------------------------------------ time

    def cast_ms(self, grp: GroupCosts, src: DType, dst: DType, numel: float) -> float:
        """A cast of ``numel`` elements from ``src`` to ``dst`` on ``grp``'s device."""
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

    def compute_ms(self, grp: GroupCosts, i: int, prec: Precision | None, d: DType
                   ) -> tuple[float, float]:
        """(forward, backward) ms of op i itself at ``prec`` (None: at the precision of the
        dtype ``d`` it carries; a pinned op at its pin)."""
        key = prec if prec is not None else pass_precision(d)
        if self.role[i] == OpRole.pinned:
            key = self.ops[i].allowed_precisions[0]
        try:
            return grp.fwd[i][key], grp.bwd[i][key]
        except KeyError:
            raise QsyncInputError(
                f"costs: no {key.value} entry for op {self.ops[i].name} on {grp.device} at "
                f"batch {grp.batch}") from None

    def op_items(self, grp: GroupCosts, i: int, prec: Sequence[Precision | None],
                 din: Sequence[DType], dout: Sequence[DType],
                 edges: Sequence[tuple[int, int]] | None = None, named: bool = True,
                 ) -> tuple[list[WorkItem], list[WorkItem]]:
        """Forward and backward work items of op i: (kind, name, ms, args).

        ``edges`` restricts the per-input-edge casts to those edges (default: all of op i's
        float in-edges); the items are additive over edges, which the linear model of
        :mod:`qsync_opt.problem.program` uses to split an op's cost into per-edge pair terms.
        ``named=False`` leaves the cast items' names empty (for sums of their times).
        """
        op = self.ops[i]
        p = prec[i]
        fwd_items: list[WorkItem] = []
        bwd_items: list[WorkItem] = []
        takes = din[i]
        if edges is None:
            edges = self.in_edges[i]
        if not self.native_flow:
            # Profiled on the runtime: the op's casts (input, weight, output, gradients) are
            # inside its measured cost.
            f_ms, b_ms = self.compute_ms(grp, i, p, dout[i])
            fwd_items.append(("fwd", op.name, f_ms,
                              {"precision": (p or pass_precision(dout[i])).value}))
            bwd_items.append(("bwd", op.name, b_ms, None))
            return fwd_items, bwd_items
        if p is not None and not self.in_edges[i] and op.input_numel:
            # A choosable op on the model input: the input arrives in fp32.
            ms = self.cast_ms(grp, DType.fp32, takes, op.input_numel * grp.scale)
            if ms:
                fwd_items.append(("cast", f"cast input fp32->{takes.value} > {op.name}" if named else "", ms,
                                  {"numel": op.input_numel * grp.scale}))
        for u, numel in edges:
            fc = self._edge_cast(grp, i, p, takes, dout[u], numel)
            if fc is not None:
                fwd_items.append(("cast", f"cast {dout[u].value}->{takes.value} "
                                  f"{self.ops[u].name} > {op.name}" if named else "", fc,
                                  {"numel": numel * grp.scale}))
        wdt = p.info.weight_dtype if p is not None else None
        wn = self.weight_numel[i]
        if wdt is not None and wn:
            fwd_items.append(("weight_cast", f"weight fp32->{wdt.value} {op.name}" if named
                              else "",
                              self.cast_ms(grp, DType.fp32, wdt, wn), {"numel": wn}))
        f_ms, b_ms = self.compute_ms(grp, i, p, dout[i])
        fwd_items.append(("fwd", op.name, f_ms,
                          {"precision": (p or pass_precision(dout[i])).value}))
        # Backward: quantize the output gradient (int8_full, fp8; int8_full twice: per row
        # for the input gradient, per output channel for the weight gradient, ops.NUMERICS),
        # the op, weight gradient back to FP32, then input gradients cast to what each
        # producer gives out.
        if p is not None and p.info.bwd_compute in (DType.int8, DType.fp8_e5m2):
            passes = GRAD_QUANTIZE_PASSES.get(p, 1)
            bwd_items.append(("grad_cast", f"grad {p.info.gives_out.value}->"
                              f"{p.info.bwd_compute.value}{f' x{passes}' if passes > 1 else ''}"
                              f" {op.name}" if named else "",
                              passes * self.cast_ms(grp, p.info.gives_out, p.info.bwd_compute,
                                                    op.output_numel * grp.scale), None))
        bwd_items.append(("bwd", op.name, b_ms, None))
        if p is not None and wdt is not None and wn:
            gdt = GRAD_DTYPE[p]
            ms = self.cast_ms(grp, gdt, DType.fp32, wn)
            if ms:
                bwd_items.append(("grad_cast", f"weight grad {gdt.value}->fp32 {op.name}"
                                  if named else "", ms,
                                  None))
        for u, numel in edges:
            bc = self._edge_grad_cast(grp, p, takes, b_ms, dout[u], numel)
            if bc is not None:
                bwd_items.append(("cast", f"grad cast {self._grad_in(p, takes).value}->"
                                  f"{dout[u].value} {op.name} > {self.ops[u].name}"
                                  if named else "", bc, {"numel": numel * grp.scale}))
        return fwd_items, bwd_items

    def _edge_cast(self, grp: GroupCosts, i: int, p: Precision | None, takes: DType,
                   src: DType, numel: int) -> float | None:
        """The forward cast on an in-edge of op i whose producer gives ``src`` (None: no
        cast): an op at a precision, pinned or promoting casts its input to what it takes."""
        if src != takes and (p is not None or self.role[i] == OpRole.pinned
                             or self.role[i] == OpRole.promote):
            return self.cast_ms(grp, src, takes, numel * grp.scale)
        return None

    @staticmethod
    def _grad_in(p: Precision | None, takes: DType) -> DType:
        """The dtype of the input gradients an op at ``p`` (taking ``takes``) produces."""
        return GRAD_DTYPE[p] if p is not None else takes

    def _edge_grad_cast(self, grp: GroupCosts, p: Precision | None, takes: DType,
                        b_ms: float, src: DType, numel: int) -> float | None:
        """The backward cast of the input gradient on an in-edge back to what its producer
        gives (``src``); None: none (the op has no backward, or the dtypes agree)."""
        if not (b_ms > 0 or p is not None):
            return None
        gin = self._grad_in(p, takes)
        return self.cast_ms(grp, gin, src, numel * grp.scale) if src != gin else None

    def edge_ms(self, grp: GroupCosts, i: int, prec: Sequence[Precision | None],
                din: Sequence[DType], dout: Sequence[DType], u: int, numel: int) -> float:
        """What the in-edge from op ``u`` (``numel`` elements) adds to op i's time: its
        forward cast and its gradient's cast back (the edge's items of :meth:`op_items`; 0
        on the fp32 flow, whose measured op costs hold every cast)."""
        if not self.native_flow:
            return 0.0
        p = prec[i]
        takes = din[i]
        fc = self._edge_cast(grp, i, p, takes, dout[u], numel)
        bc = self._edge_grad_cast(grp, p, takes, self.compute_ms(grp, i, p, dout[i])[1],
                                  dout[u], numel)
        return (fc or 0.0) + (bc or 0.0)

    def op_ms(self, grp: GroupCosts, i: int, prec: Sequence[Precision | None],
              din: Sequence[DType], dout: Sequence[DType],
              edges: Sequence[tuple[int, int]] | None = None) -> float:
        """Op i's forward plus backward ms, casts included (the sum of :meth:`op_items`)."""
        f, b = self.op_items(grp, i, prec, din, dout, edges, named=False)
        return sum(x[2] for x in f) + sum(x[2] for x in b)

    # ------------------------------------------------------------------ memory

    def static_memory(self, grp: GroupCosts) -> dict[str, int]:
        """A group's memory that no precision changes: fp32 weights and gradients, optimizer
        state, buffers, context (and, on the runtime with several ranks, DDP's buckets)."""
        mem = {
            "weights_fp32": self.graph.param_bytes,
            "grads_fp32": self.graph.param_bytes,
            "optimizer_state": grp.optimizer_state_bytes,
            "buffers": self.graph.buffer_bytes,
            "context": grp.context_bytes,
        }
        if not self.native_flow and self.cluster.world_size > 1:
            # The runtime's DDP keeps its FP32 gradient buckets for the run: one more copy
            # of the gradients (measured: +param bytes per rank, digits_cnn and tiny_gpt).
            mem["ddp_buckets"] = self.graph.param_bytes
        return mem

    def runtime_op_memory(self, grp: GroupCosts, i: int, p: Precision | None
                          ) -> tuple[float, float, float, float]:
        """Op i on qsync-opt's runtime layers (the fp32 flow): (saved bytes, weight-copy bytes,
        forward transient, backward transient), as the runtime really allocates them.

        Measured against the exact allocator trace (:mod:`qsync_opt.runtime.memory`): an fp32
        op saves what the trace measured (shared storage once); a bf16/fp16 layer saves new
        16-bit copies of its inputs and weight; an int8 Linear/Conv2d saves its int8 input and
        weight with their scales, and its forward holds the int32 accumulator (a conv also the
        fp32 and int8 im2col columns; int4 the same, its values in int8 storage); an int8,
        int4 or fp8 attention matmul fake-quantizes, so it
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
        if p in (Precision.int8, Precision.int8_full, Precision.int4) \
                and op.kind != OpKind.matmul \
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

    def op_memory(self, grp: GroupCosts, i: int, prec: Sequence[Precision | None],
                  din: Sequence[DType], dout: Sequence[DType]) -> tuple[float, float, float]:
        """(saved activation bytes, low-precision weight copy bytes, working-set bytes) of
        op i: the terms of the summed view (on the fp32 flow, :meth:`runtime_op_memory` with
        the larger transient as the working set: the linear bound)."""
        op = self.ops[i]
        p = prec[i]
        if not self.native_flow:
            saved, wcopy, f, b = self.runtime_op_memory(grp, i, p)
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
        if edges:
            cast_in = any(dout[u] != din[i] for u, _ in edges)
        else:
            cast_in = p is not None and din[i] != DType.fp32
        base = op.saved_bytes if cast_in else op.unique_saved_bytes
        saved = base * kept.itemsize / 4 * s
        wdt = p.info.weight_dtype if p is not None else None
        wcopy = self.weight_numel[i] * wdt.itemsize if wdt is not None else 0
        work = (op.input_numel * din[i].itemsize + op.output_numel * dout[i].itemsize) * s
        return saved, float(wcopy), work

    def mem_terms(self, grp: GroupCosts, i: int, prec: Sequence[Precision | None],
                  din: Sequence[DType], dout: Sequence[DType]) -> tuple[float, ...]:
        """Op i's memory terms, the input of :meth:`peak_memory`: (saved, weight copy, working
        set) on the native flow (:meth:`op_memory`); (saved, weight copy, forward transient,
        backward transient) on the fp32 flow (:meth:`runtime_op_memory`)."""
        if self.native_flow:
            return self.op_memory(grp, i, prec, din, dout)
        return self.runtime_op_memory(grp, i, prec[i])

    def peak_memory(self, grp: GroupCosts, cols: Sequence[Sequence[float]]) -> dict[str, int]:
        """The replayer's memory components at a group's peak from every op's
        :meth:`mem_terms`, column-wise (``cols[c][i]`` is term c of op i): the summed view
        on the native flow, the timeline view on the fp32 flow."""
        if not self.native_flow:
            return self.timeline_memory(grp, cols)
        return self.summed_memory(grp, cols)

    def summed_memory(self, grp: GroupCosts, cols: Sequence[Sequence[float]]) -> dict[str, int]:
        """Static memory, every saved activation and weight copy, and the largest working
        set (``cols``: the :meth:`op_memory` columns)."""
        saved, wcopy, work = cols
        mem = self.static_memory(grp)
        mem["weight_copies"] = int(sum(wcopy))
        mem["activations"] = int(sum(saved))
        mem["workspace"] = int(max(work, default=0.0))
        return mem

    def timeline_memory(self, grp: GroupCosts, cols: Sequence[Sequence[float]]
                        ) -> dict[str, int]:
        """Memory components at the peak of one step on the runtime (the fp32 flow), from
        the ops' :meth:`runtime_op_memory` terms, column-wise.

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
        mem = self.static_memory(grp)
        mem["grads_fp32"] = int(best[3])
        mem["weight_copies"] = int(best[2])
        mem["activations"] = int(best[1])
        mem["workspace"] = int(best[4])
        return mem

    def group_memory(self, grp: GroupCosts, prec: Sequence[Precision | None]) -> dict[str, int]:
        """:meth:`peak_memory` of one plan row (the dtypes derived here)."""
        din, dout = self.dtypes(prec)
        terms = [self.mem_terms(grp, i, prec, din, dout) for i in range(self.n)]
        return self.peak_memory(grp, [[t[c] for t in terms] for c in range(self.n_mem_terms)])
