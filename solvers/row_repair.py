"""A PuLP program built, run and checked until its plan holds in the exact model.

The program of a part (the groups ``gis``) is translated (:mod:`.pulp_model`), its warm
start set, and run (one run of the backend's, by the deadline). The solver's report is
checked against its solution (:mod:`.consistency`): when they disagree after a start, the
program is re-solved without it; else the plan is kept as FEASIBLE without the solver's
bound. In the rare case a solver tolerance let a row slip (the exact model,
``GroupModel.time_ms`` / ``memory_bytes``, exceeds its bound beyond ``FEAS_REL``), the row is
tightened by the violation plus a relative margin (1e-9, then 1e-7, 1e-5) and the program
re-solved, with a message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType

from qsync_opt.solvers import timing
from qsync_opt.solvers.base import Forbidden, SolveOptions
from qsync_opt.solvers.checks import exact_violation
from qsync_opt.solvers.consistency import ReportCheck
from qsync_opt.solvers.formulation import formulate
from qsync_opt.solvers.parts import part_objective
from qsync_opt.solvers.pulp_model import PulpProgram, read_assignment, set_start, to_pulp
from qsync_opt.solvers.pulp_runs import Outcome, abs_gap
from qsync_opt.solvers.timing import Stopwatch

from qsync_opt.problem.program import AllocationProblem

#: Relative tightening of a row per repair (on top of the measured violation).
REPAIR_MARGIN = 1e-9
MAX_REPAIRS = 3

#: One run of the solver: (pulp, program, options, seconds, from the start?, stopwatch,
#: messages) -> its outcome.
OneRun = Callable[[ModuleType, PulpProgram, SolveOptions, float, bool, Stopwatch, list[str]],
                  Outcome]


@dataclass
class Solved:
    """One program's outcome (bound in objective units), its assignment and size."""

    outcome: Outcome
    assignment: dict[str, list[int]] | None
    n_variables: int
    n_constraints: int


@dataclass
class Program:
    """What one program's solve needs besides its runs: the problem and its groups, the
    solver's name and report check, the options, the deadline (a :data:`timing.clock`
    time) and the call's stopwatch and messages, and the part's tag."""

    problem: AllocationProblem
    gis: Sequence[int]
    solver: str
    check: ReportCheck
    options: SolveOptions
    deadline: float
    sw: Stopwatch
    messages: list[str]
    tag: str


def solve_program(run_once: OneRun, pulp: ModuleType, p: Program,
                  hints: Mapping[str, Sequence[int]] | None, forbid: Forbidden | None = None
                  ) -> Solved:
    """Build and solve one program by its deadline; repair rows a solver tolerance let
    slip (:func:`repair`); check the solution against the solver's own report and, when
    they disagree, re-solve without the start."""
    problem, messages, tag = p.problem, p.messages, p.tag
    with p.sw.building():
        prog = to_pulp(pulp, formulate(problem, p.gis, forbid=forbid), f"qsync_{tag}")
        if hints is not None:
            set_start(prog, hints)
    start, rechecked, attempt = hints is not None, False, 0
    while True:
        left = p.deadline - timing.clock()
        if not left > 0:  # nothing is run past the deadline (building took it)
            messages.append(f"{tag}: no time left to run {p.solver} (the time limit "
                            "was spent before it)")
            return solved(Outcome("TIME_LIMIT", None, 0.0), None, prog)
        out = run_once(pulp, prog, p.options, left, start, p.sw, messages)
        if out.status not in ("OPTIMAL", "FEASIBLE"):
            return solved(out, None, prog)
        assign = {problem.groups[gv.gi].name: read_assignment(gv) for gv in prog.groups}
        own = (part_objective(problem, p.gis, assign) - prog.obj_offset) * prog.obj_scale
        why = p.check.why(out.status, own, out.objective, out.bound, p.options.rel_gap)
        if why is not None:
            if start and not rechecked and p.deadline - timing.clock() > 0:
                messages.append(p.check.retried_note(tag, p.solver, out.status, why))
                start, rechecked = False, True
                continue
            messages.append(p.check.kept_note(tag, p.solver, out.status, why))
            out = dataclasses.replace(out, status="FEASIBLE", bound=None)
        ended = repair(p, prog, assign, out, attempt)
        if ended is not None:
            return ended
        attempt += 1


def repair(p: Program, prog: PulpProgram, assign: dict[str, list[int]], out: Outcome,
           attempt: int) -> Solved | None:
    """The program's result when no row slipped (None: a row was tightened, solve
    again). A row the solution exceeds within the solver's tolerance is tightened by
    its violation plus a relative margin (1e-9, 1e-7, 1e-5)."""
    problem, messages, tag = p.problem, p.messages, p.tag
    budget = problem.group_budget_ms()
    slipped = False
    margin = REPAIR_MARGIN * 100.0 ** attempt
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
                f"{REPAIR_MARGIN * 100.0 ** (attempt - 1):.0e} relative)")
        return solved(dataclasses.replace(out, abs_tol=abs_gap(p.options.rel_gap)),
                      assign, prog)
    if attempt == MAX_REPAIRS:
        messages.append(f"{tag}: the solver's assignment still exceeds a bound after "
                        f"{MAX_REPAIRS} tightenings; no plan")
        return solved(Outcome("ERROR", None, out.solve_s), None, prog)
    if timing.clock() >= p.deadline:
        messages.append(f"{tag}: the solver's assignment exceeds a bound within its "
                        "tolerance and no time is left to re-solve with the row "
                        "tightened; no plan")
        return solved(Outcome("TIME_LIMIT", None, out.solve_s), None, prog)
    return None


def solved(out: Outcome, assign: dict[str, list[int]] | None, prog: PulpProgram) -> Solved:
    """The outcome with its bound, objective and tolerance in objective units."""
    off = prog.obj_offset
    unscaled = dataclasses.replace(
        out, bound=None if out.bound is None else out.bound / prog.obj_scale + off,
        objective=None if out.objective is None else out.objective / prog.obj_scale + off,
        abs_tol=None if out.abs_tol is None else out.abs_tol / prog.obj_scale)
    return Solved(unscaled, assign, prog.n_variables, prog.n_constraints)
