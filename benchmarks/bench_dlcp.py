"""Bounded-loss priority gradient communication (DLCP), its quality side.

Per model, two ranks in the emulated data-parallel path (the same drop decisions and
arithmetic as the DDP hook on two gloo ranks: tests/sync/test_dlcp.py), every op at fp32, one
cosine schedule, ``--seeds`` paired seeds: ``--comm dlcp:p=P,stress,policy=POLICY`` (the
fixed-p stress mode) for P in
``--ps`` and the three policies (``priority``, ``random``, ``unbiased``), against the plain
all-reduce (p = 0, the same run for every policy: tested bit for bit). Columns: the dropped
fraction actually reached (mean over steps and ranks; the budget is filled in whole chunks,
so it sits just under P), held-out loss (and accuracy for a classifier) as mean and 95%
Student t interval over the seeds, and (mode - p0) paired per seed. Then the claim to
test: priority against random at the largest P, paired per seed, and where each policy's
drops fall (mean fraction dropped per layer).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_dlcp.py --models digits_cnn tiny_gpt --seeds 5

Every figure is of fixed seeds and one thread, so it does not depend on the machine's load.

``--network``: the network half, on the packet simulator (qsync_opt.netsim, docs/NETSIM.md):
resnet50 on v100x16+t4x16 by default, its real DDP buckets emitted at the replayer's ready
times, 100 seeded iterations per cell, simulated time (not this machine's):

    .venv/bin/python benchmarks/bench_dlcp.py --network --dump benchmarks/results/dlcp_network.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_accuracy import ci  # the benchmarks' one 95% t interval

from qsync_opt import load_cluster, trace
from qsync_opt.core.machine import cpu_model
from qsync_opt.documents.io import atomic_write_text
from qsync_opt.job.rank import emulate
from qsync_opt.problem.plan import make_plan
from qsync_opt.runtime.config import TrainConfig
from qsync_opt.runtime.faults import NO_FAULTS
from qsync_opt.strategy.droppolicy import POLICIES

#: Per model: steps, per-rank batch, optimizer, peak lr, schedule, held-out batches, and the
#: chunk (KiB): small enough that 1% of the gradient is many chunks.
DEFAULTS: dict[str, dict[str, Any]] = {
    "digits_cnn": dict(steps=300, batch=32, optimizer="sgd", lr=0.1,
                       schedule="cosine:warmup=15", eval_batches=3, chunk_kib=1),
    "tiny_gpt": dict(steps=200, batch=16, optimizer="adamw", lr=3e-3,
                     schedule="cosine:warmup=10", eval_batches=8, chunk_kib=4),
}


def run(model: str, plan: Path, d: dict[str, Any], comm: str, seed: int, out: Path
        ) -> dict[str, Any]:
    cfg = TrainConfig(workload=model, plan_path=str(plan), rank_groups=["cpu", "cpu"],
                      steps=d["steps"], lr=d["lr"], lr_schedule=d["schedule"],
                      optimizer=d["optimizer"], momentum=0.9, seed=seed, out_dir=str(out),
                      emulate_dp=True, eval_batches=d["eval_batches"], comm=comm)
    s = emulate(cfg, faults=NO_FAULTS)
    rows = [json.loads(x) for r in (0, 1)
            for x in (out / f"metrics.rank{r}.jsonl").read_text().splitlines()]
    layers: dict[str, float] = {}
    for x in rows:
        for k, v in (x.get("dropped_by_layer") or {}).items():
            layers[k] = layers.get(k, 0.0) + v / len(rows)
    return {"eval_loss": s["eval_loss"], "eval_accuracy": s["eval_accuracy"],
            "dropped_frac": statistics.mean(x.get("dropped_frac", 0.0) for x in rows),
            "dropped_by_layer": layers}


def fmt(m: float, h: float, digits: int = 4) -> str:
    return f"{m:.{digits}f} +- {h:.{digits}f}"


def network(args: argparse.Namespace) -> int:
    """The network half: p50/p99 over seeded iterations for the policies (fifo+tcp,
    priority+bounded and the two mixed ones) x
    {hash, spray} x the three scenarios, the workload's real buckets emitted at the
    replayer's ready times (every group at its highest precision)."""
    from qsync_opt.costs.roofline import estimate
    from qsync_opt.netsim.cluster import (
        SCENARIO_PATTERN,
        SCENARIOS,
        cluster_network,
        group_ready_ms,
        run_iterations,
        workload_buckets,
    )
    from qsync_opt.netsim.traffic import POLICIES as NET_POLICIES
    from qsync_opt.netsim.traffic import NetConfig, layer_bytes, summarise

    graph = trace(args.net_model)
    cluster = load_cluster(args.net_cluster).with_default_batch(graph.batch_size)
    costs = estimate(graph, cluster)
    ready, tl = group_ready_ms(graph, cluster, costs)
    buckets = workload_buckets(graph, costs.buckets)
    print(f"{args.net_model} on {args.net_cluster}: {len(buckets)} buckets "
          f"({', '.join(f'{b.bytes / 2**20:.1f}' for b in buckets)} MiB), replayed compute "
          f"{tl.iteration_ms:.1f} ms, last bucket ready at {max(max(r) for r in ready):.1f} ms; "
          f"{args.iterations} seeded iterations, {args.cell_kib} KiB cells, compute jitter "
          f"{args.jitter:g}, bounded p = {args.p:g}, RACK loss detection, min RTO "
          f"{args.min_rto_ms:g} ms; analytic ring all-reduce "
          f"{sum(b.allreduce_ms for b in costs.buckets):.2f} ms in all")
    rows, dump = [], {}
    scenarios = args.scenarios.split(",")
    if not scenarios or any(sc not in SCENARIOS for sc in scenarios):
        raise SystemExit(f"--scenarios: expected names from {', '.join(SCENARIOS)}")
    for scenario in scenarios:
        net = cluster_network(cluster, scenario)
        for policy in args.net_policies.split(","):
            if policy not in NET_POLICIES:
                raise SystemExit(f"--net-policies: expected names from {', '.join(NET_POLICIES)}")
            for routing in ("hash", "spray"):
                cfg = NetConfig(policy=policy, routing=routing, p=args.p,
                                cell_bytes=args.cell_kib << 10, jitter=args.jitter,
                                min_rto_ms=args.min_rto_ms)
                t0 = time.perf_counter()
                runs = run_iterations(net, buckets, ready, cfg,
                                      pattern=SCENARIO_PATTERN[scenario],
                                      iterations=args.iterations, seed=0)
                s = summarise(runs)
                # busiest link over the communication window (first bucket out to the end)
                span = [(r.comm_end_ms - min(r.bucket_start_ms)) * 1e-3 for r in runs]
                util = max(max(b / sp for b in r.link_busy_s) for r, sp in zip(runs, span, strict=True))
                lost, sent = layer_bytes(runs)
                order = [op.name for op in graph.ops if op.name in sent]
                third = max(1, len(order) // 3)
                parts = [order[:third], order[third:-third], order[-third:]]
                by_part = [sum(lost.get(n, 0) for n in part) / max(1, sum(sent[n] for n in part))
                           for part in parts]
                s.update(scenario=scenario, policy=policy, routing=routing,
                         max_link_busy=util, lost_front_mid_back=by_part,
                         wall_s=time.perf_counter() - t0)
                dump[f"{scenario}/{policy}/{routing}"] = s
                rows.append(s)
                print(f"  {scenario:14s} {policy:17s} {routing:5s} comm end p50 "
                      f"{s['comm_end_ms']['p50']:8.2f} p99 {s['comm_end_ms']['p99']:8.2f} ms; "
                      f"exposed p50 {s['exposed_ms']['p50']:7.2f} p99 {s['exposed_ms']['p99']:7.2f}"
                      f" ms; lost {s['lost_fraction']:.4f} (front/mid/back "
                      f"{by_part[0]:.3f}/{by_part[1]:.3f}/{by_part[2]:.3f}); busiest link "
                      f"{util:.2f}; drops {s['drops']}, retransmissions {s['retransmits']}, "
                      f"timeouts {s['timeouts']} [{s['wall_s']:.0f} s]", flush=True)
                if args.dump:  # after every cell: a run stopped early keeps what it did
                    atomic_write_text(args.dump, json.dumps(dump, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--network", action="store_true",
                    help="the network half (packet simulator) instead of the quality half")
    ap.add_argument("--net-model", default="resnet50")
    ap.add_argument("--net-cluster", default="v100x16+t4x16")
    ap.add_argument("--net-policies", default="fifo+tcp,priority+bounded,fifo+bounded,priority+tcp",
                    help="queue+transport pairs; the mixed two separate what each half does")
    ap.add_argument("--scenarios", default="ring,incast,oversubscribed",
                    help="the network half's scenarios, comma-separated, run in this order")
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--cell-kib", type=int, default=256)
    ap.add_argument("--jitter", type=float, default=0.01,
                    help="relative compute-time noise of each rank's bucket ready times")
    ap.add_argument("--p", type=float, default=0.05, help="the bounded-loss transport's p")
    ap.add_argument("--min-rto-ms", type=float, default=200.0,
                    help="the network half's least RTO (default: Linux's 200 ms)")
    ap.add_argument("--models", nargs="+", default=list(DEFAULTS), choices=list(DEFAULTS))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--ps", default="0.01,0.05,0.1,0.3",
                    help="the bounds p, comma-separated (p = 0 always runs)")
    ap.add_argument("--steps", type=int, default=None, help="default: per model")
    ap.add_argument("--dump", type=Path, default=None, help="JSON of every training")
    args = ap.parse_args(argv)
    if args.network:
        return network(args)
    if args.seeds < 2:
        raise SystemExit("--seeds: expected at least 2 (a 95% interval)")
    try:
        ps = [float(x) for x in args.ps.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--ps: expected comma-separated fractions, got {args.ps!r}") from None
    if not ps or not all(0 < p <= 0.5 for p in ps):
        raise SystemExit(f"--ps: expected fractions in (0, 0.5], got {args.ps!r}")
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    print(f"machine: {cpu_model()}; torch threads 1; load average "
          f"{os.getloadavg()[0]:.2f} at the start")
    dump: dict[str, Any] = {}
    for model in args.models:
        d = dict(DEFAULTS[model])
        if args.steps:
            d["steps"] = args.steps
        print(f"\n{model}: 2 ranks x {d['batch']} (emulated), {d['steps']} steps, "
              f"{d['optimizer']} lr {d['lr']:g} {d['schedule']}, chunks of {d['chunk_kib']} KiB, "
              f"{args.seeds} paired seeds", flush=True)
        res: dict[str, list[dict[str, Any]]] = {}
        with tempfile.TemporaryDirectory() as tmp:
            plan = Path(tmp) / "fp32.plan.json"
            make_plan(trace(model, d["batch"]), load_cluster(f"cpux2@{d['batch']}"), {}).save(plan)
            combos = [("p0", "allreduce")] + [
                (f"p{p:g} {pol}",
                 f"dlcp:p={p:g},stress,policy={pol},chunk_kib={d['chunk_kib']:g}")
                for p in ps for pol in POLICIES]
            for name, comm in combos:
                t0 = time.perf_counter()
                res[name] = [run(model, plan, d, comm, s, Path(tmp) / f"{len(res)}-{s}")
                             for s in range(args.seeds)]
                print(f"  {name}: {args.seeds} trainings in {time.perf_counter() - t0:.0f} s",
                      flush=True)
        base = [x["eval_loss"] for x in res["p0"]]
        clf = res["p0"][0]["eval_accuracy"] is not None
        print(f"  {'mode':<16} {'dropped':>8}  {'held-out loss':>16}"
              + (f"  {'accuracy':>16}" if clf else "") + f"  {'loss - p0 (paired)':>18}")
        for name, rs in res.items():
            loss = [x["eval_loss"] for x in rs]
            m, h = ci(loss)
            acc = ""
            if clf:
                am, ah = ci([x["eval_accuracy"] for x in rs])
                acc = f"  {fmt(am, ah):>16}"
            dd = "" if name == "p0" else fmt(*ci([a - b for a, b in zip(loss, base, strict=True)]))
            drop = statistics.mean(x["dropped_frac"] for x in rs)
            print(f"  {name:<16} {drop:>8.2%}  {fmt(m, h):>16}{acc}  {dd:>18}")
        top = max(ps)
        pri = [x["eval_loss"] for x in res[f"p{top:g} priority"]]
        for other in ("random", "unbiased"):
            o = [x["eval_loss"] for x in res[f"p{top:g} {other}"]]
            m, h = ci([a - b for a, b in zip(pri, o, strict=True)])
            verdict = ("priority better" if m + h < 0 else "priority worse" if m - h > 0
                       else "no difference shown")
            print(f"  at p = {top:g}: priority - {other} held-out loss {fmt(m, h)} "
                  f"(paired over {args.seeds} seeds): {verdict}")
        print(f"  where the drops fall at p = {top:g} (mean fraction of each layer's gradient "
              "dropped per step, over steps, ranks and seeds):")
        layer_names = list(res[f"p{top:g} random"][0]["dropped_by_layer"]) or list(
            res[f"p{top:g} priority"][0]["dropped_by_layer"])
        seen = {k for pol in POLICIES for x in res[f"p{top:g} {pol}"] for k in x["dropped_by_layer"]}
        layer_names += sorted(seen - set(layer_names))
        print(f"    {'layer':<28}" + "".join(f"{pol:>10}" for pol in POLICIES))
        for layer in layer_names:
            vals = [statistics.mean(x["dropped_by_layer"].get(layer, 0.0)
                                    for x in res[f"p{top:g} {pol}"]) for pol in POLICIES]
            print(f"    {layer:<28}" + "".join(f"{v:>10.1%}" for v in vals))
        dump[model] = {"settings": d, "runs": res}
    if args.dump:
        args.dump.write_text(json.dumps(dump, indent=2, default=float) + "\n")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s; load average "
          f"{os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
