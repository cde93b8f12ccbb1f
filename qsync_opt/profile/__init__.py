"""The profiler: a CostTable measured on the local device, in the estimator's exact shape.

``qsync-opt profile --model M --device cpu|cuda --out costs.json`` traces the workload at the
batch, builds the estimator's table for one local device (``DEVICEx1``) as the template of
keys, and replaces what it can measure:

* **Ops**, each *in isolation*: the op's module (or function, rebuilt from the op's kind and
  target) on random inputs of its traced shapes, a random output gradient pushed back with
  ``torch.autograd.backward``; choosable ops swapped to each precision the device runs with
  :func:`~qsync_opt.ops.layers.apply_precisions`; pass-through and promoting ops fed
  inputs of each activation dtype. Warm-up calls, then the median of ``repeats``; the spread
  (interquartile range over median) goes to :attr:`Profile.spread` and a summary to the
  table's notes. Ops with identical signatures (module type and settings, shapes, precision:
  the repeated blocks of a transformer) are measured once and shared (noted). An op that
  cannot be rebuilt keeps the estimator's value with ``source="estimated"``.
* **Dispatch overhead**: a 1-element add forward and backward, measured and recorded in the
  notes and as ``efficiencies.launch_overhead_us`` (not assumed).
* **Casts**: ``x.to(dtype)`` (and :func:`qsync_opt.ops.quantize_int8` for int8) at several
  sizes, ``a * numel + b`` fitted by least squares (:func:`fit_cast`).
* **All-reduce**: alpha-beta fitted on the process group when ``torch.distributed`` is
  initialised with more than one rank; otherwise the estimator's comm model is kept (noted).
* **Optimizer**: one SGD and one Adam step over the model's parameters, measured.

:func:`merge` joins profiles of several machines (one per device type) into one table.

The package, by job: :mod:`.orchestrate` (the profiler run: :func:`profile_detailed`),
:mod:`.timing` (the clock and the measurements), :mod:`.builders` (ops rebuilt on random
inputs), :mod:`.gloo` (the local gloo harness: :func:`spawn_local`,
:func:`measure_comm_local`), :mod:`qsync_opt.costs.tables` (the CostTable algebra: :func:`fit_cast`,
:func:`with_comm`, :func:`derive`, :func:`merge`; it needs no torch, and importing this
package imports torch only when a name that needs it is first used). The command
``qsync-opt profile`` is :mod:`qsync_opt.cli.profile`; the in-context method's runs are
:mod:`qsync_opt.profile.incontext`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qsync_opt.core.lazy import lazy_getattr
from qsync_opt.costs.tables import derive, fit_cast, median_iqr, merge, with_comm

if TYPE_CHECKING:
    from qsync_opt.profile.builders import OpBuilder
    from qsync_opt.profile.gloo import measure_comm_local, spawn_local
    from qsync_opt.profile.orchestrate import (
        Profile,
        environment,
        environment_note,
        profile,
        profile_detailed,
    )
    from qsync_opt.profile.settings import (
        ALLREDUCE_SIZES,
        CAST_SIZES,
        DEFAULT_REPEATS,
        DEFAULT_WARMUP,
    )
    from qsync_opt.profile.timing import Timer, measure_dispatch_us

#: The names that need torch -> the module of this package that holds them (imported on use).
_LAZY = {
    "OpBuilder": "builders",
    "measure_comm_local": "gloo", "spawn_local": "gloo",
    "Profile": "orchestrate", "environment": "orchestrate", "environment_note": "orchestrate",
    "profile": "orchestrate", "profile_detailed": "orchestrate",
    "ALLREDUCE_SIZES": "settings", "CAST_SIZES": "settings", "DEFAULT_REPEATS": "settings",
    "DEFAULT_WARMUP": "settings", "Timer": "timing", "measure_dispatch_us": "timing",
}

__all__ = [
    "ALLREDUCE_SIZES", "CAST_SIZES", "DEFAULT_REPEATS", "DEFAULT_WARMUP",
    "OpBuilder", "Profile", "Timer", "derive",
    "environment", "environment_note", "fit_cast", "measure_comm_local", "measure_dispatch_us",
    "median_iqr", "merge", "profile", "profile_detailed", "spawn_local", "with_comm",
]


#: the names above whose modules import torch, imported when first read
__getattr__ = lazy_getattr(__name__, globals(), _LAZY)
