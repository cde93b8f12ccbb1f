"""The strategy a version-2 plan carries beside its precisions: how the replicas agree
(``sync``), how gradients travel (``transport``), the optional pipeline, and what the
planner predicted for that choice.

The texts are the command line's own (``ddp``, ``local:H``, ``qsr:alpha=A,h_base=H0``;
``fp32``, ``fp16``, ``dlcp:p=P,policy=...``); this layer checks their shape only (length,
printable, the pipeline's counts). What they mean, and whether they combine, is the
strategy rules' (:mod:`qsync_opt.strategy.modes`), applied by
:func:`qsync_opt.problem.plan.check_plan` to every plan a command reads.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from qsync_opt.documents.base import MAX_BATCH, NAME_RE, Int, Real, Schema

#: A strategy text's longest form (the longest dlcp text is about 120 characters).
MAX_STRATEGY_TEXT = 200
#: The transport of today's plans: DDP's own FP32 all-reduce.
DEFAULT_TRANSPORT = "fp32"
DEFAULT_SYNC = "ddp"
#: The most pipeline stages a plan may name (the runtime's limit).
MAX_STAGES = 64

__all__ = ["DEFAULT_SYNC", "DEFAULT_TRANSPORT", "MAX_STAGES", "PipelineStrategy", "Strategy",
           "StrategyPrediction"]


def _printable(text: str, field: str) -> str:
    if not text.isprintable() or not text.strip():
        raise ValueError(f"{field}: expected a printable, non-empty text, got {text!r}")
    return text


class PipelineStrategy(Schema):
    """One rank per stage, stage ``k`` on group ``stage_groups[k]``; ``cuts`` None: cut by
    the launcher, balanced on each stage's estimated time at the plan's precisions."""

    stages: Int = Field(ge=2, le=MAX_STAGES, description="Pipeline stages, one rank each.")
    stage_groups: list[str] = Field(
        max_length=MAX_STAGES, description="The group running each stage, in stage order.")
    cuts: list[str] | None = Field(
        None, max_length=MAX_STAGES,
        description="Where each stage after the first begins (scope names of the traced "
                    "model); None: balanced by the launcher.")
    micro_batches: Int = Field(1, ge=1, le=MAX_BATCH, description="GPipe micro-batches.")
    compress_act: str = Field("none", max_length=MAX_STRATEGY_TEXT,
                              description="Activation compressor: none, topk:F, quant:B.")
    compress_grad: str = Field("none", max_length=MAX_STRATEGY_TEXT,
                               description="Boundary gradient compressor, the same forms.")
    feedback: Literal["none", "ef", "ef21", "aqsgd"] = "none"

    @model_validator(mode="after")
    def _counts(self) -> PipelineStrategy:
        if len(self.stage_groups) != self.stages:
            raise ValueError(f"stage_groups: {self.stages} stages need "
                             f"{self.stages} groups, got {len(self.stage_groups)}")
        for g in self.stage_groups:
            if not re.match(NAME_RE, g):
                raise ValueError(f"stage_groups: {g!r} is not a group name")
        if self.cuts is not None:
            if len(self.cuts) != self.stages - 1:
                raise ValueError(f"cuts: {self.stages} stages need "
                                 f"{self.stages - 1} cuts, got {len(self.cuts)}")
            for c in self.cuts:
                _printable(c, "cuts")
        _printable(self.compress_act, "compress_act")
        _printable(self.compress_grad, "compress_grad")
        return self

    def flags(self) -> str:
        """The ``train`` flags that ask for this pipeline."""
        out = [f"--pipeline-stages {self.stages}",
               "--rank-groups " + ",".join(f"{i}:{g}" for i, g in enumerate(self.stage_groups))]
        if self.cuts is not None:
            out.append("--cuts " + ",".join(self.cuts))
        if self.micro_batches != 1:
            out.append(f"--micro-batches {self.micro_batches}")
        for flag, value in (("--compress-act", self.compress_act),
                            ("--compress-grad", self.compress_grad),
                            ("--feedback", self.feedback)):
            if value != "none":
                out.append(f"{flag} {value}")
        return " ".join(out)

    def describe(self) -> str:
        cuts = "balanced cuts" if self.cuts is None else "cuts at " + ", ".join(self.cuts)
        return (f"{self.stages} stages on {', '.join(self.stage_groups)} ({cuts}), "
                f"{self.micro_batches} micro-batch(es), act {self.compress_act}, grad "
                f"{self.compress_grad}, feedback {self.feedback}")


class StrategyPrediction(Schema):
    """What the planner predicted for the strategy (per optimizer step, the whole job)."""

    step_ms: Real = Field(ge=0, description="Mean time of one optimizer step, sync "
                          "rounds amortised over their steps.")
    compute_ms: Real = Field(ge=0, description="The step without its communication: the "
                             "slowest group's forward, backward and optimizer.")
    comm_ms: Real = Field(ge=0, description="Communication not hidden behind compute, per "
                          "step (amortised).")
    bytes_per_step: Real = Field(ge=0, description="Bytes each rank sends per step "
                                 "(amortised: a round's bytes over its steps).")
    syncs_per_step: Real = Field(ge=0, le=1, description="Synchronisations per step (1: "
                                 "every step; 1/H for local:H).")
    samples_per_s: Real = Field(ge=0, description="Global batch over step_ms.")
    degradation: Real | None = Field(None, description="The precision plan's objective "
                                     "(batch-weighted Omega), as the solver reports it.")
    comm_model: str = Field(max_length=MAX_STRATEGY_TEXT,
                            description="How communication was priced: the replayer's "
                                        "alpha-beta ring, or the packet simulator.")


class Strategy(Schema):
    """The job's strategy: ``sync``, ``transport`` and optionally ``pipeline``, with what the
    planner predicted for it and the quality risks it takes (texts the report prints)."""

    sync: str = Field(DEFAULT_SYNC, max_length=MAX_STRATEGY_TEXT,
                      description="ddp, local:H or qsr:alpha=A,h_base=H0[,power=P].")
    transport: str = Field(DEFAULT_TRANSPORT, max_length=MAX_STRATEGY_TEXT,
                           description="fp32, fp16 or dlcp:p=P[,policy=...]: the gradient "
                                       "transport of ddp's all-reduce.")
    pipeline: PipelineStrategy | None = None
    predicted: StrategyPrediction | None = None
    risks: list[str] = Field(default_factory=list, max_length=16,
                             description="The quality risks this strategy takes, as the "
                                         "planner stated them.")
    space: str | None = Field(None, max_length=4 * MAX_STRATEGY_TEXT,
                              description="The strategy space the planner searched.")

    @model_validator(mode="after")
    def _texts(self) -> Strategy:
        _printable(self.sync, "sync")
        _printable(self.transport, "transport")
        for r in self.risks:
            _printable(r, "risks")
        return self

    @property
    def is_default(self) -> bool:
        """ddp, fp32 and no pipeline: what a version-1 plan runs."""
        return (self.sync == DEFAULT_SYNC and self.transport == DEFAULT_TRANSPORT
                and self.pipeline is None)

    def describe(self) -> str:
        pipe = "no pipeline" if self.pipeline is None else f"pipeline {self.pipeline.describe()}"
        return f"sync {self.sync}, transport {self.transport}, {pipe}"
