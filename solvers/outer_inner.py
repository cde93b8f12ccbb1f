"""A CP-SAT part solved on its two integer models (:mod:`.integers`): the *outer* model (costs
down, bounds up: a relaxation) first; if its optimum is feasible in the exact model it is
the exact optimum. Otherwise (an optimum within the rounding slack of a bound) the *inner*
model (costs up, bounds down), whose every solution is exactly feasible, gives the plan and
the outer model the bound. Each run's report is checked against its solution
(:mod:`.consistency`); the objective scale is refitted when the driver forbids choices.

The outer optimum is the exact optimum (up to ``2 * max_objective_error``) when the exact
model (``GroupModel.time_ms`` / ``memory_bytes``, relative tolerance ``FEAS_REL``) accepts
it. Otherwise the optimum sits within the rounding slack of a bound, and the inner model's
plan is OPTIMAL only if it meets the outer bound within the gap. Either way the exact
objective of CP-SAT's plan is at most the optimum of the problem with the budget reduced by
``max_time_slack_ms`` and the capacity by ``max_mem_slack_bytes``, plus
``2 * max_objective_error`` and the relative gap; the reported bound (the outer model's) is
a bound on the exact problem.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from qsync_opt.solvers import timing
from qsync_opt.solvers.base import Forbidden, PartResult, SolveOptions, Translation
from qsync_opt.solvers.checks import exact_violation, infeasible_messages
from qsync_opt.solvers.consistency import ReportCheck
from qsync_opt.solvers.formulation import formulate
from qsync_opt.solvers.integers import (
    IntGroup,
    Scaling,
    integer_group,
    omega_scale_for,
    scaling_for,
)
from qsync_opt.solvers.timing import Stopwatch

from qsync_opt.problem.program import AllocationProblem


@dataclass
class Solved:
    """One CP-SAT run's outcome."""

    status: str  # OPTIMAL, FEASIBLE, INFEASIBLE, TIME_LIMIT, ERROR
    assignment: dict[str, list[int]] | None
    bound: float  # scaled objective bound / omega_scale
    name: str  # CP-SAT's status name
    wall_s: float
    own: int | None = None  # the assignment's scaled objective, recomputed
    reported: float | None = None  # CP-SAT's objective_value
    scaled_bound: float | None = None  # CP-SAT's best_objective_bound


#: One CP-SAT run: (cp_model, problem, gis, integer coefficients, hints, options, end time,
#: scaling, stopwatch) -> (its outcome, variables, constraints).
RawRun = Callable[[ModuleType, AllocationProblem, Sequence[int], Mapping[int, IntGroup],
                   Mapping[str, Sequence[int]] | None, SolveOptions, float, Scaling,
                   Stopwatch], tuple[Solved, int, int]]


@dataclass
class IntModels:
    """The integer models a run of a part uses: the inner (costs up, bounds down) and the
    outer (costs down, bounds up) coefficients per group, and their scaling."""

    inner: Mapping[int, IntGroup]
    outer: Mapping[int, IntGroup]
    scaling: Scaling


@dataclass
class CpSatTranslation(Translation):
    """A CP-SAT call: OR-Tools' model module and the call's integer models."""

    cp_model: Any = None
    models: IntModels = field(default_factory=lambda: IntModels({}, {}, Scaling(0, 0, 0)))


def integer_models(problem: AllocationProblem, units: float) -> tuple[IntModels, int]:
    """The call's integer models (the formulation translated twice, inner and outer), their
    scaling's slacks and objective error summed over the groups; with the formulation's
    number of rows."""
    sc = scaling_for(problem, units)
    form = formulate(problem)
    inner: dict[int, IntGroup] = {}
    outer: dict[int, IntGroup] = {}
    for b in form.blocks:
        group, time_slack, mem_slack, objective_error = integer_group(form, b, sc)
        inner[b.gi] = group
        outer[b.gi] = integer_group(form, b, sc, outer=True)[0]
        sc.max_time_slack_ms = max(sc.max_time_slack_ms, time_slack)
        sc.max_mem_slack_bytes = max(sc.max_mem_slack_bytes, mem_slack)
        sc.max_objective_error += objective_error
    return IntModels(inner, outer, sc), len(form.rows)


def rescaled_scaling(t: CpSatTranslation, gis: Sequence[int], forbid: Forbidden) -> Scaling:
    """The call's scaling with the objective scale fitted to the choices left."""
    total = sum(abs(g.weight) * max(abs(v) for k, v in enumerate(row)
                                    if (u, k) not in forbid[gi])
                for gi in gis for g in [t.problem.groups[gi]]
                for u, row in enumerate(g.omega1) if row)
    return dataclasses.replace(t.models.scaling, omega_scale=omega_scale_for(total))


def rescaled(t: CpSatTranslation, gis: Sequence[int], forbid: Forbidden) -> IntModels:
    """The part's integer models without the choices ``forbid`` names."""
    sc = rescaled_scaling(t, gis, forbid)
    form = formulate(t.problem, gis, forbid=forbid)
    return IntModels({b.gi: integer_group(form, b, sc)[0] for b in form.blocks},
                     {b.gi: integer_group(form, b, sc, outer=True)[0]
                      for b in form.blocks}, sc)


def solve_part(raw: RawRun, check: ReportCheck, t: CpSatTranslation, gis: Sequence[int],
               limit: float, start: Mapping[str, Sequence[int]] | None, models: IntModels
               ) -> PartResult:
    """The outer model (3/4 of the share at most: the inner model is rarely needed);
    its optimum when the exact model accepts it, else the inner model's plan."""
    problem, messages, tag = t.problem, t.messages, t.tag(gis)
    t_end = timing.clock() + max(limit, 0.0)
    err = sum(models.inner[gi].obj_err for gi in gis)
    obj_min = sum(models.inner[gi].obj_min for gi in gis)
    out, nv, nc = solve_checked(raw, check, t, gis, models.outer, start, limit * 0.75,
                                models.scaling)
    lb = max(obj_min, out.bound - err)
    if out.status == "INFEASIBLE":
        messages.extend(infeasible_messages(problem, gis, problem.group_budget_ms()))
        messages.append(f"{tag}: no assignment meets the target and capacity "
                        "(proven on the outer model, a relaxation)")
        return PartResult("INFEASIBLE", None, None, nv, nc)
    if out.status == "ERROR":
        messages.append(f"{tag}: CP-SAT {out.name}")
        return PartResult("ERROR", None, None, nv, nc)
    found = out.assignment
    if found is not None and any(
            max(exact_violation(problem.groups[gi], found[problem.groups[gi].name],
                                problem.group_budget_ms())) > 0 for gi in gis):
        found = None
    if found is None:
        return from_inner(raw, check, t, gis, models, out, start, t_end, lb, err, nv, nc)
    return PartResult(out.status, found, lb, nv, nc, objective_tol=2 * err)


def from_inner(raw: RawRun, check: ReportCheck, t: CpSatTranslation, gis: Sequence[int],
               models: IntModels, out: Solved, start: Mapping[str, Sequence[int]] | None,
               t_end: float, lb: float, err: float, nv: int, nc: int) -> PartResult:
    """The inner model's plan (every solution is feasible in the exact model), OPTIMAL
    when it meets the outer bound within the gap."""
    problem, messages, tag, sc = t.problem, t.messages, t.tag(gis), models.scaling
    res, _, _ = solve_checked(raw, check, t, gis, models.inner, out.assignment or start,
                              t_end - timing.clock(), sc)
    if res.assignment is None:
        if res.status == "INFEASIBLE":
            messages.append(
                f"{tag}: infeasible within the scaling slack: the inner model has "
                "no solution, so any exactly feasible assignment lies within "
                f"{sc.max_time_slack_ms:.3g} ms of the budget or "
                f"{sc.max_mem_slack_bytes:.3g} B of the capacity (the outer "
                "optimum fails the exact model); highs/cbc decide such cases")
            return PartResult("INFEASIBLE", None, None, nv, nc)
        messages.append(f"{tag}: CP-SAT {res.name} after {res.wall_s:.2f} s, no solution")
        return PartResult("TIME_LIMIT" if res.status != "ERROR" else "ERROR",
                          None, lb, nv, nc)
    found = res.assignment
    for gi in gis:
        g = problem.groups[gi]
        dt, dm = exact_violation(g, found[g.name], problem.group_budget_ms(), rel=0.0)
        if dt > 0 or dm > 0:  # cannot happen with conservative rounding
            messages.append(f"group {g.name}: CP-SAT plan exceeds the exact "
                            f"model by {dt:.3g} ms / {dm:.3g} B (scaling bug)")
    obj = sum(problem.groups[gi].weight * problem.groups[gi].degradation(
        found[problem.groups[gi].name]) for gi in gis)
    proven = (out.status == "OPTIMAL" and obj - lb
              <= t.options.rel_gap * abs(obj) + 2 * err + 1e-12)
    why = ("the outer optimum lies within the rounding slack of a bound"
           if out.assignment is not None else
           f"the outer model found no solution in its time ({out.name})")
    messages.append(f"{tag}: {why}; plan from the inner model ({res.name})"
                    + ("" if proven else f", {obj - lb:.3g} above the outer bound"))
    return PartResult("OPTIMAL" if proven else "FEASIBLE", found, lb, nv, nc,
                      objective_tol=2 * err)


def _report_fails(check: ReportCheck, solved: Solved, rel_gap: float) -> str | None:
    if solved.assignment is None or solved.own is None or solved.reported is None:
        return None
    return check.why(solved.status, solved.own, solved.reported, solved.scaled_bound,
                     rel_gap)


def solve_checked(raw: RawRun, check: ReportCheck, t: CpSatTranslation, gis: Sequence[int],
                  ints: Mapping[int, IntGroup], hints: Mapping[str, Sequence[int]] | None,
                  time_limit: float, sc: Scaling) -> tuple[Solved, int, int]:
    """One CP-SAT run; its solution is checked against CP-SAT's own report (the scaled
    objective of the returned assignment must equal ``objective_value``, and an OPTIMAL
    one must lie within the gap of the bound). On a mismatch with hints it is re-solved
    without them; without hints the plan is kept as FEASIBLE and the bound dropped."""
    problem, options, messages = t.problem, t.options, t.messages
    t_end = timing.clock() + max(time_limit, 0.0)
    solved, nv, nc = raw(t.cp_model, problem, gis, ints, hints, options, t_end, sc, t.sw)
    why = _report_fails(check, solved, options.rel_gap)
    tag = problem.groups[gis[0]].name if len(gis) == 1 else "all"
    if why is not None and hints is not None and t_end - timing.clock() > 0:
        messages.append(check.retried_note(tag, "CP-SAT", solved.name, why))
        solved, nv, nc = raw(t.cp_model, problem, gis, ints, None, options, t_end, sc, t.sw)
        why = _report_fails(check, solved, options.rel_gap)
    if why is None:
        return solved, nv, nc
    messages.append(check.kept_note(tag, "CP-SAT", solved.name, why))
    floor = sum(ints[gi].obj_min for gi in gis)
    return dataclasses.replace(solved, status="FEASIBLE", bound=floor), nv, nc
