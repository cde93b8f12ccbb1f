"""The exact program in OR-Tools CP-SAT (Boolean x and y, integer coefficients).

The model is a translation of :mod:`.formulation`'s program (one-hot ``x``, pair variables
``y`` tied to ``x`` by their marginal rows, AND rows for derived units, the working set
``W`` as an integer variable), in two steps: :func:`integer_group` turns each group's block
of the formulation into integers (the rounding below, its scale factors and slacks kept in
:class:`Scaling` and recorded in the report's options and messages), then
:meth:`CpSat._build` writes the rows of the chosen groups, family by family (one-hot rows
become ``add_exactly_one``). The scaling is explicit:

* time in units of ``time_unit_ms``, a power of ten that puts the group budget between 1e8
  and 1e9 units; memory in units of ``mem_unit_bytes``, likewise for the smallest capacity.
  (With 1e6-1e7 units the rounding slack of ~1000 terms reached 5e-4 of the budget on a
  600-op model and cost optimality; 1e8-1e9 keeps every sum far inside int64 and solves as
  fast.)
* the objective ``weight * Omega`` is scaled by ``omega_scale`` (a power of ten that keeps
  the largest possible total below 1e15; int64 holds 9.2e18) and rounded to nearest;
  ``max_objective_error`` bounds ``|scaled / omega_scale - exact|`` for any assignment.
  An OPTIMAL plan whose rounding error could exceed the relative gap of its objective
  (Omegas of very different sizes) is re-solved without the choices whose Omega alone
  exceeds the plan's, on a scale fitted to what is left; if that does not prove it, it is
  FEASIBLE.
* every coefficient is at most 2**50 units; a number beyond that (or not finite) is
  refused, naming the quantity, and a capacity or budget no assignment can reach is
  replaced by one just above what any assignment takes (exact: the row never binds).
* the **inner** model rounds every time and memory cost up (ceil) and every budget and
  capacity down (floor): every assignment it accepts is feasible in the exact
  floating-point model. It may lose assignments within ``max_time_slack_ms`` of the budget
  or ``max_mem_slack_bytes`` of the capacity (both computed term by term from the actual
  rounding, and recorded in the report's options).
* the **outer** model rounds costs down and bounds (with the tolerance ``FEAS_REL``) up: it
  accepts every exactly feasible assignment, so its optimum bounds the exact one and its
  infeasibility proves the problem's.

Each program is solved on the outer model first; if its optimum is feasible in the exact
model (``GroupModel.time_ms`` / ``memory_bytes``, relative tolerance ``FEAS_REL``) it is the
exact optimum (up to ``2 * max_objective_error``). Otherwise the optimum sits within the
rounding slack of a bound, and the inner model gives the plan (status OPTIMAL only if it
meets the outer bound within the gap). Either way the exact objective of CP-SAT's plan is
at most the optimum of the problem with the budget reduced by ``max_time_slack_ms`` and the
capacity by ``max_mem_slack_bytes``, plus ``2 * max_objective_error`` and the relative gap;
the reported bound (the outer model's) is a bound on the exact problem.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import QsyncInputError
from ..problem import AllocationProblem
from ..schemas import Plan, SolveReport
from . import common
from .base import SolveOptions
from .common import (
    FEAS_REL,
    MAX_RESCALES,
    Deadline,
    PartResult,
    Stopwatch,
    cheap_infeasibility,
    check_numbers,
    exact_violation,
    excluded_choices,
    finish,
    infeasible_messages,
    mode_text,
    part_floor,
    part_objective,
    program_parts,
    solve_parts,
)
from .formulation import Block, Formulation, formulate
from .warmstart import start_hints

#: Target range of the scaled budget / capacity (units) and of the scaled objective total.
_UNITS_LOW = 1e8
_OBJECTIVE_MAX = 1e15
#: The largest |coefficient| in units CP-SAT is given (2**50: exact in a double, so the
#: rounding loops below settle within a step, and sums of 8000 such terms stay inside
#: int64). A cost beyond it (more than ~1e7 times the budget or the smallest capacity)
#: cannot be scaled with the precision the budget needs: refused, naming the quantity.
_INT_LIMIT = float(2 ** 50)
#: The decimal exponents a unit may take (10**-300 .. 10**300: never 0, never inf).
_EXP_RANGE = 300


def _quotient(v: float, unit: float, what: str) -> float:
    """``v / unit``, refused (one line, naming ``what``) when ``v`` is not finite or the
    quotient is beyond :data:`_INT_LIMIT` units."""
    q = v / unit
    if not math.isfinite(v) or not math.isfinite(q) or abs(q) > _INT_LIMIT:
        raise QsyncInputError(
            f"{what}: {v!r} cannot be scaled to CP-SAT's integers (a finite value within "
            f"{_INT_LIMIT * unit:.6g} is needed at this problem's scale, {unit:g} per unit); "
            "highs or cbc solve it in floating point")
    return q


def _up(v: float, unit: float, what: str = "coefficient") -> int:
    """The least integer r with r * unit >= v (checked in floating point; at most a few
    steps: |v / unit| <= 2**50, where consecutive multiples of ``unit`` differ)."""
    r = math.ceil(_quotient(v, unit, what))
    for _ in range(4):
        if r * unit >= v:
            break
        r += 1
    for _ in range(4):
        if (r - 1) * unit < v:
            break
        r -= 1
    return r


def _down(v: float, unit: float, what: str = "coefficient") -> int:
    """The greatest integer r with r * unit <= v (bounded like :func:`_up`)."""
    r = math.floor(_quotient(v, unit, what))
    for _ in range(4):
        if r * unit <= v:
            break
        r -= 1
    for _ in range(4):
        if (r + 1) * unit > v:
            break
        r += 1
    return r


def _decade_unit(span: float, units: float = _UNITS_LOW) -> float:
    """A power of ten that puts ``span`` between ``units`` and ``10 * units`` units
    (the exponent kept within +-300, so the unit is never 0 or infinite)."""
    if not span > 0 or not math.isfinite(span):
        return 1.0
    exp = math.floor(math.log10(span)) - round(math.log10(units))
    return 10.0 ** max(-_EXP_RANGE, min(_EXP_RANGE, exp))


@dataclass
class Scaling:
    time_unit_ms: float
    mem_unit_bytes: float
    omega_scale: float
    max_time_slack_ms: float = 0.0
    max_mem_slack_bytes: float = 0.0
    max_objective_error: float = 0.0

    def to_json(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass
class _IntGroup:
    """One group's coefficients, in integers."""

    time1: list[list[int]]
    mem1: list[list[int]]
    obj1: list[list[int]]
    pairs: list[tuple[int, list[list[int]], list[list[int]]]]  # (pair index, time, mem)
    work0: int
    work1: dict[int, list[int]]  # only the rows that can exceed work0
    time_rhs: int  # floor(budget) - ceil(time0)
    mem_rhs: int  # floor(capacity) - ceil(mem0)
    obj_min: float  # the least possible exact objective (sum of row minima), a trivial bound
    obj_err: float  # max |scaled / omega_scale - exact| over the group's assignments
    forbid: frozenset[tuple[int, int]]  # (unit, choice) fixed to 0
    form: Formulation  # what was translated
    block: Block


def scaling_for(problem: AllocationProblem, units: float = _UNITS_LOW) -> Scaling:
    """The units: the budget and the smallest capacity between ``units`` and 10x as many
    (``SolveOptions.extra["cpsat_units"]`` overrides it, e.g. coarse units in tests).
    Numbers that are not finite are refused here, naming the quantity (one line)."""
    if not (isinstance(units, (int, float)) and 1.0 <= units <= 1e12):
        raise QsyncInputError(f"cpsat_units: expected a number in [1, 1e12], got {units!r}")
    check_numbers(problem)
    budget = problem.group_budget_ms()
    if not budget > 0:
        budget = max([abs(g.time0) for g in problem.groups]
                     + [abs(v) for g in problem.groups for r in g.time1 for v in r] + [1e-9])
    caps = [g.capacity_bytes for g in problem.groups if g.capacity_bytes > 0]
    cap = min(caps) if caps else 1.0
    total = sum(abs(g.weight) * max(abs(v) for v in r) for g in problem.groups
                for r in g.omega1 if r)
    if not math.isfinite(total):
        raise QsyncInputError(f"indicator: the weighted sum of the largest values is {total!r}; "
                              "expected a finite number")
    return Scaling(_decade_unit(budget, units), _decade_unit(cap, units), _omega_scale(total))


def _omega_scale(total: float) -> float:
    """The power of ten that keeps an objective total of ``total`` below 1e15 units."""
    if not total > 0:
        return 1.0
    return 10.0 ** max(-_EXP_RANGE, min(_EXP_RANGE,
                                        math.floor(math.log10(_OBJECTIVE_MAX / total))))


def _never_binding(bound: float, most: float, unit: float) -> float:
    """``bound``, or, when it exceeds ``most`` (what any assignment reaches) by far, a value
    just above ``most``: the row then accepts every assignment either way."""
    if math.isfinite(most) and bound > 2 * abs(most) + 4 * unit:
        return 2 * abs(most) + 4 * unit
    return bound


@dataclass
class _Numbers:
    """One block's coefficients read back from the formulation, per unit and pair (the
    layout the rounding works on): exact, in ms and bytes."""

    name: str
    capacity_bytes: float
    weight_omega: list[list[float]]  # real units: w * Omega
    time0: float
    time1: list[list[float]]
    mem0: float
    mem1: list[list[float]]
    pairs: list[tuple[int, list[list[float]], list[list[float]]]]  # active pairs only
    work0: float
    work1: dict[int, list[float]]  # the working-set rows


def block_numbers(form: Formulation, b: Block) -> _Numbers:
    """The coefficients of block ``b``'s rows and objective, by unit and pair."""
    if b.time_row is None:
        raise ValueError("CP-SAT translates the degradation objective with its time row")
    trow, mrow = form.rows[b.time_row], form.rows[b.mem_row]
    tc, mc, oc = dict(trow.terms), dict(mrow.terms), dict(form.objective.terms)
    unit_of = {v: u for u, row in enumerate(b.x) for v in row}
    work1: dict[int, list[float]] = {}
    for ri in b.rows:
        r = form.rows[ri]
        if r.family == "working_set":
            u = unit_of[r.terms[0][0]]
            work1[u] = [-c for _, c in r.terms[:-1]]
    return _Numbers(
        b.group.name, mrow.rhs, [[oc[v] for v in b.x[u]] for u in range(b.n_real)],
        trow.constant, [[tc[v] for v in row] for row in b.x], mrow.constant,
        [[mc[v] for v in row] for row in b.x],
        [(pi, [[tc[v] for v in yrow] for yrow in y], [[mc[v] for v in yrow] for yrow in y])
         for pi, y in b.pairs],
        form.variables[b.w].lb, work1)


def _time_max(n: _Numbers) -> float:
    """The most time any assignment takes (each term at its largest)."""
    return (n.time0 + sum(max(r) for r in n.time1 if r)
            + sum(max(max(row) for row in pt) for _, pt, _ in n.pairs if pt and pt[0]))


def _memory_max(n: _Numbers) -> float:
    """The most memory any assignment takes (each term at its largest)."""
    return (n.mem0 + sum(max(r) for r in n.mem1 if r)
            + sum(max(max(row) for row in pm) for _, _, pm in n.pairs if pm and pm[0])
            + max([n.work0] + [max(r) for r in n.work1.values() if r]))


def integer_group(form: Formulation, b: Block, sc: Scaling, outer: bool = False
                  ) -> tuple[_IntGroup, float, float, float]:
    """The translation of block ``b`` of ``form`` into integers: its coefficients and its
    time slack (ms), memory slack (bytes) and objective error bound.

    ``outer=False`` (the inner model): costs rounded up, budget and capacity down, so every
    assignment it accepts is feasible in the exact model; the slacks bound what it may lose.
    ``outer=True``: costs rounded down, bounds (with the tolerance ``FEAS_REL``) up, so it
    accepts every exactly feasible assignment (a relaxation: its optimum bounds the exact
    one); the slacks are then meaningless (returned as 0). The block's forbidden choices
    (fixed to 0: no plan better than a known one takes them) have no Omega counted.
    """
    g = block_numbers(form, b)
    budget = form.rows[b.time_row].rhs if b.time_row is not None else form.budget
    forbid = b.forbid
    tu, mu, s = sc.time_unit_ms, sc.mem_unit_bytes, sc.omega_scale
    # A capacity above the most memory any assignment can take never binds: it is replaced
    # by that most (plus a margin), exactly, so a huge capacity beside a small one (whose
    # unit sets mu) still fits CP-SAT's integers. Likewise the budget.
    capacity = _never_binding(g.capacity_bytes, _memory_max(g), mu)
    budget = _never_binding(budget, _time_max(g), tu)
    if outer:
        cost, sign = _down, -1.0
        t_cap = _up(budget + FEAS_REL * abs(budget), tu, "target_ms (group budget, ms)")
        m_cap = _up(capacity * (1 + FEAS_REL), mu, f"group {g.name}: capacity_bytes")
    else:
        cost, sign = _up, 1.0
        t_cap = _down(budget, tu, "target_ms (group budget, ms)")
        m_cap = _down(capacity, mu, f"group {g.name}: capacity_bytes")
    t_slack = budget - t_cap * tu
    m_slack = capacity - m_cap * mu
    gt, gm = f"group {g.name}: a time cost (ms)", f"group {g.name}: a memory cost (bytes)"
    t0 = cost(g.time0, tu, gt)
    m0 = cost(g.mem0, mu, gm)
    t_slack += t0 * tu - g.time0
    m_slack += m0 * mu - g.mem0
    time1, mem1, obj1 = [], [], []
    obj_err = 0.0
    obj_min = 0.0
    for u in range(len(g.time1)):  # real units, then derived ones (no objective)
        tr = [cost(v, tu, gt) for v in g.time1[u]]
        mr = [cost(v, mu, gm) for v in g.mem1[u]]
        t_slack += max(sign * (r * tu - v) for r, v in zip(tr, g.time1[u], strict=True))
        m_slack += max(sign * (r * mu - v) for r, v in zip(mr, g.mem1[u], strict=True))
        time1.append(tr)
        mem1.append(mr)
        if u < len(g.weight_omega):
            exact = g.weight_omega[u]
            orow = [0 if (u, k) in forbid else round(v * s) for k, v in enumerate(exact)]
            # (every choice forbidden: the program has no plan; the row still bounds)
            allowed = ([k for k in range(len(exact)) if (u, k) not in forbid]
                       or list(range(len(exact))))
            obj_err += max(abs(orow[k] / s - exact[k]) for k in allowed)
            obj_min += min(exact[k] for k in allowed)
            obj1.append(orow)
    pairs = []
    for pi, p_time, p_mem in g.pairs:
        pt = [[cost(v, tu, gt) for v in row] for row in p_time]
        pm = [[cost(v, mu, gm) for v in row] for row in p_mem]
        t_slack += max(sign * (r * tu - v) for rr, vv in zip(pt, p_time, strict=True)
                       for r, v in zip(rr, vv, strict=True))
        m_slack += max(sign * (r * mu - v) for rr, vv in zip(pm, p_mem, strict=True)
                       for r, v in zip(rr, vv, strict=True))
        pairs.append((pi, pt, pm))
    w0 = cost(g.work0, mu, gm)
    w_over = sign * (w0 * mu - g.work0)
    work1 = {}
    for u, exact_row in g.work1.items():
        row = [cost(v, mu, gm) for v in exact_row]
        w_over = max(w_over, max(sign * (r * mu - v)
                                 for r, v in zip(row, exact_row, strict=True)))
        work1[u] = row
    m_slack += w_over
    # CP-SAT checks that no linear row can overflow int64: refuse such rows here, by name.
    for what, rows, extra in (
            ("time", time1 + [r for _, pt, _ in pairs for r in pt], abs(t_cap) + abs(t0)),
            ("memory", mem1 + [r for _, _, pm in pairs for r in pm] + list(work1.values()),
             abs(m_cap) + abs(m0) + abs(w0))):
        if sum(max((abs(v) for v in r), default=0) for r in rows) + extra > 2 ** 62:
            raise QsyncInputError(
                f"group {g.name}: the {what} costs sum beyond CP-SAT's integer range at this "
                "problem's scale (costs far above the budget or capacity); highs or cbc "
                "solve it in floating point")
    ig = _IntGroup(time1, mem1, obj1, pairs, w0, work1, t_cap - t0, m_cap - m0, obj_min,
                   obj_err, frozenset(forbid), form, b)
    if outer:
        return ig, 0.0, 0.0, obj_err
    return ig, t_slack, m_slack, obj_err


def _chosen(solver: Any, row: Sequence[Any]) -> int:
    """The index of the variable of a one-hot row that is 1 in the solver's solution."""
    values = [solver.value(v) for v in row]
    return max(range(len(values)), key=values.__getitem__)


@dataclass
class _Solved:
    status: str  # OPTIMAL, FEASIBLE, INFEASIBLE, TIME_LIMIT, ERROR
    assignment: dict[str, list[int]] | None
    bound: float  # scaled objective bound / omega_scale
    name: str  # CP-SAT's status name
    wall_s: float
    own: int | None = None  # the assignment's scaled objective, recomputed
    reported: float | None = None  # CP-SAT's objective_value
    scaled_bound: float | None = None  # CP-SAT's best_objective_bound


#: Programs at most this large (variables) run on one CP-SAT worker by default: measured on
#: this 2-core machine, one worker proves resnet50 (1.6k variables) in 0.19 s and
#: gpt2_medium (4.5k per group) in 2.7 s, against 0.28 s and 6.5 s with 8; the 600-op
#: synthetic graph (26k per group) needs the 8-worker portfolio (2 workers stayed unproven
#: after 60 s in the issue's probe).
SMALL_PROGRAM_VARS = 20_000


def _kept_feasible(res: PartResult, obj: float, err: float) -> PartResult:
    """An OPTIMAL plan kept as FEASIBLE when the objective's rounding (error ``err`` per
    side) could hide a better one: its bound lowered to ``obj - 2 * err`` at most."""
    return dataclasses.replace(res, status="FEASIBLE",
                               bound=min(res.bound, obj - 2 * err)
                               if res.bound is not None else None)


def prefer_highs(problem: AllocationProblem, n_variables: int) -> str:
    """What the report says when CP-SAT stops without proving its plan optimal: the menu's
    size, and that HiGHS is the backend to prefer there (on BERT-base with ``--int4`` at
    batch 32 CP-SAT stopped at its limit with a 0.7% gap after 56 s where HiGHS proves
    the optimum: CP-SAT's integer model grows with the menu, HiGHS's LP bounds do not)."""
    menu = max((len(c) for g in problem.groups for c in g.choices), default=0)
    return (f"cpsat stopped without proving the optimum (a gap remains) on a program of "
            f"{n_variables} variables, up to {menu} choices per op: on large menus (--int4, "
            "many precisions) prefer --solver highs, which proves such programs in floating "
            "point")


def default_workers(n_variables: int) -> int:
    """CP-SAT workers when the user sets no thread count."""
    return 1 if n_variables <= SMALL_PROGRAM_VARS else 8


class CpSat:
    """OR-Tools CP-SAT on the exact program (integer-scaled, conservatively)."""

    name = "cpsat"
    exact = True

    def is_available(self) -> bool:
        try:
            from ortools.sat.python import cp_model  # noqa: F401
        except Exception:
            return False
        return True

    def _build(self, cp_model: Any, problem: AllocationProblem, gis: Sequence[int],
               ints: Mapping[int, _IntGroup], hints: Mapping[str, Sequence[int]] | None
               ) -> tuple[Any, dict[int, list[list[Any]]], int, int]:
        """The CP-SAT model of the groups ``gis``: each group's block of the formulation,
        row by row, with its integer coefficients (``ints``). One-hot rows become
        ``add_exactly_one``, a forbidden choice an equality to 0, the working set ``W`` an
        integer variable in memory units."""
        model = cp_model.CpModel()
        LinearExpr = cp_model.LinearExpr
        xs: dict[int, list[list[Any]]] = {}
        obj_vars: list[Any] = []
        obj_coefs: list[int] = []
        n_vars = n_cons = 0
        for gi in gis:
            ig = ints[gi]
            form, b = ig.form, ig.block
            variables = form.variables
            w_hi = max([ig.work0] + [max(r) for r in ig.work1.values()])
            cv: dict[int, Any] = {}
            for i in range(b.x[0][0] if b.x else b.w, b.w + 1):
                var = variables[i]
                cv[i] = (model.new_int_var(ig.work0, w_hi, var.name) if i == b.w
                         else model.new_bool_var(var.name))
            n_vars += len(cv)
            for _, y in b.pairs:  # a hopeless pair combination (formulation.Hopeless)
                for v in (v for yrow in y for v in yrow if variables[v].ub == 0.0):
                    model.add(cv[v] == 0)
                    n_cons += 1
            x = [[cv[v] for v in row] for row in b.x]
            xs[gi] = x
            # the integer coefficients by variable, for the time, memory and objective rows
            t_int: dict[int, int] = {}
            m_int: dict[int, int] = {}
            for u, row in enumerate(b.x):
                for k, v in enumerate(row):
                    t_int[v], m_int[v] = ig.time1[u][k], ig.mem1[u][k]
                    if u < b.n_real and ig.obj1[u][k]:
                        obj_vars.append(cv[v])
                        obj_coefs.append(ig.obj1[u][k])
            for (_, y), (_, pt, pm) in zip(b.pairs, ig.pairs, strict=True):
                for ka, yrow in enumerate(y):
                    for kb, v in enumerate(yrow):
                        t_int[v], m_int[v] = pt[ka][kb], pm[ka][kb]
            m_int[b.w] = 1
            unit_of = {v: u for u, row in enumerate(b.x) for v in row}
            for ri in b.rows:
                r = form.rows[ri]
                fam = r.family
                if fam == "one_hot":
                    model.add_exactly_one([cv[v] for v, _ in r.terms])
                    n_cons += 1
                    for v, _ in r.terms:
                        if variables[v].ub == 0.0:
                            model.add(cv[v] == 0)
                            n_cons += 1
                elif fam == "derived_and":  # sum S_i - x[d,k] >= 0
                    model.add(cv[r.terms[-1][0]] <= LinearExpr.sum(
                        [cv[v] for v, _ in r.terms[:-1]]))
                    n_cons += 1
                elif fam == "derived_all":  # sum_i S_i - x[d,k] <= n - 1
                    model.add(cv[r.terms[-1][0]] >= LinearExpr.sum(
                        [cv[v] for v, _ in r.terms[:-1]]) - int(r.rhs))
                    n_cons += 1
                elif fam in ("pair_a", "pair_b"):  # sum y - x = 0
                    model.add(LinearExpr.sum([cv[v] for v, _ in r.terms[:-1]])
                              == cv[r.terms[-1][0]])
                    n_cons += 1
                elif fam == "working_set":  # W - sum work1 x >= 0
                    u = unit_of[r.terms[0][0]]
                    model.add(cv[b.w] >= LinearExpr.weighted_sum(x[u], ig.work1[u]))
                    n_cons += 1
                elif fam in ("time", "memory"):
                    coefs = t_int if fam == "time" else m_int
                    terms = [(cv[v], coefs[v]) for v, _ in r.terms if coefs[v]]
                    rhs = ig.time_rhs if fam == "time" else ig.mem_rhs
                    model.add(LinearExpr.weighted_sum([v for v, _ in terms],
                                                      [c for _, c in terms]) <= rhs)
                    n_cons += 1
                else:  # pragma: no cover - a family this translation does not know
                    raise ValueError(f"cpsat: no translation of the row family {fam!r}")
            if hints is not None:
                point = form.point({b.group.name: hints[b.group.name]})
                for v in range(b.x[0][0] if b.x else b.w, b.w):
                    model.add_hint(cv[v], int(point[v]))
        model.minimize(LinearExpr.weighted_sum(obj_vars, obj_coefs))
        return model, xs, n_vars, n_cons

    def _solve_once(self, cp_model: Any, problem: AllocationProblem, gis: Sequence[int],
                    ints: Mapping[int, _IntGroup], hints: Mapping[str, Sequence[int]] | None,
                    options: SolveOptions, time_limit: float, sc: Scaling, sw: Stopwatch,
                    messages: list[str] | None = None) -> tuple[_Solved, int, int]:
        """One CP-SAT run; its solution is checked against CP-SAT's own report (the scaled
        objective of the returned assignment must equal ``objective_value``, and an OPTIMAL
        one must lie within the gap of the bound). On a mismatch with hints it is re-solved
        without them; without hints the plan is kept as FEASIBLE and the bound dropped."""
        t_end = common.clock() + max(time_limit, 0.0)
        solved, nv, nc = self._solve_raw(cp_model, problem, gis, ints, hints, options,
                                         t_end, sc, sw)
        why = self._inconsistency(solved, options.rel_gap)
        if why is None:
            return solved, nv, nc
        tag = problem.groups[gis[0]].name if len(gis) == 1 else "all"
        if hints is not None and t_end - common.clock() > 0:
            if messages is not None:
                messages.append(f"{tag}: CP-SAT reported {solved.name}, but {why}; re-solved "
                                "without the hints")
            solved, nv, nc = self._solve_raw(cp_model, problem, gis, ints, None, options,
                                             t_end, sc, sw)
            why = self._inconsistency(solved, options.rel_gap)
            if why is None:
                return solved, nv, nc
        if messages is not None:
            messages.append(f"{tag}: CP-SAT reported {solved.name}, but {why}; the plan is "
                            "kept as FEASIBLE and CP-SAT's bound dropped")
        floor = sum(ints[gi].obj_min for gi in gis)
        return dataclasses.replace(solved, status="FEASIBLE", bound=floor), nv, nc

    @staticmethod
    def _inconsistency(solved: _Solved, rel_gap: float) -> str | None:
        if solved.assignment is None or solved.own is None or solved.reported is None:
            return None
        if abs(solved.own - solved.reported) > 0.5:
            return (f"its solution's own scaled objective {solved.own} differs from the "
                    f"reported {solved.reported:.17g}")
        if solved.status == "OPTIMAL" and solved.scaled_bound is not None and (
                solved.own - solved.scaled_bound > rel_gap * max(1.0, abs(solved.own)) + 1.0):
            return (f"its solution's own scaled objective {solved.own} is above its bound "
                    f"{solved.scaled_bound:.17g} by more than the gap")
        return None

    def _solve_raw(self, cp_model: Any, problem: AllocationProblem, gis: Sequence[int],
                   ints: Mapping[int, _IntGroup], hints: Mapping[str, Sequence[int]] | None,
                   options: SolveOptions, t_end: float, sc: Scaling, sw: Stopwatch
                   ) -> tuple[_Solved, int, int]:
        """Build and run CP-SAT until ``t_end`` (a :data:`common.clock` time); nothing is
        run when building used up the time (status TIME_LIMIT)."""
        with sw.building():
            model, xs, nv, nc = self._build(cp_model, problem, gis, ints, hints)
        time_limit = t_end - common.clock()
        if not time_limit > 0:
            return _Solved("TIME_LIMIT", None, -math.inf, "not run (no time left)", 0.0), nv, nc
        solver = cp_model.CpSolver()
        prm = solver.parameters
        prm.num_workers = options.threads or default_workers(nv)
        prm.linearization_level = 2
        prm.max_time_in_seconds = max(time_limit, 1e-3)
        prm.random_seed = int(options.seed)
        prm.relative_gap_limit = options.rel_gap
        # OR-Tools 9.15: the at-most-one/linear inclusion presolve can certify a wrong
        # optimum (google/or-tools#5293); it did so here on the one-hot rows with the
        # time row. Switching that presolve family off is the workaround.
        prm.presolve_inclusion_work_limit = 0
        for k, v in options.extra.get("cpsat", {}).items():  # raw CP-SAT parameters
            setattr(prm, k, v)
        with sw.solving():
            st = solver.solve(model)
        name = solver.status_name(st)
        status = {cp_model.OPTIMAL: "OPTIMAL", cp_model.FEASIBLE: "FEASIBLE",
                  cp_model.INFEASIBLE: "INFEASIBLE", cp_model.UNKNOWN: "TIME_LIMIT"
                  }.get(st, "ERROR")
        assignment = None
        own: int | None = None
        reported: float | None = None
        if status in ("OPTIMAL", "FEASIBLE"):
            assignment = {}
            own = 0
            for gi in gis:
                g = problem.groups[gi]
                assignment[g.name] = [_chosen(solver, row) for row in xs[gi][:len(g.choices)]]
                own += sum(r[k] for r, k in zip(ints[gi].obj1, assignment[g.name], strict=True))
            reported = solver.objective_value
        has_bound = status in ("OPTIMAL", "FEASIBLE", "TIME_LIMIT")
        raw_bound = solver.best_objective_bound if has_bound else None
        bound = raw_bound / sc.omega_scale if raw_bound is not None else -math.inf
        if status == "ERROR":
            name += f" ({model.validate()})"
        return _Solved(status, assignment, bound, name, solver.wall_time, own, reported,
                       raw_bound), nv, nc

    def solve(self, problem: AllocationProblem, options: SolveOptions
              ) -> tuple[Plan | None, SolveReport]:
        """Per program (one per group, or one for all): first the *outer* model (a
        relaxation); if its optimum is feasible in the exact model it is the exact optimum.
        Otherwise (an optimum within the rounding slack of a bound) the *inner* model, whose
        every solution is exactly feasible, gives the plan and the outer model the bound."""
        sw = Stopwatch()
        messages: list[str] = []
        mode = mode_text(problem)
        if not self.is_available():
            messages.append("cpsat: ortools is not installed")
            return finish(problem, self.name, None, status="ERROR", mode=mode,
                          options=options, sw=sw, messages=messages)
        from ortools.sat.python import cp_model

        deadline = Deadline(options.time_limit_s)  # greedy's warm start counts
        check_numbers(problem)
        proof = cheap_infeasibility(problem)
        if proof:  # before any scaling: costs far above a tiny budget need no integers
            program_parts(problem, options, messages)
            messages.extend(proof)
            # the report's scaling keys are always there: zero units, no integers built
            none = {**Scaling(0.0, 0.0, 0.0).to_json(), "scaled": False}
            return finish(problem, self.name, None, status="INFEASIBLE", mode=mode,
                          options=options, sw=sw, messages=messages, extra_options=none)
        hints = start_hints(problem, options, messages, deadline)
        budget = problem.group_budget_ms()
        with sw.building():
            sc = scaling_for(problem, float(options.extra.get("cpsat_units", _UNITS_LOW)))
            form = formulate(problem)
            inner: dict[int, _IntGroup] = {}
            outer: dict[int, _IntGroup] = {}
            for b in form.blocks:
                ig, ts, ms, oe = integer_group(form, b, sc)
                inner[b.gi] = ig
                outer[b.gi] = integer_group(form, b, sc, outer=True)[0]
                sc.max_time_slack_ms = max(sc.max_time_slack_ms, ts)
                sc.max_mem_slack_bytes = max(sc.max_mem_slack_bytes, ms)
                sc.max_objective_error += oe
        workers = options.threads or "auto"  # default_workers(size of each program)
        messages.append(
            f"integer scaling (the formulation's {len(form.rows)} rows translated twice): "
            f"time unit {sc.time_unit_ms:g} ms, memory unit {sc.mem_unit_bytes:g} B, "
            f"objective x{sc.omega_scale:g} rounded to nearest; the inner model rounds "
            "costs up and bounds down (its plans are feasible in the exact model) and may "
            f"lose assignments within {sc.max_time_slack_ms:.3g} ms of the budget or "
            f"{sc.max_mem_slack_bytes:.3g} B of the capacity; the outer model (costs down, "
            f"bounds up) gives the bound; objective error <= {sc.max_objective_error:.3g}")
        parts = program_parts(problem, options, messages)
        if hints is not None:
            messages.append("warm start: hints given to CP-SAT (add_hint)")

        def solve_with(gis: Sequence[int], limit: float,
                       start: Mapping[str, Sequence[int]] | None,
                       inner: Mapping[int, _IntGroup], outer: Mapping[int, _IntGroup],
                       sc: Scaling) -> PartResult:
            tag = problem.groups[gis[0]].name if len(gis) == 1 else "all"
            t_end = common.clock() + max(limit, 0.0)
            seed0 = start if start is not None else hints
            err = sum(inner[gi].obj_err for gi in gis)
            obj_min = sum(inner[gi].obj_min for gi in gis)
            # 1. The outer model (3/4 of the share at most: the inner model is rarely needed).
            out, nv, nc = self._solve_once(cp_model, problem, gis, outer, seed0, options,
                                           limit * 0.75, sc, sw, messages)
            lb = max(obj_min, out.bound - err)
            if out.status == "INFEASIBLE":
                messages.extend(infeasible_messages(problem, gis, budget))
                messages.append(f"{tag}: no assignment meets the target and capacity "
                                "(proven on the outer model, a relaxation)")
                return PartResult("INFEASIBLE", None, None, nv, nc)
            if out.status == "ERROR":
                messages.append(f"{tag}: CP-SAT {out.name}")
                return PartResult("ERROR", None, None, nv, nc)
            found = out.assignment
            status = out.status
            if found is not None and any(
                    max(exact_violation(problem.groups[gi], found[problem.groups[gi].name],
                                        budget)) > 0 for gi in gis):
                found = None
            if found is None:
                # 2. The inner model: every solution is feasible in the exact model.
                seed = out.assignment or seed0
                res, _, _ = self._solve_once(cp_model, problem, gis, inner, seed, options,
                                             t_end - common.clock(), sc, sw, messages)
                if res.assignment is None:
                    if res.status == "INFEASIBLE":
                        messages.append(
                            f"{tag}: infeasible within the scaling slack: the inner model has "
                            "no solution, so any exactly feasible assignment lies within "
                            f"{sc.max_time_slack_ms:.3g} ms of the budget or "
                            f"{sc.max_mem_slack_bytes:.3g} B of the capacity (the outer "
                            "optimum fails the exact model); highs/cbc decide such cases")
                        return PartResult("INFEASIBLE", None, None, nv, nc)
                    messages.append(f"{tag}: CP-SAT {res.name} after {res.wall_s:.2f} s, "
                                    "no solution")
                    return PartResult("TIME_LIMIT" if res.status != "ERROR" else "ERROR",
                                      None, lb, nv, nc)
                found = res.assignment
                for gi in gis:
                    g = problem.groups[gi]
                    dt, dm = exact_violation(g, found[g.name], budget, rel=0.0)
                    if dt > 0 or dm > 0:  # cannot happen with conservative rounding
                        messages.append(f"group {g.name}: CP-SAT plan exceeds the exact "
                                        f"model by {dt:.3g} ms / {dm:.3g} B (scaling bug)")
                obj = sum(problem.groups[gi].weight * problem.groups[gi].degradation(
                    found[problem.groups[gi].name]) for gi in gis)
                proven = (out.status == "OPTIMAL" and obj - lb
                          <= options.rel_gap * abs(obj) + 2 * err + 1e-12)
                status = "OPTIMAL" if proven else "FEASIBLE"
                why = ("the outer optimum lies within the rounding slack of a bound"
                       if out.assignment is not None else
                       f"the outer model found no solution in its time ({out.name})")
                messages.append(
                    f"{tag}: {why}; plan from the inner model ({res.name})"
                    + ("" if proven else f", {obj - lb:.3g} above the outer bound"))
            return PartResult(status, found, lb, nv, nc)

        def solve_part(gis: Sequence[int], limit: float,
                       start: Mapping[str, Sequence[int]] | None) -> PartResult:
            """:func:`solve_with` on the call's scaling; an OPTIMAL plan that the objective's
            rounding could hide a better one from (its error bound above the relative gap of
            the plan's objective: Omegas of very different sizes) is re-solved without the
            choices no better plan takes, on an objective scale fitted to what is left."""
            tag = problem.groups[gis[0]].name if len(gis) == 1 else "all"
            t_end = common.clock() + max(limit, 0.0)
            res = solve_with(gis, limit, start, inner, outer, sc)
            ints = inner
            forbid: dict[int, frozenset[tuple[int, int]]] | None = None
            for rnd in range(MAX_RESCALES + 1):
                if res.status != "OPTIMAL" or res.assignment is None:
                    break
                err = sum(ints[gi].obj_err for gi in gis)
                obj = part_objective(problem, gis, res.assignment)
                if part_floor(problem, gis) >= obj or 2 * err <= options.rel_gap * abs(obj):
                    break
                why = (f"the objective's rounding error (up to {2 * err:.3g}) is more than the "
                       f"relative gap {options.rel_gap:g} of the plan's objective {obj:.6g} "
                       "(Omegas of very different sizes)")
                new = excluded_choices(problem, gis, res.assignment)
                if new == forbid or common.clock() >= t_end or rnd == MAX_RESCALES:
                    messages.append(f"{tag}: CP-SAT's plan is OPTIMAL in integers, but {why}; "
                                    "status FEASIBLE")
                    res = _kept_feasible(res, obj, err)
                    break
                forbid = new
                total = sum(abs(g.weight) * max(abs(v) for k, v in enumerate(row)
                                                if (u, k) not in forbid[gi])
                            for gi in gis for g in [problem.groups[gi]]
                            for u, row in enumerate(g.omega1) if row)
                sc_p = dataclasses.replace(sc, omega_scale=_omega_scale(total))
                form_p = formulate(problem, gis, forbid=forbid)
                ints = {b.gi: integer_group(form_p, b, sc_p)[0] for b in form_p.blocks}
                ints_out = {b.gi: integer_group(form_p, b, sc_p, outer=True)[0]
                            for b in form_p.blocks}
                n_out = sum(len(v) for v in forbid.values())
                messages.append(f"{tag}: {why}; re-solved without the {n_out} choice(s) whose "
                                "Omega alone exceeds the plan's (no better plan takes them), "
                                f"objective x{sc_p.omega_scale:g}")
                res2 = solve_with(gis, t_end - common.clock(), res.assignment, ints, ints_out,
                                  sc_p)
                if res2.assignment is None or part_objective(
                        problem, gis, res2.assignment) > obj:
                    messages.append(f"{tag}: the re-solve gave {res2.status} and no better "
                                    "plan; the first plan is kept as FEASIBLE")
                    res = _kept_feasible(res, obj, err)
                    break
                res = dataclasses.replace(res2, n_variables=res.n_variables,
                                          n_constraints=res.n_constraints)
            return res

        status, assignment, bound, n_vars, n_cons = solve_parts(
            problem, parts, solve_part, deadline, messages, options.rel_gap)
        extra = {**sc.to_json(), "num_workers": workers, "linearization_level": 2,
                 "presolve_inclusion_work_limit": 0}
        tol = 2 * sc.max_objective_error + 1.0 / sc.omega_scale
        if assignment is None:
            return finish(problem, self.name, None, status=status, mode=mode, options=options,
                          sw=sw, bound=bound, n_variables=n_vars, n_constraints=n_cons,
                          messages=messages, extra_options=extra)
        objective = problem.objective(assignment)
        if status == "OPTIMAL" and bound is not None:
            bound = min(bound, objective)
        if status == "FEASIBLE":
            messages.append(prefer_highs(problem, n_vars))
        return finish(problem, self.name, assignment, status=status, mode=mode,
                      options=options, sw=sw, bound=bound, n_variables=n_vars,
                      n_constraints=n_cons, messages=messages, extra_options=extra,
                      optimal_tol=tol)
