"""The strategy search checked against measurement: predicted against measured step time of
8 strategies on two gloo ranks (``cpu`` and ``cpu/2``) over an emulated link, per model and
link, with the Spearman rank correlation and the planner's choice against the measured best.

Per model (``--models``) the op costs are profiled once on this CPU, in one process
(``profile_detailed``, one thread; ``--tables DIR`` keeps them for a re-run). Per link
(``--links``: name=GB/s,latency_us pairs) the cluster ``cpux1@B+cpu/2x1@B`` is given that
inter-node link, the costs' communication model is the link's own figures
(``LinkSpec.comm_model``: what ``train --emulate-link cluster`` delivers) in series with the
local gloo all-reduce measured on two processes (the link sleeps on top of it), ``cpu/2``
derived from the profile, and the strategy
search (:func:`qsync_opt.planner.strategies.search_strategies`, every candidate solved)
predicts each strategy's step: ddp over fp32, fp16 and dlcp (1% and 5%), local:2, local:4,
local:8 and qsr. Each strategy's version-2 plan is then trained with
``qsync-opt train --plan P --emulate-link cluster`` (nothing else: the plan says the
strategy) for ``--steps`` steps; measured: the mean ``step_ms`` of the slower rank over the
steps after the first ``--skip`` (a mean, not a median: Local SGD pays its round once in H
steps). Printed per strategy: predicted and measured ms, their ratio; per model and link:
Spearman's rho of the two orders, and the planner's choice's measured step against the
measured best.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_strategy.py \\
        [--models digits_cnn,tiny_gpt] [--links fast=10,20:slow=0.02,200] [--steps 32] \\
        [--tables DIR] [--json OUT]

The step times are wall-clock: run it on a quiet machine and say the load (printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from qsync_opt.solvers import SolveOptions

from qsync_opt import parse_shorthand, trace
from qsync_opt.core.machine import cpu_model
from qsync_opt.costs.link import LinkSpec
from qsync_opt.documents.schemas import CommModel, CostTable
from qsync_opt.planner.solve import solve
from qsync_opt.planner.strategies import StrategySearch, plan_of, search_strategies
from qsync_opt.problem.program import AllocationProblem, ProblemOptions
from qsync_opt.problem.synthetic import random_indicator
from qsync_opt.profile import derive, measure_comm_local, profile_detailed, with_comm
from qsync_opt.strategy.space import parse_allow

#: Per-rank batch of each model (as bench_prediction's).
BATCH = {"digits_cnn": 64, "tiny_gpt": 16}
#: 8 data-parallel strategies. Pipelines are left out: the search prices a pipeline with the
#: GPipe predictor, whose stage costs are the roofline's, not this profile's (see the docs).
SPACE = ["sync=ddp,local:2-8,qsr", "transport=fp32,fp16,dlcp:0.01-0.05"]


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho (average ranks for ties)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else float("nan")


def profiled(name: str, tables: Path | None) -> CostTable:
    path = tables / f"{name}.costs.json" if tables else None
    if path is not None and path.exists():
        return CostTable.load(path)
    table = profile_detailed(name, BATCH[name], device="cpu", repeats=8, threads=1).table
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        table.save(path)
    return table


def searched(name: str, costs: CostTable, local: CommModel, gbps: float, latency_us: float
             ) -> StrategySearch:
    """Every strategy of :data:`SPACE` predicted on the two-rank cluster behind this link."""
    b = BATCH[name]
    graph = trace(name, b)
    cluster = parse_shorthand(f"cpux1@{b}+cpu/2x1@{b}").model_copy(update={
        "inter_node_bandwidth_gb_per_s": gbps, "inter_node_latency_us": latency_us})
    link = LinkSpec.from_cluster(cluster, [g.name for g in cluster.groups]).comm_model()
    # the emulated delay sleeps on top of the real local transfer: the two in series
    comm = link.model_copy(update={
        "bandwidth_gb_per_s": 1 / (1 / link.bandwidth_gb_per_s + 1 / local.bandwidth_gb_per_s),
        "latency_us": link.latency_us + local.latency_us,
        "bottleneck": f"emulated link in series with local gloo ({link.bottleneck})"})
    costs = with_comm(derive(costs, ["cpu/2"]), graph, comm)
    problem = AllocationProblem(graph, cluster, costs, random_indicator(graph),
                                ProblemOptions())

    def one(sub: AllocationProblem, o: SolveOptions) -> Any:
        return solve(sub, "highs", o, refine=1, compare_ties=False)

    return search_strategies(problem, parse_allow(SPACE), one, SolveOptions(time_limit_s=120),
                             prune=False)


def measured(name: str, plan_path: Path, out: Path, steps: int, skip: int) -> float:
    """``train --plan P --emulate-link cluster``: the slower rank's mean step_ms after
    ``skip`` steps."""
    cmd = [sys.executable, "-m", "qsync_opt.cli", "train", "--model", name, "--plan",
           str(plan_path), "--steps", str(steps), "--out", str(out), "--no-resume",
           "--emulate-link", "cluster", "--timeout", "300"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    per_rank = []
    for f in sorted(out.glob("metrics.rank*.jsonl")):
        rows = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        timed = [r["step_ms"] for r in rows if "step_ms" in r and r.get("step", 0) > skip]
        if timed:
            per_rank.append(statistics.mean(timed))
    return max(per_rank)


def run_case(name: str, costs: CostTable, local: CommModel, link: str, gbps: float,
             latency_us: float, steps: int, skip: int, tmp: Path) -> dict[str, Any]:
    search = searched(name, costs, local, gbps, latency_us)
    rows = []
    for i, r in enumerate(search.rows):
        if r.plan is None or r.prediction is None:
            continue
        plan = plan_of(r, search.space)
        path = tmp / f"{name}-{link}-{i}.plan.json"
        plan.save(path)
        meas = measured(name, path, tmp / f"{name}-{link}-{i}", steps, skip)
        rows.append({"strategy": r.candidate.describe(), "predicted_ms": r.prediction.step_ms,
                     "measured_ms": meas, "chosen": r is search.chosen})
        print(f"  {r.candidate.describe()[:40]:<40} {r.prediction.step_ms:9.2f} {meas:9.2f} "
              f"{meas / r.prediction.step_ms:7.3f}" + ("  (chosen)" if r is search.chosen
                                                       else ""), flush=True)
    rho = spearman([x["predicted_ms"] for x in rows], [x["measured_ms"] for x in rows])
    best = min(x["measured_ms"] for x in rows)
    chosen = next(x for x in rows if x["chosen"])
    print(f"  Spearman rho {rho:.3f} over {len(rows)} strategies; chosen "
          f"{chosen['strategy']} measured {chosen['measured_ms']:.2f} ms against the measured "
          f"best {best:.2f} ms (+{chosen['measured_ms'] / best - 1:.1%})")
    return {"model": name, "link": link, "gb_per_s": gbps, "latency_us": latency_us,
            "rows": rows, "spearman": rho, "chosen_over_best": chosen["measured_ms"] / best}


def _links(text: str) -> list[tuple[str, float, float]]:
    out = []
    for item in text.split(":"):
        name, _, figs = item.partition("=")
        bw, _, lat = figs.partition(",")
        out.append((name, float(bw), float(lat or 50)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="digits_cnn,tiny_gpt")
    ap.add_argument("--links", default="fast=10,20:slow=0.02,200",
                    help="NAME=GB/s,LATENCY_US joined by ':'")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--skip", type=int, default=8, help="steps left out of the mean")
    ap.add_argument("--tables", default=None, help="folder keeping the profiled costs")
    ap.add_argument("--json", default=None, help="write every row here")
    args = ap.parse_args(argv)
    print(f"CPU: {cpu_model()}; load {os.getloadavg()[0]:.2f} at the start", flush=True)
    cases = []
    tables = Path(args.tables) if args.tables else None
    local = measure_comm_local(2)
    print(f"local gloo all-reduce (two processes): {local.bandwidth_gb_per_s:.2f} GB/s, "
          f"{local.latency_us:.1f} us a hop", flush=True)
    with tempfile.TemporaryDirectory() as d:
        for name in args.models.split(","):
            costs = profiled(name, tables)
            for link, gbps, lat in _links(args.links):
                print(f"\n== {name}, batch {BATCH[name]} a rank, link {link}: {gbps:g} GB/s, "
                      f"{lat:g} us (emulated); {args.steps} steps, mean of the steps after "
                      f"{args.skip}\n  {'strategy':<40} {'pred ms':>9} {'meas ms':>9} "
                      f"{'meas/pred':>7}", flush=True)
                cases.append(run_case(name, costs, local, link, gbps, lat, args.steps,
                                      args.skip, Path(d)))
    print(f"\nload {os.getloadavg()[0]:.2f} at the end")
    if args.json:
        Path(args.json).write_text(json.dumps(cases, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
