"""The ``qsync-opt report`` command's body (a plan's report is :mod:`qsync_opt.planner.figure`,
a run's story :mod:`qsync_opt.runtime.story` told by :mod:`qsync_opt.runtime.storyview`); its
parser is :mod:`qsync_opt.cli.parsers.report`."""

from __future__ import annotations

import argparse
import json
import sys

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.planner.figure import (
    load_report_inputs,
    plan_figure,
    plan_summary_lines,
    report_summary,
)
from qsync_opt.runtime.story import read_story
from qsync_opt.runtime.storyview import check_figure_path, story_figure, story_lines, story_summary

#: The flags that read a plan's inputs: meaningless beside --run.
PLAN_ONLY = ("costs", "model", "graph")


def cmd_report(args: argparse.Namespace) -> int:
    if getattr(args, "run", None) is not None:
        return cmd_run_report(args)
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


def cmd_run_report(args: argparse.Namespace) -> int:
    """``report --run DIR``: the run's story printed (or ``--json``), drawn with ``--png``."""
    for dest in PLAN_ONLY:
        if getattr(args, dest, None) is not None:
            raise QsyncInputError(f"--{dest}: not allowed with --run (it is an input of a "
                                  "plan's report; --run reads a run's folder)")
    png = getattr(args, "png", None)
    if png:
        check_figure_path(png, "--png")  # before any reading: a link there is refused
    story = read_story(args.run)
    if png:
        story_figure(story, png, what="--png")
    if getattr(args, "json", False):
        summary = story_summary(story)
        summary["png"] = str(png) if png else None
        sys.stdout.write(json.dumps(summary, indent=2, allow_nan=False) + "\n")
        if png:
            sys.stderr.write(f"wrote {png}\n")
        return 0
    print("\n".join(story_lines(story)))
    if png:
        print(f"wrote {png}")
    return 0
