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
from typing import Any

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import DType, Precision
from qsync_opt.costs.rules import CostRules, GroupCosts, allowed_on, fidelity
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


#: The rules calls a schedule makes (:meth:`CostRules.op_ms`, ``op_memory``, ``edge_ms``).
_MS, _MEM, _EDGE = 0, 1, 2
#: The steps of a schedule, applied in order to a group's terms: add a call's time, add a
#: component of its memory, add its time only where it is not 0 (a cast), raise the working
#: set to it, add the largest saved bytes of several calls.
_ADD_T, _ADD_M, _ADD_T_NONZERO, _WORK, _ADD_M_MAX = 0, 1, 2, 3, 4

#: Where a step adds: None (nowhere), () the constant, (u, k) a unary, (a, ka, b, kb) a pair.
Slot = tuple[int, ...] | None
#: One rules call: kind, op, the op's precision, its dtypes in and out, its in-edge
#: producers that give out another dtype than fp32 with that dtype, and for an edge call the
#: producer and numel.
Call = tuple[int, int, Precision | None, DType, DType, tuple[tuple[int, DType], ...], int, int]


@dataclass(frozen=True)
class Schedule:
    """How one group's coefficients are derived, whatever its batch: the decisions'
    choices (``choices``, ``ext``: the real units', then the derived ones'), the rules calls
    to make (``calls``, each once) and the steps that add their results into the terms, in
    the order of the op-by-op derivation (so every sum is the same float sum). It depends
    on the graph, the group's menu, the units, pins and options, never on the batch: the
    candidate splits of one problem share it (:class:`ScheduleCache`)."""

    choices: list[tuple[Precision, ...]]
    ext: list[tuple[Precision, ...]]
    derived: list[DerivedUnit]
    unit_of: list[int | None]
    calls: list[Call]
    steps: list[tuple[int, Slot, tuple[int, ...], int]]
    memory_or: int
    #: the graph's ops it was recorded on (a schedule is only used on these very ops)
    ops: Sequence[OpNode]


#: Schedules by what they depend on, shared by the problems made from one problem.
ScheduleCache = dict[tuple[object, ...], Schedule]


class _Recorder:
    """Walks the ops once, as the derivation does, and records the rules calls and the steps.

    ``src[i]``: the unit that sets op ``i``'s output dtype (None: fp32 whatever the plan). A
    promoting op whose inputs all come from units gets a *derived* unit: its dtype is the
    widest of theirs (fp16 only if all give fp16, likewise bf16, else fp32), not a decision.
    ``ext``: the choices of the real units, then of the derived ones.
    """

    def __init__(self, inputs: GroupInputs, choices: list[tuple[Precision, ...]]) -> None:
        rules = inputs.rules
        self.rules = rules
        self.casts = inputs.casts
        self.choices = choices
        n = rules.n
        self.unit_of = [inputs.unit_of.get(o.name) for o in rules.ops]
        self.src: list[int | None] = [None] * n
        self.derived: list[DerivedUnit] = []
        self.ext: list[tuple[Precision, ...]] = list(choices)
        self._find_sources()
        #: per unit (real, then derived), the dtype each of its choices gives out
        self.gives = [tuple(rules.gives_out(p) for p in c) for c in self.ext]
        #: per op, the producers of its float in-edges (in ``in_edges`` order)
        self.producers = [[v for v, _ in edges] for edges in rules.in_edges]
        self.calls: list[Call] = []
        self.call_index: dict[Call, int] = {}
        self.steps: list[tuple[int, Slot, tuple[int, ...], int]] = []
        self.prec: list[Precision | None] = [None] * n
        self.din = [DType.fp32] * n
        self.dout = [DType.fp32] * n
        #: ops whose saved-activation bytes are the maximum over several producers' choices
        self.memory_or = 0

    def schedule(self) -> Schedule:
        for i in range(self.rules.n):
            self.add_op(i)
        return Schedule(choices=self.choices, ext=self.ext, derived=self.derived,
                        unit_of=self.unit_of, calls=self.calls, steps=self.steps,
                        memory_or=self.memory_or, ops=self.rules.ops)

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
        return self.gives[u][k]

    def call(self, kind: int, i: int, u: int = -1, numel: int = 0) -> int:
        """The index of the rules call on op ``i`` in the current dtypes (made once)."""
        dout = self.dout
        ins = tuple([(v, dout[v]) for v in self.producers[i] if dout[v] is not DType.fp32])
        key: Call = (kind, i, self.prec[i], self.din[i], dout[i], ins, u, numel)
        got = self.call_index.get(key)
        if got is None:
            got = self.call_index[key] = len(self.calls)
            self.calls.append(key)
        return got

    def step(self, op: int, s: int | None, ks: int | None, calls: tuple[int, ...],
             comp: int = 0, e: int | None = None, ke: int | None = None) -> None:
        """Record that ``op`` adds ``calls``' results into the term of unit ``s`` at choice
        ``ks`` and, where ``e`` is given, unit ``e`` at ``ke`` (None: not a decision); a
        pair of one unit's two different choices, which no plan has, is dropped."""
        slot: Slot
        if s is None or ks is None:
            slot = () if e is None or ke is None else (e, ke)
        elif e is None or ke is None:
            slot = (s, ks)
        elif s == e:
            slot = (s, ks) if ks == ke else None
        else:
            slot = (s, ks, e, ke) if s < e else (e, ke, s, ks)
        if slot is not None:
            self.steps.append((op, slot, calls, comp))

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
        dout = self.dout
        edges = self.rules.in_edges[i]
        self.setup(i, s, ks)
        for u, _ in edges:
            dout[u] = DType.fp32
        self.step(_ADD_T, s, ks, (self.call(_MS, i),))
        # Working set and weight copy depend on the op's own dtypes only.
        mem = self.call(_MEM, i)
        self.step(_WORK, s, ks, (mem,), 2)
        self.step(_ADD_M, s, ks, (mem,), 1)
        if not self.casts:
            return
        for u, numel in edges:
            eu = self.src[u]
            e_range: list[int | None] = list(range(len(self.ext[eu]))) if eu is not None else [None]
            for ke in e_range:
                if eu is not None and eu == s and ke != ks:
                    continue
                dout[u] = self.out_dtype(eu, ke)
                edge = self.call(_EDGE, i, u, numel)
                dout[u] = DType.fp32
                self.step(_ADD_T_NONZERO, s, ks, (edge,), 0, eu, ke)

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
            vals: list[tuple[tuple[int, ...], int]] = []
            for combo in itertools.product(*[range(len(self.ext[v])) for v in var_edges]):
                assign = dict(zip(var_edges, combo, strict=True))
                for u, _ in edges:
                    eu = src[u]
                    k = ks if eu == s else None if eu is None else assign.get(eu)
                    self.dout[u] = self.out_dtype(eu, k)
                vals.append((combo, self.call(_MEM, i)))
            if len(var_edges) == 1:
                for combo, mem in vals:
                    self.step(_ADD_M, s, ks, (mem,), 0, var_edges[0], combo[0])
            else:
                self.step(_ADD_M_MAX, s, ks, tuple(mem for _, mem in vals), 0)


def schedule_for(inputs: GroupInputs, gi: int, cache: ScheduleCache | None = None
                 ) -> Schedule:
    """Group ``gi``'s :class:`Schedule`, from ``cache`` when one was made for the same graph,
    menu, units, pins and options (then the units' choices are checked again all the same);
    the graph is told by its ops, the very list the schedule was recorded on."""
    rules = inputs.rules
    choices = unit_choices(inputs, gi)
    if cache is None:
        return _Recorder(inputs, choices).schedule()
    key = (id(rules.ops), rules.native_flow, inputs.casts, tuple(inputs.units),
           tuple(inputs.unit_of.items()), tuple(choices))
    got = cache.get(key)
    if got is None or got.ops is not rules.ops:
        got = cache[key] = _Recorder(inputs, choices).schedule()
    return got


def _call_values(rules: CostRules, grp: GroupCosts, calls: Sequence[Call]) -> list[Any]:
    """Every call's result on ``grp``: each op's precision and dtypes set as recorded, the
    others left fp32 (the rules read only the op's own and its in-edges' producers')."""
    n = rules.n
    fp32 = DType.fp32
    prec: list[Precision | None] = [None] * n
    din = [fp32] * n
    dout = [fp32] * n
    op_ms, op_memory, edge_ms = rules.op_ms, rules.op_memory, rules.edge_ms
    out: list[Any] = []
    append = out.append
    for kind, i, p, di, do, ins, u, numel in calls:
        for v, d in ins:
            dout[v] = d
        prec[i], din[i], dout[i] = p, di, do
        if kind == _MS:
            append(op_ms(grp, i, prec, din, dout, []))
        elif kind == _MEM:
            append(op_memory(grp, i, prec, din, dout))
        else:
            append(edge_ms(grp, i, prec, din, dout, u, numel))
        for v, _ in ins:
            dout[v] = fp32
        prec[i], din[i], dout[i] = None, fp32, fp32
    return out


class _Terms:
    """One group's terms as a schedule's steps add into them."""

    def __init__(self, ext: list[tuple[Precision, ...]], mem0: float) -> None:
        self.ext = ext
        self.time0 = 0.0
        self.mem0 = mem0
        self.work0 = 0.0
        self.time1 = [[0.0] * len(c) for c in ext]
        self.mem1 = [[0.0] * len(c) for c in ext]
        self.work1 = [[0.0] * len(c) for c in ext]
        self.pairs: dict[tuple[int, int], PairTerm] = {}

    def add(self, slot: tuple[int, ...], t: float, m: float) -> None:
        if not slot:
            self.time0 += t
            self.mem0 += m
        elif len(slot) == 2:
            u, k = slot
            self.time1[u][k] += t
            self.mem1[u][k] += m
        else:
            a, ka, b, kb = slot
            term = self.pairs.get((a, b))
            if term is None:
                ext = self.ext
                term = self.pairs[(a, b)] = PairTerm(
                    a, b, [[0.0] * len(ext[b]) for _ in ext[a]],
                    [[0.0] * len(ext[b]) for _ in ext[a]])
            term.time[ka][kb] += t
            term.mem[ka][kb] += m

    def apply(self, steps: Sequence[tuple[int, Slot, tuple[int, ...], int]],
              values: Sequence[Any]) -> None:
        """Every step, in order, on the calls' ``values``."""
        time1, mem1, work1, add = self.time1, self.mem1, self.work1, self.add
        for op, slot, calls, comp in steps:
            assert slot is not None  # recorded only with a slot
            if op == _ADD_T:
                if len(slot) == 2:
                    u, k = slot
                    time1[u][k] += values[calls[0]]
                    mem1[u][k] += 0.0
                else:
                    add(slot, values[calls[0]], 0.0)
            elif op == _ADD_M:
                if len(slot) == 2:
                    u, k = slot
                    time1[u][k] += 0.0
                    mem1[u][k] += values[calls[0]][comp]
                else:
                    add(slot, 0.0, values[calls[0]][comp])
            elif op == _WORK:
                work = values[calls[0]][comp]
                if slot:
                    u, k = slot
                    work1[u][k] = max(work1[u][k], work)
                else:
                    self.work0 = max(self.work0, work)
            elif op == _ADD_T_NONZERO:
                t = values[calls[0]]
                if t:
                    add(slot, t, 0.0)
            else:
                add(slot, 0.0, max(values[c][comp] for c in calls))


def additive_times(rules: CostRules, grp: GroupCosts, sched: Schedule
                   ) -> tuple[float, list[list[float]]]:
    """The additive model's time terms: compute only (no input, weight or gradient casts)."""
    time0 = 0.0
    time1 = [[0.0] * len(c) for c in sched.ext]
    for i in range(rules.n):
        u = sched.unit_of[i]
        if u is None:
            f, b = rules.compute_ms(grp, i, None, DType.fp32)
            time0 += f + b
        else:
            for k, p in enumerate(sched.ext[u]):
                f, b = rules.compute_ms(grp, i, p, p.info.gives_out)
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


def group_model(inputs: GroupInputs, gi: int, cache: ScheduleCache | None = None
                ) -> tuple[GroupModel, int]:
    """Group ``gi``'s coefficients, and how many of its ops take their saved-activation
    bytes as the maximum over several producers' choices (an upper bound). ``cache``: the
    schedules of problems made from the same one (their other batches share them)."""
    sched = schedule_for(inputs, gi, cache)
    rules = inputs.rules
    grp = rules.groups[gi]
    terms = _Terms(sched.ext, float(sum(rules.static_memory(grp).values())))
    terms.apply(sched.steps, _call_values(rules, grp, sched.calls))
    time0, time1 = terms.time0, terms.time1
    if not inputs.casts:
        # The additive model: compute only; its memory terms stay those of the real model.
        time0, time1 = additive_times(rules, grp, sched)
        for term in terms.pairs.values():
            term.time = [[0.0] * len(row) for row in term.time]
    spec = inputs.cluster.groups[gi]
    choices = sched.choices
    b = int(spec.batch_per_device or inputs.graph_batch)
    weight = spec.count * b / sum(g.count * int(g.batch_per_device or inputs.graph_batch)
                                  for g in inputs.cluster.groups)
    model = GroupModel(
        name=grp.name, device=grp.device, count=spec.count, batch=b, weight=weight,
        capacity_bytes=grp.capacity * (1 - inputs.memory_headroom),
        usable_bytes=grp.capacity, choices=list(choices), time0=time0, time1=time1,
        mem0=terms.mem0, mem1=terms.mem1, work0=terms.work0, work1=terms.work1,
        omega1=omega_rows(inputs.units, choices, inputs.indicator),
        pairs=[terms.pairs[k] for k in sorted(terms.pairs)],
        reference=reference_choices(choices, inputs.reference),
        derived=list(sched.derived))
    return model, sched.memory_or
