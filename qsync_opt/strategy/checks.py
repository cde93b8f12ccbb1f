"""A plan's strategy checked against the rules: :func:`check_strategy` is what
:func:`qsync_opt.problem.plan.check_plan` runs on a version-2 plan's ``strategy``, so a plan
edited by hand into a combination the runtime cannot run is refused in one line naming the
field, before anything is traced or launched."""

from __future__ import annotations

from collections import Counter

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.documents.hardware import ClusterSpec
from qsync_opt.documents.jobstrategy import PipelineStrategy, Strategy
from qsync_opt.strategy.compressor_text import parse_compressor_text
from qsync_opt.strategy.modes import (
    CommMode,
    SyncMode,
    check_combination,
    parse_sync,
    parse_transport,
    transport_text,
)

__all__ = ["check_strategy", "strategy_modes"]


def _field(field: str, exc: QsyncInputError) -> QsyncInputError:
    """The rule's one-line refusal, named by the plan's field."""
    return QsyncInputError(f"plan: strategy.{field}: {str(exc).partition(': ')[2] or exc}")


def strategy_modes(strategy: Strategy) -> tuple[SyncMode, CommMode]:
    """The strategy's sync mode and transport, parsed (a bad text: one line naming the
    plan's field)."""
    try:
        sync = parse_sync(strategy.sync)
    except QsyncInputError as exc:
        raise _field("sync", exc) from None
    try:
        comm = parse_transport(strategy.transport)
    except QsyncInputError as exc:
        raise _field("transport", exc) from None
    return sync, comm


def check_strategy(strategy: Strategy, cluster: ClusterSpec) -> tuple[SyncMode, CommMode]:
    """Refuse a strategy the runtime cannot run on ``cluster``: an unknown sync mode or
    transport, a pair that does not combine (a gradient transport with Local SGD or QSR),
    a pipeline beside a data-parallel mode, a pipeline stage on a group the cluster lacks
    or more stages on a group than it has devices, a compressor the codecs do not know.
    Returns the parsed sync mode and transport."""
    sync, comm = strategy_modes(strategy)
    try:
        check_combination(sync, comm)
    except QsyncInputError as exc:
        raise QsyncInputError(f"plan: strategy: sync {strategy.sync} with transport "
                              f"{strategy.transport}: "
                              + str(exc).partition(": ")[2].partition("; use")[0]) from None
    if strategy.pipeline is not None:
        _check_pipeline(strategy.pipeline, sync, comm, cluster)
    return sync, comm


def _check_pipeline(pipe: PipelineStrategy, sync: SyncMode, comm: CommMode,
                    cluster: ClusterSpec) -> None:
    if sync.kind != "ddp" or comm.kind != "allreduce":
        raise QsyncInputError("plan: strategy.pipeline: a pipeline has one replica of each "
                              "stage, so its sync is ddp and its transport fp32 (got "
                              f"{sync.describe()}, {transport_text(comm)})")
    counts = {g.name: g.count for g in cluster.groups}
    for name, n in Counter(pipe.stage_groups).items():
        if name not in counts:
            raise QsyncInputError(f"plan: strategy.pipeline.stage_groups: group {name!r} is "
                                  f"not in the plan's cluster ({', '.join(counts)})")
        if n > counts[name]:
            raise QsyncInputError(f"plan: strategy.pipeline.stage_groups: {n} stages on group "
                                  f"{name!r}, which has {counts[name]} device(s)")
    for field in ("compress_act", "compress_grad"):
        try:
            parse_compressor_text(getattr(pipe, field))
        except QsyncInputError as exc:
            raise _field(f"pipeline.{field}", exc) from None
