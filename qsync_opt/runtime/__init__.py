"""Runtime: run a plan's precisions in real PyTorch modules and train with them."""

from .apply import ApplyReport, apply_plan
from .dispatch import FunctionalDispatch, count_calls
from .layers import QConv1d, QConv2d, QLinear, QMatMul, QMultiheadAttention, apply_precisions

__all__ = ["ApplyReport", "FunctionalDispatch", "QConv1d", "QConv2d", "QLinear", "QMatMul",
           "QMultiheadAttention", "apply_plan", "apply_precisions", "count_calls"]
