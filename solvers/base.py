"""The backend protocol and the options every backend accepts (re-exported by
:mod:`qsync_opt.solvers`). Its own module so the backends import it without importing the
registry that imports them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..problem import AllocationProblem
    from ..schemas import Plan, SolveReport


@dataclass(frozen=True)
class SolveOptions:
    """Options every backend accepts (a backend ignores what does not apply, and says so
    in its report's messages).

    ``hints``: a warm start, choice indices per group (``AllocationProblem.assignment``);
    ``warm_start="greedy"`` makes the exact backends run greedy first and hint its plan.
    ``acceptance``: greedy's move check, ``"replayer"`` (QSync's way) or ``"linear"``.
    ``decompose``: with a fixed target the groups do not interact; solve one small program
    per group (False: one program for all groups, for comparison).
    """

    time_limit_s: float = 60.0
    threads: int = 0  # 0: the backend's default
    seed: int = 0
    rel_gap: float = 1e-6
    warm_start: str | None = None  # None or "greedy"
    hints: dict[str, list[int]] | None = None
    acceptance: str = "replayer"
    decompose: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    #: The limit the caller asked for, kept when a solve inside a call is given only what
    #: remains (:meth:`with_time_left`); None: ``time_limit_s`` is the one asked for. The
    #: plan and the report record the limit asked for, so identical inputs give identical
    #: plan bytes (the time used is the report's ``wall_s``).
    asked_time_limit_s: float | None = None

    @property
    def asked_limit_s(self) -> float:
        return (self.asked_time_limit_s if self.asked_time_limit_s is not None
                else self.time_limit_s)

    def with_time_left(self, seconds: float) -> SolveOptions:
        """These options with ``seconds`` to run, the limit asked for kept."""
        return dataclasses.replace(self, time_limit_s=seconds,
                                   asked_time_limit_s=self.asked_limit_s)

    def to_json(self) -> dict[str, Any]:
        return {"time_limit_s": self.asked_limit_s, "threads": self.threads, "seed": self.seed,
                "rel_gap": self.rel_gap, "warm_start": self.warm_start,
                "acceptance": self.acceptance, "decompose": self.decompose,
                "hints": self.hints is not None}


@runtime_checkable
class Backend(Protocol):
    """What every allocator provides."""

    name: str
    exact: bool  # proves optimality of the linear model when it reports OPTIMAL

    def is_available(self) -> bool: ...

    def solve(self, problem: AllocationProblem, options: SolveOptions
              ) -> tuple[Plan | None, SolveReport]:
        """The plan (None when there is none) and the report of one solve."""
        ...
