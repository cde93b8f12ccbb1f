"""Accuracy of plans: a two-group CPU hybrid trained under each plan, many seeds (issue 9).

One strong group (this CPU) and one weak group (`cpu/2`, an emulated card half as fast),
or with ``--cluster`` two catalog cards (e.g. ``v100x1+t4x1``: the plans are chosen from the
catalog's estimates for those cards, where lower precision is faster; on a CPU without AMX
every lower precision is slower, so with the default cluster every plan but UP is all-fp32),
both at ``--batch`` per rank, trained with single-process data-parallel emulation
(``TrainConfig(emulate_dp=True)``, mathematically the synchronous run) under: every op at
fp32 (reference); the weak group uniformly at its lowest precision (QSync's UP); the exact
solver's plan; greedy's plan at the exact plan's target; a random weak-group plan of about
the exact plan's predicted makespan. The indicator is ``indicate(model, 10, "qsync",
batch=--batch)`` on the workload's real data, computed afresh (no cache) and timed.

Metrics (held-out, after the run). ``emulate``'s summary has ``eval_loss`` and
``eval_accuracy``: rank 0's replica in eval mode, *at rank 0's group's precisions*, on
``--eval-batches`` held-out batches of the global batch (2 x ``--batch`` samples), each
batch's mean loss weighted by its number of samples. For tiny_gpt (causal LM) a batch's loss
is ``F.cross_entropy`` over all its (sequence, position) tokens and every batch has the same
number of tokens, so ``eval_loss`` is the mean per-token cross-entropy (nats) over every
held-out token; for digits_cnn the mean cross-entropy per image. Since greedy also lowers
the strong group (rank 0), that score would mix the plan's effect on training with
low-precision inference; so every plan's trained weights (``emulate``'s checkpoint; all
replicas hold the same weights) are re-scored here at fp32 on the very same held-out batches,
weighted the same way (the largest gap to ``eval_loss`` is printed). Printed: for tiny_gpt
the held-out perplexity ``exp(mean token CE)`` as the primary figure, with the token CE (the
untrained model's is printed once, for context); for digits_cnn held-out loss and accuracy.
The held-out batches depend on the seed only, so every plan is scored on the same data.

Statistics. Mean and 95% confidence interval over the seeds (Student t). Seeds are shared
across plans (same seed: same initial weights, same training batches, same held-out batches),
so each plan is compared with the reference *paired*: per seed the difference plan minus
reference, then the mean of those differences and its 95% t interval. "within noise" when
the interval contains 0; otherwise the difference and its interval are stated as beyond
noise. The same paired test compares the exact plan with greedy, the random plan and UP.

    .venv/bin/python benchmarks/bench_accuracy.py --model tiny_gpt --seeds 5
    .venv/bin/python benchmarks/bench_accuracy.py --model digits_cnn --seeds 5 --steps 150
    .venv/bin/python benchmarks/bench_accuracy.py --model digits_cnn --seeds 5 --cluster v100x1+t4x1

Per-model defaults (override with the flags): digits_cnn batch 32, 150 steps, SGD lr 0.05;
tiny_gpt batch 16, 120 steps, Adam lr 1e-3; 8 held-out batches each.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from qsync_opt import estimate, parse_shorthand, trace
from qsync_opt.indicator import indicate
from qsync_opt.machine import cpu_model
from qsync_opt.precision import Precision
from qsync_opt.problem import AllocationProblem
from qsync_opt.runtime.config import TrainConfig
from qsync_opt.runtime.train import emulate
from qsync_opt.schemas import Plan
from qsync_opt.solve import solve

#: Two-sided 95% Student t quantiles by sample size n (df = n - 1), when scipy is absent.
T95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306,
       10: 2.262, 11: 2.228, 12: 2.201, 13: 2.179, 14: 2.160, 15: 2.145, 16: 2.131,
       17: 2.120, 18: 2.110, 19: 2.101, 20: 2.093, 21: 2.086, 26: 2.060, 31: 2.042}

#: Per-model defaults: per-rank batch, steps, optimizer, learning rate, held-out batches.
DEFAULTS = {
    "digits_cnn": {"batch": 32, "steps": 150, "optimizer": "sgd", "lr": 0.05, "eval_batches": 8},
    "tiny_gpt": {"batch": 16, "steps": 120, "optimizer": "adam", "lr": 1e-3, "eval_batches": 8},
}
FALLBACK = {"batch": 32, "steps": 150, "optimizer": "sgd", "lr": 0.05, "eval_batches": 8}

REF = "reference fp32"


def t95(n: int) -> float:
    try:
        from scipy.stats import t as student_t

        return float(student_t.ppf(0.975, n - 1))
    except ImportError:
        return T95.get(n, T95[max(k for k in T95 if k <= n)] if n > 2 else float("nan"))


def ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% Student t interval (nan for one sample)."""
    m = statistics.mean(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, t95(len(xs)) * statistics.stdev(xs) / math.sqrt(len(xs))


def paired(xs: list[float], ys: list[float], digits: int) -> str:
    """Paired comparison of x against y (same seeds): mean of x - y, its 95% t interval."""
    d, h = ci([x - y for x, y in zip(xs, ys, strict=True)])
    if math.isnan(h):
        return f"{d:+.{digits}f} (one seed: no interval)"
    text = f"{d:+.{digits}f} +- {h:.{digits}f}"
    return f"within noise ({text})" if abs(d) <= h else f"{text} beyond noise"


def random_plan(prob: AllocationProblem, target_ms: float, seed: int, tol: float = 0.01,
                walk: int = 2000) -> dict[str, list[int]]:
    """A random weak-group assignment whose linear makespan is within ``tol`` of ``target_ms``.

    Independent uniform draws almost never land near a tight target (slow precisions and
    casts dominate), so this is a random walk: from a uniform random start, single-op changes
    are accepted when they do not move the makespan away from the target, then, once inside
    the band, ``walk`` more proposals wander within it. The strong groups stay at fp32.
    """
    rng = random.Random(seed)
    a = prob.reference_assignment()
    weak = [g for g in prob.groups if g.name not in prob.strong_groups]
    for g in weak:
        a[g.name] = [rng.randrange(len(c)) for c in g.choices]
    band = tol * target_ms
    dist = abs(prob.makespan_ms(a) - target_ms)
    inside = 0
    for _ in range(200_000):
        g = rng.choice(weak)
        u = rng.randrange(len(g.choices))
        b = dict(a)
        b[g.name] = list(a[g.name])
        b[g.name][u] = rng.randrange(len(g.choices[u]))
        if g.memory_bytes(b[g.name]) > g.capacity_bytes:
            continue
        d = abs(prob.makespan_ms(b) - target_ms)
        if d <= max(dist, band):
            a, dist = b, d
        if dist <= band:
            inside += 1
            if inside >= walk:
                break
    return a


def fp32_eval(model: str, seed: int, global_batch: int, eval_batches: int,
              checkpoint: Path | None = None) -> tuple[float, float | None]:
    """Held-out (loss, accuracy or None) of fp32 weights, on the held-out batches ``emulate``
    scores for ``seed``, weighted as it weights them: the seed's initial weights, or the
    trained weights of ``checkpoint`` (``emulate``'s)."""
    from qsync_opt.models import TASK_CLASSIFICATION, compute_loss, get_workload

    from qsync_opt.runtime.train import GlobalBatches, load_checkpoint

    wl = get_workload(model)
    torch.manual_seed(seed)
    net = wl.build().float()
    if checkpoint is not None:
        net.load_state_dict(load_checkpoint(checkpoint)["model"])
    net.eval()
    data = GlobalBatches(wl, seed, global_batch)
    tot, correct, n = 0.0, 0.0, 0
    with torch.no_grad():
        for inputs, targets in data.eval_batches(eval_batches):
            out = net(*inputs)
            k = targets.shape[0]
            tot += float(compute_loss(wl, out, targets)) * k
            if wl.task == TASK_CLASSIFICATION:
                correct += float((out.argmax(-1) == targets).sum())
            n += k
    return tot / n, (correct / n if wl.task == TASK_CLASSIFICATION else None)


def describe(plan: Plan) -> str:
    """Per group, how many ops run at each precision."""
    parts = []
    for name, gp in plan.groups.items():
        c = Counter(Precision(p).value for p in gp.precisions.values())
        parts.append(f"{name}: " + ", ".join(f"{k} {v}" for v, k in
                                             sorted(((v, k) for k, v in c.items()), reverse=True)))
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="digits_cnn")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=None, help="default: per model")
    ap.add_argument("--batch", type=int, default=None, help="per-rank batch; default: per model")
    ap.add_argument("--lr", type=float, default=None, help="default: per model")
    ap.add_argument("--optimizer", choices=["sgd", "adam"], default=None,
                    help="default: per model")
    ap.add_argument("--eval-batches", type=int, default=None, help="default: per model")
    ap.add_argument("--cluster", default=None,
                    help="two one-device groups whose catalog estimates choose the plans, e.g. "
                         "v100x1+t4x1 (default: cpux1+cpu/2x1, this CPU's own ratios); the "
                         "training is emulated on this CPU either way")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    d = DEFAULTS.get(args.model, FALLBACK)
    batch = args.batch or d["batch"]
    steps = args.steps or d["steps"]
    lr = args.lr or d["lr"]
    optimizer = args.optimizer or d["optimizer"]
    eval_batches = args.eval_batches if args.eval_batches is not None else d["eval_batches"]
    lm = args.model == "tiny_gpt"
    shorthand = "+".join(f"{part.split('@')[0]}@{batch}" for part in
                         (args.cluster or "cpux1+cpu/2x1").split("+"))
    t_start = time.perf_counter()

    g = trace(args.model, batch)
    cluster = parse_shorthand(shorthand)
    if len(cluster.groups) != 2 or any(gr.count != 1 for gr in cluster.groups):
        raise SystemExit("--cluster: expected two groups of one device each, e.g. v100x1+t4x1")
    rank_groups = [gr.name for gr in cluster.groups]
    t0 = time.perf_counter()
    ind = indicate(args.model, 10, "qsync", batch=batch, cache=False)
    t_ind = time.perf_counter() - t0
    prob = AllocationProblem(g, cluster, estimate(g, cluster), ind)
    exact, rep = solve(prob, "highs", refine=0, compare_ties=False)
    greedy, _ = solve(prob.retarget(float(exact.provenance["target_ms"])), "greedy",
                      refine=0, compare_ties=False)
    ea = prob.assignment(exact)
    plans = {
        REF: prob.make_plan({gm.name: [c.index(Precision.fp32) for c in gm.choices]
                             for gm in prob.groups}),
        "weak lowest (UP)": prob.make_plan({gm.name: (gm.reference if gm.name in
                                                      prob.strong_groups else gm.lowest())
                                            for gm in prob.groups}),
        "exact": exact,
        "greedy": greedy,
        "random, equal time": prob.make_plan(random_plan(prob, prob.makespan_ms(ea), 0)),
    }
    print(f"machine: {cpu_model()}; torch threads {torch.get_num_threads()}")
    print(f"{args.model} on {shorthand}, {steps} steps, {optimizer} lr {lr:g}, {args.seeds} "
          f"seeds, emulated DP, {eval_batches} held-out batches of {2 * batch}")
    print(f"indicator: qsync, 10 real batches of {batch}, {t_ind:.1f} s (not cached)")
    print(f"exact plan: {rep.mode}")
    for name, plan in plans.items():
        print(f"  {name:>20}: {describe(plan)}")
    u, _ = fp32_eval(args.model, 0, 2 * batch, eval_batches)
    if lm:
        print(f"untrained (seed 0 init, fp32): held-out token CE {u:.4f} nats, "
              f"perplexity {math.exp(u):.2f} (vocabulary 98)")
    else:
        print(f"untrained (seed 0 init, fp32): held-out loss {u:.4f}")

    loss: dict[str, list[float]] = {}
    acc: dict[str, list[float]] = {}
    wall: dict[str, list[float]] = {}
    rank0_gap: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, plan) in enumerate(plans.items()):
            path = Path(tmp) / f"{i}.plan.json"
            plan.save(path)
            for seed in range(args.seeds):
                cfg = TrainConfig(workload=args.model, plan_path=str(path),
                                  rank_groups=rank_groups, steps=steps, lr=lr,
                                  optimizer=optimizer, seed=seed,
                                  out_dir=str(Path(tmp) / f"{i}-{seed}"), emulate_dp=True,
                                  resume=False, eval_batches=eval_batches)
                s = emulate(cfg)
                fp32, fp32_acc = fp32_eval(args.model, seed, 2 * batch, eval_batches,
                                           Path(cfg.out_dir) / "checkpoint.pt")
                loss.setdefault(name, []).append(fp32)
                rank0_gap[name] = max(rank0_gap.get(name, 0.0),
                                      abs(float(s["eval_loss"]) - fp32))
                if fp32_acc is not None:
                    acc.setdefault(name, []).append(fp32_acc)
                wall.setdefault(name, []).append(float(s["wall_s"]))

    print()
    if lm:
        metric = {n: [math.exp(x) for x in xs] for n, xs in loss.items()}
        print(f"{'plan':>20} {'held-out perplexity':>21} {'token CE (nats)':>19} "
              f"{'predicted ms':>12} {'train s':>7}  perplexity vs reference (paired)")
        for name in plans:
            pm, ph = ci(metric[name])
            lo_m, lo_h = ci(loss[name])
            pred = prob.makespan_ms(prob.assignment(plans[name]))
            verdict = "" if name == REF else paired(metric[name], metric[REF], 3)
            print(f"{name:>20} {pm:10.3f} +- {ph:7.3f} {lo_m:8.4f} +- {lo_h:7.4f} {pred:12.2f} "
                  f"{statistics.mean(wall[name]):7.1f}  {verdict}")
        print("per seed perplexity: " + "; ".join(
            f"{n}: " + " ".join(f"{x:.3f}" for x in metric[n]) for n in plans))
    else:
        metric = loss
        print(f"{'plan':>20} {'held-out loss':>19} {'accuracy':>17} {'predicted ms':>12} "
              f"{'train s':>7}  loss vs reference (paired) | accuracy vs reference (paired)")
        for name in plans:
            lo_m, lo_h = ci(loss[name])
            am, ah = ci(acc[name]) if acc.get(name) else (float("nan"), float("nan"))
            pred = prob.makespan_ms(prob.assignment(plans[name]))
            verdict = ("" if name == REF else paired(loss[name], loss[REF], 4) + " | "
                       + paired(acc[name], acc[REF], 4))
            print(f"{name:>20} {lo_m:8.4f} +- {lo_h:7.4f} {am:7.4f} +- {ah:6.4f} {pred:12.2f} "
                  f"{statistics.mean(wall[name]):7.1f}  {verdict}")
        print("per seed loss: " + "; ".join(
            f"{n}: " + " ".join(f"{x:.4f}" for x in loss[n]) for n in plans))
        print("per seed accuracy: " + "; ".join(
            f"{n}: " + " ".join(f"{x:.4f}" for x in acc[n]) for n in plans))
    print("emulate's own eval_loss (rank 0's replica at its group's precisions) against the "
          "fp32 score, largest |difference| over seeds: "
          + ", ".join(f"{n} {rank0_gap[n]:.2g}" for n in plans))
    what = "perplexity" if lm else "loss"
    print(f"exact vs others, paired held-out {what} (exact minus other; negative: exact better):")
    for other in ("greedy", "random, equal time", "weak lowest (UP)"):
        print(f"  exact - {other}: {paired(metric['exact'], metric[other], 3 if lm else 4)}")
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
