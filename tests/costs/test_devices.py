"""The device catalog (qsync_opt.costs.devices) against docs/DEVICES.md, and the CPU entry."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import DType, Precision
from qsync_opt.costs import devices
from qsync_opt.costs.devices import (
    ALIASES,
    CATALOG,
    canonical_name,
    get_device,
    known_device_names,
)
from qsync_opt.documents.schemas import DeviceSpec

GiB = 1024**3
MiB = 1024**2

GPU_NAMES = ["t4", "v100", "a10", "l4", "a100_40gb", "a100_80gb", "h100", "h200"]
ALL_CATALOG = [
    "t4", "v100", "v100_pcie", "a10", "l4", "a100_40gb", "a100_80gb", "a100_pcie_80gb",
    "h100", "h100_pcie", "h200",
]


def names(precisions: list[Precision]) -> set[str]:
    return {p.value for p in precisions}


# ----------------------------------------------------------------------------- names


def test_catalog_holds_the_datasheet_devices() -> None:
    assert set(GPU_NAMES) <= set(CATALOG)
    assert list(CATALOG) == ALL_CATALOG
    assert known_device_names() == [*ALL_CATALOG, "cpu"]
    for key, spec in CATALOG.items():
        assert spec.name == key


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("a100", "a100_80gb"),
        ("v100_sxm2", "v100"),
        ("v100_sxm2_32gb", "v100"),
        ("a100_sxm", "a100_80gb"),
        ("h100_sxm", "h100"),
        ("A100", "a100_80gb"),  # case and surrounding space are normalised
        ("  t4 ", "t4"),
        ("cpu", "cpu"),
        ("h200", "h200"),
    ],
)
def test_canonical_name(alias: str, canonical: str) -> None:
    assert canonical_name(alias) == canonical


def test_aliases_point_at_catalog_entries() -> None:
    assert set(ALIASES.values()) <= set(CATALOG)
    assert get_device("a100") is CATALOG["a100_80gb"]
    assert get_device("v100_sxm2") is CATALOG["v100"]


@pytest.mark.parametrize("bad", ["a200", "k80", "", "t4x2"])
def test_unknown_device_lists_known_names(bad: str) -> None:
    with pytest.raises(QsyncInputError) as exc:
        get_device(bad)
    msg = str(exc.value)
    assert f"unknown device {bad!r}" in msg
    for name in [*ALL_CATALOG, "cpu"]:
        assert name in msg
    assert "a100=a100_80gb" in msg  # the aliases are listed too


def test_unknown_device_error_is_a_value_error() -> None:
    # Pydantic field validators turn ValueError into a field error; that needs this base.
    assert issubclass(QsyncInputError, ValueError)


# ----------------------------------------------------------------------------- menus


@pytest.mark.parametrize(
    ("device", "menu"),
    [
        ("v100", {"fp32", "fp16"}),
        ("v100_pcie", {"fp32", "fp16"}),
        ("t4", {"fp32", "fp16", "int8", "int8_full"}),
        ("a10", {"fp32", "tf32", "bf16", "fp16", "int8", "int8_full"}),
        ("a100_40gb", {"fp32", "tf32", "bf16", "fp16", "int8", "int8_full"}),
        ("a100_80gb", {"fp32", "tf32", "bf16", "fp16", "int8", "int8_full"}),
        ("a100_pcie_80gb", {"fp32", "tf32", "bf16", "fp16", "int8", "int8_full"}),
        ("l4", {"fp32", "tf32", "bf16", "fp16", "int8", "int8_full", "fp8"}),
        ("h100", {"fp32", "tf32", "bf16", "fp16", "int8", "int8_full", "fp8"}),
        ("h100_pcie", {"fp32", "tf32", "bf16", "fp16", "int8", "int8_full", "fp8"}),
        ("h200", {"fp32", "tf32", "bf16", "fp16", "int8", "int8_full", "fp8"}),
    ],
)
def test_precision_menus_follow_compute_capability(device: str, menu: set[str]) -> None:
    spec = get_device(device)
    assert names(spec.precisions) == menu
    assert len(spec.precisions) == len(menu)  # no duplicates
    for p in Precision:
        assert spec.supports(p) == (p.value in menu)


def test_v100_has_no_int8_rate_at_all() -> None:
    # DEVICES.md note V: no INT8 tensor mode on Volta, so no rate is invented for it.
    v100 = get_device("v100")
    assert not v100.supports(Precision.int8)
    assert set(v100.peak_tflops) == {DType.fp32, DType.fp16}


@pytest.mark.parametrize(
    ("device", "cc"),
    [("t4", "7.5"), ("v100", "7.0"), ("a10", "8.6"), ("l4", "8.9"), ("a100_40gb", "8.0"),
     ("a100_80gb", "8.0"), ("h100", "9.0"), ("h200", "9.0")],
)
def test_compute_capability(device: str, cc: str) -> None:
    assert get_device(device).compute_capability == cc


# ----------------------------------------------------------------------------- figures

# One row per checked figure: (device, dtype, dense TFLOPS) straight from DEVICES.md's table;
# "x (y*)" entries are y/2.
RATES = [
    ("t4", DType.fp32, 8.1), ("t4", DType.fp16, 65.0), ("t4", DType.int8, 130.0),
    ("v100", DType.fp32, 15.7), ("v100", DType.fp16, 125.0),
    ("v100_pcie", DType.fp16, 112.0),
    ("a10", DType.fp32, 31.2), ("a10", DType.tf32, 62.5), ("a10", DType.bf16, 125.0),
    ("a10", DType.int8, 250.0),
    ("l4", DType.fp32, 30.3), ("l4", DType.tf32, 120.0 / 2), ("l4", DType.fp16, 242.0 / 2),
    ("l4", DType.int8, 485.0 / 2), ("l4", DType.fp8_e4m3, 485.0 / 2),
    ("a100_40gb", DType.fp32, 19.5), ("a100_40gb", DType.tf32, 156.0),
    ("a100_40gb", DType.fp16, 312.0), ("a100_40gb", DType.int8, 624.0),
    ("a100_80gb", DType.bf16, 312.0),
    ("h100", DType.fp32, 67.0), ("h100", DType.tf32, 989.0 / 2),
    ("h100", DType.fp16, 1979.0 / 2), ("h100", DType.bf16, 989.5),
    ("h100", DType.fp8_e4m3, 3958.0 / 2), ("h100", DType.int8, 1979.0),
    ("h100_pcie", DType.fp16, 1513.0 / 2),
    ("h200", DType.fp32, 67.0), ("h200", DType.fp16, 989.5), ("h200", DType.fp8_e4m3, 1979.0),
]


@pytest.mark.parametrize(("device", "dtype", "tflops"), RATES)
def test_peak_rates_match_devices_md(device: str, dtype: DType, tflops: float) -> None:
    spec = get_device(device)
    assert spec.peak_tflops[dtype] == pytest.approx(tflops, abs=1e-9)
    assert spec.peak_flops(dtype) == pytest.approx(tflops * 1e12)


def test_e5m2_runs_at_the_e4m3_rate() -> None:
    h100 = get_device("h100")
    assert DeviceSpec.rate_key(DType.fp8_e5m2) == DType.fp8_e4m3
    assert h100.peak_flops(DType.fp8_e5m2) == pytest.approx(1979.0e12)


@pytest.mark.parametrize(
    ("device", "gb_per_s"),
    [("t4", 300.0), ("v100", 900.0), ("a10", 600.0), ("l4", 300.0), ("a100_40gb", 1555.0),
     ("a100_80gb", 2039.0), ("a100_pcie_80gb", 1935.0), ("h100", 3350.0),
     ("h100_pcie", 2000.0), ("h200", 4800.0)],
)
def test_memory_bandwidth(device: str, gb_per_s: float) -> None:
    assert get_device(device).memory_bandwidth_gb_per_s == gb_per_s


@pytest.mark.parametrize(
    ("device", "gib", "usable_mib"),
    [("t4", 16, 15360), ("v100", 32, 32768), ("a10", 24, 23028), ("l4", 24, 23034),
     ("a100_40gb", 40, 40960), ("a100_80gb", 80, 81920), ("h100", 80, 81559),
     ("h200", 141, 143771)],
)
def test_memory_capacity_and_driver_total(device: str, gib: int, usable_mib: int) -> None:
    spec = get_device(device)
    assert spec.memory_bytes == gib * GiB
    assert spec.usable_memory_bytes == usable_mib * MiB


def test_t4_ecc_loses_one_sixteenth() -> None:
    # DEVICES.md note M: 16,384 MiB x 15/16 = 15,360 MiB.
    assert get_device("t4").usable_memory_bytes == 16 * GiB * 15 // 16


@pytest.mark.parametrize(
    ("device", "intra", "tdp"),
    [("v100", 150.0, 300.0), ("a100_80gb", 300.0, 400.0), ("h100", 450.0, 700.0),
     ("t4", 16.0, 70.0), ("l4", 32.0, 72.0)],
)
def test_links_are_per_direction_halves_and_tdp(device: str, intra: float, tdp: float) -> None:
    spec = get_device(device)
    assert spec.intra_node_bandwidth_gb_per_s == intra
    assert spec.tdp_w == tdp


@pytest.mark.parametrize("device", ALL_CATALOG)
def test_every_entry_is_consistent_and_sourced(device: str) -> None:
    spec = CATALOG[device]
    assert spec.source.strip()
    assert "DEVICES.md" in spec.source
    ids = re.findall(r"\b([NX]\d+)\b", spec.source)
    assert "N1" in ids  # compute capability source
    assert len(ids) >= 2
    assert 0 < spec.usable_memory_bytes <= spec.memory_bytes
    assert spec.measured is False
    assert spec.precisions[0] == Precision.fp32
    for p in spec.precisions:
        for dt in (p.info.fwd_compute, p.info.bwd_compute):
            assert spec.peak_flops(dt) > 0
    # Tensor-core rates are never below the CUDA-core fp32 rate.
    for dt, rate in spec.peak_tflops.items():
        assert rate >= spec.peak_tflops[DType.fp32], dt


# ----------------------------------------------------------------------------- validation


def _t4_data(**update: object) -> dict[str, object]:
    data = CATALOG["t4"].model_dump()
    data.update(update)
    return data


def test_t4_round_trips_through_validation() -> None:
    assert DeviceSpec.model_validate(_t4_data()) == CATALOG["t4"]


def test_menu_precision_without_a_rate_is_refused() -> None:
    data = _t4_data(precisions=[*CATALOG["t4"].precisions, Precision.bf16])
    with pytest.raises(ValidationError, match="precision bf16 needs a peak_tflops entry for bf16"):
        DeviceSpec.model_validate(data)


def test_fp8_needs_the_e4m3_rate() -> None:
    data = _t4_data(precisions=[*CATALOG["t4"].precisions, Precision.fp8])
    with pytest.raises(ValidationError, match="precision fp8 needs a peak_tflops entry for fp8_e4m3"):
        DeviceSpec.model_validate(data)


def test_usable_above_memory_is_refused() -> None:
    data = _t4_data(usable_memory_bytes=16 * GiB + 1)
    with pytest.raises(ValidationError, match="usable_memory_bytes exceeds memory_bytes"):
        DeviceSpec.model_validate(data)


def test_menu_without_fp32_is_refused() -> None:
    data = _t4_data(precisions=[Precision.fp16, Precision.int8])
    with pytest.raises(ValidationError, match="precisions must include fp32"):
        DeviceSpec.model_validate(data)


def test_non_positive_rate_is_refused() -> None:
    rates = dict(CATALOG["t4"].peak_tflops)
    rates[DType.int8] = 0.0
    with pytest.raises(ValidationError, match="peak_tflops values must be > 0"):
        DeviceSpec.model_validate(_t4_data(peak_tflops=rates))


def test_unknown_field_is_refused() -> None:
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        DeviceSpec.model_validate(_t4_data(sparse=True))


# ----------------------------------------------------------------------------- cpu


@pytest.fixture
def fresh_cpu_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    devices.measure_cpu.cache_clear()
    yield tmp_path
    devices.measure_cpu.cache_clear()


def test_cpu_is_measured_and_cached(fresh_cpu_cache: Path) -> None:
    spec = get_device("cpu")
    assert spec.name == "cpu"
    assert spec.measured is True
    assert spec.compute_capability is None
    for dt in (DType.fp32, DType.bf16, DType.int8):
        assert spec.peak_tflops[dt] > 0
    menu = names(spec.precisions)
    assert {"fp32", "bf16", "int8"} <= menu
    assert "fp8" not in menu and "tf32" not in menu
    assert 0 < spec.usable_memory_bytes <= spec.memory_bytes
    assert spec.memory_bandwidth_gb_per_s > 0
    # Same object within the process (lru_cache) ...
    assert get_device("CPU") is spec
    # ... and the figures were written under XDG_CACHE_HOME for the next process.
    cache = fresh_cpu_cache / "qsync-opt" / "cpu_spec.json"
    assert cache.is_file()
    devices.measure_cpu.cache_clear()
    again = get_device("cpu")
    assert again.peak_tflops == spec.peak_tflops  # read back, not re-measured


def test_cpu_cache_keeps_one_entry_per_thread_count(fresh_cpu_cache: Path) -> None:
    """Runs at 1 and 2 threads on one machine must not overwrite each other's figures."""
    import json

    import torch

    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        devices.measure_cpu.cache_clear()
        one = get_device("cpu")
        torch.set_num_threads(2)
        devices.measure_cpu.cache_clear()
        get_device("cpu")
        entries = json.loads((fresh_cpu_cache / "qsync-opt" / "cpu_spec.json").read_text())
        assert len(entries["entries"]) == 2
        torch.set_num_threads(1)
        devices.measure_cpu.cache_clear()
        assert get_device("cpu").peak_tflops == one.peak_tflops  # read back, not re-measured
    finally:
        torch.set_num_threads(old)
        devices.measure_cpu.cache_clear()
        devices._derived_cpu.cache_clear()  # derived CPUs are built from the measured one


# ---------------------------------------------------------------- int8 as the runtime runs it

def test_hopper_int8_runtime_rate_is_the_h200_measurement_and_its_derivation() -> None:
    """int8 on Hopper: the datasheet peak is kept; the rate the estimate uses is a separate,
    sourced figure: the H200's measured torch._int_mm rate (4096^3 in 1.0941 ms,
    benchmarks/results/gpu_h200/bench_cuda.log), the H100s derived by the same share of
    their own peak."""
    measured = 2 * 4096**3 / 1.0941e-3 / 1e12
    assert measured == pytest.approx(125.618, abs=1e-3)
    assert devices.H200_RUNTIME_INT8_TOPS == pytest.approx(measured, rel=1e-12)
    assert devices.HOPPER_INT8_RUNTIME_RATIO == pytest.approx(measured / 1979.0, rel=1e-12)
    for name, peak in (("h200", 1979.0), ("h100", 1979.0), ("h100_pcie", 1513.0)):
        spec = get_device(name)
        assert spec.peak_tflops[DType.int8] == peak  # the datasheet, unchanged
        rate = spec.runtime_tflops[DType.int8]
        assert rate == pytest.approx(peak * measured / 1979.0, rel=1e-12)
        assert spec.runtime_flops(DType.int8) == pytest.approx(rate * 1e12)
        assert set(spec.runtime_tflops) == {DType.int8}  # fp16, bf16, fp8: peak x efficiency
        assert spec.runtime_flops(DType.fp16) is None
        assert "DEVICES.md R1" in spec.source
        assert ("measured on an H200" in spec.source) == (name == "h200")
        assert ("derived" in spec.source) == (name != "h200")
    assert get_device("h100_pcie").runtime_tflops[DType.int8] == pytest.approx(96.04, abs=0.01)
    # No other card carries a runtime rate (no measurement of it yet).
    assert [n for n, d in CATALOG.items() if d.runtime_tflops] == ["h100", "h100_pcie", "h200"]


def test_hopper_int8_runtime_rate_is_documented() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "DEVICES.md").read_text()
    assert "**R1**" in text and "benchmarks/results/gpu_h200/bench_cuda.log" in text
    assert "1.0941" in text and "125.6" in text and "96.0" in text and "derived" in text


@pytest.mark.parametrize("rate", [0.0, -1.0, float("nan"), float("inf"), 131.0, 1e300])
def test_runtime_rate_must_be_positive_and_at_most_the_peak(rate: float) -> None:
    data = CATALOG["t4"].model_dump()
    data["runtime_tflops"] = {"int8": rate}  # the T4's int8 peak is 130
    with pytest.raises(ValidationError, match=r"runtime_tflops(\[|\.)int8"):
        DeviceSpec.model_validate(data)


def test_runtime_rate_needs_a_peak_of_its_dtype() -> None:
    data = CATALOG["v100"].model_dump()
    data["runtime_tflops"] = {"int8": 10.0}  # the V100 has no int8 peak
    with pytest.raises(ValidationError, match=r"runtime_tflops\[int8\].*peak_tflops entry"):
        DeviceSpec.model_validate(data)
