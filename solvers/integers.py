"""The formulation in CP-SAT's integers: :func:`integer_group` turns each group's block of
the formulation into integer coefficients (the rounding below, its scale factors and slacks
kept in :class:`Scaling` and recorded in the report's options and messages), which
:mod:`.cpsat` writes into a CP-SAT model. The scaling is explicit:

* time in units of ``time_unit_ms``, a power of ten that puts the group budget between 1e8
  and 1e9 units; memory in units of ``mem_unit_bytes``, likewise for the smallest capacity.
  (With 1e6-1e7 units the rounding slack of ~1000 terms reached 5e-4 of the budget on a
  600-op model and cost optimality; 1e8-1e9 keeps every sum far inside int64 and solves as
  fast.)
* the objective ``weight * Omega`` is scaled by ``omega_scale`` (a power of ten that keeps
  the largest possible total below 1e15; int64 holds 9.2e18) and rounded to nearest;
  ``max_objective_error`` bounds ``|scaled / omega_scale - exact|`` for any assignment.
  An OPTIMAL plan whose rounding error could exceed the relative gap of its objective
  (Omegas of very different sizes) is re-solved by the driver's loose-optimum loop without
  the choices whose Omega alone exceeds the plan's, on a scale fitted to what is left; if
  that does not prove it, it is FEASIBLE.
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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from qsync_opt.solvers.base import CPSAT_UNITS
from qsync_opt.solvers.checks import FEAS_REL, check_numbers
from qsync_opt.solvers.formulation import Block, Formulation

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.problem.program import AllocationProblem

#: Target range of the scaled budget / capacity (units) and of the scaled objective total.
_UNITS_LOW = CPSAT_UNITS
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


def scaling_message(form_rows: int, sc: Scaling) -> str:
    """What the report says of the call's integer scaling."""
    return (f"integer scaling (the formulation's {form_rows} rows translated twice): "
            f"time unit {sc.time_unit_ms:g} ms, memory unit {sc.mem_unit_bytes:g} B, "
            f"objective x{sc.omega_scale:g} rounded to nearest; the inner model rounds "
            "costs up and bounds down (its plans are feasible in the exact model) and may "
            f"lose assignments within {sc.max_time_slack_ms:.3g} ms of the budget or "
            f"{sc.max_mem_slack_bytes:.3g} B of the capacity; the outer model (costs down, "
            f"bounds up) gives the bound; objective error <= {sc.max_objective_error:.3g}")


@dataclass
class IntGroup:
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
    (``SolveOptions.cpsat.units`` overrides it, e.g. coarse units in tests).
    Numbers that are not finite are refused here, naming the quantity (one line)."""
    if not (isinstance(units, (int, float)) and 1.0 <= units <= 1e12):
        raise QsyncInputError(f"cpsat.units (extra cpsat_units): expected a number in "
                              f"[1, 1e12], got {units!r}")
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
    return Scaling(_decade_unit(budget, units), _decade_unit(cap, units), omega_scale_for(total))


def omega_scale_for(total: float) -> float:
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


def _rounded_pairs(g: _Numbers, cost: Callable[[float, float, str], int], sign: float,
                   tu: float, mu: float, t_slack: float, m_slack: float
                   ) -> tuple[list[tuple[int, list[list[int]], list[list[int]]]], float, float]:
    """The pair terms of ``g`` rounded by ``cost``, and the time and memory slacks given
    with each pair's largest rounding added (in the pairs' order)."""
    gt, gm = f"group {g.name}: a time cost (ms)", f"group {g.name}: a memory cost (bytes)"
    pairs = []
    for pi, p_time, p_mem in g.pairs:
        pt = [[cost(v, tu, gt) for v in row] for row in p_time]
        pm = [[cost(v, mu, gm) for v in row] for row in p_mem]
        t_slack += max(sign * (r * tu - v) for rr, vv in zip(pt, p_time, strict=True)
                       for r, v in zip(rr, vv, strict=True))
        m_slack += max(sign * (r * mu - v) for rr, vv in zip(pm, p_mem, strict=True)
                       for r, v in zip(rr, vv, strict=True))
        pairs.append((pi, pt, pm))
    return pairs, t_slack, m_slack


def _check_integer_range(group: str, what: str, rows: list[list[int]], constant: int) -> None:
    """CP-SAT checks that no linear row can overflow int64: such a row is refused here, by
    name (costs far above the budget or capacity)."""
    if sum(max((abs(v) for v in r), default=0) for r in rows) + constant > 2 ** 62:
        raise QsyncInputError(
            f"group {group}: the {what} costs sum beyond CP-SAT's integer range at this "
            "problem's scale (costs far above the budget or capacity); highs or cbc "
            "solve it in floating point")


def integer_group(form: Formulation, b: Block, sc: Scaling, outer: bool = False
                  ) -> tuple[IntGroup, float, float, float]:
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
    pairs, t_slack, m_slack = _rounded_pairs(g, cost, sign, tu, mu, t_slack, m_slack)
    w0 = cost(g.work0, mu, gm)
    w_over = sign * (w0 * mu - g.work0)
    work1 = {}
    for u, exact_row in g.work1.items():
        row = [cost(v, mu, gm) for v in exact_row]
        w_over = max(w_over, max(sign * (r * mu - v)
                                 for r, v in zip(row, exact_row, strict=True)))
        work1[u] = row
    m_slack += w_over
    _check_integer_range(g.name, "time", time1 + [r for _, pt, _ in pairs for r in pt],
                         abs(t_cap) + abs(t0))
    _check_integer_range(g.name, "memory", mem1 + [r for _, _, pm in pairs for r in pm]
                         + list(work1.values()), abs(m_cap) + abs(m0) + abs(w0))
    ig = IntGroup(time1, mem1, obj1, pairs, w0, work1, t_cap - t0, m_cap - m0, obj_min,
                  obj_err, frozenset(forbid), form, b)
    if outer:
        return ig, 0.0, 0.0, obj_err
    return ig, t_slack, m_slack, obj_err
