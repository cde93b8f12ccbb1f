"""What the CLI and the demo print: aligned tables, and the summary lines of a graph,
a cost estimate, a replay and a plan (with the comparison plans a replay shows)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from qsync_opt.costs.roofline import group_summary
from qsync_opt.documents.schemas import ModelGraph, OpRole, Plan
from qsync_opt.graph import unseen_ops
from qsync_opt.replayer import Replayer, Timeline

GiB = 1024**3


def format_table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [[str(h) for h in header]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for j, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if j and _numeric(c) else c.ljust(w)
                               for c, w in zip(r, widths, strict=True)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        if abs(x) >= 100:
            return f"{x:,.1f}".removesuffix(".0")
        return f"{x:.4g}"
    if isinstance(x, int) and not isinstance(x, bool):
        return f"{x:,}"
    return str(x)


def _numeric(s: str) -> bool:
    return s.replace(",", "").replace(".", "").replace("-", "").isdigit()


def graph_summary_lines(graph: ModelGraph, seconds: float | None = None) -> list[str]:
    n_ch = len(graph.choosable_ops())
    pinned = [o for o in graph.ops if o.role == OpRole.pinned]
    gemm_flops = sum(o.fwd_flops for o in graph.ops if o.kind.value in ("linear", "conv", "matmul"))
    head = [o.name for o in pinned if o.pin_reason and o.pin_reason.startswith("classifier")]
    took = f" in {seconds:.2f} s" if seconds is not None else ""
    return [
        f"graph: {graph.workload} at batch {graph.batch_size}, traced with "
        f"{graph.trace_method}{took}",
        f"  ops {len(graph.ops)} (choosable {n_ch}, pinned {len(pinned)}), edges "
        f"{len(graph.edges)}, depth {graph.max_depth}",
        f"  parameters {graph.param_count / 1e6:.2f} M ({graph.param_bytes / 2**20:.1f} MiB FP32)",
        f"  forward {graph.total_fwd_flops / 1e9:.1f} GFLOP per batch, "
        f"{gemm_flops / 2 / graph.batch_size / 1e9:.2f} G multiply-adds per sample in GEMMs "
        f"(a multiply-add = 2 FLOPs)",
        f"  activations saved for backward (measured, FP32): "
        f"{graph.saved_activation_bytes / 2**20:.1f} MiB",
        f"  classifier head pinned to fp32: {', '.join(head) or 'none'}",
    ] + [f"  unseen (the planner cannot look inside; over 1% of the parameters or FLOPs): "
         f"{line}" for line in unseen_ops(graph)]


def estimate_summary_lines(graph: ModelGraph, cluster: Any, costs: Any) -> list[str]:
    rows = []
    for r in group_summary(graph, cluster, costs):
        rows.append((r["group"], r["device"], r["count"], r["batch_per_device"],
                     r["compute_fp32_ms"], r["compute_fastest_ms"], r["allreduce_ms"],
                     r["optimizer_ms"], f"{int(r['memory_fp32_bytes']) / GiB:.1f}",
                     f"{int(r['capacity_bytes']) / GiB:.1f}"))
    lines = [
        format_table(rows, ["group", "device", "n", "batch", "fp32 ms", "fastest ms", "allreduce ms",
                      "optim ms", "mem GiB", "cap GiB"]),
        f"  all-reduce: {len(costs.buckets)} buckets over {costs.comm.world_size} devices, "
        f"bottleneck {costs.comm.bottleneck}",
        "  fp32/fastest ms: serial sums of per-op forward+backward estimates at FP32 and at each "
        "op's fastest precision (casts ignored); the replayer overlaps communication.",
    ]
    return lines


def uniform_plans(rep: Replayer) -> dict[str, dict[str, dict[str, Any]]]:
    """The comparison plans: everything at its highest precision; then the groups slower
    than the fastest one (the weak groups) at their lowest precision."""
    high = rep.uniform("highest")
    plans: dict[str, dict[str, dict[str, Any]]] = {"uniform-highest": high}
    tl = rep.simulate(high, events=False)
    fastest = min(g.compute_ms for g in tl.groups.values())
    weak = [n for n, g in tl.groups.items() if g.compute_ms > 1.01 * fastest]
    if weak:
        low = rep.uniform("lowest")
        plans["weak-lowest"] = {n: (low[n] if n in weak else high[n]) for n in high}
    return plans


def replay_rows(name: str, tl: Timeline) -> list[tuple[Any, ...]]:
    rows = []
    for g in tl.groups.values():
        rows.append((name, g.name, g.device, g.batch_per_device, g.compute_ms, g.cast_ms,
                     g.n_casts, g.exposed_comm_ms, g.straggler_wait_ms, tl.iteration_ms,
                     f"{g.peak_memory_bytes / GiB:.2f}/{g.capacity_bytes / GiB:.1f}",
                     "yes" if g.fits else "NO"))
    return rows


REPLAY_HEADER = ["plan", "group", "device", "batch", "compute ms", "casts ms", "casts",
                 "exposed comm", "waits ms", "iteration ms", "peak/cap GiB", "fits"]


def plan_lines(problem: Any, plan: Plan, ev: Any) -> list[str]:
    """Per group: how many ops run at each precision, time and memory."""
    lines = []
    for name, gp in plan.groups.items():
        counts = Counter(p.value for p in gp.precisions.values())
        mix = ", ".join(f"{n} {p}" for p, n in counts.most_common())
        g = ev.groups[name]
        lines.append(f"  {name} ({g.device}, batch {g.batch}): {mix}; linear {g.linear_ms:.1f} ms, "
                     f"replayer compute {g.replay_compute_ms:.1f} ms, memory "
                     f"{g.replay_memory_bytes / GiB:.2f}/{g.capacity_bytes / GiB:.1f} GiB")
    return lines
