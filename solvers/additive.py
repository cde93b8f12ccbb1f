"""The additive-ILP baseline: the one-hot ILP of QSync's and HAWQ-V3's code, with purely
additive latency (no cast terms), solved exactly by HiGHS or CBC on its own model and
scored on the real, cast-aware one."""

from __future__ import annotations

from qsync_opt.solvers.base import SolveOptions
from qsync_opt.solvers.checks import exact_violation
from qsync_opt.solvers.driver import solve_assignment
from qsync_opt.solvers.ilp import PulpIlp
from qsync_opt.solvers.report import finish, mode_text
from qsync_opt.solvers.timing import Stopwatch

from qsync_opt.documents.schemas import Plan, SolveReport
from qsync_opt.problem.program import AllocationProblem


def cast_violations(problem: AllocationProblem, assignment: dict[str, list[int]]) -> list[str]:
    """Where a plan of the additive model exceeds the real model's budget or capacity."""
    budget = problem.group_budget_ms()
    bad = []
    for g in problem.groups:
        dt, dm = exact_violation(g, assignment[g.name], budget)
        if dt > 0:
            bad.append(f"group {g.name}: time {g.time_ms(assignment[g.name]):.4f} ms exceeds "
                       f"the budget {budget:.4f} ms by {dt:.4f} ms once casts count")
        if dm > 0:
            bad.append(f"group {g.name}: memory exceeds the capacity by {dm:.0f} bytes "
                       "in the cast-aware model")
    return bad


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
        got, _ = solve_assignment(backend, additive, options, sw, messages)
        status, a = got.status, got.assignment
        if a is not None:
            bad = cast_violations(problem, a)
            messages.extend(bad)
            status = "INFEASIBLE" if bad else "FEASIBLE"
            if bad:
                messages.append("the plan is returned although it violates the real model")
        return finish(problem, self.name, a, status=status, mode=mode_text(problem),
                      options=options, sw=sw, bound=None, n_variables=got.n_variables,
                      n_constraints=got.n_constraints, messages=messages,
                      extra_options={"backend": backend.name, "casts": False})
