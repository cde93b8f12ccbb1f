"""What the planner writes: a :class:`Plan` (a precision for every op on every group) and a
:class:`SolveReport` (what the solver did)."""

from __future__ import annotations

import math
import os
from typing import Any, ClassVar, Literal, Self

from pydantic import (
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from qsync_opt.core.precision import Precision
from qsync_opt.documents.base import (
    MAX_BATCH,
    MAX_GROUPS,
    MAX_OPS,
    Document,
    Int,
    JSONScalar,
    Real,
    Schema,
    finite_or_none,
)
from qsync_opt.documents.hardware import ClusterSpec


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
        return finite_or_none(v, "provenance", info)

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
