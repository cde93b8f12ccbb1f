"""The integer program, written once: variables, named rows per equation family, and an
objective, built from an :class:`~qsync_opt.problem.program.AllocationProblem` (or some of its
groups). The backends translate it (:mod:`.pulp_model` into PuLP for CBC and HiGHS,
:mod:`.cpsat` into CP-SAT's integers); nothing here knows a solver.

Per device group ``g`` (choice indices into ``GroupModel.choices[u]``; the derived units of
promoting ops follow the real ones), in physical units (ms, bytes, ``w * Omega``)::

    min  sum_u w_g * Omega_u[k] x[u,k]                              (degradation, real units)
      or time0 + sum t1 x + sum t_p y                                (time: no time row)
      or mem0 + sum m1 x + sum m_p y + W                             (memory: no time row)
    s.t. one_hot      sum_k x[u,k] = 1                              (x binary)
         derived_and  sum_{(u,j) in S_i} x[u,j] - x[d,k] >= 0        (derived d = AND of inputs)
         derived_all  sum_i S_i - x[d,k] <= n - 1
         pair_a       sum_kb y[p,ka,kb] - x[a,ka] = 0                (pair p = (a, b), y >= 0)
         pair_b       sum_ka y[p,ka,kb] - x[b,kb] = 0
         working_set  W - sum_k work1[u][k] x[u,k] >= 0             (W >= work0: its bound)
         time         time0 + sum t1 x + sum t_p y <= target - tail  (the group's budget)
         memory       mem0 + sum m1 x + sum m_p y + W <= capacity

The marginal rows make ``y`` the product of the two one-hot rows for any binary ``x``, so
``y`` need not be integer. Pair terms whose time and memory matrices are all zero are left
out, as are working-set rows that can never exceed ``work0``. Rows keep their zero
coefficients (each backend drops what it does not need); a row reads ``constant + sum
terms <sense> rhs`` and carries ``scale``, the size of its quantity (the group budget, the
capacity), by which a floating-point backend normalises it. A forbidden choice (no plan
better than a known one takes it) is a variable with upper bound 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from qsync_opt.problem.groupmodel import GroupModel
from qsync_opt.problem.program import AllocationProblem

#: The equation families, in the order a group's rows are written.
FAMILIES = ("one_hot", "derived_and", "derived_all", "pair_a", "pair_b", "working_set",
            "time", "memory")
#: The objectives a formulation can carry.
OBJECTIVES = ("degradation", "time", "memory")

Family = Literal["one_hot", "derived_and", "derived_all", "pair_a", "pair_b", "working_set",
                 "time", "memory"]
ObjectiveKind = Literal["degradation", "time", "memory"]
Sense = Literal["==", "<=", ">="]
VarKind = Literal["binary", "continuous"]


def ext_choices(g: GroupModel) -> list[tuple[object, ...]]:
    """Choices of every unit of the program: the real units, then the derived units."""
    return list(g.all_choices) if g.derived else list(g.choices)


def complete(g: GroupModel, a: Sequence[int]) -> list[int]:
    """A real assignment extended with the derived units' (implied) choices."""
    return g.complete(a) if g.derived else list(a)


def derived_rows(g: GroupModel) -> list[tuple[int, int, list[list[tuple[int, int]]]]]:
    """AND rows tying each derived unit's 16-bit choices to its inputs' choices."""
    return g.derived_rows() if g.derived else []


def active_pairs(g: GroupModel) -> list[int]:
    """Indices of the pair terms with any nonzero time or memory coefficient."""
    return [i for i, p in enumerate(g.pairs)
            if any(v for row in p.time for v in row) or any(v for row in p.mem for v in row)]


def work_rows(g: GroupModel) -> list[int]:
    """Units whose working set can exceed ``work0`` (the only W rows needed)."""
    return [u for u, row in enumerate(g.work1) if row and max(row) > g.work0]


#: A choice is left out as hopeless only when it exceeds the budget or capacity by this
#: relative margin over every assignment (far above every backend's tolerance).
HOPELESS_REL = 1e-6


@dataclass(frozen=True)
class Hopeless:
    """What no feasible assignment of a group takes (each alone, with every other term at
    its least, exceeds the budget or the capacity): (unit, choice) pairs, (pair, choice a,
    choice b) combinations. They are fixed to 0 with coefficient 0, so an extreme but
    finite cost (1e300 ms) never reaches a solver's numerics or CP-SAT's integers, and the
    feasible set is the same."""

    units: frozenset[tuple[int, int]]
    pairs: frozenset[tuple[int, int, int]]


def hopeless_choices(g: GroupModel, budget: float | None) -> Hopeless:
    """The group's hopeless choices against its time ``budget`` (None: no time row) and its
    capacity (see :class:`Hopeless`)."""
    pis = active_pairs(g)
    units: set[tuple[int, int]] = set()
    pairs: set[tuple[int, int, int]] = set()

    def mark(bound: float, low: float, rows: Sequence[Sequence[float]],
             pair_rows: Sequence[Sequence[Sequence[float]]]) -> None:
        slack = bound - low + HOPELESS_REL * max(abs(bound), abs(low))
        for u, row in enumerate(rows):
            least = min(row, default=0.0)
            units.update((u, k) for k, v in enumerate(row) if v - least > slack)
        for pi, m in zip(pis, pair_rows, strict=True):
            least = min((v for r in m for v in r), default=0.0)
            pairs.update((pi, ka, kb) for ka, r in enumerate(m) for kb, v in enumerate(r)
                         if v - least > slack)

    def least(rows: Sequence[Sequence[float]], pair_rows: Sequence[Sequence[Sequence[float]]]
              ) -> float:
        return (sum(min(r) for r in rows if r)
                + sum(min((v for r in m for v in r), default=0.0) for m in pair_rows))

    if budget is not None:
        pt = [g.pairs[pi].time for pi in pis]
        mark(budget, g.time0 + least(g.time1, pt), g.time1, pt)
    pm = [g.pairs[pi].mem for pi in pis]
    summed = g.mem0 + least(g.mem1, pm)
    work = max([g.work0] + [min(r) for r in g.work1 if r])
    mark(g.capacity_bytes, summed + work, g.mem1, pm)
    slack = g.capacity_bytes - summed + HOPELESS_REL * max(abs(g.capacity_bytes), abs(summed))
    units.update((u, k) for u, row in enumerate(g.work1) for k, v in enumerate(row)
                 if v > slack)
    return Hopeless(frozenset(units), frozenset(pairs))


def row_scale(v: float) -> float:
    """The normalising scale of a row bounded by ``v`` (1 for a bound of ~0)."""
    return abs(v) if abs(v) > 1e-300 else 1.0


@dataclass
class Variable:
    """One variable. ``unit``: the size of one of its units in a floating-point backend
    (the working set ``W`` is in bytes and expressed there in units of the capacity)."""

    name: str
    kind: VarKind
    lb: float
    ub: float | None
    unit: float = 1.0


@dataclass
class Row:
    """``constant + sum(coef * var) <sense> rhs``, one equation of family ``family``."""

    family: Family
    name: str
    terms: list[tuple[int, float]]  # (variable index, coefficient)
    sense: Sense
    rhs: float
    constant: float = 0.0
    scale: float = 1.0
    block: int = 0  # index into Formulation.blocks


@dataclass
class Objective:
    """What is minimised: ``constant + sum(coef * var)`` in the kind's units (``w * Omega``,
    ms, bytes). ``scale``: the row scale a floating-point backend normalises time or memory
    terms by (1 for degradation)."""

    kind: ObjectiveKind
    terms: list[tuple[int, float]]
    constant: float = 0.0
    scale: float = 1.0


@dataclass
class Block:
    """One group's part of the program: its variable and row indices."""

    gi: int
    group: GroupModel
    x: list[list[int]]  # variable index per unit (real, then derived) and choice
    pairs: list[tuple[int, list[list[int]]]]  # (pair index, y[ka][kb] variable indices)
    w: int
    rows: list[int]
    time_row: int | None  # None when the objective is the time
    mem_row: int
    time_scale: float
    mem_scale: float
    forbid: frozenset[tuple[int, int]] = frozenset()

    @property
    def n_real(self) -> int:
        return len(self.group.choices)


@dataclass
class Formulation:
    """The program of some groups of a problem: variables, rows, objective, and per group
    the :class:`Block` that says which of them are its."""

    variables: list[Variable] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    objective: Objective = field(default_factory=lambda: Objective("degradation", []))
    budget: float = 0.0

    @property
    def n_variables(self) -> int:
        return len(self.variables)

    @property
    def n_constraints(self) -> int:
        return len(self.rows)

    def families(self) -> dict[str, list[str]]:
        """Row names by family (every family of :data:`FAMILIES`, empty ones included)."""
        out: dict[str, list[str]] = {f: [] for f in FAMILIES}
        for r in self.rows:
            out[r.family].append(r.name)
        return out

    def rows_of(self, family: str) -> list[Row]:
        return [r for r in self.rows if r.family == family]

    def _var(self, name: str, kind: VarKind, lb: float, ub: float | None,
             unit: float = 1.0) -> int:
        self.variables.append(Variable(name, kind, lb, ub, unit))
        return len(self.variables) - 1

    def _row(self, family: Family, name: str, terms: list[tuple[int, float]], sense: Sense,
             rhs: float, block: int, constant: float = 0.0, scale: float = 1.0) -> int:
        self.rows.append(Row(family, name, terms, sense, rhs, constant, scale, block))
        return len(self.rows) - 1

    def point(self, assignments: Mapping[str, Sequence[int]]) -> dict[int, float]:
        """Every variable's value at the given choices (per group name, real units; groups
        not named are left out): x one-hot, y the products, W the largest working set. For
        warm starts."""
        out: dict[int, float] = {}
        for b in self.blocks:
            g = b.group
            if g.name not in assignments:
                continue
            a = complete(g, assignments[g.name])
            for u, row in enumerate(b.x):
                for k, v in enumerate(row):
                    out[v] = 1.0 if a[u] == k else 0.0
            for pi, y in b.pairs:
                p = g.pairs[pi]
                for ka, yrow in enumerate(y):
                    for kb, v in enumerate(yrow):
                        out[v] = 1.0 if (a[p.a] == ka and a[p.b] == kb) else 0.0
            out[b.w] = max([g.work0] + [row[c] for row, c in zip(g.work1, a, strict=True)])
        return out

    def value(self, point: Mapping[int, float]) -> float:
        """The objective at ``point`` (variable values)."""
        return self.objective.constant + sum(c * point[v] for v, c in self.objective.terms)

    def violations(self, point: Mapping[int, float], tol: float = 1e-9) -> list[str]:
        """Names of the rows ``point`` violates (beyond ``tol`` of each row's scale)."""
        bad = []
        for r in self.rows:
            lhs = r.constant + sum(c * point[v] for v, c in r.terms)
            slack = tol * r.scale
            if (r.sense == "==" and abs(lhs - r.rhs) > slack
                    or r.sense == "<=" and lhs > r.rhs + slack
                    or r.sense == ">=" and lhs < r.rhs - slack):
                bad.append(r.name)
        return bad


def _add_pairs(form: Formulation, g: GroupModel, gi: int, bi: int, x: list[list[int]],
               hopeless: frozenset[tuple[int, int, int]],
               rows: list[int]) -> tuple[list[tuple[int, list[list[int]]]],
                                         list[tuple[int, float]], list[tuple[int, float]]]:
    """Group ``g``'s pair variables ``y`` (a hopeless combination's bounded to 0) and their
    marginal rows (appended to ``rows``); the pairs' variables and time and memory terms."""
    pair_vars: list[tuple[int, list[list[int]]]] = []
    pair_time: list[tuple[int, float]] = []
    pair_mem: list[tuple[int, float]] = []
    for pi in active_pairs(g):
        p = g.pairs[pi]
        xa, xb = x[p.a], x[p.b]
        y = [[form._var(f"y{gi}_{pi}_{ka}_{kb}", "continuous", 0.0,
                        0.0 if (pi, ka, kb) in hopeless else None)
              for kb in range(len(xb))] for ka in range(len(xa))]
        for ka, yrow in enumerate(y):
            rows.append(form._row("pair_a", f"ma{gi}_{pi}_{ka}",
                                  [(v, 1.0) for v in yrow] + [(xa[ka], -1.0)], "==", 0.0, bi))
            for kb, v in enumerate(yrow):
                out = (pi, ka, kb) in hopeless
                pair_time.append((v, 0.0 if out else p.time[ka][kb]))
                pair_mem.append((v, 0.0 if out else p.mem[ka][kb]))
        for kb in range(len(xb)):
            rows.append(form._row("pair_b", f"mb{gi}_{pi}_{kb}",
                                  [(y[ka][kb], 1.0) for ka in range(len(xa))] + [(xb[kb], -1.0)],
                                  "==", 0.0, bi))
        pair_vars.append((pi, y))
    return pair_vars, pair_time, pair_mem


def add_group(form: Formulation, g: GroupModel, gi: int, budget: float,
              objective: ObjectiveKind = "degradation",
              forbid: frozenset[tuple[int, int]] = frozenset()) -> Block:
    """Append group ``g``'s variables and rows (named with ``gi``) to ``form``; its part
    of the objective goes to ``form.objective`` (of kind ``objective``: with "time" or
    "memory" there is no time row)."""
    bi = len(form.blocks)
    ts = row_scale(budget)
    ms = row_scale(g.capacity_bytes)
    obj = form.objective
    rows: list[int] = []
    x: list[list[int]] = []
    time_terms: list[tuple[int, float]] = []
    mem_terms: list[tuple[int, float]] = []
    n_real = len(g.choices)
    ext = ext_choices(g)
    hope = hopeless_choices(g, budget if objective == "degradation" else None)
    forbid = forbid | hope.units
    for u, ch in enumerate(ext):
        row = [form._var(f"x{gi}_{u}_{k}", "binary", 0.0, 0.0 if (u, k) in forbid else 1.0)
               for k in range(len(ch))]
        x.append(row)
        t1, m1 = g.time1[u], g.mem1[u]
        for k, v in enumerate(row):
            out = (u, k) in hope.units  # fixed to 0: its coefficient need not be carried
            time_terms.append((v, 0.0 if out else t1[k]))
            mem_terms.append((v, 0.0 if out else m1[k]))
        if objective == "degradation" and u < n_real:
            obj.terms.extend((v, g.weight * om) for v, om in zip(row, g.omega1[u], strict=True))
    for u, row in enumerate(x):
        rows.append(form._row("one_hot", f"one{gi}_{u}", [(v, 1.0) for v in row], "==", 1.0, bi))
    for r, (d, k, inputs) in enumerate(derived_rows(g)):
        xd = x[d][k]
        sums = [[(x[u][j], 1.0) for u, j in opts] for opts in inputs]
        for i, terms in enumerate(sums):
            rows.append(form._row("derived_and", f"dand{gi}_{r}_{i}", [*terms, (xd, -1.0)],
                                  ">=", 0.0, bi))
        rows.append(form._row("derived_all", f"dall{gi}_{r}",
                              [t for ts_ in sums for t in ts_] + [(xd, -1.0)], "<=",
                              float(len(inputs) - 1), bi))
    pair_vars, pair_time, pair_mem = _add_pairs(form, g, gi, bi, x, hope.pairs, rows)
    time_terms += pair_time
    mem_terms += pair_mem
    w = form._var(f"w{gi}", "continuous", g.work0, None, unit=ms)
    for u in work_rows(g):
        terms = [(v, 0.0 if (u, k) in hope.units else -g.work1[u][k])
                 for k, v in enumerate(x[u])]
        terms.append((w, 1.0))
        rows.append(form._row("working_set", f"w{gi}_{u}", terms, ">=", 0.0, bi, scale=ms))
    mem_terms.append((w, 1.0))
    time_row: int | None = None
    if objective == "degradation":
        time_row = form._row("time", f"time{gi}", time_terms, "<=", budget, bi,
                             constant=g.time0, scale=ts)
        rows.append(time_row)
    elif objective == "time":
        obj.terms.extend(time_terms)
        obj.constant += g.time0
        obj.scale = ts
    else:
        obj.terms.extend(mem_terms)
        obj.constant += g.mem0
        obj.scale = ms
    mem_row = form._row("memory", f"mem{gi}", mem_terms, "<=", g.capacity_bytes, bi,
                        constant=g.mem0, scale=ms)
    rows.append(mem_row)
    block = Block(gi, g, x, pair_vars, w, rows, time_row, mem_row, ts, ms, frozenset(forbid))
    form.blocks.append(block)
    return block


def formulate(problem: AllocationProblem, gis: Sequence[int] | None = None, *,
              objective: ObjectiveKind = "degradation",
              forbid: Mapping[int, frozenset[tuple[int, int]]] | None = None,
              budget: float | None = None) -> Formulation:
    """The program of the groups ``gis`` (all by default) of ``problem``: the time rows
    bound each group by ``budget`` (the problem's group budget by default). ``forbid``: per
    group index, (unit, choice) pairs fixed to 0."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective: expected one of {', '.join(OBJECTIVES)}, got {objective!r}")
    b = problem.group_budget_ms() if budget is None else budget
    form = Formulation(objective=Objective(objective, []), budget=b)
    for gi in (range(len(problem.groups)) if gis is None else gis):
        add_group(form, problem.groups[gi], gi, b, objective, (forbid or {}).get(gi, frozenset()))
    return form


def formulate_group(g: GroupModel, gi: int, *, objective: ObjectiveKind,
                    budget: float = 1.0) -> Formulation:
    """The program of one group on its own (e.g. a copy with another capacity)."""
    form = Formulation(objective=Objective(objective, []), budget=budget)
    add_group(form, g, gi, budget, objective)
    return form
