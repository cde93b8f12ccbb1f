"""The exact program in PuLP, solved by CBC or HiGHS, and the additive-ILP baseline.

The program is :mod:`.formulation`'s (one-hot, pair marginals, derived units' AND rows,
working set, time and memory rows per group), translated by :mod:`.pulp_model`. With a
fixed target the groups do not interact: by default one small program is solved per group
(``SolveOptions.decompose``; the time limit is shared out, the bounds summed).

Numerics. The time and memory rows are normalised (divided by the budget and the capacity)
and the solvers run with feasibility and integrality tolerances of 1e-9, so their absolute
tolerances act relatively. Every assignment is then checked with the exact model
(``GroupModel.time_ms`` / ``memory_bytes``, relative tolerance ``FEAS_REL``); in the rare
case a solver tolerance let a row slip, the row is tightened (by the violation plus 1e-9,
then 1e-7, 1e-5 of the bound) and the program re-solved, with a message.

The objective is each unit's ``w * Omega`` less its least (a constant), divided by its
largest coefficient; the solvers' absolute gap is 1e-3 of the relative one in those units.
An OPTIMAL plan whose objective is so small beside the largest coefficient that this gap
exceeds the relative gap of it (one Omega 1e5 times the rest) is not trusted as proven: the
program is re-solved without the choices whose term alone exceeds the plan's whole
objective (no better plan takes one), which makes the largest coefficient at most the
plan's objective; a plan still not proven that way is FEASIBLE, its bound dropped.

``build_s`` counts the formulation, its PuLP model and its transfer to the solver
(highspy arrays, or the MPS file and solution file), ``solve_s`` the solver's run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ..problem import AllocationProblem
from ..schemas import Plan, SolveReport
from . import common
from .base import SolveOptions
from .common import (
    FEAS_REL,
    MAX_RESCALES,
    Deadline,
    PartResult,
    Stopwatch,
    check_numbers,
    exact_violation,
    excluded_choices,
    finish,
    infeasible_messages,
    mode_text,
    part_objective,
    program_parts,
    solve_parts,
)
from .fastest import FastestTimeLimit, fastest_plans, fastest_times
from .formulation import formulate
from .pulp_model import (
    PULP_NAMES,
    Outcome,
    PulpProgram,
    abs_gap,
    available,
    lp_relaxation,
    pulp_module,
    read_assignment,
    run,
    set_start,
    to_pulp,
)
from .warmstart import start_hints

__all__ = ["FEAS_REL", "AdditiveIlp", "FastestTimeLimit", "PulpIlp", "exact_violation",
           "excluded_choices", "fastest_plans", "fastest_times", "loose_optimum"]

#: Relative tightening of a row per repair (on top of the measured violation).
_REPAIR_MARGIN = 1e-9
_MAX_REPAIRS = 3


class PulpIlp:
    """The exact program in PuLP, solved by CBC (``backend="cbc"``) or HiGHS."""

    exact = True

    def __init__(self, backend: str = "highs") -> None:
        if backend not in PULP_NAMES:
            raise ValueError(f"backend: expected cbc or highs, got {backend!r}")
        self.backend = backend
        self.name = backend

    def is_available(self) -> bool:
        return available(self.backend)

    def _run(self, pulp: Any, prog: PulpProgram, options: SolveOptions, time_limit: float,
             start: bool, sw: Stopwatch, messages: list[str]) -> Outcome:
        return run(pulp, prog, self.backend, options, time_limit, start, sw, messages)

    # ----------------------------------------------------------------- the backend

    def _solve_program(self, pulp: Any, problem: AllocationProblem, gis: Sequence[int],
                       options: SolveOptions, hints: Mapping[str, Sequence[int]] | None,
                       deadline: float, sw: Stopwatch, messages: list[str], tag: str,
                       forbid: Mapping[int, frozenset[tuple[int, int]]] | None = None
                       ) -> tuple[Outcome, dict[str, list[int]] | None, int, int]:
        """Build and solve one program (the groups ``gis``) by ``deadline`` (a
        :data:`common.clock` time); repair rows a solver tolerance let slip; check the
        solution against the solver's own report (:meth:`_inconsistency`) and, when they
        disagree, re-solve without the start. Returns the outcome (bound in objective
        units), the assignment of those groups, and the program's size."""
        with sw.building():
            prog = to_pulp(pulp, formulate(problem, gis, forbid=forbid), f"qsync_{tag}")
            if hints is not None:
                set_start(prog, hints)
        budget = problem.group_budget_ms()
        out = Outcome("ERROR", None, 0.0)
        assign: dict[str, list[int]] | None = None
        start = hints is not None
        rechecked = False
        attempt = 0
        while True:
            left = deadline - common.clock()
            if not left > 0:  # nothing is run past the deadline (building took it)
                messages.append(f"{tag}: no time left to run {self.name} (the time limit "
                                "was spent before it)")
                return Outcome("TIME_LIMIT", None, 0.0), None, prog.n_variables, prog.n_constraints
            out = self._run(pulp, prog, options, left, start, sw, messages)
            if out.status not in ("OPTIMAL", "FEASIBLE"):
                return self._unscaled(out, prog), None, prog.n_variables, prog.n_constraints
            assign = {problem.groups[gv.gi].name: read_assignment(gv) for gv in prog.groups}
            own = (part_objective(problem, gis, assign) - prog.obj_offset) * prog.obj_scale
            why = self._inconsistency(out, own, options.rel_gap)
            if why is not None:
                if start and not rechecked and deadline - common.clock() > 0:
                    messages.append(f"{tag}: {self.name} reported {out.status}, but {why}; "
                                    "the solution looks like the warm start handed back; "
                                    "re-solved without the start")
                    start, rechecked = False, True
                    continue
                messages.append(f"{tag}: {self.name} reported {out.status}, but {why}; the "
                                "plan is kept as FEASIBLE (its own objective) and the "
                                "solver's bound dropped")
                out = dataclasses.replace(out, status="FEASIBLE", bound=None)
            slipped = False
            margin = _REPAIR_MARGIN * 100.0 ** attempt  # relative: 1e-9, 1e-7, 1e-5
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
                out = dataclasses.replace(out, abs_tol=abs_gap(options.rel_gap))
                return self._unscaled(out, prog), assign, prog.n_variables, prog.n_constraints
            if attempt == _MAX_REPAIRS:
                messages.append(f"{tag}: the solver's assignment still exceeds a bound after "
                                f"{_MAX_REPAIRS} tightenings; no plan")
                return (Outcome("ERROR", None, out.solve_s), None, prog.n_variables,
                        prog.n_constraints)
            if common.clock() >= deadline:
                messages.append(f"{tag}: the solver's assignment exceeds a bound within its "
                                "tolerance and no time is left to re-solve with the row "
                                "tightened; no plan")
                return (Outcome("TIME_LIMIT", None, out.solve_s), None, prog.n_variables,
                        prog.n_constraints)
            attempt += 1

    @staticmethod
    def _unscaled(out: Outcome, prog: PulpProgram) -> Outcome:
        """The outcome with its bound and objective in objective units."""
        off = prog.obj_offset
        return dataclasses.replace(
            out, bound=None if out.bound is None else out.bound / prog.obj_scale + off,
            objective=None if out.objective is None else out.objective / prog.obj_scale + off,
            abs_tol=None if out.abs_tol is None else out.abs_tol / prog.obj_scale)

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

    def solve_assignment(self, problem: AllocationProblem, options: SolveOptions,
                         sw: Stopwatch, messages: list[str]
                         ) -> tuple[str, dict[str, list[int]] | None, float | None, int, int]:
        """status, assignment (None if none), bound (objective units), n_vars, n_cons.

        ``options.time_limit_s`` bounds the whole solve (greedy's warm start included); the
        groups share what remains (:func:`common.solve_parts`)."""
        pulp = pulp_module()
        deadline = Deadline(options.time_limit_s)
        check_numbers(problem)
        hints = start_hints(problem, options, messages, deadline)
        budget = problem.group_budget_ms()
        if self.backend == "highs" and hints is not None:
            messages.append("highs: warm start passed to highspy setSolution "
                            "(pulp's HiGHS class has no warmStart)")
        parts = program_parts(problem, options, messages)

        def solve_part(gis: Sequence[int], limit: float,
                       start: Mapping[str, Sequence[int]] | None) -> PartResult:
            tag = problem.groups[gis[0]].name if len(gis) == 1 else "all"
            end = common.clock() + max(limit, 0.0)
            seed = start if start is not None else hints
            out, a, nv, nc = self._solve_program(pulp, problem, gis, options, seed, end, sw,
                                                 messages, tag)
            forbid: dict[int, frozenset[tuple[int, int]]] | None = None
            for rnd in range(MAX_RESCALES + 1):
                if out.status != "OPTIMAL" or a is None:
                    break
                why = loose_optimum(problem, gis, a, out.abs_tol, options.rel_gap)
                if why is None:
                    break
                new = excluded_choices(problem, gis, a)
                if new == forbid or common.clock() >= end or rnd == MAX_RESCALES:
                    messages.append(f"{tag}: {self.name} reported OPTIMAL, but {why}; status "
                                    "FEASIBLE, its bound dropped")
                    out = dataclasses.replace(out, status="FEASIBLE", bound=None)
                    break
                n_out = sum(len(v) for v in new.values())
                messages.append(f"{tag}: {self.name} reported OPTIMAL, but {why}; re-solved "
                                f"without the {n_out} choice(s) whose Omega alone exceeds the "
                                "plan's (no better plan takes them), the objective rescaled")
                forbid = new
                out2, a2, nv, nc = self._solve_program(pulp, problem, gis, options, a, end,
                                                       sw, messages, tag, forbid)
                if a2 is None or part_objective(problem, gis, a2) > part_objective(
                        problem, gis, a):
                    messages.append(f"{tag}: the re-solve gave {out2.status} and no better "
                                    "plan; the first plan is kept as FEASIBLE (no bound: the "
                                    "first solve's is not proven)")
                    out = dataclasses.replace(out, status="FEASIBLE", bound=None)
                    break
                out, a = out2, a2
            if out.detail:
                messages.append(f"{tag}: {out.detail}")
            if out.status == "INFEASIBLE":
                messages.extend(infeasible_messages(problem, gis, budget))
                messages.append(f"{tag}: no assignment meets the target and capacity")
            return PartResult(out.status, a, out.bound, nv, nc)

        memo = (None if hints is not None else
                ("pulp", self.backend, options.rel_gap, options.seed, options.threads,
                 repr(sorted(options.extra.items()))))
        return solve_parts(problem, parts, solve_part, deadline, messages, options.rel_gap,
                           memo)

    def solve(self, problem: AllocationProblem, options: SolveOptions
              ) -> tuple[Plan | None, SolveReport]:
        sw = Stopwatch()
        messages: list[str] = []
        if not self.is_available():
            messages.append(f"{self.name}: solver not available (pulp or the binary missing)")
            return finish(problem, self.name, None, status="ERROR", mode=mode_text(problem),
                          options=options, sw=sw, messages=messages)
        status, a, bound, nv, nc = self.solve_assignment(problem, options, sw, messages)
        if a is not None and status == "OPTIMAL" and bound is not None:
            bound = min(bound, problem.objective(a))
        return finish(problem, self.name, a, status=status, mode=mode_text(problem),
                      options=options, sw=sw, bound=bound, n_variables=nv, n_constraints=nc,
                      messages=messages, extra_options={"backend": self.backend})


def loose_optimum(problem: AllocationProblem, gis: Sequence[int],
                  assignment: Mapping[str, Sequence[int]], abs_tol: float | None,
                  rel_gap: float) -> str | None:
    """Why an OPTIMAL plan is not proven within the relative gap (None: it is): the
    solver's absolute gap ``abs_tol`` (objective units) exceeds ``rel_gap`` of the plan's
    objective, as when one Omega is 1e5 times the rest and the optimum is made of the
    rest. A plan whose shifted objective is 0 is optimal whatever the tolerances."""
    if abs_tol is None:
        return None
    z = part_objective(problem, gis, assignment)
    low = sum(g.weight * min(r) for gi in gis for g in [problem.groups[gi]] for r in g.omega1
              if r)
    if z - low <= 0.0 or abs_tol <= rel_gap * abs(z):
        return None
    return (f"its absolute gap tolerance {abs_tol:.3g} is more than the relative gap "
            f"{rel_gap:g} of the plan's objective {z:.6g} (Omegas of very different sizes)")


class AdditiveIlp:
    """Baseline: the one-hot ILP of QSync's and HAWQ-V3's code, with purely additive
    latency (no cast terms). Solved exactly on its own model, scored on the real one."""

    name = "additive-ilp"
    exact = False

    def _backend(self) -> PulpIlp | None:
        for b in ("highs", "cbc"):
            if PulpIlp(b).is_available():
                return PulpIlp(b)
        return None

    def is_available(self) -> bool:
        return self._backend() is not None

    def solve(self, problem: AllocationProblem, options: SolveOptions
              ) -> tuple[Plan | None, SolveReport]:
        sw = Stopwatch()
        messages: list[str] = []
        backend = self._backend()
        if backend is None:
            messages.append("additive-ilp: no PuLP solver available")
            return finish(problem, self.name, None, status="ERROR", mode=mode_text(problem),
                          options=options, sw=sw, messages=messages)
        with sw.building():
            additive = problem.with_options(casts=False, target_ms=problem.target_ms)
            for ga, g in zip(additive.groups, problem.groups, strict=True):
                ga.capacity_bytes = g.capacity_bytes  # the same bound, even if edited
        messages.append(
            f"additive model solved with {backend.name}: its time row ignores casts (QSync's "
            "and HAWQ-V3's ILP); the plan is scored on the cast-aware model")
        status, a, _, nv, nc = backend.solve_assignment(additive, options, sw, messages)
        if a is not None:
            budget = problem.group_budget_ms()
            bad = []
            for g in problem.groups:
                dt, dm = exact_violation(g, a[g.name], budget)
                if dt > 0:
                    bad.append(f"group {g.name}: time {g.time_ms(a[g.name]):.4f} ms exceeds "
                               f"the budget {budget:.4f} ms by {dt:.4f} ms once casts count")
                if dm > 0:
                    bad.append(f"group {g.name}: memory exceeds the capacity by {dm:.0f} bytes "
                               "in the cast-aware model")
            messages.extend(bad)
            status = "INFEASIBLE" if bad else "FEASIBLE"
            if bad:
                messages.append("the plan is returned although it violates the real model")
        return finish(problem, self.name, a, status=status, mode=mode_text(problem),
                      options=options, sw=sw, bound=None, n_variables=nv, n_constraints=nc,
                      messages=messages, extra_options={"backend": backend.name,
                                                        "casts": False})


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
    least = common.least_part(problem, gis)
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
