"""The ``sweep`` command: its parser and a thin body over :func:`qsync_opt.hfta.sweep.run_sweep`
(the sweep itself, described in :mod:`qsync_opt.hfta.sweep`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from qsync_opt.cli.summaries import format_table
from qsync_opt.core.limits import (
    MAX_EVAL_BATCHES,
    MAX_STEPS,
    finite_float,
    int_range,
    positive_int,
    spec_type,
)
from qsync_opt.documents.io import atomic_write_text
from qsync_opt.documents.schemas import MAX_BATCH
from qsync_opt.hfta.request import SweepRequest, check_request, parse_seeds, parse_values
from qsync_opt.strategy.schedule import SCHEDULE_SYNTAX, parse_schedule

__all__ = ["add_sweep_parser", "cmd_sweep", "sweep_request"]

#: The command's help description: the first line of :mod:`qsync_opt.hfta.sweep`'s
#: docstring (the sweep imports torch; building the parser must not).
DESCRIPTION = ("``qsync-opt sweep``: a seed / learning-rate / weight-decay sweep trained as "
               "one fused array.")


def _lrs(text: str) -> list[float]:
    return parse_values(text, "--lr", positive=True)


def _wds(text: str) -> list[float]:
    return parse_values(text, "--wd", positive=False)


def _schedule_text(text: str) -> Any:
    return parse_schedule(text, 1.0, MAX_STEPS)  # the warm-up against --steps: later


def add_sweep_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("sweep", help="train many variants of a model as one fused array (HFTA)",
                       description=DESCRIPTION)
    p.add_argument("--model", required=True, help="workload (qsync-opt models)")
    p.add_argument("--seeds", type=spec_type(parse_seeds, "--seeds"), default="0",
                   help="seeds: 0-7, 0,3,5 (default 0)")
    p.add_argument("--lr", type=spec_type(_lrs, "--lr"), default="0.05",
                   help="learning rates, comma-separated (default 0.05)")
    p.add_argument("--wd", type=spec_type(_wds, "--wd"), default="0",
                   help="weight decays, comma-separated (default 0)")
    p.add_argument("--steps", type=positive_int(MAX_STEPS), default=100,
                   help="optimizer steps (default 100)")
    p.add_argument("--batch", type=positive_int(MAX_BATCH), default=None,
                   help="batch per model (default: the "
                   "model's)")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--momentum", type=finite_float(0, 1, hi_open=True), default=None,
                   help="SGD momentum (default 0.9)")
    p.add_argument("--lr-schedule", type=spec_type(_schedule_text, "lr_schedule"),
                   default="constant", metavar="SCHEDULE",
                   help=f"{SCHEDULE_SYNTAX} (default constant)")
    p.add_argument("--inputs", choices=["per_model", "replicated"], default="per_model",
                   help="per_model: each model its own seed's batches (separate runs); "
                        "replicated: one stream for all (they differ in weights only)")
    p.add_argument("--fuse", choices=["measure", "fused", "serial", "separate"],
                   default="measure", help="per-op fuse-or-not (default: measured here)")
    p.add_argument("--plan", help="Plan JSON: the array runs one group's precisions")
    p.add_argument("--group", help="with --plan: the group whose precisions run")
    p.add_argument("--eval-batches", type=int_range(0, MAX_EVAL_BATCHES), default=4)
    p.add_argument("--device", default="cpu",
                   help="where the array trains: cpu (default), cuda or cuda:N")
    p.add_argument("--out", help="write sweep.json here (and --export's runs)")
    p.add_argument("--export", action="store_true",
                   help="also write each model as a run `train` resumes (OUT/model{b})")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="write the result JSON to FILE (stdout without FILE)")
    p.set_defaults(fn=cmd_sweep)
    return p


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
    # lazy: the fused trainer and the metrics import torch (only a run needs them)
    from qsync_opt.hfta.sweep import run_sweep
    from qsync_opt.runtime.metrics import clean

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
