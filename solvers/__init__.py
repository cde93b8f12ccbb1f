"""Allocators (installed as ``qsync_opt.solvers``): the backend protocol and its registry.

Each backend turns an :class:`~qsync_opt.problem.AllocationProblem` into a
``(Plan, SolveReport)``. The exact backends (PuLP with CBC or HiGHS, OR-Tools CP-SAT),
QSync's replayer-guided greedy allocator and the baselines register here; imports of
optional solver packages are guarded inside each backend so a missing one only makes that
backend unavailable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


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

    def to_json(self) -> dict[str, Any]:
        return {"time_limit_s": self.time_limit_s, "threads": self.threads, "seed": self.seed,
                "rel_gap": self.rel_gap, "warm_start": self.warm_start,
                "acceptance": self.acceptance, "decompose": self.decompose,
                "hints": self.hints is not None}


@runtime_checkable
class Backend(Protocol):
    """What every allocator provides."""

    name: str
    exact: bool  # proves optimality of the linear model when it reports OPTIMAL

    def is_available(self) -> bool: ...

    def solve(self, problem: Any, options: SolveOptions) -> tuple[Any, Any]: ...


def registry() -> dict[str, Backend]:
    """Backends by name, in the order `compare` lists them. Built on each call."""
    from .baselines import DynamicBatching, StrongOnly, Uniform
    from .cpsat import CpSat
    from .greedy import Greedy
    from .ilp import AdditiveIlp, PulpIlp

    backends: list[Backend] = [
        PulpIlp("highs"), PulpIlp("cbc"), CpSat(), Greedy(), Greedy(per_ms=True),
        Uniform(), DynamicBatching(), AdditiveIlp(), StrongOnly(),
    ]
    return {b.name: b for b in backends}


EXACT = ("highs", "cbc", "cpsat")


def get_backend(name: str) -> Backend:
    backends = registry()
    if name not in backends:
        raise KeyError(f"unknown solver {name!r}; known: {', '.join(backends)}")
    return backends[name]
