"""The CLI's argument types (every numeric flag checked: finite, in its range; a bad
value is one line, exit 2, before any work), JSON output, and ``--model`` traced."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from typing import Any

from ..graph import is_user_model, load_user_workload, trace
from ..runtime.schedule import SCHEDULE_SYNTAX
from ..schemas import MAX_BATCH, ClusterSpec, ModelGraph


def _flag_type(name: str, parse: Callable[[str], Any], ok: Callable[[Any], bool],
               expected: str) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except (ValueError, OverflowError):
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    convert.__name__ = name
    return convert


def int_range(lo: int, hi: int, expected: str | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi]."""
    return _flag_type("int", int, lambda v: lo <= v <= hi,
                      expected or f"an integer from {lo} to {hi}")


def positive_int(hi: int) -> Callable[[str], int]:
    """An argparse type: an integer in [1, hi]."""
    return int_range(1, hi, f"a positive integer (at most {hi})")


def finite_float(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
                 hi_open: bool = False, expected: str | None = None) -> Callable[[str], float]:
    """An argparse type: a finite float (never inf or nan) in the given range."""

    def ok(v: float) -> bool:
        return (math.isfinite(v)
                and (lo is None or (v > lo if lo_open else v >= lo))
                and (hi is None or (v < hi if hi_open else v <= hi)))

    def shown(x: float) -> str:
        return str(int(x)) if float(x).is_integer() else repr(x)

    if expected is None:
        left = "" if lo is None else f"{'>' if lo_open else '>='} {shown(lo)}"
        right = "" if hi is None else f"{'<' if hi_open else '<='} {shown(hi)}"
        expected = "a finite number" + (f" {left}" if left else "") + (
            f"{' and' if left else ''} {right}" if right else "")
    return _flag_type("float", float, ok, expected)


BATCH = positive_int(MAX_BATCH)


BATCHES = positive_int(100_000)


SEED = int_range(0, 2**31 - 1)  # CP-SAT's random_seed is an int32


POSITIVE_SECONDS = finite_float(0, 1e7, lo_open=True,
                                expected="a positive finite number of seconds (at most 1e7)")


FRACTION = finite_float(0, 1, hi_open=True, expected="a fraction from 0 up to (not including) 1")


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def workload_arg(args: argparse.Namespace, model_sha256: str | None = None) -> Any:
    """``--model``: a registry name as it is, a ``PATH.py:FUNCTION`` file loaded (it is run:
    the user named it; with ``model_sha256`` it must have that content hash first)."""
    if is_user_model(args.model):
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
    ``--tracer`` picks the tracer."""
    wl = workload if workload is not None else workload_arg(args, model_sha256)
    return trace(wl, args.batch, pin_head=not args.unpin_head, tie=args.tie,
                 method=getattr(args, "tracer", "auto"))


INT4_FLAG_HELP = ("add int4 (opt-in) to the menu of every group whose card has an INT4 peak "
                  "(t4, a10, or a cpu/F~CARD standing in for one); the same as writing "
                  "DEVICE:int4 for those groups")


def cluster_arg(args: argparse.Namespace, text: Any = None) -> ClusterSpec:
    """``--cluster`` (or ``text``) loaded, and with ``--int4`` int4 enabled on every group
    whose card has an INT4 peak (:func:`qsync_opt.devices.enable_int4`). Says on stderr which
    groups got it; refuses (one line, exit 2) when none can."""
    from ..cluster import load_cluster
    from ..devices import INT4_CARDS, enable_int4
    from ..errors import QsyncInputError

    cluster = load_cluster(args.cluster if text is None else text)
    if not getattr(args, "int4", False):
        return cluster
    cluster, got = enable_int4(cluster)
    if not got:
        raise QsyncInputError(
            "int4: no group's card has an INT4 peak (cards with one: "
            f"{', '.join(INT4_CARDS)}; a derived CPU takes its ~CARD's)")
    rest = [g.name for g in cluster.groups if g.name not in got]
    sys.stderr.write(f"int4: enabled on group(s) {', '.join(got)}"
                     + (f"; not on {', '.join(rest)} (no INT4 peak)" if rest else "") + "\n")
    return cluster


SYNC_FLAG_HELP = ("the runtime's sync mode the times are for: ddp (gradients all-reduced every "
                  "step, default), local:H or qsr:alpha=A,h_base=H0[,power=P] (parameters "
                  "averaged once per round: communication paid once per round, the per-step "
                  "time averaged over the round; QSR's rounds from --lr, --lr-schedule and "
                  "--steps)")


def add_sync_args(sp: argparse.ArgumentParser) -> None:
    """``--sync`` and, for QSR's rounds, the run's ``--lr``, ``--lr-schedule``, ``--steps``."""
    sp.add_argument("--sync", default=None, metavar="MODE", help=SYNC_FLAG_HELP)
    sp.add_argument("--lr", type=float, default=0.05,
                    help="with --sync qsr: the run's base learning rate (default 0.05)")
    sp.add_argument("--lr-schedule", default="constant", metavar="SCHEDULE",
                    help=f"with --sync qsr: the run's schedule, {SCHEDULE_SYNTAX} (default "
                         "constant)")
    sp.add_argument("--steps", type=int, default=100,
                    help="with --sync qsr/local: the run's steps (default 100)")


def sync_arg(args: argparse.Namespace) -> Any:
    """The replayer's sync model of ``--sync`` (None: DDP's); bad text: one line naming the
    flag."""
    from ..errors import QsyncInputError
    from ..replayer import sync_model_for

    text = getattr(args, "sync", None)
    if text is None:
        return None
    if not (isinstance(args.steps, int) and args.steps >= 1):
        raise QsyncInputError(f"--steps: expected an integer >= 1, got {args.steps}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise QsyncInputError(f"--lr: expected a finite number > 0, got {args.lr}")
    try:
        return sync_model_for(text, lr=args.lr, lr_schedule=args.lr_schedule, steps=args.steps)
    except QsyncInputError as exc:
        field, _, msg = str(exc).partition(": ")
        flag = {"sync": "--sync", "lr_schedule": "--lr-schedule"}.get(field, field)
        raise QsyncInputError(f"{flag}: {msg}") from None
