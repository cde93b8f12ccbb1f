"""The hardware documents: a device of the catalog (:class:`DeviceSpec`) and a cluster of
device groups and the network between them (:class:`ClusterSpec`)."""

from __future__ import annotations

from collections import Counter
from typing import Any, ClassVar, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from qsync_opt.core.device_names import canonical_name
from qsync_opt.core.precision import DType, Precision
from qsync_opt.documents.base import (
    DEVICE_NAME_RE,
    MAX_BATCH,
    MAX_DEVICES,
    MAX_DEVICES_PER_NODE,
    MAX_GROUPS,
    NAME_RE,
    Document,
    Int,
    Real,
    Schema,
)


class DeviceSpec(Document):
    """One accelerator type of the catalog, from its published datasheet (or measured)."""

    SCHEMA_NAME: ClassVar[str] = "DeviceSpec"
    schema_name: Literal["DeviceSpec"] = Field("DeviceSpec", description="Kind of document.")
    schema_version: Literal[1] = Field(1, description="Layout version this file uses.")

    name: str = Field(description="Catalog key, e.g. 't4', 'a100_80gb', or a derived CPU "
                      "such as 'cpu/2' (see qsync_opt.costs.devices).", pattern=DEVICE_NAME_RE)
    display_name: str = Field(description="Marketing name, e.g. 'NVIDIA T4 16 GB'.")
    compute_capability: str | None = Field(
        description="CUDA compute capability 'major.minor'; None for a CPU.",
        pattern=r"^\d+\.\d+$",
    )
    memory_bytes: Int = Field(gt=0, description="Vendor memory capacity in bytes (binary GiB).")
    usable_memory_bytes: Int = Field(
        gt=0, description="Memory a process can see (driver-reported total, ECC on), bytes."
    )
    memory_bandwidth_gb_per_s: Real = Field(gt=0, description="Peak DRAM bandwidth, GB/s (1e9).")
    peak_tflops: dict[DType, Real] = Field(
        description="Dense peak rate per compute dtype, TFLOPS (TOPS for int8); "
        "fp32 is the non-tensor-core rate."
    )
    runtime_tflops: dict[DType, Real] = Field(
        default_factory=dict,
        description="Rate this project's runtime reaches per compute dtype where it is far "
        "below peak x efficiency, TFLOPS (TOPS for int8), measured or derived from a "
        "measurement named in `source`; the estimate uses it in place of peak x efficiency. "
        "Empty: peak x efficiency everywhere.")
    precisions: list[Precision] = Field(
        min_length=1, description="Precision menu the device runs fast (its tensor-core modes)."
    )
    intra_node_bandwidth_gb_per_s: Real = Field(
        gt=0, description="Per-direction device-to-device bandwidth inside a node, GB/s."
    )
    host_link_gb_per_s: Real = Field(gt=0, description="Per-direction PCIe host link, GB/s.")
    tdp_w: Real | None = Field(None, gt=0, description="Board power, W.")
    source: str = Field(description="Where the figures come from (datasheet ids, measurement).")
    measured: bool = Field(False, description="True when the figures were measured here.")
    slowdown: Real = Field(
        1.0, ge=1, description="Factor by which the runtime stretches this device's measured "
        "compute time (emulation of a slower card on this CPU; 1 for real devices).")

    @model_validator(mode="after")
    def _check(self) -> DeviceSpec:
        if self.usable_memory_bytes > self.memory_bytes:
            raise ValueError("usable_memory_bytes exceeds memory_bytes")
        if Precision.fp32 not in self.precisions:
            raise ValueError("precisions must include fp32")
        for rate in self.peak_tflops.values():
            if not rate > 0:
                raise ValueError("peak_tflops values must be > 0")
        for p in self.precisions:
            for dt in (p.info.fwd_compute, p.info.bwd_compute):
                if self.rate_key(dt) not in self.peak_tflops:
                    raise ValueError(f"precision {p.value} needs a peak_tflops entry for {dt.value}")
        for dt, rate in self.runtime_tflops.items():
            if not (rate > 0 and dt in self.peak_tflops and rate <= self.peak_tflops[dt]):
                raise ValueError(f"runtime_tflops[{dt.value}]: expected a rate > 0 and at most "
                                 f"the peak_tflops entry for {dt.value}, got {rate}")
        return self

    @staticmethod
    def rate_key(dtype: DType) -> DType:
        """The peak-rate entry that a compute dtype runs at (e5m2 shares e4m3's rate)."""
        return DType.fp8_e4m3 if dtype == DType.fp8_e5m2 else dtype

    def peak_flops(self, dtype: DType) -> float:
        """Dense peak in FLOP/s (OP/s) for a compute dtype."""
        return self.peak_tflops[self.rate_key(dtype)] * 1e12

    def runtime_flops(self, dtype: DType) -> float | None:
        """The rate this project's runtime reaches for a compute dtype, FLOP/s (OP/s), where
        the catalog records one (``runtime_tflops``); else None (peak x efficiency)."""
        rate = self.runtime_tflops.get(self.rate_key(dtype))
        return None if rate is None else rate * 1e12

    def supports(self, precision: Precision) -> bool:
        return precision in self.precisions


# --------------------------------------------------------------------------- cluster


class DeviceGroup(Schema):
    """Devices of one type that run one plan (one decision copy in the integer program)."""

    name: str = Field(pattern=NAME_RE, description="Group name, unique in the cluster.")
    device: str = Field(description="Catalog device name (see `qsync-opt devices`).")
    count: Int = Field(ge=1, le=MAX_DEVICES, description="Number of devices in the group.")
    devices_per_node: Int = Field(8, ge=1, le=MAX_DEVICES_PER_NODE,
                                  description="Devices of this group per node.")
    batch_per_device: Int | None = Field(
        None, ge=1, le=MAX_BATCH,
        description="Samples per device per iteration; None: the workload default."
    )
    intra_node_bandwidth_gb_per_s: Real | None = Field(
        None, gt=0, description="Override of the device's per-direction intra-node bandwidth."
    )

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        canon = canonical_name(v)  # raises ValueError listing the known names
        if canon != v.strip().lower():
            try:  # every later step reads the canonical spelling back
                canonical_name(canon)
            except ValueError:
                raise ValueError(
                    f"device {v!r}: its slowdown factor or memory cap is too small or too "
                    "large for a device name (it would need an exponent); write the memory "
                    "cap in the other unit (m or g)") from None
        return canon

    @property
    def nodes(self) -> int:
        return -(-self.count // self.devices_per_node)


class ClusterSpec(Document):
    """Named device groups and the network between them."""

    SCHEMA_NAME: ClassVar[str] = "ClusterSpec"
    schema_name: Literal["ClusterSpec"] = Field("ClusterSpec", description="Kind of document.")
    schema_version: Literal[1] = Field(1, description="Layout version this file uses.")

    name: str = Field("", description="Free-form cluster name.")
    groups: list[DeviceGroup] = Field(min_length=1, max_length=MAX_GROUPS,
                                      description="Device groups.")
    inter_node_bandwidth_gb_per_s: Real = Field(
        12.5, gt=0, description="Per-direction NIC bandwidth between nodes, GB/s "
        "(default 100 Gb/s Ethernet/InfiniBand EDR = 12.5 GB/s)."
    )
    inter_node_latency_us: Real = Field(
        10.0, ge=0, description="One-hop latency between nodes, microseconds."
    )
    intra_node_latency_us: Real = Field(
        5.0, ge=0, description="One-hop latency inside a node, microseconds."
    )

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data: Any) -> Any:
        # before validating each group: a file of 600,000 groups is refused at once
        groups = data.get("groups") if isinstance(data, dict) else None
        if isinstance(groups, (list, tuple)) and len(groups) > MAX_GROUPS:
            raise ValueError(f"groups: {len(groups)} groups, more than the {MAX_GROUPS} a "
                             "cluster may have")
        return data

    @model_validator(mode="after")
    def _unique(self) -> ClusterSpec:
        counts = Counter(g.name for g in self.groups)  # linear in the number of groups
        dup = sorted(n for n, k in counts.items() if k > 1)
        if dup:
            raise ValueError(f"group names must be unique; repeated: {', '.join(dup)}")
        world = sum(g.count for g in self.groups)
        if world > MAX_DEVICES:
            raise ValueError(f"groups: {world} devices in all, more than the {MAX_DEVICES} a "
                             "cluster may have")
        return self

    @property
    def world_size(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def nodes(self) -> int:
        return sum(g.nodes for g in self.groups)

    def group(self, name: str) -> DeviceGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no group {name!r}; groups: {', '.join(x.name for x in self.groups)}")

    def with_default_batch(self, batch: int) -> ClusterSpec:
        """Fill every unset per-device batch with ``batch`` (the workload's default)."""
        groups = [
            g if g.batch_per_device is not None else g.model_copy(update={"batch_per_device": batch})
            for g in self.groups
        ]
        return self.model_copy(update={"groups": groups})

    def global_batch(self) -> int:
        if any(g.batch_per_device is None for g in self.groups):
            raise ValueError("batch_per_device is unset; call with_default_batch first")
        return sum(g.count * (g.batch_per_device or 0) for g in self.groups)
