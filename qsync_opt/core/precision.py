"""The one precision vocabulary of qsync-opt.

Every stage (graph, costs, indicator, solvers, plan, runtime) names precisions with
:class:`Precision`. Each precision states what its operator takes in, computes in and gives
out, forward and backward (docs/ARCHITECTURE.md, "The allocation problem, the replayer and the runtime"). A cast is costed on an edge
exactly where a producer's ``gives_out`` differs from its consumer's ``takes_in``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class DType(StrEnum):
    """Storage / compute dtypes that appear on edges and inside operators."""

    fp32 = "fp32"
    tf32 = "tf32"  # fp32 storage, tensor-core multiply with a 10-bit mantissa
    bf16 = "bf16"
    fp16 = "fp16"
    int8 = "int8"
    int4 = "int4"  # 4-bit integer values in [-7, 7]; stored one per byte (see itemsize)
    int32 = "int32"
    fp8_e4m3 = "fp8_e4m3"
    fp8_e5m2 = "fp8_e5m2"

    @property
    def itemsize(self) -> int:
        """Bytes per element when stored.

        ``int4`` counts one byte: its values live in int8 storage (this package's CPU
        kernels, its CUDA int4 path and the saved activations all keep one value per byte).
        A GPU kernel that packs two values per byte would move half those bytes; the memory
        and byte models do not assume it (docs/COSTS.md, "int4").
        """
        return _ITEMSIZE[self]


_ITEMSIZE = {
    DType.fp32: 4,
    DType.tf32: 4,
    DType.bf16: 2,
    DType.fp16: 2,
    DType.int8: 1,
    DType.int4: 1,
    DType.int32: 4,
    DType.fp8_e4m3: 1,
    DType.fp8_e5m2: 1,
}


class Precision(StrEnum):
    """Precision an allocatable operator runs at (the decision variable's domain)."""

    fp32 = "fp32"
    tf32 = "tf32"
    bf16 = "bf16"
    fp16 = "fp16"
    int8 = "int8"  # int8 forward GEMM (int32 accumulate), 16-bit (fp16) backward
    int8_full = "int8_full"  # int8 in the backward GEMMs too
    fp8 = "fp8"  # e4m3 forward, e5m2 backward
    int4 = "int4"  # int4 forward GEMM (int32 accumulate), 16-bit (fp16) backward; opt-in

    @property
    def info(self) -> PrecisionInfo:
        return PRECISION_INFO[self]


@dataclass(frozen=True)
class PrecisionInfo:
    """What an operator at this precision reads, computes and writes.

    ``takes_in`` is the dtype the operator's kernel consumes on its activation input; a
    producer giving out anything else pays a cast on that edge (for int8 and fp8 that cast is
    the quantization itself, with its abs-max pass). ``gives_out`` is its output dtype.
    ``saved_dtype`` is the dtype of the activation it keeps for backward, ``weight_dtype`` the
    dtype of the low-precision weight copy made from the FP32 master weight each iteration
    (None: the master weight is used directly).
    """

    fwd_compute: DType
    bwd_compute: DType
    takes_in: DType
    gives_out: DType
    saved_dtype: DType
    weight_dtype: DType | None
    family: str  # "float" or "fixed": the indicator's error model
    rank: int  # numeric fidelity order within the whole vocabulary, higher is more exact
    description: str


PRECISION_INFO: dict[Precision, PrecisionInfo] = {
    Precision.fp32: PrecisionInfo(
        DType.fp32, DType.fp32, DType.fp32, DType.fp32, DType.fp32, None, "float", 6,
        "FP32 everywhere (QSync's reference precision).",
    ),
    Precision.tf32: PrecisionInfo(
        DType.tf32, DType.tf32, DType.fp32, DType.fp32, DType.fp32, None, "float", 5,
        "TF32 tensor-core multiply on FP32 storage (SM80+); no cast on either side.",
    ),
    Precision.bf16: PrecisionInfo(
        DType.bf16, DType.bf16, DType.bf16, DType.bf16, DType.bf16, DType.bf16, "float", 3,
        "Input cast to bf16, bf16 GEMM with FP32 accumulation, bf16 output (SM80+).",
    ),
    Precision.fp16: PrecisionInfo(
        DType.fp16, DType.fp16, DType.fp16, DType.fp16, DType.fp16, DType.fp16, "float", 4,
        "Input cast to fp16, fp16 GEMM with FP32 accumulation, fp16 output.",
    ),
    Precision.int8: PrecisionInfo(
        DType.int8, DType.fp16, DType.int8, DType.fp32, DType.int8, DType.int8, "fixed", 1,
        "Input quantized to int8 (abs-max scale), int8 GEMM with int32 accumulation, "
        "rescaled FP32 output; backward GEMMs in fp16 on the saved int8 input.",
    ),
    Precision.int8_full: PrecisionInfo(
        DType.int8, DType.int8, DType.int8, DType.fp32, DType.int8, DType.int8, "fixed", 0,
        "As int8, and the backward GEMMs quantize the output gradient to int8 too.",
    ),
    Precision.fp8: PrecisionInfo(
        DType.fp8_e4m3, DType.fp8_e5m2, DType.fp8_e4m3, DType.bf16, DType.fp8_e4m3,
        DType.fp8_e4m3, "float", 2,
        "Input and weight cast to e4m3, FP8 GEMM with FP32 accumulation, bf16 output; "
        "gradients in e5m2 (SM89+).",
    ),
    Precision.int4: PrecisionInfo(
        DType.int4, DType.fp16, DType.int4, DType.fp32, DType.int4, DType.int4, "fixed", -1,
        "Input quantized to int4 ([-7, 7], abs-max/7 scale per tensor or per row group), "
        "weight per output channel, int4 GEMM with int32 accumulation, rescaled FP32 output; "
        "backward GEMMs in fp16 on the saved int4 operands (T4, A10; opt-in).",
    ),
}

#: Precisions no default menu offers: a user enables them per group (``devices.enable_int4``,
#: the ``:int4`` device suffix, the CLI's ``--int4``). int4 changes accuracy far more than
#: int8, so every default plan stays what it was.
OPT_IN: frozenset[Precision] = frozenset({Precision.int4})

#: Precisions ordered from most to least exact; "one step higher" in the greedy allocator.
BY_FIDELITY: tuple[Precision, ...] = tuple(
    sorted(Precision, key=lambda p: PRECISION_INFO[p].rank, reverse=True)
)

#: Dtypes an activation edge can carry between float operators (pass-through ops run in these).
ACTIVATION_DTYPES: tuple[DType, ...] = (DType.fp32, DType.bf16, DType.fp16)


def parse_precision(value: str) -> Precision:
    """Parse a precision name, with an error that lists the vocabulary."""
    try:
        return Precision(value)
    except ValueError:
        known = ", ".join(p.value for p in Precision)
        raise ValueError(f"unknown precision {value!r}; expected one of: {known}") from None
