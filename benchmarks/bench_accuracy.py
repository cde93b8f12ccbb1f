"""Accuracy of plans, first cut: a two-group CPU hybrid trained under each plan, many seeds.

One strong group (this CPU) and one weak group (`cpu/2`, an emulated card half as fast),
trained with single-process data-parallel emulation (`--emulate-dp`, mathematically the
synchronous run) under: every op at fp32 (reference); the weak group uniformly at its lowest
precision (QSync's UP); the exact solver's plan; greedy's plan; a random plan of about the
exact plan's predicted makespan. Per plan and seed: held-out loss and accuracy after the
run. Printed: mean and a 95% confidence interval over the seeds (Student t), and whether
each plan differs from the reference beyond that noise.

    .venv/bin/python benchmarks/bench_accuracy.py [--model digits_cnn] [--seeds 5] [--steps 150]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
from pathlib import Path

from qsync_opt import estimate, parse_shorthand, trace
from qsync_opt._env import cpu_model
from qsync_opt.indicator import indicate
from qsync_opt.precision import Precision
from qsync_opt.problem import AllocationProblem
from qsync_opt.runtime.config import TrainConfig
from qsync_opt.runtime.train import emulate
from qsync_opt.solve import solve

T95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306,
       10: 2.262}


def ci(xs: list[float]) -> tuple[float, float]:
    m = statistics.mean(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, T95.get(len(xs), 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))


def random_plan(prob: AllocationProblem, target_ms: float, seed: int) -> dict[str, list[int]]:
    """A random weak-group assignment whose linear makespan is closest to ``target_ms``."""
    rng = random.Random(seed)
    ref = prob.reference_assignment()
    weak = [g for g in prob.groups if g.name not in prob.strong_groups]
    best, best_d = ref, float("inf")
    for _ in range(3000):
        a = dict(ref)
        for g in weak:
            a[g.name] = [rng.randrange(len(c)) for c in g.choices]
        if any(g.memory_bytes(a[g.name]) > g.capacity_bytes for g in prob.groups):
            continue
        d = abs(prob.makespan_ms(a) - target_ms)
        if d < best_d:
            best, best_d = a, d
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="digits_cnn")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args(argv)
    g = trace(args.model)
    cluster = parse_shorthand("cpux1@32+cpu/2x1@32")
    ind = indicate(args.model, 10, "qsync", batch=32)
    prob = AllocationProblem(g, cluster, estimate(g, cluster), ind)
    exact, rep = solve(prob, "highs", refine=0, compare_ties=False)
    greedy, _ = solve(prob.retarget(float(exact.provenance["target_ms"])), "greedy",
                      refine=0, compare_ties=False)
    ea = prob.assignment(exact)
    plans = {
        "reference fp32": prob.make_plan({gm.name: [c.index(Precision.fp32) for c in gm.choices]
                                          for gm in prob.groups}),
        "weak lowest (UP)": prob.make_plan({gm.name: (gm.reference if gm.name in
                                                      prob.strong_groups else gm.lowest())
                                            for gm in prob.groups}),
        "exact": exact,
        "greedy": greedy,
        "random, equal time": prob.make_plan(random_plan(prob, prob.makespan_ms(ea), 0)),
    }
    print(f"machine: {cpu_model()}; {args.model} on cpux1@32+cpu/2x1@32, {args.steps} steps, "
          f"{args.seeds} seeds, --emulate-dp; exact plan: {rep.mode}")
    results: dict[str, list[tuple[float, float | None]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, plan in plans.items():
            path = Path(tmp) / f"{len(results)}.plan.json"
            plan.save(path)
            for seed in range(args.seeds):
                cfg = TrainConfig(workload=args.model, plan_path=str(path),
                                  rank_groups=["cpu", "cpu_2"], steps=args.steps, lr=args.lr,
                                  seed=seed, out_dir=str(Path(tmp) / f"{name}-{seed}"),
                                  emulate_dp=True, resume=False, eval_batches=8)
                s = emulate(cfg)
                results.setdefault(name, []).append((s["eval_loss"], s.get("eval_accuracy")))
    ref_loss = ci([x[0] for x in results["reference fp32"]])
    print(f"{'plan':>20} {'held-out loss':>22} {'accuracy':>20} {'predicted ms':>13}  vs reference")
    for name, rows in results.items():
        lm, lh = ci([x[0] for x in rows])
        accs = [x[1] for x in rows if x[1] is not None]
        am, ah = ci(accs) if accs else (float("nan"), float("nan"))
        pred = prob.makespan_ms(prob.assignment(plans[name]))
        within = abs(lm - ref_loss[0]) <= lh + ref_loss[1]
        print(f"{name:>20} {lm:10.4f} +- {lh:8.4f} {am:10.4f} +- {ah:6.4f} {pred:13.2f}  "
              + ("within noise" if within and name != "reference fp32" else
                 ("" if name == "reference fp32" else f"{lm - ref_loss[0]:+.4f}")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
