"""The CLI's argument types (every numeric flag checked: ASCII digits, finite, in
its stated range, :mod:`qsync_opt.core.limits`; a bad value is one line, exit 2, before any work), JSON output, and ``--model`` traced."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.limits import (
    MAX_STEPS,
    finite_float,
    int_range,
    parse_float,
    positive_int,
    spec_type,
)
from qsync_opt.core.modelspec import is_user_model
from qsync_opt.costs.cluster import SHORTHAND_HELP, load_cluster
from qsync_opt.costs.devices import INT4_CARDS, enable_int4
from qsync_opt.documents.schemas import MAX_BATCH, ClusterSpec, ModelGraph
from qsync_opt.graph import TIE_MODES, trace
from qsync_opt.indicator import METHODS
from qsync_opt.netsim.cluster import COMM_MODEL_HELP
from qsync_opt.replayer import sync_model_for
from qsync_opt.strategy.compressor_text import parse_compressor_text
from qsync_opt.strategy.modes import parse_sync
from qsync_opt.strategy.schedule import SCHEDULE_SYNTAX, parse_schedule

BATCH = positive_int(MAX_BATCH)


BATCHES = positive_int(100_000)


SEED = int_range(0, 2**31 - 1)  # CP-SAT's random_seed is an int32


POSITIVE_SECONDS = finite_float(0, 1e7, lo_open=True,
                                expected="a positive finite number of seconds (at most 1e7)")


FRACTION = finite_float(0, 1, hi_open=True, expected="a fraction from 0 up to (not including) 1")


@dataclass(frozen=True)
class Deferred:
    """A command's body named by its module and function: a parser registers it as its
    default ``fn`` without importing the module (which may import the solve pipeline or
    torch), so building the parser (``qsync-opt --help``) stays light; called, it imports the
    module and runs the function the module holds at that moment."""

    module: str
    name: str

    def resolve(self) -> Callable[[argparse.Namespace], int]:
        """The function itself (its module imported)."""
        fn: Callable[[argparse.Namespace], int] = getattr(
            importlib.import_module(self.module), self.name)
        return fn

    def __call__(self, args: argparse.Namespace) -> int:
        return self.resolve()(args)


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def workload_arg(args: argparse.Namespace, model_sha256: str | None = None) -> Any:
    """``--model``: a registry name as it is, a ``PATH.py:FUNCTION`` file loaded (it is run:
    the user named it; with ``model_sha256`` it must have that content hash first)."""
    if is_user_model(args.model):
        # lazy: loading a model file imports torch; a built-in's name stays a string
        from qsync_opt.models.resolve import load_user_workload

        return load_user_workload(args.model, sha256=model_sha256)
    return args.model


#: ``--tracer``: :func:`qsync_opt.graph.trace`'s methods.
TRACERS = ("auto", "fx", "function_mode")
TRACER_HELP = ("how the model is traced: auto (torch.fx, and the function-mode tracer where fx "
               "fails or keeps a Python function that runs GEMMs or reads parameters as one "
               "opaque op, as torchvision's Swin attention; default), fx, or function_mode")


def trace_args(args: argparse.Namespace, model_sha256: str | None = None,
                workload: Any = None) -> ModelGraph:
    """The graph of ``--model`` (see :func:`workload_arg`), at ``--batch``: a user's file at
    its example's batch by default, at another on synthetic inputs shaped like them;
    ``--tracer`` picks the tracer. A built-in's graph comes from the graph cache once traced
    (:mod:`qsync_opt.graph.cache`)."""
    wl = workload if workload is not None else workload_arg(args, model_sha256)
    return trace(wl, args.batch, pin_head=not args.unpin_head, tie=args.tie,
                 method=getattr(args, "tracer", "auto"), cache=True)


INT4_FLAG_HELP = ("add int4 (opt-in) to the menu of every group whose card has an INT4 peak "
                  "(t4, a10, or a cpu/F~CARD standing in for one); the same as writing "
                  "DEVICE:int4 for those groups")


def cluster_arg(args: argparse.Namespace, text: Any = None) -> ClusterSpec:
    """``--cluster`` (or ``text``) loaded, and with ``--int4`` int4 enabled on every group
    whose card has an INT4 peak (:func:`qsync_opt.costs.devices.enable_int4`). Says on stderr which
    groups got it; refuses (one line, exit 2) when none can."""
    cluster = load_cluster(args.cluster if text is None else text)
    if not getattr(args, "int4", False):
        return cluster
    cluster, got = enable_int4(cluster)
    if not got:
        raise QsyncInputError(
            "int4: no group's card has an INT4 peak (cards with one: "
            f"{', '.join(INT4_CARDS)}; a derived CPU takes its ~CARD's)")
    rest = [g.name for g in cluster.groups if g.name not in got]
    note = (f"int4: enabled on group(s) {', '.join(got)}"
            + (f"; not on {', '.join(rest)} (no INT4 peak)" if rest else ""))
    held = getattr(args, "held_notes", None)
    if held is not None:  # said once the command succeeds (a refusal stays one line)
        held.append(note)
    else:
        sys.stderr.write(note + "\n")
    return cluster


def notes_after_success(fn: Callable[[argparse.Namespace], int]
                        ) -> Callable[[argparse.Namespace], int]:
    """A command whose notes on stderr (``--int4``'s) are written after it returns, and not
    at all when it raises: a refusal is its one line, never a note and then the line."""

    def run(args: argparse.Namespace) -> int:
        args.held_notes = []
        rc = fn(args)
        for note in args.held_notes:
            sys.stderr.write(note + "\n")
        return rc

    run.__name__, run.__doc__ = fn.__name__, fn.__doc__
    return run


SYNC_FLAG_HELP = ("the runtime's sync mode the times are for: ddp (gradients all-reduced every "
                  "step, default), local:H or qsr:alpha=A,h_base=H0[,power=P] (parameters "
                  "averaged once per round: communication paid once per round, the per-step "
                  "time averaged over the round; QSR's rounds from --lr, --lr-schedule and "
                  "--steps)")


def _check_schedule_text(text: str) -> None:
    """``--lr-schedule`` on its own: kind, keys and values (warm-up against ``--steps``
    when both are known, :func:`sync_arg`)."""
    parse_schedule(text, 1.0, MAX_STEPS)


def _check_sync_text(text: str) -> None:
    parse_sync(text)


def _check_gbps_text(text: str) -> None:
    parts = str(text).split(",")
    vals = [parse_float(x) for x in parts]
    if not parts or len(parts) > 64 or not all(v is not None and 0 < v < 1e6 for v in vals):
        raise QsyncInputError(f"link_gbps: expected up to 64 positive numbers below 1e6 "
                              f"(Gb/s) separated by commas, got {text!r}")


#: ``--compress-act`` / ``--compress-grad``: the compressor's text checked when parsed.
COMPRESSOR_TEXT = spec_type(parse_compressor_text)
#: ``--link-gbps``: bandwidths, Gb/s, checked when parsed.
GBPS_TEXT = spec_type(_check_gbps_text, "link_gbps")
#: ``--sync``'s type: the mode's text checked when the command line is parsed.
SYNC_TEXT = spec_type(_check_sync_text, "sync")
#: ``--lr-schedule``'s type: kind, keys and values checked when parsed.
SCHEDULE_TEXT = spec_type(_check_schedule_text, "lr_schedule")
#: A learning rate: finite, > 0.
LEARNING_RATE = finite_float(0, 1e6, lo_open=True)
#: A run's optimizer steps (:data:`qsync_opt.core.limits.MAX_STEPS`).
STEPS = positive_int(MAX_STEPS)
#: The defaults of ``--lr``, ``--lr-schedule`` and ``--steps`` under ``--sync``.
SYNC_DEFAULTS: dict[str, Any] = {"lr": 0.05, "lr_schedule": "constant", "steps": 100}


def add_sync_args(sp: argparse.ArgumentParser) -> None:
    """``--sync`` and, for QSR's rounds, the run's ``--lr``, ``--lr-schedule``, ``--steps``
    (only with ``--sync``: given without it, refused by :func:`sync_arg`)."""
    sp.add_argument("--sync", type=SYNC_TEXT, default=None, metavar="MODE", help=SYNC_FLAG_HELP)
    sp.add_argument("--lr", type=LEARNING_RATE, default=None,
                    help="with --sync qsr: the run's base learning rate (default 0.05)")
    sp.add_argument("--lr-schedule", type=SCHEDULE_TEXT, default=None, metavar="SCHEDULE",
                    help=f"with --sync qsr: the run's schedule, {SCHEDULE_SYNTAX} (default "
                         "constant)")
    sp.add_argument("--steps", type=STEPS, default=None,
                    help="with --sync qsr/local: the run's steps (default 100)")


def sync_arg(args: argparse.Namespace) -> Any:
    """The replayer's sync model of ``--sync`` (None: DDP's); bad text, or ``--lr``,
    ``--lr-schedule`` or ``--steps`` without ``--sync``: one line naming the flag. Cheap
    (the rounds are counted, not listed): call it before any work."""
    text = getattr(args, "sync", None)
    given = {k: getattr(args, k, None) for k in SYNC_DEFAULTS}
    kind = "ddp" if text is None else parse_sync(text).kind  # the text checked when parsed
    extra = [k for k, v in given.items() if v is not None]
    if kind == "ddp":
        if extra and not getattr(args, "allow", None):  # accepted and ignored is refused
            raise QsyncInputError(f"--{extra[0].replace('_', '-')}: only with --sync local:H "
                                  "or qsr:... (the run whose rounds are paid); --sync is "
                                  + ("ddp" if text is None else text.strip()))
        return None
    vals: dict[str, Any] = {k: SYNC_DEFAULTS[k] if v is None else v for k, v in given.items()}
    try:
        return sync_model_for(text, **vals)
    except QsyncInputError as exc:
        field, _, msg = str(exc).partition(": ")
        flag = {"sync": "--sync", "lr_schedule": "--lr-schedule", "steps": "--steps",
                "lr": "--lr"}.get(field, field)
        raise QsyncInputError(f"{flag}: {msg}") from None


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


def command(sub: Any, name: str, help_: str) -> argparse.ArgumentParser:
    """A command's parser with the common ``--json`` flag (the planning commands' help ends
    with the exit codes)."""
    sp: argparse.ArgumentParser = sub.add_parser(
        name, help=help_, description=help_, epilog=EXIT_CODES_HELP if name in PLANNING else None)
    sp.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    return sp


def model_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--model", required=True,
                    help="workload name (qsync-opt models) or path/file.py:fn (that file "
                         "is run: it is imported and fn() called)")
    sp.add_argument("--batch", type=BATCH, default=None, help="per-device batch to trace at")
    sp.add_argument("--unpin-head", action="store_true",
                    help="let the classifier head's precision be chosen")
    sp.add_argument("--tie", choices=TIE_MODES, default="none", help="tie groups")
    sp.add_argument("--tracer", choices=TRACERS, default="auto", help=TRACER_HELP)


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
