"""The profiler's measuring settings, which need no torch (the command's parser reads its
defaults without importing the profiler): repeats and warm-up calls of each measurement,
and the sizes the cast and all-reduce fits run at."""

from __future__ import annotations

__all__ = ["ALLREDUCE_SIZES", "CAST_SIZES", "DEFAULT_REPEATS", "DEFAULT_WARMUP"]

#: Timed calls of each measurement (the median is kept).
DEFAULT_REPEATS = 10
#: Calls before the timed ones.
DEFAULT_WARMUP = 3
#: Element counts the cast fit (``a * numel + b``) is measured at.
CAST_SIZES = (1 << 10, 1 << 13, 1 << 16, 1 << 18, 1 << 20)
#: Message sizes in bytes the all-reduce fit is measured at.
ALLREDUCE_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 21)
