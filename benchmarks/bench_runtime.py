"""The straggler and the plan that removes it, measured on this CPU.

Two gloo ranks under torchrun on this machine; rank 1 is the derived device ``cpu/2`` (every
op's measured time stretched 2x: an emulated card half as fast). The same model trains with
every op at fp32, with the exact solver's precision plan, and with the exact solver's joint
plan (precisions and the batch split chosen together; per-op costs at other batches scaled
from the profile by the fitted batch model). Printed: median step time per rank (steps 6 on),
wall time, final and held-out loss, the replayer's prediction from this CPU's in-context
profile (`cpu/2` derived from it, the all-reduce fitted on two local gloo processes), and each
plan's precisions and per-rank batches.

Whether precision can remove the straggler depends on the CPU: with AMX, bf16 is faster than
fp32 and the precision plan lowers the slow rank's ops; on an AVX2-only CPU every lower
precision is slower, the precision plan is all-fp32, and only the batch split helps.

    .venv/bin/python benchmarks/bench_runtime.py [--model tiny_gpt] [--steps 40] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from qsync_opt import Plan, parse_shorthand, trace
from qsync_opt.core.machine import cpu_model
from qsync_opt.core.precision import Precision
from qsync_opt.planner.solve import solve
from qsync_opt.problem.evaluator import evaluate
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.problem.synthetic import random_indicator
from qsync_opt.profile import derive, measure_comm_local, profile_detailed, with_comm


def train(model: str, plan: Path, out: Path, steps: int) -> dict:
    cmd = [sys.executable, "-m", "qsync_opt.cli", "train", "--model", model, "--plan", str(plan),
           "--nproc", "2", "--steps", str(steps), "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    per_rank = []
    for r in (0, 1):
        rows = [json.loads(x) for x in (out / f"metrics.rank{r}.jsonl").read_text().splitlines()]
        per_rank.append((rows[0]["group"], statistics.median(x["step_ms"] for x in rows[5:])))
    return {"ranks": per_rank, **json.loads((out / "summary.json").read_text())}


def _key(plan: Plan) -> str:
    """What makes two plans run the same: precisions and batches per group."""
    return json.dumps({k: [v.batch_per_device, {o: x.value for o, x in v.precisions.items()}]
                       for k, v in plan.groups.items()}, sort_keys=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny_gpt")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs of each distinct plan, interleaved (A B B A ...)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    g = trace(args.model)
    c = parse_shorthand("cpux1+cpu/2x1")
    prof = profile_detailed(args.model, g.batch_size, threads=1, graph=g)
    costs = with_comm(derive(prof.table, ["cpu/2"]), g, measure_comm_local(2))
    prob = AllocationProblem(g, c, costs, random_indicator(g))
    plan, rep = solve(prob, "highs")
    joint, jrep = solve(prob, "highs", joint_split=True)
    fp32 = prob.make_plan({gm.name: [ch.index(Precision.fp32) for ch in gm.choices]
                           for gm in prob.groups}, {"solver": "all-fp32"})
    print(f"machine: {cpu_model()}; {args.model}, 2 ranks (cpu, cpu/2), {args.steps} steps")
    print(f"precision plan: {rep.mode}; joint plan: {jrep.mode}")
    candidates = (("all fp32", fp32), ("precision plan", plan), ("joint plan", joint))
    plans: list[tuple[str, Plan]] = []
    for name, p in candidates:  # a plan equal to an earlier one is said so, not re-run
        same = next((n for n, q in plans if _key(q) == _key(p)), None)
        if same is not None:
            print(f"{name:>14}: the same plan as {same}")
        else:
            plans.append((name, p))
    runs: dict[str, list[dict]] = {name: [] for name, _ in plans}
    with tempfile.TemporaryDirectory() as tmp:
        order = [x for r in range(args.repeats)
                 for x in (plans if r % 2 == 0 else plans[::-1])]  # A B C C B A ...
        for i, (name, p) in enumerate(order):
            path = Path(tmp) / f"{name.replace(' ', '_')}.json"
            p.save(path)
            runs[name].append(train(args.model, path, Path(tmp) / f"run{i}", args.steps))
        base = statistics.median(max(ms for _, ms in r["ranks"]) for r in runs[plans[0][0]])
        for name, p in plans:
            pred = evaluate(prob, p).replay_makespan_ms
            res = runs[name]
            iters = [max(ms for _, ms in r["ranks"]) for r in res]
            mix = {k: sorted({x.value for x in v.precisions.values()}) for k, v in p.groups.items()}
            print(f"{name:>14}: iteration ms (slowest rank's median step) over {len(res)} runs: "
                  f"median {statistics.median(iters):.0f}, range {min(iters):.0f}-"
                  f"{max(iters):.0f}; speed-up over all fp32 "
                  f"{base / statistics.median(iters):.2f}x; predicted {pred:.0f} ms; wall "
                  f"{statistics.median(r['wall_s'] for r in res):.1f} s; final loss "
                  f"{res[0]['final_loss']:.4f}, held-out {res[0]['eval_loss']:.4f}; precisions "
                  f"{mix}; batches "
                  + ", ".join(f"{k} {v.batch_per_device}" for k, v in p.groups.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
