"""QSync's greedy against the exact optimum over random-indicator seeds.

Per (workload, cluster, seed): the exact objective (HiGHS, the linear model's optimum at
the problem's target) and each greedy variant's objective divided by it, at the same
target. Greedy runs with QSync's replayer acceptance (the default) and with the linear
model's acceptance, ranked by gain (``greedy``) and by gain per added millisecond
(``greedy-per-ms``). Indicators are ``qsync_opt.problem.synthetic.random_indicator(graph, seed)``:
the ratios depend on the indicator, so one seed is not a figure; the range over seeds is.
The target is the problem's default (no straggler); where that is out of reach even at the
fastest precisions it is the smallest reachable makespan plus 2% (what ``solve``'s auto mode
does), and the table says so. Objectives do not depend on machine load.

    .venv/bin/python benchmarks/bench_greedy_seeds.py [--seeds 0-4] [--models resnet50,bert_base]
        [--lower-reference]
"""

from __future__ import annotations

import argparse
import sys

from qsync_opt.solvers import SolveOptions
from qsync_opt.solvers.greedy import Greedy
from qsync_opt.solvers.ilp import PulpIlp

from qsync_opt import estimate, parse_shorthand, trace
from qsync_opt.planner.solve import LEXICOGRAPHIC_SLACK, reachable_ms
from qsync_opt.problem.evaluator import evaluate
from qsync_opt.problem.program import AllocationProblem, ProblemOptions
from qsync_opt.problem.synthetic import random_indicator

VARIANTS = (("greedy", False, "replayer"), ("greedy", False, "linear"),
            ("greedy-per-ms", True, "replayer"), ("greedy-per-ms", True, "linear"))


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _ratio(obj: float | None, exact: float) -> str:
    if obj is None:
        return f"{'no plan':>12}"
    if exact == 0:
        return f"{'=0' if obj == 0 else 'inf':>12}"
    return f"{obj / exact:12.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0-4")
    ap.add_argument("--models", default="resnet50,bert_base")
    ap.add_argument("--cluster", default="v100x16+t4x16")
    ap.add_argument("--target", choices=["default", "halfway"], default="default",
                    help="default: the problem's (no straggler); halfway: half-way from the "
                         "smallest reachable makespan to the all-reference one (where casts "
                         "matter most; bench_solvers' BERT instance)")
    ap.add_argument("--lower-reference", action="store_true",
                    help="let the solvers lower the strong groups too (ProblemOptions)")
    args = ap.parse_args(argv)
    options = ProblemOptions(lower_reference=True) if args.lower_reference else None
    seeds = _seeds(args.seeds)
    cluster = parse_shorthand(args.cluster)
    exact = PulpIlp("highs")
    if not exact.is_available():
        raise SystemExit("HiGHS is not available")
    for model in args.models.split(","):
        graph = trace(model)
        costs = estimate(graph, cluster)
        print(f"\n== {model} on {args.cluster}, random indicator seeds {args.seeds}"
              + (", strong groups may be lowered" if args.lower_reference else
                 ", strong groups held at their reference"))
        print(f"{'seed':>4} {'target ms':>10} {'exact obj':>12} "
              + " ".join(f"{f'{n}/{a}':>22}" for n, _, a in VARIANTS))
        ratios: dict[int, list[float]] = {i: [] for i in range(len(VARIANTS))}
        for seed in seeds:
            prob = AllocationProblem(graph, cluster, costs, random_indicator(graph, seed),
                                     options)
            tag = ""
            if args.target == "halfway":
                lo = reachable_ms(prob)
                ref = prob.makespan_ms(prob.reference_assignment())
                if lo is None:
                    print(f"{seed:>4} no memory-feasible plan")
                    continue
                prob = prob.retarget((lo + ref) / 2, source="halfway")
                tag = " h"
            plan, rep = exact.solve(prob, SolveOptions())
            if plan is None:
                best = reachable_ms(prob)
                if best is None:
                    print(f"{seed:>4} no memory-feasible plan")
                    continue
                prob = prob.retarget(best * (1 + LEXICOGRAPHIC_SLACK), source="reachable + 2%")
                tag = " *"
                plan, rep = exact.solve(prob, SolveOptions())
            if plan is None or rep.status != "OPTIMAL":
                print(f"{seed:>4} exact: {rep.status}")
                continue
            ex = evaluate(prob, plan).objective
            cells = []
            for i, (_, per_ms, acceptance) in enumerate(VARIANTS):
                gplan, _ = Greedy(per_ms=per_ms).solve(prob, SolveOptions(acceptance=acceptance))
                obj = None
                if gplan is not None:
                    ev = evaluate(prob, gplan)
                    if not ev.feasible:
                        raise SystemExit(f"seed {seed}: greedy plan infeasible: {ev.violations}")
                    obj = ev.objective
                    if ex > 0:
                        ratios[i].append(obj / ex)
                cells.append(f"{_ratio(obj, ex):>22}")
            print(f"{seed:>4} {prob.target_ms:10.3f}{tag:<2}{ex:11.4g} " + " ".join(cells))
            sys.stdout.flush()
        print(f"{'range':>28} " + " ".join(
            f"{(f'{min(r):.3f}-{max(r):.3f}' if r else '-'):>22}" for r in ratios.values()))
        print("(ratio: greedy objective / exact objective at the same target; * target = "
              "smallest reachable makespan + 2%, the default being out of reach; h = half-way "
              "from the smallest reachable to the all-reference makespan)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
