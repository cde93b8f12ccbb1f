"""Allocators (installed as ``qsync_opt.solvers``): the backend protocol and its registry.

Each backend turns an :class:`~qsync_opt.problem.program.AllocationProblem` into a
``(Plan, SolveReport)``. The exact backends (PuLP with CBC or HiGHS, OR-Tools CP-SAT:
each a translation of the formulation and one run, orchestrated by :mod:`.driver`), QSync's replayer-guided greedy allocator and the baselines register here; imports of
optional solver packages are guarded inside each backend so a missing one only makes that
backend unavailable.
"""

from __future__ import annotations

from qsync_opt.solvers.base import (
    Backend,
    CbcOptions,
    CpSatOptions,
    DynamicBatchingOptions,
    ExactBackend,
    HighsOptions,
    SolveOptions,
    UniformOptions,
)

__all__ = ["EXACT", "Backend", "CbcOptions", "CpSatOptions", "DynamicBatchingOptions",
           "ExactBackend", "HighsOptions", "SolveOptions", "UniformOptions", "get_backend",
           "registry"]


def registry() -> dict[str, Backend]:
    """Backends by name, in the order `compare` lists them. Built on each call."""
    # imported on call: every backend module imports this package
    from qsync_opt.solvers.additive import AdditiveIlp
    from qsync_opt.solvers.baselines import DynamicBatching, StrongOnly, Uniform
    from qsync_opt.solvers.cpsat import CpSat
    from qsync_opt.solvers.greedy import Greedy
    from qsync_opt.solvers.ilp import PulpIlp

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
