"""The ``qsync-opt report`` command: its parser and its body (the report itself is
:mod:`qsync_opt.planner.figure`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from qsync_opt.planner.figure import (
    load_report_inputs,
    plan_figure,
    plan_summary_lines,
    report_summary,
)


def add_report_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``report`` to the CLI's subparsers (``sub`` from ``add_subparsers``)."""
    help_ = "summarise a plan: precisions, one replayed iteration, memory; optionally a PNG"
    sp: argparse.ArgumentParser = sub.add_parser("report", help=help_, description=help_)
    sp.add_argument("--plan", required=True, help="Plan JSON to report on")
    sp.add_argument("--png", help="write the figure (heatmap, time and memory bars) here")
    sp.add_argument("--costs", help="CostTable JSON (default: roofline estimates)")
    sp.add_argument("--model", default=None, metavar="PATH.py:FUNCTION",
                    help="the model file of a plan made from one: it is run (a plan never "
                         "runs code), and its sha256 must be the plan's workload_sha256")
    sp.add_argument("--graph", default=None, metavar="GRAPH.json",
                    help="the plan's ModelGraph (qsync-opt graph --out): reused, nothing is "
                         "traced or imported (no --model needed)")
    sp.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    sp.set_defaults(fn=cmd_report)
    return sp


def cmd_report(args: argparse.Namespace) -> int:
    inputs = load_report_inputs(args.plan, getattr(args, "costs", None),
                                getattr(args, "model", None), getattr(args, "graph", None))
    png = getattr(args, "png", None)
    if png:
        plan_figure(inputs.plan, inputs.graph, inputs.timeline, png, what="--png")
    if getattr(args, "json", False):
        summary = report_summary(inputs.plan, inputs.timeline)
        summary["png"] = str(png) if png else None
        sys.stdout.write(json.dumps(summary, indent=2, default=str) + "\n")
        if png:
            sys.stderr.write(f"wrote {png}\n")
        return 0
    print("\n".join(plan_summary_lines(inputs.plan, inputs.timeline)))
    if png:
        print(f"wrote {png}")
    return 0
