"""The precision vocabulary (qsync_opt.core.precision): names, dtype rules, fidelity order."""

from __future__ import annotations

import pytest

from qsync_opt.core.precision import (
    ACTIVATION_DTYPES,
    BY_FIDELITY,
    PRECISION_INFO,
    DType,
    Precision,
    parse_precision,
)

ALL_NAMES = ["fp32", "tf32", "bf16", "fp16", "int8", "int8_full", "fp8", "int4"]

# (fwd_compute, bwd_compute, takes_in, gives_out), written out by hand from docs/ARCHITECTURE.md's
# "Precisions and casts": int8 quantizes its input on the edge (takes int8), computes
# forward in int8, backward in fp16 and gives rescaled fp32; fp8 is e4m3 fwd / e5m2 bwd.
EXPECTED_RULES = {
    "fp32": ("fp32", "fp32", "fp32", "fp32"),
    "tf32": ("tf32", "tf32", "fp32", "fp32"),
    "bf16": ("bf16", "bf16", "bf16", "bf16"),
    "fp16": ("fp16", "fp16", "fp16", "fp16"),
    "int8": ("int8", "fp16", "int8", "fp32"),
    "int8_full": ("int8", "int8", "int8", "fp32"),
    "fp8": ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3", "bf16"),
    "int4": ("int4", "fp16", "int4", "fp32"),
}


def test_vocabulary_is_exactly_the_eight_precisions() -> None:
    assert [p.value for p in Precision] == ALL_NAMES
    assert set(PRECISION_INFO) == set(Precision)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_dtype_rules_per_precision(name: str) -> None:
    info = Precision(name).info
    fwd, bwd, takes, gives = EXPECTED_RULES[name]
    assert info.fwd_compute == DType(fwd)
    assert info.bwd_compute == DType(bwd)
    assert info.takes_in == DType(takes)
    assert info.gives_out == DType(gives)
    assert info is PRECISION_INFO[Precision(name)]


def test_int8_quantize_is_a_cast_on_the_incoming_edge() -> None:
    # An fp32 producer feeding an int8 consumer differs in dtype, so the edge pays the cast
    # (the quantization); the int8 op itself gives fp32 back, so an fp32 consumer pays none.
    fp32, int8 = Precision.fp32.info, Precision.int8.info
    assert fp32.gives_out != int8.takes_in
    assert int8.gives_out == fp32.takes_in
    assert int8.saved_dtype == DType.int8
    assert int8.weight_dtype == DType.int8


def test_fp32_and_tf32_need_no_cast_between_them() -> None:
    for a in (Precision.fp32, Precision.tf32):
        for b in (Precision.fp32, Precision.tf32):
            assert a.info.gives_out == b.info.takes_in == DType.fp32
    # Master weights are used directly at fp32/tf32 (no low-precision weight copy).
    assert Precision.fp32.info.weight_dtype is None
    assert Precision.tf32.info.weight_dtype is None


def test_families() -> None:
    fixed = {p.value for p in Precision if p.info.family == "fixed"}
    assert fixed == {"int8", "int8_full", "int4"}
    assert all(p.info.family in ("float", "fixed") for p in Precision)


def test_by_fidelity_order() -> None:
    assert BY_FIDELITY[0] == Precision.fp32
    assert BY_FIDELITY[-1] == Precision.int4
    assert [p.value for p in BY_FIDELITY] == [
        "fp32", "tf32", "fp16", "bf16", "fp8", "int8", "int8_full", "int4"
    ]
    assert set(BY_FIDELITY) == set(Precision)
    ranks = [p.info.rank for p in BY_FIDELITY]
    assert ranks == sorted(ranks, reverse=True)
    assert len(set(ranks)) == len(ranks)  # a strict order: no ties


@pytest.mark.parametrize("name", ALL_NAMES)
def test_parse_precision_accepts_every_name(name: str) -> None:
    assert parse_precision(name) is Precision(name)


@pytest.mark.parametrize("bad", ["fp64", "FP16", "int2", "", "fp8_e4m3"])
def test_parse_precision_error_lists_the_vocabulary(bad: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_precision(bad)
    msg = str(exc.value)
    assert repr(bad) in msg
    assert "fp32, tf32, bf16, fp16, int8, int8_full, fp8, int4" in msg


@pytest.mark.parametrize(
    ("dtype", "size"),
    [
        ("fp32", 4), ("tf32", 4), ("bf16", 2), ("fp16", 2),
        ("int8", 1), ("int4", 1), ("int32", 4), ("fp8_e4m3", 1), ("fp8_e5m2", 1),
    ],
)
def test_dtype_itemsize(dtype: str, size: int) -> None:
    assert DType(dtype).itemsize == size


def test_dtype_members_and_activation_dtypes() -> None:
    assert {d.value for d in DType} == {
        "fp32", "tf32", "bf16", "fp16", "int8", "int4", "int32", "fp8_e4m3", "fp8_e5m2"
    }
    assert ACTIVATION_DTYPES == (DType.fp32, DType.bf16, DType.fp16)


def test_precision_and_dtype_are_str_enums() -> None:
    # They round-trip through JSON as plain strings.
    assert Precision.int8_full == "int8_full"
    assert DType.fp8_e5m2 == "fp8_e5m2"
