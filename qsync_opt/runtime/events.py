"""The run's story: one JSON line per event in ``out_dir/events.jsonl``.

A training run writes here what changed while it ran, beside the per-step metrics rows:
which groups were present, which plan ran, when a checkpoint was committed, when a
slowdown was injected or detected and what the re-plan chose. ``qsync-opt report --run DIR``
reads it back and tells the timeline.

Every line is an object with at least

``kind``
    one of :data:`KINDS` (below);
``time``
    seconds since the epoch (``time.time()``) when it was written;
``step``
    the training step it belongs to: the first step the change applies to (``membership``,
    ``replan``, ``slowdown``), the step a checkpoint holds (``checkpoint``), else the step
    the run was at.

and the kind's own fields (:data:`FIELDS`: the ones each kind must carry; more may be
added). Times are in milliseconds (``*_ms``) or seconds (``*_s``), as named.

The file is appended to by one writer at a time (rank 0 of the world, or the launcher when
no world runs), a line in one ``write`` and flushed, inside the run's folder without ever
following a link (:func:`qsync_opt.documents.outfolder.append_text`). A reader skips a torn
last line (a kill in the middle of a write) and lines that are not objects of a known kind.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, TextIO

from qsync_opt.documents.outfolder import append_text, read_bytes

__all__ = ["EVENTS_NAME", "FIELDS", "KINDS", "EventLog", "parse_events", "read_events"]

#: The file's name inside the run's folder.
EVENTS_NAME = "events.jsonl"

#: Each kind and the fields it must carry beside ``kind``, ``time`` and ``step``.
FIELDS: dict[str, tuple[str, ...]] = {
    # a world started (the first, or a restart after a membership change): its groups, the
    # number of ranks, the plan it runs and that plan's predicted step time (whole, per group)
    "world": ("groups", "world_size", "plan", "predicted_step_ms", "predicted_group_ms",
              "resumed_from"),
    # the groups changed: old and new, the plans' predicted step times, the seconds from
    # the change being noticed to the first step of the new world, and the steps trained
    # after the checkpoint resumed from that were thrown away (0 after a graceful leave)
    "membership": ("old_groups", "new_groups", "old_predicted_ms", "new_predicted_ms",
                   "change_to_first_step_s", "lost_steps"),
    # a re-plan inside a running world: the group(s) measured slower (factor = measured /
    # expected), the old and new predicted step times, how long the solve took
    "replan": ("groups", "factors", "old_predicted_ms", "new_predicted_ms", "solve_s",
               "reason"),
    # a fault injected by a test or the benchmark (an emulated card's stretch changed)
    "slowdown": ("group", "old_factor", "new_factor"),
    # a checkpoint set committed (``step``: the step it holds)
    "checkpoint": ("path",),
    # the run stopped: why, and the newest checkpoint it leaves
    "stop": ("reason", "checkpoint"),
}
KINDS = tuple(FIELDS)


def _finite(value: Any) -> Any:
    """JSON-safe: non-finite floats become null, tuples lists, nested as deep as given."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class EventLog:
    """The writer of ``out_dir/events.jsonl`` (append-only; see the module docstring)."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out = Path(out_dir)
        self._fh: TextIO | None = None

    def write(self, kind: str, step: int, **fields: Any) -> dict[str, Any]:
        """Append one event; returns the row written. ``kind`` must be one of
        :data:`KINDS` and carry that kind's :data:`FIELDS` (a programming error otherwise:
        ValueError)."""
        if kind not in FIELDS:
            raise ValueError(f"event kind {kind!r}: expected one of {', '.join(KINDS)}")
        missing = [f for f in FIELDS[kind] if f not in fields]
        if missing:
            raise ValueError(f"event {kind!r}: missing field(s) {', '.join(missing)}")
        row = {"kind": kind, "time": round(time.time(), 3), "step": int(step),
               **_finite(fields)}
        if self._fh is None:
            self._fh = append_text(self.out, EVENTS_NAME)
        self._fh.write(json.dumps(row, sort_keys=False) + "\n")
        self._fh.flush()
        return row

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(out_dir: str | Path) -> list[dict[str, Any]]:
    """The run's events in the order written ([] without a file); a torn or foreign line is
    skipped, never fatal."""
    data = read_bytes(Path(out_dir), EVENTS_NAME)
    return [] if data is None else parse_events(data)


def parse_events(data: bytes) -> list[dict[str, Any]]:
    """The events of an ``events.jsonl``'s bytes (:func:`read_events`)."""
    rows: list[dict[str, Any]] = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # bad JSON, or an int of over 4,300 digits
            continue
        if (isinstance(row, dict) and row.get("kind") in FIELDS
                and isinstance(row.get("step"), int) and not isinstance(row.get("step"), bool)
                and isinstance(row.get("time"), (int, float))):
            rows.append(row)
    return rows
