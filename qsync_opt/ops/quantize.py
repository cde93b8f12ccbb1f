"""Quantize and dequantize (int8, int4) and the fused rescale of an int32 GEMM result:
``qsync::quantize_int8``, ``qsync::dequantize_int8``, ``qsync::quantize_int4``,
``qsync::rescale_int32``, ``qsync::rescale_int32_rows``."""

from __future__ import annotations

import torch
from torch import Tensor

from qsync_opt.ops import backends
from qsync_opt.ops import reference as ref
from qsync_opt.ops.backends import check_float, owned

__all__ = ["dequantize_impl", "dequantize_int8", "quantize_impl", "quantize_int4", "quantize_int8",
           "quantize_rows_impl", "rescale_int32", "rescale_int32_op", "rescale_int32_rows",
           "rescale_int32_rows_op", "rescale_rows"]


def _quantize_kernel(moved: Tensor, inv: Tensor, stochastic: bool, seed: int,
                     qmax: int) -> Tensor:
    """The quantization kernel on contiguous ``moved`` ([C, inner], ``inv`` per channel).

    The compiled kernels clamp to int8's [-127, 127]; int4 (``qmax`` 7) is the same kernel
    at scale amax/7, clamped once more to [-7, 7] (a value at amax can round to 7 + 1 ulp,
    which stochastic rounding could carry to 8): the reference's formula exactly."""
    if backends.use_cpp(moved):
        q = torch.ops.qsync_cpu.quantize_int8(moved, inv, stochastic, seed)
    elif moved.is_cuda and backends.cuda_kernels() is not None:
        inner = moved.numel() // inv.numel()
        if qmax == ref.INT4_QMAX:  # the CUDA int4 kernel clamps at 7 itself
            return backends.cuda_kernels().quantize_int4(moved, inv, inner, stochastic, seed)
        q = backends.cuda_kernels().quantize_int8(moved, inv, inner, stochastic, seed)
    else:
        return ref.quantize_levels(moved, inv, stochastic, seed, qmax)
    return q if qmax == ref.INT8_QMAX else q.clamp_(-qmax, qmax)


def quantize_impl(x: Tensor, axis: int | None, stochastic: bool, seed: int,
                   qmax: int = ref.INT8_QMAX) -> tuple[Tensor, Tensor]:
    check_float("x", x)
    moved = x if axis is None else x.movedim(axis, 0)
    moved = moved.contiguous()
    amax = ref.channel_amax(moved, per_channel=axis is not None)
    inv = float(qmax) / amax
    scale = ref.scale_of(amax, qmax)
    q = _quantize_kernel(moved, inv, stochastic, seed, qmax)
    if axis is not None:
        q = q.movedim(0, axis).contiguous()
        return q, scale
    return q, scale.reshape(())


@torch.library.custom_op("qsync::quantize_int8", mutates_args=())
def _quantize_op(x: Tensor, axis: int | None, stochastic: bool, seed: int
                 ) -> tuple[Tensor, Tensor]:
    return owned(quantize_impl(x, axis, stochastic, seed), (x,))


@_quantize_op.register_fake
def _(x: Tensor, axis: int | None, stochastic: bool, seed: int) -> tuple[Tensor, Tensor]:
    q = torch.empty_like(x, dtype=torch.int8, memory_format=torch.contiguous_format)
    scale = x.new_empty((x.shape[axis],) if axis is not None else (), dtype=torch.float32)
    return q, scale


def quantize_int8(x: Tensor, axis: int | None = None, stochastic: bool = True,
                  seed: int = 0) -> tuple[Tensor, Tensor]:
    """Symmetric int8 quantization: per tensor (``axis=None``) or per channel along ``axis``.

    Returns ``(q, scale)`` with ``x ~ q * scale`` (scale broadcast along ``axis``).
    Stochastic rounding draws ``u(i, seed)`` from a counter-based hash of the element index
    ``i`` in the layout with ``axis`` moved first; the same seed gives the same bits on
    every implementation.
    """
    return torch.ops.qsync.quantize_int8(x, axis, stochastic, int(seed))


def dequantize_impl(q: Tensor, scale: Tensor, axis: int | None, dtype: torch.dtype) -> Tensor:
    moved = (q if axis is None else q.movedim(axis, 0)).contiguous()
    s = scale.to(torch.float32).reshape(-1).contiguous()
    if backends.use_cpp(moved):
        out = torch.ops.qsync_cpu.dequantize_int8(moved, s, dtype)
    elif moved.is_cuda and backends.cuda_kernels() is not None:
        out = backends.cuda_kernels().dequantize_int8(moved, s, moved.numel() // s.numel(), dtype)
    else:
        out = ref.dequantize_int8(moved, s, dtype)
    return out if axis is None else out.movedim(0, axis).contiguous()


@torch.library.custom_op("qsync::dequantize_int8", mutates_args=())
def _dequantize_op(q: Tensor, scale: Tensor, axis: int | None, dtype: torch.dtype) -> Tensor:
    return owned(dequantize_impl(q, scale, axis, dtype), (q, scale))


@_dequantize_op.register_fake
def _(q: Tensor, scale: Tensor, axis: int | None, dtype: torch.dtype) -> Tensor:
    return torch.empty_like(q, dtype=dtype, memory_format=torch.contiguous_format)


def dequantize_int8(q: Tensor, scale: Tensor, axis: int | None = None,
                    dtype: torch.dtype = torch.float32) -> Tensor:
    """``q * scale`` (per channel along ``axis``) in ``dtype``."""
    return torch.ops.qsync.dequantize_int8(q, scale, axis, dtype)


def quantize_rows_impl(x2d: Tensor, group_rows: int, stochastic: bool, seed: int,
                        qmax: int) -> tuple[Tensor, Tensor]:
    """2-D ``x2d`` quantized with one scale per group of ``group_rows`` consecutive rows
    (``scale`` has one entry per row). The element order is the per-tensor one, so the
    stochastic-rounding draws are those of a per-tensor quantization of the same tensor."""
    check_float("x", x2d)
    moved = x2d.contiguous()
    amax = ref.group_amax(moved, group_rows)
    inv = float(qmax) / amax
    return _quantize_kernel(moved, inv, stochastic, seed, qmax), ref.scale_of(amax, qmax)


@torch.library.custom_op("qsync::quantize_int4", mutates_args=())
def _quantize_int4_op(x: Tensor, axis: int | None, group_rows: int, stochastic: bool,
                      seed: int) -> tuple[Tensor, Tensor]:
    if group_rows > 0:
        k = x.shape[-1] if x.dim() else 1
        q, scale = quantize_rows_impl(x.reshape(-1, k), group_rows, stochastic, seed,
                                       ref.INT4_QMAX)
        return owned((q.reshape(x.shape), scale), (x,))
    return owned(quantize_impl(x, axis, stochastic, seed, ref.INT4_QMAX), (x,))


@_quantize_int4_op.register_fake
def _(x: Tensor, axis: int | None, group_rows: int, stochastic: bool, seed: int
      ) -> tuple[Tensor, Tensor]:
    q = torch.empty_like(x, dtype=torch.int8, memory_format=torch.contiguous_format)
    if group_rows > 0:
        rows = x.numel() // x.shape[-1] if x.dim() else 1
        return q, x.new_empty((rows,), dtype=torch.float32)
    scale = x.new_empty((x.shape[axis],) if axis is not None else (), dtype=torch.float32)
    return q, scale


def quantize_int4(x: Tensor, axis: int | None = None, stochastic: bool = True,
                  seed: int = 0, group_rows: int = 0) -> tuple[Tensor, Tensor]:
    """Symmetric int4: values in [-7, 7] (int8 storage), scale ``amax / 7``.

    Per tensor (``axis=None``), per channel along ``axis``, or, with ``group_rows > 0``,
    per group of that many consecutive rows of ``x`` viewed [-1, last dim] (``scale`` then
    has one entry per row). Rounding as :func:`quantize_int8` (same seeds, same draws).
    Dequantize with :func:`dequantize_int8` (the same ``q * scale``; per-row scales along
    axis 0 of the 2-D view).
    """
    return torch.ops.qsync.quantize_int4(x, axis, int(group_rows), stochastic, int(seed))


def _rescale_impl(kernel: str, acc: Tensor, sx: Tensor, sw: Tensor, bias: Tensor | None,
                  dtype: torch.dtype, per_row: bool) -> Tensor:
    """``kernel`` (``rescale_int32`` or ``rescale_int32_rows``) on the C++ kernels, the CUDA
    kernels (``sx`` a float per tensor, a float tensor per row) or the reference."""
    if backends.use_cpp(acc):
        out = getattr(torch.ops.qsync_cpu, kernel)(acc, sx, sw, bias, dtype)
    elif acc.is_cuda and backends.cuda_kernels() is not None:
        cuda_sx = sx.float().contiguous() if per_row else float(sx)
        out = getattr(backends.cuda_kernels(), kernel)(
            acc.contiguous(), cuda_sx, sw.float().contiguous(),
            None if bias is None else bias.float().contiguous(), dtype)
    else:
        out = getattr(ref, kernel)(acc, sx, sw, bias, dtype)
    return owned(out, (acc, sx, sw, bias))


def _rescale_fake(acc: Tensor, sx: Tensor, sw: Tensor, bias: Tensor | None,
                  dtype: torch.dtype) -> Tensor:
    return acc.new_empty(acc.shape, dtype=dtype)


@torch.library.custom_op("qsync::rescale_int32", mutates_args=())
def rescale_int32_op(acc: Tensor, sx: Tensor, sw: Tensor, bias: Tensor | None,
                dtype: torch.dtype) -> Tensor:
    return _rescale_impl("rescale_int32", acc, sx, sw, bias, dtype, per_row=False)


rescale_int32_op.register_fake(_rescale_fake)


def rescale_int32(acc: Tensor, sx: Tensor, sw: Tensor, bias: Tensor | None = None,
                  dtype: torch.dtype = torch.float32) -> Tensor:
    """``acc * (sx * sw) + bias`` in ``dtype`` for an int32 GEMM result ``acc`` [M, N]."""
    return torch.ops.qsync.rescale_int32(acc, sx, sw, bias, dtype)


@torch.library.custom_op("qsync::rescale_int32_rows", mutates_args=())
def rescale_int32_rows_op(acc: Tensor, sx: Tensor, sw: Tensor, bias: Tensor | None,
                     dtype: torch.dtype) -> Tensor:
    return _rescale_impl("rescale_int32_rows", acc, sx, sw, bias, dtype, per_row=True)


rescale_int32_rows_op.register_fake(_rescale_fake)


def rescale_int32_rows(acc: Tensor, sx: Tensor, sw: Tensor, bias: Tensor | None = None,
                       dtype: torch.dtype = torch.float32) -> Tensor:
    """``acc * (sx[m] * sw[n]) + bias[n]`` in ``dtype``: one scale per row of ``acc``."""
    return torch.ops.qsync.rescale_int32_rows(acc, sx, sw, bias, dtype)


def rescale_rows(acc: Tensor, sx: Tensor, sw: Tensor, bias: Tensor | None,
                  dtype: torch.dtype) -> Tensor:
    """Rescale an int32 GEMM result: per-tensor ``sx`` through ``qsync::rescale_int32``,
    per-row ``sx`` [M] through ``qsync::rescale_int32_rows`` (``acc * (sx[m] * sw[n]) +
    bias[n]``)."""
    if sx.dim() == 0:
        return rescale_int32_op(acc, sx, sw, bias, dtype)
    return rescale_int32_rows_op(acc, sx, sw, bias, dtype)
