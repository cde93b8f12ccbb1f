"""The ``demo`` command's body: its arguments handed to
:func:`qsync_opt.cli.walkthrough.run_demo`; its parser is :mod:`qsync_opt.cli.parsers.demo`."""

from __future__ import annotations

import argparse

from qsync_opt.cli.walkthrough import run_demo
from qsync_opt.documents.outfolder import check_folder, check_names

#: What the demo writes into its folder (checked before any work: no link there).
DEMO_FILES = ("plan.json", "frontier.png", "graph.json", "costs.json", "indicator.json",
              "cluster.json", "local_plan.json", "local_fp32.json", "local_costs.json")


def cmd_demo(args: argparse.Namespace) -> int:
    out = check_folder(args.out or "qsync-demo", "--out")  # before any work
    check_names(out, files=DEMO_FILES)
    return run_demo(out=args.out, method=args.method, indicator_batches=args.indicator_batches,
                    local=not getattr(args, "no_local", False), steps=args.steps)
