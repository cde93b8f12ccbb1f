"""The replayer's fast path: one plan held in per-op Fenwick trees, one-op changes re-costed
in their neighbourhood (the greedy allocator's "what if")."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import DType, Precision
from qsync_opt.documents.schemas import OpRole, Plan
from qsync_opt.replayer.prepared import PreparedReplay


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

    Memory: every op's memory terms (``mem[g][c][i]``, ``CostRules.mem_terms``) are kept
    and re-costed with its time; :meth:`state` gives them to ``CostRules.peak_memory``, the
    computation :meth:`Replayer.simulate` makes, so the two report the same bytes on both
    flows (a sum on the native flow, the runtime's timeline on the fp32 flow; O(ops) per
    state, in C sums on the native flow and one Python pass each way on the fp32 flow).
    """

    def __init__(self, rep: PreparedReplay,
                 plan: Plan | Mapping[str, Mapping[str, Precision | str]]) -> None:
        self.rep = rep
        rules = rep.rules
        self.prec = rep.precisions_for(plan)
        self.din: list[list[DType]] = []
        self.dout: list[list[DType]] = []
        self.fwd: list[_Fenwick] = []
        self.bwd: list[_Fenwick] = []
        #: Per group, per memory term, per op (columns of ``CostRules.mem_terms``).
        self.mem: list[list[list[float]]] = []
        for grp, prec in zip(rep.groups, self.prec, strict=True):
            din, dout = rules.dtypes(prec)
            self.din.append(din)
            self.dout.append(dout)
            f_vals, b_vals = [], []
            cols: list[list[float]] = [[] for _ in range(rules.n_mem_terms)]
            for i in range(rep.n):
                fi, bi = rules.op_items(grp, i, prec, din, dout)
                f_vals.append(sum(x[2] for x in fi))
                b_vals.append(sum(x[2] for x in bi))
                for col, v in zip(cols, rules.mem_terms(grp, i, prec, din, dout), strict=True):
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
        rules = rep.rules
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
        allowed = grp.allowed(node)
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
            new_in, new_out = rules.op_dtypes(j, prec, dout)
            changed = new_out != dout[j]
            din[j], dout[j] = new_in, new_out
            if changed or j == i:
                for v in rep.out_edges[j]:
                    touched.add(v)
                    if prec[v] is None and rep.role[v] in (OpRole.pass_through, OpRole.promote):
                        stack.append(v)
        for j in touched:
            fi, bi = rules.op_items(grp, j, prec, din, dout)
            self.fwd[gi].set(j, sum(x[2] for x in fi))
            self.bwd[gi].set(j, sum(x[2] for x in bi))
            for col, term in zip(self.mem[gi], rules.mem_terms(grp, j, prec, din, dout),
                                 strict=True):
                col[j] = term

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
            peak = int(sum(rep.rules.peak_memory(g, self.mem[gi]).values()))
            peaks[g.name] = peak
            fits = fits and peak <= g.capacity
        return Change(iteration_ms=it, fits=fits, peak_memory_bytes=peaks, compute_ms=compute)

    def plan(self) -> dict[str, dict[str, Precision]]:
        return {g.name: {self.rep.ops[i].name: p for i, p in enumerate(row) if p is not None}
                for g, row in zip(self.rep.groups, self.prec, strict=True)}
