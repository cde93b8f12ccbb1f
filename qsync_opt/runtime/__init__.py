"""Runtime: run a plan's precisions in real PyTorch modules and train with them.

Importing the package imports no torch (the command line reads :mod:`.config`'s limits
when it builds its parsers): the names re-exported here are imported when first read."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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

_FROM_DISPATCH = ("FunctionalDispatch", "count_calls")
_FROM_LAYERS = ("QConv1d", "QConv2d", "QLinear", "QMatMul", "QMultiheadAttention",
                "apply_precisions")
_FROM_APPLY = ("ApplyReport", "apply_plan")


def __getattr__(name: str) -> Any:
    """The re-exported names, imported when first read (their modules import torch)."""
    if name in _FROM_DISPATCH:
        from qsync_opt.ops import dispatch  # lazy: imports torch

        return getattr(dispatch, name)
    if name in _FROM_LAYERS:
        from qsync_opt.ops import layers  # lazy: imports torch

        return getattr(layers, name)
    if name in _FROM_APPLY:
        from qsync_opt.runtime import apply  # lazy: imports torch

        return getattr(apply, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
