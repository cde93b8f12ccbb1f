"""The tables the planner reads: per-op costs, casts, communication and optimizer costs
(:class:`CostTable`) and per-op degradations (:class:`IndicatorTable`)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
)

from qsync_opt.core.precision import DType, Precision
from qsync_opt.documents.base import (
    MAX_BATCH,
    MAX_DEVICES,
    Document,
    Int,
    Real,
    Schema,
)

#: "scaled": made from measured entries at other batches by a fitted batch model
#: (:mod:`qsync_opt.costs.batchmodel`).
CostSource = Literal["estimated", "measured", "scaled"]


class OpCost(Schema):
    device: str
    batch_size: Int = Field(ge=1, le=MAX_BATCH, description="Per-device batch the cost is for.")
    op: str
    precision: Precision
    fwd_ms: Real = Field(ge=0)
    bwd_ms: Real = Field(ge=0)
    source: CostSource


class CastCost(Schema):
    """Cost of converting a tensor between dtypes: a_ms_per_element * numel + b_ms."""

    device: str
    src: DType
    dst: DType
    a_ms_per_element: Real = Field(ge=0)
    b_ms: Real = Field(ge=0)
    source: CostSource

    def ms(self, numel: int) -> float:
        return self.a_ms_per_element * numel + self.b_ms


class CommModel(Schema):
    """Ring all-reduce over the whole cluster: 2(n-1)/n * bytes/bw + 2(n-1) * latency."""

    world_size: Int = Field(ge=1, le=MAX_DEVICES)
    bandwidth_gb_per_s: Real = Field(gt=0, description="Bottleneck per-direction bandwidth.")
    latency_us: Real = Field(ge=0, description="Per-hop latency.")
    bottleneck: str = Field(description="Which link sets the bandwidth.")
    source: CostSource

    def allreduce_ms(self, nbytes: int) -> float:
        n = self.world_size
        if n <= 1:
            return 0.0
        steps = 2 * (n - 1)
        return (steps / n) * nbytes / (self.bandwidth_gb_per_s * 1e9) * 1e3 + steps * (
            self.latency_us * 1e-3
        )

    def broadcast_ms(self, nbytes: int) -> float:
        """A pipelined broadcast from one rank: (n - 1) hops of latency, the bytes once."""
        n = self.world_size
        if n <= 1:
            return 0.0
        return nbytes / (self.bandwidth_gb_per_s * 1e9) * 1e3 + (n - 1) * self.latency_us * 1e-3


class GradBucket(Schema):
    """A DDP gradient bucket: the ops whose FP32 gradients it holds, in reverse order."""

    index: Int = Field(ge=0)
    ops: list[str]
    bytes: Int = Field(ge=0)
    allreduce_ms: Real = Field(ge=0)


class OptimizerCost(Schema):
    device: str
    optimizer: Literal["sgd", "adam"]
    ms: Real = Field(ge=0, description="One optimizer step over all FP32 parameters.")
    state_bytes: Int = Field(ge=0, description="Optimizer state bytes per device.")


class Efficiencies(Schema):
    """Fractions of datasheet peaks the roofline assumes. See docs/COSTS.md for provenance."""

    tensor_core_gemm: Real = Field(
        0.6, gt=0, le=1,
        description="Achieved fraction of dense tensor-core peak for training GEMMs/convs "
        "(Megatron-LM reports 52% of A100 peak end to end; per-GEMM cuBLAS is higher).",
    )
    fp32_gemm: Real = Field(
        0.75, gt=0, le=1, description="Achieved fraction of the non-tensor-core FP32 peak."
    )
    int8_gemm: Real = Field(
        0.5, gt=0, le=1,
        description="Fraction of INT8 peak; lower than 16-bit because of rescale epilogues.",
    )
    memory: Real = Field(
        0.8, gt=0, le=1, description="Achieved fraction of DRAM bandwidth (STREAM-like copies)."
    )
    launch_overhead_us: Real = Field(
        5.0, ge=0, description="Per-kernel launch and framework overhead, microseconds."
    )
    quantize_cast_factor: Real = Field(
        5.0, ge=1, description="A quantize (abs-max + scale + round) costs this many casts "
        "(QSync, IPDPS 2024)."
    )
    network: Real = Field(
        0.8, gt=0, le=1, description="Achieved fraction of link bandwidth by NCCL rings."
    )


class CostTable(Document):
    """Per-op, per-precision costs for each device type and batch, plus casts and comms."""

    SCHEMA_NAME: ClassVar[str] = "CostTable"
    schema_name: Literal["CostTable"] = Field("CostTable", description="Kind of document.")
    schema_version: Literal[1] = Field(1, description="Layout version this file uses.")

    workload: str
    graph_hash: str = Field(description="ModelGraph.structure_hash() the costs are for.")
    entries: list[OpCost]
    casts: list[CastCost]
    comm: CommModel
    buckets: list[GradBucket]
    bucket_cap_bytes: Int = Field(gt=0, description="DDP bucket size cap (25 MiB default).")
    optimizer: list[OptimizerCost]
    efficiencies: Efficiencies
    activation_flow: Literal["native", "fp32"] = Field(
        "native", description="How activations travel between ops. 'native' (the estimator, "
        "QSync's and autocast's model): a low-precision op gives out its own dtype, and casts "
        "are paid on the edges where dtypes differ. 'fp32' (tables profiled in context on "
        "qsync-opt's runtime, whose layers cast their input and weight in and their output "
        "back to fp32): activations stay fp32 between ops, every cast is inside the measured "
        "cost of the op that makes it, and the cast models are not used for time.")
    environment: dict[str, dict[str, str]] = Field(
        default_factory=dict, description="Per measured device: where and how its entries were "
        "measured (hardware, torch, cuda, threads, qsync_opt, method). Empty for estimates; "
        "merged tables keep every device's.")
    notes: list[str] = Field(default_factory=list)

    def lookup(self) -> dict[tuple[str, int, str, Precision], OpCost]:
        return {(c.device, c.batch_size, c.op, c.precision): c for c in self.entries}


# --------------------------------------------------------------------------- indicator


class IndicatorTable(Document):
    """Omega[op][precision]: each op's degradation at each precision (fp32 is 0)."""

    SCHEMA_NAME: ClassVar[str] = "IndicatorTable"
    schema_name: Literal["IndicatorTable"] = Field("IndicatorTable", description="Kind of document.")
    schema_version: Literal[1] = Field(1, description="Layout version this file uses.")

    workload: str
    graph_hash: str
    method: str = Field(description="qsync, wvar, hessian, fisher, random or curv.")
    batch_size: Int = Field(ge=1, le=MAX_BATCH, description="Batch the statistics were measured at.")
    batches: Int = Field(ge=1, description="Number of batches averaged.")
    seed: Int
    gamma: Real | None = Field(None, description="Forward weight of the qsync indicator.")
    data: str = Field(description="'real', 'synthetic' or 'given' inputs.")
    values: dict[str, dict[Precision, Real]]
    stochastic: bool = Field(True, description="int8 rounding assumed: stochastic or nearest.")
    monotone_fixes: Int = Field(0, ge=0, description="Values raised to keep each family "
                                "monotone (a lower precision never scores below a higher).")
    terms: dict[str, dict[Precision, list[Real]]] | None = Field(
        None, description="qsync method: [Var_fwd, Var_bwd] per op and precision (relative); "
        "curv: [forward, backward] expected loss increase (nats).")
    notes: list[str] = Field(default_factory=list)
    unmeasured: dict[str, str] = Field(
        default_factory=dict, description="Choosable ops the method could not measure, with "
        "why: their row has fp32 only (never a default value at another precision), and a "
        "plan keeps them fp32.")

    @model_serializer(mode="wrap")
    def _without_empty_unmeasured(self, handler: SerializerFunctionWrapHandler) -> Any:
        """``unmeasured`` is written only when it names an op, so a table without one has the
        bytes (and content hash) it had before the field existed."""
        data = handler(self)
        if isinstance(data, dict) and not data.get("unmeasured"):
            data.pop("unmeasured", None)
        return data

    @field_validator("values")
    @classmethod
    def _nonneg(cls, v: dict[str, dict[Precision, float]]) -> dict[str, dict[Precision, float]]:
        for op, row in v.items():
            for p, x in row.items():
                if not x >= 0:
                    raise ValueError(f"values[{op}][{p.value}] must be >= 0, got {x}")
        return v
