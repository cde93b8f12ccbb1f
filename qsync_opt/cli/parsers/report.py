"""The parser of ``report`` (its body: :mod:`qsync_opt.cli.report`)."""

from __future__ import annotations

import argparse
from typing import Any

from qsync_opt.cli.args import Deferred


def add_report_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``report`` to the CLI's subparsers (``sub`` from ``add_subparsers``)."""
    help_ = ("summarise a plan (precisions, one replayed iteration, memory) or a training "
             "run's story (--run); optionally a PNG")
    sp: argparse.ArgumentParser = sub.add_parser("report", help=help_, description=help_)
    which = sp.add_mutually_exclusive_group(required=True)
    which.add_argument("--plan", help="Plan JSON to report on")
    which.add_argument("--run", metavar="DIR",
                       help="a training run's folder (train --out): its periods, plan changes, "
                            "predicted and measured step time per group, checkpoints, steps "
                            "lost and how it stopped")
    sp.add_argument("--png", help="write the figure here (a plan: heatmap, time and memory "
                                  "bars; a run: step time per group over the steps)")
    sp.add_argument("--costs", help="CostTable JSON (default: roofline estimates)")
    sp.add_argument("--model", default=None, metavar="PATH.py:FUNCTION",
                    help="the model file of a plan made from one: it is run (a plan never "
                         "runs code), and its sha256 must be the plan's workload_sha256")
    sp.add_argument("--graph", default=None, metavar="GRAPH.json",
                    help="the plan's ModelGraph (qsync-opt graph --out): reused, nothing is "
                         "traced or imported (no --model needed)")
    sp.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    sp.set_defaults(fn=Deferred("qsync_opt.cli.report", "cmd_report"))
    return sp
