"""One call of the allocator: its deadline, one backend run scored by the evaluator, and
the errors of a call that ends without a plan.

:class:`SolveCall` carries the deadline every solve, refinement round, fallback, tie
comparison and diagnosis inside one call shares. :func:`run_backend` runs one backend within
it and scores the plan with :func:`qsync_opt.problem.evaluator.evaluate`;
:func:`reachable_ms` is the smallest makespan the linear model reaches.
:class:`InfeasibleError` and :class:`SolveTimeLimit` say why a call has no plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.documents.schemas import Plan, SolveReport
from qsync_opt.planner.diagnose import explain
from qsync_opt.planner.errors import InfeasibleError, SolveTimeLimit
from qsync_opt.problem.evaluator import Evaluation, evaluate
from qsync_opt.problem.groupmodel import GroupModel
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.solvers import Backend, SolveOptions, timing
from qsync_opt.solvers.backends import get_backend
from qsync_opt.solvers.ilp import FastestTimeLimit, PulpIlp, fastest_times
from qsync_opt.solvers.report import ZERO_REL, mode_text, objective_scale
from qsync_opt.solvers.timing import Deadline


@dataclass(frozen=True)
class ScoredRun:
    """A backend's plan (None: none), its report, and the evaluator's score of the plan."""

    plan: Plan | None
    report: SolveReport
    evaluation: Evaluation | None


@dataclass
class SolveCall:
    """One call's deadline (every solve, refinement round, fallback, tie comparison and
    diagnosis inside it gets at most what remains) and the reachable makespans it found
    (they do not depend on the target; keyed by the problem's group models)."""

    deadline: Deadline
    reach: dict[int, tuple[list[GroupModel], float | None]] = field(default_factory=dict)

    @classmethod
    def start(cls, options: SolveOptions) -> SolveCall:
        return cls(Deadline(options.time_limit_s))

    @property
    def limit_s(self) -> float:
        return self.deadline.seconds

    def child(self, seconds: float) -> SolveCall:
        """A call ending after ``seconds`` or with this one, whichever is first."""
        sub = Deadline(self.deadline.seconds)
        sub.end = min(self.deadline.end, timing.clock() + max(seconds, 0.0))
        return SolveCall(sub, self.reach)


#: The diagnosis of an infeasible problem runs only with at least this much time left.
MIN_DIAGNOSIS_S = 0.05


def no_plan_error(problem: AllocationProblem, solver: str, report: SolveReport,
          call: SolveCall | None = None) -> InfeasibleError:
    """The error of a solve without a plan: the diagnosis (exact least memory and fastest
    makespan per group) when there is time for it; for a backend that is not exact, its
    own figure first (the diagnosis is the exact model's)."""
    said = "; ".join(m.replace("\n", " ") for m in report.messages[-3:])
    lines: list[str] = []
    left = call.deadline.remaining() if call is not None else 60.0
    if left >= MIN_DIAGNOSIS_S:
        try:
            # explain gives each group's least-memory program the limit, and the fastest
            # plans share it: n + 1 shares at most.
            lines = explain(problem, time_limit_s=left / (len(problem.groups) + 1)).lines
        except Exception:  # noqa: BLE001 - the diagnosis is a help, never a second error
            lines = []
    exact = is_exact(solver)
    if not exact:
        own = own_fastest(report)
        first = (f"{solver}'s fastest plan takes {own:.3f} ms against the target "
                 f"{problem.target_ms:.3f} ms ({solver}'s own makespan)" if own is not None
                 else said)
        lines = [first, *(f"exact model: {ln}" for ln in lines)]
    elif left < MIN_DIAGNOSIS_S:
        lines = [said, "(no time left for a diagnosis)"]
    err = InfeasibleError(f"{solver}: no plan ({report.status}); "
                          + ("; ".join(lines) if lines else said), report)
    err.head = f"{solver}: no plan ({report.status})"
    err.lines = lines or [said]
    return err


def time_limit_error(problem: AllocationProblem, solver: str, report: SolveReport,
                call: SolveCall) -> SolveTimeLimit:
    """No plan within the call's time limit: say so, with the best bound found."""
    scale, _, low = objective_scale(problem)
    bound = report.bound if report.bound is not None else low
    trivial = abs(bound - low) <= ZERO_REL * max(scale, 1e-300)
    msg = (f"{solver}: no plan found within {call.limit_s:g} s (the time limit of the whole "
           f"solve; status TIME_LIMIT, not infeasible; best bound on the degradation "
           f"{bound:.6g}" + (" (the trivial one: every op at its least Omega)" if trivial
                             else "")
           + "); give more time (time_limit_s, --time-limit)")
    return SolveTimeLimit(msg, report, bound)


def is_exact(solver: str) -> bool:
    try:
        return bool(get_backend(solver).exact)
    except KeyError:
        return False


def own_fastest(report: SolveReport) -> float | None:
    """A backend's own smallest makespan when it reports one (greedy: its fastest plan,
    in the makespan of its acceptance check)."""
    v = report.options.get("fastest_makespan_ms")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def reachable_ms(problem: AllocationProblem, call: SolveCall | None = None) -> float | None:
    """The smallest makespan any memory-feasible plan reaches in the linear model (None:
    some group fits nothing, or no PuLP solver). Within ``call``'s deadline (60 s without
    one); raises :class:`~qsync_opt.solvers.ilp.FastestTimeLimit` when time runs out."""
    key = id(problem.groups)
    if call is not None and key in call.reach:
        return call.reach[key][1]
    backend = next((b for b in ("highs", "cbc") if PulpIlp(b).is_available()), None)
    if backend is None:
        return None
    limit = call.deadline.remaining() if call is not None else 60.0
    if not limit > 0:
        raise FastestTimeLimit("fastest plans: no time left")
    times = fastest_times(problem, backend=backend, time_limit_s=limit)
    best = (None if any(t is None for t in times.values())
            else max(t for t in times.values() if t is not None) + problem.tail_ms)
    if call is not None:
        call.reach[key] = (problem.groups, best)
    return best


def backend_for(solver: str) -> Backend:
    try:
        backend = get_backend(solver)
    except KeyError as exc:
        raise QsyncInputError(f"solver: {exc.args[0]}") from None
    if not backend.is_available():
        raise QsyncInputError(f"solver: {solver} is not available here (its package or binary "
                              "is missing)")
    return backend


def run_backend(problem: AllocationProblem, solver: str, options: SolveOptions,
                call: SolveCall | None = None) -> tuple[Plan | None, SolveReport, Evaluation | None]:
    """One backend solve, scored by the evaluator; with ``call``, its time limit is what
    remains of the call (nothing is run once that is spent: status TIME_LIMIT)."""
    backend = backend_for(solver)
    if call is not None:
        left = call.deadline.remaining()
        if not left > 0:
            return None, SolveReport(
                solver=solver, status="TIME_LIMIT", mode=mode_text(problem),
                options=options.to_json(),
                messages=[f"not run: the time limit of the whole solve "
                          f"({call.limit_s:g} s) was spent"]), None
        options = options.with_time_left(left)
    plan, report = backend.solve(problem, options)
    if plan is None:
        return None, report, None
    ev = evaluate(problem, plan)
    msgs = list(report.messages)
    msgs.append(f"evaluated: objective {ev.objective:.6g}, linear makespan {ev.makespan_ms:.3f} ms, "
                f"replayer {ev.replay_makespan_ms:.3f} ms, {ev.samples_per_s:.1f} samples/s"
                + (f"; violations: {'; '.join(ev.violations)}" if ev.violations else ""))
    if ev.violations and report.status in ("OPTIMAL", "FEASIBLE") and backend.exact:
        msgs.append("BUG: an exact backend returned a plan the evaluator rejects")
    return plan, report.model_copy(update={"messages": msgs}), ev
