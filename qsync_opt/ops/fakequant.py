"""Quantize-and-back with a straight-through gradient: ``qsync::fake_quant_int8``,
``qsync::fake_quant_int4``, ``qsync::fake_quant_float``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from qsync_opt.ops import reference as ref
from qsync_opt.ops import rounding
from qsync_opt.ops.backends import owned
from qsync_opt.ops.quantize import dequantize_impl, quantize_impl
from qsync_opt.ops.rounding import pick

__all__ = ["FP8_MAX", "fake_quant_float", "fake_quant_int4", "fake_quant_int8"]

FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
_FLOAT_FORMATS = {"fp16": torch.float16, "bf16": torch.bfloat16,
                  "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@torch.library.custom_op("qsync::fake_quant_int8", mutates_args=())
def _fake_int8_op(x: Tensor, axis: int | None, stochastic: bool, seed: int) -> Tensor:
    q, scale = quantize_impl(x, axis, stochastic, seed)
    return owned(dequantize_impl(q, scale, axis, x.dtype), (x,))


@_fake_int8_op.register_fake
def _(x: Tensor, axis: int | None, stochastic: bool, seed: int) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _straight_through(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    return (grad,) + (None,) * ctx.n_extra


def _st_setup(n_extra: int) -> Any:
    def setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.n_extra = n_extra
    return setup


_fake_int8_op.register_autograd(_straight_through, setup_context=_st_setup(3))


def fake_quant_int8(x: Tensor, axis: int | None = None, stochastic: bool | None = None,
                    seed: int = 0) -> Tensor:
    """Quantize to int8 and back (the noise of int8, in ``x.dtype``; rounding as the int8
    forward, :data:`NUMERICS`); gradient passes through."""
    return torch.ops.qsync.fake_quant_int8(
        x, axis, pick(stochastic, rounding.NUMERICS.int8_forward_stochastic), int(seed))


@torch.library.custom_op("qsync::fake_quant_int4", mutates_args=())
def _fake_int4_op(x: Tensor, axis: int | None, stochastic: bool, seed: int) -> Tensor:
    q, scale = quantize_impl(x, axis, stochastic, seed, ref.INT4_QMAX)
    return owned(dequantize_impl(q, scale, axis, x.dtype), (x,))


@_fake_int4_op.register_fake
def _(x: Tensor, axis: int | None, stochastic: bool, seed: int) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_fake_int4_op.register_autograd(_straight_through, setup_context=_st_setup(3))


def fake_quant_int4(x: Tensor, axis: int | None = None, stochastic: bool | None = None,
                    seed: int = 0) -> Tensor:
    """Quantize to int4 ([-7, 7]) and back, in ``x.dtype`` (rounding as :func:`int4_linear`);
    gradient passes through."""
    return torch.ops.qsync.fake_quant_int4(
        x, axis, pick(stochastic, rounding.NUMERICS.int4_forward_stochastic), int(seed))


@torch.library.custom_op("qsync::fake_quant_float", mutates_args=())
def _fake_float_op(x: Tensor, fmt: str) -> Tensor:
    if fmt not in _FLOAT_FORMATS:
        raise ValueError(f"fmt: expected one of {', '.join(_FLOAT_FORMATS)}, got {fmt!r}")
    target = _FLOAT_FORMATS[fmt]
    if fmt in FP8_MAX:
        # Per-tensor scaling to the format's largest finite value, as FP8 training recipes do.
        amax = ref.channel_amax(x, per_channel=False).reshape(())
        scale = FP8_MAX[fmt] / amax
        y = (x.to(torch.float32) * scale).clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(target)
        return owned((y.to(torch.float32) / scale).to(x.dtype), (x,))
    return owned(x.to(target).to(x.dtype), (x,))  # x itself when x is already in fmt


@_fake_float_op.register_fake
def _(x: Tensor, fmt: str) -> Tensor:
    return torch.empty_like(x)


_fake_float_op.register_autograd(_straight_through, setup_context=_st_setup(1))


def fake_quant_float(x: Tensor, fmt: str) -> Tensor:
    """Round ``x`` to ``fmt`` (fp16, bf16, fp8_e4m3, fp8_e5m2) and back; gradient passes
    through. FP8 is scaled per tensor so the abs-max lands on the format's largest value."""
    return torch.ops.qsync.fake_quant_float(x, fmt)
