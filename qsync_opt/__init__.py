"""qsync-opt: plan and run synchronous data-parallel training on mixed GPU clusters.

Pipeline (docs/DESIGN.md): workload -> :func:`trace` -> ModelGraph; device catalog + cluster spec
-> :func:`estimate` -> CostTable; later stages add the indicator, the allocation problem and
its solvers, the replayer, the plan and the training runtime. Every arrow is a schema in
:mod:`qsync_opt.schemas`, written and read by :mod:`qsync_opt.io`.
"""

from __future__ import annotations

from .cluster import load_cluster, parse_shorthand
from .costs import estimate
from .devices import CATALOG, get_device, known_device_names
from .errors import QsyncInputError, SchemaVersionError, TraceError
from .graph import trace
from .io import load, save
from .precision import DType, Precision
from .schemas import (
    ClusterSpec,
    CostTable,
    DeviceGroup,
    DeviceSpec,
    Efficiencies,
    IndicatorTable,
    ModelGraph,
    OpNode,
    Plan,
    SolveReport,
)

__version__ = "0.1.0"

__all__ = [
    "CATALOG", "ClusterSpec", "CostTable", "DType", "DeviceGroup", "DeviceSpec",
    "Efficiencies", "IndicatorTable", "ModelGraph", "OpNode", "Plan", "Precision",
    "QsyncInputError", "SchemaVersionError", "SolveReport", "TraceError", "estimate",
    "get_device", "known_device_names", "load", "load_cluster", "parse_shorthand", "save",
    "trace",
]
