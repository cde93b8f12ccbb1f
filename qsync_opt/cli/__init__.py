"""The ``qsync-opt`` command line.

Tables for people, ``--json`` for programs. Bad input exits with code 2 (a proven infeasible
problem 3, no plan within the time limit 4: :data:`EXIT_CODES_HELP`) and one line on
stderr naming the field and what was expected (control characters in it escaped); every
numeric flag is checked by its argparse type (finite, in its range); files are written
atomically, and a write that fails (read-only folder, full disk, file-size limit, a folder
in the way) is one line naming the flag, exit 2, the file that was there unchanged.

The package, by family of commands: :mod:`.info` (devices, schema) and :mod:`.workloads`
(models), :mod:`.model` (graph, estimate, replay, indicate), :mod:`.planning` (solve,
compare, pareto), and one module each for :mod:`.netsim`, :mod:`.report`, :mod:`.train`,
:mod:`.sweep`, :mod:`.profile` and :mod:`.demo`: each is the commands' bodies, and imports
what they need at its top. Their parsers (``add_<command>_parser``) are
:mod:`qsync_opt.cli.parsers`, one module per family, each naming its bodies by module
(:class:`~qsync_opt.cli.args.Deferred`), so building the parser imports no body: neither
torch nor the solve pipeline. :mod:`.args` holds the flag types, the shared arguments and
the exit codes. :func:`build_parser` runs every registration in :data:`COMMANDS`' order, and
:func:`main` (the entry point ``qsync_opt.cli:main``) is here; the text the commands print is
:mod:`qsync_opt.cli.summaries`. The library builds no parser: a command's module calls library
functions of plain values.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from pydantic import ValidationError

from qsync_opt.cli.args import (
    BATCH,
    BATCHES,
    EXIT_BAD_INPUT,
    EXIT_CODES_HELP,
    EXIT_INFEASIBLE,
    EXIT_TIME_LIMIT,
    FRACTION,
    POSITIVE_SECONDS,
    SEED,
    finite_float,
    int_range,
    positive_int,
)
from qsync_opt.cli.parsers.demo import add_demo_parser
from qsync_opt.cli.parsers.info import add_devices_parser, add_models_parser, add_schema_parser
from qsync_opt.cli.parsers.model import (
    add_estimate_parser,
    add_graph_parser,
    add_indicate_parser,
    add_replay_parser,
)
from qsync_opt.cli.parsers.netsim import add_netsim_parser
from qsync_opt.cli.parsers.planning import add_compare_parser, add_pareto_parser, add_solve_parser
from qsync_opt.cli.parsers.profile import add_profile_parser
from qsync_opt.cli.parsers.report import add_report_parser
from qsync_opt.cli.parsers.sweep import add_sweep_parser
from qsync_opt.cli.parsers.train import add_train_parser
from qsync_opt.cli.summaries import (
    REPLAY_HEADER,
    GiB,
    estimate_summary_lines,
    graph_summary_lines,
    plan_lines,
    replay_rows,
    uniform_plans,
)
from qsync_opt.core.errors import QsyncInputError, describe_validation_error, one_line
from qsync_opt.core.lazy import lazy_getattr
from qsync_opt.core.version import __version__
from qsync_opt.documents.io import check_output_file
from qsync_opt.documents.outfolder import check_folder
from qsync_opt.documents.schemas import MAX_BATCH
from qsync_opt.planner.errors import InfeasibleError, SolveTimeLimit
from qsync_opt.solvers.errors import FastestTimeLimit

if TYPE_CHECKING:
    from qsync_opt.cli.demo import cmd_demo
    from qsync_opt.cli.info import cmd_devices, cmd_schema
    from qsync_opt.cli.model import cmd_estimate, cmd_graph, cmd_indicate, cmd_replay
    from qsync_opt.cli.netsim import cmd_netsim
    from qsync_opt.cli.planning import cmd_compare, cmd_pareto, cmd_solve
    from qsync_opt.cli.workloads import cmd_models

#: The commands' bodies re-exported here -> their modules, imported when first read (a body
#: may import the solve pipeline or torch; importing the command line must not).
_LAZY = {
    "cmd_compare": "planning", "cmd_pareto": "planning", "cmd_solve": "planning",
    "cmd_demo": "demo", "cmd_devices": "info", "cmd_schema": "info", "cmd_models": "workloads",
    "cmd_estimate": "model", "cmd_graph": "model", "cmd_indicate": "model", "cmd_replay": "model",
    "cmd_netsim": "netsim",
}

__all__ = [
    "BATCH", "BATCHES", "COMMANDS", "EXIT_BAD_INPUT", "EXIT_CODES_HELP", "EXIT_INFEASIBLE",
    "EXIT_TIME_LIMIT", "FRACTION", "POSITIVE_SECONDS", "REPLAY_HEADER", "SEED", "GiB",
    "build_parser", "cmd_compare", "cmd_demo", "cmd_devices", "cmd_estimate", "cmd_graph",
    "cmd_indicate", "cmd_models", "cmd_netsim", "cmd_pareto", "cmd_replay", "cmd_schema", "cmd_solve",
    "estimate_summary_lines", "finite_float", "graph_summary_lines", "int_range", "main",
    "plan_lines", "positive_int", "replay_rows", "uniform_plans",
]


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line with exit code 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {one_line(message)}\n")
        raise SystemExit(EXIT_BAD_INPUT)


#: Every command's parser, in the order ``qsync-opt --help`` lists them; each family's
#: parser module registers its own (flags, help, default ``fn``: the body, deferred).
COMMANDS: tuple[Callable[[Any], argparse.ArgumentParser], ...] = (
    add_models_parser, add_devices_parser, add_schema_parser, add_graph_parser,
    add_estimate_parser, add_replay_parser, add_netsim_parser, add_indicate_parser,
    add_solve_parser, add_compare_parser, add_report_parser, add_train_parser,
    add_sweep_parser, add_profile_parser, add_pareto_parser, add_demo_parser)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="qsync-opt", description="Precision plans for mixed GPU clusters.",
               epilog=EXIT_CODES_HELP)
    p.add_argument("--version", action="version", version=f"qsync-opt {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for register in COMMANDS:
        register(sub)
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
    "netsim": ("json", "png"), "solve": ("out", "report", "png"), "compare": ("json",),
    "report": ("png",), "sweep": ("json",), "profile": ("out",), "pareto": ("out", "png")}
OUTPUT_FOLDERS: dict[str, tuple[str, ...]] = {"replay": ("write_plans",)}


def check_outputs(args: argparse.Namespace) -> None:
    """Before a command works: every output file it was told to write must be writable (not
    a folder, not through a file, in a folder it may write), every output folder one it can
    write into or make; refused in one line naming the flag, so no work is thrown away."""
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


#: the commands' bodies above, each imported when first read
__getattr__ = lazy_getattr(__name__, globals(), _LAZY)
