"""A plan at a glance: one figure and a few summary lines (``qsync-opt report``).

:func:`plan_figure` draws three panels from a Plan and its replayed :class:`Timeline`:

(a) a precision heatmap, the choosable ops in graph order against the device groups, one
    colour per precision (legend from most exact to least);
(b) per group, one iteration as stacked horizontal bars in the order things happen: compute
    (forward + backward without casts), casts, idle waiting for the slowest group's
    backward, exposed communication, optimizer step; the iteration time is marked, and the
    straggler (the group whose iteration ends last, ``Timeline.straggler``) labelled;
(c) per group, memory by category against the card's usable capacity.

:func:`load_report_inputs` rebuilds what a plan file needs (graph, costs, timeline) from the
plan alone, checking the traced graph is the plan's. Matplotlib is imported only when a
figure is drawn, and only its object API is used (no pyplot, no global backend switch), so
drawing never opens a window or changes the caller's matplotlib state.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.figures import new_figure, png_bytes
from qsync_opt.core.precision import BY_FIDELITY, Precision
from qsync_opt.costs.roofline import estimate
from qsync_opt.documents.io import atomic_write_bytes, load
from qsync_opt.documents.schemas import CostTable, ModelGraph, OpRole, Plan
from qsync_opt.netsim.cluster import parse_comm_model, transport_costs
from qsync_opt.problem.plan import check_plan, graph_for_plan, plan_graph_difference
from qsync_opt.replayer import GroupTimeline, Replayer, Timeline
from qsync_opt.replayer.syncmodel import sync_model_for
from qsync_opt.strategy.checks import check_strategy

if TYPE_CHECKING:  # matplotlib is optional: its types only for the checker
    from matplotlib.axes import Axes

GiB = 1024**3

#: One fixed colour per precision, cool (exact) to warm (coarse), the same in every figure.
PRECISION_COLORS: dict[Precision, str] = {
    Precision.fp32: "#08306b",
    Precision.tf32: "#4292c6",
    Precision.fp16: "#238b45",
    Precision.bf16: "#a1d99b",
    Precision.fp8: "#fdae6b",
    Precision.int8: "#e6550d",
    Precision.int8_full: "#a50f15",
    Precision.int4: "#67000d",
}

#: Time components of one iteration per group, in the order they happen: (key, label, colour).
TIME_PARTS: tuple[tuple[str, str, str], ...] = (
    ("compute", "compute", "#4c72b0"),
    ("casts", "casts", "#d62728"),
    ("idle", "idle (waits for the slowest backward)", "#d9d9d9"),
    ("comm", "exposed communication", "#8172b2"),
    ("optimizer", "optimizer", "#55a868"),
)

#: Memory categories of the replayer, drawn in this order (others after them).
MEMORY_ORDER: tuple[str, ...] = (
    "weights_fp32", "grads_fp32", "optimizer_state", "weight_copies", "activations",
    "workspace", "buffers", "context",
)
_MEMORY_COLORS = ("#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c", "#98df8a",
                  "#9467bd", "#c7c7c7", "#8c564b", "#e377c2", "#bcbd22", "#17becf")

#: At most this many op names label the heatmap's x axis; more ops get evenly spaced labels.
MAX_OP_LABELS = 40
#: Op names longer than this are shown by their end ("…layer.3.attention.self.query").
OP_LABEL_CHARS = 30


@dataclass
class PlanFigure:
    """What :func:`plan_figure` drew: the heatmap's data, and where the PNG went."""

    path: Path
    ops: list[str]  # choosable ops in graph order (heatmap columns)
    groups: list[str]  # heatmap rows, the cluster's group order
    matrix: list[list[str]]  # matrix[row][col]: precision value of ops[col] on groups[row]
    legend: list[str]  # precisions in the legend, most exact first
    tick_ops: list[int] = field(default_factory=list)  # columns whose op name is a tick label


@dataclass
class ReportInputs:
    """A plan with what it was made for, rebuilt: graph, costs and the replayed iteration."""

    plan: Plan
    graph: ModelGraph
    costs: CostTable
    timeline: Timeline


# ----------------------------------------------------------------------------- data


def time_parts(g: GroupTimeline) -> dict[str, float]:
    """One group's iteration split into :data:`TIME_PARTS` (ms); they sum to ``g.end_ms``."""
    return {
        "compute": max(0.0, g.forward_ms + g.backward_ms - g.cast_ms),
        "casts": g.cast_ms,
        "idle": max(0.0, g.straggler_wait_ms),
        "comm": max(0.0, g.exposed_comm_ms),
        "optimizer": g.optimizer_ms,
    }


def straggler_reason(timeline: Timeline) -> str | None:
    """Why ``timeline.straggler`` (the group whose iteration ends last) ends last, against
    the group that ends next: when each starts its optimizer step (its backward's end or the
    all-reduce's, whichever is later) and how long the step takes; a straggler with less
    compute than that group says so. None with one group."""
    if len(timeline.groups) < 2:
        return None
    s = timeline.groups[timeline.straggler]
    rest = [g for n, g in timeline.groups.items() if n != s.name]
    r = max(rest, key=lambda g: (g.end_ms, g.compute_ms))
    gap = s.end_ms - r.end_ms
    comm_end = timeline.bucket_end_ms[-1] if timeline.bucket_end_ms else 0.0
    d_bwd = max(s.compute_ms, comm_end) - max(r.compute_ms, comm_end)
    d_opt = s.optimizer_ms - r.optimizer_ms
    tol = 1e-9 * max(s.end_ms, 1.0)
    if gap <= tol:
        return f"{s.name} and {r.name} end together at {s.end_ms:.4g} ms"
    parts = []
    if abs(d_bwd) > tol:  # when it can start its step: its backward's end or the all-reduce's
        parts.append(f"it starts its optimizer step {abs(d_bwd):.3g} ms "
                     + ("after" if d_bwd > 0 else "before") + f" {r.name} "
                     + ("(its backward ends past the all-reduce)" if d_bwd > 0 else
                        f"({r.name}'s backward ends past the all-reduce)"))
    elif s.compute_ms <= comm_end and r.compute_ms <= comm_end:
        parts.append("both start their optimizer step when the all-reduce ends")
    if abs(d_opt) > tol:
        parts.append(f"its optimizer step takes {abs(d_opt):.3g} ms "
                     + ("longer" if d_opt > 0 else "less") + f" than {r.name}'s")
    slowest = max(timeline.groups.values(), key=lambda g: g.compute_ms).name
    for g, who in ((s, "it"), (r, r.name)):
        if g.straggler_wait_ms > tol:
            parts.append(f"{who} waits {g.straggler_wait_ms:.4g} ms for {slowest}'s backward")
    compute = ("" if s.compute_ms >= r.compute_ms else
               f"; it computes {r.compute_ms - s.compute_ms:.3g} ms less than {r.name}")
    return (f"{s.name} ends last at {s.end_ms:.4g} ms, {gap:.3g} ms after {r.name}: "
            + ", ".join(parts) + compute)


def precision_counts(plan: Plan, group: str) -> dict[str, int]:
    """How many ops run at each precision on ``group``, most exact first."""
    counts = Counter(Precision(p) for p in plan.groups[group].precisions.values())
    return {p.value: counts[p] for p in BY_FIDELITY if counts[p]}


def heatmap_matrix(plan: Plan, graph: ModelGraph) -> tuple[list[str], list[str], list[list[str]]]:
    """(choosable ops in graph order, groups, precision of each op on each group).

    An op a group's plan leaves out runs at fp32, as in the replayer.
    """
    _check_same_graph(plan, graph)
    ops = [o.name for o in graph.ops if o.role == OpRole.choosable]
    groups = [g.name for g in plan.cluster.groups]
    matrix = [[Precision(plan.groups[g].precisions.get(op, Precision.fp32)).value for op in ops]
              for g in groups]
    return ops, groups, matrix


def sparse_ticks(n: int, max_labels: int = MAX_OP_LABELS) -> list[int]:
    """Indices of at most ``max_labels`` evenly spaced ticks over ``n`` items, the last included."""
    if n <= 0:
        return []
    if n <= max_labels:
        return list(range(n))
    step = math.ceil(n / max_labels)
    ticks = list(range(0, n, step))
    if ticks[-1] != n - 1:
        if n - 1 - ticks[-1] < step / 2 or len(ticks) >= max_labels:
            ticks[-1] = n - 1
        else:
            ticks.append(n - 1)
    return ticks


def _check_same_graph(plan: Plan, graph: ModelGraph) -> None:
    if plan.graph_hash != graph.structure_hash():
        raise QsyncInputError(plan_graph_difference(plan, graph))


def _cluster_text(plan: Plan) -> str:
    return " + ".join(f"{g.count}×{g.device}" if g.name == g.device
                      else f"{g.name} ({g.count}×{g.device})" for g in plan.cluster.groups)


def _title(plan: Plan, timeline: Timeline) -> str:
    prov = plan.provenance
    head = f"{plan.workload} on {_cluster_text(plan)}"
    bits = []
    if prov.get("solver") is not None:
        solver = f"solver {prov['solver']}"
        if prov.get("status") is not None:
            solver += f" ({prov['status']})"
        bits.append(solver)
    elif prov.get("status") is not None:
        bits.append(f"status {prov['status']}")
    bits.append(f"iteration {timeline.iteration_ms:.4g} ms")
    if len(timeline.groups) > 1:
        bits.append(f"straggler {timeline.straggler}")
    over = [n for n, g in timeline.groups.items() if not g.fits]
    bits.append(f"over memory on {', '.join(over)}" if over else "fits in memory")
    return head + "\n" + " · ".join(bits)


# ----------------------------------------------------------------------------- figure


def plan_figure(plan: Plan, graph: ModelGraph, timeline: Timeline,
                path: str | os.PathLike[str], *, what: str = "png") -> PlanFigure:
    """Draw the plan's heatmap, time bars and memory bars; write them as a PNG, atomically
    (a failed write: one line naming ``what``, the flag the path came from).

    Returns the heatmap's data (every choosable op of ``graph``, every group of the plan).
    Refuses (QsyncInputError) a plan made for another graph or a timeline of other groups.
    """
    ops, groups, matrix = heatmap_matrix(plan, graph)
    missing = [g for g in groups if g not in timeline.groups]
    if missing:
        raise QsyncInputError(
            f"timeline: no group {', '.join(missing)} (it has {', '.join(timeline.groups)})")

    ng = len(groups)
    heat_h = 0.38 * ng + 1.9
    bars_h = 0.55 * ng + 1.6
    fig = new_figure((14, heat_h + bars_h + 0.8), layout="constrained")
    gs = fig.add_gridspec(2, 2, height_ratios=[heat_h, bars_h], width_ratios=[1.2, 1])
    ax_heat = fig.add_subplot(gs[0, :])
    ax_time = fig.add_subplot(gs[1, 0])
    ax_mem = fig.add_subplot(gs[1, 1])
    fig.suptitle(_title(plan, timeline), fontsize=12)
    legend, ticks = _draw_heatmap(ax_heat, plan, ops, groups, matrix)
    _draw_times(ax_time, timeline, groups)
    _draw_memory(ax_mem, timeline, groups)

    target = _atomic_write_bytes(path, png_bytes(fig), what)
    return PlanFigure(path=target, ops=ops, groups=groups, matrix=matrix, legend=legend,
                      tick_ops=ticks)


def _draw_heatmap(ax_heat: Axes, plan: Plan, ops: list[str], groups: list[str],
                  matrix: list[list[str]]) -> tuple[list[str], list[int]]:
    """Panel (a): the precision of every choosable op per group; the legend's precisions
    and the ops named on the axis."""
    # optional dependency: matplotlib is imported only when a figure is drawn
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch

    ng, nops = len(groups), len(ops)
    order = list(BY_FIDELITY)
    code = {p.value: i for i, p in enumerate(order)}
    codes = [[code[v] for v in row] for row in matrix]
    present = {v for row in matrix for v in row}
    legend: list[str] = [p.value for p in order if p.value in present]

    by_name = {g.name: g for g in plan.cluster.groups}

    # (a) precision heatmap
    cmap = ListedColormap([PRECISION_COLORS[p] for p in order])
    norm = BoundaryNorm([i - 0.5 for i in range(len(order) + 1)], cmap.N)
    if nops:
        ax_heat.imshow(codes, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
        for r in range(1, ng):
            ax_heat.axhline(r - 0.5, color="white", linewidth=2)
    ticks = sparse_ticks(nops)
    ax_heat.set_xticks(ticks)
    ax_heat.set_xticklabels([_short(ops[i]) for i in ticks], rotation=90,
                            fontsize=7 if nops <= MAX_OP_LABELS else 6)
    ax_heat.set_yticks(range(ng))
    ax_heat.set_yticklabels([f"{g} ({by_name[g].count}×{by_name[g].device})" for g in groups])
    ax_heat.set_xlim(-0.5, max(nops, 1) - 0.5)
    ax_heat.set_ylim(ng - 0.5, -0.5)
    shown = "every op named" if len(ticks) == nops else f"one op in {_step(ticks)} named"
    ax_heat.set_xlabel(f"{nops} choosable ops in graph order ({shown})")
    ax_heat.set_title("(a) precision of each choosable op", loc="left", fontsize=10)
    ax_heat.legend(handles=[Patch(facecolor=PRECISION_COLORS[Precision(p)], label=p)
                            for p in legend],
                   title="most exact → least", loc="upper left", bbox_to_anchor=(1.005, 1.0),
                   fontsize=8, title_fontsize=8, frameon=False)
    return legend, ticks


def _draw_times(ax_time: Axes, timeline: Timeline, groups: list[str]) -> None:
    """Panel (b): where each group's iteration goes."""
    ng = len(groups)
    # (b) one iteration per group
    labels = [f"{g}\n{timeline.groups[g].device}, batch {timeline.groups[g].batch_per_device}"
              + ("\n(straggler)" if ng > 1 and g == timeline.straggler else "")
              for g in groups]
    left = [0.0] * ng
    for key, label, color in TIME_PARTS:
        widths = [time_parts(timeline.groups[g])[key] for g in groups]
        ax_time.barh(range(ng), widths, left=left, color=color, label=label, height=0.6,
                     hatch="//" if key == "idle" else None, edgecolor="white", linewidth=0.5)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    it = timeline.iteration_ms
    ax_time.axvline(it, color="black", linestyle="--", linewidth=1.2,
                    label=f"iteration {it:.4g} ms")
    for i, g in enumerate(groups):
        ax_time.text(left[i], i, f" {timeline.groups[g].end_ms:.4g}", va="center", fontsize=8)
    ax_time.set_yticks(range(ng))
    ax_time.set_yticklabels(labels, fontsize=8)
    ax_time.set_ylim(ng - 0.5, -0.5)
    ax_time.set_xlim(0, max(it, *left) * 1.12 if left else 1.0)
    ax_time.set_xlabel("ms in one iteration")
    ax_time.set_title("(b) where each group's iteration goes", loc="left", fontsize=10)
    ax_time.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)


def _draw_memory(ax_mem: Axes, timeline: Timeline, groups: list[str]) -> None:
    """Panel (c): memory per device against capacity."""
    ng = len(groups)
    # (c) memory against capacity
    cats = [c for c in MEMORY_ORDER if any(c in timeline.groups[g].memory for g in groups)]
    cats += sorted({c for g in groups for c in timeline.groups[g].memory} - set(cats))
    left = [0.0] * ng
    for k, cat in enumerate(cats):
        widths = [timeline.groups[g].memory.get(cat, 0) / GiB for g in groups]
        ax_mem.barh(range(ng), widths, left=left, height=0.6, label=cat,
                    color=_MEMORY_COLORS[k % len(_MEMORY_COLORS)], edgecolor="white",
                    linewidth=0.5)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    caps = [timeline.groups[g].capacity_bytes / GiB for g in groups]
    for i, g in enumerate(groups):
        gt = timeline.groups[g]
        ax_mem.vlines(caps[i], i - 0.42, i + 0.42, colors="black", linewidth=2.2,
                      label="capacity" if i == 0 else "_nolegend_")
        ax_mem.text(max(caps[i], left[i]), i,
                    f"  {gt.peak_memory_bytes / GiB:.1f} / {caps[i]:.1f} GiB"
                    + ("" if gt.fits else "  OVER"),
                    va="center", fontsize=8, color="black" if gt.fits else "#d62728")
    ax_mem.set_yticks(range(ng))
    ax_mem.set_yticklabels(groups, fontsize=8)
    ax_mem.set_ylim(ng - 0.5, -0.5)
    ax_mem.set_xlim(0, max([*caps, *left, 1e-9]) * 1.45)
    ax_mem.set_xlabel("GiB per device")
    ax_mem.set_title("(c) memory per device against capacity", loc="left", fontsize=10)
    ax_mem.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)


def _short(name: str, limit: int = OP_LABEL_CHARS) -> str:
    """An op name cut to ``limit`` characters, keeping its informative end."""
    return name if len(name) <= limit else "…" + name[-(limit - 1):]


def _step(ticks: list[int]) -> int:
    return ticks[1] - ticks[0] if len(ticks) > 1 else 1


def _atomic_write_bytes(path: str | os.PathLike[str], data: bytes, what: str = "png") -> Path:
    """Write ``data`` to ``path`` atomically with the package's one writer
    (:func:`qsync_opt.documents.io.atomic_write_bytes`: mode kept, links written through); a failure
    is one line, ``WHAT: cannot write PATH (reason)``."""
    return atomic_write_bytes(path, data, what=what)


# ----------------------------------------------------------------------------- summary


def plan_summary_lines(plan: Plan, timeline: Timeline) -> list[str]:
    """A header line, then one line per group: precisions, times (ms) and memory (GiB)."""
    prov = plan.provenance
    head = f"{plan.workload} on {_cluster_text(plan)}: iteration {timeline.iteration_ms:.4g} ms"
    if len(timeline.groups) > 1:
        head += f", straggler {timeline.straggler}"
    head += ", fits in memory" if timeline.fits else ", OVER MEMORY"
    if prov.get("solver") is not None:
        head += f"; solver {prov['solver']}"
        if prov.get("status") is not None:
            head += f" ({prov['status']})"
    lines = [head]
    for name, gp in plan.groups.items():
        g = timeline.groups.get(name)
        counts = ", ".join(f"{n} {p}" for p, n in precision_counts(plan, name).items()) or "no ops"
        if g is None:
            lines.append(f"  {name}: {counts}; not in the timeline")
            continue
        t = time_parts(g)
        lines.append(
            f"  {name} ({g.device}, batch {gp.batch_per_device}): {counts} | compute "
            f"{t['compute']:.4g} ms, casts {t['casts']:.4g} ms ({g.n_casts}), idle "
            f"{t['idle']:.4g} ms, comm {t['comm']:.4g} ms, optimizer {t['optimizer']:.4g} ms, "
            f"end {g.end_ms:.4g} ms | memory {g.peak_memory_bytes / GiB:.2f} / "
            f"{g.capacity_bytes / GiB:.2f} GiB" + ("" if g.fits else " OVER"))
    reason = straggler_reason(timeline)
    if reason is not None:
        lines.append(f"  straggler (the group whose iteration ends last): {reason}")
    return lines + strategy_lines(plan, timeline)


def strategy_lines(plan: Plan, timeline: Timeline) -> list[str]:
    """A version-2 plan's strategy: what it is, what the planner predicted against this
    replay (analytic ring), and the quality risks it takes (nothing for version 1)."""
    st = plan.strategy
    if st is None:  # version 1: ddp, fp32, no pipeline; its report reads as before
        return []
    out = [f"  strategy: {st.describe()}"]
    p = st.predicted
    if p is not None:
        out.append(f"  predicted by the planner: {p.step_ms:.4g} ms a step ({p.comm_model}), "
                   f"{p.samples_per_s:.1f} samples/s, {p.bytes_per_step / 2**20:.2f} MiB sent "
                   f"a step, {p.syncs_per_step:.3g} syncs a step; replayed here "
                   f"{timeline.iteration_ms:.4g} ms (analytic ring)")
    out += [f"  risk: {r}" for r in st.risks]
    return out


def report_summary(plan: Plan, timeline: Timeline) -> dict[str, Any]:
    """The timeline's JSON summary, with the plan's workload, provenance and precision counts."""
    out = timeline.summary()
    for name, g in out["groups"].items():
        if name in plan.groups:
            g["precision_counts"] = precision_counts(plan, name)
            g["time_parts_ms"] = time_parts(timeline.groups[name])
    out["straggler_reason"] = straggler_reason(timeline)
    return {"workload": plan.workload, "graph_hash": plan.graph_hash,
            "provenance": dict(plan.provenance),
            "strategy": plan.job_strategy.model_dump(mode="json"), **out}


# ----------------------------------------------------------------------------- loading


def load_report_inputs(plan_path: str | os.PathLike[str],
                       costs_path: str | os.PathLike[str] | None = None,
                       model: str | None = None,
                       graph_path: str | os.PathLike[str] | None = None) -> ReportInputs:
    """Read a plan, re-trace its graph (or read it: ``graph_path``), cost it and replay it.

    With ``graph_path``, a ModelGraph JSON (``qsync-opt graph --out``), nothing is traced and
    no model file is imported: the graph must be the plan's (:func:`qsync_opt.problem.plan.
    check_plan`; for a plan made from a file, also the same file's sha256), and ``model`` is
    not needed.

    The graph is :func:`qsync_opt.problem.plan.graph_for_plan`'s: traced at the plan's
    ``provenance.graph_batch`` and ``graph_tie_mode`` and checked against the plan. A plan
    made from a user's model file is read only with ``model``, that file (it is run; its
    sha256 must be the plan's ``workload_sha256``): a plan never runs code. Costs are the
    roofline estimates unless a CostTable file is given.
    """
    try:
        plan = load(plan_path, Plan)
    except QsyncInputError as exc:
        raise type(exc)(f"plan: {exc}") from None
    prov = plan.provenance
    if graph_path is not None:
        try:
            graph = load(graph_path, ModelGraph)
        except QsyncInputError as exc:
            raise type(exc)(f"--graph: {exc}") from None
        if graph.workload_sha256 != plan.workload_sha256:
            raise QsyncInputError(
                f"--graph {graph_path}: traced from {graph.workload!r} (sha256 "
                f"{(graph.workload_sha256 or 'none')[:16]}), the plan was made from "
                f"{plan.workload!r} (sha256 {(plan.workload_sha256 or 'none')[:16]})")
        check_plan(plan, graph)
    else:
        graph = graph_for_plan(plan, model)
    if costs_path is not None:
        try:
            costs = load(costs_path, CostTable)
        except QsyncInputError as exc:
            raise type(exc)(f"costs: {exc}") from None
    else:
        costs = estimate(graph, plan.cluster)
    optimizer = prov.get("optimizer")
    sync = None
    if plan.strategy is not None:  # version 2: replayed under its own sync and transport
        check_strategy(plan.strategy, plan.cluster)
        costs = transport_costs(graph, plan.cluster, costs, plan.strategy.transport,
                                parse_comm_model(None))
        sync = sync_model_for(plan.strategy.sync)
    rep = Replayer(graph, plan.cluster, costs, sync=sync,
                   optimizer=optimizer if optimizer in ("sgd", "adam") else "sgd")
    return ReportInputs(plan=plan, graph=graph, costs=costs, timeline=rep.simulate(plan))
