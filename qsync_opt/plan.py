"""Plans: build a Plan document from per-group precisions, and check it against a graph."""

from __future__ import annotations

from collections.abc import Mapping

from .errors import QsyncInputError
from .precision import Precision
from .schemas import ClusterSpec, GroupPlan, JSONScalar, ModelGraph, OpRole, Plan


def make_plan(
    graph: ModelGraph,
    cluster: ClusterSpec,
    precisions: Mapping[str, Mapping[str, Precision | str]],
    provenance: Mapping[str, JSONScalar] | None = None,
) -> Plan:
    """A Plan covering every choosable op of ``graph`` on every group of ``cluster``.

    Ops a group's mapping leaves out are written as fp32, so the file says everything.
    """
    cluster = cluster.with_default_batch(graph.batch_size)
    groups: dict[str, GroupPlan] = {}
    for g in cluster.groups:
        given = precisions.get(g.name, {})
        row: dict[str, Precision] = {}
        for op in graph.ops:
            if op.role == OpRole.choosable:
                try:
                    row[op.name] = Precision(given.get(op.name, Precision.fp32))
                except ValueError:
                    raise QsyncInputError(
                        f"plan: group {g.name}, op {op.name}: unknown precision "
                        f"{given.get(op.name)!r}") from None
        groups[g.name] = GroupPlan(batch_per_device=int(g.batch_per_device or graph.batch_size),
                                   precisions=row)
    return Plan(workload=graph.workload, graph_hash=graph.structure_hash(), cluster=cluster,
                groups=groups, provenance=dict(provenance or {}))


def plan_graph_difference(plan: Plan, graph: ModelGraph) -> str:
    """One line saying why ``plan`` does not belong to ``graph``: the ops that differ."""
    choosable = [o.name for o in graph.ops if o.role == OpRole.choosable]
    planned: list[str] = []
    for gp in plan.groups.values():
        planned = list(gp.precisions)
        break
    extra = [n for n in planned if n not in set(choosable)]
    missing = [n for n in choosable if n not in set(planned)]

    def few(names: list[str]) -> str:
        return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")

    parts = [f"plan: made for graph {plan.graph_hash} ({plan.workload}), not "
             f"{graph.structure_hash()} ({graph.workload})"]
    if extra:
        parts.append(f"ops the graph lacks: {few(extra)}")
    if missing:
        parts.append(f"choosable ops the plan lacks: {few(missing)}")
    if not extra and not missing:
        parts.append("same op names, different shapes, kinds or edges")
    return "; ".join(parts)
