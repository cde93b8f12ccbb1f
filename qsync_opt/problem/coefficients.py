"""The coefficients of one device group, derived op by op from the replayer's cost rules.

:func:`group_model` turns the cost rules (:class:`~qsync_opt.costs.rules.CostRules`) of one
group, the decision units and the problem's options into a
:class:`~qsync_opt.problem.groupmodel.GroupModel`: for every op, its items under every
choice of the unit that sets its own dtype (and, per float in-edge, of the unit that sets
that producer's dtype) become a constant, a unary or a pair term of time and memory; the
working set is a per-unit maximum; saved activations depend on the own dtype and, where the
op shares storage with an earlier one, on its inputs' casts. The equations are those of
:mod:`qsync_opt.problem.program`.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import DType, Precision
from qsync_opt.costs.rules import CostRules, allowed_on, fidelity
from qsync_opt.documents.schemas import ClusterSpec, IndicatorTable, OpNode, OpRole
from qsync_opt.problem.groupmodel import DerivedUnit, GroupModel, PairTerm, Unit, widest_choices


def op_choices(op: OpNode, menu: frozenset[Precision], pin: Precision | None,
               group: str, device: str) -> list[Precision]:
    """The precisions ``op`` may run at on a card with ``menu`` (only ``pin`` when pinned)."""
    allowed = allowed_on(op, menu)
    if pin is not None:
        if pin not in allowed:
            raise QsyncInputError(
                f"pinned: op {op.name} cannot run at {pin.value} on group {group} ({device}); "
                f"allowed: {', '.join(p.value for p in allowed)}")
        allowed = [pin]
    return allowed


@dataclass(frozen=True)
class GroupInputs:
    """What one group's coefficients are derived from: the cost rules, the decision units
    (``unit_of``: op name -> unit index), the problem's options that shape them (see
    :class:`~qsync_opt.problem.program.ProblemOptions`), the indicator and the cluster."""

    rules: CostRules
    units: Sequence[Unit]
    unit_of: Mapping[str, int]
    pinned: Mapping[str, Precision | str]
    casts: bool
    memory_headroom: float
    reference: Precision
    indicator: IndicatorTable
    cluster: ClusterSpec
    graph_batch: int


def unit_choices(inputs: GroupInputs, gi: int) -> list[tuple[Precision, ...]]:
    """Choices per unit on group ``gi``: the intersection over its ops, most exact first."""
    rules = inputs.rules
    grp = rules.groups[gi]
    pins = {k: Precision(v) for k, v in inputs.pinned.items()}
    choices: list[tuple[Precision, ...]] = []
    for unit in inputs.units:
        common: set[Precision] | None = None
        for name in unit.ops:
            op = rules.ops[rules.index[name]]
            allowed = set(op_choices(op, grp.menu, pins.get(name), grp.name, grp.device))
            common = allowed if common is None else common & allowed
        if not common:
            raise QsyncInputError(
                f"group {grp.name} ({grp.device}): tied ops {', '.join(unit.ops)} share no "
                "precision the card runs")
        choices.append(tuple(sorted(common, key=fidelity, reverse=True)))
    return choices


class _GroupTerms:
    """The terms of one group as they are accumulated, op by op.

    ``src[i]``: the unit that sets op ``i``'s output dtype (None: fp32 whatever the plan). A
    promoting op whose inputs all come from units gets a *derived* unit: its dtype is the
    widest of theirs (fp16 only if all give fp16, likewise bf16, else fp32), not a decision.
    ``ext``: the choices of the real units, then of the derived ones.
    """

    def __init__(self, inputs: GroupInputs, gi: int, choices: list[tuple[Precision, ...]]
                 ) -> None:
        rules = inputs.rules
        self.rules = rules
        self.grp = rules.groups[gi]
        self.casts = inputs.casts
        self.choices = choices
        n = rules.n
        self.unit_of = [inputs.unit_of.get(o.name) for o in rules.ops]
        self.src: list[int | None] = [None] * n
        self.derived: list[DerivedUnit] = []
        self.ext: list[tuple[Precision, ...]] = list(choices)
        self._find_sources()
        ext = self.ext
        self.time0 = 0.0
        self.mem0 = float(sum(rules.static_memory(self.grp).values()))
        self.work0 = 0.0
        self.time1 = [[0.0] * len(c) for c in ext]
        self.mem1 = [[0.0] * len(c) for c in ext]
        self.work1 = [[0.0] * len(c) for c in ext]
        self.pairs: dict[tuple[int, int], PairTerm] = {}
        self.prec: list[Precision | None] = [None] * n
        self.din = [DType.fp32] * n
        self.dout = [DType.fp32] * n
        #: ops whose saved-activation bytes are the maximum over several producers' choices
        self.memory_or = 0

    def _find_sources(self) -> None:
        rules, src = self.rules, self.src
        n_real = len(self.choices)
        by_inputs: dict[tuple[int, ...], int] = {}
        for i, o in enumerate(rules.ops):
            if o.role == OpRole.choosable:
                src[i] = self.unit_of[i]
            elif o.role == OpRole.pass_through and rules.in_edges[i]:
                src[i] = src[rules.in_edges[i][0][0]]
            elif o.role == OpRole.promote and rules.in_edges[i] and rules.native_flow:
                ins = [src[u] for u, _ in rules.in_edges[i]]
                known = [x for x in ins if x is not None]
                if len(known) == len(ins):
                    key = tuple(sorted(set(known)))
                    if key not in by_inputs:
                        dchoices = widest_choices([self.ext[u] for u in key])
                        by_inputs[key] = n_real + len(self.derived)
                        self.derived.append(DerivedUnit(index=n_real + len(self.derived),
                                                        op=o.name, inputs=key, choices=dchoices))
                        self.ext.append(dchoices)
                    src[i] = by_inputs[key]

    def out_dtype(self, u: int | None, k: int | None) -> DType:
        if u is None or k is None:
            return DType.fp32
        return self.rules.gives_out(self.ext[u][k])

    def add_pair(self, a: int, ka: int, b: int, kb: int, t: float, m: float) -> None:
        if a == b:
            if ka == kb:
                self.time1[a][ka] += t
                self.mem1[a][ka] += m
            return
        if a > b:
            a, ka, b, kb = b, kb, a, ka
        term = self.pairs.get((a, b))
        if term is None:
            ext = self.ext
            term = self.pairs[(a, b)] = PairTerm(
                a, b, [[0.0] * len(ext[b]) for _ in ext[a]],
                [[0.0] * len(ext[b]) for _ in ext[a]])
        term.time[ka][kb] += t
        term.mem[ka][kb] += m

    def add(self, units_choices: Sequence[tuple[int | None, int | None]], t: float,
            m: float) -> None:
        var = [(u, k) for u, k in units_choices if u is not None and k is not None]
        if not var:
            self.time0 += t
            self.mem0 += m
        elif len(var) == 1:
            u, k = var[0]
            self.time1[u][k] += t
            self.mem1[u][k] += m
        else:
            (a, ka), (b, kb) = var
            self.add_pair(a, ka, b, kb, t, m)

    def setup(self, i: int, s: int | None, ks: int | None) -> None:
        """Op ``i``'s own precision and dtypes with its unit ``s`` at choice ``ks``."""
        rules = self.rules
        o = rules.ops[i]
        if o.role == OpRole.choosable:
            assert s is not None and ks is not None  # a choosable op is its own unit
            p = self.choices[s][ks]
            self.prec[i] = p
            self.din[i], self.dout[i] = rules.takes_in(p), rules.gives_out(p)
        else:
            self.prec[i] = None
            if o.role in (OpRole.pass_through, OpRole.promote) and rules.in_edges[i]:
                self.din[i] = self.dout[i] = self.out_dtype(s, ks)
            else:
                self.din[i] = self.dout[i] = DType.fp32

    def own_unit(self, i: int) -> int | None:
        """The unit that sets op ``i``'s own dtype (None: none)."""
        role = self.rules.ops[i].role
        if role == OpRole.choosable:
            return self.unit_of[i]
        return self.src[i] if role in (OpRole.pass_through, OpRole.promote) else None

    def add_op(self, i: int) -> None:
        """Every term of op ``i``; its dtypes are reset to fp32 afterwards."""
        s = self.own_unit(i)
        s_range: list[int | None] = list(range(len(self.ext[s]))) if s is not None else [None]
        for ks in s_range:
            self._add_compute(i, s, ks)
        self._add_saved(i, s, s_range)
        for u, _ in self.rules.in_edges[i]:
            self.dout[u] = DType.fp32
        self.prec[i] = None
        self.din[i] = self.dout[i] = DType.fp32

    def _add_compute(self, i: int, s: int | None, ks: int | None) -> None:
        """Op ``i``'s time, working set and weight copy at its unit's choice ``ks``, and one
        pair term per in-edge for the casts on it."""
        rules, dout = self.rules, self.dout
        edges = rules.in_edges[i]
        self.setup(i, s, ks)
        for u, _ in edges:
            dout[u] = DType.fp32
        base = rules.op_ms(self.grp, i, self.prec, self.din, dout, [])
        self.add([(s, ks)], base, 0.0)
        # Working set and weight copy depend on the op's own dtypes only.
        _, wcopy, work = rules.op_memory(self.grp, i, self.prec, self.din, dout)
        if s is None:
            self.work0 = max(self.work0, work)
        else:
            assert ks is not None  # s set: ks ranges over its choices
            self.work1[s][ks] = max(self.work1[s][ks], work)
        self.add([(s, ks)], 0.0, wcopy)
        if not self.casts:
            return
        for u, numel in edges:
            eu = self.src[u]
            e_range: list[int | None] = list(range(len(self.ext[eu]))) if eu is not None else [None]
            for ke in e_range:
                if eu is not None and eu == s and ke != ks:
                    continue
                dout[u] = self.out_dtype(eu, ke)
                t = rules.edge_ms(self.grp, i, self.prec, self.din, dout, u, numel)
                dout[u] = DType.fp32
                if t:
                    self.add([(s, ks), (eu, ke)], t, 0.0)

    def _add_saved(self, i: int, s: int | None, s_range: list[int | None]) -> None:
        """Saved activations: they depend on the own dtype and on whether any input is cast
        (without storage shared with an earlier op the input casts change nothing)."""
        rules, src = self.rules, self.src
        edges = rules.in_edges[i]
        edge_units = [src[u] for u, _ in edges]
        var_edges = sorted({eu for eu in edge_units if eu is not None and eu != s}
                           ) if rules.ops[i].saved_shared_bytes else []
        if len(var_edges) > 1:
            self.memory_or += 1
        for ks in s_range:
            self.setup(i, s, ks)
            vals: list[tuple[tuple[int, ...], float]] = []
            for combo in itertools.product(*[range(len(self.ext[v])) for v in var_edges]):
                assign = dict(zip(var_edges, combo, strict=True))
                for u, _ in edges:
                    eu = src[u]
                    k = ks if eu == s else None if eu is None else assign.get(eu)
                    self.dout[u] = self.out_dtype(eu, k)
                saved, _, _ = rules.op_memory(self.grp, i, self.prec, self.din, self.dout)
                vals.append((combo, saved))
            if len(var_edges) == 1:
                for combo, saved in vals:
                    self.add([(s, ks), (var_edges[0], combo[0])], 0.0, saved)
            else:
                self.add([(s, ks)], 0.0, max(v for _, v in vals))

    def additive_times(self) -> tuple[float, list[list[float]]]:
        """The additive model's time terms: compute only (no input, weight or gradient casts)."""
        rules = self.rules
        time0 = 0.0
        time1 = [[0.0] * len(c) for c in self.ext]
        for i in range(rules.n):
            u = self.unit_of[i]
            if u is None:
                f, b = rules.compute_ms(self.grp, i, None, DType.fp32)
                time0 += f + b
            else:
                for k, p in enumerate(self.ext[u]):
                    f, b = rules.compute_ms(self.grp, i, p, p.info.gives_out)
                    time1[u][k] += f + b
        return time0, time1


def omega_rows(units: Sequence[Unit], choices: list[tuple[Precision, ...]],
               indicator: IndicatorTable) -> list[list[float]]:
    """Each unit's degradation per choice: the sum of its ops' indicator values."""
    values = indicator.values
    out: list[list[float]] = []
    for unit, ch in zip(units, choices, strict=True):
        row = []
        for p in ch:
            total = 0.0
            for name in unit.ops:
                if p == Precision.fp32:
                    continue
                v = values.get(name, {}).get(p)
                if v is None:
                    raise QsyncInputError(
                        f"indicator: no value for op {name} at {p.value} (method "
                        f"{indicator.method}); recompute it for this graph")
                total += v
            row.append(total)
        out.append(row)
    return out


def reference_choices(choices: list[tuple[Precision, ...]], reference: Precision
                      ) -> list[int]:
    """Per unit, the index of ``reference`` among its choices (else fp32, else the first)."""
    out = []
    for c in choices:
        if reference in c:
            out.append(c.index(reference))
        elif Precision.fp32 in c:
            out.append(c.index(Precision.fp32))
        else:
            out.append(0)
    return out


def group_model(inputs: GroupInputs, gi: int) -> tuple[GroupModel, int]:
    """Group ``gi``'s coefficients, and how many of its ops take their saved-activation
    bytes as the maximum over several producers' choices (an upper bound)."""
    choices = unit_choices(inputs, gi)
    terms = _GroupTerms(inputs, gi, choices)
    for i in range(inputs.rules.n):
        terms.add_op(i)
    time0, time1 = terms.time0, terms.time1
    if not inputs.casts:
        # The additive model: compute only; its memory terms stay those of the real model.
        time0, time1 = terms.additive_times()
        for term in terms.pairs.values():
            term.time = [[0.0] * len(row) for row in term.time]
    spec = inputs.cluster.groups[gi]
    grp = terms.grp
    b = int(spec.batch_per_device or inputs.graph_batch)
    weight = spec.count * b / sum(g.count * int(g.batch_per_device or inputs.graph_batch)
                                  for g in inputs.cluster.groups)
    model = GroupModel(
        name=grp.name, device=grp.device, count=spec.count, batch=b, weight=weight,
        capacity_bytes=grp.capacity * (1 - inputs.memory_headroom),
        usable_bytes=grp.capacity, choices=choices, time0=time0, time1=time1,
        mem0=terms.mem0, mem1=terms.mem1, work0=terms.work0, work1=terms.work1,
        omega1=omega_rows(inputs.units, choices, inputs.indicator),
        pairs=[terms.pairs[k] for k in sorted(terms.pairs)],
        reference=reference_choices(choices, inputs.reference),
        derived=terms.derived)
    return model, terms.memory_or
