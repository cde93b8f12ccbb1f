"""The warm start an exact backend is given: the caller's hints, else (``warm_start=
"greedy"``) greedy's plan. Its own module, above greedy, so that greedy (which needs the
exact fastest-plan program, :mod:`.fastest`) and the exact backends do not import each
other."""

from __future__ import annotations

import time

from qsync_opt.solvers.base import SolveOptions
from qsync_opt.solvers.checks import check_hints
from qsync_opt.solvers.greedy import Greedy
from qsync_opt.solvers.timing import Deadline

from qsync_opt.problem.program import AllocationProblem


def greedy_hints(problem: AllocationProblem, messages: list[str],
                 deadline: Deadline | None = None) -> dict[str, list[int]] | None:
    """Greedy's assignment for a warm start (None, with a message, when there is none),
    within the call's ``deadline``."""
    t0 = time.perf_counter()
    try:
        limit = deadline.remaining() if deadline is not None else SolveOptions().time_limit_s
        if not limit > 0:
            messages.append("warm start: no time left for greedy; solving without a warm start")
            return None
        plan, _ = Greedy().solve(problem, SolveOptions(acceptance="linear", time_limit_s=limit))
    except Exception as exc:
        messages.append(f"warm start: greedy failed ({type(exc).__name__}: {exc}); "
                        "solving without a warm start")
        return None
    if plan is None:
        messages.append("warm start: greedy found no plan; solving without a warm start")
        return None
    hints = problem.assignment(plan)
    messages.append(f"warm start: greedy plan (objective {problem.objective(hints):.6g}, "
                    f"{time.perf_counter() - t0:.3f} s)")
    return hints


def start_hints(problem: AllocationProblem, options: SolveOptions, messages: list[str],
                deadline: Deadline | None = None) -> dict[str, list[int]] | None:
    """The warm start to give the solver: ``options.hints``, else greedy's plan if asked."""
    if options.hints is not None:
        check_hints(problem, options.hints)
        return {g.name: list(options.hints[g.name]) for g in problem.groups}
    if options.warm_start == "greedy":
        return greedy_hints(problem, messages, deadline)
    if options.warm_start is not None:
        messages.append(f"warm start: unknown kind {options.warm_start!r} ignored")
    return None
