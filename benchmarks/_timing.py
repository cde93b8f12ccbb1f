"""The one timer the benchmark scripts share: median wall time over repeats."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def timed(fn: Callable[[], Any], repeats: int, warmup: bool = False) -> tuple[float, Any]:
    """(median seconds over ``repeats`` calls, the last call's result)."""
    if warmup:
        fn()
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out
