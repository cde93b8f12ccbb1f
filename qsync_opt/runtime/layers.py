"""Precision-specific Linear, Conv2d and attention MatMul on the qsync ops library.

Each layer is a subclass of the torch module it replaces and keeps its parameters, so a swap
(:func:`apply_precisions`) changes no ``state_dict`` key and keeps FP32 master weights and
FP32 gradients. Per precision:

* ``fp32`` and ``tf32``: the module's own computation (tf32 only differs on an Ampere+ GPU,
  where torch's ``allow_tf32`` flags decide; on a CPU it is fp32).
* ``fp16`` / ``bf16``: input and weight cast to 16 bit, the op in 16 bit, the result cast
  back to the input dtype (the 16-bit output's rounding is kept).
* ``int8`` / ``int8_full``: ``qsync::int8_linear`` / ``qsync::int8_conv2d`` (a real integer
  GEMM, stochastic rounding, a fresh seed each call from the layer's counter); attention
  matmuls fake-quantize both operands to int8 and multiply in the input dtype, with an
  unquantized gradient, so ``int8_full`` computes there exactly what ``int8`` does (there is
  no batched int8 GEMM op yet).
* ``fp8`` (emulated): both operands fake-quantized to e4m3 (scaled per tensor), the GEMM in
  the input dtype (FP32), the gradient passed straight through in FP32 (no FP8 GEMM, no e5m2
  gradients), on a CPU and on CUDA alike. The cost model still charges FP8 peaks.

Convolutions with a ``padding_mode`` other than zeros are padded first, as torch does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops
from ..errors import QsyncInputError
from ..models.layers import MatMul
from ..precision import Precision

_HALF = {Precision.fp16: torch.float16, Precision.bf16: torch.bfloat16}


class _QMixin:
    precision: Precision
    qseed: int

    def _next_seed(self) -> int:
        self.qseed += 1
        return self.qseed


class QLinear(nn.Linear, _QMixin):
    def forward(self, x: Tensor) -> Tensor:
        p = self.precision
        if p in _HALF:
            d = _HALF[p]
            b = None if self.bias is None else self.bias.to(d)
            return F.linear(x.to(d), self.weight.to(d), b).to(x.dtype)
        if p in (Precision.int8, Precision.int8_full):
            return ops.int8_linear(x, self.weight, self.bias,
                                   int8_backward=p == Precision.int8_full,
                                   seed=self._next_seed())
        if p == Precision.fp8:
            return F.linear(ops.fake_quant_float(x, "fp8_e4m3"),
                            ops.fake_quant_float(self.weight, "fp8_e4m3"), self.bias)
        return F.linear(x, self.weight, self.bias)


class QConv2d(nn.Conv2d, _QMixin):
    def forward(self, x: Tensor) -> Tensor:
        p = self.precision
        if isinstance(self.padding, str):
            raise QsyncInputError(f"QConv2d: string padding {self.padding!r} is not supported")
        if p not in (*_HALF, Precision.int8, Precision.int8_full, Precision.fp8):
            return super().forward(x)
        padding: Any = self.padding
        if self.padding_mode != "zeros":  # reflect / replicate / circular: pad first, as torch
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = (0, 0)
        if p in _HALF:
            d = _HALF[p]
            b = None if self.bias is None else self.bias.to(d)
            return F.conv2d(x.to(d), self.weight.to(d), b, self.stride, padding,
                            self.dilation, self.groups).to(x.dtype)
        if p in (Precision.int8, Precision.int8_full):
            return ops.int8_conv2d(x, self.weight, self.bias, self.stride, padding,
                                   self.dilation, self.groups,
                                   int8_backward=p == Precision.int8_full,
                                   seed=self._next_seed())
        return F.conv2d(ops.fake_quant_float(x, "fp8_e4m3"),
                        ops.fake_quant_float(self.weight, "fp8_e4m3"), self.bias,
                        self.stride, padding, self.dilation, self.groups)


class QMatMul(MatMul, _QMixin):
    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        p = self.precision
        if p in _HALF:
            d = _HALF[p]
            return torch.matmul(a.to(d), b.to(d)).to(a.dtype)
        if p in (Precision.int8, Precision.int8_full):
            s = self._next_seed()
            return torch.matmul(ops.fake_quant_int8(a, seed=2 * s),
                                ops.fake_quant_int8(b, seed=2 * s + 1))
        if p == Precision.fp8:
            return torch.matmul(ops.fake_quant_float(a, "fp8_e4m3"),
                                ops.fake_quant_float(b, "fp8_e4m3"))
        return torch.matmul(a, b)


_SWAPS: list[tuple[type[nn.Module], type[nn.Module]]] = [
    (QLinear, nn.Linear), (QConv2d, nn.Conv2d), (QMatMul, MatMul)]


def apply_precisions(model: nn.Module, precisions: Mapping[str, Precision | str],
                     seed: int = 0) -> dict[str, Any]:
    """Swap the named modules in place to run at the given precisions.

    Returns ``{name: precision}`` as applied. Unknown names and modules of a kind with no
    precision-specific layer are refused with the name in the message.
    """
    modules = dict(model.named_modules())
    applied: dict[str, Any] = {}
    for i, (name, value) in enumerate(sorted(precisions.items())):
        mod = modules.get(name)
        if mod is None:
            raise QsyncInputError(f"precisions: no module named {name!r} in the model")
        try:
            p = Precision(value)
        except ValueError:
            raise QsyncInputError(f"precisions: {name}: unknown precision {value!r}") from None
        for qcls, base in _SWAPS:
            if isinstance(mod, base):
                mod.__class__ = qcls
                mod.precision = p  # type: ignore[attr-defined]
                mod.qseed = (seed * 1_000_003 + i * 7919) & 0x7FFFFFFF  # type: ignore[attr-defined]
                applied[name] = p
                break
        else:
            raise QsyncInputError(
                f"precisions: {name} is a {type(mod).__name__}; only Linear, Conv2d and MatMul "
                "have precision-specific layers")
    return applied
