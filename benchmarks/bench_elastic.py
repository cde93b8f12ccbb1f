"""Elastic hybrid training: the figures of its goals, one section each.

* ``resolve``: the re-solve of a re-plan (``ReplanCache.replan``, the problem built once):
  median, min and max seconds over ``--repeats`` for a group gone and a group slowed 1.3x,
  on resnet50 and bert_base on v100x16+t4x16 (goal: at most 1 s) and on the CPU
  workloads' emulated clusters (goal: at most 0.2 s), with what each re-plan changed (the
  plans are deterministic: a random indicator of seed 0, so no model is run).
* ``online``: an emulated run (``train --emulate-dp --replan auto``) with cpu_2's stretch
  changed from 2 to ``--factor`` at step ``--at``: the steps until the re-plan (goal: at
  most the window + 2), and the measured step time after it (median over the steps from
  the re-plan on, the slowest replica's compute plus the sync) against a run started with
  the plan for the true slowdown (the injected stretch over the device's own) under the
  same stretch (goal: within 10%).
* ``plans``: the re-plans of ``resolve`` without their times (deterministic).
* ``membership``: ``train --elastic`` with a group leaving gracefully, returning, crashing
  and returning (:mod:`elastic_membership`): per change the steps lost and the seconds from
  the change to the first step of the new world (goal: at most the checkpoint interval
  plus 15 s).
* ``noise``: each group's compute time in an emulated run without faults: its coefficient
  of variation, the share of steps over +10% of the median and the longest run of such
  steps (what the detector's defaults, 10% over 20 consecutive steps, stand on).

Sections are functions (``resolve``, ``online``, ``noise``); :func:`main` runs those asked::

    .venv/bin/python benchmarks/bench_elastic.py [--section resolve|plans|online|noise|membership|all]
        [--repeats 5] [--steps 60] [--at 20] [--factor 6]

Wall-clock figures: run on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from elastic_membership import membership_section, print_rows  # benchmarks/ (run as a script)

import qsync_opt as qs
from qsync_opt.cli.replanning import make_replanner
from qsync_opt.job.rank import emulate
from qsync_opt.planner.replan import ReplanCache
from qsync_opt.planner.solve import solve
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.problem.synthetic import random_indicator
from qsync_opt.runtime.config import TrainConfig
from qsync_opt.runtime.events import read_events
from qsync_opt.runtime.online import OnlineSpec, SlowdownInjection
from qsync_opt.runtime.straggler import coefficient_of_variation

#: (workload, cluster, goal in s): the re-solve cases.
RESOLVE_CASES = [("resnet50", "v100x16+t4x16", 1.0), ("bert_base", "v100x16+t4x16", 1.0),
                 ("digits_cnn", "cpux1@32+cpu/2x1@32", 0.2),
                 ("tiny_gpt", "cpux1@8+cpu/2x2@8", 0.2)]
#: The membership section's run (benchmarks/elastic_membership.py: leave, return, crash, return).
MEMBERSHIP_STEPS, MEMBERSHIP_EVERY = 200, 25
#: The online run's workload and cluster (cpu_2 is the group slowed, its own stretch 2).
ONLINE_MODEL, ONLINE_CLUSTER, BASE_STRETCH = "digits_cnn", "cpux1@32+cpu/2x1@32", 2.0


def _first_plan(workload: str, cluster: str) -> tuple[Any, Any, Any]:
    """(graph, indicator, the plan a fresh joint solve gives) for a case."""
    graph = qs.trace(workload)
    cl = qs.load_cluster(cluster)
    ind = random_indicator(graph, 0)
    problem = AllocationProblem(graph, cl, qs.estimate(graph, cl), ind)
    plan, _ = solve(problem, "cpsat", refine=0, joint_split=True, compare_ties=False)
    return graph, ind, plan


def resolve(repeats: int) -> list[dict[str, Any]]:
    """The re-solve section: one row per case and scenario."""
    rows = []
    for workload, cluster, goal in RESOLVE_CASES:
        graph, ind, plan = _first_plan(workload, cluster)
        t0 = time.perf_counter()
        cache = ReplanCache.build(plan, graph, indicator=ind)
        build_s = time.perf_counter() - t0
        warm_s = cache.warm()  # as a run's start does (cli/replanning.py)
        names = [g.name for g in plan.cluster.groups]
        for scenario, groups, slow in (("gone", names[:-1], {}),
                                       ("slowed 1.3x", names, {names[-1]: 1.3})):
            times, last = [], None
            for _ in range(repeats):
                last = cache.replan(groups, slow)
                times.append(last.solve_s)
            assert last is not None
            rows.append({"workload": workload, "cluster": cluster, "scenario": scenario,
                         "median_s": statistics.median(times), "min_s": min(times),
                         "max_s": max(times), "goal_s": goal, "build_s": build_s, "warm_s": warm_s,
                         "predicted_ms": last.predicted_step_ms, "changes": last.changes,
                         # the running plan under the same slowdown (None: groups gone)
                         "kept_ms": cache.predict(plan, slow)[0] if not scenario.startswith(
                             "gone") else None})
    return rows


def _run(folder: Path, plan: Path, ind: Path, steps: int, slowdown: dict[str, float],
         online: OnlineSpec | None) -> list[list[dict[str, Any]]]:
    cfg = TrainConfig(workload=ONLINE_MODEL, plan_path=str(plan), rank_groups=["cpu", "cpu_2"],
                      steps=steps, out_dir=str(folder), emulate_dp=True, eval_batches=1,
                      slowdown=slowdown, online=online, progress_every_s=0)
    emulate(cfg, replanner=make_replanner)
    return [[json.loads(x) for x in (folder / f"metrics.rank{r}.jsonl").read_text()
             .splitlines()] for r in (0, 1)]


def _step_ms(rows: list[list[dict[str, Any]]], start: int) -> float:
    """Median over steps >= ``start`` of the slowest replica's compute plus the sync."""
    per_step = [max(r0["compute_ms"], r1["compute_ms"]) + r0["sync_ms"]
                for r0, r1 in zip(*rows, strict=True) if r0["step"] >= start]
    return statistics.median(per_step)


def online(steps: int, at: int, factor: float) -> dict[str, Any]:
    """The online section: an injected slowdown, the re-plan, and the right plan's run."""
    _, ind, plan = _first_plan(ONLINE_MODEL, ONLINE_CLUSTER)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        plan.save(root / "plan.json")
        ind.save(root / "ind.json")
        spec = OnlineSpec(replan="auto", indicator=str(root / "ind.json"), inject_slowdown=[
            SlowdownInjection(group="cpu_2", step=at, factor=factor)])
        rows = _run(root / "online", root / "plan.json", root / "ind.json", steps,
                    {"cpu_2": BASE_STRETCH}, spec)
        reps = [e for e in read_events(root / "online") if e["kind"] == "replan"]
        out: dict[str, Any] = {"steps": steps, "slowdown_at": at, "factor": factor,
                               "window": spec.replan_window, "replans": len(reps)}
        if not reps:
            return out
        first = reps[0]
        # the right plan from the start: the plan for the true slowdown (the injected
        # stretch over the device's own), run under that stretch from step 0
        cache = ReplanCache.load(root / "online" / "replan_cache.json")
        right = cache.replan(["cpu", "cpu_2"], {"cpu_2": factor / BASE_STRETCH}).plan
        right.save(root / "right.json")
        ref = _run(root / "right", root / "right.json", root / "ind.json", steps,
                   {"cpu_2": factor}, None)
        after = _step_ms(rows, first["step"] + spec.replan_calibration)
        reference = _step_ms(ref, spec.replan_calibration)
        out.update({"replan_step": first["step"], "steps_to_replan": first["step"] - at,
                    "solve_s": first["solve_s"], "factor_measured": first["factors"],
                    "step_ms_after": after, "step_ms_right_plan": reference,
                    "ratio": after / reference, "batches": first["batches"],
                    "right_batches": {g: p.batch_per_device for g, p in right.groups.items()}})
    return out


def _longest_over(values: list[float], threshold: float) -> int:
    """The longest run of values over (1 + threshold) x their median."""
    cut = statistics.median(values) * (1 + threshold)
    best = run = 0
    for v in values:
        run = run + 1 if v > cut else 0
        best = max(best, run)
    return best


def noise(steps: int) -> dict[str, dict[str, float]]:
    """The noise section, per group: the coefficient of variation of its compute time, the
    share of steps over +10% of the median, and the longest run of them (the detector
    fires on 20 in a row)."""
    _, ind, plan = _first_plan(ONLINE_MODEL, ONLINE_CLUSTER)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        plan.save(root / "plan.json")
        ind.save(root / "ind.json")
        rows = _run(root / "run", root / "plan.json", root / "ind.json", steps,
                    {"cpu_2": 2.0}, None)
    out = {}
    for g, rank in zip(("cpu", "cpu_2"), rows, strict=True):
        ms = [r["compute_ms"] for r in rank[5:]]
        med = statistics.median(ms)
        out[g] = {"cv": coefficient_of_variation(ms),
                  "over_10pct": sum(v > 1.1 * med for v in ms) / len(ms),
                  "longest_run_over_10pct": _longest_over(ms, 0.1)}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--section", choices=("resolve", "plans", "online", "noise", "membership",
                                           "all"),
                    default="all")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--at", type=int, default=20)
    ap.add_argument("--factor", type=float, default=6.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread; wall figures need a quiet machine")
    if args.section == "plans":
        print("\n== re-plans (deterministic: a random indicator of seed 0) ==")
        for r in resolve(1):
            kept = (f" (the running plan: {r['kept_ms']:.3f} ms)" if r["kept_ms"] is not None
                    else "")
            print(f"{r['workload']:>10} {r['cluster']:>22} {r['scenario']:>12}: predicted "
                  f"{r['predicted_ms']:.3f} ms{kept}; " + "; ".join(r["changes"]))
    if args.section in ("resolve", "all"):
        print("\n== re-solve (median/min/max s over repeats; goal) ==")
        for r in resolve(args.repeats):
            ok = "ok" if r["median_s"] <= r["goal_s"] else "OVER"
            print(f"{r['workload']:>10} {r['cluster']:>22} {r['scenario']:>12}: "
                  f"{r['median_s']:.3f} ({r['min_s']:.3f}..{r['max_s']:.3f}) s, goal "
                  f"{r['goal_s']:g} s {ok}; build {r['build_s']:.3f} s, warm {r['warm_s']:.2f} s; "
                  f"predicted "
                  f"{r['predicted_ms']:.3f} ms; " + "; ".join(r["changes"]))
    if args.section in ("noise", "all"):
        print("\n== noise: coefficient of variation of compute_ms per group ==")
        for g, n in noise(args.steps).items():
            print(f"  {g}: cv {n['cv']:.3f}, {n['over_10pct']:.0%} of steps over +10% of the "
                  f"median, longest run of them {n['longest_run_over_10pct']}")
    if args.section in ("online", "all"):
        print("\n== online re-plan ==")
        print(json.dumps(online(args.steps, args.at, args.factor), indent=1))
    if args.section in ("membership", "all"):
        print("\n== membership: a group leaving and returning (train --elastic) ==")
        with tempfile.TemporaryDirectory() as tmp:
            rows = membership_section(Path(tmp) / "run", steps=MEMBERSHIP_STEPS,
                                      every=MEMBERSHIP_EVERY)
        print_rows(rows, MEMBERSHIP_STEPS, MEMBERSHIP_EVERY)


if __name__ == "__main__":
    main()
