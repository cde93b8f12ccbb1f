"""Runtime: run a plan's precisions in real PyTorch modules and train with them."""

from .apply import ApplyReport, apply_plan
from .layers import QConv2d, QLinear, QMatMul, apply_precisions

__all__ = ["ApplyReport", "QConv2d", "QLinear", "QMatMul", "apply_plan", "apply_precisions"]
