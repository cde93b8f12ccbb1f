"""Schemas: every arrow of the data flow (docs/ARCHITECTURE.md) is one of these pydantic models.

All models are frozen and forbid unknown fields. The ones written to disk derive from
:class:`Document` and carry ``schema_name`` and ``schema_version``; a reader refuses a file of
another kind or of a version it does not know, with a message that says which. Units are in
the field names (``_ms``, ``_bytes``, ``_gb_per_s``, ``_us``, ``_tflops``); FLOPs count a
multiply-add as two.

Numbers are checked for the whole class of input, not field by field: every float of every
schema must be finite (``allow_inf_nan=False``: Infinity and NaN are refused naming the
field; only SolveReport, an output no command reads, may hold a bound of -inf); integer and float fields refuse ``true``/``false`` and strings (:data:`Int`,
:data:`Real`: a bool is an int in Python); sizes have sane upper limits, named in the
message (:data:`MAX_GROUPS`, :data:`MAX_DEVICES`, :data:`MAX_DEVICES_PER_NODE`,
:data:`MAX_BATCH`, :data:`MAX_OPS`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import weakref
from collections import Counter
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Self, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from qsync_opt.core.device_names import canonical_name
from qsync_opt.core.errors import (
    QsyncInputError,
    SchemaVersionError,
    describe_validation_error,
    one_line,
)
from qsync_opt.core.precision import DType, Precision
from qsync_opt.documents.files import atomic_write_text, check_depth, read_json

NAME_RE = r"^[A-Za-z_][A-Za-z0-9_\-]*$"
#: A device name: a catalog key, or a derived CPU such as ``cpu/2:4g~t4`` (costs/devices.py).
DEVICE_NAME_RE = r"^[A-Za-z_][A-Za-z0-9_\-]*(/[0-9.]+(:[0-9.]+[gm])?(~[A-Za-z0-9_]+)?)?(:int4)?$"
FLOP_CONVENTION = "a multiply-add counts as 2 FLOPs"

JSONScalar = float | int | str | bool | None

#: Sane limits. Beyond them an input is a mistake (10^30 devices, a batch of 25 digits), and
#: the solvers' integer scaling or a quadratic check would loop on it.
MAX_GROUPS = 1024  # device groups in a cluster (decision copies of the program)
MAX_DEVICES = 1_000_000  # devices in a group, and in the whole cluster
MAX_DEVICES_PER_NODE = 1024
MAX_BATCH = 1_048_576  # samples per device per iteration (2**20)
MAX_OPS = 100_000  # operators in a graph

#: Validation context of a document read from a file (see :func:`parse_document`).
FROM_FILE = "qsync_from_file"


def _no_bool_or_str(kind: str) -> Any:
    def check(v: Any) -> Any:
        if isinstance(v, (bool, str, bytes)):
            raise ValueError(f"expected {kind}, got {json.dumps(v) if isinstance(v, bool) else repr(v)}")
        return v
    return BeforeValidator(check)


#: An integer field: ``true``/``false`` and strings are refused (pydantic's lax mode takes
#: ``true`` as 1 and ``"16"`` as 16).
Int = Annotated[int, _no_bool_or_str("an integer")]
#: A float field (finite: every schema has ``allow_inf_nan=False``); bools and strings refused.
Real = Annotated[float, _no_bool_or_str("a number")]


#: Hashes of documents, computed once each: (id, kind) -> (weak reference, hash).
_HASHES: dict[tuple[int, str], tuple[weakref.ref[Any], str]] = {}


def _memo(doc: Any, kind: str, compute: Callable[[], str]) -> str:
    """``compute()`` for ``doc``, once per document: the schemas are frozen, so a
    document's hash never changes (``model_copy`` makes a new document, hashed anew). The
    entry goes when the document does."""
    key = (id(doc), kind)
    hit = _HASHES.get(key)
    if hit is not None and hit[0]() is doc:
        return hit[1]
    value = compute()

    def gone(ref: weakref.ref[Any], key: tuple[int, str] = key) -> None:
        if _HASHES.get(key, (None, ""))[0] is ref:
            del _HASHES[key]

    _HASHES[key] = (weakref.ref(doc, gone), value)
    return value


class Schema(BaseModel):
    """Base of every schema: frozen, unknown fields refused, every float finite."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False,
                              allow_inf_nan=False)


def _finite_or_none(values: Any, field: str, info: ValidationInfo) -> Any:
    """Free-form JSON scalars (provenance, options): a non-finite float made in memory (a
    solver's bound of -inf) becomes None, as it is written to JSON; one read from a file is
    refused, naming the key."""
    if not isinstance(values, dict):
        return values
    from_file = bool(info.context and info.context.get(FROM_FILE))
    out = {}
    for k, v in values.items():
        if isinstance(v, float) and not math.isfinite(v):
            if from_file:
                raise ValueError(f"{field}.{k}: Input should be a finite number")
            v = None
        out[k] = v
    return out


def written(value: object) -> str:
    """A parsed JSON value spelled as in the file where Python's repr differs (``true``,
    ``null``); strings quoted."""
    return json.dumps(value) if value is None or isinstance(value, bool) else repr(value)


def header_problem(data: dict[str, Any], cls: type[Document]) -> str | None:
    """What is wrong with a document's header for ``cls`` (another ``schema_name``, or a
    ``schema_version`` that is not exactly the integer this qsync-opt reads: ``true`` is not
    1, ``1.0`` is not 1), or None; a missing field reads as ``cls``'s. The one version check:
    :class:`Document`'s validator and :func:`parse_document` both call it."""
    name = data.get("schema_name", cls.SCHEMA_NAME)
    version = data.get("schema_version", cls.SCHEMA_VERSION)
    if name != cls.SCHEMA_NAME:
        return f"schema_name is {written(name)}, expected {cls.SCHEMA_NAME!r}"
    if type(version) is not int or version != cls.SCHEMA_VERSION:
        return (f"schema_version {written(version)} of {cls.SCHEMA_NAME} is not one this "
                f"qsync-opt reads (it reads version {cls.SCHEMA_VERSION})")
    return None


class Document(Schema):
    """A schema that is written to disk. Subclasses set ``SCHEMA_NAME``/``SCHEMA_VERSION``."""

    SCHEMA_NAME: ClassVar[str] = "Document"
    SCHEMA_VERSION: ClassVar[int] = 1

    schema_name: str = Field("Document", description="Kind of document; fixed per schema.")
    schema_version: Int = Field(1, description="Version of that schema's layout.")

    @model_validator(mode="before")
    @classmethod
    def _check_header(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        problem = header_problem(data, cls)
        if problem is not None:
            raise ValueError(problem)
        data["schema_name"] = data.get("schema_name", cls.SCHEMA_NAME)
        data["schema_version"] = data.get("schema_version", cls.SCHEMA_VERSION)
        return data

    def save(self, path: str | os.PathLike[str], *, what: str | None = None) -> Path:
        """Write this document as JSON (:func:`to_json`), atomically (see
        :func:`qsync_opt.documents.files.atomic_write`); ``what``: the flag or field the path came
        from, named by a failed write."""
        return atomic_write_text(path, to_json(self), what=what)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Self:
        """Read a document of this type from a JSON file, refusing other kinds and versions
        clearly (:func:`parse_document`)."""
        return parse_document(read_json(path), cls, where=str(path))

    def content_hash(self) -> str:
        """sha256 of the canonical JSON, the first 16 hex digits (provenance, plan checks);
        computed once per document (:func:`_memo`)."""
        def compute() -> str:
            payload = json.dumps(self.model_dump(mode="json"), sort_keys=True,
                                 separators=(",", ":"))
            return hashlib.sha256(payload.encode()).hexdigest()[:16]

        return _memo(self, "content", compute)


# --------------------------------------------------------------------------- devices


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


# --------------------------------------------------------------------------- graph


class OpKind(StrEnum):
    """What an operator computes; decides its FLOPs, its precision menu and its dtype rule."""

    linear = "linear"
    conv = "conv"
    matmul = "matmul"
    embedding = "embedding"
    norm = "norm"
    softmax = "softmax"
    loss = "loss"
    activation = "activation"
    pool = "pool"
    dropout = "dropout"
    elementwise = "elementwise"
    reshape = "reshape"
    concat = "concat"
    reduce = "reduce"
    other = "other"


class OpRole(StrEnum):
    """How an operator's precision is decided."""

    choosable = "choosable"  # a decision variable of the allocation problem
    pinned = "pinned"  # fixed precision (pin_reason says why)
    pass_through = "pass_through"  # runs in its input's dtype (relu, dropout, pool, reshape)
    promote = "promote"  # several inputs: runs in the widest of them (add, cat)


class TensorSpec(Schema):
    name: str = Field(description="Input name.")
    shape: list[Int] = Field(description="Shape.")
    dtype: str = Field(description="torch dtype name, e.g. 'float32', 'int64'.")


class OpNode(Schema):
    """One operator of the traced graph, at the traced batch and FP32."""

    name: str = Field(min_length=1, description="Module FQN where a module exists, else graph node.")
    kind: OpKind
    target: str = Field(description="Module class or function that runs the op.")
    role: OpRole
    allowed_precisions: list[Precision] = Field(
        description="Precisions the op kind allows (the device menu is intersected later)."
    )
    pin_reason: str | None = Field(None, description="Why a pinned op is pinned.")
    input_shapes: list[list[Int]] = Field(description="Shapes of tensor inputs.")
    output_shapes: list[list[Int]] = Field(description="Shapes of tensor outputs.")
    weight_shape: list[Int] | None = Field(None, description="Shape of the main weight.")
    param_count: Int = Field(ge=0, description="Parameters owned by the op's module.")
    input_numel: Int = Field(ge=0, description="Elements read from activation inputs.")
    output_numel: Int = Field(ge=0, description="Elements written to outputs.")
    fwd_flops: Int = Field(ge=0, description=f"Forward FLOPs ({FLOP_CONVENTION}).")
    bwd_flops: Int = Field(ge=0, description=f"Backward FLOPs ({FLOP_CONVENTION}).")
    fwd_bytes: Int = Field(ge=0, description="Bytes moved forward at FP32 (inputs+outputs+params).")
    saved_bytes: Int = Field(
        ge=0, description="Activation bytes this op saves for backward, measured at FP32 "
        "(saved-tensor hooks; parameters excluded)."
    )
    saved_shared_bytes: Int = Field(
        ge=0, description="Part of saved_bytes already saved by an earlier op (same storage)."
    )
    needs_input_grad: bool = Field(
        True, description="Whether backward computes the input gradient (False on the first layer)."
    )
    depth: Int = Field(ge=0, description="Longest path from the input counting computing ops.")
    hidden_gemms: Int = Field(0, ge=0, description="GEMM calls run inside this op where the "
                              "tracer kept a Python function as one op (torch.fx.wrap): work "
                              "the planner cannot choose a precision for.")
    tie_group: str | None = Field(
        None, description="Ops of one tie group share one decision ('module:' groups are the "
        "calls of one module, always tied; others come from the optional tie mode)."
    )

    @model_validator(mode="after")
    def _check(self) -> OpNode:
        if self.saved_shared_bytes > self.saved_bytes:
            raise ValueError("saved_shared_bytes exceeds saved_bytes")
        if self.role == OpRole.choosable and len(self.allowed_precisions) < 2:
            raise ValueError("a choosable op needs at least two allowed_precisions")
        if self.role == OpRole.pinned and not self.pin_reason:
            raise ValueError("a pinned op needs a pin_reason")
        return self

    @property
    def choosable(self) -> bool:
        return self.role == OpRole.choosable

    @property
    def unique_saved_bytes(self) -> int:
        return self.saved_bytes - self.saved_shared_bytes

    @property
    def module_name(self) -> str:
        """The module whose weights the op uses: a module called several times is one
        ('module:' tie group, named after its first call); otherwise the op's own name."""
        tie = self.tie_group or ""
        return tie[len("module:"):] if tie.startswith("module:") else self.name


class Edge(Schema):
    """A tensor flowing from one op to another."""

    src: str
    dst: str
    shape: list[Int]
    numel: Int = Field(ge=0)
    bytes: Int = Field(ge=0, description="Bytes at the traced dtype.")
    dtype: str = Field("float32", description="torch dtype of the tensor as traced, e.g. "
                       "'float32', 'int64', 'bool'; only floating edges carry casts.")

    @property
    def is_float(self) -> bool:
        return self.dtype in ("float32", "float16", "bfloat16", "float64")


class ModelGraph(Document):
    """The operator graph of one workload at one batch, FP32, in topological order."""

    SCHEMA_NAME: ClassVar[str] = "ModelGraph"
    schema_name: Literal["ModelGraph"] = Field("ModelGraph", description="Kind of document.")
    schema_version: Literal[1] = Field(1, description="Layout version this file uses.")

    workload: str = Field(description="Registry name, or the user's module spec.")
    workload_sha256: str | None = Field(
        None, pattern=r"^[0-9a-f]{64}$",
        description="sha256 of the user's model file the graph was traced from (None for a "
        "registry workload); a plan made from it carries it, and the file given to a command "
        "reading that plan must have it before it is run.")
    batch_size: Int = Field(ge=1, le=MAX_BATCH, description="Batch the graph was traced at.")
    inputs: list[TensorSpec]
    ops: list[OpNode] = Field(min_length=1, max_length=MAX_OPS)
    edges: list[Edge]
    max_depth: Int = Field(ge=0, description="Largest depth L (the indicator's graph depth).")
    param_count: Int = Field(ge=0)
    param_bytes: Int = Field(ge=0, description="FP32 parameter bytes.")
    buffer_bytes: Int = Field(ge=0, description="Bytes of buffers (BN running stats, masks).")
    trace_method: str = Field(description="'fx' or 'function_mode' (the fallback).")
    tie_mode: str = Field("none", description="How tie groups were formed.")
    flop_convention: str = Field(FLOP_CONVENTION)
    torch_version: str = Field(description="torch that traced it.")

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data: Any) -> Any:
        ops = data.get("ops") if isinstance(data, dict) else None
        if isinstance(ops, (list, tuple)) and len(ops) > MAX_OPS:
            raise ValueError(f"ops: {len(ops)} ops, more than the {MAX_OPS} a graph may have")
        return data

    @model_validator(mode="after")
    def _check(self) -> ModelGraph:
        names = [o.name for o in self.ops]
        seen: set[str] = set()
        for n in names:
            if n in seen:
                raise ValueError(f"op names must be unique; repeated: {n}")
            seen.add(n)
        order = {n: i for i, n in enumerate(names)}
        for e in self.edges:
            for end in (e.src, e.dst):
                if end not in order:
                    raise ValueError(f"edge {e.src} -> {e.dst} names an unknown op {end!r}")
            if order[e.src] >= order[e.dst]:
                raise ValueError(f"edge {e.src} -> {e.dst} breaks the topological order")
        return self

    def op(self, name: str) -> OpNode:
        for o in self.ops:
            if o.name == name:
                return o
        raise KeyError(name)

    def choosable_ops(self) -> list[OpNode]:
        return [o for o in self.ops if o.choosable]

    def structure_hash(self) -> str:
        """Hash of what a plan depends on: op names, kinds, roles, shapes and edges
        (computed once per graph, :func:`_memo`)."""
        def compute() -> str:
            payload = [(o.name, o.kind.value, o.role.value, o.input_shapes, o.output_shapes)
                       for o in self.ops] + [(e.src, e.dst) for e in self.edges]
            return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]

        return _memo(self, "structure", compute)

    @property
    def total_fwd_flops(self) -> int:
        return sum(o.fwd_flops for o in self.ops)

    @property
    def saved_activation_bytes(self) -> int:
        """Activation bytes held for backward at FP32, each storage counted once."""
        return sum(o.unique_saved_bytes for o in self.ops)


# --------------------------------------------------------------------------- costs


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


# --------------------------------------------------------------------------- plan


class GroupPlan(Schema):
    batch_per_device: Int = Field(ge=1, le=MAX_BATCH)
    precisions: dict[str, Precision] = Field(max_length=MAX_OPS,
                                             description="Op name -> precision, every op chosen.")


class Plan(Document):
    """Which precision every choosable op runs at on every device group."""

    SCHEMA_NAME: ClassVar[str] = "Plan"
    schema_name: Literal["Plan"] = Field("Plan", description="Kind of document.")
    schema_version: Literal[1] = Field(1, description="Layout version this file uses.")

    workload: str
    workload_sha256: str | None = Field(
        None, pattern=r"^[0-9a-f]{64}$",
        description="sha256 of the user's model file (workload PATH.py:FUNCTION) the plan was "
        "made from; None for a registry workload. A plan never runs that file: the user passes "
        "it (--model), and its content must have this hash.")
    graph_hash: str
    cluster: ClusterSpec
    groups: dict[str, GroupPlan] = Field(max_length=MAX_GROUPS)
    provenance: dict[str, JSONScalar] = Field(
        default_factory=dict,
        description="solver, status, objective, gap, wall_s, costs/indicator hashes, options.",
    )

    @field_validator("provenance", mode="before")
    @classmethod
    def _finite_provenance(cls, v: Any, info: ValidationInfo) -> Any:
        return _finite_or_none(v, "provenance", info)

    @model_validator(mode="after")
    def _groups_match(self) -> Plan:
        names = {g.name for g in self.cluster.groups}
        if set(self.groups) != names:
            raise ValueError(
                f"groups {sorted(self.groups)} do not match the cluster's {sorted(names)}"
            )
        return self

    @classmethod
    def load(cls, path: str | os.PathLike[str], graph: object = None) -> Self:
        """Read a Plan. Whether it belongs to a graph is :func:`qsync_opt.problem.plan.check_plan`'s
        to say, called on the plan this returns: given ``graph`` this refuses (TypeError)
        rather than return a plan it did not check."""
        if graph is not None:
            raise TypeError("Plan.load(path) reads a plan without checking it against a "
                            "graph: call qsync_opt.problem.plan.check_plan(plan, graph) on the plan "
                            "it returns")
        return super().load(path)


class SolveReport(Document):
    """What a solver did. Written by the program, read by none of its commands: its floats
    may be non-finite in memory (a bound of -inf: no bound), written as null."""

    model_config = ConfigDict(allow_inf_nan=True)
    SCHEMA_NAME: ClassVar[str] = "SolveReport"
    schema_name: Literal["SolveReport"] = Field("SolveReport", description="Kind of document.")
    schema_version: Literal[1] = Field(1, description="Layout version this file uses.")

    solver: str
    status: Literal["OPTIMAL", "FEASIBLE", "INFEASIBLE", "TIME_LIMIT", "ERROR"]
    mode: str = Field(description="Objective mode that ran, and why.")
    objective: Real | None = None
    bound: Real | None = None
    gap: Real | None = None
    build_s: Real = Field(0.0, ge=0, allow_inf_nan=False)  # a time taken is finite
    solve_s: Real = Field(0.0, ge=0, allow_inf_nan=False)
    wall_s: Real = Field(0.0, ge=0, allow_inf_nan=False)
    n_variables: Int = Field(0, ge=0)
    n_constraints: Int = Field(0, ge=0)
    options: dict[str, JSONScalar] = Field(default_factory=dict)
    messages: list[str] = Field(default_factory=list)
    rounds: list[dict[str, JSONScalar]] = Field(
        default_factory=list,
        description="Solve-replay refinement: per round the target, linear and replayer "
        "makespan and the objective.")

    @field_validator("objective", "bound", "gap")
    @classmethod
    def _none_if_not_finite(cls, v: float | None) -> float | None:
        """A non-finite objective, bound or gap (-inf: no bound) is None, as the file
        writes it, so a report read back equals the one written."""
        return v if v is None or math.isfinite(v) else None

    @field_validator("options")
    @classmethod
    def _options_finite(cls, v: dict[str, Any]) -> dict[str, Any]:
        return {k: _null_if_not_finite(x) for k, x in v.items()}

    @field_validator("rounds")
    @classmethod
    def _rounds_finite(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: _null_if_not_finite(x) for k, x in r.items()} for r in v]


def _null_if_not_finite(x: Any) -> Any:
    """A JSON scalar as the file holds it: a non-finite float is null."""
    return None if isinstance(x, float) and not math.isfinite(x) else x


SCHEMAS: dict[str, type[Document]] = {
    cls.SCHEMA_NAME: cls
    for cls in (DeviceSpec, ClusterSpec, ModelGraph, CostTable, IndicatorTable, Plan, SolveReport)
}
#: Sub-schemas (not files on their own) that `qsync-opt schema` also prints.
SUB_SCHEMAS: dict[str, type[Schema]] = {
    "DeviceGroup": DeviceGroup,
    "OpNode": OpNode,
    "Edge": Edge,
    "OpCost": OpCost,
    "CastCost": CastCost,
    "Efficiencies": Efficiencies,
    "GroupPlan": GroupPlan,
}


def schema_names() -> list[str]:
    return sorted([*SCHEMAS, *SUB_SCHEMAS])


def json_schema(name: str) -> dict[str, Any]:
    cls = SCHEMAS.get(name) or SUB_SCHEMAS.get(name)
    if cls is None:
        raise QsyncInputError(f"unknown schema {name!r}; known: {', '.join(schema_names())}")
    return cls.model_json_schema()


D = TypeVar("D", bound=Document)


def to_json(doc: Document, indent: int | None = 2) -> str:
    """A document's JSON as written to a file (the golden plans are this text)."""
    return doc.model_dump_json(indent=indent) + "\n"


def parse_document(data: object, cls: type[D], where: str = "") -> D:
    """Validate parsed JSON as ``cls``, refusing other kinds and unknown versions clearly."""
    prefix = f"{where}: " if where else ""
    if not isinstance(data, dict):
        raise QsyncInputError(one_line(f"{prefix}expected a JSON object holding a "
                                       f"{cls.SCHEMA_NAME}"))
    check_depth(data, where)
    problem = header_problem(data, cls)
    if problem is not None:
        raise SchemaVersionError(one_line(prefix + problem))
    try:
        return cls.model_validate(data, context={FROM_FILE: True})
    except ValidationError as exc:
        raise QsyncInputError(describe_validation_error(exc, where)) from None
    except RecursionError:  # cannot happen below MAX_DEPTH; never a traceback
        raise QsyncInputError(one_line(f"{prefix}nested too deeply")) from None
