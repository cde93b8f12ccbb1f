"""Elastic runs: what the launcher, the agents' ranks and the inference service tell each other.

An elastic run (``qsync-opt train --elastic``) runs one torchrun elastic agent per device
group; its ranks restart whenever the groups present change. Everything they share lives in
the run's folder (a shared filesystem on a real cluster), never followed through a link
(:mod:`qsync_opt.documents.outfolder`):

``OUT/elastic/spec.json``
    :class:`ElasticSpec`: the run's groups in plan order, the ranks each group's agent runs,
    the seconds of work a crash may lose (``max_lost_s``), the checkpoint interval (0: chosen
    from the measured step time, :func:`checkpoint_interval`), the membership schedule of a
    localhost test (:func:`parse_membership`), how long the launcher waits when every group
    is gone.
``OUT/leave/GROUP``
    a graceful leave asked by the inference service (or the launcher): the ranks checkpoint
    at the next step boundary (or at the step the file holds, when it holds one), the
    group's agent exits and the others restart into the smaller world; the file is removed
    once the group has left (:func:`leave_requests`).
``OUT/elastic/exit.rankR.json``
    written by every rank that leaves its world alive (:func:`write_exit`): when, at which
    step, why; the next world's rank 0 reads them for the ``membership`` event (the steps
    lost, the time from the change to the first new step) and removes them
    (:func:`take_exits`).
``OUT/elastic/world.json``
    the world now running (:func:`write_world`): its groups, plan and predicted step time,
    the ``old`` side of the next ``membership`` event.

This module is torch-free: the command line checks ``--membership`` with it.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.documents.outfolder import list_names, read_bytes, remove, write_text
from qsync_opt.runtime.config import CheckpointSet, latest_complete_set
from qsync_opt.runtime.events import EventLog

__all__ = [
    "ALL_GONE_S", "CRASH_AT_ENV", "DIE_IN_REPLAN_ENV", "FAULT_FIRED", "ELASTIC_DIR", "LEAVE_DIR", "MAX_LOST_S", "MEMBERSHIP_FLAG", "RDZV_FLAG",
    "NODE_DEVICE_ENV", "NODE_GROUP_ENV", "RESTART_EXIT_CODE", "WARM_STEPS", "Change", "ElasticSpec", "checkpoint_interval",
    "parse_endpoint", "parse_membership", "leave_requests", "read_spec", "read_world", "remove_leave",
    "reset_run_state",
    "take_exits", "write_exit", "write_spec", "write_stop", "write_world",
]

MEMBERSHIP_FLAG = "--membership"
#: Default seconds of work a crash may lose: the checkpoint interval's target. A checkpoint
#: of the CPU workloads costs well under a second, so 30 s keeps the saving below a few
#: percent of the run while a crash costs at most half a minute of steps.
MAX_LOST_S = 30.0
#: Default seconds the launcher waits for a group to return once every group is gone.
ALL_GONE_S = 120.0
#: A rank that leaves its world to restart into the next one exits with this code (the
#: agent restarts its ranks on any failure; 75 is EX_TEMPFAIL: try again).
RESTART_EXIT_CODE = 75
#: Steps of a new world measured before the checkpoint interval is chosen (the first step
#: pays the warm-up: it is not among them).
WARM_STEPS = 3
#: The agent's environment: its device group (every rank it starts inherits it).
NODE_GROUP_ENV = "QSYNC_NODE_GROUP"
#: The agent's environment: the device its node has now (default: the one its group left
#: with; a node that returns with another is refused by name).
NODE_DEVICE_ENV = "QSYNC_NODE_DEVICE"
#: Test hook (the membership switch's crash): at this step a rank of the agent kills the
#: agent with SIGKILL and dies, as a node that loses power.
CRASH_AT_ENV = "QSYNC_ELASTIC_CRASH_AT"
#: Test hook: "1" makes the rank that re-plans die after solving, before it hands the plan
#: out (a kill during the re-plan). Like the runtime's QSYNC_TEST_* faults, in an elastic
#: run it strikes once per run (:data:`FAULT_FIRED` marks it), not again after the restart.
DIE_IN_REPLAN_ENV = "QSYNC_TEST_DIE_IN_REPLAN"
FAULT_FIRED = "fault-fired"
ELASTIC_DIR = "elastic"
LEAVE_DIR = "leave"
SPEC_NAME = "spec.json"
WORLD_NAME = "world.json"
_EXIT = re.compile(r"exit\.rank(\d{1,6})\.json")
#: Entries of ``--membership`` and the characters of its text, at most.
MAX_CHANGES = 64
MAX_TEXT = 4096
_ENTRY = re.compile(r"([A-Za-z0-9_.\-]{1,64}?)([+-])@(\d{1,9})(?::(crash|graceful))?"
                    r"(?:=([A-Za-z0-9_./\-]{1,64}))?")

#: ``--rdzv-endpoint``: a host name, an IPv4 address or a bracketed IPv6 one, and a port.
RDZV_FLAG = "--rdzv-endpoint"
_ENDPOINT = re.compile(r"(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9](?:[A-Za-z0-9.\-]{0,252}))"
                       r":([0-9]{1,5})")


def parse_endpoint(text: str) -> str:
    """``HOST:PORT`` of the rendezvous store (ASCII; a port from 1 to 65535), as given."""
    m = _ENDPOINT.fullmatch(text) if isinstance(text, str) else None
    if m is None or not 1 <= int(m[2]) <= 65535:
        shown = repr(text[:80]) if isinstance(text, str) else type(text).__name__
        raise QsyncInputError(f"{RDZV_FLAG}: expected HOST:PORT (a host name, an IPv4 address "
                              f"or [IPv6], a port from 1 to 65535; e.g. head:29400), got {shown}")
    return text


@dataclass(frozen=True)
class Change:
    """One entry of the membership schedule: ``group`` leaves (``leave``; ``mode`` crash or
    graceful) or returns at ``step``."""

    group: str
    leave: bool
    step: int
    mode: str = "graceful"
    #: a return only: the device the node comes back with (None: the one it left with)
    device: str | None = None

    def text(self) -> str:
        return (f"{self.group}{'-' if self.leave else '+'}@{self.step}"
                + (f":{self.mode}" if self.leave else "")
                + (f"={self.device}" if self.device else ""))


def parse_membership(text: str, groups: list[str] | None = None,
                     steps: int | None = None) -> tuple[Change, ...]:
    """``GROUP-@STEP[:crash|:graceful],GROUP+@STEP[=DEVICE],...`` as changes in step order.

    A leave is graceful unless ``:crash``; a return with ``=DEVICE`` comes back with that
    device instead of the one it left with (the run refuses it by name); per group the entries alternate leave, return,
    leave... starting with a leave, at increasing steps (a return strictly after its leave);
    ``groups`` (the plan's) and ``steps`` (the run's length) bound the names and steps when
    given. QsyncInputError names ``--membership`` and the entry."""
    if not isinstance(text, str) or not text.strip():
        raise QsyncInputError(f"{MEMBERSHIP_FLAG}: expected GROUP-@STEP[:crash],GROUP+@STEP,"
                              "... (e.g. t4-@20,t4+@40), got an empty value")
    if len(text) > MAX_TEXT or not text.isascii() or not text.isprintable():
        raise QsyncInputError(f"{MEMBERSHIP_FLAG}: expected printable ASCII text of at most "
                              f"{MAX_TEXT} characters")
    entries = [e.strip() for e in text.split(",")]
    if len(entries) > MAX_CHANGES:
        raise QsyncInputError(f"{MEMBERSHIP_FLAG}: at most {MAX_CHANGES} changes, got "
                              f"{len(entries)}")
    out: list[Change] = []
    for e in entries:
        m = _ENTRY.fullmatch(e)
        if m is None:
            raise QsyncInputError(f"{MEMBERSHIP_FLAG}: {e!r}: expected GROUP-@STEP"
                                  "[:crash|:graceful] or GROUP+@STEP (e.g. t4-@20:crash)")
        if m[2] == "+" and m[4]:
            raise QsyncInputError(f"{MEMBERSHIP_FLAG}: {e!r}: a return has no mode (only a "
                                  "leave is :crash or :graceful)")
        if m[2] == "-" and m[5]:
            raise QsyncInputError(f"{MEMBERSHIP_FLAG}: {e!r}: only a return names a device "
                                  "(GROUP+@STEP=DEVICE: the node comes back with another)")
        out.append(Change(m[1], m[2] == "-", int(m[3]), m[4] or "graceful", m[5]))
    _check_changes(out, groups, steps)
    return tuple(sorted(out, key=lambda c: c.step))


def _check_changes(changes: list[Change], groups: list[str] | None, steps: int | None) -> None:
    for c in changes:
        if groups is not None and c.group not in groups:
            raise QsyncInputError(f"{MEMBERSHIP_FLAG}: {c.text()}: the plan has no group "
                                  f"{c.group!r}; its groups: {', '.join(groups)}")
        if c.step < 1 or (steps is not None and c.step >= steps):
            bound = f" and below --steps {steps}" if steps is not None else ""
            raise QsyncInputError(f"{MEMBERSHIP_FLAG}: {c.text()}: the step must be at least "
                                  f"1{bound}")
    by_group: dict[str, list[Change]] = {}
    for c in sorted(changes, key=lambda c: (c.step, not c.leave)):
        by_group.setdefault(c.group, []).append(c)
    for g, cs in by_group.items():
        for i, c in enumerate(cs):
            if c.leave != (i % 2 == 0):
                what = "leaves again before returning" if c.leave else "returns before leaving"
                raise QsyncInputError(f"{MEMBERSHIP_FLAG}: {c.text()}: group {g} {what}")
            if i and c.step <= cs[i - 1].step:
                raise QsyncInputError(f"{MEMBERSHIP_FLAG}: {c.text()}: group {g}'s changes "
                                      f"must be at increasing steps (after "
                                      f"{cs[i - 1].text()})")


def checkpoint_interval(step_s: float, max_lost_s: float) -> int:
    """Steps between checkpoints so that a crash loses at most ``max_lost_s`` seconds of
    work at ``step_s`` seconds a step (at least 1)."""
    if not (math.isfinite(step_s) and step_s > 0):
        return 1
    return max(1, math.floor(max_lost_s / step_s * (1 + 1e-12)))


class ElasticSpec(BaseModel):
    """What every rank of an elastic run reads beside its TrainConfig (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    groups: list[str] = Field(description="The run's groups, in the plan's order.")
    ranks: dict[str, int] = Field(description="Ranks each group's agent runs.")
    devices: dict[str, str] = Field(description="The device each group left with.")
    max_lost_s: float = Field(default=MAX_LOST_S, gt=0, le=86400)
    checkpoint_every: int = Field(default=0, ge=0,
                                  description="0: chosen from the measured step time.")
    membership: list[str] = Field(default_factory=list,
                                  description="The membership schedule's entries (tests).")
    all_gone_s: float = Field(default=ALL_GONE_S, ge=0, le=86400)
    replan_cache: str = Field(description="The re-plan cache's file (built at launch).")

    def changes(self) -> tuple[Change, ...]:
        return parse_membership(",".join(self.membership)) if self.membership else ()


def _elastic(name: str) -> Path:
    return Path(ELASTIC_DIR, name)


def write_spec(out: str | Path, spec: ElasticSpec) -> Path:
    return write_text(out, _elastic(SPEC_NAME), spec.model_dump_json(indent=2))


def read_spec(out: str | Path) -> ElasticSpec:
    data = read_bytes(out, _elastic(SPEC_NAME))
    if data is None:
        raise QsyncInputError(f"--out {out}: no {ELASTIC_DIR}/{SPEC_NAME}: not an elastic run's "
                              "folder (start it with qsync-opt train --elastic)")
    try:
        return ElasticSpec.model_validate_json(data)
    except ValueError as exc:
        raise QsyncInputError(f"{ELASTIC_DIR}/{SPEC_NAME}: {str(exc).splitlines()[0]}") from None


def leave_requests(out: str | Path, groups: list[str]) -> dict[str, int | None]:
    """The graceful leaves asked in ``OUT/leave/``: group -> the step it leaves at (None: at
    the next step boundary). A file of another name than a group is ignored; a file that
    does not hold a step number asks for the next boundary."""
    asked: dict[str, int | None] = {}
    try:
        names = [n for n, st in list_names(out, LEAVE_DIR)]
    except (OSError, QsyncInputError):
        return asked
    for name in names:
        if name not in groups:
            continue
        try:
            data = read_bytes(out, Path(LEAVE_DIR, name))
        except (OSError, QsyncInputError):
            data = b""
        text = (data or b"").decode("ascii", errors="replace").strip()
        asked[name] = int(text) if text.isdigit() and len(text) <= 12 else None
    return asked


def remove_leave(out: str | Path, group: str) -> None:
    """The group has left: its leave request goes (the service sees the file gone)."""
    try:
        remove(out, Path(LEAVE_DIR, group))
    except (OSError, QsyncInputError):
        pass


def write_exit(out: str | Path, rank: int, step: int, reason: str,
               groups: list[str]) -> None:
    """A rank leaves its world alive at ``step`` (steps completed) for ``reason``."""
    doc = {"time": time.time(), "step": int(step), "reason": reason, "groups": groups}
    write_text(out, _elastic(f"exit.rank{rank}.json"), json.dumps(doc))


def take_exits(out: str | Path) -> list[dict[str, Any]]:
    """Every exit record the last world's ranks left, removed as read."""
    found = []
    try:
        names = [n for n, _ in list_names(out, ELASTIC_DIR) if _EXIT.fullmatch(n)]
    except (OSError, QsyncInputError):
        return []
    for n in names:
        rel = _elastic(n)
        try:
            doc = json.loads((read_bytes(out, rel) or b"").decode("utf-8"))
            remove(out, rel)
        except (ValueError, OSError, QsyncInputError, RecursionError):
            continue
        if (isinstance(doc, dict) and isinstance(doc.get("time"), (int, float))
                and isinstance(doc.get("step"), int)):
            found.append(doc)
    return found


def reset_run_state(out: str | Path, groups: list[str]) -> None:
    """At launch: what an earlier launch in ``out`` left of its worlds goes (its exit
    records, its world, its pending leave requests, its fired-fault mark), so none of it is
    read as this run's; the checkpoints and the event log stay."""
    try:
        names = [n for n, _ in list_names(out, ELASTIC_DIR)]
    except (OSError, QsyncInputError):
        names = []
    for n in names:
        if _EXIT.fullmatch(n) or n in (WORLD_NAME, FAULT_FIRED):
            remove(out, _elastic(n))
    for g in groups:
        remove_leave(out, g)


def write_world(out: str | Path, doc: dict[str, Any]) -> None:
    write_text(out, _elastic(WORLD_NAME), json.dumps(doc, indent=2))


def read_world(out: str | Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(read_bytes(out, _elastic(WORLD_NAME)) or b"null")
    except (ValueError, OSError, QsyncInputError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None



def write_stop(out: str | Path, reason: str) -> CheckpointSet | None:
    """The run's ``stop`` event (``reason``), at the newest complete checkpoint set, which is
    left as it is and returned (None: there is none)."""
    cs = latest_complete_set(out)
    with EventLog(out) as ev:
        ev.write("stop", cs.step if cs else 0, reason=reason,
                 checkpoint=str(cs.path) if cs else None)
    return cs
