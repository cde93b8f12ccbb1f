"""HiGHS's process-wide state, shared by every HiGHS run in the process (the exact
program's, through PuLP, and the LP relaxation's): the banner its C++ prints when the
first ``Highs`` object is made, and its thread pool, fixed at the first run; and a model's
columns and rows passed to a ``Highs`` object in bulk (numpy arrays, not one at a time)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import numpy as np

if TYPE_CHECKING:  # HiGHS is imported when a solve needs it (~0.25 s)
    from highspy import Highs

T = TypeVar("T")

#: The thread count of HiGHS's process-wide scheduler (None: not started by us yet).
_HIGHS_THREADS: int | None = None
_HIGHS_BANNER_DONE = False


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """Silence file descriptor 1 (HiGHS prints its banner from C++ when the first Highs
    object is made, before output_flag can be set; it would corrupt JSON on stdout)."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def without_banner(make: Callable[[], T]) -> T:
    """``make()``, the process's first HiGHS object made with stdout silenced."""
    global _HIGHS_BANNER_DONE
    if _HIGHS_BANNER_DONE:
        return make()
    with quiet_stdout():
        made = make()
    _HIGHS_BANNER_DONE = True
    return made


def use_threads(threads: int | None) -> None:
    """HiGHS fixes its thread pool at the first run in a process; a run asking for another
    thread count fails (model status kNotset) unless the pool is reset: reset it then."""
    import highspy  # lazy: importing HiGHS costs ~0.25 s, kept off paths that never solve

    global _HIGHS_THREADS
    want = int(threads or 0)
    if want != _HIGHS_THREADS:
        if _HIGHS_THREADS is not None:
            highspy.Highs.resetGlobalScheduler(True)
        _HIGHS_THREADS = want


def add_columns(h: Highs, lower: Sequence[float], upper: Sequence[float],
                costs: Sequence[tuple[int, float]]) -> None:
    """Columns with their bounds, and the nonzero objective costs (column, cost)."""
    h.addVars(len(lower), np.array(lower, dtype=np.float64), np.array(upper, dtype=np.float64))
    if costs:
        h.changeColsCost(len(costs), np.array([i for i, _ in costs], dtype=np.int32),
                         np.array([c for _, c in costs], dtype=np.float64))


@dataclass
class RowArrays:
    """Rows gathered for one bulk ``addRows``: bounds and the nonzeros row by row."""

    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    index: list[int] = field(default_factory=list)
    value: list[float] = field(default_factory=list)

    def add(self, lower: float, upper: float, terms: Iterable[tuple[int, float]]) -> None:
        self.starts.append(len(self.index))
        for i, c in terms:
            self.index.append(i)
            self.value.append(c)
        self.lower.append(lower)
        self.upper.append(upper)

    def load(self, h: Highs) -> None:
        """Pass the rows to ``h`` (nothing when there are none)."""
        if self.lower:
            h.addRows(len(self.lower), np.array(self.lower, dtype=np.float64),
                      np.array(self.upper, dtype=np.float64), len(self.index),
                      np.array(self.starts, dtype=np.int32),
                      np.array(self.index, dtype=np.int32),
                      np.array(self.value, dtype=np.float64))
