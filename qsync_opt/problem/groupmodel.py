"""One device group's coefficients of the integer program, and the decisions they are over.

:class:`GroupModel` holds, per device group, the unary and pair terms of time, memory,
working set and degradation that :class:`~qsync_opt.problem.program.AllocationProblem`
derives (:mod:`qsync_opt.problem.coefficients`), indexed by decision :class:`Unit` and
choice; :class:`DerivedUnit` is a promoting op whose dtype follows from its inputs'.
:func:`check_finite` refuses coefficients that are not finite numbers, and
:func:`held_at_reference` slices a group down to its reference choices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import DType, Precision
from qsync_opt.costs.rules import PASS_PRECISION, fidelity, widest_precision


@dataclass(frozen=True)
class Unit:
    """One decision: the ops that share it (one op, or a tie group)."""

    name: str
    ops: tuple[str, ...]


@dataclass
class PairTerm:
    """Coefficients of a pair of units (a < b): ``[choice of a][choice of b]``."""

    a: int
    b: int
    time: list[list[float]]
    mem: list[list[float]]


@dataclass(frozen=True)
class DerivedUnit:
    """A promoting op (add, cat) fed only by decision units: its dtype is not chosen but
    follows from theirs (autocast's widest rule). Index ``index`` in the extended unit space;
    ``choices`` are fp32/fp16/bf16 as pass-through precisions."""

    index: int
    op: str
    inputs: tuple[int, ...]
    choices: tuple[Precision, ...]


def widest_choices(inputs: Sequence[tuple[Precision, ...]]) -> tuple[Precision, ...]:
    """The dtypes a promoting op can end up in, given its inputs' choices."""
    can = [{p.info.gives_out for p in c} for c in inputs]
    out = []
    if any(DType.fp32 in c for c in can) or (len(can) > 1 and len(set().union(*can)) > 1):
        out.append(Precision.fp32)
    for dt in (DType.fp16, DType.bf16):
        if all(dt in c for c in can):
            out.append(PASS_PRECISION[dt])
    return tuple(sorted(out, key=fidelity, reverse=True))


@dataclass
class GroupModel:
    """One device group's coefficients. Choice indices refer to ``choices[u]``, which lists
    the unit's precisions from the most exact to the least."""

    name: str
    device: str
    count: int
    batch: int
    weight: float  # share of the global batch
    capacity_bytes: float  # usable memory * (1 - headroom)
    usable_bytes: int
    choices: list[tuple[Precision, ...]]
    time0: float
    time1: list[list[float]]
    mem0: float
    mem1: list[list[float]]
    work0: float
    work1: list[list[float]]
    omega1: list[list[float]]
    pairs: list[PairTerm]
    reference: list[int]
    derived: list[DerivedUnit] = field(default_factory=list)

    @property
    def n_units(self) -> int:
        """Real decisions; derived units follow them in time1/mem1/work1 and pair indices."""
        return len(self.choices)

    @property
    def all_choices(self) -> list[tuple[Precision, ...]]:
        return list(self.choices) + [d.choices for d in self.derived]

    def complete(self, a: Sequence[int]) -> list[int]:
        """Extend an assignment of the real units with the derived units' choices."""
        full = list(a)
        if len(full) != len(self.choices):
            raise ValueError(f"assignment has {len(full)} choices, expected {len(self.choices)}")
        for d in self.derived:
            full.append(self.derived_choice(d, full))
        return full

    def derived_choice(self, d: DerivedUnit, full: Sequence[int]) -> int:
        """Derived unit ``d``'s choice index given its inputs' choices in ``full``."""
        ext = self.all_choices
        dtypes = {ext[u][full[u]].info.gives_out for u in d.inputs}
        return d.choices.index(widest_precision(dtypes))

    def time_ms(self, a: Sequence[int]) -> float:
        a = self.complete(a) if self.derived else a
        t = self.time0 + sum(row[c] for row, c in zip(self.time1, a, strict=True))
        return t + sum(p.time[a[p.a]][a[p.b]] for p in self.pairs)

    def memory_bytes(self, a: Sequence[int]) -> float:
        a = self.complete(a) if self.derived else a
        m = self.mem0 + sum(row[c] for row, c in zip(self.mem1, a, strict=True))
        m += sum(p.mem[a[p.a]][a[p.b]] for p in self.pairs)
        work = max([self.work0] + [row[c] for row, c in zip(self.work1, a, strict=True)])
        return m + work

    def derived_rows(self) -> list[tuple[int, int, list[list[tuple[int, int]]]]]:
        """The derived units' definition as AND rows, for the exact backends.

        One entry ``(d, k, inputs)`` per derived unit ``d`` and each 16-bit choice ``k`` of
        it: ``inputs`` lists, per input unit, the ``(unit, choice)`` pairs giving that dtype.
        With S_i the sum of those x of input i: ``x[d,k] <= S_i`` for every i and
        ``x[d,k] >= sum_i S_i - (len(inputs) - 1)``; with one-hot rows on ``d`` this fixes
        ``d`` exactly (fp32 is the rest). An input that can never give it forces ``x[d,k] = 0``.
        """
        ext = self.all_choices
        rows = []
        for d in self.derived:
            for k, p in enumerate(d.choices):
                if p == Precision.fp32:
                    continue
                dt = p.info.gives_out
                rows.append((d.index, k, [[(u, j) for j, q in enumerate(ext[u])
                                           if q.info.gives_out == dt] for u in d.inputs]))
        return rows

    def degradation(self, a: Sequence[int]) -> float:
        return sum(row[c] for row, c in zip(self.omega1, a, strict=True))

    def lowest(self) -> list[int]:
        return [len(c) - 1 for c in self.choices]


def check_finite(groups: Sequence[GroupModel], unit_names: Sequence[str] | None = None) -> None:
    """Refuse (one line, naming the group, the quantity and the op) any coefficient the
    solvers would be given that is not a finite number: Infinity or NaN in a cost, a
    capacity or an indicator value would otherwise reach the solvers' scaling."""

    def name(u: int) -> str:
        return (unit_names[u] if unit_names is not None and u < len(unit_names)
                else f"unit {u}")

    def bad(v: object) -> bool:
        return not isinstance(v, (int, float)) or not math.isfinite(v)

    for g in groups:
        where = f"group {g.name}"
        for what, v in (("weight", g.weight), ("capacity_bytes", g.capacity_bytes),
                        ("time0 (fixed time, ms)", g.time0), ("mem0 (fixed memory, bytes)",
                                                              g.mem0),
                        ("work0 (working set, bytes)", g.work0)):
            if bad(v):
                raise QsyncInputError(f"{where}: {what} is {v!r}; expected a finite number "
                                      "(check the costs and cluster files)")
        for what, rows in (("time cost (ms)", g.time1), ("memory cost (bytes)", g.mem1),
                           ("working set (bytes)", g.work1),
                           ("indicator value (Omega)", g.omega1)):
            for u, row in enumerate(rows):
                for v in row:
                    if bad(v):
                        raise QsyncInputError(
                            f"{where}, op {name(u)}: {what} is {v!r}; expected a finite "
                            "number (check the costs and indicator files)")
        for p in g.pairs:
            for what, mat in (("cast time (ms)", p.time), ("cast memory (bytes)", p.mem)):
                if any(bad(v) for row in mat for v in row):
                    raise QsyncInputError(
                        f"{where}, ops {name(p.a)} -> {name(p.b)}: a {what} is not a finite "
                        "number (check the costs file)")


def held_at_reference(g: GroupModel) -> GroupModel:
    """``g`` with every real unit held at its reference choice (one choice each); a derived
    unit keeps the choices its inputs can still give. The coefficients are sliced from
    ``g``'s, not rebuilt, so any assignment of the held group costs what it costs in ``g``;
    pair terms left with one choice on a side become unary (or constant) terms."""
    n_real = len(g.choices)
    keep: list[list[int]] = [[r] for r in g.reference]
    ext: list[tuple[Precision, ...]] = [(g.choices[u][r],) for u, r in enumerate(g.reference)]
    derived = []
    for d in g.derived:
        can = set(widest_choices([ext[u] for u in d.inputs]))
        k = [i for i, p in enumerate(d.choices) if p in can]
        keep.append(k)
        ext.append(tuple(d.choices[i] for i in k))
        derived.append(dataclasses.replace(d, choices=ext[-1]))

    def cut(rows: list[list[float]]) -> list[list[float]]:
        return [[row[i] for i in k] for row, k in zip(rows, keep, strict=True)]

    time0, mem0 = g.time0, g.mem0
    time1, mem1, work1 = cut(g.time1), cut(g.mem1), cut(g.work1)
    pairs = []
    for p in g.pairs:
        t = [[p.time[i][j] for j in keep[p.b]] for i in keep[p.a]]
        m = [[p.mem[i][j] for j in keep[p.b]] for i in keep[p.a]]
        if len(t) == 1 and len(t[0]) == 1:
            time0 += t[0][0]
            mem0 += m[0][0]
        elif len(t) == 1:
            time1[p.b] = [x + y for x, y in zip(time1[p.b], t[0], strict=True)]
            mem1[p.b] = [x + y for x, y in zip(mem1[p.b], m[0], strict=True)]
        elif len(t[0]) == 1:
            time1[p.a] = [x + row[0] for x, row in zip(time1[p.a], t, strict=True)]
            mem1[p.a] = [x + row[0] for x, row in zip(mem1[p.a], m, strict=True)]
        else:
            pairs.append(PairTerm(p.a, p.b, t, m))
    return dataclasses.replace(
        g, choices=ext[:n_real], time0=time0, time1=time1, mem0=mem0, mem1=mem1, work1=work1,
        omega1=[[row[r]] for row, r in zip(g.omega1, g.reference, strict=True)], pairs=pairs,
        reference=[0] * n_real, derived=derived)


def scale_time(g: GroupModel, factor: float) -> GroupModel:
    """``g`` with every time term (constant, unary, pair) multiplied by ``factor``: the
    group's compute measured ``factor`` times slower than its costs say. Memory, working
    set and degradation are unchanged; ``factor`` 1 gives ``g`` itself."""
    if factor == 1.0:
        return g
    return dataclasses.replace(
        g, time0=g.time0 * factor, time1=[[v * factor for v in row] for row in g.time1],
        pairs=[dataclasses.replace(p, time=[[v * factor for v in row] for row in p.time])
               for p in g.pairs])
