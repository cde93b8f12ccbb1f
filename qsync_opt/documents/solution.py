"""What the planner writes: a :class:`Plan` (a precision for every op on every group) and a
:class:`SolveReport` (what the solver did)."""

from __future__ import annotations

import math
import os
from typing import Any, ClassVar, Literal, Self

from pydantic import (
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
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
from qsync_opt.documents.jobstrategy import Strategy


class GroupPlan(Schema):
    batch_per_device: Int = Field(ge=1, le=MAX_BATCH)
    precisions: dict[str, Precision] = Field(max_length=MAX_OPS,
                                             description="Op name -> precision, every op chosen.")


class Plan(Document):
    """Which precision every choosable op runs at on every device group; from version 2
    also the job's strategy (:class:`~qsync_opt.documents.jobstrategy.Strategy`: sync,
    transport, pipeline and their prediction).

    A plan without a strategy is written as version 1, byte for byte as before; it runs
    as ddp, fp32, no pipeline unless the command's flags say otherwise. A version-2 plan
    always holds its strategy, and ``train --plan`` runs exactly that."""

    SCHEMA_NAME: ClassVar[str] = "Plan"
    SCHEMA_VERSION: ClassVar[int] = 2
    SCHEMA_VERSIONS: ClassVar[tuple[int, ...]] = (1, 2)
    schema_name: Literal["Plan"] = Field("Plan", description="Kind of document.")
    schema_version: Literal[1, 2] = Field(
        1, description="Layout version this file uses: 1 without a strategy, 2 with one.")

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
    strategy: Strategy | None = Field(
        None, description="Version 2: the job's sync, transport and pipeline, as chosen and "
        "predicted by the planner (absent from version 1).")

    @field_validator("provenance", mode="before")
    @classmethod
    def _finite_provenance(cls, v: Any, info: ValidationInfo) -> Any:
        return finite_or_none(v, "provenance", info)

    @model_validator(mode="before")
    @classmethod
    def _version_of_content(cls, data: Any) -> Any:
        """A plan made in memory with a strategy is version 2; one read from a file must say
        which version it is, and a version-1 file holds no strategy."""
        if isinstance(data, dict) and "schema_version" not in data:
            data = {**data, "schema_version": 2 if data.get("strategy") is not None else 1}
        return data

    @model_validator(mode="after")
    def _strategy_matches_version(self) -> Plan:
        if self.schema_version == 1 and self.strategy is not None:
            raise ValueError("strategy: a version-1 plan holds no strategy (write "
                             "schema_version 2)")
        if self.schema_version == 2 and self.strategy is None:
            raise ValueError("strategy: a version-2 plan holds its strategy (sync, transport, "
                             "pipeline); none is given")
        return self

    @model_serializer(mode="wrap")
    def _without_absent_strategy(self, handler: SerializerFunctionWrapHandler) -> Any:
        """Version 1 is written without the strategy key, as before it existed."""
        out = handler(self)
        if isinstance(out, dict) and out.get("strategy", 0) is None:
            del out["strategy"]
        return out

    @property
    def job_strategy(self) -> Strategy:
        """The strategy the plan runs: its own (version 2), else ddp, fp32, no pipeline."""
        return self.strategy if self.strategy is not None else Strategy()

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
