"""The launcher side of a pipeline run: ``qsync-opt train --pipeline-stages N``'s
:class:`~qsync_opt.runtime.config.PipelineSpec`, resolved before any rank starts.

:func:`pipeline_spec` fixes the batch (``--batch``, else the plan's per-device batch when
the stages' groups agree on it) and the cuts (``--cuts``, checked against the traced model;
else balanced on each stage's estimated per-op ms: its group's device at its plan's
precisions), so the config records the exact split every rank makes
(:mod:`qsync_opt.pipeline.run`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import ValidationError

from qsync_opt.core.errors import QsyncInputError, describe_validation_error
from qsync_opt.costs.roofline import estimate
from qsync_opt.documents.schemas import Plan
from qsync_opt.graph import trace
from qsync_opt.models import UnknownWorkloadError, get_workload
from qsync_opt.pipeline.run import PipelineBatches
from qsync_opt.pipeline.stages import StageSplit, plan_op_costs, split_stages, split_top
from qsync_opt.runtime.config import PipelineSpec, rank_groups_example

__all__ = ["PipelineRequest", "pipeline_spec"]


@dataclass(frozen=True)
class PipelineRequest:
    """What the command line asks of a pipeline run, before it is checked against the plan:
    ``--pipeline-stages`` (None: no pipeline), ``--cuts``, ``--micro-batches``, the
    compressors, the feedback and ``--compress-at-eval``."""

    stages: int | None = None
    cuts: str | None = None
    micro_batches: int = 1
    compress_act: str = "none"
    compress_grad: str = "none"
    feedback: str = "none"
    compress_at_eval: bool = False

    def flag_without_stages(self) -> str | None:
        """The first pipeline flag given other than its default, or None."""
        given = (("--cuts", self.cuts is not None), ("--micro-batches", self.micro_batches != 1),
                 ("--compress-act", self.compress_act != "none"),
                 ("--compress-grad", self.compress_grad != "none"),
                 ("--feedback", self.feedback != "none"),
                 ("--compress-at-eval", self.compress_at_eval))
        return next((flag for flag, on in given if on), None)


def pipeline_spec(request: PipelineRequest, plan: Plan, ranks: list[str], *, model: str,
                  batch: int | None, lines: list[str] | None = None) -> PipelineSpec:
    """The run's :class:`~qsync_opt.runtime.config.PipelineSpec` for ``model``: one rank
    per stage, the batch (``batch``: ``--batch``) and the cuts resolved; ``lines`` receives
    the line that says how it was cut."""
    n = request.stages
    if n is None:
        raise QsyncInputError("--pipeline-stages: expected a number of stages")
    if len(ranks) != n:
        raise QsyncInputError(f"--pipeline-stages {n}: one rank per stage, but the ranks are "
                              f"{len(ranks)} ({', '.join(ranks)}); pass --rank-groups with {n} "
                              "ranks (e.g. " + rank_groups_example(ranks, n) + ")")
    try:
        wl = get_workload(model)
    except UnknownWorkloadError as exc:
        raise QsyncInputError(f"--model: {exc}") from None
    batch = _stage_batch(batch, plan, ranks)
    if request.feedback == "aqsgd":
        PipelineBatches(wl, 0, batch, "aqsgd")  # the workload has indexed samples, enough
    torch.manual_seed(0)
    net = wl.build().float()
    example = wl.make_inputs(batch, torch.device("cpu"))  # shapes only (meta tensors)
    if request.cuts:
        split = _given_split(request.cuts, n, net, example)
        how = "as given"
    else:
        graph = trace(model, plan.groups[ranks[0]].batch_per_device)
        table = estimate(graph, plan.cluster)
        costs = [plan_op_costs(table, plan, g) for g in ranks]
        split = split_stages(net, n_stages=n, costs=costs, example_inputs=example)
        how = ("balanced on each stage's estimated ms (its group's device and plan): "
               + ", ".join(f"{c:.3f}" for c in split.costs))
    try:
        spec = PipelineSpec(stages=n, cuts=list(split.cuts),
                            micro_batches=request.micro_batches, batch=batch,
                            compress_act=request.compress_act,
                            compress_grad=request.compress_grad,
                            feedback=request.feedback, compress_at_eval=request.compress_at_eval)
    except ValidationError as exc:
        raise QsyncInputError(describe_validation_error(exc, "train")) from None
    if lines is not None:
        lines.append(f"pipeline: {spec.describe()} (cuts {how})")
    return spec


def _stage_batch(batch: int | None, plan: Plan, ranks: list[str]) -> int:
    """``--batch``, else the per-device batch that the stages' plan groups agree on."""
    batches = sorted({plan.groups[g].batch_per_device for g in ranks})
    if batch is not None:
        return int(batch)
    if len(batches) == 1:
        return batches[0]
    raise QsyncInputError(f"--batch: the stages' plan groups have batches "
                          f"{', '.join(map(str, batches))}; every stage of a pipeline "
                          "processes the same batch: pass --batch")


def _given_split(text: str, n: int, model: torch.nn.Module, example: object) -> StageSplit:
    """``--cuts``: ``n - 1`` op or block names, checked against the traced model."""
    cuts = [c.strip() for c in str(text).split(",") if c.strip()]
    if len(cuts) != n - 1:
        raise QsyncInputError(f"--cuts: {n} stages need {n - 1} cuts, got {len(cuts)}")
    try:
        split = split_stages(model, cuts=cuts, example_inputs=example)
        split_top(split)  # every stage can be built (no copy of the weights)
    except QsyncInputError as exc:
        raise QsyncInputError(f"--cuts: {str(exc).partition(': ')[2]}") from None
    return split
