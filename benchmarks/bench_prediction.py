"""Predicted against measured iteration time on this CPU, from profiled costs (first cut).

For each model: profile it once on this CPU at one thread (uniform precisions, every op in
isolation: `qsync_opt.profile`), then for five plans — uniform fp32, bf16 and int8, and two
mixed plans from the exact solver at targets a third and two thirds of the way from the
fastest to the fp32 iteration — predict one single-process iteration with the replayer
from those profiled costs (no mixed plan is ever profiled) and measure it: forward,
backward and an SGD step of the model with the plan applied, median of repeats after
warm-up, one thread. The run-to-run noise is measured first (the fp32 plan timed twice).
Peak memory is not measured here yet (a CPU has no allocator statistics to compare with).

    .venv/bin/python benchmarks/bench_prediction.py [--models digits_cnn,tiny_gpt] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from qsync_opt.models import compute_loss, get_workload

from qsync_opt import parse_shorthand, trace
from qsync_opt._env import cpu_model
from qsync_opt.precision import Precision
from qsync_opt.problem import AllocationProblem
from qsync_opt.profile import profile
from qsync_opt.runtime import apply_plan
from qsync_opt.solve import _reachable_ms, solve
from qsync_opt.synthetic import random_indicator

BATCH = {"digits_cnn": 64, "tiny_gpt": 16, "resnet18": 8}


def measure(model_name: str, plan, batch: int, repeats: int) -> float:
    """Median ms of forward + backward + SGD step with ``plan`` applied (one thread)."""
    wl = get_workload(model_name)
    torch.manual_seed(0)
    model = wl.build().float().train()
    apply_plan(model, plan, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    inputs = wl.make_inputs(batch, torch.device("cpu"))
    targets = wl.make_targets(batch, torch.device("cpu"))
    times = []
    for i in range(repeats + 3):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = compute_loss(wl, model(*inputs), targets)
        loss.backward()
        opt.step()
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="digits_cnn,tiny_gpt")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"machine: {cpu_model()}, torch {torch.__version__}, 1 thread")
    for name in args.models.split(","):
        b = BATCH.get(name, 8)
        g = trace(name, b)
        t0 = time.perf_counter()
        costs = profile(name, b, device="cpu", repeats=args.repeats, threads=1)
        prof_s = time.perf_counter() - t0
        cluster = parse_shorthand(f"cpux1@{b}")
        prob = AllocationProblem(g, cluster, costs, random_indicator(g))
        gm = prob.groups[0]

        def uniform(p: Precision, gm=gm) -> list[int]:  # noqa: ANN001
            return [c.index(p) if p in c else c.index(Precision.fp32) for c in gm.choices]

        plans = {f"uniform {p.value}": prob.make_plan({"cpu": uniform(p)})
                 for p in (Precision.fp32, Precision.bf16, Precision.int8)}
        ref = prob.makespan_ms({"cpu": uniform(Precision.fp32)})
        lo = _reachable_ms(prob) or ref
        for frac in (1 / 3, 2 / 3):
            target = lo + frac * (ref - lo)
            try:
                plan, _ = solve(prob.retarget(target), "highs", refine=0, compare_ties=False)
                plans[f"mixed @{target:.1f} ms"] = plan
            except Exception as exc:  # noqa: BLE001 - a benchmark row, not a crash
                print(f"  mixed @{target:.1f} ms: no plan ({exc})")
        noise_a = measure(name, plans["uniform fp32"], b, args.repeats)
        noise_b = measure(name, plans["uniform fp32"], b, args.repeats)
        noise = abs(noise_a - noise_b) / min(noise_a, noise_b)
        print(f"\n== {name}, batch {b}: profiled in {prof_s:.1f} s; run-to-run noise "
              f"{noise:.1%} (fp32 timed twice: {noise_a:.2f} / {noise_b:.2f} ms)")
        print(f"{'plan':>22} {'predicted ms':>13} {'measured ms':>12} {'error':>8}")
        errors = []
        for label, plan in plans.items():
            pred = prob.replayer.simulate(plan, events=False).iteration_ms
            meas = measure(name, plan, b, args.repeats)
            err = (pred - meas) / meas
            errors.append(abs(err))
            print(f"{label:>22} {pred:13.2f} {meas:12.2f} {err:+8.1%}")
        print(f"median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
