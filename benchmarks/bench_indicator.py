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
import math
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from qsync_opt.models import compute_loss, get_workload, image_split
from qsync_opt.models.samples import real_batches
from scipy.stats import spearmanr
from torch import nn

from qsync_opt import trace
from qsync_opt.core.precision import Precision
from qsync_opt.indicator import METHODS, indicate
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


class EffectTable:
    """Per op, ``cells[op][s][b]``: the loss increase with rounding seed ``s`` on held-out
    piece ``b``; rectangular per op, but ops may hold different numbers of seeds and pieces
    (more where their error needs it). ``measure(op, s, first, last)`` returns the cells of
    seed ``s`` on pieces ``first..last-1``; ``max_pieces`` is how many pieces exist (None:
    as many as asked for, drawn from an endless held-out stream)."""

    def __init__(self, ops: list[str], measure, max_pieces: int | None) -> None:
        self.ops = ops
        self.measure = measure
        self.max_pieces = max_pieces
        self.cells: dict[str, list[list[float]]] = {op: [] for op in ops}
        self.evaluated = 0  # cells measured (the cost unit)

    def seeds(self, op: str) -> int:
        return len(self.cells[op])

    def pieces(self, op: str) -> int:
        return len(self.cells[op][0]) if self.cells[op] else 0

    def grow(self, op: str, seeds: int, pieces: int) -> None:
        """At least ``seeds`` seeds on at least ``pieces`` pieces for ``op`` (new pieces for
        the seeds it has first, then new seeds on all its pieces)."""
        if self.max_pieces is not None:
            pieces = min(pieces, self.max_pieces)
        rows = self.cells[op]
        have = self.pieces(op)
        if rows and pieces > have:
            for s, row in enumerate(rows):
                row.extend(self.measure(op, s, have, pieces))
                self.evaluated += pieces - have
        pieces = max(pieces, have)
        for s in range(len(rows), seeds):
            rows.append(list(self.measure(op, s, 0, pieces)))
            self.evaluated += pieces

    def stat(self, op: str) -> tuple[float, float, float, float]:
        """(effect, standard error, its rounding part, its held-out sample part)."""
        rows = self.cells[op]
        by_seed = [statistics.fmean(r) for r in rows]
        by_piece = [statistics.fmean(c) for c in zip(*rows, strict=True)]
        se_s = statistics.stdev(by_seed) / math.sqrt(len(by_seed)) if len(rows) > 1 else 0.0
        se_b = (statistics.stdev(by_piece) / math.sqrt(len(by_piece))
                if len(by_piece) > 1 else 0.0)
        return statistics.fmean(by_seed), math.hypot(se_s, se_b), se_s, se_b

    def stats(self) -> tuple[list[float], list[float], float, float]:
        """Effects, standard errors, the spread of effects (sd over ops) and the largest
        standard error over the spread."""
        mean, se = [], []
        for op in self.ops:
            m, e, _, _ = self.stat(op)
            mean.append(m)
            se.append(e)
        spread = statistics.stdev(mean) if len(mean) > 1 else float("nan")
        return mean, se, spread, (max(se) / spread if spread > 0 else float("inf"))


#: :func:`refine` calls an op out of reach only once it has this many seeds (or the cap).
STUCK_AFTER_SEEDS = 32


def components(rows: list[list[float]]) -> tuple[float, float, float]:
    """The variance components of a seeds x pieces table, from its two-way mean squares:
    (between seeds, between held-out pieces, per cell), each at least 0. The reported
    standard error ``hypot(se_s, se_b)`` of S seeds on P pieces is, in these terms,
    ``sqrt(v_seed / S + v_piece / P + 2 v_cell / (S P))`` (exactly, before the clipping
    at 0), which is what lets :func:`refine` predict it for a larger table."""
    n_s, n_p = len(rows), len(rows[0])
    grand = statistics.fmean(x for r in rows for x in r)
    by_seed = [statistics.fmean(r) for r in rows]
    by_piece = [statistics.fmean(c) for c in zip(*rows, strict=True)]
    ms_s = n_p * sum((m - grand) ** 2 for m in by_seed) / (n_s - 1)
    ms_p = n_s * sum((m - grand) ** 2 for m in by_piece) / (n_p - 1)
    ms_e = sum((rows[i][j] - by_seed[i] - by_piece[j] + grand) ** 2
               for i in range(n_s) for j in range(n_p)) / ((n_s - 1) * (n_p - 1))
    return max(ms_s - ms_e, 0.0) / n_p, max(ms_p - ms_e, 0.0) / n_s, ms_e


def predicted_se2(v: tuple[float, float, float], seeds: int, pieces: int) -> float:
    v_seed, v_piece, v_cell = v
    return v_seed / seeds + v_piece / pieces + 2 * v_cell / (seeds * pieces)


def refine(table: EffectTable, target: float, max_seeds: int = 0,
           max_cells: float = float("inf"), log=print) -> set[str]:
    """Add seeds and held-out pieces to the ops whose standard error is not under ``target``
    times the spread of effects, each op by what its error is made of (its variance
    components: seeds shrink the rounding part, pieces the held-out sample part, where more
    pieces exist), choosing per op the cheapest table (seeds x pieces) whose predicted error
    is under the goal. Stops when every op is under it, or no op can get there (even endless
    seeds on every piece that exists, or ``max_seeds``, would leave it over), or the next
    round would pass ``max_cells`` more cells. Returns the ops that cannot get there. The
    growth per round is at most 4x in each direction, since the components that set it are
    estimates themselves."""
    stuck: set[str] = set()
    start = table.evaluated
    while True:
        _, se, spread, _ = table.stats()
        goal = target * spread
        todo = [op for op, e in zip(table.ops, se, strict=True) if e >= goal and op not in stuck]
        if not todo:
            return stuck
        t2 = (0.9 * goal) ** 2  # aim a little under, so that the next estimate lands under
        plans = []
        for op in sorted(todo, key=lambda o: -table.stat(o)[1]):
            s_have, p_have = table.seeds(op), table.pieces(op)
            if s_have < 2 or p_have < 2:
                plans.append((op, max(s_have, 2), p_have, max(s_have, 2) * p_have))
                continue
            v = components(table.cells[op])
            s_cap = max_seeds if max_seeds > 0 else None
            p_cap = table.max_pieces
            s_lim = s_cap if s_cap is not None else 10**9
            p_lim = p_cap if p_cap is not None else 10**9
            if predicted_se2(v, s_lim, p_lim) >= (goal * goal):
                if s_have < min(STUCK_AFTER_SEEDS, s_lim):
                    # with few seeds the held-out part's estimate still carries the cells'
                    # rounding noise: more seeds before calling it out of reach
                    want_s = min(4 * s_have, s_lim)
                    plans.append((op, want_s, p_have, (want_s - s_have) * p_have))
                    continue
                stuck.add(op)
                log(f"  {op}: even {'endless' if s_cap is None else s_cap} seeds on "
                    f"{'its' if p_cap is None else p_cap} held-out pieces would leave its "
                    f"standard error over the goal ({goal:.6f}; held-out sample part "
                    f"{math.sqrt(v[1] / min(p_lim, 10**9)):.6f})")
                continue
            best = None  # the cheapest table in reach that meets the goal, else the lowest
            for want_p in range(p_have, min(4 * p_have, p_lim) + 1):
                for want_s in (range(s_have, min(4 * s_have, s_lim) + 1)):
                    e2 = predicted_se2(v, want_s, want_p)
                    key = (e2 > t2, want_s * want_p if e2 <= t2 else e2)
                    if best is None or key < best[0]:
                        best = (key, want_s, want_p)
                    if e2 <= t2:
                        break  # more seeds at these pieces only cost more
            assert best is not None
            _, want_s, want_p = best
            if want_s * want_p <= s_have * p_have:  # the estimate says done: a step anyway
                if s_have < s_lim:
                    want_s = s_have + 1
                elif p_have < p_lim:
                    want_p = p_have + 1
                else:
                    stuck.add(op)
                    continue
            plans.append((op, want_s, want_p, want_s * want_p - s_have * p_have))
        if not plans:
            return stuck
        if table.evaluated - start + sum(c for *_, c in plans) > max_cells:
            log(f"  the budget does not reach the next round ({len(plans)} ops to refine)")
            return stuck
        for op, want_s, want_p, _ in plans:
            log(f"  {op}: {table.seeds(op)} seeds x {table.pieces(op)} pieces, SE / spread "
                f"{table.stat(op)[1] / spread:.3f}; going to {want_s} x {want_p}")
            table.grow(op, want_s, want_p)


def run_immediate(name: str, seeds: int, n_eval: int, target: float = 0.1,
                  max_seeds: int = 0, budget_s: float = 0.0) -> dict:
    """Only the immediate effect, with many rounding seeds and held-out batches, and its
    standard error per op: a higher-powered check of the rankings (no fine-tunes).

    Per op, ``d[s][b]`` is the loss increase on held-out piece ``b`` with rounding seed
    ``s``; the effect is its mean. Its standard error combines the rounding noise (the
    seeds' means) and the held-out sample (the pieces' means): ``sqrt(se_s^2 + se_b^2)``,
    conservative (each piece's mean still carries rounding noise / S). Every op gets
    ``seeds`` seeds on ``n_eval`` held-out batches (tiny_gpt; the digits models: their 359
    held-out images in 6 pieces); then :func:`refine` adds seeds and held-out batches to
    the ops whose error is not yet under ``target`` times the spread of effects, each by
    what its error is made of, within ``max_seeds`` and ``budget_s``."""
    cfg = CONFIG[name]
    t0 = time.perf_counter()
    torch.manual_seed(0)
    wl = get_workload(name)
    model = wl.build()
    train(model, name, cfg["pretrain"], cfg["lr"], seed=1)
    ev = eval_batches(name, n_eval)
    growable = image_split(name) is None  # text: an endless held-out stream
    graph = trace(name, cfg["batch"], pin_head=cfg["pin_head"])
    ops = [o.name for o in graph.choosable_ops()]
    plain = batch_losses(model, name, ev)

    def measure(op: str, s: int, first: int, last: int) -> list[float]:
        if last > len(plain):  # more held-out batches (a seeded stream: the first stay)
            ev[:] = eval_batches(name, last)
            plain.extend(batch_losses(model, name, ev[len(plain):]))
        m = copy.deepcopy(model)
        # pieces added later get their own rounding draws (every call draws afresh)
        apply_precisions(m, {op: PREC}, seed=500 + s + 100_003 * first)
        cut = ev[first:last] if growable else ev
        return [a - b for a, b in zip(batch_losses(m, name, cut), plain[first:last],
                                      strict=True)]

    effects = EffectTable(ops, measure, None if growable else len(plain))
    t1 = time.perf_counter()
    for op in ops:
        effects.grow(op, seeds, len(plain))
    base_cells, base_pieces = effects.evaluated, len(plain)
    per_cell = (time.perf_counter() - t1) / base_cells
    mean, se, spread, worst = effects.stats()
    print(f"  {seeds} seeds x {len(plain)} pieces on every op: largest SE / spread "
          f"{worst:.3f}", flush=True)
    left = budget_s - (time.perf_counter() - t0) if budget_s > 0 else float("inf")
    stuck = refine(effects, target, max_seeds, left / per_cell,
                   log=lambda m: print(m, flush=True))
    mean, se, spread, worst = effects.stats()
    parts = [effects.stat(op)[2:] for op in ops]
    print(f"\ntrained fp32 model's held-out loss on the first {base_pieces} pieces: "
          f"{statistics.fmean(plain[:base_pieces]):.6f}")
    print(f"== {name}, immediate effect only, each op alone at {PREC.value}: "
          f"{seeds} rounding seeds x {base_pieces} held-out pieces "
          f"on every op, then more where an op's error needed them ({effects.evaluated} cells, "
          f"{effects.evaluated / base_cells:.2f}x the uniform {base_cells}); per-op increase "
          f"median {statistics.median(mean):+.6f}, max {max(mean):+.6f}; median standard "
          f"error {statistics.median(se):.6f} (rounding "
          f"{statistics.median(p[0] for p in parts):.6f}, held-out sample "
          f"{statistics.median(p[1] for p in parts):.6f}); spread of effects (sd over ops) "
          f"{spread:.6f}, largest standard error / spread {worst:.3f} "
          f"({'under' if worst < target else 'NOT under'} {target:g}: "
          f"{'the ranking is resolved' if worst < target else 'not resolved'})")
    under = sum(e < target * spread for e in se)
    print(f"ops whose standard error is under {target:g} x the spread: {under} of {len(ops)}; "
          f"largest effect's standard error / spread "
          f"{se[mean.index(max(mean))] / spread:.3f}"
          + (f"; held-out sample alone over the goal (no more pieces): {', '.join(sorted(stuck))}"
             if stuck else ""))
    print(f"{'op':>28} {'effect':>10} {'SE':>9} {'rounding':>9} {'sample':>9} {'SE/spread':>9} "
          f"{'seeds':>5} {'pieces':>6}")
    for i in sorted(range(len(ops)), key=lambda i: -mean[i]):
        print(f"{ops[i]:>28} {mean[i]:>+10.6f} {se[i]:>9.6f} {parts[i][0]:>9.6f} "
              f"{parts[i][1]:>9.6f} {se[i] / spread:>9.3f} {effects.seeds(ops[i]):>5} "
              f"{effects.pieces(ops[i]):>6}")
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
    return {"ops": ops, "precision": PREC.value, "seeds": [effects.seeds(o) for o in ops],
            "pieces": [effects.pieces(o) for o in ops], "n_cells": effects.evaluated,
            "mean": mean, "se": se, "se_rounding": [p[0] for p in parts],
            "se_sample": [p[1] for p in parts], "spread": spread,
            "worst_se_over_spread": worst, "stuck": sorted(stuck),
            "plain": plain, "cells": {op: effects.cells[op] for op in ops},
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
