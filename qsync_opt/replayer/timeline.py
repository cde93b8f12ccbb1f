"""What one simulated iteration reports: events, per-group timelines, the chrome trace."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Event:
    group: str
    stream: str  # "compute" or "comm"
    kind: str  # fwd, bwd, cast, weight_cast, grad_cast, allreduce, optimizer
    name: str
    start_ms: float
    dur_ms: float
    args: dict[str, Any] | None = None

    @property
    def end_ms(self) -> float:
        return self.start_ms + self.dur_ms


@dataclass
class GroupTimeline:
    name: str
    device: str
    batch_per_device: int
    forward_ms: float
    backward_ms: float
    cast_ms: float
    n_casts: int
    optimizer_ms: float
    end_ms: float
    exposed_comm_ms: float  # communication after the slowest group's backward ended
    straggler_wait_ms: float  # this group idle, waiting for the slowest group's compute
    memory: dict[str, int]
    peak_memory_bytes: int
    capacity_bytes: int

    @property
    def compute_ms(self) -> float:
        """Forward plus backward, casts included."""
        return self.forward_ms + self.backward_ms

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.capacity_bytes


@dataclass
class Timeline:
    """One simulated iteration: per-group times and memory, buckets, critical path, events."""

    iteration_ms: float
    groups: dict[str, GroupTimeline]
    bucket_start_ms: list[float]
    bucket_end_ms: list[float]
    critical_path: list[dict[str, Any]]
    events: list[Event] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: ``[group][bucket]``: when each group has each bucket's gradients (ms; the packet
    #: simulator emits the buckets at these times)
    bucket_ready_ms: list[list[float]] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return all(g.fits for g in self.groups.values())

    @property
    def straggler(self) -> str:
        """The group whose iteration ends last (``end_ms``: its compute, waits, exposed
        all-reduce and optimizer step); among groups ending within 1e-9 of the last, the one
        with the most compute. The one definition the report and the demo use too."""
        last = max(g.end_ms for g in self.groups.values())
        ending = [g for g in self.groups.values() if g.end_ms >= last - 1e-9 * max(last, 1.0)]
        return max(ending, key=lambda g: g.compute_ms).name

    def summary(self) -> dict[str, Any]:
        """JSON-able summary (no events)."""
        return {
            "iteration_ms": self.iteration_ms,
            "fits": self.fits,
            "straggler": self.straggler,
            "groups": {
                n: {
                    "device": g.device, "batch_per_device": g.batch_per_device,
                    "compute_ms": g.compute_ms, "forward_ms": g.forward_ms,
                    "backward_ms": g.backward_ms, "cast_ms": g.cast_ms, "n_casts": g.n_casts,
                    "optimizer_ms": g.optimizer_ms, "end_ms": g.end_ms,
                    "exposed_comm_ms": g.exposed_comm_ms,
                    "straggler_wait_ms": g.straggler_wait_ms,
                    "peak_memory_bytes": g.peak_memory_bytes,
                    "capacity_bytes": g.capacity_bytes, "fits": g.fits, "memory": g.memory,
                }
                for n, g in self.groups.items()
            },
            "buckets": [{"start_ms": s, "end_ms": e}
                        for s, e in zip(self.bucket_start_ms, self.bucket_end_ms, strict=True)],
            "critical_path": self.critical_path,
            "notes": self.notes,
        }

    def chrome_trace(self) -> dict[str, Any]:
        """Chrome/Perfetto trace: a process per group, threads for compute and comm."""
        pids = {name: i + 1 for i, name in enumerate(self.groups)}
        tids = {"compute": 1, "comm": 2}
        out: list[dict[str, Any]] = []
        for name, pid in pids.items():
            g = self.groups[name]
            out.append({"ph": "M", "pid": pid, "name": "process_name",
                        "args": {"name": f"{name} ({g.device}, batch {g.batch_per_device})"}})
            for stream, tid in tids.items():
                out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                            "args": {"name": stream}})
        for ev in self.events:
            item = {"ph": "X", "pid": pids[ev.group], "tid": tids[ev.stream], "name": ev.name,
                    "cat": ev.kind, "ts": ev.start_ms * 1e3, "dur": ev.dur_ms * 1e3}
            if ev.kind in ("cast", "weight_cast", "grad_cast"):
                item["cname"] = "terrible"  # casts stand out in red
            if ev.args:
                item["args"] = ev.args
            out.append(item)
        return {"traceEvents": out, "displayTimeUnit": "ms",
                "otherData": {"iteration_ms": self.iteration_ms}}

    def chrome_trace_json(self) -> str:
        return json.dumps(self.chrome_trace())
