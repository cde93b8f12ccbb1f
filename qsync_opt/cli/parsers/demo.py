"""The parser of ``demo`` (its body: :mod:`qsync_opt.cli.demo`)."""

from __future__ import annotations

import argparse
from typing import Any

from qsync_opt.cli.args import BATCHES, Deferred, positive_int
from qsync_opt.indicator import METHODS


def add_demo_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``demo`` (its body: :func:`~qsync_opt.cli.demo.cmd_demo`)."""
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
    sp.set_defaults(fn=Deferred("qsync_opt.cli.demo", "cmd_demo"))
    return sp
