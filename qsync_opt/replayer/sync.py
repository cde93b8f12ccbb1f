"""How device groups synchronise gradients: :class:`SyncModel` and DDP's all-reduce.

The event loop (:mod:`qsync_opt.replayer.loop`) and the incremental path hand a sync model
every group's bucket ready times and get back when each bucket's communication runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SyncSchedule:
    """When each gradient bucket's communication starts and ends (ms from iteration start)."""

    start_ms: list[float]
    end_ms: list[float]

    @property
    def comm_end_ms(self) -> float:
        return self.end_ms[-1] if self.end_ms else 0.0


class SyncModel(Protocol):
    """How groups synchronise gradients. Local SGD, pipeline transfers and packet-level
    networks plug in here with the same inputs: per-group bucket ready times."""

    @property
    def name(self) -> str:
        """The model's name (``"allreduce"``)."""
        ...

    def schedule(self, ready_ms: Sequence[Sequence[float]], bucket_ms: Sequence[float]) -> SyncSchedule:
        """``ready_ms[g][k]``: when group g has bucket k's gradients; ``bucket_ms[k]``: its cost."""
        ...


@dataclass(frozen=True)
class AllReduceSync:
    """DDP: bucket k starts when every group has it ready and bucket k-1 is done."""

    name: str = "allreduce"

    def schedule(self, ready_ms: Sequence[Sequence[float]], bucket_ms: Sequence[float]) -> SyncSchedule:
        start: list[float] = []
        end: list[float] = []
        prev = 0.0
        for k, cost in enumerate(bucket_ms):
            s = max(prev, max(r[k] for r in ready_ms))
            start.append(s)
            prev = s + cost
            end.append(prev)
        return SyncSchedule(start, end)
