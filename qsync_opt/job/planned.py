"""A version-2 plan's strategy applied to a ``train`` request: ``train --plan P`` runs the
sync, the transport and the pipeline the plan names with no other flag.

A flag given beside such a plan must say the same as the plan (compared parsed, so
``local:4`` and ``local:04`` agree); one that contradicts it is refused in one line naming
the flag and the plan's field, unless ``--override`` is given, in which case the flag wins
and the run's config records each override (``TrainConfig.overrides``). A version-1 plan
records no strategy: the flags choose, with their defaults (ddp, fp32, no pipeline).
"""

from __future__ import annotations

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.documents.jobstrategy import PipelineStrategy, Strategy
from qsync_opt.documents.schemas import Plan
from qsync_opt.pipeline.spec import PipelineRequest
from qsync_opt.strategy.compressor_text import parse_compressor_text
from qsync_opt.strategy.modes import parse_comm, parse_sync, parse_transport

__all__ = ["apply_plan_strategy"]

#: The ``train`` defaults of the strategy flags (what a request holds when none was given).
DEFAULT_SYNC_FLAG = "ddp"
DEFAULT_COMM_FLAG = "allreduce"


def _same_sync(a: str, b: str) -> bool:
    try:
        return parse_sync(a) == parse_sync(b)
    except QsyncInputError:
        return False


def _same_comm(flag: str, planned: str) -> bool:
    try:
        return parse_comm(flag) == parse_transport(planned)
    except QsyncInputError:
        return False


def _rank_groups_text(groups: list[str]) -> str:
    return ",".join(f"{i}:{g}" for i, g in enumerate(groups))


def _pipeline_request(pipe: PipelineStrategy, given: PipelineRequest) -> PipelineRequest:
    return PipelineRequest(
        stages=pipe.stages, cuts=None if pipe.cuts is None else ",".join(pipe.cuts),
        micro_batches=pipe.micro_batches, compress_act=pipe.compress_act,
        compress_grad=pipe.compress_grad, feedback=pipe.feedback,
        compress_at_eval=given.compress_at_eval)


def _pipeline_differences(pipe: PipelineStrategy | None, given: PipelineRequest,
                          rank_groups: str | None) -> list[tuple[str, str, str]]:
    """(flag, given, the plan's) for each pipeline flag that says otherwise than the plan."""
    if given.stages is None:
        return []
    if pipe is None:
        return [("--pipeline-stages", str(given.stages), "no pipeline")]
    out = []
    if given.stages != pipe.stages:
        out.append(("--pipeline-stages", str(given.stages), str(pipe.stages)))
    if given.cuts is not None and pipe.cuts is not None and \
            [c.strip() for c in given.cuts.split(",")] != pipe.cuts:
        out.append(("--cuts", given.cuts, ",".join(pipe.cuts)))
    if given.micro_batches not in (1, pipe.micro_batches):
        out.append(("--micro-batches", str(given.micro_batches), str(pipe.micro_batches)))
    for flag, mine, theirs in (("--compress-act", given.compress_act, pipe.compress_act),
                               ("--compress-grad", given.compress_grad, pipe.compress_grad)):
        if mine != "none" and parse_compressor_text(mine) != parse_compressor_text(theirs):
            out.append((flag, mine, theirs))
    if given.feedback not in ("none", pipe.feedback):
        out.append(("--feedback", given.feedback, pipe.feedback))
    if rank_groups is not None and rank_groups.replace(" ", "") != \
            _rank_groups_text(pipe.stage_groups):
        out.append(("--rank-groups", rank_groups, _rank_groups_text(pipe.stage_groups)))
    return out


def _differences(strategy: Strategy, sync: str | None, comm: str | None,
                 pipeline: PipelineRequest, rank_groups: str | None
                 ) -> list[tuple[str, str, str]]:
    out = []
    if sync is not None and not _same_sync(sync, strategy.sync):
        out.append(("--sync", sync, strategy.sync))
    if comm is not None and not _same_comm(comm, strategy.transport):
        out.append(("--comm", comm, strategy.transport))
    return out + _pipeline_differences(strategy.pipeline, pipeline, rank_groups)


def apply_plan_strategy(plan: Plan, *, sync: str | None, comm: str | None,
                        pipeline: PipelineRequest, rank_groups: str | None,
                        override: bool) -> tuple[str, str, PipelineRequest, str | None,
                                                 list[str]]:
    """The run's sync, ``--comm`` text, pipeline request and rank groups under ``plan``,
    and the overrides to record. ``sync``/``comm`` None: not given on the command line."""
    strategy = plan.strategy
    if strategy is None:  # version 1: the flags decide
        return (sync or DEFAULT_SYNC_FLAG, comm or DEFAULT_COMM_FLAG, pipeline, rank_groups,
                [])
    diffs = _differences(strategy, sync, comm, pipeline, rank_groups)
    if diffs and not override:
        flag, mine, theirs = diffs[0]
        raise QsyncInputError(
            f"{flag} {mine}: the plan's strategy says {theirs} (plan field strategy."
            f"{_field_of(flag)}); leave the flag out to run the plan, or pass --override to "
            "run the flag instead (recorded in the run's config)")
    overrides = [f"{flag} {mine} over the plan's {theirs}" for flag, mine, theirs in diffs]
    run_sync = sync if sync is not None and override else strategy.sync
    planned_comm = parse_transport(strategy.transport).describe()
    run_comm = comm if comm is not None and override else planned_comm
    if strategy.pipeline is not None and (pipeline.stages is None or not override):
        pipe = _pipeline_request(strategy.pipeline, pipeline)
        groups = rank_groups if rank_groups is not None and override else \
            _rank_groups_text(strategy.pipeline.stage_groups)
        return run_sync, run_comm, pipe, groups, overrides
    return run_sync, run_comm, pipeline, rank_groups, overrides


def _field_of(flag: str) -> str:
    return {"--sync": "sync", "--comm": "transport", "--rank-groups": "pipeline.stage_groups",
            "--pipeline-stages": "pipeline"}.get(flag, "pipeline." + flag[2:].replace("-", "_"))
