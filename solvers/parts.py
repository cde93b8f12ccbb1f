"""What a part is: the groups one program holds (one per group, or all in one), the
outcome of solving it (:class:`PartResult`), its objective and trivial floor, its optimum
when no solver is needed (:func:`least_part`), and the better of two runs on it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from qsync_opt.solvers.base import PartResult, SolveOptions
from qsync_opt.solvers.checks import exact_violation
from qsync_opt.solvers.report import ZERO_REL, objective_scale

from qsync_opt.problem.program import AllocationProblem


def part_objective(problem: AllocationProblem, gis: Sequence[int],
                   assignment: Mapping[str, Sequence[int]]) -> float:
    return sum(problem.groups[gi].weight * problem.groups[gi].degradation(
        assignment[problem.groups[gi].name]) for gi in gis)


def part_floor(problem: AllocationProblem, gis: Sequence[int]) -> float:
    """The least objective any assignment of these groups has (a trivial bound)."""
    return sum(g.weight * min(r) for gi in gis for g in [problem.groups[gi]] for r in g.omega1
               if r)


def least_part(problem: AllocationProblem, gis: Sequence[int]) -> PartResult | None:
    """The part's optimum when no solver is needed (None otherwise): every real unit at its
    least ``Omega`` (the first, most exact, of equal ones) has the least objective any
    assignment has; when it meets each group's time budget and capacity exactly (no
    tolerance), it is optimal, its objective its own bound."""
    budget = problem.group_budget_ms()
    out: dict[str, list[int]] = {}
    for gi in gis:
        g = problem.groups[gi]
        if not all(g.omega1):
            return None
        a = [min(range(len(row)), key=row.__getitem__) for row in g.omega1]
        dt, dm = exact_violation(g, a, budget, rel=0.0)
        if dt > 0 or dm > 0:
            return None
        out[g.name] = a
    return PartResult("OPTIMAL", out, part_objective(problem, gis, out))



def better_of(problem: AllocationProblem, gis: Sequence[int], old: PartResult, new: PartResult,
            rel_gap: float) -> PartResult:
    """The better of two runs on the same part: the lower objective, the higher bound."""
    bounds = [b for b in (old.bound, new.bound) if b is not None]
    bound = max(bounds) if bounds else None
    cands = [r for r in (old, new) if r.assignment is not None]
    if not cands:
        return PartResult("TIME_LIMIT", None, bound)
    pick = min(cands, key=lambda r: part_objective(problem, gis, r.assignment or {}))
    obj = part_objective(problem, gis, pick.assignment or {})
    scale = objective_scale(problem)[0]
    proven = pick.status == "OPTIMAL" or (
        bound is not None and obj - bound <= rel_gap * abs(obj) + ZERO_REL * scale)
    return PartResult("OPTIMAL" if proven else "FEASIBLE", pick.assignment, bound)



def program_parts(problem: AllocationProblem, options: SolveOptions,
                  messages: list[str]) -> list[list[int]]:
    """Which groups each program holds: one per group (decomposed: with a fixed target the
    groups do not interact) or all in one; the choice is written to ``messages``."""
    n = len(problem.groups)
    if options.decompose:
        messages.append(f"decomposed: one program per group ({n} groups); with a fixed "
                        "target the groups do not interact")
        return [[gi] for gi in range(n)]
    messages.append(f"monolithic: one program for all {n} groups")
    return [list(range(n))]

