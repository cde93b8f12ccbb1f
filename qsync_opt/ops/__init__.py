"""Low-precision operators: the ``qsync`` torch.library namespace.

Everything that computes in low precision (the indicator's checks, the training runtime,
the profiler) calls these ops, defined here once each with its schema, a fake (meta) kernel
and, where it has a gradient, autograd:

==========================  ===============================================================
``qsync::quantize_int8``    symmetric int8, per tensor or per channel, stochastic rounding
                            (seeded, counter-based, unbiased) or round-to-nearest-even
``qsync::dequantize_int8``  int8 and scales back to a float dtype
``qsync::rescale_int32``    fused rescale + bias + cast of an int32 GEMM result
``qsync::int8_linear``      int8 x int8 -> int32 GEMM (``torch._int_mm``), fused rescale and
                            bias; backward in 16 bit, or int8 GEMMs with ``int8_backward``
``qsync::int8_conv2d``      the same for conv2d through an im2col integer GEMM
``qsync::quantize_int4``    symmetric int4 ([-7, 7] in int8 storage): per tensor, per channel
                            or per group of rows; the int8 kernels at scale amax/7, clamped
``qsync::int4_linear``      int4 x int4 -> int32 GEMM (the int8 GEMM on int4 values: exact,
                            no speed gain on this CPU), weights per channel, activations per
                            tensor or per row group; backward in 16 bit
``qsync::int4_conv2d``      the same for conv2d (activations per tensor)
``qsync::fake_quant_int8``  quantize-dequantize with a straight-through gradient
``qsync::fake_quant_float`` round to fp16 / bf16 / fp8 (e4m3, e5m2; scaled by the abs-max)
                            and back, straight-through gradient
==========================  ===============================================================

Implementations per device: the C++ CPU kernels (``torch.ops.qsync_cpu``, compiled on first
use, see ``_build``), the CUDA kernels of ``qsync_opt.cuda`` (C ABI, ctypes), and the Python
references of :mod:`qsync_opt.ops.reference`, which are both the fallback and the oracle the
tests hold the compiled kernels to, bit for bit. :func:`available` says which are active.

On this CPU the 16-bit backward of int8 ops runs in bf16 by default (fp16 GEMMs have no fast
kernel here), on CUDA in fp16 (the T4 has no bf16); ``bwd_dtype`` overrides it.

Every op's outputs own their memory (:func:`_owned`): no output is a view or shares memory
with an input or another output, so an in-place op may follow any of them. Every integer
GEMM goes through :func:`int_mm`, which hands ``torch._int_mm`` only operands with a valid
leading dimension (:func:`gemm_layout_ok`). Inside :func:`float_exact_gemm` (or with
``QSYNC_OPT_INT_GEMM=float``) a CPU's integer GEMM runs instead as fp32 GEMMs over pieces of
K of at most 1024, bit for bit the same int32 result: for accuracy runs on a CPU whose
``torch._int_mm`` is slow (no AVX512-VNNI / AMX-INT8), never for timing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.grad import conv2d_input, conv2d_weight
from torch.utils._python_dispatch import TorchDispatchMode

from . import reference as ref
from ._build import load_cpu

log = logging.getLogger(__name__)

__all__ = [
    "available", "quantize_int8", "dequantize_int8", "rescale_int32", "int8_linear",
    "int8_conv2d", "fake_quant_int8", "fake_quant_float", "int_mm", "gemm_layout_ok",
    "default_bwd_dtype", "emulated_half", "float_exact_gemm", "FLOAT_EXACT_MAX_K",
    "quantize_int4", "int4_linear", "int4_conv2d", "fake_quant_int4", "Numerics", "NUMERICS",
    "numerics", "GRAD_SCALES", "rescale_int32_rows",
]

FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
_FLOAT_FORMATS = {"fp16": torch.float16, "bf16": torch.bfloat16,
                  "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclasses.dataclass(frozen=True)
class Numerics:
    """Rounding and scale granularity per tensor role, the defaults every integer op takes
    when its caller passes none (the precision layers, the dispatcher and hfta pass none).

    Chosen by one-step gradient cosine against fp32 (``benchmarks/bench_grad_noise.py``,
    docs/BENCHMARKS.md): ``int8_forward_stochastic`` (int8 / int8_full activations and
    weights), ``int4_forward_stochastic`` (int4: round to nearest, see COSTS.md),
    ``grad_stochastic`` (what int8_full's backward quantizes: the output gradient and the
    weight re-quantized per input column) and ``grad_scale``, the output gradient's scales:
    ``"tensor"`` (one), ``"row"`` (one per row, i.e. per token / output position, for the
    input-gradient GEMM; one per tensor for the weight-gradient GEMM) or ``"rowcol"`` (per
    row for the input gradient, per output channel for the weight gradient). Each is exact
    in the integer GEMM: a row scale of ``go`` is a row scale of ``go @ W``, a column scale
    of ``go`` a row scale of ``go^T @ x``.
    """

    int8_forward_stochastic: bool = True
    int4_forward_stochastic: bool = False
    grad_stochastic: bool = True
    grad_scale: str = "rowcol"


GRAD_SCALES = ("tensor", "row", "rowcol")
NUMERICS = Numerics()


@contextlib.contextmanager
def numerics(**changes: Any) -> Iterator[Numerics]:
    """Within the block, :data:`NUMERICS` with ``changes`` (for measurements and tests)."""
    global NUMERICS
    before = NUMERICS
    NUMERICS = dataclasses.replace(before, **changes)
    if NUMERICS.grad_scale not in GRAD_SCALES:
        NUMERICS = before
        raise ValueError(f"grad_scale: expected one of {', '.join(GRAD_SCALES)}, got "
                         f"{changes.get('grad_scale')!r}")
    try:
        yield NUMERICS
    finally:
        NUMERICS = before


def _grad_scale_code(grad_scale: str | None) -> int:
    name = NUMERICS.grad_scale if grad_scale is None else grad_scale
    if name not in GRAD_SCALES:
        raise ValueError(f"grad_scale: expected one of {', '.join(GRAD_SCALES)}, got {name!r}")
    return GRAD_SCALES.index(name)


def _pick(value: bool | None, default: bool) -> bool:
    return default if value is None else bool(value)


# ----------------------------------------------------------------------------- backends


@lru_cache(maxsize=1)
def _cuda() -> Any:
    if not torch.cuda.is_available():
        return None
    try:
        from ..cuda.kernels import load

        return load()
    except Exception as exc:  # a missing or broken build: the references serve
        log.warning("qsync CUDA kernels unavailable (%s); using the Python references", exc)
        return None


def _use_cpp(t: Tensor) -> bool:
    return t.device.type == "cpu" and load_cpu()[0]


def available() -> dict[str, str]:
    """Which implementation serves each device, and why where it is a fallback."""
    cpp, why = load_cpu()
    out = {"cpu": f"C++ kernels ({why})" if cpp else f"Python references ({why})"}
    if not torch.cuda.is_available():
        out["cuda"] = "no CUDA device in this torch"
    else:
        kernels = _cuda()
        if kernels is not None:
            out["cuda"] = "CUDA kernels (qsync_opt.cuda, ctypes)"
        else:
            try:
                from ..cuda.kernels import load_error

                reason = load_error() or "not loaded"
            except Exception as exc:
                reason = str(exc)
            out["cuda"] = f"Python references ({reason})"
    out["int_mm"] = "torch._int_mm (int8 x int8 -> int32)"
    return out


def default_bwd_dtype(device: torch.device) -> torch.dtype:
    """16-bit dtype of int8 ops' backward: bf16 on this CPU, fp16 on CUDA."""
    return torch.float16 if device.type == "cuda" else torch.bfloat16


def _check_float(name: str, t: Tensor) -> None:
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name}: expected float32, float16 or bfloat16, got {t.dtype}")


# ----------------------------------------------------------------------------- aliasing


def _shares_memory(a: Tensor, b: Tensor) -> bool:
    if a.device != b.device:
        return False
    sa, sb = a.untyped_storage(), b.untyped_storage()
    return sa.nbytes() > 0 and sb.nbytes() > 0 and sa.data_ptr() == sb.data_ptr()


def _owned(outputs: Any, inputs: Sequence[Any]) -> Any:
    """The outputs of a custom op as tensors that own their memory: none is a view, none
    shares memory with an input or with another output.

    Every ``qsync::`` op returns through this. A view (``reshape`` of a GEMM result,
    ``permute().contiguous()``, which is a no-op on a 1x1 map, ``movedim`` over a size-1
    axis) would reach autograd as a view created inside a custom Function, and an in-place
    op on it (``ReLU(inplace=True)``) raises; an output aliasing an input (``x.to(x.dtype)``)
    breaks the op's schema. A view that spans its whole buffer is re-wrapped without a copy
    (nothing else holds that buffer); one aliasing an input or another output, or covering
    only part of its buffer, is copied.
    """
    single = isinstance(outputs, Tensor)
    outs = [outputs] if single else list(outputs)
    seen = [t for t in inputs if isinstance(t, Tensor)]
    for i, t in enumerate(outs):
        if not isinstance(t, Tensor):
            continue
        if any(_shares_memory(t, o) for o in seen):
            t = t.clone(memory_format=torch.contiguous_format)
        elif t._is_view():
            storage = t.untyped_storage()
            if t.storage_offset() == 0 and storage.nbytes() == t.numel() * t.element_size() \
                    and t.is_contiguous():
                t = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                    storage, 0, t.shape, torch.empty(t.shape, device="meta").stride())
            else:
                t = t.clone(memory_format=torch.contiguous_format)
        outs[i] = t
        seen.append(t)
    return outs[0] if single else tuple(outs)


# ----------------------------------------------------------------------------- quantize


def _quantize_kernel(moved: Tensor, inv: Tensor, stochastic: bool, seed: int,
                     qmax: int) -> Tensor:
    """The quantization kernel on contiguous ``moved`` ([C, inner], ``inv`` per channel).

    The compiled kernels clamp to int8's [-127, 127]; int4 (``qmax`` 7) is the same kernel
    at scale amax/7, clamped once more to [-7, 7] (a value at amax can round to 7 + 1 ulp,
    which stochastic rounding could carry to 8): the reference's formula exactly."""
    if _use_cpp(moved):
        q = torch.ops.qsync_cpu.quantize_int8(moved, inv, stochastic, seed)
    elif moved.is_cuda and _cuda() is not None:
        inner = moved.numel() // inv.numel()
        if qmax == ref.INT4_QMAX:  # the CUDA int4 kernel clamps at 7 itself
            return _cuda().quantize_int4(moved, inv, inner, stochastic, seed)
        q = _cuda().quantize_int8(moved, inv, inner, stochastic, seed)
    else:
        return ref.quantize_levels(moved, inv, stochastic, seed, qmax)
    return q if qmax == ref.INT8_QMAX else q.clamp_(-qmax, qmax)


def _quantize_impl(x: Tensor, axis: int | None, stochastic: bool, seed: int,
                   qmax: int = ref.INT8_QMAX) -> tuple[Tensor, Tensor]:
    _check_float("x", x)
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
    return _owned(_quantize_impl(x, axis, stochastic, seed), (x,))


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


def _dequantize_impl(q: Tensor, scale: Tensor, axis: int | None, dtype: torch.dtype) -> Tensor:
    moved = (q if axis is None else q.movedim(axis, 0)).contiguous()
    s = scale.to(torch.float32).reshape(-1).contiguous()
    if _use_cpp(moved):
        out = torch.ops.qsync_cpu.dequantize_int8(moved, s, dtype)
    elif moved.is_cuda and _cuda() is not None:
        out = _cuda().dequantize_int8(moved, s, moved.numel() // s.numel(), dtype)
    else:
        out = ref.dequantize_int8(moved, s, dtype)
    return out if axis is None else out.movedim(0, axis).contiguous()


@torch.library.custom_op("qsync::dequantize_int8", mutates_args=())
def _dequantize_op(q: Tensor, scale: Tensor, axis: int | None, dtype: torch.dtype) -> Tensor:
    return _owned(_dequantize_impl(q, scale, axis, dtype), (q, scale))


@_dequantize_op.register_fake
def _(q: Tensor, scale: Tensor, axis: int | None, dtype: torch.dtype) -> Tensor:
    return torch.empty_like(q, dtype=dtype, memory_format=torch.contiguous_format)


def dequantize_int8(q: Tensor, scale: Tensor, axis: int | None = None,
                    dtype: torch.dtype = torch.float32) -> Tensor:
    """``q * scale`` (per channel along ``axis``) in ``dtype``."""
    return torch.ops.qsync.dequantize_int8(q, scale, axis, dtype)


def _quantize_rows_impl(x2d: Tensor, group_rows: int, stochastic: bool, seed: int,
                        qmax: int) -> tuple[Tensor, Tensor]:
    """2-D ``x2d`` quantized with one scale per group of ``group_rows`` consecutive rows
    (``scale`` has one entry per row). The element order is the per-tensor one, so the
    stochastic-rounding draws are those of a per-tensor quantization of the same tensor."""
    _check_float("x", x2d)
    moved = x2d.contiguous()
    amax = ref.group_amax(moved, group_rows)
    inv = float(qmax) / amax
    return _quantize_kernel(moved, inv, stochastic, seed, qmax), ref.scale_of(amax, qmax)


@torch.library.custom_op("qsync::quantize_int4", mutates_args=())
def _quantize_int4_op(x: Tensor, axis: int | None, group_rows: int, stochastic: bool,
                      seed: int) -> tuple[Tensor, Tensor]:
    if group_rows > 0:
        k = x.shape[-1] if x.dim() else 1
        q, scale = _quantize_rows_impl(x.reshape(-1, k), group_rows, stochastic, seed,
                                       ref.INT4_QMAX)
        return _owned((q.reshape(x.shape), scale), (x,))
    return _owned(_quantize_impl(x, axis, stochastic, seed, ref.INT4_QMAX), (x,))


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


@torch.library.custom_op("qsync::rescale_int32", mutates_args=())
def _rescale_op(acc: Tensor, sx: Tensor, sw: Tensor, bias: Tensor | None,
                dtype: torch.dtype) -> Tensor:
    if _use_cpp(acc):
        out = torch.ops.qsync_cpu.rescale_int32(acc, sx, sw, bias, dtype)
    elif acc.is_cuda and _cuda() is not None:
        out = _cuda().rescale_int32(acc.contiguous(), float(sx), sw.float().contiguous(),
                                    None if bias is None else bias.float().contiguous(), dtype)
    else:
        out = ref.rescale_int32(acc, sx, sw, bias, dtype)
    return _owned(out, (acc, sx, sw, bias))


@_rescale_op.register_fake
def _(acc: Tensor, sx: Tensor, sw: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
    return acc.new_empty(acc.shape, dtype=dtype)


def rescale_int32(acc: Tensor, sx: Tensor, sw: Tensor, bias: Tensor | None = None,
                  dtype: torch.dtype = torch.float32) -> Tensor:
    """``acc * (sx * sw) + bias`` in ``dtype`` for an int32 GEMM result ``acc`` [M, N]."""
    return torch.ops.qsync.rescale_int32(acc, sx, sw, bias, dtype)


@torch.library.custom_op("qsync::rescale_int32_rows", mutates_args=())
def _rescale_rows_op(acc: Tensor, sx: Tensor, sw: Tensor, bias: Tensor | None,
                     dtype: torch.dtype) -> Tensor:
    if _use_cpp(acc):
        out = torch.ops.qsync_cpu.rescale_int32_rows(acc, sx, sw, bias, dtype)
    elif acc.is_cuda and _cuda() is not None:
        out = _cuda().rescale_int32_rows(acc.contiguous(), sx.float().contiguous(),
                                         sw.float().contiguous(),
                                         None if bias is None else bias.float().contiguous(),
                                         dtype)
    else:
        out = ref.rescale_int32_rows(acc, sx, sw, bias, dtype)
    return _owned(out, (acc, sx, sw, bias))


@_rescale_rows_op.register_fake
def _(acc: Tensor, sx: Tensor, sw: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
    return acc.new_empty(acc.shape, dtype=dtype)


def rescale_int32_rows(acc: Tensor, sx: Tensor, sw: Tensor, bias: Tensor | None = None,
                       dtype: torch.dtype = torch.float32) -> Tensor:
    """``acc * (sx[m] * sw[n]) + bias[n]`` in ``dtype``: one scale per row of ``acc``."""
    return torch.ops.qsync.rescale_int32_rows(acc, sx, sw, bias, dtype)


# ----------------------------------------------------------------------------- integer GEMM


def gemm_layout_ok(t: Tensor, row_major_only: bool = False) -> bool:
    """Whether a 2-D GEMM operand's strides give a valid leading dimension.

    ``torch._int_mm`` on a CPU with AVX512-VNNI hands its operands to oneDNN's s8 GEMM as
    row-major when ``stride(1) == 1`` (leading dimension ``stride(0)``) and transposed
    otherwise (leading dimension ``stride(1)``), without checking that leading dimension.
    A tensor with a size-1 dimension can be "contiguous" with any stride on that dimension
    (``[1, K]`` with strides ``(1, 1)``: a transposed column, or ``movedim`` over a size-1
    axis; ``[M, 1]`` with strides ``(1, L)`` from an unfold): its leading dimension is then
    smaller than its row and the GEMM misreads it. Valid: row-major with
    ``stride(0) >= max(1, cols)``, or transposed with ``stride(0) == 1`` and
    ``stride(1) >= max(1, rows)``.
    """
    rows, cols = t.shape
    s0, s1 = t.stride()
    if s1 == 1:
        return s0 >= max(1, cols)
    return not row_major_only and s0 == 1 and s1 >= max(1, rows)


def _gemm_operand(t: Tensor, row_major_only: bool = False) -> Tensor:
    if gemm_layout_ok(t, row_major_only):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)  # strides (cols, 1)


#: K up to which an int8 GEMM is exact in fp32: every partial sum is an integer of size at
#: most K * 128 * 128 <= 2**24, which fp32 holds exactly, whatever the order of the adds.
FLOAT_EXACT_MAX_K = 2**24 // (128 * 128)

_float_gemm = os.environ.get("QSYNC_OPT_INT_GEMM", "").strip().lower() == "float"


@contextlib.contextmanager
def float_exact_gemm(enabled: bool = True) -> Iterator[None]:
    """Within the block, a CPU :func:`int_mm` runs as fp32 GEMMs of the integer values over
    pieces of K of at most :data:`FLOAT_EXACT_MAX_K`, each back to int32 and summed in
    int32: bit for bit the integer GEMM's result (every partial sum of a piece is an integer
    of size at most 2**24), at the fp32 GEMM's speed. For
    accuracy measurements on a CPU without AVX512-VNNI / AMX-INT8, where ``torch._int_mm``
    is many times slower than fp32; never for timing (the integer GEMM is what runs on a
    card). ``QSYNC_OPT_INT_GEMM=float`` turns it on for a whole process."""
    global _float_gemm
    before = _float_gemm
    _float_gemm = enabled
    try:
        yield
    finally:
        _float_gemm = before


_half_emulated = os.environ.get("QSYNC_OPT_HALF", "").strip().lower() == "emulate"

_aten = torch.ops.aten
#: The aten GEMMs :func:`emulated_half` runs in fp32 when an operand is 16-bit on a CPU.
_HALF_GEMMS = frozenset((_aten.mm.default, _aten.addmm.default, _aten.bmm.default,
                         _aten.baddbmm.default, _aten.convolution.default,
                         _aten.convolution_backward.default))


def _mm16(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` of two 16-bit tensors, in 16 bit (in fp32, rounded, under
    :func:`emulated_half` on a CPU)."""
    if _half_emulated and not a.is_cuda:
        return (a.float() @ b.float()).to(a.dtype)
    return a @ b


class _HalfAsFloat(TorchDispatchMode):
    """Runs each CPU aten GEMM / convolution with a 16-bit operand in fp32 on the 16-bit
    values, its results rounded back to that 16-bit dtype."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _HALF_GEMMS:
            flat = [t for t in (*args, *kwargs.values()) if isinstance(t, Tensor)]
            half = next((t.dtype for t in flat if t.dtype in (torch.float16, torch.bfloat16)
                         and not t.is_cuda), None)
            if half is not None:
                def up(t: Any) -> Any:
                    return t.float() if isinstance(t, Tensor) and t.dtype == half else t

                out = func(*(up(a) for a in args), **{k: up(v) for k, v in kwargs.items()})
                if isinstance(out, Tensor):
                    return out.to(half)
                return type(out)(o.to(half) if isinstance(o, Tensor) else o for o in out)
        return func(*args, **kwargs)


@contextlib.contextmanager
def emulated_half(enabled: bool = True) -> Iterator[None]:
    """Within the block, every CPU GEMM and convolution with 16-bit (fp16 / bf16) operands,
    forward and backward, the precision layers' and the integer ops' 16-bit backward alike,
    runs in fp32 on the 16-bit values and rounds its results to 16 bit: the operands and
    results a 16-bit GEMM with fp32 accumulation has, differing from it only in the order of
    the fp32 adds (not bit for bit). For accuracy runs on a CPU with no fast fp16 / bf16
    kernels, where a real 16-bit GEMM is many times slower than fp32; never for timing.
    ``QSYNC_OPT_HALF=emulate`` turns the ops' part on for a whole process."""
    global _half_emulated
    before = _half_emulated
    _half_emulated = enabled
    try:
        if enabled:
            with _HalfAsFloat():
                yield
        else:
            yield
    finally:
        _half_emulated = before


def int_mm(a: Tensor, b: Tensor) -> Tensor:
    """int8 [M, K] @ int8 [K, N] -> int32 with ``torch._int_mm`` (or, inside
    :func:`float_exact_gemm` on a CPU, the bit-identical fp32 GEMM where K allows).

    ``a`` goes in row-major, ``b`` row-major or transposed, each with a valid leading
    dimension (:func:`gemm_layout_ok`; a copy where not). cuBLASLt wants M > 16 and K, N
    multiples of 8: on CUDA the operands are zero-padded to that and the result cropped
    (zeros add nothing to an integer sum).
    """
    if a.is_cuda:
        m, k = a.shape
        n = b.shape[1]
        pm, pk, pn = max(17, m), -(-k // 8) * 8, -(-n // 8) * 8
        if (pm, pk, pn) != (m, k, n):
            a = F.pad(a, (0, pk - k, 0, pm - m))
            b = F.pad(b, (0, pn - n, 0, pk - k))
            return torch._int_mm(_gemm_operand(a, True), _gemm_operand(b, True))[:m, :n]
    if _float_gemm and not a.is_cuda:
        k, step = a.shape[1], FLOAT_EXACT_MAX_K
        af, bf = a.float(), b.float()
        acc = torch.mm(af[:, :step], bf[:step]).to(torch.int32)
        for i in range(step, k, step):  # K in pieces of at most 1024, summed in int32
            acc += torch.mm(af[:, i:i + step], bf[i:i + step]).to(torch.int32)
        return acc
    return torch._int_mm(_gemm_operand(a, True), _gemm_operand(b))


def _seeds(seed: int) -> tuple[int, int, int, int]:
    """Distinct stochastic-rounding streams: input, weight, output gradient, weight again
    (the output gradient's per-column copy takes ``seed + 4 * 0x9E37``)."""
    s = int(seed)
    return s, s + 0x9E37, s + 2 * 0x9E37, s + 3 * 0x9E37


def _quantize_grad(go: Tensor, grad_scale: int, stochastic: bool, seed: int
                   ) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """int8_full's output gradient ``go`` [M, N], quantized for the two backward GEMMs:
    ``((q, s) for grad_x = go @ W, (q, s) for grad_w = go^T @ x)``. ``grad_scale`` indexes
    :data:`GRAD_SCALES`: 0 one scale for both; 1 one per row (token) for grad_x, one per
    tensor for grad_w; 2 per row for grad_x, per column (output channel) for grad_w. Every
    scale factors out of its integer GEMM: row scales of ``go`` are row scales of grad_x,
    column scales of ``go`` row scales of grad_w."""
    if grad_scale == 0:
        one = _quantize_impl(go, None, stochastic, seed)
        return one, one
    rows = _quantize_impl(go, 0, stochastic, seed)
    if grad_scale == 1:
        return rows, _quantize_impl(go, None, stochastic, seed + 4 * 0x9E37)
    return rows, _quantize_impl(go, 1, stochastic, seed + 4 * 0x9E37)


def _grad_w_rescale(acc: Tensor, sg: Tensor, sx: Tensor, dtype: torch.dtype) -> Tensor:
    """grad_w [N, K] from ``acc = qgo^T @ qx``: ``sg`` one scale or one per row (N)."""
    ones = torch.ones(acc.shape[1], dtype=torch.float32, device=acc.device)
    return _rescale_rows(acc, sg * sx, ones, None, dtype)


# ----------------------------------------------------------------------------- int8 linear


def _int_linear_fake(x: Tensor, weight: Tensor, per_row: bool
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
    _check_float("x", x)
    k = x.shape[-1]
    x_seed, w_seed, _, _ = _seeds(seed)
    qx, sx = _quantize_impl(x.reshape(-1, k), None, stochastic, x_seed)
    qw, sw = _quantize_impl(weight, 0, stochastic, w_seed)
    acc = int_mm(qx, qw.t())
    out = _rescale_op(acc, sx, sw, bias, x.dtype)
    return _owned((out.reshape(*x.shape[:-1], weight.shape[0]), qx, sx, qw, sw),
                  (x, weight, bias))


@_int8_linear_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, int8_backward: bool, stochastic: bool,
      seed: int, bwd_dtype: torch.dtype, grad_stochastic: bool, grad_scale: int
      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _int_linear_fake(x, weight, per_row=False)


@torch.library.custom_op("qsync::int8_linear_backward", mutates_args=())
def _int8_linear_backward_op(grad: Tensor, qx: Tensor, sx: Tensor, qw: Tensor, sw: Tensor,
                             int8_backward: bool, stochastic: bool, seed: int,
                             bwd_dtype: torch.dtype, x_dtype: torch.dtype,
                             w_dtype: torch.dtype, grad_scale: int) -> tuple[Tensor, Tensor]:
    """``stochastic`` here is the backward's rounding (``grad_stochastic``)."""
    n = qw.shape[0]
    go = grad.reshape(-1, n)
    _, _, g_seed, w2_seed = _seeds(seed)
    if int8_backward:
        (qgr, sgr), (qgc, sgc) = _quantize_grad(go, grad_scale, stochastic, g_seed)
        # grad_x = go @ W needs W's scale on its output (K) axis: requantize W per input
        # column. grad_w = go^T @ x: x per tensor, go's column (or one) scale per row of it.
        w_deq = _dequantize_impl(qw, sw, 0, torch.float32)
        qwc, swc = _quantize_impl(w_deq, 1, stochastic, w2_seed)
        grad_x = _rescale_rows(int_mm(qgr, qwc), sgr, swc, None, x_dtype)
        grad_w = _grad_w_rescale(int_mm(qgc.t(), qx), sgc, sx, w_dtype)
    else:
        g16 = go.to(bwd_dtype)
        w16 = _dequantize_impl(qw, sw, 0, bwd_dtype)
        x16 = _dequantize_impl(qx, sx, None, bwd_dtype)
        grad_x = _mm16(g16, w16).to(x_dtype)
        grad_w = _mm16(g16.t(), x16).to(w_dtype)
    return _owned((grad_x, grad_w), (grad, qx, sx, qw, sw))


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
        x, weight, bias, int8_backward, _pick(stochastic, NUMERICS.int8_forward_stochastic),
        int(seed), dtype, _pick(grad_stochastic, NUMERICS.grad_stochastic),
        _grad_scale_code(grad_scale))[0]


# ----------------------------------------------------------------------------- int8 conv2d


def _im2col_int8(q: Tensor, kernel: Sequence[int], stride: Sequence[int],
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


def _int_conv2d_forward(x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int],
                        padding: list[int], dilation: list[int], groups: int,
                        stochastic: bool, seed: int, qmax: int
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The integer conv2d forward of int8_conv2d and int4_conv2d: activations quantized per
    tensor, weights per output channel, symmetric levels up to ``qmax`` (int8's or int4's), the
    im2col integer GEMM per group, rescaled; returns (out, qx, sx, qw, sw)."""
    _check_float("x", x)
    x_seed, w_seed, _, _ = _seeds(seed)
    qx, sx = _quantize_impl(x, None, stochastic, x_seed, qmax)
    qw, sw = _quantize_impl(weight, 0, stochastic, w_seed, qmax)
    b = x.shape[0]
    cout = weight.shape[0]
    cin_g, cout_g = x.shape[1] // groups, cout // groups
    outs = []
    for g in range(groups):
        cols, ho, wo = _im2col_int8(qx[:, g * cin_g:(g + 1) * cin_g], weight.shape[2:],
                                    stride, padding, dilation)
        wg = qw[g * cout_g:(g + 1) * cout_g].reshape(cout_g, -1)
        bias_g = None if bias is None else bias[g * cout_g:(g + 1) * cout_g]
        outs.append(_rescale_op(int_mm(cols, wg.t()), sx, sw[g * cout_g:(g + 1) * cout_g],
                                bias_g, x.dtype))
    out = torch.cat(outs, dim=1) if groups > 1 else outs[0]
    out = out.reshape(b, ho, wo, cout).permute(0, 3, 1, 2).contiguous()
    return _owned((out, qx, sx, qw, sw), (x, weight, bias))


def _int_conv2d_fake(x: Tensor, weight: Tensor, stride: list[int], padding: list[int],
                     dilation: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The shapes and dtypes :func:`_int_conv2d_forward` returns (the ops' fakes)."""
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
    return _int_conv2d_forward(x, weight, bias, stride, padding, dilation, groups,
                               stochastic, seed, ref.INT8_QMAX)


@_int8_conv2d_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int], padding: list[int],
      dilation: list[int], groups: int, int8_backward: bool, stochastic: bool, seed: int,
      bwd_dtype: torch.dtype, grad_stochastic: bool, grad_scale: int
      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _int_conv2d_fake(x, weight, stride, padding, dilation)


@torch.library.custom_op("qsync::int8_conv2d_backward", mutates_args=())
def _int8_conv2d_backward_op(grad: Tensor, qx: Tensor, sx: Tensor, qw: Tensor, sw: Tensor,
                             stride: list[int], padding: list[int], dilation: list[int],
                             groups: int, int8_backward: bool, stochastic: bool, seed: int,
                             bwd_dtype: torch.dtype, x_dtype: torch.dtype,
                             w_dtype: torch.dtype, grad_scale: int) -> tuple[Tensor, Tensor]:
    """``stochastic`` here is the backward's rounding (``grad_stochastic``)."""
    if not int8_backward:
        g16 = grad.to(bwd_dtype)
        w16 = _dequantize_impl(qw, sw, 0, bwd_dtype)
        x16 = _dequantize_impl(qx, sx, None, bwd_dtype)
        if _half_emulated and not grad.is_cuda:  # fp32 arithmetic, 16-bit results
            w16, g16, x16 = w16.float(), g16.float(), x16.float()
        grad_x = conv2d_input(list(qx.shape), w16, g16, stride, padding,
                              dilation, groups).to(bwd_dtype)
        grad_w = conv2d_weight(x16, list(qw.shape), g16, stride, padding,
                               dilation, groups).to(bwd_dtype)
        return _owned((grad_x.to(x_dtype), grad_w.to(w_dtype)), (grad, qx, sx, qw, sw))
    _, _, g_seed, w2_seed = _seeds(seed)
    b, cin, h, w = qx.shape
    cout, cin_g, kh, kw = qw.shape
    cout_g = cout // groups
    if grad_scale == 0:  # one scale: quantized in the NCHW layout, then moved
        qgo, sgo = _quantize_impl(grad.contiguous(), None, stochastic, g_seed)
        go_r = go_c = qgo.permute(0, 2, 3, 1).reshape(-1, cout)  # [B*L, Cout]
        sgr = sgc = sgo
    else:  # per output position (row) for grad_x; per channel or one for grad_w
        go_f = grad.permute(0, 2, 3, 1).reshape(-1, cout).contiguous()
        (go_r, sgr), (go_c, sgc) = _quantize_grad(go_f, grad_scale, stochastic, g_seed)
    w_deq = _dequantize_impl(qw, sw, 0, torch.float32).reshape(cout, -1)
    grad_ws, grad_cols = [], []
    for g in range(groups):
        cols, ho, wo = _im2col_int8(qx[:, g * cin_g:(g + 1) * cin_g], (kh, kw), stride, padding,
                                    dilation)
        sl = slice(g * cout_g, (g + 1) * cout_g)
        go_g = go_r[:, sl].contiguous()
        sgc_g = sgc if sgc.dim() == 0 else sgc[sl]
        grad_ws.append(_grad_w_rescale(int_mm(go_c[:, sl].contiguous().t(), cols), sgc_g, sx,
                                       w_dtype))
        qwc, swc = _quantize_impl(w_deq[sl].contiguous(), 1, stochastic, w2_seed + g)
        gc = _rescale_rows(int_mm(go_g, qwc), sgr, swc, None, torch.float32)  # [B*L, cin_g*k]
        gc = gc.reshape(b, ho * wo, -1).transpose(1, 2)
        grad_cols.append(F.fold(gc, (h, w), (kh, kw), dilation=tuple(dilation),
                                padding=tuple(padding), stride=tuple(stride)))
    grad_w = torch.cat(grad_ws, 0).reshape(qw.shape)
    grad_x = torch.cat(grad_cols, 1) if groups > 1 else grad_cols[0]
    return _owned((grad_x.to(x_dtype), grad_w), (grad, qx, sx, qw, sw))


@_int8_conv2d_backward_op.register_fake
def _(grad: Tensor, qx: Tensor, sx: Tensor, qw: Tensor, sw: Tensor, stride: list[int],
      padding: list[int], dilation: list[int], groups: int, int8_backward: bool,
      stochastic: bool, seed: int, bwd_dtype: torch.dtype, x_dtype: torch.dtype,
      w_dtype: torch.dtype, grad_scale: int) -> tuple[Tensor, Tensor]:
    return (grad.new_empty(qx.shape, dtype=x_dtype), grad.new_empty(qw.shape, dtype=w_dtype))


def _save_conv(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...],
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
    _save_conv(ctx, inputs, output, (stride, padding, dilation, groups, int8_backward,
                                     grad_stochastic, seed, bwd_dtype, grad_scale))


def _conv_backward(ctx: Any, grad: Tensor, *_: Any) -> tuple[Any, ...]:
    """int8_conv2d's backward (int8 or 16-bit by its ``int8_backward``), and int4_conv2d's
    (16-bit on the saved int4 values)."""
    qx, sx, qw, sw = ctx.saved_tensors
    *args, grad_scale = ctx.args
    grad_x, grad_w = torch.ops.qsync.int8_conv2d_backward(
        grad.contiguous(), qx, sx, qw, sw, *args, ctx.x_dtype, ctx.w_dtype, grad_scale)
    grad_b = grad.sum((0, 2, 3)).to(torch.float32) if ctx.has_bias else None
    return (grad_x, grad_w, grad_b) + (None,) * (ctx.n_inputs - 3)


_int8_conv2d_op.register_autograd(_conv_backward, setup_context=_conv_setup)


def _pair(v: int | Sequence[int]) -> list[int]:
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
        x, weight, bias, _pair(stride), _pair(padding), _pair(dilation), int(groups),
        int8_backward, _pick(stochastic, NUMERICS.int8_forward_stochastic), int(seed), dtype,
        _pick(grad_stochastic, NUMERICS.grad_stochastic), _grad_scale_code(grad_scale))[0]


# ----------------------------------------------------------------------------- int4


def _rescale_rows(acc: Tensor, sx: Tensor, sw: Tensor, bias: Tensor | None,
                  dtype: torch.dtype) -> Tensor:
    """Rescale an int32 GEMM result: per-tensor ``sx`` through ``qsync::rescale_int32``,
    per-row ``sx`` [M] through ``qsync::rescale_int32_rows`` (``acc * (sx[m] * sw[n]) +
    bias[n]``)."""
    if sx.dim() == 0:
        return _rescale_op(acc, sx, sw, bias, dtype)
    return _rescale_rows_op(acc, sx, sw, bias, dtype)


@torch.library.custom_op("qsync::int4_linear", mutates_args=())
def _int4_linear_op(x: Tensor, weight: Tensor, bias: Tensor | None, group_rows: int,
                    stochastic: bool, seed: int, bwd_dtype: torch.dtype
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check_float("x", x)
    k = x.shape[-1]
    x_seed, w_seed, _, _ = _seeds(seed)
    x2 = x.reshape(-1, k)
    if group_rows > 0:
        qx, sx = _quantize_rows_impl(x2, group_rows, stochastic, x_seed, ref.INT4_QMAX)
    else:
        qx, sx = _quantize_impl(x2, None, stochastic, x_seed, ref.INT4_QMAX)
    qw, sw = _quantize_impl(weight, 0, stochastic, w_seed, ref.INT4_QMAX)
    acc = int_mm(qx, qw.t())  # int4 values, int32 accumulation
    out = _rescale_rows(acc, sx, sw, bias, x.dtype)
    return _owned((out.reshape(*x.shape[:-1], weight.shape[0]), qx, sx, qw, sw),
                  (x, weight, bias))


@_int4_linear_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, group_rows: int, stochastic: bool,
      seed: int, bwd_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _int_linear_fake(x, weight, per_row=group_rows > 0)


@torch.library.custom_op("qsync::int4_linear_backward", mutates_args=())
def _int4_linear_backward_op(grad: Tensor, qx: Tensor, sx: Tensor, qw: Tensor, sw: Tensor,
                             bwd_dtype: torch.dtype, x_dtype: torch.dtype,
                             w_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """16-bit backward GEMMs on the saved int4 operands (dequantized to ``bwd_dtype``)."""
    go = grad.reshape(-1, qw.shape[0])
    g16 = go.to(bwd_dtype)
    w16 = _dequantize_impl(qw, sw, 0, bwd_dtype)
    x16 = _dequantize_impl(qx, sx, None if sx.dim() == 0 else 0, bwd_dtype)
    grad_x = _mm16(g16, w16).to(x_dtype)
    grad_w = _mm16(g16.t(), x16).to(w_dtype)
    return _owned((grad_x, grad_w), (grad, qx, sx, qw, sw))


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
                                       _pick(stochastic, NUMERICS.int4_forward_stochastic),
                                       int(seed), dtype)[0]


@torch.library.custom_op("qsync::int4_conv2d", mutates_args=())
def _int4_conv2d_op(x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int],
                    padding: list[int], dilation: list[int], groups: int,
                    stochastic: bool, seed: int, bwd_dtype: torch.dtype
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _int_conv2d_forward(x, weight, bias, stride, padding, dilation, groups,
                               stochastic, seed, ref.INT4_QMAX)


@_int4_conv2d_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int], padding: list[int],
      dilation: list[int], groups: int, stochastic: bool, seed: int,
      bwd_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _int_conv2d_fake(x, weight, stride, padding, dilation)


def _int4_conv_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    (_, _, _, stride, padding, dilation, groups, stochastic, seed, bwd_dtype) = inputs
    # the 16-bit backward of int8_conv2d on the saved int4 values (int8_backward=False)
    _save_conv(ctx, inputs, output,
               (stride, padding, dilation, groups, False, stochastic, seed, bwd_dtype, 0))


_int4_conv2d_op.register_autograd(_conv_backward, setup_context=_int4_conv_setup)


def int4_conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                stride: int | Sequence[int] = 1, padding: int | Sequence[int] = 0,
                dilation: int | Sequence[int] = 1, groups: int = 1, *,
                stochastic: bool | None = None, seed: int = 0,
                bwd_dtype: torch.dtype | None = None) -> Tensor:
    """conv2d with int4 operands (activations per tensor, weights per output channel) and
    the im2col integer GEMM of :func:`int8_conv2d`, rounding as :func:`int4_linear`; 16-bit
    backward."""
    dtype = bwd_dtype or default_bwd_dtype(x.device)
    return torch.ops.qsync.int4_conv2d(x, weight, bias, _pair(stride), _pair(padding),
                                       _pair(dilation), int(groups),
                                       _pick(stochastic, NUMERICS.int4_forward_stochastic),
                                       int(seed), dtype)[0]


# ----------------------------------------------------------------------------- fake quant


@torch.library.custom_op("qsync::fake_quant_int8", mutates_args=())
def _fake_int8_op(x: Tensor, axis: int | None, stochastic: bool, seed: int) -> Tensor:
    q, scale = _quantize_impl(x, axis, stochastic, seed)
    return _owned(_dequantize_impl(q, scale, axis, x.dtype), (x,))


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
        x, axis, _pick(stochastic, NUMERICS.int8_forward_stochastic), int(seed))


@torch.library.custom_op("qsync::fake_quant_int4", mutates_args=())
def _fake_int4_op(x: Tensor, axis: int | None, stochastic: bool, seed: int) -> Tensor:
    q, scale = _quantize_impl(x, axis, stochastic, seed, ref.INT4_QMAX)
    return _owned(_dequantize_impl(q, scale, axis, x.dtype), (x,))


@_fake_int4_op.register_fake
def _(x: Tensor, axis: int | None, stochastic: bool, seed: int) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_fake_int4_op.register_autograd(_straight_through, setup_context=_st_setup(3))


def fake_quant_int4(x: Tensor, axis: int | None = None, stochastic: bool | None = None,
                    seed: int = 0) -> Tensor:
    """Quantize to int4 ([-7, 7]) and back, in ``x.dtype`` (rounding as :func:`int4_linear`);
    gradient passes through."""
    return torch.ops.qsync.fake_quant_int4(
        x, axis, _pick(stochastic, NUMERICS.int4_forward_stochastic), int(seed))


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
        return _owned((y.to(torch.float32) / scale).to(x.dtype), (x,))
    return _owned(x.to(target).to(x.dtype), (x,))  # x itself when x is already in fmt


@_fake_float_op.register_fake
def _(x: Tensor, fmt: str) -> Tensor:
    return torch.empty_like(x)


_fake_float_op.register_autograd(_straight_through, setup_context=_st_setup(1))


def fake_quant_float(x: Tensor, fmt: str) -> Tensor:
    """Round ``x`` to ``fmt`` (fp16, bf16, fp8_e4m3, fp8_e5m2) and back; gradient passes
    through. FP8 is scaled per tensor so the abs-max lands on the format's largest value."""
    return torch.ops.qsync.fake_quant_float(x, fmt)
