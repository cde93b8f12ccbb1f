"""The parsers of ``solve``, ``compare`` and ``pareto`` (their bodies, which import the
solve pipeline: :mod:`qsync_opt.cli.planning`)."""

from __future__ import annotations

import argparse
from typing import Any

from qsync_opt.cli.args import (
    EXIT_CODES_HELP,
    Deferred,
    command,
    finite_float,
    int_range,
    problem_args,
)
from qsync_opt.strategy.space import ALLOW_SYNTAX


def add_allow_args(sp: argparse.ArgumentParser, *, solve: bool = True) -> None:
    """``--allow`` (repeatable); for ``solve`` also ``--no-prune`` and ``--png`` (compare and
    pareto solve every strategy, and pareto's ``--png`` is its frontier)."""
    sp.add_argument("--allow", action="append", metavar="KNOB=VALUES",
                    help="strategies the planner may choose among (repeatable): "
                         f"{ALLOW_SYNTAX}; " + ("the plan records the chosen one (version 2). "
                                                if solve else "one row each. ")
                         + "Default: ddp, fp32, no pipeline")
    if not solve:
        return
    sp.add_argument("--no-prune", action="store_true",
                    help="with --allow: solve every strategy (the whole Pareto set), not "
                         "only those whose bound can beat the best found")
    sp.add_argument("--png", default=None,
                    help="with --allow: draw the strategies' throughput against "
                         "degradation here")


def add_solve_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``solve`` (its body: :func:`~qsync_opt.cli.planning.cmd_solve`)."""
    sp = command(sub, "solve", "choose every op's precision on every group")
    problem_args(sp)
    sp.add_argument("--solver", default="cpsat",
                    help="highs, cbc, cpsat, greedy, greedy-per-ms, uniform, dynamic-batching, "
                         "additive-ilp or strong-only")
    sp.add_argument("--out", required=True, help="write the Plan JSON here")
    sp.add_argument("--report", help="also write the SolveReport JSON here")
    sp.add_argument("--mode", choices=["auto", "target", "budget"], default="auto",
                    help="least degradation under the target (auto: lexicographic when the "
                         "default target is out of reach), or least makespan under --budget")
    sp.add_argument("--budget", type=finite_float(0, 1e15), default=None,
                    help="degradation budget (--mode budget)")
    sp.add_argument("--joint-split", action="store_true",
                    help="choose the per-group batch split together with the precisions")
    add_allow_args(sp)
    sp.set_defaults(fn=Deferred("qsync_opt.cli.planning", "cmd_solve"))
    return sp


def add_compare_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``compare`` (its body: :func:`~qsync_opt.cli.planning.cmd_compare`)."""
    sp = sub.add_parser("compare", help="every allocator and baseline side by side",
                        description="every allocator and baseline side by side",
                        epilog=EXIT_CODES_HELP)
    problem_args(sp)
    sp.add_argument("--solvers", help="comma-separated subset (default: all)")
    sp.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                    help='write {"rows": [...]} to FILE (stdout without FILE)')
    sp.add_argument("--plans", metavar="DIR", help="write every plan into this folder")
    sp.add_argument("--joint-split", action="store_true",
                    help="add a row choosing the batch split with the precisions")
    add_allow_args(sp, solve=False)
    sp.set_defaults(fn=Deferred("qsync_opt.cli.planning", "cmd_compare"))
    return sp


def add_pareto_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``pareto`` (its body: :func:`~qsync_opt.cli.planning.cmd_pareto`)."""
    sp = command(sub, "pareto", "degradation against throughput as the makespan target sweeps")
    problem_args(sp)
    sp.add_argument("--out", required=True, help="write the frontier's points (JSON) here")
    sp.add_argument("--png", help="also plot it here")
    sp.add_argument("--points", type=int_range(2, 1000), default=8, help="targets swept")
    sp.add_argument("--exact", default="highs", help="exact backend (highs, cbc, cpsat)")
    sp.add_argument("--no-split", action="store_true",
                    help="leave out the joint batch split series (faster)")
    add_allow_args(sp, solve=False)
    sp.set_defaults(fn=Deferred("qsync_opt.cli.planning", "cmd_pareto"))
    return sp
