"""The ``demo`` command: its arguments handed to :func:`qsync_opt.demo.run_demo`."""

from __future__ import annotations

import argparse


def cmd_demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo
    from ..outfolder import check_folder

    check_folder(args.out or "qsync-demo", "--out")  # before any work: a folder to write
    return run_demo(out=args.out, method=args.method, indicator_batches=args.indicator_batches,
                    local=not getattr(args, "no_local", False), steps=args.steps)
