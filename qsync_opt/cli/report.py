"""The ``qsync-opt report`` command's body (the report itself is
:mod:`qsync_opt.planner.figure`); its parser is :mod:`qsync_opt.cli.parsers.report`."""

from __future__ import annotations

import argparse
import json
import sys

from qsync_opt.planner.figure import (
    load_report_inputs,
    plan_figure,
    plan_summary_lines,
    report_summary,
)


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
