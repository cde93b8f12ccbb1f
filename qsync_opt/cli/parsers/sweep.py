"""The parser of ``sweep`` (its body: :mod:`qsync_opt.cli.sweep`)."""

from __future__ import annotations

import argparse
from typing import Any

from qsync_opt.cli.args import Deferred
from qsync_opt.core.limits import (
    MAX_EVAL_BATCHES,
    MAX_STEPS,
    finite_float,
    int_range,
    positive_int,
    spec_type,
)
from qsync_opt.documents.schemas import MAX_BATCH
from qsync_opt.hfta.request import parse_seeds, parse_values
from qsync_opt.strategy.schedule import SCHEDULE_SYNTAX, parse_schedule

__all__ = ["DESCRIPTION", "add_sweep_parser"]

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
    p.set_defaults(fn=Deferred("qsync_opt.cli.sweep", "cmd_sweep"))
    return p
