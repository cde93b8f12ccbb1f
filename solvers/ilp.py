"""The exact program in PuLP, solved by CBC or HiGHS: translation and one run of a part.

The program is :mod:`.formulation`'s (one-hot, pair marginals, derived units' AND rows,
working set, time and memory rows per group), translated by :mod:`.pulp_model`. The driver
(:mod:`.driver`) runs it: the deadline, the parts (by default one small program per group:
with a fixed target the groups do not interact), the memo, the warm start and the
loose-optimum loop are its.

Numerics. The time and memory rows are normalised (divided by the budget and the capacity)
and the solvers run with feasibility and integrality tolerances of 1e-9, so their absolute
tolerances act relatively. Every assignment is then checked with the exact model
(``GroupModel.time_ms`` / ``memory_bytes``, relative tolerance ``FEAS_REL``); in the rare
case a solver tolerance let a row slip, the row is tightened (by the violation plus 1e-9,
then 1e-7, 1e-5 of the bound) and the program re-solved, with a message.

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

from qsync_opt.solvers import timing
from qsync_opt.solvers.base import Forbidden, PartResult, SolveOptions, Translation
from qsync_opt.solvers.checks import FEAS_REL, exact_violation, infeasible_messages
from qsync_opt.solvers.driver import solve_exact
from qsync_opt.solvers.fastest import FastestTimeLimit, fastest_plans, fastest_times
from qsync_opt.solvers.formulation import formulate
from qsync_opt.solvers.parts import part_objective
from qsync_opt.solvers.pulp_model import (
    PULP_NAMES,
    Outcome,
    PulpProgram,
    abs_gap,
    available,
    pulp_module,
    read_assignment,
    run,
    set_start,
    to_pulp,
)
from qsync_opt.solvers.timing import Stopwatch

from qsync_opt.documents.schemas import Plan, SolveReport
from qsync_opt.problem.program import AllocationProblem

__all__ = ["FEAS_REL", "FastestTimeLimit", "PulpIlp", "exact_violation", "fastest_plans",
           "fastest_times"]

#: Relative tightening of a row per repair (on top of the measured violation).
_REPAIR_MARGIN = 1e-9
_MAX_REPAIRS = 3


@dataclass
class PulpTranslation(Translation):
    """A PuLP call: the module (each part's program is built when the part runs)."""

    pulp: Any = None


@dataclass
class _Solved:
    """One program's outcome (bound in objective units), its assignment and size."""

    outcome: Outcome
    assignment: dict[str, list[int]] | None
    n_variables: int
    n_constraints: int


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
        got = self._solve_program(t.pulp, t.problem, gis, t.options, start, end, t.sw,
                                  t.messages, tag, forbid)
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

    # ------------------------------------------------------------- one program

    def _run(self, pulp: ModuleType, prog: PulpProgram, options: SolveOptions, time_limit: float,
             start: bool, sw: Stopwatch, messages: list[str]) -> Outcome:
        return run(pulp, prog, self.backend, options, time_limit, start, sw, messages)

    def _solve_program(self, pulp: ModuleType, problem: AllocationProblem, gis: Sequence[int],
                       options: SolveOptions, hints: Mapping[str, Sequence[int]] | None,
                       deadline: float, sw: Stopwatch, messages: list[str], tag: str,
                       forbid: Forbidden | None = None) -> _Solved:
        """Build and solve one program (the groups ``gis``) by ``deadline`` (a
        :data:`timing.clock` time); repair rows a solver tolerance let slip
        (:meth:`_repair`); check the solution against the solver's own report
        (:meth:`_inconsistency`) and, when they disagree, re-solve without the start."""
        with sw.building():
            prog = to_pulp(pulp, formulate(problem, gis, forbid=forbid), f"qsync_{tag}")
            if hints is not None:
                set_start(prog, hints)
        start, rechecked, attempt = hints is not None, False, 0
        while True:
            left = deadline - timing.clock()
            if not left > 0:  # nothing is run past the deadline (building took it)
                messages.append(f"{tag}: no time left to run {self.name} (the time limit "
                                "was spent before it)")
                return self._solved(Outcome("TIME_LIMIT", None, 0.0), None, prog)
            out = self._run(pulp, prog, options, left, start, sw, messages)
            if out.status not in ("OPTIMAL", "FEASIBLE"):
                return self._solved(out, None, prog)
            assign = {problem.groups[gv.gi].name: read_assignment(gv) for gv in prog.groups}
            own = (part_objective(problem, gis, assign) - prog.obj_offset) * prog.obj_scale
            why = self._inconsistency(out, own, options.rel_gap)
            if why is not None:
                if start and not rechecked and deadline - timing.clock() > 0:
                    messages.append(f"{tag}: {self.name} reported {out.status}, but {why}; "
                                    "the solution looks like the warm start handed back; "
                                    "re-solved without the start")
                    start, rechecked = False, True
                    continue
                messages.append(f"{tag}: {self.name} reported {out.status}, but {why}; the "
                                "plan is kept as FEASIBLE (its own objective) and the "
                                "solver's bound dropped")
                out = dataclasses.replace(out, status="FEASIBLE", bound=None)
            ended = self._repair(problem, prog, assign, out, options, attempt, deadline,
                                 messages, tag)
            if ended is not None:
                return ended
            attempt += 1

    def _repair(self, problem: AllocationProblem, prog: PulpProgram,
                assign: dict[str, list[int]], out: Outcome, options: SolveOptions,
                attempt: int, deadline: float, messages: list[str], tag: str
                ) -> _Solved | None:
        """The program's result when no row slipped (None: a row was tightened, solve
        again). A row the solution exceeds within the solver's tolerance is tightened by
        its violation plus a relative margin (1e-9, 1e-7, 1e-5)."""
        budget = problem.group_budget_ms()
        slipped = False
        margin = _REPAIR_MARGIN * 100.0 ** attempt
        for gv in prog.groups:
            g = problem.groups[gv.gi]
            dt, dm = exact_violation(g, assign[g.name], budget)
            if dt > 0 and gv.time_row is not None:
                gv.time_row.constant += dt / gv.time_scale + margin
                slipped = True
            if dm > 0:
                gv.mem_row.constant += dm / gv.mem_scale + margin
                slipped = True
        if not slipped:
            if attempt:
                messages.append(
                    f"{tag}: {attempt} re-solve(s) after a row exceeded its bound within "
                    f"the solver's tolerance (rows tightened by up to "
                    f"{_REPAIR_MARGIN * 100.0 ** (attempt - 1):.0e} relative)")
            return self._solved(dataclasses.replace(out, abs_tol=abs_gap(options.rel_gap)),
                                assign, prog)
        if attempt == _MAX_REPAIRS:
            messages.append(f"{tag}: the solver's assignment still exceeds a bound after "
                            f"{_MAX_REPAIRS} tightenings; no plan")
            return self._solved(Outcome("ERROR", None, out.solve_s), None, prog)
        if timing.clock() >= deadline:
            messages.append(f"{tag}: the solver's assignment exceeds a bound within its "
                            "tolerance and no time is left to re-solve with the row "
                            "tightened; no plan")
            return self._solved(Outcome("TIME_LIMIT", None, out.solve_s), None, prog)
        return None

    @staticmethod
    def _solved(out: Outcome, assign: dict[str, list[int]] | None, prog: PulpProgram
                ) -> _Solved:
        """The outcome with its bound, objective and tolerance in objective units."""
        off = prog.obj_offset
        unscaled = dataclasses.replace(
            out, bound=None if out.bound is None else out.bound / prog.obj_scale + off,
            objective=None if out.objective is None else out.objective / prog.obj_scale + off,
            abs_tol=None if out.abs_tol is None else out.abs_tol / prog.obj_scale)
        return _Solved(unscaled, assign, prog.n_variables, prog.n_constraints)

    @staticmethod
    def _inconsistency(out: Outcome, own: float, rel_gap: float) -> str | None:
        """Why the solver's report does not describe the solution it returned (None: it
        does). ``own``: the returned assignment's objective recomputed from the problem, in
        the program's scaled units (the largest coefficient is 1). The reported objective
        must equal it, and an OPTIMAL one must lie within the gap of the bound (HiGHS with a
        start can report kOptimal with the optimum's objective while ``getSolution`` still
        holds the start)."""
        tol = 1e-6 * max(1.0, abs(own))
        if out.objective is not None and abs(own - out.objective) > tol:
            return (f"its solution's own objective {own:.9g} differs from the objective it "
                    f"reports, {out.objective:.9g} (scaled units)")
        if out.status == "OPTIMAL" and out.bound is not None and (
                own - out.bound > rel_gap * abs(own) + 1e-6 + tol):
            return (f"its solution's own objective {own:.9g} is above its bound "
                    f"{out.bound:.9g} by more than the gap (scaled units)")
        return None
