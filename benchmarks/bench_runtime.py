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

    .venv/bin/python benchmarks/bench_runtime.py [--model tiny_gpt] [--steps 40]
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
from qsync_opt._env import cpu_model
from qsync_opt.precision import Precision
from qsync_opt.problem import AllocationProblem, evaluate
from qsync_opt.profile import derive, measure_comm_local, profile_detailed, with_comm
from qsync_opt.solve import solve
from qsync_opt.synthetic import random_indicator


def train(model: str, plan: Path, out: Path, steps: int) -> dict:
    cmd = [sys.executable, "-m", "qsync_opt.cli", "train", "--model", model, "--plan", str(plan),
           "--nproc", "2", "--steps", str(steps), "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    per_rank = []
    for r in (0, 1):
        rows = [json.loads(x) for x in (out / f"metrics.rank{r}.jsonl").read_text().splitlines()]
        per_rank.append((rows[0]["group"], statistics.median(x["step_ms"] for x in rows[5:])))
    return {"ranks": per_rank, **json.loads((out / "summary.json").read_text())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny_gpt")
    ap.add_argument("--steps", type=int, default=40)
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
    with tempfile.TemporaryDirectory() as tmp:
        for name, p in (("all fp32", fp32), ("precision plan", plan), ("joint plan", joint)):
            path = Path(tmp) / f"{name.replace(' ', '_')}.json"
            p.save(path)
            res = train(args.model, path, Path(tmp) / name.replace(" ", "_"), args.steps)
            pred = evaluate(prob, Plan.load(path)).replay_makespan_ms
            mix = {k: sorted({x.value for x in v.precisions.values()}) for k, v in p.groups.items()}
            print(f"{name:>14}: step ms median " + ", ".join(f"{gname} {ms:.0f}" for gname, ms in
                                                           res["ranks"])
                  + f"; wall {res['wall_s']:.1f} s; final loss {res['final_loss']:.4f}, held-out "
                  f"{res['eval_loss']:.4f}; predicted iteration {pred:.0f} ms; precisions {mix}; "
                  "batches " + ", ".join(f"{k} {v.batch_per_device}" for k, v in p.groups.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
