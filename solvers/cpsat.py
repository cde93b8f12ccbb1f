"""The exact program in OR-Tools CP-SAT (Boolean x and y, integer coefficients).

The model is the one of :mod:`.ilp` (one-hot ``x``, pair variables ``y`` tied to ``x`` by
their marginal rows, the working set ``W`` as an integer variable), with every coefficient
made an integer. The scaling is explicit and conservative:

* time in units of ``time_unit_ms`` (a power of ten that puts the group budget between 1e6
  and 1e7 units), memory in units of ``mem_unit_bytes`` (the smallest capacity between 1e6
  and 1e7 units);
* every time and memory cost is rounded **up** and every budget and capacity **down**, so a
  plan CP-SAT accepts is feasible in the exact floating-point model;
* the price: an assignment whose exact time is within ``max_time_slack_ms`` of the budget
  (or memory within ``max_mem_slack_bytes`` of the capacity) may be rejected. Both slacks
  are computed from the actual rounding, term by term, and recorded in the report;
* the objective ``weight * Omega`` is scaled by ``omega_scale`` (a power of ten that keeps
  the largest possible total below 1e12) and rounded to nearest; ``max_objective_error``
  bounds ``|scaled / omega_scale - exact|`` for any assignment. So the exact objective of
  CP-SAT's plan is at most the optimum of the problem with the budget reduced by
  ``max_time_slack_ms`` and the capacity by ``max_mem_slack_bytes``, plus
  ``2 * max_objective_error`` (plus the relative gap).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..problem import AllocationProblem, GroupModel
from ..schemas import Plan, SolveReport
from . import SolveOptions
from ._common import Stopwatch, finish, mode_text
from .ilp import active_pairs, exact_violation, start_hints, time_lower_bound, work_rows

#: Target range of the scaled budget / capacity (units) and of the scaled objective total.
_UNITS_LOW = 1e6
_OBJECTIVE_MAX = 1e12


def _up(v: float, unit: float) -> int:
    """The least integer r with r * unit >= v (checked in floating point)."""
    r = math.ceil(v / unit)
    while r * unit < v:
        r += 1
    while (r - 1) * unit >= v:
        r -= 1
    return r


def _down(v: float, unit: float) -> int:
    """The greatest integer r with r * unit <= v."""
    r = math.floor(v / unit)
    while r * unit > v:
        r -= 1
    while (r + 1) * unit <= v:
        r += 1
    return r


def _decade_unit(span: float) -> float:
    """A power of ten that puts ``span`` between 1e6 and 1e7 units."""
    if not span > 0 or not math.isfinite(span):
        return 1.0
    return 10.0 ** (math.floor(math.log10(span)) - round(math.log10(_UNITS_LOW)))


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


def scaling_for(problem: AllocationProblem) -> Scaling:
    budget = problem.group_budget_ms()
    if not budget > 0:
        budget = max([abs(g.time0) for g in problem.groups]
                     + [abs(v) for g in problem.groups for r in g.time1 for v in r] + [1e-9])
    caps = [g.capacity_bytes for g in problem.groups if g.capacity_bytes > 0]
    cap = min(caps) if caps else 1.0
    total = sum(g.weight * max(r) for g in problem.groups for r in g.omega1 if r)
    scale = 1.0
    if total > 0 and math.isfinite(total):
        scale = 10.0 ** math.floor(math.log10(_OBJECTIVE_MAX / total))
    return Scaling(_decade_unit(budget), _decade_unit(cap), scale)


def integer_group(g: GroupModel, budget: float, sc: Scaling) -> tuple[_IntGroup, float, float,
                                                                       float]:
    """The group's integer coefficients and its time slack (ms), memory slack (bytes) and
    objective error bound."""
    tu, mu, s = sc.time_unit_ms, sc.mem_unit_bytes, sc.omega_scale
    t_slack = budget - _down(budget, tu) * tu
    m_slack = g.capacity_bytes - _down(g.capacity_bytes, mu) * mu
    t0 = _up(g.time0, tu)
    m0 = _up(g.mem0, mu)
    t_slack += t0 * tu - g.time0
    m_slack += m0 * mu - g.mem0
    time1, mem1, obj1 = [], [], []
    obj_err = 0.0
    obj_min = 0.0
    for u in range(len(g.choices)):
        tr = [_up(v, tu) for v in g.time1[u]]
        mr = [_up(v, mu) for v in g.mem1[u]]
        exact = [g.weight * v for v in g.omega1[u]]
        orow = [round(v * s) for v in exact]
        t_slack += max(r * tu - v for r, v in zip(tr, g.time1[u], strict=True))
        m_slack += max(r * mu - v for r, v in zip(mr, g.mem1[u], strict=True))
        obj_err += max(abs(r / s - v) for r, v in zip(orow, exact, strict=True))
        obj_min += min(exact)
        time1.append(tr)
        mem1.append(mr)
        obj1.append(orow)
    pairs = []
    for pi in active_pairs(g):
        p = g.pairs[pi]
        pt = [[_up(v, tu) for v in row] for row in p.time]
        pm = [[_up(v, mu) for v in row] for row in p.mem]
        t_slack += max(r * tu - v for rr, vv in zip(pt, p.time, strict=True)
                       for r, v in zip(rr, vv, strict=True))
        m_slack += max(r * mu - v for rr, vv in zip(pm, p.mem, strict=True)
                       for r, v in zip(rr, vv, strict=True))
        pairs.append((pi, pt, pm))
    w0 = _up(g.work0, mu)
    w_over = w0 * mu - g.work0
    work1 = {}
    for u in work_rows(g):
        row = [_up(v, mu) for v in g.work1[u]]
        w_over = max(w_over, max(r * mu - v for r, v in zip(row, g.work1[u], strict=True)))
        work1[u] = row
    m_slack += w_over
    ig = _IntGroup(time1, mem1, obj1, pairs, w0, work1,
                   _down(budget, tu) - t0, _down(g.capacity_bytes, mu) - m0, obj_min, obj_err)
    return ig, t_slack, m_slack, obj_err


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
        model = cp_model.CpModel()
        LinearExpr = cp_model.LinearExpr
        xs: dict[int, list[list[Any]]] = {}
        obj_vars: list[Any] = []
        obj_coefs: list[int] = []
        n_vars = n_cons = 0
        for gi in gis:
            g, ig = problem.groups[gi], ints[gi]
            hint = hints[g.name] if hints is not None else None
            x = [[model.NewBoolVar(f"x{gi}_{u}_{k}") for k in range(len(ch))]
                 for u, ch in enumerate(g.choices)]
            xs[gi] = x
            t_vars: list[Any] = []
            t_coefs: list[int] = []
            m_vars: list[Any] = []
            m_coefs: list[int] = []
            for u, row in enumerate(x):
                n_vars += len(row)
                model.AddExactlyOne(row)
                n_cons += 1
                for k, v in enumerate(row):
                    if ig.time1[u][k]:
                        t_vars.append(v)
                        t_coefs.append(ig.time1[u][k])
                    if ig.mem1[u][k]:
                        m_vars.append(v)
                        m_coefs.append(ig.mem1[u][k])
                    if ig.obj1[u][k]:
                        obj_vars.append(v)
                        obj_coefs.append(ig.obj1[u][k])
                    if hint is not None:
                        model.AddHint(v, 1 if hint[u] == k else 0)
            for pi, pt, pm in ig.pairs:
                p = g.pairs[pi]
                xa, xb = x[p.a], x[p.b]
                y = [[model.NewBoolVar(f"y{gi}_{pi}_{ka}_{kb}") for kb in range(len(xb))]
                     for ka in range(len(xa))]
                n_vars += len(xa) * len(xb)
                for ka, yrow in enumerate(y):
                    model.Add(LinearExpr.Sum(yrow) == xa[ka])
                    for kb, v in enumerate(yrow):
                        if pt[ka][kb]:
                            t_vars.append(v)
                            t_coefs.append(pt[ka][kb])
                        if pm[ka][kb]:
                            m_vars.append(v)
                            m_coefs.append(pm[ka][kb])
                        if hint is not None:
                            model.AddHint(v, 1 if (hint[p.a] == ka and hint[p.b] == kb) else 0)
                for kb in range(len(xb)):
                    model.Add(LinearExpr.Sum([y[ka][kb] for ka in range(len(xa))]) == xb[kb])
                n_cons += len(xa) + len(xb)
            w_hi = max([ig.work0] + [max(r) for r in ig.work1.values()])
            w = model.NewIntVar(ig.work0, w_hi, f"w{gi}")
            n_vars += 1
            for u, row in ig.work1.items():
                model.Add(w >= LinearExpr.WeightedSum(x[u], row))
                n_cons += 1
            m_vars.append(w)
            m_coefs.append(1)
            model.Add(LinearExpr.WeightedSum(t_vars, t_coefs) <= ig.time_rhs)
            model.Add(LinearExpr.WeightedSum(m_vars, m_coefs) <= ig.mem_rhs)
            n_cons += 2
        model.Minimize(LinearExpr.WeightedSum(obj_vars, obj_coefs))
        return model, xs, n_vars, n_cons

    def solve(self, problem: AllocationProblem, options: SolveOptions
              ) -> tuple[Plan | None, SolveReport]:
        sw = Stopwatch()
        messages: list[str] = []
        mode = mode_text(problem)
        if not self.is_available():
            messages.append("cpsat: ortools is not installed")
            return finish(problem, self.name, None, status="ERROR", mode=mode,
                          options=options, sw=sw, messages=messages)
        from ortools.sat.python import cp_model

        hints = start_hints(problem, options, messages)
        deadline = time.perf_counter() + options.time_limit_s
        budget = problem.group_budget_ms()
        with sw.building():
            sc = scaling_for(problem)
            ints: dict[int, _IntGroup] = {}
            obj_err = 0.0
            for gi, g in enumerate(problem.groups):
                ig, ts, ms, oe = integer_group(g, budget, sc)
                ints[gi] = ig
                sc.max_time_slack_ms = max(sc.max_time_slack_ms, ts)
                sc.max_mem_slack_bytes = max(sc.max_mem_slack_bytes, ms)
                obj_err += oe
            sc.max_objective_error = obj_err
        workers = options.threads or 8
        messages.append(
            f"integer scaling: time unit {sc.time_unit_ms:g} ms, memory unit "
            f"{sc.mem_unit_bytes:g} B, objective x{sc.omega_scale:g}; costs rounded up and "
            f"bounds down (plans are feasible in the exact model); assignments within "
            f"{sc.max_time_slack_ms:.3g} ms of the budget or {sc.max_mem_slack_bytes:.3g} B "
            f"of the capacity may be lost; objective error <= {sc.max_objective_error:.3g}")
        if options.decompose:
            messages.append(
                f"decomposed: one program per group ({len(problem.groups)} groups); with a "
                "fixed target the groups do not interact")
            parts = [[gi] for gi in range(len(problem.groups))]
        else:
            messages.append(f"monolithic: one program for all {len(problem.groups)} groups")
            parts = [list(range(len(problem.groups)))]
        if hints is not None:
            messages.append("warm start: hints given to CP-SAT (AddHint)")
        assignment: dict[str, list[int]] = {}
        statuses: list[str] = []
        bound: float | None = 0.0
        n_vars = n_cons = 0
        final = None
        for i, gis in enumerate(parts):
            tag = problem.groups[gis[0]].name if len(gis) == 1 else "all"
            with sw.building():
                model, xs, nv, nc = self._build(cp_model, problem, gis, ints, hints)
            n_vars += nv
            n_cons += nc
            share = max((deadline - time.perf_counter()) / (len(parts) - i), 1e-3)
            solver = cp_model.CpSolver()
            prm = solver.parameters
            prm.num_workers = workers
            prm.linearization_level = 2
            prm.max_time_in_seconds = share
            prm.random_seed = int(options.seed)
            prm.relative_gap_limit = options.rel_gap
            for k, v in options.extra.get("cpsat", {}).items():
                setattr(prm, k, v)
            with sw.solving():
                st = solver.Solve(model)
            name = solver.StatusName(st)
            if st == cp_model.INFEASIBLE:
                for gi in gis:
                    g = problem.groups[gi]
                    lb = time_lower_bound(g)
                    if lb > budget:
                        messages.append(
                            f"group {g.name}: infeasible, even its fastest choices take at "
                            f"least {lb:.4f} ms > budget {budget:.4f} ms")
                messages.append(f"{tag}: no assignment meets the (scaled) target and capacity")
                final = "INFEASIBLE"
                break
            if st == cp_model.MODEL_INVALID:
                messages.append(f"{tag}: CP-SAT model invalid: {model.Validate()}")
                final = "ERROR"
                break
            if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                messages.append(f"{tag}: CP-SAT {name} after {solver.WallTime():.2f} s, no "
                                "solution")
                final = "TIME_LIMIT"
                break
            statuses.append("OPTIMAL" if st == cp_model.OPTIMAL else "FEASIBLE")
            obj_min = 0.0
            for gi in gis:
                g = problem.groups[gi]
                a = [max(range(len(row)), key=lambda k, row=row: solver.Value(row[k]))
                     for row in xs[gi]]
                dt, dm = exact_violation(g, a, budget)
                if dt > 0 or dm > 0:  # cannot happen with conservative rounding
                    messages.append(f"group {g.name}: CP-SAT plan exceeds the exact model "
                                    f"by {dt:.3g} ms / {dm:.3g} B (scaling bug)")
                assignment[g.name] = a
                obj_min += ints[gi].obj_min
            if bound is not None:
                gb = solver.BestObjectiveBound() / sc.omega_scale
                # A bound on the exact objective over the scaled model's feasible set.
                err = sum(ints[gi].obj_err for gi in gis)
                bound += max(obj_min, gb - err)
        if final is not None:
            return finish(problem, self.name, None, status=final, mode=mode, options=options,
                          sw=sw, n_variables=n_vars, n_constraints=n_cons, messages=messages,
                          extra_options=sc.to_json())
        status = "OPTIMAL" if all(s == "OPTIMAL" for s in statuses) else "FEASIBLE"
        if status == "OPTIMAL" and bound is not None:
            bound = min(bound, problem.objective(assignment))
        return finish(problem, self.name, assignment, status=status, mode=mode,
                      options=options, sw=sw, bound=bound, n_variables=n_vars,
                      n_constraints=n_cons, messages=messages,
                      extra_options={**sc.to_json(), "num_workers": workers,
                                     "linearization_level": 2})

