"""Allocators (installed as ``qsync_opt.solvers``): the backend protocol and its registry.

Each backend turns an :class:`~qsync_opt.problem.program.AllocationProblem` into a
``(Plan, SolveReport)``. The exact backends (PuLP with CBC or HiGHS, OR-Tools CP-SAT:
each a translation of the formulation and one run, orchestrated by :mod:`.driver`), QSync's
replayer-guided greedy allocator and the baselines register in :mod:`.backends`
(:func:`registry`, :func:`get_backend`, re-exported here); imports of optional solver
packages are guarded inside each backend so a missing one only makes that backend
unavailable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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

from qsync_opt.core.lazy import lazy_getattr

if TYPE_CHECKING:
    from qsync_opt.solvers.backends import get_backend, registry

__all__ = ["EXACT", "Backend", "CbcOptions", "CpSatOptions", "DynamicBatchingOptions",
           "ExactBackend", "HighsOptions", "SolveOptions", "UniformOptions", "get_backend",
           "registry"]


#: The exact backends' names.
EXACT = ("highs", "cbc", "cpsat")

#: The registry's functions -> their module (:mod:`.backends`, which imports every backend
#: module, each of which imports this package's :mod:`.base`), imported when first read.
_LAZY = {"get_backend": "backends", "registry": "backends"}

#: the registry's functions, imported when first read
__getattr__ = lazy_getattr(__name__, globals(), _LAZY)
