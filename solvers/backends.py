"""Every allocator by name: the exact backends (PuLP with HiGHS or CBC, OR-Tools CP-SAT),
greedy and the baselines, in the order ``compare`` lists them. Each backend module imports
its solver package only when it runs, so building the registry imports none of them."""

from __future__ import annotations

from qsync_opt.solvers.additive import AdditiveIlp
from qsync_opt.solvers.base import Backend
from qsync_opt.solvers.baselines import DynamicBatching, StrongOnly, Uniform
from qsync_opt.solvers.cpsat import CpSat
from qsync_opt.solvers.greedy import Greedy
from qsync_opt.solvers.ilp import PulpIlp

__all__ = ["get_backend", "registry"]


def registry() -> dict[str, Backend]:
    """Backends by name, in the order `compare` lists them. Built on each call."""
    backends: list[Backend] = [
        PulpIlp("highs"), PulpIlp("cbc"), CpSat(), Greedy(), Greedy(per_ms=True),
        Uniform(), DynamicBatching(), AdditiveIlp(), StrongOnly(),
    ]
    return {b.name: b for b in backends}


def get_backend(name: str) -> Backend:
    backends = registry()
    if name not in backends:
        raise KeyError(f"unknown solver {name!r}; known: {', '.join(backends)}")
    return backends[name]
