"""Replayer speed: full (event-loop) and incremental one-op simulations, side by side.

Per workload and cluster: the one-off preparation (indexing the CostTable), a full
simulation with every event, one without the event list, and the incremental path's
`set` (change one op) and `what_if` (change, answer, undo), each the median over repeated
calls on random choosable ops and precisions.

    .venv/bin/python benchmarks/bench_replayer.py [--repeats 200]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from _timing import timed  # benchmarks/ is on sys.path when a script here runs

from qsync_opt import estimate, load_cluster, trace
from qsync_opt.replayer import Replayer

CASES = [("resnet50", "v100x16+t4x16"), ("resnet50", "h100x8+l4x8+t4x8"),
         ("bert_base", "a100x8+t4x8"), ("bert_base", "h100x8+l4x8+t4x8"),
         ("gpt2_xl", "a100x8+t4x8"), ("gpt2_xl", "h100x8+l4x8+t4x8")]


def _median_ms(fn, repeats: int) -> float:
    return timed(fn, repeats)[0] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians in ms")
    header = ("model", "cluster", "ops", "prepare", "full+events", "full", "set", "what_if",
              "full/what_if")
    print("  ".join(f"{h:>16}" for h in header))
    rng = random.Random(0)
    for model, shorthand in CASES:
        graph = trace(model)
        cluster = load_cluster(shorthand)
        costs = estimate(graph, cluster)
        t0 = time.perf_counter()
        rep = Replayer(graph, cluster, costs)
        prepare = (time.perf_counter() - t0) * 1e3
        plan = rep.uniform("highest")
        reps = max(5, args.repeats // 20)
        full_ev = _median_ms(lambda r=rep, p=plan: r.simulate(p), reps)
        full = _median_ms(lambda r=rep, p=plan: r.simulate(p, events=False), reps)
        inc = rep.incremental(plan)
        moves = []
        for grp in rep.groups:
            for op in graph.choosable_ops():
                if op.tie_group:
                    continue
                for p in op.allowed_precisions:
                    if p in grp.menu:
                        moves.append((grp.name, op.name, p))
        picks = [rng.choice(moves) for _ in range(args.repeats)]
        it = iter(picks * 2)
        t_set = _median_ms(lambda i=inc, m=it: i.set(*next(m)), args.repeats)
        it = iter(picks * 2)
        t_what = _median_ms(lambda i=inc, m=it: i.what_if(*next(m)), args.repeats)
        row = (model, shorthand, len(graph.ops), f"{prepare:.2f}", f"{full_ev:.2f}",
               f"{full:.2f}", f"{t_set:.3f}", f"{t_what:.3f}", f"{full / t_what:.0f}x")
        print("  ".join(f"{c:>16}" for c in row))


if __name__ == "__main__":
    main()
