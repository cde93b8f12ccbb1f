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
* ``compute``: :func:`indicate`, its steps and its disk cache.
"""

from __future__ import annotations

from qsync_opt.indicator.compute import (
    ERROR_MODEL_VERSION,
    PROGRESS_EVERY_S,
    default_cache_dir,
    fast_options,
    indicate,
)
from qsync_opt.indicator.curv import CURV_LR, CURVATURES
from qsync_opt.indicator.errormodel import (
    FLOAT_KINDS,
    INT4_QMAX,
    LADDERS,
    METHODS,
    SPECS,
    check_method,
    element_variance,
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
from qsync_opt.models.samples import real_batches, synthetic_batches

__all__ = [
    "CURVATURES", "CURV_LR", "ERROR_MODEL_VERSION", "FLOAT_KINDS", "HESSIAN_ACTIVATION_FACTOR",
    "INT4_QMAX", "LADDERS", "METHODS", "PROGRESS_EVERY_S", "RUNTIME_BYTES", "SPECS",
    "TERM_COPIES", "UNMEASURED_GRAD", "UNMEASURED_RAN", "IndicatorMemory",
    "available_memory_bytes", "check_indicator_memory", "check_method", "cover",
    "default_cache_dir", "element_variance", "enforce_monotone", "fast_options", "indicate",
    "indicator_memory", "kinds_for", "placeholder_indicator", "rank_table", "real_batches",
    "scale_to_batch", "synthetic_batches",
]
