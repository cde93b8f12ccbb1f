"""In-process CPU time of planning: the plain solve, the joint split and the pareto frontier.

resnet50 on v100x16+t4x16 (catalog roofline estimate, seeded random indicator from
:func:`qsync_opt.problem.synthetic.random_indicator`, so no model is run), solver highs.
Each repeat builds the problem afresh (the joint split's candidate problems are not reused
between repeats, and the memo of solved parts is emptied before each call) and times, with ``time.process_time()`` (user + system CPU of this
process, meaningful on a loaded machine), the problem build, ``solve`` without and with
``joint_split`` and, with ``--pareto``, ``frontier``; printed: the medians, the ratio
joint split / plain solve, the joint split's search line (candidates solved, relaxed,
bounded, group programs solved alone: deterministic counts) and the load average.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_joint_split.py [--repeats 3] [--pareto]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from qsync_opt.solvers.memo import clear_part_memo

from qsync_opt import estimate, parse_shorthand, trace
from qsync_opt.planner.frontier import frontier
from qsync_opt.planner.solve import solve
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.problem.synthetic import random_indicator


def cpu(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """``fn(*args, **kwargs)`` and its CPU seconds, the memo of solved parts emptied first
    (so each call costs what it costs in a fresh process)."""
    clear_part_memo()
    t0 = time.process_time()
    out = fn(*args, **kwargs)
    return out, time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--cluster", default="v100x16+t4x16")
    ap.add_argument("--solver", default="highs")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pareto", action="store_true", help="also time frontier()")
    args = ap.parse_args()
    graph = trace(args.model)
    cluster = parse_shorthand(args.cluster)
    costs = estimate(graph, cluster)
    indicator = random_indicator(graph)
    times: dict[str, list[float]] = {"build": [], "plain": [], "joint": [], "pareto": []}
    for _ in range(args.repeats):
        problem, t = cpu(AllocationProblem, graph, cluster, costs, indicator)
        times["build"].append(t)
        times["plain"].append(cpu(solve, problem, args.solver)[1])
        fresh = AllocationProblem(graph, cluster, costs, indicator)
        (_, report), t = cpu(solve, fresh, args.solver, joint_split=True)
        times["joint"].append(t)
        search = next(m for m in report.messages if m.startswith("joint batch split: "))
        if args.pareto:
            other = AllocationProblem(graph, cluster, costs, indicator)
            times["pareto"].append(cpu(frontier, other)[1])
    print(f"{args.model} on {args.cluster}, solver {args.solver}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
          f"{args.repeats} repeats, CPU seconds (user + sys), median [all]")
    for name, vals in times.items():
        if vals:
            print(f"  {name:7s} {statistics.median(vals):7.3f}  "
                  f"[{', '.join(f'{v:.3f}' for v in vals)}]")
    ratio = statistics.median(times["joint"]) / statistics.median(times["plain"])
    print(f"  joint split / plain solve: {ratio:.2f}x")
    print(f"  the joint split's search (deterministic counts): {search}")
    print("  load average at the end: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
