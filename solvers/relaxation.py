"""A lower bound on a part's least objective from the LP relaxation of its exact program,
solved by HiGHS (the joint split's bound on a candidate before it is solved)."""

from __future__ import annotations

from collections.abc import Sequence

from qsync_opt.solvers import parts
from qsync_opt.solvers.base import SolveOptions
from qsync_opt.solvers.formulation import formulate
from qsync_opt.solvers.pulp_model import available, lp_relaxation

from qsync_opt.problem.program import AllocationProblem

#: The LP relaxation's optimum is taken down by this relative margin (the LP solver's
#: optimality tolerance) before it bounds anything.
RELAX_REL = 1e-6


def relaxation_bound(problem: AllocationProblem, gis: Sequence[int],
                     options: SolveOptions) -> tuple[str, float | None]:
    """A lower bound on the least objective of the groups ``gis`` from the LP relaxation of
    their exact program (the formulation with every binary continuous in [0, 1]), solved by
    HiGHS: ("OPTIMAL", bound), ("INFEASIBLE", None) when the relaxation has no point (then
    neither has the program), or ("UNKNOWN", None) when HiGHS is missing or gave no answer.
    The bound holds for every backend's plan: each is an assignment of the exact model.
    HiGHS runs with ``options``' threads, seed and time limit."""
    least = parts.least_part(problem, gis)
    if least is not None:
        return "OPTIMAL", least.bound
    if not available("highs"):
        return "UNKNOWN", None
    status, value = lp_relaxation(formulate(problem, gis), options)
    if status == "INFEASIBLE":
        return "INFEASIBLE", None
    if status != "OPTIMAL" or value is None:
        return "UNKNOWN", None
    return "OPTIMAL", value - RELAX_REL * max(abs(value), part_floor_scale(problem, gis))


def part_floor_scale(problem: AllocationProblem, gis: Sequence[int]) -> float:
    """The size of the groups' objective terms (for an absolute margin): their largest
    ``w * Omega``."""
    return max((abs(g.weight * v) for gi in gis for g in [problem.groups[gi]]
                for row in g.omega1 for v in row), default=0.0)
