"""Runtime: run a plan's precisions in real PyTorch modules (training under torchrun comes
with the runtime stage; the layers here are what it swaps in)."""

from .layers import QConv2d, QLinear, QMatMul, apply_precisions

__all__ = ["QConv2d", "QLinear", "QMatMul", "apply_precisions"]
