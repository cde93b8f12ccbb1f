"""A lower bound on a part's least objective from the LP relaxation of its exact program,
solved by HiGHS (the joint split's bound on a candidate before it is solved): the
relaxation (:func:`lp_relaxation`) on the normalised rows of :mod:`.pulp_model`, passed
straight to highspy."""

from __future__ import annotations

from collections.abc import Sequence

from qsync_opt.solvers import parts
from qsync_opt.solvers.base import SolveOptions
from qsync_opt.solvers.formulation import Formulation, formulate
from qsync_opt.solvers.highs_process import RowArrays, add_columns, use_threads, without_banner
from qsync_opt.solvers.pulp_model import column_bounds, normalised_rows, scaled_objective
from qsync_opt.solvers.pulp_runs import FEAS_TOL, available
from qsync_opt.solvers.timing import solver_limit

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


def lp_relaxation(form: Formulation, options: SolveOptions) -> tuple[str, float | None]:
    """The optimum of ``form``'s LP relaxation (every binary continuous in [0, 1]), solved
    by HiGHS on the same normalised rows as :func:`.pulp_model.to_pulp` gives it, passed
    straight to highspy: ("OPTIMAL", objective in the formulation's units), ("INFEASIBLE", None) or
    (another status, None)."""
    import highspy  # lazy: importing HiGHS costs ~0.25 s, kept off paths that never solve
    limit = solver_limit(float(options.time_limit_s))
    if not limit > 0:  # not started: too little time left for a run and its margin
        return "TIME_LIMIT", None
    h = without_banner(highspy.Highs)
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", limit)
    h.setOptionValue("random_seed", int(options.seed))
    h.setOptionValue("primal_feasibility_tolerance", FEAS_TOL)
    if options.threads:
        h.setOptionValue("threads", int(options.threads))
    use_threads(options.threads)
    inf = highspy.kHighsInf
    bounds = column_bounds(form)
    terms, scale, offset = scaled_objective(form, list(range(len(bounds))))
    add_columns(h, [lb for lb, _ in bounds], [inf if ub is None else ub for _, ub in bounds],
                terms)
    rows = RowArrays()
    for row, rterms, rhs in normalised_rows(form):
        rows.add(rhs if row.sense in ("==", ">=") else -inf,
                 rhs if row.sense in ("==", "<=") else inf, rterms)
    rows.load(h)
    h.run()
    S = highspy.HighsModelStatus
    status = h.getModelStatus()
    if status == S.kOptimal:
        return "OPTIMAL", h.getInfo().objective_function_value / scale + offset
    if status in (S.kInfeasible, S.kUnboundedOrInfeasible):
        return "INFEASIBLE", None
    return str(status), None
