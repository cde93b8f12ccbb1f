"""A run's story, read back from its folder: the periods of one membership, the plan changes
between them, and per group the predicted step time against the measured one.

A training run's folder (``train --out DIR``) holds the per-step metrics rows of every rank
(``metrics.rank{r}.jsonl``: :func:`qsync_opt.runtime.metrics.step_row`), the run's event log
(``events.jsonl``: :mod:`qsync_opt.runtime.events`) when the run wrote one, its checkpoint
sets (``ckpt/step-N``) and, once it finished, ``summary.json``. :func:`read_story` reads
them without following a link anywhere in the folder and tells:

- the **periods**: one per world (a ``world`` event: its groups, world size and plan's
  predicted step time), each from its first step to the step before the next world's
  first; a world that resumed from an earlier step than the previous one had reached
  replaces the steps it re-trains. A folder without events is one period, from its metrics;
- the **phases**: the periods cut at each re-plan inside a world (a ``replan`` event: its
  new predicted step time, and per group where the event carries ``predicted_group_ms``);
- the plan **changes** (``membership`` and ``replan`` events), the injected **slowdowns**,
  the **checkpoints** (events, or the complete sets on disk when there are none), the steps
  **lost** (the sum of the membership changes' ``lost_steps``, and the steps trained past
  the last checkpoint) and how the run **stopped**;
- per phase and group the medians of the measured ``compute_ms`` and ``step_ms`` beside the
  predicted time (:class:`GroupFigures`).

A metrics row is keyed by its ``group``, never by its rank's number (after a membership
change a rank number names another group), and it belongs to the period its step lies in
only when its group is one of that period's and its rank below that world's size: the rank
files of a larger earlier world keep the rows of steps a later world trained again.

Rows and events are read as untrusted: a torn or foreign line, a row whose step is not a
JSON integer (``"٣"``, ``true``, a float) or past :data:`~qsync_opt.core.limits.MAX_STEPS`,
a time that is not a finite number in range, an event missing a field or holding one of the
wrong type are left out and counted (:attr:`RunStory.skipped_rows`,
:attr:`RunStory.skipped_events`), never fatal. A missing folder, a file where the folder
should be, a link planted for a file the story reads, a file over :data:`MAX_FILE_BYTES` or
a folder holding neither events nor metrics is a one-line
:class:`~qsync_opt.core.errors.QsyncInputError` naming ``--run``. No torch is imported.
"""

from __future__ import annotations

import json
import math
import re
import stat
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qsync_opt.core.errors import QsyncInputError, one_line
from qsync_opt.core.limits import MAX_STEPS
from qsync_opt.documents.outfolder import list_names, read_bytes
from qsync_opt.runtime.config import CKPT_DIR, read_commit, step_folders
from qsync_opt.runtime.events import EVENTS_NAME, FIELDS, parse_events

__all__ = ["MAX_FILE_BYTES", "Change", "GroupFigures", "Period", "RunStory", "read_story",
           "texts"]

#: The largest file of a run's folder the story reads (a rank's metrics of a billion-step
#: run would be larger; the story of such a run is not told).
MAX_FILE_BYTES = 1 << 30
#: The largest time, factor or size a row or event may give (ms, s or a ratio).
MAX_VALUE = 1e12
#: The longest group name shown (a longer one makes the row or event foreign).
MAX_NAME = 200
#: The largest world (ranks) an event may give.
MAX_WORLD = 1 << 20
#: The most notes of a world's plan (``plan_changes``) kept.
MAX_NOTES = 20

_METRICS = re.compile(r"metrics\.rank(\d{1,7})\.jsonl")
_WHAT = "--run"


# ----------------------------------------------------------------------------- the story


@dataclass
class Period:
    """A span of steps under one membership (a world) or, as a phase, one plan."""

    first: int
    last: int | None  # None: no step of it is known to have been trained
    groups: tuple[str, ...]
    world_size: int | None
    predicted_step_ms: float | None
    predicted_group_ms: dict[str, float]
    cause: str  # start, resume, membership, restart, replan, or metrics (no world event)
    order: int = 0  # the event's line in the log (a re-plan belongs to the world before it)
    solve_s: float | None = None  # the world's re-solve, when its event says
    notes: tuple[str, ...] = ()  # what its plan changed (a world's plan_changes)

    def steps_text(self) -> str:
        return f"{self.first}..{self.last if self.last is not None else '?'}"


@dataclass(frozen=True)
class Change:
    """A plan change: a membership change (a new world) or a re-plan inside one."""

    step: int
    kind: str  # "membership" or "replan"
    event: dict[str, Any]


@dataclass(frozen=True)
class GroupFigures:
    """One group in one phase: its predicted time and the medians of its measured rows."""

    phase: int
    group: str
    predicted_ms: float | None
    compute_ms: float | None
    step_ms: float | None
    rows: int

    @property
    def ratio(self) -> float | None:
        """Measured compute over predicted (None when either is unknown or 0)."""
        if self.compute_ms is None or not self.predicted_ms:
            return None
        return self.compute_ms / self.predicted_ms


@dataclass
class RunStory:
    """What :func:`read_story` tells of a run's folder (see the module docstring)."""

    run: Path
    periods: list[Period]
    phases: list[Period]
    changes: list[Change]
    slowdowns: list[dict[str, Any]]
    checkpoints: list[tuple[int, str]]  # (step it holds, path), by step
    stop: dict[str, Any] | None
    summary_steps: int | None  # summary.json's steps, when it holds them
    figures: list[GroupFigures]
    phase_step_ms: list[float | None]  # per phase: the median over steps of the slowest row
    series: dict[str, list[tuple[int, float]]]  # group -> (step, median step_ms of its rows)
    lost_steps: int  # the membership changes' lost_steps, summed
    # what was read, and what was left out of it
    metrics_files: int
    rows: int
    skipped_rows: int = 0  # lines of the metrics files that are no row
    skipped_events: int = 0  # lines of events.jsonl that are no event of a known kind
    stale_rows: int = 0  # rows outside the world that trained their step
    missing_steps: list[tuple[int, int]] = field(default_factory=list)

    @property
    def end_step(self) -> int | None:
        """The step after the last one trained (None: none known)."""
        ends = [p.last + 1 for p in self.periods if p.last is not None]
        if self.stop is not None:
            ends.append(self.stop["step"])
        return max(ends) if ends else None

    @property
    def unanchored(self) -> list[int]:
        """The first steps of worlds after the first that no recorded checkpoint holds (a
        world resumes from a checkpoint: none should be listed)."""
        held = {s for s, _ in self.checkpoints}
        return [p.first for p in self.periods[1:]
                if p.cause != "metrics" and p.first not in held]

    @property
    def beyond_checkpoint(self) -> int | None:
        """Steps trained past the newest checkpoint (None: no step or no checkpoint known)."""
        end = self.end_step
        if end is None or not self.checkpoints:
            return None
        return max(0, end - self.checkpoints[-1][0])


def read_story(run: str | Path) -> RunStory:
    """The story of the run folder ``run`` (see the module docstring)."""
    if not str(run).strip():
        raise QsyncInputError(f"{_WHAT}: expected a run's folder, got an empty name")
    run = _check_run(Path(run))
    metrics = _run_files(run)
    events, events_bad = _read_events(run)
    rows, rows_bad = _read_all_rows(run, metrics)
    if not events and not rows:
        raise QsyncInputError(one_line(
            f"{_WHAT} {run}: no events.jsonl and no metrics row in it "
            f"({len(metrics)} metrics file(s), {rows_bad} unreadable row(s), "
            f"{events_bad} unreadable event(s)): not a training run's folder, or a run that "
            "trained no step"))
    periods = _periods(events, rows)
    phases = _phases(periods, events)
    kept, stale = _assign_rows(phases, rows)
    stop = _last(events, "stop")
    _close_last(periods, phases, kept, stop)
    story = RunStory(
        run=run, periods=periods, phases=phases,
        changes=[Change(e["step"], e["kind"], e) for e in events
                 if e["kind"] in ("membership", "replan")],
        slowdowns=[e for e in events if e["kind"] == "slowdown"],
        checkpoints=_checkpoints(run, events), stop=stop,
        summary_steps=_summary_steps(run), figures=[], phase_step_ms=[], series={},
        lost_steps=sum(e["lost_steps"] for e in events if e["kind"] == "membership"),
        metrics_files=len(metrics), rows=len(rows), skipped_rows=rows_bad,
        skipped_events=events_bad, stale_rows=stale)
    _measure(story, kept)
    return story


# ----------------------------------------------------------------------------- the folder


def _check_run(run: Path) -> Path:
    """``run`` as an existing folder (followed if the name given is a link, as named)."""
    if not run.exists():
        what = "a link to nothing" if run.is_symlink() else "no such folder"
        raise QsyncInputError(one_line(f"{_WHAT} {run}: {what}; name a training run's "
                                       "folder (train --out)"))
    if not run.is_dir():
        raise QsyncInputError(one_line(f"{_WHAT} {run}: is a file, not a folder; name a "
                                       "training run's folder (train --out)"))
    return run


def _run_files(run: Path) -> list[str]:
    """The metrics files at the top of ``run``; a link or non-regular file planted for one
    (or for events.jsonl, summary.json; a link for ckpt) is refused, as is a file over the
    size limit."""
    names = []
    for name, st in list_names(run, what=_WHAT):
        if name == CKPT_DIR and stat.S_ISLNK(st.st_mode):
            raise QsyncInputError(one_line(
                f"{_WHAT} {run}: {name} is a symbolic link; nothing in a run's folder is "
                "followed: remove it"))
        ours = _METRICS.fullmatch(name) or name in (EVENTS_NAME, "summary.json")
        if not ours:
            continue
        if not stat.S_ISREG(st.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            raise QsyncInputError(one_line(
                f"{_WHAT} {run}: {name} is {kind}; nothing in a run's folder is followed: "
                "remove it, or copy the real file there"))
        if st.st_size > MAX_FILE_BYTES:
            raise QsyncInputError(one_line(
                f"{_WHAT} {run}: {name} holds {st.st_size} bytes, more than the "
                f"{MAX_FILE_BYTES} a run's story reads"))
        if name.startswith("metrics."):
            names.append(name)
    return sorted(names, key=lambda n: int(_METRICS.fullmatch(n)[1]))  # type: ignore[index]


def _read_events(run: Path) -> tuple[list[dict[str, Any]], int]:
    """The events whose fields are all of their kind's types, and how many lines were not."""
    data = read_bytes(run, EVENTS_NAME, what=_WHAT)
    if data is None:
        return [], 0
    lines = sum(1 for x in data.decode("utf-8", errors="replace").splitlines() if x.strip())
    good = [e for e in parse_events(data) if _event_ok(e)]
    return good, max(0, lines - len(good))


def _summary_steps(run: Path) -> int | None:
    """``summary.json``'s ``steps`` (None: no summary, or not one that says it)."""
    data = read_bytes(run, "summary.json", what=_WHAT)
    try:
        doc = json.loads(data) if data is not None else None
    except (ValueError, RecursionError):
        return None
    steps = doc.get("steps") if isinstance(doc, dict) else None
    return steps if _is_step(steps) else None


def _checkpoints(run: Path, events: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """The checkpoint events by step (the newest path of a step kept); without any, the
    complete sets in ``run/ckpt``."""
    found = {e["step"]: e["path"] for e in events if e["kind"] == "checkpoint"}
    if not found:
        for step, folder in step_folders(run):
            if read_commit(folder, step) is not None:
                found[step] = str(folder.relative_to(run))
    return sorted(found.items())


def _last(events: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    rows = [e for e in events if e["kind"] == kind]
    return rows[-1] if rows else None


# ----------------------------------------------------------------------------- values


def _is_step(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_STEPS


def _is_num(x: object, nullable: bool = True) -> bool:
    if x is None:
        return nullable
    return (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            and abs(x) <= MAX_VALUE)


def _is_name(x: object) -> bool:
    return isinstance(x, str) and 0 < len(x) <= MAX_NAME


def _is_names(x: object) -> bool:
    return (isinstance(x, list) and len(x) <= MAX_WORLD and all(_is_name(g) for g in x)
            and len(set(x)) == len(x))


def _is_group_ms(x: object) -> bool:
    return x is None or (isinstance(x, dict) and len(x) <= MAX_WORLD and all(
        _is_name(k) and _is_num(v) for k, v in x.items()))


def _is_factors(x: object, groups: object) -> bool:
    if isinstance(x, dict):
        return _is_group_ms(x)
    return (isinstance(x, list) and isinstance(groups, list) and len(x) == len(groups)
            and all(_is_num(v) for v in x))


#: Per kind: field -> the check its value must pass (beside kind, time and step).
_CHECKS: dict[str, dict[str, Any]] = {
    "world": {"groups": _is_names,
              "world_size": lambda x: _is_step(x) and 1 <= x <= MAX_WORLD,
              "predicted_step_ms": _is_num, "predicted_group_ms": _is_group_ms,
              "resumed_from": lambda x: x is None or _is_step(x), "plan": lambda x: True},
    "membership": {"old_groups": lambda x: x is None or _is_names(x), "new_groups": _is_names,
                   "old_predicted_ms": _is_num, "new_predicted_ms": _is_num,
                   "change_to_first_step_s": _is_num, "lost_steps": _is_step},
    "replan": {"groups": _is_names, "factors": lambda x: True, "old_predicted_ms": _is_num,
               "new_predicted_ms": _is_num, "solve_s": _is_num,
               "reason": lambda x: x is None or isinstance(x, str),
               "predicted_group_ms": _is_group_ms},
    "slowdown": {"group": _is_name, "old_factor": _is_num, "new_factor": _is_num},
    "checkpoint": {"path": lambda x: isinstance(x, str)},
    "stop": {"reason": lambda x: x is None or isinstance(x, str),
             "checkpoint": lambda x: x is None or isinstance(x, str)},
}
assert set(_CHECKS) == set(FIELDS)  # a kind added to the log needs its checks here


def _event_ok(e: dict[str, Any]) -> bool:
    """Every field of the event's kind there and of its type (``predicted_group_ms`` of a
    re-plan may be absent), its step a step and its time a finite number."""
    if not _is_step(e["step"]) or not _is_num(e["time"], nullable=False):
        return False
    for name, check in _CHECKS[e["kind"]].items():
        if name not in e and name not in FIELDS[e["kind"]]:
            continue
        if name not in e or not check(e[name]):
            return False
    return e["kind"] != "replan" or _is_factors(e["factors"], e["groups"])


def _row_of(line: bytes) -> dict[str, Any] | None:
    """A metrics row as the story uses it (step, rank, group, compute_ms, step_ms), or None
    when the line is not one."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(row, dict):
        return None
    step: Any = row.get("step")
    rank: Any = row.get("rank")
    group: Any = row.get("group")
    compute: Any = row.get("compute_ms")
    total: Any = row.get("step_ms")
    if not (_is_step(step) and _is_step(rank) and _is_name(group)
            and _is_num(compute, False) and _is_num(total, False)):
        return None
    if rank >= MAX_WORLD or compute < 0 or total < 0:
        return None
    return {"step": step, "rank": rank, "group": group, "compute_ms": float(compute),
            "step_ms": float(total)}


def _read_all_rows(run: Path, names: list[str]) -> tuple[list[dict[str, Any]], int]:
    rows: list[dict[str, Any]] = []
    bad = 0
    for name in names:
        data = read_bytes(run, name, what=_WHAT) or b""
        for line in data.splitlines():
            if not line.strip():
                continue
            row = _row_of(line)
            if row is None:
                bad += 1
            else:
                rows.append(row)
    return rows, bad


# ----------------------------------------------------------------------------- periods


def _world_period(e: dict[str, Any], order: int, before: Period | None) -> Period:
    """A world event's period; its cause: the run's start (its resume when the first
    world known starts past step 0), else a membership change, or a restart with the same
    groups."""
    if before is None:
        cause = "start" if e["step"] == 0 else "resume"
    else:
        cause = "restart" if tuple(e["groups"]) == before.groups else "membership"
    return Period(first=e["step"], last=None, groups=tuple(e["groups"]),
                  world_size=e["world_size"], predicted_step_ms=e["predicted_step_ms"],
                  predicted_group_ms=dict(e["predicted_group_ms"] or {}), cause=cause,
                  order=order, solve_s=e.get("solve_s") if _is_num(e.get("solve_s")) else None,
                  notes=tuple(texts(e.get("plan_changes"))))


def texts(x: object) -> list[str]:
    """``x`` when it is a list of strings (its first :data:`MAX_NOTES`), else []: an event's
    optional notes (``plan_changes``, ``reasons``, ``changes``)."""
    if isinstance(x, list) and all(isinstance(v, str) for v in x):
        return x[:MAX_NOTES]
    return []


def _periods(events: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[Period]:
    """One period per world, in the lineage of the final weights: a world that starts at or
    before an earlier world's first step replaces it, and ends the one it starts inside."""
    out: list[Period] = []
    for order, e in enumerate(events):
        if e["kind"] != "world":
            continue
        out = [p for p in out if p.first < e["step"]]
        if out:
            out[-1].last = e["step"] - 1
        out.append(_world_period(e, order, out[-1] if out else None))
    before = [r for r in rows if not out or r["step"] < out[0].first]
    if before:  # rows of steps no world event tells of: the run as its metrics say
        first = min(r["step"] for r in before)
        groups = tuple(dict.fromkeys(r["group"] for r in sorted(before, key=_row_key)))
        ranks = {r["rank"] for r in before}
        last = out[0].first - 1 if out else None
        out.insert(0, Period(first=first, last=last, groups=groups,
                             world_size=max(ranks) + 1 if ranks else None,
                             predicted_step_ms=None, predicted_group_ms={}, cause="metrics",
                             order=-1))
    return out


def _row_key(r: dict[str, Any]) -> tuple[int, int]:
    return r["step"], r["rank"]


def _phases(periods: list[Period], events: list[dict[str, Any]]) -> list[Period]:
    """The periods cut at each re-plan logged while their world ran (after the world's event,
    before the next world's) whose step lies inside the world's span."""
    phases: list[Period] = []
    orders = [p.order for p in periods] + [len(events)]
    for i, p in enumerate(periods):
        cur = Period(**{**p.__dict__, "predicted_group_ms": dict(p.predicted_group_ms)})
        for order in range(p.order + 1, orders[i + 1]):  # a metrics period's order: -1
            e = events[order]
            if (e["kind"] != "replan" or e["step"] < p.first
                    or (p.last is not None and e["step"] > p.last)):
                continue
            nxt = Period(first=e["step"], last=cur.last, groups=p.groups,
                         world_size=p.world_size, predicted_step_ms=e["new_predicted_ms"],
                         predicted_group_ms=dict(e.get("predicted_group_ms") or {}),
                         cause="replan", order=order)
            if e["step"] > cur.first:
                cur.last = e["step"] - 1
                phases.append(cur)
            cur = nxt
        phases.append(cur)
    return phases


def _assign_rows(phases: list[Period], rows: list[dict[str, Any]]
                 ) -> tuple[list[list[dict[str, Any]]], int]:
    """Each phase's rows: step inside it (the last phase open-ended), group one of its
    world's, rank below its world's size; the rest counted as stale."""
    firsts = [p.first for p in phases]
    kept: list[list[dict[str, Any]]] = [[] for _ in phases]
    stale = 0
    for r in rows:
        i = _index_at(firsts, r["step"])
        if i is None or not _belongs(r, phases[i], i == len(phases) - 1):
            stale += 1
            continue
        kept[i].append(r)
    return kept, stale


def _belongs(r: dict[str, Any], p: Period, open_ended: bool) -> bool:
    return ((open_ended or p.last is None or r["step"] <= p.last) and r["group"] in p.groups
            and (p.world_size is None or r["rank"] < p.world_size))


def _index_at(firsts: list[int], step: int) -> int | None:
    """The index of the last phase starting at or before ``step`` (None: before all)."""
    lo, hi = 0, len(firsts)
    while lo < hi:
        mid = (lo + hi) // 2
        if firsts[mid] <= step:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1 if lo else None


def _close_last(periods: list[Period], phases: list[Period],
                kept: list[list[dict[str, Any]]], stop: dict[str, Any] | None) -> None:
    """The open end of the last phase: its last step with a row, else the step before the
    run's stop (unknown when neither); the last period ends with its last phase that ends."""
    if not phases:
        return
    tail = phases[-1]
    steps = [r["step"] for r in kept[-1]]
    last = max(steps) if steps else (stop["step"] - 1 if stop is not None else None)
    tail.last = last if last is not None and last >= tail.first else None
    ends = [p.last for p in phases if p.first >= periods[-1].first and p.last is not None]
    periods[-1].last = max(ends) if ends else None


# ----------------------------------------------------------------------------- figures


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _measure(story: RunStory, kept: list[list[dict[str, Any]]]) -> None:
    """Per phase and group the medians; per phase the median slowest row of a step; per
    group the series of its median step time by step; steps with no row at all."""
    by_group: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for i, (phase, rows) in enumerate(zip(story.phases, kept, strict=True)):
        per_group: dict[str, list[dict[str, Any]]] = defaultdict(list)
        slowest: dict[int, float] = {}
        for r in rows:
            per_group[r["group"]].append(r)
            by_group[r["group"]][r["step"]].append(r["step_ms"])
            slowest[r["step"]] = max(slowest.get(r["step"], 0.0), r["step_ms"])
        story.phase_step_ms.append(_median(list(slowest.values())))
        for g in phase.groups:
            mine = per_group.get(g, [])
            story.figures.append(GroupFigures(
                phase=i, group=g, predicted_ms=phase.predicted_group_ms.get(g),
                compute_ms=_median([r["compute_ms"] for r in mine]),
                step_ms=_median([r["step_ms"] for r in mine]), rows=len(mine)))
        if phase.last is not None:
            story.missing_steps.extend(_gaps(phase.first, phase.last, set(slowest)))
    story.series = {g: sorted((s, statistics.median(v)) for s, v in steps.items())
                    for g, steps in by_group.items()}


def _gaps(first: int, last: int, seen: set[int]) -> list[tuple[int, int]]:
    """The runs of steps in ``first..last`` with no row (as (from, to), inclusive); in the
    time of the rows, whatever the span."""
    out: list[tuple[int, int]] = []
    prev = first - 1
    for s in sorted(x for x in seen if first <= x <= last) + [last + 1]:
        if s > prev + 1:
            out.append((prev + 1, s - 1))
        prev = s
    return out
