"""Stated limits on every count a user gives, and numbers read strictly from text.

A count beyond its limit is a typo or an attack, not a run: ``--steps 1000000000000`` made
the replayer enumerate a trillion rounds, ``--seeds 99999999999999999999999`` overflowed
torch's ``manual_seed``. Every integer flag of every command has a stated bound, checked by
its argparse type (:func:`int_range`) when the command line is parsed, before any work.

Numbers are read strictly: ASCII digits only (Python's ``int`` and ``float`` also take
``'٣'``, ``'３'`` and ``'1_000'``; ``str.isdigit`` takes ``'²'``, which ``int`` then
refuses with a traceback), integers without a fraction, floats finite. :func:`parse_int`
and :func:`parse_float` are the one reader for flags and for the options inside a spec
(``local:H``, ``quant:B``, ``step:every=N``...).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import Any

from qsync_opt.core.errors import QsyncInputError

__all__ = ["MAX_EVAL_BATCHES", "MAX_STEPS", "finite_float", "int_range", "parse_float",
           "parse_int", "positive_int", "spec_type"]

#: Optimizer steps of a run (and every step-valued flag: checkpoint period, rounds, warm-up).
#: A billion steps is 11 days at 1 ms a step; a bound the replayer's round count relies on.
MAX_STEPS = 1_000_000_000
#: Held-out batches scored at the end of a run.
MAX_EVAL_BATCHES = 100_000
#: The longest number text read (digits and signs): beyond it, no count of this package.
_MAX_DIGITS = 40
#: The spaces allowed around a number: ASCII only (str.strip() would also take "\x1f",
#: "\xa0" or "\u2003").
_SPACES = " \t\n\r\f\v"

_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def parse_int(text: Any) -> int | None:
    """``text`` as an integer written in ASCII digits (an optional sign, spaces around),
    else None: never ``'٣'``, ``'²'``, ``'1_000'``, ``'1.0'`` or 5,000 digits."""
    if isinstance(text, bool):
        return None
    if isinstance(text, int):
        return text
    s = str(text).strip(_SPACES)
    if len(s) > _MAX_DIGITS or not _INT.fullmatch(s):
        return None
    return int(s)


def parse_float(text: Any) -> float | None:
    """``text`` as a finite float written in ASCII (``1``, ``-2.5``, ``3e-4``), else None:
    never ``inf``, ``nan``, ``1e999``, ``'٣'`` or ``'1_0'``."""
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        v = float(text)
    else:
        s = str(text).strip(_SPACES)
        if len(s) > 4 * _MAX_DIGITS or not _FLOAT.fullmatch(s):
            return None
        v = float(s)
    return v if math.isfinite(v) else None


def _flag_type(name: str, parse: Callable[[str], Any], ok: Callable[[Any], bool],
               expected: str, bounds: tuple[Any, Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        value = parse(text)
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    convert.__name__ = name
    convert.bounds = bounds  # type: ignore[attr-defined]  # read by the flag audit test
    return convert


def int_range(lo: int, hi: int, expected: str | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi], ASCII digits."""
    return _flag_type("int", parse_int, lambda v: lo <= v <= hi,
                      expected or f"an integer from {lo} to {hi}", (lo, hi))


def positive_int(hi: int) -> Callable[[str], int]:
    """An argparse type: an integer in [1, hi]."""
    return int_range(1, hi, f"a positive integer (at most {hi})")


def finite_float(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
                 hi_open: bool = False, expected: str | None = None) -> Callable[[str], float]:
    """An argparse type: a finite float (never inf or nan) in the given range."""

    def ok(v: float) -> bool:
        return ((lo is None or (v > lo if lo_open else v >= lo))
                and (hi is None or (v < hi if hi_open else v <= hi)))

    def shown(x: float) -> str:
        return str(int(x)) if float(x).is_integer() else repr(x)

    if expected is None:
        left = "" if lo is None else f"{'>' if lo_open else '>='} {shown(lo)}"
        right = "" if hi is None else f"{'<' if hi_open else '<='} {shown(hi)}"
        expected = "a finite number" + (f" {left}" if left else "") + (
            f"{' and' if left else ''} {right}" if right else "")
    return _flag_type("float", parse_float, ok, expected, (lo, hi))


def spec_type(check: Callable[[str], Any], field: str | None = None) -> Callable[[str], str]:
    """An argparse type for a spec flag (``--sync local:4``, ``--compress-act quant:4``):
    ``check(text)`` runs when the command line is parsed (its QsyncInputError's message,
    less a leading ``field: `` -- the field with or without its dashes, argparse names the
    flag already -- is the one-line refusal after the flag); the text itself is the value."""
    bare = field.lstrip("-") if field is not None else None
    prefixes = () if bare is None else (f"--{bare}: ", f"{bare}: ")

    def convert(text: str) -> str:
        try:
            check(text)
        except QsyncInputError as exc:
            msg = str(exc)
            for pre in prefixes:
                if msg.startswith(pre):
                    msg = msg[len(pre):]
                    break
            raise argparse.ArgumentTypeError(msg) from None
        return text

    convert.__name__ = "spec"
    return convert
