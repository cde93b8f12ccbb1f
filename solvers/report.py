"""The Plan and the SolveReport of one solve: the objective recomputed from the problem,
the bound clamped to what is known, the one definition of the optimality gap, and the
demotion of an OPTIMAL that lies further above its bound than the gap allows."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from qsync_opt.solvers.base import SolveOptions
from qsync_opt.solvers.timing import Stopwatch

from qsync_opt.documents.schemas import Plan, SolveReport
from qsync_opt.problem.program import AllocationProblem

#: Objective differences below this fraction of the largest possible objective are zero
#: (bounds of -3.9e-16 on an optimum of 0 are solver noise, not a gap).
ZERO_REL = 1e-12


def objective_scale(problem: AllocationProblem) -> tuple[float, float, float]:
    """(largest possible |objective|, largest single |term|, least possible objective): the
    sums of each unit's largest |weight * Omega|, the largest such term, and the sum of each
    unit's smallest weight * Omega (a bound no assignment goes below)."""
    total = top = low = 0.0
    for g in problem.groups:
        for row in g.omega1:
            if row:
                terms = [g.weight * v for v in row]
                big = max(abs(v) for v in terms)
                total += big
                top = max(top, big)
                low += min(terms)
    return total, top, low


def relative_gap(objective: float | None, bound: float | None, scale: float) -> float | None:
    """The one gap of every backend: ``(objective - bound) / max(|objective|, |bound|)``,
    0 when the difference is within ``ZERO_REL * scale`` (both ~0 included: a proven optimum
    of 0 has gap 0); None without a bound."""
    if objective is None or bound is None:
        return None
    diff = objective - bound
    if diff <= ZERO_REL * max(scale, 0.0):
        return 0.0
    return diff / max(abs(objective), abs(bound))


def clean_bound(objective: float | None, bound: float | None, problem: AllocationProblem,
                messages: list[str]) -> float | None:
    """A bound clamped to what is known: never below the least possible objective (tiny
    negative bounds of a 0 optimum), never above the plan's own objective (within
    tolerance; a bound far above it is solver output that contradicts itself: dropped,
    with a message)."""
    if bound is None or not math.isfinite(bound):
        return None
    scale, _, low = objective_scale(problem)
    bound = max(bound, low)
    if objective is not None and bound > objective:
        if bound - objective > 1e-9 * max(abs(objective), ZERO_REL * scale) + ZERO_REL * scale:
            messages.append(f"bound {bound:.6g} above the plan's own objective {objective:.6g}: "
                            "the solver's output contradicts itself; bound dropped")
            return None
        bound = objective
    return bound




def finish(
    problem: AllocationProblem,
    solver: str,
    assignment: Mapping[str, Sequence[int]] | None,
    *,
    status: str,
    mode: str,
    options: SolveOptions,
    sw: Stopwatch,
    bound: float | None = None,
    n_variables: int = 0,
    n_constraints: int = 0,
    messages: Sequence[str] = (),
    extra_options: Mapping[str, Any] | None = None,
    plan: Plan | None = None,
    optimal_tol: float = 0.0,
) -> tuple[Plan | None, SolveReport]:
    """The Plan (None when there is no assignment) and the report of one solve.

    ``objective`` is always recomputed from the problem (never taken from the solver); the
    bound is clamped (:func:`clean_bound`) and ``gap`` is :func:`relative_gap`. A status
    OPTIMAL whose plan lies further above the bound than the gap tolerance allows
    (``options.rel_gap``, HiGHS's absolute 1e-6 of the largest term, ``optimal_tol``) is
    not trusted: it becomes FEASIBLE, with a message.
    """
    objective = None
    messages = list(messages)
    if plan is None and assignment is not None:
        objective = problem.objective(assignment)
    elif plan is not None:
        objective = problem.objective(problem.assignment(plan)) if plan.cluster == problem.cluster else None
    scale, top, _ = objective_scale(problem)
    bound = clean_bound(objective, bound, problem, messages)
    gap = relative_gap(objective, bound, scale)
    if status == "OPTIMAL" and objective is not None and bound is not None:
        allowed = (options.rel_gap * abs(objective) + 1e-6 * top + optimal_tol
                   + ZERO_REL * scale)
        if objective - bound > allowed:
            messages.append(f"{solver}: reported OPTIMAL, but the plan's own objective "
                            f"{objective:.6g} is {objective - bound:.3g} above the bound "
                            f"{bound:.6g} (more than the gap tolerance): status FEASIBLE")
            status = "FEASIBLE"
    opts: dict[str, Any] = options.to_json()
    opts.update(extra_options or {})
    clean = {k: v for k, v in opts.items() if v is None or isinstance(v, (str, int, float, bool))}
    report = SolveReport.model_validate(dict(
        solver=solver, status=status, mode=mode,
        objective=objective, bound=bound, gap=gap, build_s=sw.build_s, solve_s=sw.solve_s,
        wall_s=sw.wall_s, n_variables=n_variables, n_constraints=n_constraints, options=clean,
        messages=messages))
    if plan is None and assignment is not None:
        plan = problem.make_plan(assignment, {
            "solver": solver, "status": status, "objective": objective, "bound": bound,
            "gap": gap, "mode": mode,
            **{f"option.{k}": v for k, v in clean.items()}})
    return plan, report


def mode_text(problem: AllocationProblem) -> str:
    return (f"least degradation under makespan target {problem.target_ms:.3f} ms "
            f"({problem.target_source})")
