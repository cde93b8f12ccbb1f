"""qsync-opt: plan and run synchronous data-parallel training on mixed GPU clusters.

Pipeline (docs/ARCHITECTURE.md): workload -> :func:`trace` -> ModelGraph; device catalog + cluster spec
-> :func:`estimate` -> CostTable; later stages add the indicator, the allocation problem and
its solvers, the replayer, the plan and the training runtime. Every arrow is a schema in
:mod:`qsync_opt.documents.schemas`, written and read by :mod:`qsync_opt.documents.io`.
"""

from __future__ import annotations

from qsync_opt.core.errors import QsyncInputError, SchemaVersionError, TraceError
from qsync_opt.core.precision import DType, Precision
from qsync_opt.core.version import __version__ as __version__
from qsync_opt.costs.cluster import load_cluster, parse_shorthand
from qsync_opt.costs.devices import CATALOG, get_device, known_device_names
from qsync_opt.costs.roofline import estimate
from qsync_opt.documents.io import load, save
from qsync_opt.documents.schemas import (
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
from qsync_opt.graph import trace  # its tracer, which needs torch, is imported when it traces

__all__ = [
    "CATALOG", "ClusterSpec", "CostTable", "DType", "DeviceGroup", "DeviceSpec",
    "Efficiencies", "IndicatorTable", "ModelGraph", "OpNode", "Plan", "Precision",
    "QsyncInputError", "SchemaVersionError", "SolveReport", "TraceError", "estimate",
    "get_device", "known_device_names", "load", "load_cluster", "parse_shorthand", "save",
    "trace",
]
