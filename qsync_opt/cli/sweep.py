"""The ``sweep`` command's body over :func:`qsync_opt.hfta.sweep.run_sweep` (the sweep itself,
described in :mod:`qsync_opt.hfta.sweep`); its parser is :mod:`qsync_opt.cli.parsers.sweep`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from qsync_opt.cli.summaries import format_table
from qsync_opt.documents.io import atomic_write_text
from qsync_opt.hfta.request import SweepRequest, check_request, parse_seeds, parse_values
from qsync_opt.hfta.sweep import run_sweep
from qsync_opt.runtime.metrics import clean

__all__ = ["cmd_sweep", "sweep_request"]


def sweep_request(args: argparse.Namespace) -> SweepRequest:
    """The sweep ``args`` ask for, every flag checked (:func:`~qsync_opt.hfta.sweep.
    check_request`, :mod:`qsync_opt.hfta.request`) before anything is built or trained."""
    req = SweepRequest(
        model=args.model, seeds=parse_seeds(args.seeds),
        lrs=parse_values(args.lr, "--lr", positive=True),
        wds=parse_values(args.wd, "--wd", positive=False), steps=args.steps,
        batch=args.batch, optimizer=args.optimizer, momentum=args.momentum,
        lr_schedule=args.lr_schedule, inputs=args.inputs, fuse=args.fuse, plan=args.plan,
        group=args.group, eval_batches=args.eval_batches, device=args.device, out=args.out,
        export=args.export)
    check_request(req)
    return req


def cmd_sweep(args: argparse.Namespace) -> int:
    req = sweep_request(args)
    quiet = args.json == "-"
    def say(line: str) -> None:
        (sys.stderr if quiet else sys.stdout).write(line + "\n")

    doc = run_sweep(req, say)
    if args.json is not None:
        text = json.dumps(clean(doc), indent=2) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
        else:
            atomic_write_text(Path(args.json), text, what="--json")
    if not quiet:
        def f(v: Any) -> str:
            return "-" if v is None or v != v else f"{v:.4f}"

        rows = doc["models"]
        print(format_table([(r["model"], r["seed"], f"{r['lr']:g}", f"{r['weight_decay']:g}",
                             f(r["final_loss"]), f(r["eval_loss"]), f(r["eval_accuracy"]),
                             r["skipped_steps"]) for r in rows],
                           ("model", "seed", "lr", "wd", "final loss", "eval loss",
                            "eval acc", "skipped")))
        n = len(rows)
        print(f"{n} models x {args.steps} steps in {doc['wall_s']:.1f} s "
              f"({doc['samples_per_s']} samples/s, {doc['threads']} thread(s))")
    return 0
