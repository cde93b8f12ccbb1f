"""The ``demo`` command: its arguments handed to :func:`qsync_opt.cli.walkthrough.run_demo`."""

from __future__ import annotations

import argparse
from typing import Any

from qsync_opt.cli.args import BATCHES, positive_int
from qsync_opt.documents.outfolder import check_folder, check_names
from qsync_opt.indicator import METHODS

#: What the demo writes into its folder (checked before any work: no link there).
DEMO_FILES = ("plan.json", "frontier.png", "graph.json", "costs.json", "indicator.json",
              "cluster.json", "local_plan.json", "local_fp32.json", "local_costs.json")


def cmd_demo(args: argparse.Namespace) -> int:
    from qsync_opt.cli.walkthrough import run_demo  # lazy: the demo pulls the solver stack
    out = check_folder(args.out or "qsync-demo", "--out")  # before any work
    check_names(out, files=DEMO_FILES)
    return run_demo(out=args.out, method=args.method, indicator_batches=args.indicator_batches,
                    local=not getattr(args, "no_local", False), steps=args.steps)


# ----------------------------------------------------------------------------- parsers


def add_demo_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``demo`` to the CLI's subparsers (its default ``fn``: :func:`cmd_demo`)."""
    sp = sub.add_parser("demo", help="the main job on built-in defaults (no GPU needed)")
    sp.add_argument("--out", help="write the plan, graph, costs, indicator and cluster JSON "
                    "into this folder (default: the plan only, into ./qsync-demo)")
    sp.add_argument("--method", default=METHODS[0],
                    choices=METHODS,
                    help="indicator method")
    sp.add_argument("--indicator-batches", type=BATCHES, default=4,
                    help="synthetic batches of 8 the indicator averages over")
    sp.add_argument("--no-local", action="store_true",
                    help="skip part 1 (profile, plan, train and check on this CPU)")
    sp.add_argument("--steps", type=positive_int(1_000_000), default=80,
                    help="training steps per run in part 1 (default 80; four runs, A B B A)")
    sp.set_defaults(fn=cmd_demo)
    return sp
