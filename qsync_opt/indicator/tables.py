"""Indicator tables after measuring: the unmeasured ops, monotone ladders, coverage of
another graph, ranks, the placeholder."""

from __future__ import annotations

from collections.abc import Sequence

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.documents.schemas import IndicatorTable, ModelGraph
from qsync_opt.indicator.errormodel import LADDERS


def placeholder_indicator(graph: ModelGraph) -> IndicatorTable:
    """Zeros for every choosable op and precision: a problem built with it has the real
    problem's time and memory (they need no indicator), for checks made before computing
    one. Not an indicator: every plan scores 0."""
    values = {o.name: {p: 0.0 for p in o.allowed_precisions} for o in graph.choosable_ops()}
    return IndicatorTable(workload=graph.workload, graph_hash=graph.structure_hash(),
                          method="placeholder", batch_size=graph.batch_size, batches=1, seed=0,
                          data="none", values=values,
                          notes=["placeholder: zeros, for checks that need no indicator"])


def table_summary(table: IndicatorTable) -> str:
    """What a table holds, in a few words: ops, batches, data, unmeasured ops."""
    text = (f"{len(table.values)} ops, {table.batches} batch(es) of {table.batch_size}, "
            f"{table.data} data")
    if table.unmeasured:
        text += f", {len(table.unmeasured)} op(s) unmeasured"
    return text


def cover(table: IndicatorTable, graph: ModelGraph) -> IndicatorTable:
    """``table`` for ``graph`` (traced at another batch, say): a choosable op of ``graph``
    the table has no row for (the trace at the table's batch took another path) joins its
    ``unmeasured``, with an fp32 row only, so it is pinned rather than lowered for free."""
    lacking = [o.name for o in graph.choosable_ops() if o.name not in table.values]
    if not lacking:
        return table
    why = (f"no indicator value: not in the model's graph at the indicator's batch "
           f"{table.batch_size} (its trace there took another path)")
    return table.model_copy(update={
        "values": {**table.values, **{n: {Precision.fp32: 0.0} for n in lacking}},
        "unmeasured": {**table.unmeasured, **dict.fromkeys(lacking, why)}})


#: Why an op has no indicator value (:attr:`IndicatorTable.unmeasured`); the CLI pins such
#: ops fp32 and prints the reason.
UNMEASURED_RAN = ("no indicator value: no call of it ran in the measured batches' forward "
                  "(a code path the trace took and the batches did not)")
UNMEASURED_GRAD = ("no indicator value: its output carries no gradient, so the loss "
                   "curvature in it cannot be measured")


def mean_of(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def enforce_monotone(values: dict[str, dict[Precision, float]]) -> int:
    """Raise any value below a more exact precision's in its family; return how many."""
    fixes = 0
    for row in values.values():
        for ladder in LADDERS:
            best = 0.0
            for p in ladder:
                if p not in row:
                    continue
                if row[p] < best:
                    row[p] = best
                    fixes += 1
                best = row[p]
    return fixes


def scale_to_batch(table: IndicatorTable, batch: int) -> dict[str, dict[Precision, float]]:
    """Omega for another per-device batch. The qsync form is relative (errors over signal
    energy, both proportional to the batch), so it carries over unchanged."""
    if batch < 1:
        raise QsyncInputError(f"batch: expected a positive integer, got {batch}")
    return {op: dict(row) for op, row in table.values.items()}


def rank_table(table: IndicatorTable, precision: Precision = Precision.int8
               ) -> list[tuple[str, float]]:
    """Ops by their value at ``precision`` (or their least exact one), most sensitive first."""
    out = []
    for op, row in table.values.items():
        p = precision if precision in row else min(row, key=lambda q: q.info.rank)
        out.append((op, row[p]))
    return sorted(out, key=lambda kv: -kv[1])
