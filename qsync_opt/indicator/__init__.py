"""Indicators: each choosable op's degradation Omega[op][precision], measured from real batches.

The ``qsync`` method (QSync's bi-directional indicator, PAPERS.md) in qsync-opt's form, and
the other methods of :data:`METHODS`. The modules:

* ``errormodel``: the error model (each precision's error kinds, per-element variances),
  its derivation in the module's docstring;
* ``terms``: the per-call terms of the qsync, fisher, wvar and hessian methods;
* ``curv``: the loss-aware ``curv`` method;
* ``batches``: the synthetic and real batches measured on;
* ``memory``: what a run holds, and the refusal when the machine has less;
* ``tables``: tables after measuring (monotone ladders, coverage, ranks, the placeholder);
* ``cache``: the settings a table is measured with and its disk cache (no torch);
* ``entry``: :func:`indicate`, which looks the cache up before importing torch;
* ``variances``: the error model's per-element variances, computed on tensors;
* ``compute``: measuring a table, its steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qsync_opt.core.lazy import lazy_getattr
from qsync_opt.indicator.cache import ERROR_MODEL_VERSION, default_cache_dir
from qsync_opt.indicator.entry import fast_options, indicate
from qsync_opt.indicator.errormodel import (
    CURV_LR,
    FLOAT_KINDS,
    INT4_QMAX,
    LADDERS,
    METHODS,
    SPECS,
    check_method,
    kinds_for,
)
from qsync_opt.indicator.memory import (
    HESSIAN_ACTIVATION_FACTOR,
    RUNTIME_BYTES,
    TERM_COPIES,
    IndicatorMemory,
    available_memory_bytes,
    check_indicator_memory,
    indicator_memory,
)
from qsync_opt.indicator.tables import (
    UNMEASURED_GRAD,
    UNMEASURED_RAN,
    cover,
    enforce_monotone,
    placeholder_indicator,
    rank_table,
    scale_to_batch,
)

if TYPE_CHECKING:
    from qsync_opt.indicator.compute import PROGRESS_EVERY_S
    from qsync_opt.indicator.curv import CURVATURES
    from qsync_opt.indicator.variances import element_variance
    from qsync_opt.models.samples import real_batches, synthetic_batches

#: Names re-exported from modules that import torch -> their module (imported on use).
_LAZY = {
    "PROGRESS_EVERY_S": "qsync_opt.indicator.compute", "CURVATURES": "qsync_opt.indicator.curv",
    "element_variance": "qsync_opt.indicator.variances",
    "real_batches": "qsync_opt.models.samples", "synthetic_batches": "qsync_opt.models.samples",
}

__all__ = [
    "CURVATURES", "CURV_LR", "ERROR_MODEL_VERSION", "FLOAT_KINDS", "HESSIAN_ACTIVATION_FACTOR",
    "INT4_QMAX", "LADDERS", "METHODS", "PROGRESS_EVERY_S", "RUNTIME_BYTES", "SPECS",
    "TERM_COPIES", "UNMEASURED_GRAD", "UNMEASURED_RAN", "IndicatorMemory",
    "available_memory_bytes", "check_indicator_memory", "check_method", "cover",
    "default_cache_dir", "element_variance", "enforce_monotone", "fast_options", "indicate",
    "indicator_memory", "kinds_for", "placeholder_indicator", "rank_table", "real_batches",
    "scale_to_batch", "synthetic_batches",
]


#: the names above whose modules import torch, imported when first read
__getattr__ = lazy_getattr(__name__, globals(), _LAZY)
