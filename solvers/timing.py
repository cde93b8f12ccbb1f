"""The clock every deadline of a solve reads, the deadline of a whole call, the limit
handed to one HiGHS or CBC run within it (room for its overrun and the work after it), and
the stopwatch that measures building apart from solving."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from qsync_opt.core.errors import QsyncInputError

#: The clock every deadline reads (monotonic seconds). Tests may replace it (a fake clock).
clock: Callable[[], float] = time.perf_counter
#: How far a HiGHS or CBC run may overrun the limit handed to it, as a fraction of that
#: limit (a plain 2 s HiGHS run took 2.65 s on a loaded machine: 33%), and the seconds the
#: work after a run takes (reading its solution back, the evaluator, the report).
SOLVER_OVERRUN = 0.35
AFTER_RUN_S = 0.05
#: No HiGHS or CBC run, and no candidate of the joint split, starts with less than this
#: many seconds to hand to it (:func:`solver_limit`).
MIN_RUN_S = 0.02


def solver_limit(seconds: float) -> float:
    """The limit to hand a HiGHS or CBC run that must be over, with the work after it,
    within ``seconds``: ``(seconds - AFTER_RUN_S) / (1 + SOLVER_OVERRUN)``, so that a run
    overrunning by :data:`SOLVER_OVERRUN` still ends in time; 0 (do not start it) when that
    is less than :data:`MIN_RUN_S`."""
    if not seconds > 0 or not math.isfinite(seconds):
        return 0.0 if not seconds > 0 else seconds
    handed = (seconds - AFTER_RUN_S) / (1.0 + SOLVER_OVERRUN)
    return handed if handed >= MIN_RUN_S else 0.0


class Deadline:
    """The wall-clock limit of a whole call: every solver run, refinement round, fallback and
    diagnosis inside it gets at most :meth:`remaining` seconds (read from :data:`clock`)."""

    def __init__(self, seconds: float) -> None:
        if not seconds > 0 or not math.isfinite(seconds):
            raise QsyncInputError(f"time_limit_s: expected a positive number of seconds, "
                                  f"got {seconds}")
        self.seconds = float(seconds)
        self.end = clock() + self.seconds

    def remaining(self) -> float:
        """Seconds left (0 once expired)."""
        return max(0.0, self.end - clock())

    def expired(self) -> bool:
        return self.remaining() <= 0.0

    def share(self, parts_left: int) -> float:
        """An equal share of the remaining time among ``parts_left`` parts still to solve."""
        return self.remaining() / max(1, parts_left)


class Stopwatch:
    """``build_s`` (model building) and ``solve_s`` (the solver itself), measured apart."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.build_s = 0.0
        self.solve_s = 0.0

    def building(self) -> _Lap:
        return _Lap(self, "build_s")

    def solving(self) -> _Lap:
        return _Lap(self, "solve_s")

    @property
    def wall_s(self) -> float:
        return time.perf_counter() - self.t0


class _Lap:
    def __init__(self, sw: Stopwatch, attr: str) -> None:
        self.sw, self.attr = sw, attr

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        setattr(self.sw, self.attr, getattr(self.sw, self.attr) + time.perf_counter() - self.start)

