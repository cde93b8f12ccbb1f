"""The least time of each group under its memory: the formulation with the time as
objective (no time row), solved exactly by HiGHS or CBC. Greedy's start, the diagnosis and
the target choice use it; it needs no backend class (so greedy and the exact backends,
which warm-start from greedy, import it without importing each other)."""

from __future__ import annotations

from ..errors import QsyncInputError
from ..problem import AllocationProblem
from .base import SolveOptions
from .common import Deadline, Stopwatch
from .formulation import formulate
from .pulp_model import PULP_NAMES, pulp_module, read_assignment, run, to_pulp


class FastestTimeLimit(QsyncInputError):
    """The least time of a group could not be proven within the time given."""


def fastest_plans(problem: AllocationProblem, backend: str = "highs",
                  time_limit_s: float = 60.0, skip: frozenset[str] = frozenset()
                  ) -> dict[str, tuple[float, list[int]] | None]:
    """Per group, the least time (ms) over assignments that fit its memory and one reaching
    it (None: none fits, or the group is in ``skip``), by solving the program with the time
    as objective. ``time_limit_s`` bounds all groups together (each gets an equal share of
    what remains). A program stopped at its limit with a plan gives that plan's time (an
    upper bound on the least); one stopped without a plan raises :class:`FastestTimeLimit`
    (the group's least time is unknown, not absent)."""
    if backend not in PULP_NAMES:
        raise ValueError(f"backend: expected cbc or highs, got {backend!r}")
    pulp = pulp_module()
    deadline = Deadline(time_limit_s)
    out: dict[str, tuple[float, list[int]] | None] = {}
    todo = [g.name for g in problem.groups if g.name not in skip]
    for gi, g in enumerate(problem.groups):
        if g.name in skip:
            out[g.name] = None
            continue
        share = deadline.share(len(todo) - todo.index(g.name))
        form = formulate(problem, [gi], objective="time")
        prog = to_pulp(pulp, form, f"fastest_{gi}")
        res = run(pulp, prog, backend, SolveOptions(rel_gap=1e-9), share, False,
                  Stopwatch(), [])
        if res.status in ("OPTIMAL", "FEASIBLE"):
            a = read_assignment(prog.groups[0])
            out[g.name] = (g.time_ms(a), a)
        elif res.status == "INFEASIBLE":
            out[g.name] = None
        else:
            raise FastestTimeLimit(
                f"fastest plan of group {g.name}: {res.status} after {share:.3g} s "
                f"({time_limit_s:g} s for all groups), no plan; its least time is not known")
    return out


def fastest_times(problem: AllocationProblem, backend: str = "highs",
                  time_limit_s: float = 60.0) -> dict[str, float | None]:
    """Each group's least time (ms) over assignments that fit its memory (None: none fits).
    For choosing targets."""
    return {name: (v[0] if v is not None else None)
            for name, v in fastest_plans(problem, backend, time_limit_s).items()}
