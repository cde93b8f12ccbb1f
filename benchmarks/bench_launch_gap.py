"""Where the launched runtime's extra time goes: one rank against two, compute against sync.

From a CostTable saved by ``bench_prediction.py --tables DIR``: a uniform bf16 plan and a
random mixed plan (seed 0; fp32, bf16 or int8 per op) of tiny_gpt at batch 16, each launched
with ``qsync-opt train --nproc 1`` and ``--nproc 2`` (25 steps); printed: rank 0's median
``step_ms``, ``compute_ms`` (zero_grad to the end of backward, DDP hooks included) and
``sync_ms`` (the rest) from step 5, and the one-process prediction (no communication).

    .venv/bin/python benchmarks/bench_launch_gap.py --tables /tmp/tables [--model tiny_gpt]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from qsync_opt import parse_shorthand, trace
from qsync_opt.core.precision import Precision
from qsync_opt.documents.schemas import CostTable
from qsync_opt.problem.program import AllocationProblem, ProblemOptions
from qsync_opt.problem.synthetic import random_indicator

BATCH = {"digits_cnn": 64, "tiny_gpt": 16, "resnet18": 8}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", required=True)
    ap.add_argument("--model", default="tiny_gpt")
    ap.add_argument("--steps", type=int, default=25)
    args = ap.parse_args(argv)
    name, b = args.model, BATCH.get(args.model, 8)
    g = trace(name, b)
    costs = CostTable.load(Path(args.tables) / f"{name}.costs.json")
    print(f"{'plan':>8} {'ranks':>5} {'step ms':>8} {'compute ms':>11} {'sync ms':>8} "
          f"{'predicted ms':>13}")
    for n in (1, 2):
        prob = AllocationProblem(g, parse_shorthand(f"cpux{n}@{b}"), costs, random_indicator(g),
                             ProblemOptions(lower_reference=True))
        gm = prob.groups[0]
        rng = random.Random(0)
        pool = (Precision.fp32, Precision.bf16, Precision.int8)
        plans = {"bf16": [c.index(Precision.bf16) if Precision.bf16 in c
                          else c.index(Precision.fp32) for c in gm.choices],
                 "mixed0": [c.index(rng.choice([p for p in pool if p in c]))
                            for c in gm.choices]}
        for label, a in plans.items():
            plan = prob.make_plan({gm.name: a})
            with tempfile.TemporaryDirectory() as d:
                plan.save(Path(d) / "plan.json")
                subprocess.run([sys.executable, "-m", "qsync_opt.cli", "train", "--model", name,
                                "--plan", str(Path(d) / "plan.json"), "--nproc", str(n),
                                "--steps", str(args.steps), "--out", str(Path(d) / "out")],
                               check=True, capture_output=True, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
                rows = [json.loads(x) for x in
                        (Path(d) / "out" / "metrics.rank0.jsonl").read_text().splitlines()][5:]
            med = {k: statistics.median(r[k] for r in rows)
                   for k in ("step_ms", "compute_ms", "sync_ms")}
            pred = prob.replayer.simulate(plan, events=False).iteration_ms
            print(f"{label:>8} {n:>5} {med['step_ms']:8.1f} {med['compute_ms']:11.1f} "
                  f"{med['sync_ms']:8.1f} {pred:13.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
