"""Runtime: run a plan's precisions in real PyTorch modules and train with them.

Importing the package imports no torch (the command line reads :mod:`.config`'s limits
when it builds its parsers): the names re-exported here are imported when first read."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qsync_opt.core.lazy import lazy_getattr

if TYPE_CHECKING:
    from qsync_opt.ops.dispatch import FunctionalDispatch, count_calls
    from qsync_opt.ops.layers import (
        QConv1d,
        QConv2d,
        QLinear,
        QMatMul,
        QMultiheadAttention,
        apply_precisions,
    )
    from qsync_opt.runtime.apply import ApplyReport, apply_plan

__all__ = ["ApplyReport", "FunctionalDispatch", "QConv1d", "QConv2d", "QLinear", "QMatMul",
           "QMultiheadAttention", "apply_plan", "apply_precisions", "count_calls"]

#: The re-exported names -> their module (imported on use: they import torch).
_LAZY = {
    "FunctionalDispatch": "qsync_opt.ops.dispatch", "count_calls": "qsync_opt.ops.dispatch",
    "QConv1d": "qsync_opt.ops.layers", "QConv2d": "qsync_opt.ops.layers",
    "QLinear": "qsync_opt.ops.layers", "QMatMul": "qsync_opt.ops.layers",
    "QMultiheadAttention": "qsync_opt.ops.layers", "apply_precisions": "qsync_opt.ops.layers",
    "ApplyReport": "qsync_opt.runtime.apply", "apply_plan": "qsync_opt.runtime.apply",
}


#: the names above whose modules import torch, imported when first read
__getattr__ = lazy_getattr(__name__, globals(), _LAZY)
