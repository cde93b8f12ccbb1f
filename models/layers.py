"""Small building blocks shared by the workload models.

The only layer here is :class:`MatMul`, a module wrapper around
:func:`torch.matmul`.  Attention blocks call it for their two
activation-by-activation products (``Q @ K^T`` and ``P @ V``) instead of
calling ``torch.matmul`` directly, so that those products become named
modules (for example ``bert.encoder.layer.0.attention.self.qk_matmul``).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MatMul"]


class MatMul(nn.Module):
    """``forward(a, b) -> torch.matmul(a, b)`` as a named, parameter-free module.

    Why a module and not a plain ``torch.matmul`` call: a matmul between two
    activations has no weight, so without a module it would have no stable,
    human-readable name.  Wrapping it gives every attention matmul a module
    path (``...attn.qk_matmul`` / ``...attn.av_matmul``) so that

    * the precision planner can list it and choose its precision like any
      ``nn.Linear`` or ``nn.Conv2d``, and
    * the runtime can swap the module for a quantized / low-precision
      implementation by name (``model.get_submodule(path)``).

    A ``torch.fx`` tracer that treats ``MatMul`` as a leaf module keeps it as a
    single ``call_module`` node; the default ``torch.fx.symbolic_trace``
    inlines it into a ``torch.matmul`` ``call_function`` node.
    """

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Return ``torch.matmul(a, b)``."""
        return torch.matmul(a, b)
