"""Pareto frontiers of every allocator, and what the joint batch split buys.

For resnet50 on v100x16+t4x16 and bert_base on a100x8+t4x8 (catalog estimates, seeded random
indicators): the frontier (degradation against linear-model throughput as the makespan
target sweeps) of the exact solver at the given split and with the joint split, QSync's
greedy, the additive ILP and the baselines, in one table and one plot per model; then the
best throughput each of precision-only (exact, given split), batch-only (dynamic batching)
and joint (exact + split) reaches within equal degradation budgets; then the joint model's
solve time at the halfway target.

    .venv/bin/python benchmarks/bench_frontier.py [--points 6] [--png-dir docs]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from qsync_opt import estimate, parse_shorthand, trace
from qsync_opt.core.machine import cpu_model
from qsync_opt.planner.frontier import format_points, frontier, plot_frontier
from qsync_opt.planner.solve import solve
from qsync_opt.planner.splits import batch_splits
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.problem.synthetic import random_indicator

INSTANCES = [("resnet50", "v100x16+t4x16"), ("bert_base", "a100x8+t4x8")]


def best_within(points, allocator: str, budget: float) -> float | None:
    vals = [p.samples_per_s for p in points if p.allocator == allocator and p.objective is not None
            and p.objective <= budget * (1 + 1e-9) + 1e-15 and p.feasible]
    return max(vals) if vals else None


def budget_ratios(pts) -> list[tuple[float, float | None, float | None]]:
    """(budget, joint/precision-only, joint/batch-only) at budgets 0 and the quartiles of the
    exact frontier's objectives."""
    exact = sorted({p.objective for p in pts if p.allocator in ("exact", "exact+split")
                    and p.objective is not None})
    budgets = [0.0] + [exact[len(exact) * k // 4] for k in (1, 2, 3) if exact]
    out = []
    for b in sorted(set(budgets)):
        prec = best_within(pts, "exact", b)
        batch = best_within(pts, "dynamic-batching", b)
        joint = best_within(pts, "exact+split", b)
        out.append((b, joint / prec if joint and prec else None,
                    joint / batch if joint and batch else None))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=6)
    ap.add_argument("--png-dir", default="docs")
    ap.add_argument("--seeds", default="0,1,2,3,4",
                    help="random-indicator seeds; the first gets the full table and the plot, "
                         "all of them the ratio ranges (default 0-4)")
    args = ap.parse_args(argv)
    seeds = [int(x) for x in args.seeds.split(",")]
    print(f"machine: {cpu_model()}; exact backend highs; random indicators "
          f"(qsync_opt.problem.synthetic.random_indicator), seeds {', '.join(map(str, seeds))}")
    for model, shorthand in INSTANCES:
        g = trace(model)
        c = parse_shorthand(shorthand)
        per_seed: dict[int, list[tuple[float, float | None, float | None]]] = {}
        for seed in seeds:
            prob = AllocationProblem(g, c, estimate(g, c), random_indicator(g, seed=seed))
            t0 = time.perf_counter()
            pts = frontier(prob, points=args.points)
            secs = time.perf_counter() - t0
            per_seed[seed] = budget_ratios(pts)
            if seed != seeds[0]:
                print(f"  {model}, seed {seed}: frontier in {secs:.0f} s; joint/precision "
                      + ", ".join(f"{r:.3f}" if r else "-" for _, r, _ in per_seed[seed])
                      + "; joint/batch "
                      + ", ".join(f"{r:.3f}" if r else "-" for _, _, r in per_seed[seed]))
                continue
            print(f"\n== {model} on {shorthand}, seed {seed}: global batch "
                  f"{prob.global_batch}, {len(batch_splits(prob))} candidate splits; frontier "
                  f"in {secs:.0f} s")
            print(format_points(pts))
            png = Path(args.png_dir) / f"frontier_{model}.png"
            plot_frontier(pts, png, f"{model} on {shorthand} (catalog estimates, random "
                          f"indicator seed {seed})")
            print(f"plot: {png}")
            print("\nbest samples/s within a degradation budget (linear model; '-' = none):")
            print(f"{'budget':>12} {'precision-only':>15} {'batch-only':>11} {'joint':>10} "
                  f"{'joint/precision':>16} {'joint/batch':>12}")
            for b in sorted({x[0] for x in per_seed[seed]}):
                prec = best_within(pts, "exact", b)
                batch = best_within(pts, "dynamic-batching", b)
                joint = best_within(pts, "exact+split", b)

                def f(v: float | None) -> str:
                    return f"{v:.1f}" if v is not None else "-"

                def r(a: float | None, z: float | None) -> str:
                    return f"{a / z:.3f}" if a and z else "-"

                print(f"{b:12.5g} {f(prec):>15} {f(batch):>11} {f(joint):>10} "
                      f"{r(joint, prec):>16} {r(joint, batch):>12}")
            ref = prob.makespan_ms(prob.reference_assignment())
            lo = min(p.makespan_ms for p in pts if p.allocator == "exact" and p.makespan_ms)
            mid = prob.retarget((lo + ref) / 2)
            t0 = time.perf_counter()
            plan, rep = solve(mid, "highs", joint_split=True, refine=0, compare_ties=False)
            wall = time.perf_counter() - t0
            t1 = time.perf_counter()
            _, rep1 = solve(mid, "highs", refine=0, compare_ties=False)
            one = time.perf_counter() - t1
            print(f"\njoint model at the halfway target {mid.target_ms:.1f} ms: {wall:.2f} s "
                  f"wall ({rep.messages[0]}); one fixed split: {one:.2f} s; objective "
                  f"{rep.objective:.5g} joint vs {rep1.objective:.5g} fixed\n")
        pos = [(jp, jb) for rows in per_seed.values() for b, jp, jb in rows if b > 0]
        jps = [x for x, _ in pos if x]
        jbs = [y for _, y in pos if y]
        if jps:
            print(f"{model}, {len(seeds)} seeds, budgets above 0: joint/precision-only "
                  f"{min(jps):.2f}-{max(jps):.2f}x (median {statistics.median(jps):.2f}), "
                  + (f"joint/dynamic batching {min(jbs):.2f}-{max(jbs):.2f}x (median "
                     f"{statistics.median(jbs):.2f})" if jbs else "dynamic batching: none"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
