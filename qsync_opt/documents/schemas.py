"""Schemas: every arrow of the data flow (docs/ARCHITECTURE.md) is one of these pydantic models,
named here from the modules that define them (:mod:`~qsync_opt.documents.base`,
:mod:`~qsync_opt.documents.hardware`, :mod:`~qsync_opt.documents.opgraph`,
:mod:`~qsync_opt.documents.costing`, :mod:`~qsync_opt.documents.solution`): callers import
them from this module.

All models are frozen and forbid unknown fields; every number is checked for the whole
class of input (finite floats, no bools or strings for numbers, sane size limits): see
:mod:`~qsync_opt.documents.base`, where the number types and limits are.
"""

from __future__ import annotations

from typing import Any

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.documents.base import (
    DEVICE_NAME_RE,
    FLOP_CONVENTION,
    FROM_FILE,
    MAX_BATCH,
    MAX_DEVICES,
    MAX_DEVICES_PER_NODE,
    MAX_GROUPS,
    MAX_OPS,
    NAME_RE,
    Document,
    Int,
    JSONScalar,
    Real,
    Schema,
    header_problem,
    parse_document,
    to_json,
    written,
)
from qsync_opt.documents.costing import (
    CastCost,
    CommModel,
    CostSource,
    CostTable,
    Efficiencies,
    GradBucket,
    IndicatorTable,
    OpCost,
    OptimizerCost,
)
from qsync_opt.documents.hardware import ClusterSpec, DeviceGroup, DeviceSpec
from qsync_opt.documents.opgraph import Edge, ModelGraph, OpKind, OpNode, OpRole, TensorSpec
from qsync_opt.documents.solution import GroupPlan, Plan, SolveReport

__all__ = [
    "DEVICE_NAME_RE", "FLOP_CONVENTION", "FROM_FILE", "MAX_BATCH", "MAX_DEVICES",
    "MAX_DEVICES_PER_NODE", "MAX_GROUPS", "MAX_OPS", "NAME_RE", "SCHEMAS", "SUB_SCHEMAS",
    "CastCost", "ClusterSpec", "CommModel", "CostSource", "CostTable", "DeviceGroup",
    "DeviceSpec", "Document", "Edge", "Efficiencies", "GradBucket", "GroupPlan",
    "IndicatorTable", "Int", "JSONScalar", "ModelGraph", "OpCost", "OpKind", "OpNode", "OpRole",
    "OptimizerCost", "Plan", "Real", "Schema", "SolveReport", "TensorSpec", "header_problem",
    "json_schema", "parse_document", "schema_names", "to_json", "written",
]


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
