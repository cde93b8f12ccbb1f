"""What every backend shares: turning an assignment into a Plan and a SolveReport."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import QsyncInputError
from ..problem import AllocationProblem
from ..schemas import Plan, SolveReport
from . import SolveOptions


class Stopwatch:
    """``build_s`` (model building) and ``solve_s`` (the solver itself), measured apart."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.build_s = 0.0
        self.solve_s = 0.0

    def building(self) -> _Lap:
        return _Lap(self, "build_s")

    def solving(self) -> _Lap:
        return _Lap(self, "solve_s")

    @property
    def wall_s(self) -> float:
        return time.perf_counter() - self.t0


class _Lap:
    def __init__(self, sw: Stopwatch, attr: str) -> None:
        self.sw, self.attr = sw, attr

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        setattr(self.sw, self.attr, getattr(self.sw, self.attr) + time.perf_counter() - self.start)


def finish(
    problem: AllocationProblem,
    solver: str,
    assignment: Mapping[str, Sequence[int]] | None,
    *,
    status: str,
    mode: str,
    options: SolveOptions,
    sw: Stopwatch,
    bound: float | None = None,
    n_variables: int = 0,
    n_constraints: int = 0,
    messages: Sequence[str] = (),
    extra_options: Mapping[str, Any] | None = None,
    plan: Plan | None = None,
) -> tuple[Plan | None, SolveReport]:
    """The Plan (None when there is no assignment) and the report of one solve.

    ``objective`` is always recomputed from the problem (never taken from the solver), and
    ``gap`` is relative: (objective - bound) / max(|objective|, 1e-12).
    """
    objective = None
    gap = None
    if plan is None and assignment is not None:
        objective = problem.objective(assignment)
    elif plan is not None:
        objective = problem.objective(problem.assignment(plan)) if plan.cluster == problem.cluster else None
    if objective is not None and bound is not None:
        gap = max(0.0, objective - bound) / max(abs(objective), 1e-12)
    opts: dict[str, Any] = options.to_json()
    opts.update(extra_options or {})
    clean = {k: v for k, v in opts.items() if v is None or isinstance(v, (str, int, float, bool))}
    report = SolveReport(
        solver=solver, status=status, mode=mode,  # type: ignore[arg-type]
        objective=objective, bound=bound, gap=gap, build_s=sw.build_s, solve_s=sw.solve_s,
        wall_s=sw.wall_s, n_variables=n_variables, n_constraints=n_constraints, options=clean,
        messages=list(messages))
    if plan is None and assignment is not None:
        plan = problem.make_plan(assignment, {
            "solver": solver, "status": status, "objective": objective, "bound": bound,
            "gap": gap, "wall_s": report.wall_s, "mode": mode,
            **{f"option.{k}": v for k, v in clean.items()}})
    return plan, report


def mode_text(problem: AllocationProblem) -> str:
    return (f"least degradation under makespan target {problem.target_ms:.3f} ms "
            f"({problem.target_source})")


def check_hints(problem: AllocationProblem, hints: Mapping[str, Sequence[int]] | None) -> None:
    if hints is None:
        return
    for g in problem.groups:
        a = hints.get(g.name)
        if a is None or len(a) != len(g.choices) or any(
                not 0 <= k < len(c) for k, c in zip(a, g.choices, strict=True)):
            raise QsyncInputError(f"hints: group {g.name} needs one valid choice index per unit")


def program_parts(problem: AllocationProblem, options: SolveOptions,
                  messages: list[str]) -> list[list[int]]:
    """Which groups each program holds: one per group (decomposed: with a fixed target the
    groups do not interact) or all in one; the choice is written to ``messages``."""
    n = len(problem.groups)
    if options.decompose:
        messages.append(f"decomposed: one program per group ({n} groups); with a fixed "
                        "target the groups do not interact")
        return [[gi] for gi in range(n)]
    messages.append(f"monolithic: one program for all {n} groups")
    return [list(range(n))]


def infeasible_messages(problem: AllocationProblem, gis: Sequence[int], budget: float) -> list[str]:
    """For groups whose cheapest choices alone exceed the time budget, say so."""
    from .ilp import time_lower_bound

    out = []
    for gi in gis:
        g = problem.groups[gi]
        lb = time_lower_bound(g)
        if lb > budget:
            out.append(f"group {g.name}: infeasible, even its fastest choices take at least "
                       f"{lb:.4f} ms > budget {budget:.4f} ms")
    return out
