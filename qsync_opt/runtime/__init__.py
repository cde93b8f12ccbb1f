"""Runtime: run a plan's precisions in real PyTorch modules and train with them."""

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
