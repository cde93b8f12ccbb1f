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

The ops live in modules by family, and this package re-exports them: ``rounding`` (the
rounding and scale defaults, :data:`NUMERICS`), ``backends`` (which implementation serves a
device, output ownership), ``quantize`` (quantize, dequantize, rescale), ``intmm`` (the
integer GEMM and the accuracy-run switches), ``int8`` (int8 linear and conv2d), ``int4``
(int4 linear and conv2d) and ``fakequant`` (quantize-and-back, straight-through).

On this CPU the 16-bit backward of int8 ops runs in bf16 by default (fp16 GEMMs have no fast
kernel here), on CUDA in fp16 (the T4 has no bf16); ``bwd_dtype`` overrides it.

Every op's outputs own their memory (:func:`~.backends.owned`): no output is a view or shares memory
with an input or another output, so an in-place op may follow any of them. Every integer
GEMM goes through :func:`int_mm`, which hands ``torch._int_mm`` only operands with a valid
leading dimension (:func:`gemm_layout_ok`). Inside :func:`float_exact_gemm` (or with
``QSYNC_OPT_INT_GEMM=float``) a CPU's integer GEMM runs instead as fp32 GEMMs over pieces of
K of at most 1024, bit for bit the same int32 result: for accuracy runs on a CPU whose
``torch._int_mm`` is slow (no AVX512-VNNI / AMX-INT8), never for timing.
"""

from __future__ import annotations

from typing import Any

from qsync_opt.ops import backends, fakequant, int4, int8, intmm, quantize, rounding
from qsync_opt.ops.backends import available, default_bwd_dtype, load_cpu
from qsync_opt.ops.fakequant import FP8_MAX, fake_quant_float, fake_quant_int4, fake_quant_int8
from qsync_opt.ops.int4 import int4_conv2d, int4_linear
from qsync_opt.ops.int8 import int8_conv2d, int8_linear
from qsync_opt.ops.intmm import (
    FLOAT_EXACT_MAX_K,
    emulated_half,
    float_exact_gemm,
    gemm_layout_ok,
    int_mm,
)
from qsync_opt.ops.quantize import (
    dequantize_int8,
    quantize_int4,
    quantize_int8,
    rescale_int32,
    rescale_int32_rows,
)
from qsync_opt.ops.rounding import GRAD_SCALES, Numerics, numerics

__all__ = [
    "available", "quantize_int8", "dequantize_int8", "rescale_int32", "int8_linear",
    "int8_conv2d", "fake_quant_int8", "fake_quant_float", "int_mm", "gemm_layout_ok",
    "default_bwd_dtype", "emulated_half", "float_exact_gemm", "FLOAT_EXACT_MAX_K",
    "quantize_int4", "int4_linear", "int4_conv2d", "fake_quant_int4", "Numerics", "NUMERICS",
    "numerics", "GRAD_SCALES", "rescale_int32_rows", "FP8_MAX", "load_cpu", "backends",
    "fakequant", "int4", "int8", "intmm", "quantize", "rounding",
]

#: Names whose value a context manager changes (:func:`numerics`, :func:`float_exact_gemm`,
#: :func:`emulated_half`): read from their module at each access.
_LIVE = {"NUMERICS": (rounding, "NUMERICS"), "_float_gemm": (intmm, "_float_gemm"),
         "_half_emulated": (intmm, "_half_emulated")}


def __getattr__(name: str) -> Any:
    if name in _LIVE:
        module, attr = _LIVE[name]
        return getattr(module, attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
