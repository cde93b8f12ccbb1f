"""Does each indicator rank operators well? Measured on real data, on this CPU.

For digits_cnn (scikit-learn digits; its classifier head unpinned so four ops compete),
digits_resnet (a ResNet-8 on the same digits upsampled to 32x32; its head unpinned too, so
ten ops compete) and tiny_gpt (stdlib source text):

1. train the FP32 model from a fixed seed;
2. per op: put that op alone at int8 (or ``--precision``: int4, ...; the ops library's real
   integer GEMM, stochastic rounding; attention matmuls fake-quantized), fine-tune briefly
   with a fixed data order, and measure the held-out loss increase over the same fine-tune
   at FP32 (two rounding seeds, averaged; their spread is the noise floor), and the
   immediate increase without fine-tuning (four rounding seeds), which is what the error
   models describe;
3. per method: the indicator of the trained model on real batches, its Spearman rank
   correlation with both measured per-op increases, and the loss increase when its k most
   vs its k least sensitive ops go to that precision together.

    .venv/bin/python benchmarks/bench_indicator.py [--quick] [--precision int4]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from qsync_opt.models import compute_loss, get_workload, image_split
from scipy.stats import spearmanr
from torch import nn

from qsync_opt import trace
from qsync_opt.indicator import METHODS, indicate, real_batches
from qsync_opt.precision import Precision
from qsync_opt.runtime import apply_precisions

#: The switches (--float-gemm, --emulate-half) held for the whole run.
_MODES = contextlib.ExitStack()

#: The precision each op is put at alone (``--precision``; int8 by default).
PREC = Precision.int8

CONFIG = {
    "digits_cnn": dict(batch=64, pretrain=400, finetune=40, lr=1e-3, ft_lr=5e-4, k=2,
                       pin_head=False),
    "digits_resnet": dict(batch=64, pretrain=300, finetune=40, lr=1e-3, ft_lr=5e-4,
                          k=3, pin_head=False),
    "tiny_gpt": dict(batch=32, pretrain=300, finetune=30, lr=3e-3, ft_lr=1e-3, k=6,
                     pin_head=True),
}


def eval_batches(name: str, n: int = 6) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    split = image_split(name)  # digits_cnn, digits_resnet: the same 359 held-out digits
    if split is not None:
        _, _, x_te, y_te = split
        return [((x_te,), y_te)]
    from qsync_opt.models.tiny_gpt import encode, sample_batch, stdlib_corpus, train_val_split

    _, val = train_val_split(encode(stdlib_corpus(max_chars=400_000)))
    return [((xb,), yb) for xb, yb in (sample_batch(val, 32, 128, gen) for _ in range(n))]


def train(model: nn.Module, name: str, steps: int, lr: float, seed: int) -> None:
    wl = get_workload(name)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    data: Iterator = real_batches(wl, CONFIG[name]["batch"], steps, seed)
    for inputs, targets in data:
        opt.zero_grad(set_to_none=True)
        compute_loss(wl, model(*inputs), targets).backward()
        opt.step()


@torch.no_grad()
def evaluate(model: nn.Module, name: str, batches: list) -> float:
    wl = get_workload(name)
    model.eval()
    losses = [float(compute_loss(wl, model(*x), y)) for x, y in batches]
    model.train()
    return statistics.fmean(losses)


def finetuned_loss(base: nn.Module, name: str, precisions: dict[str, Precision],
                   rounding_seed: int, ev: list) -> float:
    cfg = CONFIG[name]
    model = copy.deepcopy(base)
    if precisions:
        apply_precisions(model, precisions, seed=rounding_seed)
    train(model, name, cfg["finetune"], cfg["ft_lr"], seed=777)  # same data order for all
    return evaluate(model, name, ev)


def batch_losses(model: nn.Module, name: str, batches: list, chunk: int = 64) -> list[float]:
    """Held-out loss per piece of at most ``chunk`` samples (a large batch, such as the
    digits' whole test split, is cut into pieces so that the sample noise can be measured)."""
    wl = get_workload(name)
    model.eval()
    out = []
    with torch.no_grad():
        for x, y in batches:
            n = y.shape[0]
            for i in range(0, n, chunk) if n > 2 * chunk else (0,):
                j = i + chunk if n > 2 * chunk else n
                out.append(float(compute_loss(wl, model(*(t[i:j] for t in x)), y[i:j])))
    model.train()
    return out


def run_immediate(name: str, seeds: int, n_eval: int, target: float = 0.1,
                  max_seeds: int = 0, budget_s: float = 0.0) -> dict:
    """Only the immediate effect, with many rounding seeds and held-out batches, and its
    standard error per op: a higher-powered check of the rankings (no fine-tunes).

    Per op, ``d[s][b]`` is the loss increase on held-out piece ``b`` with rounding seed
    ``s``; the effect is its mean. Its standard error combines the rounding noise (the
    seeds' means) and the held-out sample (the pieces' means): ``sqrt(se_s^2 + se_b^2)``,
    conservative (each piece's mean still carries rounding noise / S). Seeds are added in
    rounds until the largest standard error is under ``target`` times the spread of effects
    (sd over ops), or ``max_seeds`` or ``budget_s`` is reached."""
    import math

    cfg = CONFIG[name]
    t0 = time.perf_counter()
    torch.manual_seed(0)
    wl = get_workload(name)
    model = wl.build()
    train(model, name, cfg["pretrain"], cfg["lr"], seed=1)
    ev = eval_batches(name, n_eval)
    graph = trace(name, cfg["batch"], pin_head=cfg["pin_head"])
    ops = [o.name for o in graph.choosable_ops()]
    plain = batch_losses(model, name, ev)
    d: dict[str, list[list[float]]] = {op: [] for op in ops}

    def add(n: int) -> None:
        for op in ops:
            for s in range(len(d[op]), len(d[op]) + n):
                m = copy.deepcopy(model)
                apply_precisions(m, {op: PREC}, seed=500 + s)
                d[op].append([a - b for a, b in zip(batch_losses(m, name, ev), plain,
                                                    strict=True)])

    parts: dict[str, list[float]] = {"seeds": [], "pieces": []}

    def stats() -> tuple[list[float], list[float], float, float]:
        mean, se = [], []
        parts["seeds"], parts["pieces"] = [], []
        for op in ops:
            rows = d[op]
            by_seed = [statistics.fmean(r) for r in rows]
            by_piece = [statistics.fmean(c) for c in zip(*rows, strict=True)]
            se_s = statistics.stdev(by_seed) / math.sqrt(len(by_seed))
            se_b = (statistics.stdev(by_piece) / math.sqrt(len(by_piece))
                    if len(by_piece) > 1 else 0.0)
            mean.append(statistics.fmean(by_seed))
            se.append(math.hypot(se_s, se_b))
            parts["seeds"].append(se_s)
            parts["pieces"].append(se_b)
        spread = statistics.stdev(mean) if len(mean) > 1 else float("nan")
        return mean, se, spread, (max(se) / spread if spread > 0 else float("inf"))

    add(seeds)
    mean, se, spread, worst = stats()
    per_seed = (time.perf_counter() - t0) / seeds
    while worst >= target and (max_seeds <= 0 or len(d[ops[0]]) < max_seeds):
        have = len(d[ops[0]])
        # SE ~ 1/sqrt(S): the seeds that would reach the target, within the caps
        want = math.ceil(have * (worst / target) ** 2 * 1.1)
        if max_seeds > 0:
            want = min(want, max_seeds)
        if budget_s > 0:
            left = budget_s - (time.perf_counter() - t0)
            want = min(want, have + int(left / per_seed))
        if want <= have:
            break
        print(f"  {have} seeds: largest SE / spread {worst:.3f}; going to {want}", flush=True)
        add(want - have)
        mean, se, spread, worst = stats()
    n_seeds = len(d[ops[0]])
    print(f"\n== {name}, immediate effect only, each op alone at {PREC.value}: {n_seeds} "
          f"rounding seeds, {len(plain)} held-out pieces; per-op increase median "
          f"{statistics.median(mean):+.6f}, max {max(mean):+.6f}; median standard error "
          f"{statistics.median(se):.6f} (rounding {statistics.median(parts['seeds']):.6f}, "
          f"held-out sample {statistics.median(parts['pieces']):.6f}); spread of effects (sd over ops) {spread:.6f}, largest "
          f"standard error / spread {worst:.3f} ({'under' if worst < target else 'NOT under'} "
          f"{target:g}: {'the ranking is resolved' if worst < target else 'not resolved'})")
    under = sum(e < target * spread for e in se)
    print(f"ops whose standard error is under {target:g} x the spread: {under} of {len(ops)}; "
          f"largest effect's standard error / spread "
          f"{se[mean.index(max(mean))] / spread:.3f}")
    print(f"{'method':>18} {'rho now':>8} {'(sd)':>6}")
    rho: dict[str, float] = {}
    omegas: dict[str, list[float]] = {}
    for method in METHODS:
        rhos = []
        for s in (range(5) if method == "random" else (0,)):
            table = indicate(wl, batches=8, method=method, seed=s, model=copy.deepcopy(model),
                             data=real_batches(wl, cfg["batch"], 8, 99 + s), graph=graph)
            omega = [table.values[o][PREC] for o in ops]
            omegas[f"{method}:{s}"] = omega
            rhos.append(float(spearmanr(omega, mean).statistic))
        rho[method] = statistics.fmean(rhos)
        sd = statistics.pstdev(rhos) if len(rhos) > 1 else 0.0
        print(f"{method + (' (5 seeds)' if method == 'random' else ''):>18} "
              f"{rho[method]:>8.3f} {sd:>6.3f}")
    if "curv" in rho:
        print(f"curv: rho {rho['curv']:.3f} ({'>=' if rho['curv'] >= 0.7 else '<'} 0.7); above "
              f"hessian ({rho.get('hessian', float('nan')):.3f}) "
              f"{'yes' if rho['curv'] > rho.get('hessian', 1) else 'no'}, above fisher "
              f"({rho.get('fisher', float('nan')):.3f}) "
              f"{'yes' if rho['curv'] > rho.get('fisher', 1) else 'no'}")
    wall = time.perf_counter() - t0
    print(f"({wall:.0f} s, torch threads {torch.get_num_threads()})")
    return {"ops": ops, "precision": PREC.value, "seeds": n_seeds, "pieces": len(plain),
            "mean": mean, "se": se, "se_rounding": parts["seeds"],
            "se_sample": parts["pieces"], "spread": spread, "worst_se_over_spread": worst,
            "rho": rho, "omega": omegas, "wall_s": wall}


def run(name: str, quick: bool) -> dict:
    cfg = CONFIG[name]
    t0 = time.perf_counter()
    torch.manual_seed(0)
    wl = get_workload(name)
    model = wl.build()
    train(model, name, cfg["pretrain"] // (4 if quick else 1), cfg["lr"], seed=1)
    ev = eval_batches(name)
    graph = trace(name, cfg["batch"], pin_head=cfg["pin_head"])
    ops = [o.name for o in graph.choosable_ops()]
    base = finetuned_loss(model, name, {}, 0, ev)
    print(f"\n== {name}: {len(ops)} choosable ops; trained FP32 held-out loss "
          f"{evaluate(model, name, ev):.4f}, after the FP32 fine-tune {base:.4f}")
    seeds = (1,) if quick else (1, 2)
    delta: dict[str, float] = {}
    spread: list[float] = []
    for op in ops:
        runs = [finetuned_loss(model, name, {op: PREC}, s, ev) - base for s in seeds]
        delta[op] = statistics.fmean(runs)
        if len(runs) > 1:
            spread.append(abs(runs[0] - runs[1]))
    measured = [delta[o] for o in ops]
    noise = statistics.median(spread) if spread else float("nan")
    # The immediate effect (no fine-tune), which is what the error models describe: held-out
    # loss with one op at int8, averaged over four rounding seeds, minus the FP32 loss.
    plain = evaluate(model, name, ev)
    immediate = []
    for op in ops:
        runs = []
        for s in range(4):
            m = copy.deepcopy(model)
            apply_precisions(m, {op: PREC}, seed=100 + s)
            runs.append(evaluate(m, name, ev) - plain)
        immediate.append(statistics.fmean(runs))
    print(f"per-op {PREC.value} loss increase: median {statistics.median(measured):+.5f}, max "
          f"{max(measured):+.5f}; noise (median |difference| between two rounding seeds) "
          f"{noise:.5f}")
    k = cfg["k"]
    rows = []
    dump: dict = {"ops": ops, "depth": {o.name: o.depth for o in graph.choosable_ops()},
                  "max_depth": graph.max_depth, "finetuned": measured,
                  "immediate": immediate, "precision": PREC.value,
                  f"omega_{PREC.value}": {}, f"terms_{PREC.value}": {}}
    for method in METHODS:
        seeds_m = range(5) if method == "random" else (0,)
        rhos, rhos_now, most_l, least_l = [], [], [], []
        for s in seeds_m:
            table = indicate(wl, batches=4 if quick else 8, method=method, seed=s,
                             model=copy.deepcopy(model),
                             data=real_batches(wl, cfg["batch"], 8, 99 + s), graph=graph)
            omega = [table.values[o][PREC] for o in ops]
            dump[f"omega_{PREC.value}"][f"{method}:{s}"] = omega
            if table.terms:
                dump[f"terms_{PREC.value}"][f"{method}:{s}"] = [table.terms[o][PREC] for o in ops]
            rhos.append(float(spearmanr(omega, measured).statistic))
            rhos_now.append(float(spearmanr(omega, immediate).statistic))
            order = sorted(ops, key=lambda o: -table.values[o][PREC])
            most = finetuned_loss(model, name, {o: PREC for o in order[:k]}, 3, ev)
            least = finetuned_loss(model, name, {o: PREC for o in order[-k:]}, 3, ev)
            most_l.append(most - base)
            least_l.append(least - base)
        label = method + (" (5 seeds)" if method == "random" else "")
        rows.append((label, statistics.fmean(rhos),
                     statistics.pstdev(rhos) if len(rhos) > 1 else 0.0,
                     statistics.fmean(rhos_now),
                     statistics.pstdev(rhos_now) if len(rhos_now) > 1 else 0.0,
                     statistics.fmean(most_l), statistics.fmean(least_l)))
    print(f"immediate per-op increase (no fine-tune, 4 seeds): median "
          f"{statistics.median(immediate):+.5f}, max {max(immediate):+.5f}")
    print(f"{'method':>18} {'rho ft':>7} {'(sd)':>6} {'rho now':>8} {'(sd)':>6} "
          f"{f'dL {k} most':>12} {f'dL {k} least':>13} {'least<most':>10}")
    for label, rho, sd, rho_now, sd_now, most, least in rows:
        print(f"{label:>18} {rho:>7.3f} {sd:>6.3f} {rho_now:>8.3f} {sd_now:>6.3f} "
              f"{most:>+12.5f} {least:>+13.5f} {'yes' if least < most else 'no':>10}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    return dump


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer steps and seeds (smoke run)")
    ap.add_argument("--models", nargs="+", default=list(CONFIG))
    ap.add_argument("--dump", help="write per-op measurements and indicator values (JSON)")
    ap.add_argument("--immediate-only", action="store_true",
                    help="only the immediate effect, with --seeds seeds and --eval batches")
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--eval", type=int, default=12)
    ap.add_argument("--target-se", type=float, default=0.1,
                    help="--immediate-only: add seeds until every op's standard error is under "
                         "this fraction of the spread of effects (default 0.1)")
    ap.add_argument("--max-seeds", type=int, default=0, help="cap on the seeds (0: none)")
    ap.add_argument("--budget-min", type=float, default=0.0,
                    help="cap on the minutes per model spent adding seeds (0: none)")
    ap.add_argument("--precision", default="int8",
                    choices=[p.value for p in Precision if p != Precision.fp32],
                    help="the precision each op is put at alone (default int8; int4 moves "
                         "the loss far more)")
    ap.add_argument("--float-gemm", action="store_true",
                    help="run the integer GEMMs as bit-identical fp32 GEMMs "
                         "(ops.float_exact_gemm): same results, far faster on a CPU without "
                         "AMX-INT8 / AVX512-VNNI; wall times are then not the integer GEMM's")
    args = ap.parse_args()
    if args.float_gemm:
        from qsync_opt import ops

        _MODES.enter_context(ops.float_exact_gemm())  # held to the end of the process
        print("integer GEMMs run as bit-identical fp32 GEMMs (--float-gemm)")
    global PREC
    PREC = Precision(args.precision)
    if args.immediate_only:
        out = {name: run_immediate(name, args.seeds, args.eval, args.target_se,
                                   args.max_seeds, args.budget_min * 60)
               for name in args.models}
        if args.dump:
            Path(args.dump).write_text(json.dumps(out, indent=1))
        return
    dumps = {name: run(name, args.quick) for name in args.models}
    if args.dump:
        Path(args.dump).write_text(json.dumps(dumps, indent=1))


if __name__ == "__main__":
    main()
