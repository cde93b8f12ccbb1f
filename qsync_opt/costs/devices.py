"""Device catalog: published datasheet figures per accelerator, and this machine's CPU.

Every figure below is a dense (non-sparse) peak from the vendor's datasheet or whitepaper;
the source ids (N1..N11, X1..X5) refer to docs/DEVICES.md, which gives the URLs, the
cross-checks and the conflicts (sparse figures halved for L4, H100 and H200). Memory:
``memory_bytes`` is the vendor capacity read as binary GiB (NVIDIA's "GB" for GPU memory),
``usable_memory_bytes`` the total nvidia-smi reports (ECC on for GDDR6 cards, note M).
Bandwidths between devices are per direction (half of NVIDIA's bidirectional totals).

The precision menu follows the compute capability, as in QSync: SM70 {fp32, fp16} (V100 has
no INT8 tensor cores, note V), SM75 adds int8, SM80/86 add tf32 and bf16, SM89/90 add fp8.

INT4 is opt-in (precision.OPT_IN): ``peak_tflops`` carries the published dense INT4 peak
(T4 260, A10 500 TOPS; docs/DEVICES.md) but no default menu lists int4. ``NAME:int4`` (e.g.
``t4:int4``, ``cpu/2~t4:int4``) is the card with int4 added to its menu; a card without an
INT4 peak (V100, L4, A100: no figure in docs/DEVICES.md; H100/H200: no INT4 tensor cores)
refuses the suffix by name. :func:`enable_int4` does it for every eligible group of a cluster.
On a derived CPU int4 runs through this CPU's int8 GEMM (values in int8 storage), so its
int4 rate is its measured int8 rate: no speed gain here.

Datasheet peaks are what the card can do; where this project's runtime is known to reach far
less, the entry also carries ``runtime_tflops``, a separately named, sourced rate the estimate
uses instead of peak x efficiency. Today that is int8 on Hopper (h200 measured, h100 and
h100_pcie derived by the same share of their peak; docs/DEVICES.md R1), whose integer GEMM
``torch._int_mm`` ran at 6% of the datasheet's INT8 peak.

The ``cpu`` entry is this machine, measured on first use (matmul throughput per dtype with
torch, copy bandwidth, memory) and cached; it is never a guess.

Derived CPUs emulate a hybrid cluster on one CPU box, where every rank is an equal CPU:
``cpu/F[:MEM][~CARD]`` is the measured ``cpu`` with its compute and memory rates divided by
``F`` (a number >= 1), its memory capped at ``MEM`` (``4g`` GiB or ``512m`` MiB) when given,
and its precision menu restricted to the catalog card ``CARD``'s menu when given, e.g.
``cpu/2``, ``cpu/2.5:4g``, ``cpu/3~t4``. The figures stay those of this CPU (its real
precision ratios: bf16 and int8 fast, fp16 slow), not the card's. The runtime honours ``F``
by stretching that rank's measured compute time (qsync_opt.runtime.emulate): it is an
emulation, and ``DeviceSpec.source`` says so.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path
from typing import Any

# the names live in the dependency-free device_names (the schemas check names with it);
# re-exported here, where callers look for the catalog
from qsync_opt.core.device_names import (  # noqa: F401
    ALIASES,
    CATALOG_NAMES,
    CPU,
    DERIVED_HELP,
    DERIVED_RE,
    INT4_CARDS,
    INT4_HELP,
    INT4_SUFFIX,
    can_enable_int4,
    canonical_name,
    has_int4,
    is_derived,
    known_device_names,
    number_text,
)
from qsync_opt.core.machine import cache_root
from qsync_opt.core.machine import cpu_model as cpu_model_name
from qsync_opt.core.precision import DType, Precision
from qsync_opt.documents.io import atomic_write_text
from qsync_opt.documents.schemas import ClusterSpec, DeviceSpec

log = logging.getLogger(__name__)

GiB = 1024**3
MiB = 1024**2

P = Precision
_SM70 = [P.fp32, P.fp16]
_SM75 = [P.fp32, P.fp16, P.int8, P.int8_full]
_SM80 = [P.fp32, P.tf32, P.bf16, P.fp16, P.int8, P.int8_full]
_SM89 = [*_SM80, P.fp8]


def _rates(fp32: float, fp16: float, tf32: float | None = None, bf16: float | None = None,
           int8: float | None = None, fp8: float | None = None,
           int4: float | None = None) -> dict[DType, float]:
    out = {DType.fp32: fp32, DType.fp16: fp16}
    for key, val in ((DType.tf32, tf32), (DType.bf16, bf16), (DType.int8, int8),
                     (DType.fp8_e4m3, fp8), (DType.int4, int4)):
        if val is not None:
            out[key] = val
    return out


def _spec(**kw: object) -> DeviceSpec:
    return DeviceSpec.model_validate(kw)


#: int8 on Hopper as this runtime runs it (docs/DEVICES.md R1): ``torch._int_mm`` (int8 x int8
#: -> int32, the runtime's integer GEMM) took 1.0941 ms for a 4096^3 product on an H200
#: (torch 2.11.0+cu130, median of 50; ``benchmarks/bench_cuda.py --sizes 2048 4096``, output
#: in benchmarks/results/gpu_h200/bench_cuda.log), 2 x 4096^3 / 1.0941 ms = 125.6 TOPS,
#: against a datasheet INT8 peak of 1,979 dense TOPS (N11). The datasheet peak stays in
#: ``peak_tflops``; this measured rate is ``runtime_tflops[int8]``, which the estimate uses in
#: place of peak x ``int8_gemm`` (1,979 x 0.5 = 990 TOPS, 7.9x the measured rate).
HOPPER_INT8_GEMM_SIZE = 4096
HOPPER_INT8_GEMM_MS = 1.0941
#: The runtime's int8 rate on the H200, TOPS (measured, above).
H200_RUNTIME_INT8_TOPS = 2.0 * HOPPER_INT8_GEMM_SIZE**3 / (HOPPER_INT8_GEMM_MS * 1e-3) / 1e12
#: Its share of the H200's datasheet INT8 peak (0.0635). The H100s (same GH100 compute, the
#: same torch kernels) are *derived* by this ratio from their own peaks: not measured.
HOPPER_INT8_RUNTIME_RATIO = H200_RUNTIME_INT8_TOPS / 1979.0
_HOPPER_INT8 = ("int8 at the runtime's rate (torch._int_mm), not the datasheet's: {how} "
                "(DEVICES.md R1)")

_CATALOG: tuple[DeviceSpec, ...] = (
    # T4: datasheet N2 (8.1 FP32, 65 FP16/FP32-acc, 130 INT8, 260 INT4, 300 GB/s, PCIe Gen3
    # 32 GB/s bidirectional, 70 W); CC 7.5 (N1); 15,360 MiB reported with ECC (X5).
    _spec(name="t4", display_name="NVIDIA T4 16 GB", compute_capability="7.5",
          memory_bytes=16 * GiB, usable_memory_bytes=15360 * MiB,
          memory_bandwidth_gb_per_s=300.0, peak_tflops=_rates(8.1, 65.0, int8=130.0, int4=260.0),
          precisions=_SM75, intra_node_bandwidth_gb_per_s=16.0, host_link_gb_per_s=16.0,
          tdp_w=70.0, source="DEVICES.md N1, N2, X3, X5"),
    # V100 SXM2 32 GB: datasheet N3 (15.7 FP32, 125 tensor, 900 GB/s, NVLink 2 300 GB/s
    # bidirectional, 300 W); no INT8 tensor mode (N4: "Peak INT8 Tensor TOPS: NA").
    _spec(name="v100", display_name="NVIDIA V100 SXM2 32 GB", compute_capability="7.0",
          memory_bytes=32 * GiB, usable_memory_bytes=32768 * MiB,
          memory_bandwidth_gb_per_s=900.0, peak_tflops=_rates(15.7, 125.0),
          precisions=_SM70, intra_node_bandwidth_gb_per_s=150.0, host_link_gb_per_s=16.0,
          tdp_w=300.0, source="DEVICES.md N1, N3, N4, X1, X3, X5"),
    # V100 PCIe 16 GB: N3 (14 FP32, 112 tensor, 250 W, PCIe Gen3).
    _spec(name="v100_pcie", display_name="NVIDIA V100 PCIe 16 GB", compute_capability="7.0",
          memory_bytes=16 * GiB, usable_memory_bytes=16384 * MiB,
          memory_bandwidth_gb_per_s=900.0, peak_tflops=_rates(14.0, 112.0),
          precisions=_SM70, intra_node_bandwidth_gb_per_s=16.0, host_link_gb_per_s=16.0,
          tdp_w=250.0, source="DEVICES.md N1, N3, X1, X3, X5"),
    # A10: datasheet N6 (31.2 FP32, 62.5 TF32, 125 FP16/BF16, 250 INT8, 500 INT4 dense,
    # 600 GB/s, PCIe Gen4).
    _spec(name="a10", display_name="NVIDIA A10 24 GB", compute_capability="8.6",
          memory_bytes=24 * GiB, usable_memory_bytes=23028 * MiB,
          memory_bandwidth_gb_per_s=600.0,
          peak_tflops=_rates(31.2, 125.0, tf32=62.5, bf16=125.0, int8=250.0, int4=500.0),
          precisions=_SM80, intra_node_bandwidth_gb_per_s=32.0, host_link_gb_per_s=32.0,
          tdp_w=150.0, source="DEVICES.md N1, N6, X3, X5 (note A: FP32-accumulate rate inferred)"),
    # L4: datasheet N7 prints sparse figures only; halved (TF32 60, FP16/BF16 121, FP8/INT8
    # 242.5), FP32 30.3, 300 GB/s, PCIe Gen4, 72 W.
    _spec(name="l4", display_name="NVIDIA L4 24 GB", compute_capability="8.9",
          memory_bytes=24 * GiB, usable_memory_bytes=23034 * MiB,
          memory_bandwidth_gb_per_s=300.0,
          peak_tflops=_rates(30.3, 121.0, tf32=60.0, bf16=121.0, int8=242.5, fp8=242.5),
          precisions=_SM89, intra_node_bandwidth_gb_per_s=32.0, host_link_gb_per_s=32.0,
          tdp_w=72.0, source="DEVICES.md N1, N7, X3, X5 (sparse figures halved; note L)"),
    # A100 SXM 40 GB: N4/N5 (19.5 FP32, 156 TF32, 312 FP16/BF16, 624 INT8, 1,555 GB/s,
    # NVLink 3 600 GB/s bidirectional, 400 W).
    _spec(name="a100_40gb", display_name="NVIDIA A100 SXM4 40 GB", compute_capability="8.0",
          memory_bytes=40 * GiB, usable_memory_bytes=40960 * MiB,
          memory_bandwidth_gb_per_s=1555.0,
          peak_tflops=_rates(19.5, 312.0, tf32=156.0, bf16=312.0, int8=624.0),
          precisions=_SM80, intra_node_bandwidth_gb_per_s=300.0, host_link_gb_per_s=32.0,
          tdp_w=400.0, source="DEVICES.md N1, N4, N5, X1, X3, X5"),
    # A100 SXM 80 GB: N5 (as 40 GB, 2,039 GB/s).
    _spec(name="a100_80gb", display_name="NVIDIA A100 SXM4 80 GB", compute_capability="8.0",
          memory_bytes=80 * GiB, usable_memory_bytes=81920 * MiB,
          memory_bandwidth_gb_per_s=2039.0,
          peak_tflops=_rates(19.5, 312.0, tf32=156.0, bf16=312.0, int8=624.0),
          precisions=_SM80, intra_node_bandwidth_gb_per_s=300.0, host_link_gb_per_s=32.0,
          tdp_w=400.0, source="DEVICES.md N1, N5, X1, X2, X3, X5"),
    # A100 PCIe 80 GB: N5 (1,935 GB/s, 300 W; NVLink bridge pairs only, so PCIe in a node).
    _spec(name="a100_pcie_80gb", display_name="NVIDIA A100 PCIe 80 GB", compute_capability="8.0",
          memory_bytes=80 * GiB, usable_memory_bytes=81920 * MiB,
          memory_bandwidth_gb_per_s=1935.0,
          peak_tflops=_rates(19.5, 312.0, tf32=156.0, bf16=312.0, int8=624.0),
          precisions=_SM80, intra_node_bandwidth_gb_per_s=32.0, host_link_gb_per_s=32.0,
          tdp_w=300.0, source="DEVICES.md N1, N5, X1, X3, X5"),
    # H100 SXM 80 GB: N8/N9, sparse halved (TF32 494.5, FP16/BF16 989.5, FP8/INT8 1,979),
    # FP32 67, 3,350 GB/s, NVLink 4 900 GB/s bidirectional, up to 700 W.
    _spec(name="h100", display_name="NVIDIA H100 SXM5 80 GB", compute_capability="9.0",
          memory_bytes=80 * GiB, usable_memory_bytes=81559 * MiB,
          memory_bandwidth_gb_per_s=3350.0,
          peak_tflops=_rates(67.0, 989.5, tf32=494.5, bf16=989.5, int8=1979.0, fp8=1979.0),
          runtime_tflops={DType.int8: 1979.0 * HOPPER_INT8_RUNTIME_RATIO},
          precisions=_SM89, intra_node_bandwidth_gb_per_s=450.0, host_link_gb_per_s=64.0,
          tdp_w=700.0, source="DEVICES.md N1, N8, N9, X1, X2, X4, X5 (sparse figures halved); "
          + _HOPPER_INT8.format(how="derived from the H200's measured share of its INT8 peak")),
    # H100 PCIe 80 GB: N8/N9 (FP32 51, TF32 378, FP16/BF16 756.5, FP8/INT8 1,513, 2,000 GB/s).
    _spec(name="h100_pcie", display_name="NVIDIA H100 PCIe 80 GB", compute_capability="9.0",
          memory_bytes=80 * GiB, usable_memory_bytes=81559 * MiB,
          memory_bandwidth_gb_per_s=2000.0,
          peak_tflops=_rates(51.0, 756.5, tf32=378.0, bf16=756.5, int8=1513.0, fp8=1513.0),
          runtime_tflops={DType.int8: 1513.0 * HOPPER_INT8_RUNTIME_RATIO},
          precisions=_SM89, intra_node_bandwidth_gb_per_s=64.0, host_link_gb_per_s=64.0,
          tdp_w=350.0, source="DEVICES.md N1, N8, N9, X1, X5 (sparse halved; note H); "
          + _HOPPER_INT8.format(how="derived from the H200's measured share of its INT8 peak")),
    # H200 SXM 141 GB: N11, same GH100 compute as H100 SXM, 4,800 GB/s, 143,771 MiB reported.
    _spec(name="h200", display_name="NVIDIA H200 SXM 141 GB", compute_capability="9.0",
          memory_bytes=141 * GiB, usable_memory_bytes=143771 * MiB,
          memory_bandwidth_gb_per_s=4800.0,
          peak_tflops=_rates(67.0, 989.5, tf32=494.5, bf16=989.5, int8=1979.0, fp8=1979.0),
          runtime_tflops={DType.int8: H200_RUNTIME_INT8_TOPS},
          precisions=_SM89, intra_node_bandwidth_gb_per_s=450.0, host_link_gb_per_s=64.0,
          tdp_w=700.0, source="DEVICES.md N1, N11, X5 (sparse figures halved); "
          + _HOPPER_INT8.format(how="measured on an H200")),
)

CATALOG: dict[str, DeviceSpec] = {d.name: d for d in _CATALOG}
if tuple(CATALOG) != CATALOG_NAMES:  # one list of names, the schemas check it
    raise RuntimeError(f"device_names.CATALOG_NAMES {CATALOG_NAMES} does not match the "
                       f"catalog {tuple(CATALOG)}")
if tuple(n for n, d in CATALOG.items() if DType.int4 in d.peak_tflops) != INT4_CARDS:
    raise RuntimeError(f"device_names.INT4_CARDS {INT4_CARDS} does not match the catalog's "
                       "INT4 peaks")


def base_device(name: str) -> str:
    """The device a name is built on: ``cpu`` for a derived CPU, else the canonical name."""
    key = canonical_name(name)
    return CPU if key.startswith("cpu/") else key.removesuffix(INT4_SUFFIX)


def get_device(name: str) -> DeviceSpec:
    """The catalog entry for ``name`` (an alias works); ``cpu`` is measured on first use.

    A derived CPU (``cpu/2``, ``cpu/2:4g~t4``) is built from the measured ``cpu``;
    ``NAME:int4`` is NAME with int4 added to its menu (:func:`_with_int4`).
    """
    key = canonical_name(name)
    if has_int4(key):
        return _with_int4(key)
    if key == CPU:
        return measure_cpu()
    if key.startswith("cpu/"):
        return _derived_cpu(key)
    return CATALOG[key]


@lru_cache(maxsize=64)
def _derived_cpu(key: str) -> DeviceSpec:
    m = DERIVED_RE.match(key)
    assert m is not None  # canonical_name checked it
    base = measure_cpu()
    factor = float(m["factor"])
    memory, usable = base.memory_bytes, base.usable_memory_bytes
    notes = [f"slowed {number_text(factor)}x"]
    if m["mem"] is not None:
        cap = int(float(m["mem"]) * (GiB if m["unit"] == "g" else MiB))
        memory, usable = cap, min(usable, cap)
        notes.append(f"memory capped at {number_text(float(m['mem']))} {'GiB' if m['unit'] == 'g' else 'MiB'}")
    precisions = list(base.precisions)
    display = base.display_name
    if m["card"] is not None:
        card = CATALOG[m["card"]]
        precisions = [p for p in precisions if card.supports(p)]
        notes.append(f"precision menu of {card.name} ({', '.join(p.value for p in precisions)})")
        display = f"{display}, standing in for {card.display_name}"
    needed = {DeviceSpec.rate_key(dt) for p in precisions
              for dt in (p.info.fwd_compute, p.info.bwd_compute)}
    return DeviceSpec(
        name=key,
        display_name=f"{display} / {number_text(factor)}",
        compute_capability=None,
        memory_bytes=memory,
        usable_memory_bytes=usable,
        memory_bandwidth_gb_per_s=base.memory_bandwidth_gb_per_s / factor,
        peak_tflops={k: v / factor for k, v in base.peak_tflops.items() if k in needed},
        precisions=precisions,
        intra_node_bandwidth_gb_per_s=base.intra_node_bandwidth_gb_per_s,
        host_link_gb_per_s=base.host_link_gb_per_s,
        tdp_w=None,
        source=f"emulation: derived from the measured cpu ({'; '.join(notes)}); the runtime "
        f"stretches this rank's measured compute time {number_text(factor)}x. Base cpu: {base.source}",
        measured=True,
        slowdown=factor,
    )


@lru_cache(maxsize=64)
def _with_int4(key: str) -> DeviceSpec:
    """``NAME:int4``: NAME's spec with int4 on its menu (canonical_name checked the card).

    A catalog card keeps its published INT4 peak; a derived CPU gets an int4 rate equal to
    its int8 rate (int4 runs through this CPU's int8 GEMM: exact, no faster).
    """
    base = get_device(key.removesuffix(INT4_SUFFIX))
    peaks = dict(base.peak_tflops)
    note = "int4 enabled (opt-in) at its published INT4 peak"
    if base.measured:
        peaks[DType.int4] = peaks[DType.int8]
        note = ("int4 enabled (opt-in): on this CPU int4 values live in int8 storage and run "
                "through the int8 GEMM, so its rate is the int8 rate (no speed gain here)")
    return base.model_copy(update={
        "name": key, "display_name": f"{base.display_name} + int4",
        "peak_tflops": peaks, "precisions": [*base.precisions, P.int4],
        "source": f"{base.source}; {note}"})


def int4_device(name: str) -> str | None:
    """``name`` with int4 enabled (``t4`` -> ``t4:int4``), or None when its card has no INT4
    peak. A name that already has int4 comes back as it is."""
    key = canonical_name(name)
    if has_int4(key):
        return key
    return key + INT4_SUFFIX if can_enable_int4(key) else None


def enable_int4(cluster: ClusterSpec) -> tuple[ClusterSpec, list[str]]:
    """Add int4 to the menu of every group whose card has an INT4 peak (T4, A10, or a
    derived CPU standing in for one): the group's device becomes ``NAME:int4``.

    Returns the cluster and the names of the groups that have int4 (enabled here or
    already). Groups on other cards are left as they are.
    """
    groups, got = [], []
    for g in cluster.groups:
        dev = int4_device(g.device)
        if dev is None:
            groups.append(g)
            continue
        got.append(g.name)
        groups.append(g if dev == g.device else g.model_copy(update={"device": dev}))
    return cluster.model_copy(update={"groups": groups}), got


# ----------------------------------------------------------------------------- the CPU


def _meminfo_bytes(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@lru_cache(maxsize=1)
def measure_cpu() -> DeviceSpec:
    """Measure this CPU once per process (and cache on disk per CPU model and torch).

    The peak rates are what torch achieves on 1024x1024 matmuls per dtype (fp16: 256x256,
    it has no fast kernel on this CPU), median of 5, so
    they already include this machine's efficiency; the estimator is told so by
    ``measured=True``. Bandwidth is a 64 MiB copy (read + write bytes).
    """
    # lazy: measuring imports torch; `import qsync_opt` reaches this module and must not
    from qsync_opt.costs import cpu

    cpu_model = cpu_model_name()
    key = f"{cpu_model}|{cpu.torch_key()}"
    cache = cache_root() / "cpu_spec.json"
    figures: dict[str, float] | None = None
    # One entry per key (CPU, torch, thread count): runs at different thread counts on one
    # machine must not keep overwriting each other's figures (and re-measuring).
    entries: dict[str, Any] = {}
    try:
        cached = json.loads(cache.read_text())
        entries = cached.get("entries", {}) if isinstance(cached, dict) else {}
        if key in entries:
            figures = {k: float(v) for k, v in entries[key].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        figures = None
    if figures is None:
        log.info("measuring this CPU's matmul throughput and bandwidth (once, cached)")
        figures = cpu.measure_figures()
        try:
            entries = {k: v for k, v in entries.items() if isinstance(v, dict)}
            entries[key] = figures
            atomic_write_text(cache, json.dumps({"entries": entries}, indent=1))
        except OSError as exc:  # a read-only home must not stop planning
            log.warning("could not cache CPU figures at %s: %s", cache, exc)
    total = _meminfo_bytes("MemTotal") or 8 * GiB
    usable = min(total, _meminfo_bytes("MemAvailable") or total)
    rates = {DType.fp32: figures["fp32"], DType.bf16: figures["bf16"],
             DType.fp16: figures["fp16"], DType.int8: figures["int8"]}
    return DeviceSpec(
        name=CPU,
        display_name=f"{cpu_model} ({int(figures['threads'])} threads)",
        compute_capability=None,
        memory_bytes=total,
        usable_memory_bytes=usable,
        memory_bandwidth_gb_per_s=round(figures["copy_gb_per_s"], 2),
        peak_tflops={k: round(v, 4) for k, v in rates.items()},
        precisions=[P.fp32, P.bf16, P.fp16, P.int8, P.int8_full],
        intra_node_bandwidth_gb_per_s=round(figures["copy_gb_per_s"], 2),
        host_link_gb_per_s=round(figures["copy_gb_per_s"], 2),
        tdp_w=None,
        source=f"measured here with torch {cpu.torch_version()}: 1024^3 matmul per dtype "
        "(fp16 256^3), 64 MiB copy; memory from /proc/meminfo",
        measured=True,
    )
