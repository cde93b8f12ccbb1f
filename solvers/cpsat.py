"""The exact program in OR-Tools CP-SAT (Boolean x and y, integer coefficients):
translation and one run of a part.

The model is a translation of :mod:`.formulation`'s program (one-hot ``x``, pair variables
``y`` tied to ``x`` by their marginal rows, AND rows for derived units, the working set
``W`` as an integer variable), in two steps: :func:`.integers.integer_group` turns each
group's block into integers (the rounding, its scale factors and slacks kept in
:class:`.integers.Scaling` and recorded in the report), then :mod:`.cpsat_writer` writes
the rows of the chosen groups, family by family (one-hot rows become
``add_exactly_one``). The driver (:mod:`.driver`) runs it: the deadline, the parts, the
warm start and the loose-optimum loop are its (an OPTIMAL whose objective rounding could
hide a better plan is re-solved on an objective scale fitted to the choices left).

Each program is solved on its outer and inner integer models (:mod:`.outer_inner`, which
states what the plan and the bound guarantee).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from types import ModuleType

from qsync_opt.solvers import timing
from qsync_opt.solvers.base import Forbidden, PartResult, SolveOptions
from qsync_opt.solvers.checks import cheap_infeasibility
from qsync_opt.solvers.consistency import ReportCheck
from qsync_opt.solvers.cpsat_writer import build_model, read_solution
from qsync_opt.solvers.driver import solve_exact
from qsync_opt.solvers.integers import IntGroup, Scaling, scaling_message
from qsync_opt.solvers.outer_inner import (
    CpSatTranslation,
    Solved,
    integer_models,
    rescaled,
    rescaled_scaling,
    solve_part,
)
from qsync_opt.solvers.timing import Stopwatch

from qsync_opt.documents.schemas import Plan, SolveReport
from qsync_opt.problem.program import AllocationProblem

#: Programs at most this large (variables) run on one CP-SAT worker by default: measured on
#: this 2-core machine, one worker proves resnet50 (1.6k variables) in 0.19 s and
#: gpt2_medium (4.5k per group) in 2.7 s, against 0.28 s and 6.5 s with 8; the 600-op
#: synthetic graph (26k per group) needs the 8-worker portfolio (2 workers stayed unproven
#: after 60 s in the issue's probe).
SMALL_PROGRAM_VARS = 20_000

#: CP-SAT's report against its solution, in scaled integer units: the objective it reports
#: within 0.5 of the solution's own, an OPTIMAL one within the gap plus one unit of its bound.
CPSAT_CHECK = ReportCheck(
    objective_abs=0.5, objective_rel=0.0, gap_floor=1.0, gap_abs=1.0,
    gap_adds_objective_tol=False,
    differs=("its solution's own scaled objective {own} differs from the reported "
             "{reported:.17g}"),
    above=("its solution's own scaled objective {own} is above its bound {bound:.17g} by "
           "more than the gap"),
    retried="{tag}: {solver} reported {status}, but {why}; re-solved without the hints",
    kept=("{tag}: {solver} reported {status}, but {why}; the plan is kept as FEASIBLE and "
          "CP-SAT's bound dropped"))


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
    requires = "ortools"
    hint_note = "warm start: hints given to CP-SAT (add_hint)"
    tolerance_name = "its objective's possible rounding error"
    demotion_note = ", its bound lowered by that rounding error"

    def is_available(self) -> bool:
        try:
            # lazy: OR-Tools is heavy to import; probed only when a CP-SAT run is asked for
            from ortools.sat.python import cp_model  # noqa: F401
        except Exception:
            return False
        return True

    def solve(self, problem: AllocationProblem, options: SolveOptions
              ) -> tuple[Plan | None, SolveReport]:
        """Per program (one per group, or one for all): the outer model, then the inner
        one when the outer optimum fails the exact model (:mod:`.outer_inner`)."""
        return solve_exact(self, problem, options)

    # ------------------------------------------------------- what the driver calls

    def translate(self, problem: AllocationProblem, options: SolveOptions, sw: Stopwatch,
                  messages: list[str]) -> CpSatTranslation:
        """The call's integer models (the formulation translated twice, inner and outer),
        or, before any scaling, the groups' least time and memory's proof of no plan
        (costs far above a tiny budget need no integers)."""
        from ortools.sat.python import cp_model  # lazy: OR-Tools is heavy to import

        proof = cheap_infeasibility(problem)
        if proof:  # the report's scaling keys are always there: zero units, no integers
            none = {**Scaling(0.0, 0.0, 0.0).to_json(), "scaled": False}
            return CpSatTranslation(problem, options, sw, messages, proof=proof,
                                    report_options=none)
        with sw.building():
            models, n_rows = integer_models(problem, options.cpsat.units)
        sc = models.scaling
        messages.append(scaling_message(n_rows, sc))
        report = {**sc.to_json(), "num_workers": options.threads or "auto",
                  "linearization_level": 2, "presolve_inclusion_work_limit": 0}
        return CpSatTranslation(problem, options, sw, messages, report_options=report,
                                optimal_tol=2 * sc.max_objective_error + 1.0 / sc.omega_scale,
                                cp_model=cp_model, models=models)

    def run(self, translation: CpSatTranslation, gis: Sequence[int], limit: float,
            start: Mapping[str, Sequence[int]] | None, forbid: Forbidden | None
            ) -> PartResult:
        t = translation
        models = t.models if forbid is None else rescaled(t, gis, forbid)
        return solve_part(self._solve_raw, CPSAT_CHECK, t, gis, limit, start, models)

    def rescale_note(self, translation: CpSatTranslation, gis: Sequence[int],
                     forbid: Forbidden) -> str:
        return f"objective x{rescaled_scaling(translation, gis, forbid).omega_scale:g}"

    def demoted(self, result: PartResult, objective: float) -> PartResult:
        """FEASIBLE, its bound lowered to ``objective`` less the rounding error at most."""
        err = result.objective_tol or 0.0
        return dataclasses.replace(result, status="FEASIBLE",
                                   bound=min(result.bound, objective - err)
                                   if result.bound is not None else None)

    def unproven_note(self, translation: CpSatTranslation, n_variables: int) -> str | None:
        return prefer_highs(translation.problem, n_variables)

    # ------------------------------------------------------------ one run

    def _solve_raw(self, cp_model: ModuleType, problem: AllocationProblem, gis: Sequence[int],
                   ints: Mapping[int, IntGroup], hints: Mapping[str, Sequence[int]] | None,
                   options: SolveOptions, t_end: float, sc: Scaling, sw: Stopwatch
                   ) -> tuple[Solved, int, int]:
        """Build and run CP-SAT until ``t_end`` (a :data:`.timing.clock` time); nothing is
        run when building used up the time (status TIME_LIMIT)."""
        with sw.building():
            model, xs, nv, nc = build_model(cp_model, gis, ints, hints)
        time_limit = t_end - timing.clock()
        if not time_limit > 0:
            return Solved("TIME_LIMIT", None, -math.inf, "not run (no time left)", 0.0), nv, nc
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
        for k, v in options.cpsat.params.items():  # raw CP-SAT parameters
            setattr(prm, k, v)
        with sw.solving():
            st = solver.solve(model)
        name = solver.status_name(st)
        status = {cp_model.OPTIMAL: "OPTIMAL", cp_model.FEASIBLE: "FEASIBLE",
                  cp_model.INFEASIBLE: "INFEASIBLE", cp_model.UNKNOWN: "TIME_LIMIT"
                  }.get(st, "ERROR")
        assignment, own, reported = None, None, None
        if status in ("OPTIMAL", "FEASIBLE"):
            assignment, own = read_solution(solver, problem, gis, xs, ints)
            reported = solver.objective_value
        has_bound = status in ("OPTIMAL", "FEASIBLE", "TIME_LIMIT")
        raw_bound = solver.best_objective_bound if has_bound else None
        bound = raw_bound / sc.omega_scale if raw_bound is not None else -math.inf
        if status == "ERROR":
            name += f" ({model.validate()})"
        return Solved(status, assignment, bound, name, solver.wall_time, own, reported,
                      raw_bound), nv, nc
