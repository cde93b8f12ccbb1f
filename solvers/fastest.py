"""The least time of each group under its memory: the formulation with the time as
objective (no time row), solved exactly by HiGHS or CBC. Greedy's start, the diagnosis and
the target choice use it; it needs no backend class (so greedy and the exact backends,
which warm-start from greedy, import it without importing each other).

A run stopped at its time limit with a plan proves nothing about the least time: its plan's
time is only an upper bound, the solver's dual bound a lower one. :func:`fastest_results`
returns both, marked unproven; :func:`fastest_plans` and :func:`fastest_times` (what a
caller takes as *the* least time: greedy's verdict, the reachable makespan, the diagnosis)
return proven values only and raise :class:`FastestTimeLimit` otherwise."""

from __future__ import annotations

from dataclasses import dataclass

from qsync_opt.solvers.base import SolveOptions
from qsync_opt.solvers.checks import time_lower_bound
from qsync_opt.solvers.errors import FastestTimeLimit
from qsync_opt.solvers.formulation import formulate
from qsync_opt.solvers.pulp_model import read_assignment, to_pulp
from qsync_opt.solvers.pulp_runs import PULP_NAMES, available, pulp_module, run
from qsync_opt.solvers.timing import Deadline, Stopwatch

from qsync_opt.problem.program import AllocationProblem


@dataclass(frozen=True)
class Fastest:
    """One group's fastest memory-feasible plan as far as the solver got: ``ms`` is the
    time of ``assignment`` (an upper bound on the least time), ``bound_ms`` a lower bound
    on it; ``proven`` (the solver's OPTIMAL): ``ms`` is the least time."""

    ms: float
    assignment: list[int]
    bound_ms: float
    proven: bool


def fastest_results(problem: AllocationProblem, backend: str = "highs",
                    time_limit_s: float = 60.0, skip: frozenset[str] = frozenset()
                    ) -> dict[str, Fastest | None]:
    """Per group, the fastest memory-feasible plan the solver found (None: none fits,
    proven, or the group is in ``skip``), by solving the program with the time as
    objective. ``time_limit_s`` bounds all groups together (each gets an equal share of
    what remains). A program stopped at its limit with a plan gives it unproven
    (``proven=False``, with the solver's lower bound); one stopped without a plan raises
    :class:`FastestTimeLimit` (the group's least time is unknown, not absent)."""
    if backend not in PULP_NAMES:
        raise ValueError(f"backend: expected cbc or highs, got {backend!r}")
    pulp = pulp_module()
    deadline = Deadline(time_limit_s)
    out: dict[str, Fastest | None] = {}
    todo = [g.name for g in problem.groups if g.name not in skip]
    for gi, g in enumerate(problem.groups):
        if g.name in skip:
            out[g.name] = None
            continue
        share = deadline.share(len(todo) - todo.index(g.name))
        if not share > 0:
            raise FastestTimeLimit(f"fastest plan of group {g.name}: no time left of "
                                   f"{time_limit_s:g} s; its least time is not known")
        form = formulate(problem, [gi], objective="time")
        prog = to_pulp(pulp, form, f"fastest_{gi}")
        res = run(pulp, prog, backend, SolveOptions(rel_gap=1e-9), share, False,
                  Stopwatch(), [])
        if res.status in ("OPTIMAL", "FEASIBLE"):
            a = read_assignment(prog.groups[0])
            ms = g.time_ms(a)
            low = time_lower_bound(g)
            if res.bound is not None:  # the program's objective leaves out the constant
                low = max(low, res.bound + form.objective.constant)
            proven = res.status == "OPTIMAL"
            out[g.name] = Fastest(ms, a, ms if proven else min(low, ms), proven)
        elif res.status == "INFEASIBLE":
            out[g.name] = None
        else:
            raise FastestTimeLimit(
                f"fastest plan of group {g.name}: {res.status} after {share:.3g} s "
                f"({time_limit_s:g} s for all groups), no plan; its least time is not known")
    return out


def group_fastest(problem: AllocationProblem, gi: int, time_limit_s: float
                  ) -> tuple[str, Fastest | None] | None:
    """Group gi's fastest plan under its memory by the exact program (HiGHS, else CBC)
    within ``time_limit_s`` (greedy's start): (backend, the result, None when nothing
    fits), or None with no backend. Raises :class:`FastestTimeLimit` when the time ran out
    without a plan (no time left included)."""
    if not time_limit_s > 0:
        raise FastestTimeLimit("the exact fastest plan: no time left")
    others = frozenset(g.name for j, g in enumerate(problem.groups) if j != gi)
    for backend in ("highs", "cbc"):
        if available(backend):
            found = fastest_results(problem, backend, time_limit_s, skip=others)
            return backend, found[problem.groups[gi].name]
    return None


def fastest_plans(problem: AllocationProblem, backend: str = "highs",
                  time_limit_s: float = 60.0, skip: frozenset[str] = frozenset()
                  ) -> dict[str, tuple[float, list[int]] | None]:
    """Per group, the least time (ms) over assignments that fit its memory and one reaching
    it (None: none fits, or the group is in ``skip``), proven. A group whose least time was
    not proven within ``time_limit_s`` (a plan found, optimality not shown, or no plan)
    raises :class:`FastestTimeLimit`: an unproven value is never returned as the least."""
    out: dict[str, tuple[float, list[int]] | None] = {}
    for name, r in fastest_results(problem, backend, time_limit_s, skip).items():
        if r is not None and not r.proven:
            raise FastestTimeLimit(
                f"fastest plan of group {name}: stopped at the time limit ({time_limit_s:g} s "
                f"for all groups) with a plan of {r.ms:.4f} ms and a bound of "
                f"{r.bound_ms:.4f} ms, not proven; its least time is not known")
        out[name] = None if r is None else (r.ms, r.assignment)
    return out


def fastest_times(problem: AllocationProblem, backend: str = "highs",
                  time_limit_s: float = 60.0) -> dict[str, float | None]:
    """Each group's least time (ms) over assignments that fit its memory (None: none fits),
    proven (else :class:`FastestTimeLimit`). For choosing targets."""
    return {name: (v[0] if v is not None else None)
            for name, v in fastest_plans(problem, backend, time_limit_s).items()}
