"""The integer GEMM every op runs (:func:`int_mm`), its operand layouts, and the two
accuracy-run switches: :func:`float_exact_gemm` (the integer GEMM as exact fp32 pieces) and
:func:`emulated_half` (16-bit GEMMs in fp32 on a CPU)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FLOAT_EXACT_MAX_K", "emulated_half", "float_exact_gemm", "gemm_layout_ok", "int_mm",
           "is_half_emulated", "mm16"]


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


def is_half_emulated() -> bool:
    """Whether :func:`emulated_half` (or ``QSYNC_OPT_HALF=emulate``) is on."""
    return _half_emulated


def mm16(a: Tensor, b: Tensor) -> Tensor:
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
