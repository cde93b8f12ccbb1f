"""Elastic runs: from a group leaving (or returning) to the first step of the new world.

One ``qsync-opt train --elastic`` on this machine, two agents (this CPU and ``cpu/2``, an
emulated card half as fast), a graceful leave, a return, a crash and a return
(``--membership``, default ``cpu_2-@40,cpu_2+@80,cpu_2-@120:crash,cpu_2+@160``, 200 steps,
a checkpoint every ``--checkpoint-every`` steps, default 25). For every ``membership``
event of the run's ``events.jsonl`` it prints the change, the steps lost, the seconds from
the change to the first step of the new world (``change_to_first_step_s``: from the rank
that noticed it; for the crash, from the crashing rank's own record just before the kill),
and the goal: at most the checkpoint interval (in seconds, at the slowest world's measured
step time) plus 15 s. ``membership_section`` returns the rows for a caller (the elastic
benchmark's membership section).

Run it on a quiet machine (wall-clock figures)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/elastic_membership.py --out /tmp/elastic_bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from qsync_opt.runtime.events import read_events

REPO = Path(__file__).resolve().parents[1]
#: The goal: leave -> first new step within the checkpoint interval plus this.
GOAL_EXTRA_S = 15.0


def _step_s(out: Path) -> float:
    """The slowest measured step time of the run (s), over every rank's metrics rows."""
    worst = 0.0
    for path in out.glob("metrics.rank*.jsonl"):
        ms = sorted(json.loads(x)["step_ms"] for x in path.read_text().splitlines())
        if ms:
            worst = max(worst, ms[len(ms) // 2] / 1e3)  # the median: the first step warms
    return worst


def membership_section(out: Path, *, steps: int = 200, every: int = 25,
                       schedule: str = "cpu_2-@40,cpu_2+@80,cpu_2-@120:crash,cpu_2+@160",
                       model: str = "digits_cnn", cluster: str = "cpux1+cpu/2x1",
                       batch: int = 32) -> list[dict[str, Any]]:
    """Run the elastic benchmark into ``out`` (emptied first); one row per change."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "qsync_opt.cli", "train", "--model", model, "--cluster",
           cluster, "--batch", str(batch), "--steps", str(steps), "--out", str(out),
           "--elastic", "--checkpoint-every", str(every), "--membership", schedule,
           "--progress-every", "0"]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=str(REPO))
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if run.returncode != 0:
        raise SystemExit(f"the elastic run failed ({run.returncode}):\n{run.stderr[-2000:]}")
    interval_s = every * _step_s(out)
    rows = []
    for e in read_events(out):
        if e["kind"] != "membership":
            continue
        took = e["change_to_first_step_s"]
        rows.append({"step": e["step"], "old": e["old_groups"], "new": e["new_groups"],
                     "lost_steps": e["lost_steps"], "change_to_first_step_s": took,
                     "goal_s": round(interval_s + GOAL_EXTRA_S, 3),
                     "met": took is not None and took <= interval_s + GOAL_EXTRA_S,
                     "reasons": e.get("reasons", [])})
    return rows


def print_rows(rows: list[dict[str, Any]], steps: int, every: int) -> None:
    """The table of :func:`membership_section`'s rows."""
    print(f"elastic membership: digits_cnn on cpu + cpu/2, {steps} steps, a checkpoint "
          f"every {every}")
    print(f"{'step':>5}  {'old -> new':<22} {'lost':>4}  {'to first step':>13}  {'goal':>8}")
    for r in rows:
        change = f"{'+'.join(r['old'])} -> {'+'.join(r['new'])}"
        took = r["change_to_first_step_s"]
        print(f"{r['step']:>5}  {change:<22} {r['lost_steps']:>4}  "
              f"{(f'{took:.2f} s' if took is not None else 'n/a'):>13}  "
              f"{r['goal_s']:>6.2f} s  {'met' if r['met'] else 'NOT met'}  "
              f"({'; '.join(x[:60] for x in r['reasons'])})")



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/qsync_elastic_bench")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--checkpoint-every", type=int, default=25)
    ap.add_argument("--membership", default="cpu_2-@40,cpu_2+@80,cpu_2-@120:crash,cpu_2+@160")
    args = ap.parse_args()
    rows = membership_section(Path(args.out), steps=args.steps, every=args.checkpoint_every,
                              schedule=args.membership)
    print_rows(rows, args.steps, args.checkpoint_every)

if __name__ == "__main__":
    main()
