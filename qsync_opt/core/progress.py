"""One progress bar for every long step (solve, joint split, pareto, indicator, training).

A bar is drawn on stderr only when it is enabled (the CLI enables it when stderr is a
terminal and ``--json`` is not given) and only once its step has run ``delay_s`` (2 s by
default): a step that finishes sooner prints nothing, so short commands stay quiet and
their output is unchanged. The bar redraws at most ten times a second and ends its line
when closed. It depends on nothing of the package.

Off a terminal (a pipe, a file, ``nohup``, a batch scheduler) a bar cannot redraw, and a run
that printed nothing until its end would look hung: :class:`ProgressLog` writes one plain line
every ``every_s`` seconds instead (:data:`LOG_EVERY_S` by default; ``qsync-opt train
--progress-every``): the steps done, the loss, the steps per second and the time left.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

#: A bar appears once its step has run this long.
DELAY_S = 2.0
#: At most one redraw per this many seconds.
REDRAW_S = 0.1
WIDTH = 30


class Progress:
    """``with Progress("pareto", total=n, enabled=tty) as bar: ... bar.advance(note=...)``.

    ``total`` None: a count without a bar. ``delay_s`` 0 draws from the first update.
    """

    def __init__(self, label: str, total: int | None = None, *, enabled: bool = False,
                 delay_s: float = DELAY_S, stream: TextIO | None = None) -> None:
        self.label, self.total, self.enabled = label, total, enabled
        self.delay_s = delay_s
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.note = ""
        self.t0 = time.perf_counter()
        self._last = -1.0
        self.drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def advance(self, n: int = 1, note: str | None = None) -> None:
        self.update(self.done + n, note)

    def update(self, done: int, note: str | None = None) -> None:
        self.done = done
        if note is not None:
            self.note = note
        if not self.enabled:
            return
        now = time.perf_counter()
        finished = self.total is not None and done >= self.total
        if now - self.t0 < self.delay_s or (now - self._last < REDRAW_S and not finished):
            return
        self._last = now
        self._draw(now)

    def line(self, now: float | None = None) -> str:
        """The text of the bar as it stands."""
        elapsed = (time.perf_counter() if now is None else now) - self.t0
        if self.total:
            k = min(WIDTH, int(WIDTH * self.done / self.total))
            head = f"[{'#' * k}{'.' * (WIDTH - k)}] {self.done}/{self.total}"
        else:
            head = f"{self.done}"
        return f"{self.label}: {head} {elapsed:.1f} s" + (f" {self.note}" if self.note else "")

    def _draw(self, now: float) -> None:
        self.stream.write("\r" + self.line(now) + "\033[K")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        """End the bar's line (only if it was drawn)."""
        if self.drawn:
            self._draw(time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False


#: Off a terminal, a long run writes a progress line this often (seconds).
LOG_EVERY_S = 30.0


def duration(seconds: float) -> str:
    """``seconds`` for a person: 42s, 4m 05s, 3h 07m."""
    if not math.isfinite(seconds):
        return "unknown"
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


class ProgressLog:
    """One plain progress line every ``every_s`` seconds (0: none), for output that is not
    a terminal (module docstring). ``start``: the step the run began at (a resume), so the
    rate counts this run's steps only; ``clock``: seconds (tests pass their own)."""

    def __init__(self, label: str, total: int, every_s: float = LOG_EVERY_S, *,
                 start: int = 0, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.total, self.every_s, self.start = label, total, every_s, start
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.t0 = self._last = clock()
        self.lines = 0

    def line(self, done: int, loss: float, now: float) -> str:
        """The text of one progress line at step ``done`` (without its newline)."""
        elapsed = now - self.t0
        rate = (done - self.start) / elapsed if elapsed > 0 else math.nan
        left = (self.total - done) / rate if rate > 0 else math.nan
        loss_text = f"{loss:.4f}" if math.isfinite(loss) else "not finite"
        return (f"{self.label}: step {done}/{self.total}, loss {loss_text}, "
                f"{rate:.3g} steps/s, {duration(left)} left")

    def update(self, done: int, loss: float) -> None:
        """Write a line when ``every_s`` has passed since the last one (or the start)."""
        if self.every_s <= 0:
            return
        now = self.clock()
        if now - self._last < self.every_s:
            return
        self._last = now
        self.stream.write(self.line(done, loss, now) + "\n")
        self.stream.flush()
        self.lines += 1
