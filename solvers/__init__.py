"""Allocators (installed as ``qsync_opt.solvers``): the backend protocol and its registry.

Each backend turns an AllocationProblem into a (Plan, SolveReport). The exact backends (PuLP
with CBC or HiGHS, OR-Tools CP-SAT), QSync's replayer-guided greedy allocator and the
baselines register here as the allocator stage lands; imports of optional solver packages
are guarded inside each backend so a missing one only makes that backend unavailable.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Backend(Protocol):
    """What every allocator provides."""

    name: str

    def is_available(self) -> bool: ...

    def solve(self, problem: Any, options: Any) -> Any: ...


def registry() -> dict[str, Backend]:
    """Backends by name. Built on each call (no module-level mutable state)."""
    return {}


def get_backend(name: str) -> Backend:
    backends = registry()
    if name not in backends:
        known = ", ".join(sorted(backends)) or "none yet (the allocator stage adds them)"
        raise KeyError(f"unknown solver {name!r}; known: {known}")
    return backends[name]
