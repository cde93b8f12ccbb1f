"""The loops back of the solve pipeline, timed side by side.

For resnet50 on v100x16+t4x16 and bert_base on a100x8+t4x8 (catalog estimates, the seeded
random indicator, so no model runs): the plain solve, the joint batch split with its bounds
(``qsync_opt.planner.splits``) and the reference procedure that solves every candidate split
(``solve.PRUNE_SPLITS = False``), each from a fresh problem (the joint split re-makes the
problem at every candidate, and that is part of its cost); the plans of the two joint runs
are compared. With ``--pareto``, the whole Pareto sweep of resnet50 (``frontier``, as
``qsync-opt pareto`` runs it) with and without the bounds. With ``--cli``, three
commands end to end, each a fresh process (model trace, the cached qsync indicator, solve,
plan written): ``qsync-opt solve --model resnet50 --cluster v100x16+t4x16 --solver highs``
with and without ``--joint-split``, and ``qsync-opt pareto`` on the same instance.

    .venv/bin/python benchmarks/bench_pipeline.py [--repeats 3] [--pareto] [--cli]
        [--only-cli --baseline OTHER/.venv/bin/qsync-opt]

Times are medians of wall seconds; say the load average beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _timing import timed  # benchmarks/ is on sys.path when a script here runs
from qsync_opt.solvers import SolveOptions
from qsync_opt.solvers.memo import clear_part_memo

import qsync_opt.planner.joint as joint_mod
from qsync_opt import estimate, parse_shorthand, trace
from qsync_opt.core.machine import cpu_model
from qsync_opt.planner.frontier import frontier
from qsync_opt.planner.solve import solve
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.problem.synthetic import random_indicator

INSTANCES = [("resnet50", "v100x16+t4x16"), ("bert_base", "a100x8+t4x8")]


def _problem(model: str, cluster: str) -> AllocationProblem:
    """A fresh problem, and no part remembered from an earlier run (each timing starts
    cold, as a new process would)."""
    clear_part_memo()
    g = trace(model)
    c = parse_shorthand(cluster)
    return AllocationProblem(g, c, estimate(g, c), random_indicator(g, 0))


def _plan_doc(plan) -> str:
    doc = plan.model_dump(mode="json")
    for key in ("wall_s", "option.time_limit_s"):
        doc["provenance"].pop(key, None)
    return json.dumps(doc, sort_keys=True)


#: Long enough that neither joint search stops at the time limit (then plans would differ).
OPTIONS = SolveOptions(time_limit_s=900)


def _joint(model: str, cluster: str, prune: bool):
    joint_mod.PRUNE_SPLITS = prune
    try:
        return solve(_problem(model, cluster), "highs", OPTIONS, joint_split=True)
    finally:
        joint_mod.PRUNE_SPLITS = True


def _cli(args: list[str], exe: Path | None = None) -> None:
    """One ``qsync-opt`` command in a fresh process (its output discarded; it must succeed)."""
    exe = exe or Path(sys.executable).with_name("qsync-opt")
    done = subprocess.run([str(exe), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{exe} {' '.join(args)} failed ({done.returncode}):\n"
                         f"{done.stderr[-2000:]}")


def _wall(args: list[str], exe: Path | None) -> float:
    t0 = time.perf_counter()
    _cli(args, exe)
    return time.perf_counter() - t0


def cli_figures(repeats: int, baseline: Path | None = None) -> None:
    """The three planning commands end to end; with ``baseline`` (another checkout's
    ``qsync-opt``, e.g. the commit before the redesign) each command alternates between the
    two executables, run by run, so both see the same machine."""
    base = ["--model", "resnet50", "--cluster", "v100x16+t4x16"]
    exes: dict[str, Path | None] = {"this": None}
    if baseline is not None:
        exes["baseline"] = baseline
    with tempfile.TemporaryDirectory() as tmp:
        for exe in exes.values():
            _cli(["solve", *base, "--solver", "highs", "--out", f"{tmp}/warm.json"], exe)
        commands = {
            "solve": ["solve", *base, "--solver", "highs", "--out", f"{tmp}/p.json"],
            "solve --joint-split": ["solve", *base, "--solver", "highs", "--joint-split",
                                    "--out", f"{tmp}/j.json"],
            "pareto": ["pareto", *base, "--out", f"{tmp}/f.json"],
        }
        walls = {(name, who): [] for name in commands for who in exes}
        for name, args in commands.items():
            for _ in range(repeats):
                for who, exe in exes.items():
                    walls[name, who].append(_wall(args, exe))
    med = {key: statistics.median(v) for key, v in walls.items()}
    plain, joint, pareto = (med[name, "this"] for name in commands)
    print(f"end to end (qsync indicator cached), medians of {repeats}: solve {plain:.2f} s; "
          f"solve --joint-split {joint:.2f} s ({joint / plain:.2f}x); pareto {pareto:.2f} s")
    if baseline is not None:
        print(f"baseline {baseline}, interleaved run by run with the above:")
        for name in commands:
            b, t = walls[name, "baseline"], walls[name, "this"]
            print(f"  {name:>20}: baseline {statistics.median(b):7.2f} s "
                  f"({min(b):.2f}-{max(b):.2f}), this {statistics.median(t):7.2f} s "
                  f"({min(t):.2f}-{max(t):.2f}); {statistics.median(b) / statistics.median(t):.1f}x"
                  f" faster")
        bj, bp = med["solve --joint-split", "baseline"], med["solve", "baseline"]
        print(f"  baseline joint split / its plain solve: {bj / bp:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pareto", action="store_true", help="also time the resnet50 sweep")
    ap.add_argument("--cli", action="store_true",
                    help="also time the planning commands end to end (computes and caches the "
                         "qsync indicator first if it is not cached: about 30 min)")
    ap.add_argument("--only-cli", action="store_true", help="only the --cli figures")
    ap.add_argument("--baseline", type=Path, metavar="EXE",
                    help="with --cli: also run another checkout's qsync-opt executable, "
                         "interleaved (e.g. the commit before the redesign)")
    args = ap.parse_args()
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores; load average "
          f"{os.getloadavg()[0]:.2f} at the start")
    if args.cli or args.only_cli:
        cli_figures(args.repeats, args.baseline)
    if args.only_cli:
        print(f"load average {os.getloadavg()[0]:.2f} at the end")
        return
    for model, cluster in INSTANCES:
        _problem(model, cluster)  # trace once (cached), outside the timings
        plain, _ = timed(lambda m=model, c=cluster: solve(_problem(m, c), "highs", OPTIONS),
                         args.repeats)
        pruned, (p1, r1) = timed(lambda m=model, c=cluster: _joint(m, c, True), args.repeats)
        ref, (p2, r2) = timed(lambda m=model, c=cluster: _joint(m, c, False), args.repeats)
        same = _plan_doc(p1) == _plan_doc(p2)
        print(f"{model} on {cluster}: plain solve {plain:.2f} s; joint split {pruned:.2f} s "
              f"({pruned / plain:.2f}x the plain solve) against {ref:.2f} s solving every "
              f"candidate ({ref / plain:.2f}x); same plan: {same}")
        print(f"  {r1.messages[0]}")
    if args.pareto:
        for prune in (True, False):
            joint_mod.PRUNE_SPLITS = prune
            try:
                t0 = time.perf_counter()
                pts = frontier(_problem("resnet50", "v100x16+t4x16"), options=OPTIONS)
                dt = time.perf_counter() - t0
            finally:
                joint_mod.PRUNE_SPLITS = True
            print(f"pareto resnet50 on v100x16+t4x16 ({'bounds' if prune else 'every split'}): "
                  f"{dt:.1f} s, {len(pts)} points")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
