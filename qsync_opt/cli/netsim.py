"""``qsync-opt netsim``: one workload's gradient traffic on a cluster's network, packet by
packet, over seeded iterations: p50/p99 communication time, loss per layer, link load."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from qsync_opt.cli.args import (
    cluster_arg,
    emit_json,
    trace_args,
)
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.figures import new_figure, png_bytes
from qsync_opt.core.progress import Progress
from qsync_opt.costs.roofline import estimate
from qsync_opt.documents.io import atomic_write_bytes, atomic_write_text, load
from qsync_opt.documents.schemas import Plan
from qsync_opt.netsim.cluster import (
    SCENARIO_PATTERN,
    check_events,
    check_hosts,
    cluster_network,
    group_ready_ms,
    limit_message,
    run_iterations,
    workload_buckets,
)
from qsync_opt.netsim.engine import NetsimLimit
from qsync_opt.netsim.traffic import NetConfig, layer_bytes, summarise
from qsync_opt.problem.plan import check_plan, plan_model


def cmd_netsim(args: argparse.Namespace) -> int:
    plan = None
    sha = None
    if args.plan:
        plan = load(args.plan, Plan)
        sha = plan_model(plan, args.model)
    graph = trace_args(args, sha)
    if plan is not None:
        check_plan(plan, graph)
    cluster = cluster_arg(args).with_default_batch(graph.batch_size)
    if cluster.world_size < 2:
        raise QsyncInputError("cluster: netsim needs at least two devices (nothing is sent)")
    check_hosts(cluster)
    costs = estimate(graph, cluster)
    ready, tl = group_ready_ms(graph, cluster, costs, plan)
    buckets = workload_buckets(graph, costs.buckets)
    net = cluster_network(cluster, args.scenario, buffer_bytes=args.buffer_kib << 10)
    pattern = args.pattern or SCENARIO_PATTERN[args.scenario]
    if pattern == "ps" and net.ps is None:
        raise QsyncInputError("pattern: ps needs the incast scenario's parameter server "
                              "(--scenario incast)")
    cfg = NetConfig(policy=args.policy, routing=args.routing, p=args.p,
                    cell_bytes=args.cell_kib << 10, jitter=args.jitter,
                    min_rto_ms=args.min_rto_ms, max_events=args.max_events, detect=args.detect)
    try:
        runs = _simulate(args, net, buckets, ready, cfg, pattern)
    except NetsimLimit as exc:  # the event cap: one line naming the flags that raise it
        raise QsyncInputError(limit_message(exc, "--cell-kib", "--max-events")) from None
    s = summarise(runs)
    topo = net.topo
    span = [max(1e-12, (r.comm_end_ms - min(r.bucket_start_ms)) * 1e-3) for r in runs]
    util = [max(r.link_busy_s[li] / sp for r, sp in zip(runs, span, strict=True))
            for li in range(len(topo.links))]
    busiest = sorted(range(len(topo.links)), key=lambda li: -util[li])[:5]
    lost, sent = layer_bytes(runs)
    per_layer = {op.name: lost.get(op.name, 0) / sent[op.name] for op in graph.ops
                 if op.name in sent}
    doc: dict[str, Any] = {
        "model": graph.workload, "cluster": args.cluster, "scenario": args.scenario,
        "pattern": pattern, "policy": args.policy, "routing": args.routing,
        "p": args.p if cfg.bounded else None, "cell_bytes": cfg.cell_bytes,
        "buffer_bytes": args.buffer_kib << 10, "jitter": args.jitter,
        "buckets_bytes": [b.bytes for b in buckets], "compute_iteration_ms": tl.iteration_ms,
        **s,
        "loss_per_layer": per_layer,
        "links": [{"link": topo.links[li].label, "gbps": topo.links[li].gbps,
                   "busy_max": util[li]} for li in busiest],
    }
    if args.png:
        _plot(runs[0], topo, busiest, cfg.bin_us, args.png)
    if args.json is not None:
        if args.json == "-":
            emit_json(doc)
            return 0
        atomic_write_text(args.json, json.dumps(doc, indent=2) + "\n", what="--json")
    _print_summary(args, graph.workload, pattern, cfg, buckets, s, tl, per_layer, topo, util,
                   busiest)
    if args.json:
        print(f"wrote {args.json}")
    if args.png:
        print(f"wrote {args.png}")
    return 0


def _print_summary(args: argparse.Namespace, workload: str, pattern: str, cfg: Any,
                   buckets: Any, s: dict[str, Any], tl: Any, per_layer: dict[str, float],
                   topo: Any, util: list[float], busiest: list[int]) -> None:
    c, e = s["comm_end_ms"], s["exposed_ms"]
    print(f"netsim: {workload} on {args.cluster}, {args.scenario} ({pattern}), "
          f"{args.policy}" + (f" p={args.p:g}" if cfg.bounded else "") + f", {args.routing}; "
          f"{len(buckets)} buckets, {args.iterations} iterations, {args.cell_kib} KiB cells")
    print(f"  communication ends at p50 {c['p50']:.3f} ms, p99 {c['p99']:.3f} ms (compute "
          f"{tl.iteration_ms:.3f} ms); exposed after the last gradient p50 {e['p50']:.3f} ms, "
          f"p99 {e['p99']:.3f} ms")
    print(f"  lost {s['lost_fraction']:.4%} of gradient bytes; {s['drops']} drops, "
          f"{s['retransmits']} retransmissions, {s['timeouts']} timeouts")
    worst = sorted(per_layer.items(), key=lambda kv: -kv[1])[:5]
    if worst and worst[0][1] > 0:
        print("  most loss: " + ", ".join(f"{n} {v:.2%}" for n, v in worst if v > 0))
    print("  busiest links (busy fraction of the communication window): " + ", ".join(
        f"{topo.links[li].label} {util[li]:.2f}" for li in busiest))


def _simulate(args: argparse.Namespace, net: Any, buckets: Any, ready: Any, cfg: Any,
              pattern: str) -> list[Any]:
    """``--iterations`` seeded iterations (the first checks the event estimate before any
    work), with a progress bar on a terminal."""
    check_events(net, buckets, pattern, cfg)
    runs = []
    with Progress("netsim", args.iterations, enabled=sys.stderr.isatty()) as bar:
        for i in range(args.iterations):
            runs.extend(run_iterations(net, buckets, ready, cfg, pattern=pattern, iterations=1,
                                       seed=args.seed + i, keep_bins=bool(args.png) and i == 0))
            bar.advance()
    return runs


def _plot(run: Any, topo: Any, links: list[int], bin_us: float, path: str) -> None:
    fig = new_figure((9, 4.5))
    ax = fig.subplots()
    for li in links:
        bins = run.link_bins[li]
        if not bins:
            continue
        xs = sorted(bins)
        cap = topo.links[li].bytes_per_s * bin_us * 1e-6
        ax.plot([x * bin_us * 1e-3 for x in xs], [bins[x] / cap for x in xs],
                label=topo.links[li].label, linewidth=0.8)
    ax.set_xlabel("time in the iteration, ms")
    ax.set_ylabel(f"load (fraction of the link, {bin_us:g} us bins)")
    ax.set_title("busiest links, first iteration")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    atomic_write_bytes(path, png_bytes(fig, tight=True), what="--png")
