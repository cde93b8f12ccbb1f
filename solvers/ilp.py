"""The exact program in PuLP, solved by CBC or HiGHS: translation and one run of a part.

The program is :mod:`.formulation`'s (one-hot, pair marginals, derived units' AND rows,
working set, time and memory rows per group), translated by :mod:`.pulp_model` and run by
:mod:`.pulp_runs`. The driver (:mod:`.driver`) runs it: the deadline, the parts (by default
one small program per group: with a fixed target the groups do not interact), the memo, the
warm start and the loose-optimum loop are its.

Numerics. The time and memory rows are normalised (divided by the budget and the capacity)
and the solvers run with feasibility and integrality tolerances of 1e-9, so their absolute
tolerances act relatively. Every assignment is then checked with the exact model
(``GroupModel.time_ms`` / ``memory_bytes``, relative tolerance ``FEAS_REL``); in the rare
case a solver tolerance let a row slip, the row is tightened and the program re-solved, with
a message (:mod:`.row_repair`).

The objective is each unit's ``w * Omega`` less its least (a constant), divided by its
largest coefficient; the solvers' absolute gap is 1e-3 of the relative one in those units
(``PartResult.objective_tol``, which the driver's loose-optimum loop reads; a plan it cannot
prove has its bound dropped).

``build_s`` counts the formulation, its PuLP model and its transfer to the solver
(highspy arrays, or the MPS file and solution file), ``solve_s`` the solver's run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from qsync_opt.solvers import row_repair, timing
from qsync_opt.solvers.base import Forbidden, PartResult, SolveOptions, Translation
from qsync_opt.solvers.checks import FEAS_REL, exact_violation, infeasible_messages
from qsync_opt.solvers.consistency import ReportCheck
from qsync_opt.solvers.driver import solve_exact
from qsync_opt.solvers.fastest import FastestTimeLimit, fastest_plans, fastest_times
from qsync_opt.solvers.pulp_model import PulpProgram
from qsync_opt.solvers.pulp_runs import PULP_NAMES, Outcome, available, pulp_module, run
from qsync_opt.solvers.timing import Stopwatch

from qsync_opt.documents.schemas import Plan, SolveReport
from qsync_opt.problem.program import AllocationProblem

__all__ = ["FEAS_REL", "FastestTimeLimit", "PulpIlp", "exact_violation", "fastest_plans",
           "fastest_times"]

#: The solvers' report against their solution, in the program's scaled units (the largest
#: objective coefficient is 1): the objective they report within 1e-6 relative of the
#: solution's own, an OPTIMAL one within the gap of its bound (HiGHS with a start can report
#: kOptimal with the optimum's objective while ``getSolution`` still holds the start).
PULP_CHECK = ReportCheck(
    objective_abs=0.0, objective_rel=1e-6, gap_floor=0.0, gap_abs=1e-6,
    gap_adds_objective_tol=True,
    differs=("its solution's own objective {own:.9g} differs from the objective it "
             "reports, {reported:.9g} (scaled units)"),
    above=("its solution's own objective {own:.9g} is above its bound {bound:.9g} by more "
           "than the gap (scaled units)"),
    retried=("{tag}: {solver} reported {status}, but {why}; the solution looks like the "
             "warm start handed back; re-solved without the start"),
    kept=("{tag}: {solver} reported {status}, but {why}; the plan is kept as FEASIBLE (its "
          "own objective) and the solver's bound dropped"))


@dataclass
class PulpTranslation(Translation):
    """A PuLP call: the module (each part's program is built when the part runs)."""

    pulp: Any = None


class PulpIlp:
    """The exact program in PuLP, solved by CBC (``backend="cbc"``) or HiGHS."""

    exact = True
    requires = "pulp or the binary"
    tolerance_name = "its absolute gap tolerance"
    demotion_note = ", its bound dropped"

    def __init__(self, backend: str = "highs") -> None:
        if backend not in PULP_NAMES:
            raise ValueError(f"backend: expected cbc or highs, got {backend!r}")
        self.backend = backend
        self.name = backend

    @property
    def hint_note(self) -> str | None:
        return ("highs: warm start passed to highspy setSolution (pulp's HiGHS class has no "
                "warmStart)" if self.backend == "highs" else None)

    def is_available(self) -> bool:
        return available(self.backend)

    def solve(self, problem: AllocationProblem, options: SolveOptions
              ) -> tuple[Plan | None, SolveReport]:
        return solve_exact(self, problem, options)

    # ------------------------------------------------------- what the driver calls

    def translate(self, problem: AllocationProblem, options: SolveOptions, sw: Stopwatch,
                  messages: list[str]) -> PulpTranslation:
        own = options.highs if self.backend == "highs" else options.cbc
        memo = ("pulp", self.backend, options.rel_gap, options.seed, options.threads, repr(own))
        return PulpTranslation(problem, options, sw, messages, memo_key=memo,
                               report_options={"backend": self.backend}, pulp=pulp_module())

    def run(self, translation: PulpTranslation, gis: Sequence[int], limit: float,
            start: Mapping[str, Sequence[int]] | None, forbid: Forbidden | None
            ) -> PartResult:
        t = translation
        tag = t.tag(gis)
        end = timing.clock() + max(limit, 0.0)
        program = row_repair.Program(t.problem, gis, self.name, PULP_CHECK, t.options, end,
                                     t.sw, t.messages, tag)
        got = row_repair.solve_program(self._run, t.pulp, program, start, forbid)
        out = got.outcome
        if out.detail:
            t.messages.append(f"{tag}: {out.detail}")
        if out.status == "INFEASIBLE":
            t.messages.extend(infeasible_messages(t.problem, gis, t.problem.group_budget_ms()))
            t.messages.append(f"{tag}: no assignment meets the target and capacity")
        return PartResult(out.status, got.assignment, out.bound, got.n_variables,
                          got.n_constraints, objective_tol=out.abs_tol)

    def rescale_note(self, translation: PulpTranslation, gis: Sequence[int],
                     forbid: Forbidden) -> str:
        return "the objective rescaled"

    def demoted(self, result: PartResult, objective: float) -> PartResult:
        return dataclasses.replace(result, status="FEASIBLE", bound=None)

    def unproven_note(self, translation: PulpTranslation, n_variables: int) -> str | None:
        return None

    # ------------------------------------------------------------- one run

    def _run(self, pulp: ModuleType, prog: PulpProgram, options: SolveOptions, time_limit: float,
             start: bool, sw: Stopwatch, messages: list[str]) -> Outcome:
        return run(pulp, prog, self.backend, options, time_limit, start, sw, messages)
