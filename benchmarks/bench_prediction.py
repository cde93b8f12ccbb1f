"""Predicted against measured iteration time on this CPU, from profiled costs (first cut).

For each model: profile it once on this CPU at one thread (uniform precisions, every op in
isolation: `qsync_opt.profile`), then for five plans — uniform fp32, bf16 and int8, and two
mixed plans from the exact solver at targets a third and two thirds of the way from the
fastest to the fp32 iteration — predict one single-process iteration with the replayer
from those profiled costs (no mixed plan is ever profiled) and measure it: forward,
backward and an SGD step of the model with the plan applied, median of repeats after
warm-up, one thread. The run-to-run noise is measured first (the fp32 plan timed twice).
Isolated op timings do not add up to their in-model cost, so two factors (choosable ops;
everything else) are fitted on the three *uniform* runs and the mixed plans are held out:
their error is the honest figure.
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
from qsync_opt.replayer import Replayer
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


def nnls2(rows: list[tuple[float, float]], rhs: list[float]) -> tuple[float, float]:
    """Least squares for (a, c) >= 0 with two unknowns: the unconstrained solution, or the
    better one-factor fit when it has a negative factor."""
    A = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(rhs, dtype=torch.float64)
    a, c = (float(v) for v in torch.linalg.lstsq(A, y.unsqueeze(1)).solution.squeeze(1))
    if a >= 0 and c >= 0:
        return a, c
    best = None
    for j in (0, 1):
        col = A[:, j]
        k = max(float(col @ y) / float(col @ col), 0.0) if float(col @ col) > 0 else 0.0
        res = float(((col * k - y) ** 2).sum())
        cand = (k, 0.0) if j == 0 else (0.0, k)
        if best is None or res < best[0]:
            best = (res, cand)
    assert best is not None
    return best[1]


def scaled(prob: AllocationProblem, a: float, c: float) -> Replayer:
    """The problem's replayer with choosable-op costs times ``a`` and every other cost
    (other ops, casts) times ``c``; the optimizer step stays as measured."""
    choosable = {o.name for o in prob.graph.choosable_ops()}
    costs = prob.costs
    entries = [e.model_copy(update={"fwd_ms": e.fwd_ms * (a if e.op in choosable else c),
                                    "bwd_ms": e.bwd_ms * (a if e.op in choosable else c)})
               for e in costs.entries]
    casts = [x.model_copy(update={"a_ms_per_element": x.a_ms_per_element * c,
                                  "b_ms": x.b_ms * c}) for x in costs.casts]
    table = costs.model_copy(update={"entries": entries, "casts": casts})
    return Replayer(prob.graph, prob.cluster, table)


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
        measured = {label: measure(name, plan, b, args.repeats) for label, plan in plans.items()}
        # Calibration from the uniform runs only: isolated op timings do not add up to their
        # cost inside the model, differently for GEMM-like choosable ops and the rest (views,
        # elementwise, norms, casts). Fit two factors, a for the choosable ops and c for the
        # rest, on the three uniform plans (least squares); the mixed plans are held out.
        basis = {k: scaled(prob, *k) for k in ((1.0, 0.0), (0.0, 1.0), (0.0, 0.0))}
        rows, rhs = [], []
        for label, plan in plans.items():
            if label.startswith("uniform"):
                gv, rv, ov = (basis[k].simulate(plan, events=False).iteration_ms for k in basis)
                rows.append((gv - ov, rv - ov))
                rhs.append(measured[label] - ov)
        a_fit, c_fit = nnls2(rows, rhs)
        calibrated = scaled(prob, a_fit, c_fit)
        print(f"calibration from the uniform runs: choosable ops x{a_fit:.3f}, the rest x{c_fit:.3f}")
        print(f"{'plan':>22} {'raw pred ms':>12} {'calibrated':>11} {'measured ms':>12} "
              f"{'raw error':>10} {'cal. error':>11}")
        held_out = []
        for label, plan in plans.items():
            raw = prob.replayer.simulate(plan, events=False).iteration_ms
            cal = calibrated.simulate(plan, events=False).iteration_ms
            meas = measured[label]
            err = (cal - meas) / meas
            tag = "" if label.startswith("uniform") else "  (held out)"
            if tag:
                held_out.append(abs(err))
            print(f"{label:>22} {raw:12.2f} {cal:11.2f} {meas:12.2f} {(raw - meas) / meas:+10.1%} "
                  f"{err:+11.1%}{tag}")
        if held_out:
            print(f"held-out mixed plans, calibrated: median |error| "
                  f"{statistics.median(held_out):.1%}, worst {max(held_out):.1%} "
                  f"(noise {noise:.1%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
