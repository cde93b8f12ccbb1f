"""Allocators side by side: every backend and baseline on the same problems, in one run.

Per instance it prints the problem size (units, one-hot and pair variables; each exact
backend's own variable and constraint counts), and per allocator: status, objective,
objective against the exact optimum, linear and replayer makespan, throughput against the
exact plan, model-building and solver seconds and the median wall time over repeats.
Indicators are seeded random tables (qsync_opt.problem.synthetic.random_indicator): solve times do
not depend on where Omega comes from, and the real indicator of gpt2_medium would take far
longer than the solves. Casts are on, tie groups off. The synthetic graph is a residual MLP
of 600 Linear layers (width 256-2048, batch 256; at batch 32 fp32 is already the fastest
choice on the small cards and the problem is trivial).

Every repeat is a cold solve: the process's memo of solved parts
(``solvers.memo.clear_part_memo``, which answers a part already solved in this process
without running a solver) is cleared before each one, so repeats 2-3 time the solver, not a
cache look-up (with the memo kept, HiGHS's and CBC's repeats are answered by it in 1-2% of
the first run's time; CP-SAT has none). ``--warm`` keeps the memo, to see its effect.

    .venv/bin/python benchmarks/bench_solvers.py [--repeats 3] [--quick] [--warm]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

from qsync_opt.solvers import SolveOptions, registry
from qsync_opt.solvers.memo import clear_part_memo

from qsync_opt import estimate, parse_shorthand, trace
from qsync_opt.core.machine import cpu_model
from qsync_opt.problem.evaluator import evaluate
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.problem.synthetic import random_indicator, synthetic_graph

#: (model, cluster, target). None: the default target (strong groups at fp32, no
#: straggler); a fraction f: f of the way from the fastest to the all-reference makespan,
#: where the default is out of reach even at the lowest precisions (bert_base at 12/12 and
#: gpt2_medium: the T4s cannot match an A100's or H100's time in these estimates).
#: gpt2_medium gives the L4s and T4s 2 sequences (4 do not fit their memory even at the
#: lowest precisions).
INSTANCES = [
    ("resnet50", "v100x16+t4x16", None),
    ("bert_base", "a100x8+t4x8", 0.5),
    ("vgg16_bn", "v100x16+t4x16", None),
    ("gpt2_medium", "h100x8+l4x8@2+t4x8@2", 0.5),
    ("synthetic600", "a100x4+l4x4+t4x4", 0.5),
]


def fastest_makespan(prob: AllocationProblem) -> float:
    """The least makespan any memory-feasible plan reaches (each group's exact minimum)."""
    from qsync_opt.planner.solve import reachable_ms

    best = reachable_ms(prob)
    if best is None:
        raise SystemExit(f"{prob.graph.workload}: some group fits no plan (or no HiGHS)")
    return best


def build(model: str, shorthand: str, frac: float | None) -> AllocationProblem:
    graph = (synthetic_graph(600, batch=256, width=1024) if model == "synthetic600"
             else trace(model))
    cluster = parse_shorthand(shorthand)
    prob = AllocationProblem(graph, cluster, estimate(graph, cluster), random_indicator(graph))
    if frac is not None:
        ref = prob.makespan_ms(prob.reference_assignment())
        fast = fastest_makespan(prob)
        prob = prob.with_options(target_ms=fast + frac * (ref - fast))
    return prob


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="resnet50 and bert_base only, 1 repeat")
    ap.add_argument("--solvers", default=None, help="comma-separated subset")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--warm", action="store_true",
                    help="keep the memo of solved parts between repeats (default: every "
                         "repeat cold, the memo cleared)")
    args = ap.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    instances = INSTANCES[:2] if args.quick else INSTANCES
    backends = registry()
    names = args.solvers.split(",") if args.solvers else list(backends)
    print(f"machine: {cpu_model()}, {platform.python_version()}; median of {repeats} "
          f"repeat(s), each " + ("warm (the memo of solved parts kept)" if args.warm else
                                 "cold (the memo of solved parts cleared before it)")
          + f"; time limit {args.time_limit:g} s")
    for model, shorthand, frac in instances:
        t0 = time.perf_counter()
        prob = build(model, shorthand, frac)
        prep = time.perf_counter() - t0
        size = prob.size()
        print(f"\n== {model} on {shorthand}: {size['units']} units, {size['x_vars']} one-hot and "
              f"{size['pair_vars']} pair variables over {len(prob.groups)} groups; target "
              f"{prob.target_ms:.2f} ms ({prob.target_source if frac is None else f'{frac:g} of the way from the fastest to the reference makespan'}); "
              f"problem prepared in {prep:.2f} s")
        rows = []
        runs = [(n, n, "replayer") for n in names]
        for n in ("greedy", "greedy-per-ms"):  # also with the linear model's acceptance
            if n in names:
                runs.insert(runs.index((n, n, "replayer")) + 1, (f"{n}/linear", n, "linear"))
        for name, backend, acceptance in runs:
            b = backends[backend]
            if not b.is_available():
                rows.append((name, "n/a"))
                continue
            walls, result = [], None
            for _ in range(repeats):
                if not args.warm:
                    clear_part_memo()  # a cold solve: no part answered from the memo
                t = time.perf_counter()
                result = b.solve(prob, SolveOptions(time_limit_s=args.time_limit,
                                                    acceptance=acceptance))
                walls.append(time.perf_counter() - t)
            plan, rep = result  # type: ignore[misc]
            ev = evaluate(prob, plan) if plan is not None else None
            rows.append((name, rep, ev, statistics.median(walls)))
        exact = next((r for r in rows if len(r) == 4 and r[0] in ("highs", "cbc", "cpsat")
                      and r[2] is not None and r[1].status == "OPTIMAL"), None)
        ex_obj = exact[2].objective if exact else None
        ex_thr = exact[2].samples_per_s if exact else None
        print(f"{'solver':>20} {'status':>10} {'ok':>3} {'objective':>10} {'/exact':>7} "
              f"{'linear ms':>10} {'replay ms':>10} {'samples/s':>10} {'/exact':>6} "
              f"{'build s':>8} {'solve s':>8} {'wall s':>8} {'vars':>7} {'cons':>7}")
        for r in rows:
            if len(r) == 2:
                print(f"{r[0]:>20} not available here")
                continue
            name, rep, ev, wall = r
            if ev is None:
                print(f"{name:>20} {rep.status:>10}  no plan: {rep.messages[-1] if rep.messages else ''}"
                      f" {'':>40} {wall:8.3f}")
                continue
            ratio = (f"{ev.objective / ex_obj:7.3f}" if ex_obj else f"{'-':>7}")
            thr = (f"{ev.samples_per_s / ex_thr:6.3f}" if ex_thr else f"{'-':>6}")
            print(f"{name:>20} {rep.status:>10} {'yes' if ev.feasible else 'no':>3} "
                  f"{ev.objective:10.4g} {ratio} {ev.makespan_ms:10.2f} "
                  f"{ev.replay_makespan_ms:10.2f} {ev.samples_per_s:10.1f} {thr} "
                  f"{rep.build_s:8.3f} {rep.solve_s:8.3f} {wall:8.3f} {rep.n_variables:7d} "
                  f"{rep.n_constraints:7d}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
