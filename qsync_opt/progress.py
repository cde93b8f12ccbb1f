"""One progress bar for every long step (solve, joint split, pareto, indicator, training).

A bar is drawn on stderr only when it is enabled (the CLI enables it when stderr is a
terminal and ``--json`` is not given) and only once its step has run ``delay_s`` (2 s by
default): a step that finishes sooner prints nothing, so short commands stay quiet and
their output is unchanged. The bar redraws at most ten times a second and ends its line
when closed. It depends on nothing of the package.
"""

from __future__ import annotations

import sys
import time
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
