"""The ``qsync-opt`` command line.

Tables for people, ``--json`` for programs. Bad input exits with code 2 (a proven infeasible
problem 3, no plan within the time limit 4: :data:`EXIT_CODES_HELP`) and one line on
stderr naming the field and what was expected (control characters in it escaped); every
numeric flag is checked by its argparse type (finite, in its range); files are written
atomically, and a write that fails (read-only folder, full disk, file-size limit, a folder
in the way) is one line naming the flag, exit 2, the file that was there unchanged.

The package, by family of commands: :mod:`.info` (models, devices, schema), :mod:`.model`
(graph, estimate, replay, indicate), :mod:`.planning` (solve, compare, pareto) and
:mod:`.demo`; :mod:`.args` holds the flag types and the shared arguments. The parser and
:func:`main` (the entry point ``qsync_opt.cli:main``) are here; the text the commands print
is :mod:`qsync_opt.summaries`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

from pydantic import ValidationError

from .. import __version__
from ..cluster import SHORTHAND_HELP
from ..errors import QsyncInputError, describe_validation_error, one_line
from ..graph import TIE_MODES
from ..indicator import METHODS
from ..netsim.cluster import COMM_MODEL_HELP
from ..netsim.traffic import POLICIES as NETSIM_POLICIES
from ..netsim.traffic import SCENARIOS as NETSIM_SCENARIOS
from ..schemas import MAX_BATCH, schema_names
from ..summaries import (
    REPLAY_HEADER,
    GiB,
    estimate_summary_lines,
    graph_summary_lines,
    plan_lines,
    replay_rows,
    uniform_plans,
)
from .args import (
    BATCH,
    BATCHES,
    COMPRESSOR_TEXT,
    FRACTION,
    GBPS_TEXT,
    INT4_FLAG_HELP,
    POSITIVE_SECONDS,
    SEED,
    TRACER_HELP,
    TRACERS,
    add_sync_args,
    finite_float,
    int_range,
    positive_int,
)
from .demo import cmd_demo
from .info import cmd_devices, cmd_models, cmd_schema
from .model import cmd_estimate, cmd_graph, cmd_indicate, cmd_replay
from .netsim import cmd_netsim
from .planning import cmd_compare, cmd_pareto, cmd_solve

__all__ = [
    "BATCH", "BATCHES", "FRACTION", "POSITIVE_SECONDS", "REPLAY_HEADER", "SEED", "GiB",
    "build_parser", "cmd_compare", "cmd_demo", "cmd_devices", "cmd_estimate", "cmd_graph",
    "cmd_indicate", "cmd_models", "cmd_netsim", "cmd_pareto", "cmd_replay", "cmd_schema", "cmd_solve",
    "estimate_summary_lines", "finite_float", "graph_summary_lines", "int_range", "main",
    "plan_lines", "positive_int", "replay_rows", "uniform_plans",
]


#: Exit codes: bad input (a flag, a file, a value), no plan exists (infeasible, proven), no
#: plan found within the time limit (one may exist). Each its own, so a script can tell them
#: apart; every other failure is 1.
EXIT_BAD_INPUT = 2
EXIT_INFEASIBLE = 3
EXIT_TIME_LIMIT = 4
EXIT_CODES_HELP = (f"exit codes: 0 done; {EXIT_BAD_INPUT} bad input (one line naming the flag "
                   f"or field); {EXIT_INFEASIBLE} no plan exists (infeasible: the lines after "
                   f"say what would make it feasible); {EXIT_TIME_LIMIT} no plan found within "
                   "the time limit (one may exist: give more --time-limit)")


#: The commands that plan (their --help names the exit codes).
PLANNING = ("solve", "pareto")


#: The netsim policies whose transport is bounded-loss: the ones ``--p`` applies to.
BOUNDED_POLICIES = [k for k, (_, transport) in NETSIM_POLICIES.items() if transport == "bounded"]


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line with exit code 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {one_line(message)}\n")
        raise SystemExit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="qsync-opt", description="Precision plans for mixed GPU clusters.",
               epilog=EXIT_CODES_HELP)
    p.add_argument("--version", action="version", version=f"qsync-opt {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_,
                            epilog=EXIT_CODES_HELP if name in PLANNING else None)
        sp.add_argument("--json", action="store_true", help="machine-readable output on stdout")
        return sp

    add("models", "list the built-in workloads").set_defaults(fn=cmd_models)
    sp = add("devices", "list the device catalog")
    sp.add_argument("--cpu", action="store_true", help="also measure and show this machine's CPU")
    sp.set_defaults(fn=cmd_devices)
    sp = sub.add_parser("schema", help="print the JSON Schema of a document")
    sp.add_argument("name", help=f"one of: {', '.join(schema_names())}")
    sp.set_defaults(fn=cmd_schema, json=True)

    def model_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--model", required=True,
                        help="workload name (qsync-opt models) or path/file.py:fn (that file "
                             "is run: it is imported and fn() called)")
        sp.add_argument("--batch", type=BATCH, default=None, help="per-device batch to trace at")
        sp.add_argument("--unpin-head", action="store_true",
                        help="let the classifier head's precision be chosen")
        sp.add_argument("--tie", choices=TIE_MODES, default="none", help="tie groups")
        sp.add_argument("--tracer", choices=TRACERS, default="auto", help=TRACER_HELP)

    sp = add("graph", "trace a workload into a ModelGraph")
    model_args(sp)
    sp.add_argument("--out", help="write the ModelGraph JSON here")
    sp.add_argument("--ops", action="store_true", help="print every op")
    sp.set_defaults(fn=cmd_graph)
    sp = add("estimate", "roofline cost estimates of a workload on a cluster")
    model_args(sp)
    sp.add_argument("--cluster", required=True, help=f"cluster file (.toml/.json) or {SHORTHAND_HELP}")
    sp.add_argument("--int4", action="store_true", help=INT4_FLAG_HELP)
    sp.add_argument("--out", help="write the CostTable JSON here")
    sp.set_defaults(fn=cmd_estimate)
    sp = add("replay", "simulate one iteration of a plan (default: the uniform plans)")
    model_args(sp)
    sp.add_argument("--cluster", help=f"cluster file or {SHORTHAND_HELP} (default: the plan's)")
    sp.add_argument("--int4", action="store_true", help=INT4_FLAG_HELP)
    sp.add_argument("--plan", help="Plan JSON to replay")
    sp.add_argument("--trace", help="write a Chrome/Perfetto trace JSON here")
    sp.add_argument("--optimizer", choices=["sgd", "adam"], default=None,
                    help="the optimizer step's time (default sgd)")
    sp.add_argument("--bucket-mb", type=finite_float(0, 2**20, lo_open=True), default=None,
                    help="DDP bucket cap in MiB")
    sp.add_argument("--write-plans", metavar="DIR", help="write the uniform plans as Plan JSON")
    add_sync_args(sp)
    sp.add_argument("--comm-model", default=None, metavar="MODEL",
                    help=f"bucket all-reduce times: {COMM_MODEL_HELP}")
    g = sp.add_argument_group("pipeline", "predict a pipeline of stages with compressed "
                              "point-to-point boundaries instead of data parallelism")
    g.add_argument("--pipeline-stages", type=int_range(2, 64), default=None, metavar="N")
    g.add_argument("--rank-groups", default=None, metavar="R:GROUP,...",
                   help="the group of each stage (default: the cluster's devices in order)")
    g.add_argument("--cuts", default=None, metavar="OP,...",
                   help="where stages 2..N begin (default: balanced on each stage's time)")
    g.add_argument("--micro-batches", type=positive_int(MAX_BATCH), default=None, metavar="M")
    g.add_argument("--compress-act", type=COMPRESSOR_TEXT, default=None, metavar="C",
                   help="none, topk:F (or N%%), quant:B[,stochastic]")
    g.add_argument("--compress-grad", type=COMPRESSOR_TEXT, default=None, metavar="C")
    g.add_argument("--link-gbps", type=GBPS_TEXT, default=None, metavar="G,...",
                   help="link bandwidths between stages, Gb/s (default 1,10)")
    g.add_argument("--latency-us", type=finite_float(0, 1e7), default=None,
                   help="one-way link latency (default 50 us)")
    sp.set_defaults(fn=cmd_replay)
    sp = sub.add_parser("netsim", help="simulate an iteration's gradient traffic packet by packet",
                        description="simulate an iteration's gradient traffic packet by packet")
    sp.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                    help="write the summary JSON to FILE (stdout without FILE)")
    model_args(sp)
    sp.add_argument("--cluster", required=True, help=f"cluster file or {SHORTHAND_HELP}")
    sp.add_argument("--plan", help="Plan JSON whose compute timeline emits the buckets "
                    "(default: every group at its highest precision)")
    sp.add_argument("--scenario", choices=list(NETSIM_SCENARIOS), default="ring")
    sp.add_argument("--pattern", choices=["ring", "ps", "hierarchical"], default=None,
                    help="the collective (default: the scenario's)")
    sp.add_argument("--policy", choices=list(NETSIM_POLICIES), default="fifo+tcp")
    sp.add_argument("--routing", choices=["hash", "spray"], default="hash")
    sp.add_argument("--p", type=finite_float(0, 0.5), default=0.05,
                    help=f"{' and '.join(BOUNDED_POLICIES)}: the loss bound per message "
                         "(default 0.05)")
    sp.add_argument("--iterations", type=positive_int(100_000), default=100)
    sp.add_argument("--cell-kib", type=positive_int(1 << 20), default=256,
                    help="packet (cell) payload in KiB (default 256: larger cells, fewer events)")
    sp.add_argument("--buffer-kib", type=positive_int(1 << 30), default=4096,
                    help="switch port buffer in KiB (default 4096)")
    sp.add_argument("--jitter", type=finite_float(0, 1), default=0.01,
                    help="relative noise of each rank's ready times per iteration")
    sp.add_argument("--min-rto-ms", type=finite_float(0, 1e5, lo_open=True), default=200.0,
                    help="the least retransmission timeout (default 200: Linux's TCP_RTO_MIN)")
    sp.add_argument("--detect", choices=["rack", "dupthresh"], default="rack",
                    help="loss detection: rack (time-based, tolerates reordering; default) or "
                         "dupthresh (3 later packets acked: ns-3's, takes reordering for loss)")
    sp.add_argument("--seed", type=SEED, default=0)
    sp.add_argument("--max-events", type=positive_int(10**9), default=5_000_000)
    sp.add_argument("--png", help="draw the busiest links' load over time (first iteration)")
    sp.set_defaults(fn=cmd_netsim)
    sp = add("indicate", "measure each op's sensitivity to each precision")
    sp.add_argument("--model", required=True,
                    help="workload name (qsync-opt models) or path/file.py:fn (that file is "
                         "run; its data() and loss() are used where it has them)")
    sp.add_argument("--method", default=METHODS[0],
                    choices=METHODS)
    sp.add_argument("--batches", type=BATCHES, default=10, help="batches to average over")
    sp.add_argument("--batch", type=BATCH, default=None, help="batch size (default: workload's)")
    sp.add_argument("--seed", type=SEED, default=0)
    sp.add_argument("--gamma", type=finite_float(0, 1e6), default=4.0, help="forward weight (qsync)")
    sp.add_argument("--top", type=positive_int(100_000), default=5, help="rows in each table")
    sp.add_argument("--no-cache", action="store_true", help="recompute even if cached")
    sp.add_argument("--fast", action="store_true",
                    help="qsync: propagate variances in bf16 for 2 samples per batch (large "
                         "models; scales still from whole batches)")
    sp.add_argument("--out", help="write the IndicatorTable JSON here")
    sp.set_defaults(fn=cmd_indicate)
    def problem_args(sp: argparse.ArgumentParser) -> None:
        model_args(sp)
        sp.add_argument("--cluster", required=True, help=f"cluster file or {SHORTHAND_HELP}")
        sp.add_argument("--int4", action="store_true", help=INT4_FLAG_HELP)
        sp.add_argument("--indicator", help="IndicatorTable JSON (default: computed and cached)")
        sp.add_argument("--method", default=METHODS[0],
                        choices=METHODS,
                        help="indicator method when it is computed")
        sp.add_argument("--indicator-batches", type=BATCHES, default=10,
                        help="batches the computed indicator averages over")
        sp.add_argument("--indicator-batch", type=BATCH, default=None,
                        help="batch the computed indicator runs at (default: the traced "
                             "batch, at most 8)")
        sp.add_argument("--costs", help="CostTable JSON (default: roofline estimates)")
        sp.add_argument("--target-ms", type=finite_float(0, 1e12, lo_open=True), default=None,
                        help="makespan target (default: strong groups at their reference)")
        sp.add_argument("--headroom", type=FRACTION, default=0.0,
                        help="fraction of each card's memory kept free")
        sp.add_argument("--reference", default="fp32", help="strong groups' reference precision")
        sp.add_argument("--lower-reference", action="store_true",
                        help="let the solver lower the strong groups below their reference "
                             "(default: held there, unless the target needs them faster or "
                             "their reference plan does not fit memory)")
        sp.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
        sp.add_argument("--pin", action="append", metavar="OP=PRECISION",
                        help="fix an op's precision on every group (repeatable)")
        sp.add_argument("--time-limit", type=POSITIVE_SECONDS, default=None,
                        help="seconds for the whole solve: every round, fallback and "
                             "diagnosis (default 60)")
        sp.add_argument("--threads", type=int_range(0, 1024), default=0,
                        help="solver threads (0: default)")
        sp.add_argument("--seed", type=SEED, default=0)
        sp.add_argument("--gap", type=finite_float(0, 1), default=1e-6,
                        help="relative optimality gap")
        sp.add_argument("--warm-start", choices=["greedy"], default=None,
                        help="hint the exact solvers with greedy's plan")
        sp.add_argument("--acceptance", choices=["replayer", "linear"], default="replayer",
                        help="greedy's move check")
        sp.add_argument("--refine", type=int_range(0, 100), default=3,
                        help="solve-replay refinement rounds for the exact solvers")
        sp.add_argument("--batch-multiple", type=BATCH, default=None,
                        help="joint split: per-device batches are multiples of this")
        add_sync_args(sp)
        sp.add_argument("--comm-model", default=None, metavar="MODEL",
                        help=f"bucket all-reduce times: {COMM_MODEL_HELP}")

    sp = add("solve", "choose every op's precision on every group")
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
    sp.set_defaults(fn=cmd_solve)
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
    sp.set_defaults(fn=cmd_compare)
    from .sweep import add_sweep_parser
    from .profile import add_profile_parser
    from .report import add_report_parser
    from .train import add_train_parser

    add_report_parser(sub)
    add_train_parser(sub)
    add_sweep_parser(sub)
    add_profile_parser(sub)
    sp = add("pareto", "degradation against throughput as the makespan target sweeps")
    problem_args(sp)
    sp.add_argument("--out", required=True, help="write the frontier's points (JSON) here")
    sp.add_argument("--png", help="also plot it here")
    sp.add_argument("--points", type=int_range(2, 1000), default=8, help="targets swept")
    sp.add_argument("--exact", default="highs", help="exact backend (highs, cbc, cpsat)")
    sp.add_argument("--no-split", action="store_true",
                    help="leave out the joint batch split series (faster)")
    sp.set_defaults(fn=cmd_pareto)
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
    return p


def _error(message: str) -> int:
    """The CLI's one error line: control characters in ``message`` shown escaped."""
    sys.stderr.write(f"qsync-opt: error: {one_line(str(message))}\n")
    return EXIT_BAD_INPUT


def _fail_writes_with_efbig() -> None:
    """A write past the file-size limit (RLIMIT_FSIZE) kills the process with SIGXFSZ by
    default, mid-write; ignored, the write fails with EFBIG and the atomic writer reports it
    in one line, the file that was there unchanged."""
    sigxfsz = getattr(signal, "SIGXFSZ", None)
    if sigxfsz is not None and threading.current_thread() is threading.main_thread():
        signal.signal(sigxfsz, signal.SIG_IGN)


#: The output files each command may be told to write, by flag (a link there is written
#: through, as named); ``--out`` of train, sweep and demo names a folder, which the command
#: checks itself, and replay's ``--write-plans`` a folder.
OUTPUT_FILES: dict[str, tuple[str, ...]] = {
    "graph": ("out",), "estimate": ("out",), "indicate": ("out",), "replay": ("trace",),
    "netsim": ("json", "png"), "solve": ("out", "report"), "compare": ("json",),
    "report": ("png",), "sweep": ("json",), "profile": ("out",), "pareto": ("out", "png")}
OUTPUT_FOLDERS: dict[str, tuple[str, ...]] = {"replay": ("write_plans",)}


def check_outputs(args: argparse.Namespace) -> None:
    """Before a command works: every output file it was told to write must be writable (not
    a folder, not through a file, in a folder it may write), every output folder one it can
    write into or make; refused in one line naming the flag, so no work is thrown away."""
    from ..io import check_output_file
    from ..outfolder import check_folder

    command = getattr(args, "command", None) or ""
    for dest in OUTPUT_FILES.get(command, ()):
        val = getattr(args, dest, None)
        if isinstance(val, str) and val != "-":
            check_output_file(val, "--" + dest.replace("_", "-"))
    for dest in OUTPUT_FOLDERS.get(command, ()):
        val = getattr(args, dest, None)
        if isinstance(val, str):
            check_folder(val, "--" + dest.replace("_", "-"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    # parsers of other modules (profile, train) may type these plain int: checked here too
    batch = getattr(args, "batch", None)
    if isinstance(batch, int) and not 1 <= batch <= MAX_BATCH:
        parser.error(f"argument --batch: expected a positive integer (at most {MAX_BATCH}), "
                     f"got {batch}")
    batches = getattr(args, "batches", None)
    if isinstance(batches, int) and batches < 1:
        parser.error(f"argument --batches: expected a positive integer, got {batches}")
    _fail_writes_with_efbig()
    from ..solve import InfeasibleError, SolveTimeLimit
    from ..solvers.fastest import FastestTimeLimit

    try:
        check_outputs(args)
        return int(args.fn(args))
    except InfeasibleError as exc:  # what would make it feasible, one finding per line
        _error(exc.head)
        for line in exc.lines:
            sys.stderr.write(f"  {one_line(str(line))}\n")
        return EXIT_INFEASIBLE
    except (SolveTimeLimit, FastestTimeLimit) as exc:
        _error(str(exc))
        return EXIT_TIME_LIMIT
    except QsyncInputError as exc:
        return _error(str(exc))
    except ValidationError as exc:
        return _error(describe_validation_error(exc))
    except BrokenPipeError:
        return 0
    except OSError as exc:  # a file no writer labelled: still one line, never a traceback
        where = f"{exc.filename}: " if exc.filename is not None else ""
        return _error(f"{where}{exc.strerror or exc.__class__.__name__}")
