"""int8 linear and conv2d: ``qsync::int8_linear``, ``qsync::int8_conv2d`` and their
backward ops (16-bit, or int8 GEMMs on a quantized output gradient with ``int8_backward``),
and the pieces the int4 ops share with them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.grad import conv2d_input, conv2d_weight

from qsync_opt.ops import intmm, rounding
from qsync_opt.ops import reference as ref
from qsync_opt.ops.backends import check_float, default_bwd_dtype, owned
from qsync_opt.ops.intmm import int_mm, mm16
from qsync_opt.ops.quantize import (
    dequantize_impl,
    quantize_impl,
    rescale_int32_op,
    rescale_rows,
)
from qsync_opt.ops.rounding import grad_scale_code, pick

__all__ = ["conv_backward", "grad_w_rescale", "im2col_int8", "int8_conv2d", "int8_linear",
           "int_conv2d_fake", "int_conv2d_forward", "int_linear_fake", "pair", "quantize_grad",
           "save_conv", "seeds"]


def seeds(seed: int) -> tuple[int, int, int, int]:
    """Distinct stochastic-rounding streams: input, weight, output gradient, weight again
    (the output gradient's per-column copy takes ``seed + 4 * 0x9E37``)."""
    s = int(seed)
    return s, s + 0x9E37, s + 2 * 0x9E37, s + 3 * 0x9E37


def quantize_grad(go: Tensor, grad_scale: int, stochastic: bool, seed: int
                   ) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """int8_full's output gradient ``go`` [M, N], quantized for the two backward GEMMs:
    ``((q, s) for grad_x = go @ W, (q, s) for grad_w = go^T @ x)``. ``grad_scale`` indexes
    :data:`GRAD_SCALES`: 0 one scale for both; 1 one per row (token) for grad_x, one per
    tensor for grad_w; 2 per row for grad_x, per column (output channel) for grad_w. Every
    scale factors out of its integer GEMM: row scales of ``go`` are row scales of grad_x,
    column scales of ``go`` row scales of grad_w."""
    if grad_scale == 0:
        one = quantize_impl(go, None, stochastic, seed)
        return one, one
    rows = quantize_impl(go, 0, stochastic, seed)
    if grad_scale == 1:
        return rows, quantize_impl(go, None, stochastic, seed + 4 * 0x9E37)
    return rows, quantize_impl(go, 1, stochastic, seed + 4 * 0x9E37)


def grad_w_rescale(acc: Tensor, sg: Tensor, sx: Tensor, dtype: torch.dtype) -> Tensor:
    """grad_w [N, K] from ``acc = qgo^T @ qx``: ``sg`` one scale or one per row (N)."""
    ones = torch.ones(acc.shape[1], dtype=torch.float32, device=acc.device)
    return rescale_rows(acc, sg * sx, ones, None, dtype)


# ----------------------------------------------------------------------------- int8 linear


def int_linear_fake(x: Tensor, weight: Tensor, per_row: bool
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The shapes and dtypes the integer linears return: (out, qx [M, K], sx (one scale, or
    one per row with ``per_row``), qw, sw per output channel)."""
    m = 1
    for s in x.shape[:-1]:
        m *= s
    out = x.new_empty((*x.shape[:-1], weight.shape[0]))
    return (out, x.new_empty((m, x.shape[-1]), dtype=torch.int8),
            x.new_empty((m,) if per_row else (), dtype=torch.float32),
            weight.new_empty(weight.shape, dtype=torch.int8),
            weight.new_empty((weight.shape[0],), dtype=torch.float32))


@torch.library.custom_op("qsync::int8_linear", mutates_args=())
def _int8_linear_op(x: Tensor, weight: Tensor, bias: Tensor | None, int8_backward: bool,
                    stochastic: bool, seed: int, bwd_dtype: torch.dtype,
                    grad_stochastic: bool, grad_scale: int
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    check_float("x", x)
    k = x.shape[-1]
    x_seed, w_seed, _, _ = seeds(seed)
    qx, sx = quantize_impl(x.reshape(-1, k), None, stochastic, x_seed)
    qw, sw = quantize_impl(weight, 0, stochastic, w_seed)
    acc = int_mm(qx, qw.t())
    out = rescale_int32_op(acc, sx, sw, bias, x.dtype)
    return owned((out.reshape(*x.shape[:-1], weight.shape[0]), qx, sx, qw, sw),
                  (x, weight, bias))


@_int8_linear_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, int8_backward: bool, stochastic: bool,
      seed: int, bwd_dtype: torch.dtype, grad_stochastic: bool, grad_scale: int
      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return int_linear_fake(x, weight, per_row=False)


@torch.library.custom_op("qsync::int8_linear_backward", mutates_args=())
def _int8_linear_backward_op(grad: Tensor, qx: Tensor, sx: Tensor, qw: Tensor, sw: Tensor,
                             int8_backward: bool, stochastic: bool, seed: int,
                             bwd_dtype: torch.dtype, x_dtype: torch.dtype,
                             w_dtype: torch.dtype, grad_scale: int) -> tuple[Tensor, Tensor]:
    """``stochastic`` here is the backward's rounding (``grad_stochastic``)."""
    n = qw.shape[0]
    go = grad.reshape(-1, n)
    _, _, g_seed, w2_seed = seeds(seed)
    if int8_backward:
        (qgr, sgr), (qgc, sgc) = quantize_grad(go, grad_scale, stochastic, g_seed)
        # grad_x = go @ W needs W's scale on its output (K) axis: requantize W per input
        # column. grad_w = go^T @ x: x per tensor, go's column (or one) scale per row of it.
        w_deq = dequantize_impl(qw, sw, 0, torch.float32)
        qwc, swc = quantize_impl(w_deq, 1, stochastic, w2_seed)
        grad_x = rescale_rows(int_mm(qgr, qwc), sgr, swc, None, x_dtype)
        grad_w = grad_w_rescale(int_mm(qgc.t(), qx), sgc, sx, w_dtype)
    else:
        g16 = go.to(bwd_dtype)
        w16 = dequantize_impl(qw, sw, 0, bwd_dtype)
        x16 = dequantize_impl(qx, sx, None, bwd_dtype)
        grad_x = mm16(g16, w16).to(x_dtype)
        grad_w = mm16(g16.t(), x16).to(w_dtype)
    return owned((grad_x, grad_w), (grad, qx, sx, qw, sw))


@_int8_linear_backward_op.register_fake
def _(grad: Tensor, qx: Tensor, sx: Tensor, qw: Tensor, sw: Tensor, int8_backward: bool,
      stochastic: bool, seed: int, bwd_dtype: torch.dtype, x_dtype: torch.dtype,
      w_dtype: torch.dtype, grad_scale: int) -> tuple[Tensor, Tensor]:
    return (grad.new_empty(qx.shape, dtype=x_dtype), grad.new_empty(qw.shape, dtype=w_dtype))


def _linear_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    x, weight, bias, int8_backward, _, seed, bwd_dtype, grad_stochastic, grad_scale = inputs
    _, qx, sx, qw, sw = output
    ctx.save_for_backward(qx, sx, qw, sw)
    ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
    ctx.has_bias = bias is not None
    ctx.args = (int8_backward, grad_stochastic, seed, bwd_dtype, grad_scale)


def _linear_backward(ctx: Any, grad: Tensor, *_: Any) -> tuple[Any, ...]:
    qx, sx, qw, sw = ctx.saved_tensors
    int8_backward, grad_stochastic, seed, bwd_dtype, grad_scale = ctx.args
    grad_x, grad_w = torch.ops.qsync.int8_linear_backward(
        grad.contiguous(), qx, sx, qw, sw, int8_backward, grad_stochastic, seed, bwd_dtype,
        ctx.x_dtype, ctx.w_dtype, grad_scale)
    grad_b = grad.reshape(-1, qw.shape[0]).sum(0).to(torch.float32) if ctx.has_bias else None
    return (grad_x.reshape(ctx.x_shape), grad_w, grad_b) + (None,) * 6


_int8_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)


def int8_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                int8_backward: bool = False, stochastic: bool | None = None, seed: int = 0,
                bwd_dtype: torch.dtype | None = None, grad_stochastic: bool | None = None,
                grad_scale: str | None = None) -> Tensor:
    """``x @ weight.T + bias`` with an int8 x int8 -> int32 GEMM.

    ``x`` is quantized per tensor, ``weight`` per output channel, by stochastic rounding or
    (``stochastic=False``) round to nearest; None takes :data:`NUMERICS`. The int32 result
    is rescaled, biased and cast to ``x.dtype`` in one fused kernel. Backward: 16-bit GEMMs
    on the saved int8 operands (``bwd_dtype``, default bf16 on the CPU and fp16 on CUDA), or
    int8 GEMMs with ``int8_backward=True`` (the ``int8_full`` precision), rounding by
    ``grad_stochastic`` with the output gradient's scales by ``grad_scale`` (one of
    :data:`GRAD_SCALES`; None: :data:`NUMERICS`). Gradients come back in the dtypes of ``x``
    and ``weight`` (FP32 master weights get FP32 gradients).
    """
    dtype = bwd_dtype or default_bwd_dtype(x.device)
    return torch.ops.qsync.int8_linear(
        x, weight, bias, int8_backward, pick(stochastic, rounding.NUMERICS.int8_forward_stochastic),
        int(seed), dtype, pick(grad_stochastic, rounding.NUMERICS.grad_stochastic),
        grad_scale_code(grad_scale))[0]


# ----------------------------------------------------------------------------- int8 conv2d


def im2col_int8(q: Tensor, kernel: Sequence[int], stride: Sequence[int],
                 padding: Sequence[int], dilation: Sequence[int]) -> tuple[Tensor, int, int]:
    """int8 [B, C, H, W] -> int8 columns [B*L, C*kh*kw] (values exact through float32)."""
    b, c, h, w = q.shape
    kh, kw = kernel
    ho = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    if (kh, kw) == (1, 1) and tuple(stride) == (1, 1) and tuple(padding) == (0, 0):
        cols = q.permute(0, 2, 3, 1).reshape(b * h * w, c)
        return cols.contiguous(), ho, wo
    cols = F.unfold(q.to(torch.float32), (kh, kw), dilation=tuple(dilation),
                    padding=tuple(padding), stride=tuple(stride))  # [B, C*kh*kw, L]
    return cols.transpose(1, 2).reshape(b * ho * wo, c * kh * kw).to(torch.int8), ho, wo


def int_conv2d_forward(x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int],
                        padding: list[int], dilation: list[int], groups: int,
                        stochastic: bool, seed: int, qmax: int
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The integer conv2d forward of int8_conv2d and int4_conv2d: activations quantized per
    tensor, weights per output channel, symmetric levels up to ``qmax`` (int8's or int4's), the
    im2col integer GEMM per group, rescaled; returns (out, qx, sx, qw, sw)."""
    check_float("x", x)
    x_seed, w_seed, _, _ = seeds(seed)
    qx, sx = quantize_impl(x, None, stochastic, x_seed, qmax)
    qw, sw = quantize_impl(weight, 0, stochastic, w_seed, qmax)
    b = x.shape[0]
    cout = weight.shape[0]
    cin_g, cout_g = x.shape[1] // groups, cout // groups
    outs = []
    for g in range(groups):
        cols, ho, wo = im2col_int8(qx[:, g * cin_g:(g + 1) * cin_g], weight.shape[2:],
                                    stride, padding, dilation)
        wg = qw[g * cout_g:(g + 1) * cout_g].reshape(cout_g, -1)
        bias_g = None if bias is None else bias[g * cout_g:(g + 1) * cout_g]
        outs.append(rescale_int32_op(int_mm(cols, wg.t()), sx, sw[g * cout_g:(g + 1) * cout_g],
                                bias_g, x.dtype))
    out = torch.cat(outs, dim=1) if groups > 1 else outs[0]
    out = out.reshape(b, ho, wo, cout).permute(0, 3, 1, 2).contiguous()
    return owned((out, qx, sx, qw, sw), (x, weight, bias))


def int_conv2d_fake(x: Tensor, weight: Tensor, stride: list[int], padding: list[int],
                     dilation: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The shapes and dtypes :func:`int_conv2d_forward` returns (the ops' fakes)."""
    b, _, h, w = x.shape
    kh, kw = weight.shape[2:]
    ho = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    return (x.new_empty((b, weight.shape[0], ho, wo)),
            torch.empty_like(x, dtype=torch.int8, memory_format=torch.contiguous_format),
            x.new_empty((), dtype=torch.float32),
            torch.empty_like(weight, dtype=torch.int8, memory_format=torch.contiguous_format),
            weight.new_empty((weight.shape[0],), dtype=torch.float32))


@torch.library.custom_op("qsync::int8_conv2d", mutates_args=())
def _int8_conv2d_op(x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int],
                    padding: list[int], dilation: list[int], groups: int,
                    int8_backward: bool, stochastic: bool, seed: int, bwd_dtype: torch.dtype,
                    grad_stochastic: bool, grad_scale: int
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return int_conv2d_forward(x, weight, bias, stride, padding, dilation, groups,
                               stochastic, seed, ref.INT8_QMAX)


@_int8_conv2d_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int], padding: list[int],
      dilation: list[int], groups: int, int8_backward: bool, stochastic: bool, seed: int,
      bwd_dtype: torch.dtype, grad_stochastic: bool, grad_scale: int
      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return int_conv2d_fake(x, weight, stride, padding, dilation)


@torch.library.custom_op("qsync::int8_conv2d_backward", mutates_args=())
def _int8_conv2d_backward_op(grad: Tensor, qx: Tensor, sx: Tensor, qw: Tensor, sw: Tensor,
                             stride: list[int], padding: list[int], dilation: list[int],
                             groups: int, int8_backward: bool, stochastic: bool, seed: int,
                             bwd_dtype: torch.dtype, x_dtype: torch.dtype,
                             w_dtype: torch.dtype, grad_scale: int) -> tuple[Tensor, Tensor]:
    """``stochastic`` here is the backward's rounding (``grad_stochastic``)."""
    if not int8_backward:
        g16 = grad.to(bwd_dtype)
        w16 = dequantize_impl(qw, sw, 0, bwd_dtype)
        x16 = dequantize_impl(qx, sx, None, bwd_dtype)
        if intmm.is_half_emulated() and not grad.is_cuda:  # fp32 arithmetic, 16-bit results
            w16, g16, x16 = w16.float(), g16.float(), x16.float()
        grad_x = conv2d_input(list(qx.shape), w16, g16, stride, padding,
                              dilation, groups).to(bwd_dtype)
        grad_w = conv2d_weight(x16, list(qw.shape), g16, stride, padding,
                               dilation, groups).to(bwd_dtype)
        return owned((grad_x.to(x_dtype), grad_w.to(w_dtype)), (grad, qx, sx, qw, sw))
    _, _, g_seed, w2_seed = seeds(seed)
    b, cin, h, w = qx.shape
    cout, cin_g, kh, kw = qw.shape
    cout_g = cout // groups
    if grad_scale == 0:  # one scale: quantized in the NCHW layout, then moved
        qgo, sgo = quantize_impl(grad.contiguous(), None, stochastic, g_seed)
        go_r = go_c = qgo.permute(0, 2, 3, 1).reshape(-1, cout)  # [B*L, Cout]
        sgr = sgc = sgo
    else:  # per output position (row) for grad_x; per channel or one for grad_w
        go_f = grad.permute(0, 2, 3, 1).reshape(-1, cout).contiguous()
        (go_r, sgr), (go_c, sgc) = quantize_grad(go_f, grad_scale, stochastic, g_seed)
    w_deq = dequantize_impl(qw, sw, 0, torch.float32).reshape(cout, -1)
    grad_ws, grad_cols = [], []
    for g in range(groups):
        cols, ho, wo = im2col_int8(qx[:, g * cin_g:(g + 1) * cin_g], (kh, kw), stride, padding,
                                    dilation)
        sl = slice(g * cout_g, (g + 1) * cout_g)
        go_g = go_r[:, sl].contiguous()
        sgc_g = sgc if sgc.dim() == 0 else sgc[sl]
        grad_ws.append(grad_w_rescale(int_mm(go_c[:, sl].contiguous().t(), cols), sgc_g, sx,
                                       w_dtype))
        qwc, swc = quantize_impl(w_deq[sl].contiguous(), 1, stochastic, w2_seed + g)
        gc = rescale_rows(int_mm(go_g, qwc), sgr, swc, None, torch.float32)  # [B*L, cin_g*k]
        gc = gc.reshape(b, ho * wo, -1).transpose(1, 2)
        grad_cols.append(F.fold(gc, (h, w), (kh, kw), dilation=tuple(dilation),
                                padding=tuple(padding), stride=tuple(stride)))
    grad_w = torch.cat(grad_ws, 0).reshape(qw.shape)
    grad_x = torch.cat(grad_cols, 1) if groups > 1 else grad_cols[0]
    return owned((grad_x.to(x_dtype), grad_w), (grad, qx, sx, qw, sw))


@_int8_conv2d_backward_op.register_fake
def _(grad: Tensor, qx: Tensor, sx: Tensor, qw: Tensor, sw: Tensor, stride: list[int],
      padding: list[int], dilation: list[int], groups: int, int8_backward: bool,
      stochastic: bool, seed: int, bwd_dtype: torch.dtype, x_dtype: torch.dtype,
      w_dtype: torch.dtype, grad_scale: int) -> tuple[Tensor, Tensor]:
    return (grad.new_empty(qx.shape, dtype=x_dtype), grad.new_empty(qw.shape, dtype=w_dtype))


def save_conv(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...],
               args: tuple[Any, ...]) -> None:
    """What the integer convs' backward needs: the saved integer operands and scales, the
    dtypes, and the arguments of ``int8_conv2d_backward``."""
    x, weight, bias = inputs[:3]
    _, qx, sx, qw, sw = output
    ctx.save_for_backward(qx, sx, qw, sw)
    ctx.x_dtype, ctx.w_dtype, ctx.has_bias = x.dtype, weight.dtype, bias is not None
    ctx.args, ctx.n_inputs = args, len(inputs)


def _conv_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    (_, _, _, stride, padding, dilation, groups, int8_backward, _, seed,
     bwd_dtype, grad_stochastic, grad_scale) = inputs
    save_conv(ctx, inputs, output, (stride, padding, dilation, groups, int8_backward,
                                     grad_stochastic, seed, bwd_dtype, grad_scale))


def conv_backward(ctx: Any, grad: Tensor, *_: Any) -> tuple[Any, ...]:
    """int8_conv2d's backward (int8 or 16-bit by its ``int8_backward``), and int4_conv2d's
    (16-bit on the saved int4 values)."""
    qx, sx, qw, sw = ctx.saved_tensors
    *args, grad_scale = ctx.args
    grad_x, grad_w = torch.ops.qsync.int8_conv2d_backward(
        grad.contiguous(), qx, sx, qw, sw, *args, ctx.x_dtype, ctx.w_dtype, grad_scale)
    grad_b = grad.sum((0, 2, 3)).to(torch.float32) if ctx.has_bias else None
    return (grad_x, grad_w, grad_b) + (None,) * (ctx.n_inputs - 3)


_int8_conv2d_op.register_autograd(conv_backward, setup_context=_conv_setup)


def pair(v: int | Sequence[int]) -> list[int]:
    return [int(v), int(v)] if isinstance(v, int) else [int(a) for a in v]


def int8_conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                stride: int | Sequence[int] = 1, padding: int | Sequence[int] = 0,
                dilation: int | Sequence[int] = 1, groups: int = 1, *,
                int8_backward: bool = False, stochastic: bool | None = None, seed: int = 0,
                bwd_dtype: torch.dtype | None = None, grad_stochastic: bool | None = None,
                grad_scale: str | None = None) -> Tensor:
    """conv2d with int8 operands and an im2col int8 x int8 -> int32 GEMM (1x1 convs skip
    the im2col); scales, rounding and backward as :func:`int8_linear` (a row of the output
    gradient is one output position, its columns the output channels)."""
    dtype = bwd_dtype or default_bwd_dtype(x.device)
    return torch.ops.qsync.int8_conv2d(
        x, weight, bias, pair(stride), pair(padding), pair(dilation), int(groups),
        int8_backward, pick(stochastic, rounding.NUMERICS.int8_forward_stochastic), int(seed), dtype,
        pick(grad_stochastic, rounding.NUMERICS.grad_stochastic), grad_scale_code(grad_scale))[0]
