"""int4 linear and conv2d: ``qsync::int4_linear`` (and its backward) and
``qsync::int4_conv2d``, on the int8 ops' integer GEMM."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from qsync_opt.ops import reference as ref
from qsync_opt.ops import rounding
from qsync_opt.ops.backends import check_float, default_bwd_dtype, owned
from qsync_opt.ops.int8 import (
    conv_backward,
    int_conv2d_fake,
    int_conv2d_forward,
    int_linear_fake,
    pair,
    save_conv,
    seeds,
)
from qsync_opt.ops.intmm import int_mm, mm16
from qsync_opt.ops.quantize import dequantize_impl, quantize_impl, quantize_rows_impl, rescale_rows
from qsync_opt.ops.rounding import pick

__all__ = ["int4_conv2d", "int4_linear"]


@torch.library.custom_op("qsync::int4_linear", mutates_args=())
def _int4_linear_op(x: Tensor, weight: Tensor, bias: Tensor | None, group_rows: int,
                    stochastic: bool, seed: int, bwd_dtype: torch.dtype
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    check_float("x", x)
    k = x.shape[-1]
    x_seed, w_seed, _, _ = seeds(seed)
    x2 = x.reshape(-1, k)
    if group_rows > 0:
        qx, sx = quantize_rows_impl(x2, group_rows, stochastic, x_seed, ref.INT4_QMAX)
    else:
        qx, sx = quantize_impl(x2, None, stochastic, x_seed, ref.INT4_QMAX)
    qw, sw = quantize_impl(weight, 0, stochastic, w_seed, ref.INT4_QMAX)
    acc = int_mm(qx, qw.t())  # int4 values, int32 accumulation
    out = rescale_rows(acc, sx, sw, bias, x.dtype)
    return owned((out.reshape(*x.shape[:-1], weight.shape[0]), qx, sx, qw, sw),
                  (x, weight, bias))


@_int4_linear_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, group_rows: int, stochastic: bool,
      seed: int, bwd_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return int_linear_fake(x, weight, per_row=group_rows > 0)


@torch.library.custom_op("qsync::int4_linear_backward", mutates_args=())
def _int4_linear_backward_op(grad: Tensor, qx: Tensor, sx: Tensor, qw: Tensor, sw: Tensor,
                             bwd_dtype: torch.dtype, x_dtype: torch.dtype,
                             w_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """16-bit backward GEMMs on the saved int4 operands (dequantized to ``bwd_dtype``)."""
    go = grad.reshape(-1, qw.shape[0])
    g16 = go.to(bwd_dtype)
    w16 = dequantize_impl(qw, sw, 0, bwd_dtype)
    x16 = dequantize_impl(qx, sx, None if sx.dim() == 0 else 0, bwd_dtype)
    grad_x = mm16(g16, w16).to(x_dtype)
    grad_w = mm16(g16.t(), x16).to(w_dtype)
    return owned((grad_x, grad_w), (grad, qx, sx, qw, sw))


@_int4_linear_backward_op.register_fake
def _(grad: Tensor, qx: Tensor, sx: Tensor, qw: Tensor, sw: Tensor, bwd_dtype: torch.dtype,
      x_dtype: torch.dtype, w_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return (grad.new_empty(qx.shape, dtype=x_dtype), grad.new_empty(qw.shape, dtype=w_dtype))


def _int4_linear_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    x, weight, bias, _group_rows, _stochastic, _seed, bwd_dtype = inputs
    _, qx, sx, qw, sw = output
    ctx.save_for_backward(qx, sx, qw, sw)
    ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
    ctx.has_bias = bias is not None
    ctx.bwd_dtype = bwd_dtype


def _int4_linear_backward(ctx: Any, grad: Tensor, *_: Any) -> tuple[Any, ...]:
    qx, sx, qw, sw = ctx.saved_tensors
    grad_x, grad_w = torch.ops.qsync.int4_linear_backward(
        grad.contiguous(), qx, sx, qw, sw, ctx.bwd_dtype, ctx.x_dtype, ctx.w_dtype)
    grad_b = grad.reshape(-1, qw.shape[0]).sum(0).to(torch.float32) if ctx.has_bias else None
    return grad_x.reshape(ctx.x_shape), grad_w, grad_b, None, None, None, None


_int4_linear_op.register_autograd(_int4_linear_backward, setup_context=_int4_linear_setup)


def int4_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                group_rows: int = 0, stochastic: bool | None = None, seed: int = 0,
                bwd_dtype: torch.dtype | None = None) -> Tensor:
    """``x @ weight.T + bias`` with int4 operands and an integer GEMM (int32 accumulation).

    ``weight`` is quantized per output channel, ``x`` (viewed [M, K]) per tensor or, with
    ``group_rows > 0``, per group of that many rows (tokens), all to [-7, 7] at scale
    ``amax / 7`` by round to nearest (``stochastic=True``: stochastic rounding; None takes
    :data:`NUMERICS`, round to nearest: 15 levels make stochastic rounding's variance,
    twice round-to-nearest's on average, cost most of the gradient's direction). The values
    live in int8 storage and run through :func:`int_mm` (exact; on this CPU no faster than
    int8). Backward: 16-bit GEMMs on the saved int4 operands (``bwd_dtype``: bf16 on the
    CPU, fp16 on CUDA), as :func:`int8_linear` without ``int8_backward``.
    """
    dtype = bwd_dtype or default_bwd_dtype(x.device)
    return torch.ops.qsync.int4_linear(x, weight, bias, int(group_rows),
                                       pick(stochastic, rounding.NUMERICS.int4_forward_stochastic),
                                       int(seed), dtype)[0]


@torch.library.custom_op("qsync::int4_conv2d", mutates_args=())
def _int4_conv2d_op(x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int],
                    padding: list[int], dilation: list[int], groups: int,
                    stochastic: bool, seed: int, bwd_dtype: torch.dtype
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return int_conv2d_forward(x, weight, bias, stride, padding, dilation, groups,
                               stochastic, seed, ref.INT4_QMAX)


@_int4_conv2d_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int], padding: list[int],
      dilation: list[int], groups: int, stochastic: bool, seed: int,
      bwd_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return int_conv2d_fake(x, weight, stride, padding, dilation)


def _int4_conv_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    (_, _, _, stride, padding, dilation, groups, stochastic, seed, bwd_dtype) = inputs
    # the 16-bit backward of int8_conv2d on the saved int4 values (int8_backward=False)
    save_conv(ctx, inputs, output,
               (stride, padding, dilation, groups, False, stochastic, seed, bwd_dtype, 0))


_int4_conv2d_op.register_autograd(conv_backward, setup_context=_int4_conv_setup)


def int4_conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                stride: int | Sequence[int] = 1, padding: int | Sequence[int] = 0,
                dilation: int | Sequence[int] = 1, groups: int = 1, *,
                stochastic: bool | None = None, seed: int = 0,
                bwd_dtype: torch.dtype | None = None) -> Tensor:
    """conv2d with int4 operands (activations per tensor, weights per output channel) and
    the im2col integer GEMM of :func:`int8_conv2d`, rounding as :func:`int4_linear`; 16-bit
    backward."""
    dtype = bwd_dtype or default_bwd_dtype(x.device)
    return torch.ops.qsync.int4_conv2d(x, weight, bias, pair(stride), pair(padding),
                                       pair(dilation), int(groups),
                                       pick(stochastic, rounding.NUMERICS.int4_forward_stochastic),
                                       int(seed), dtype)[0]
