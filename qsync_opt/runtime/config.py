"""What a training run is told: one JSON document shared by the launcher and every rank."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from ..schemas import Document


class TrainConfig(Document):
    """A training run of a plan. Written by ``qsync-opt train``, read by every rank."""

    SCHEMA_NAME: ClassVar[str] = "TrainConfig"
    schema_name: Literal["TrainConfig"] = Field("TrainConfig", description="Kind of document.")
    schema_version: Literal[1] = Field(1, description="Layout version this file uses.")

    workload: str = Field(description="Registry name of the model (qsync-opt models).")
    plan_path: str = Field(description="Plan JSON; its groups and batches drive the ranks.")
    rank_groups: list[str] = Field(
        description="Group name of each rank, in rank order (world size = its length).")
    steps: int = Field(ge=1, description="Optimizer steps to run (in total, across resumes).")
    lr: float = Field(0.05, gt=0)
    optimizer: Literal["sgd", "adam"] = "sgd"
    momentum: float = Field(0.9, ge=0, lt=1)
    seed: int = 0
    out_dir: str = Field(description="Checkpoints, metrics.jsonl and the final summary go here.")
    checkpoint_every: int = Field(0, ge=0, description="Steps between checkpoints (0: at the end only).")
    resume: bool = Field(True, description="Continue from out_dir's checkpoint when present.")
    emulate_dp: bool = Field(False, description="One process computes every rank's micro-batch.")
    slowdown: dict[str, float] = Field(
        default_factory=dict,
        description="Group -> factor by which that group's measured compute time is stretched "
                    "(emulation of a slower card on equal CPUs; from devices like 'cpu/2').")
    loss_scale: float | None = Field(
        None, description="Initial dynamic loss scale for fp16 (None: 2**16 when any rank runs "
                          "fp16, else 1).")
    max_bad_steps: int = Field(
        10, ge=1, description="Consecutive non-finite steps (skipped on every rank) before the "
                              "run stops with an error.")
    timeout_s: float = Field(120.0, gt=0, description="Collective timeout: a dead rank makes the "
                                                      "others fail within it, never hang.")
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    eval_batches: int = Field(4, ge=0, description="Held-out batches scored at the end.")
    memory_step: int | None = Field(
        None, ge=0, description="Measure this step's exact peak live tensor bytes inside each "
        "rank (CPU ranks, one replica per process; qsync_opt.runtime.memory): the summary's "
        "'memory' field. None: not measured.")

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if not self.rank_groups:
            raise ValueError("rank_groups must name at least one rank's group")
        for g, f in self.slowdown.items():
            if not f >= 1:
                raise ValueError(f"slowdown[{g}] must be >= 1, got {f}")
        return self

    @property
    def world_size(self) -> int:
        return len(self.rank_groups)
