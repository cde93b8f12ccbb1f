"""The operator graph document (:class:`ModelGraph`): its ops, their kinds and roles, and
the tensors between them."""

from __future__ import annotations

import hashlib
import json
from enum import StrEnum
from typing import Any, ClassVar, Literal

from pydantic import (
    Field,
    model_validator,
)

from qsync_opt.core.precision import Precision
from qsync_opt.documents.base import (
    FLOP_CONVENTION,
    MAX_BATCH,
    MAX_OPS,
    Document,
    Int,
    Schema,
    memo,
)


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
        (computed once per graph, :func:`qsync_opt.documents.base.memo`)."""
        def compute() -> str:
            payload = [(o.name, o.kind.value, o.role.value, o.input_shapes, o.output_shapes)
                       for o in self.ops] + [(e.src, e.dst) for e in self.edges]
            return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]

        return memo(self, "structure", compute)

    @property
    def total_fwd_flops(self) -> int:
        return sum(o.fwd_flops for o in self.ops)

    @property
    def saved_activation_bytes(self) -> int:
        """Activation bytes held for backward at FP32, each storage counted once."""
        return sum(o.unique_saved_bytes for o in self.ops)
