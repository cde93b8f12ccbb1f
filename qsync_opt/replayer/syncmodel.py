"""How device groups synchronise: :class:`SyncModel`, DDP's all-reduce and Local SGD / QSR.

The event loop (:mod:`qsync_opt.replayer.loop`) and the incremental path hand a sync model
every group's bucket ready times and get back when each bucket's communication runs.

:class:`AllReduceSync` is DDP: every step, every gradient bucket is all-reduced as soon as
every group has it, and the step's bookkeeping collectives (a 32-byte statistics
all-reduce, a buffer broadcast) follow. :class:`PeriodicSync` is Local SGD and QSR (the
runtime's ``--sync local:H`` / ``qsr:...``): no gradient leaves a rank; every group still
waits for the slowest at each round's end, and the round's averaging (one all-reduce of the
FP32 parameters and buffers) and its statistics all-reduce are paid once per round, so a
step is charged ``(averaging + statistics) / H`` after its optimizer step, ``H`` the mean
round length over the run (:func:`qsync_opt.strategy.modes.rounds`). The replayed
iteration is then the per-step time averaged over the round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from qsync_opt.documents.schemas import CommModel
from qsync_opt.strategy.modes import parse_sync, round_count
from qsync_opt.strategy.schedule import parse_schedule


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


@dataclass(frozen=True)
class PeriodicSync:
    """Local SGD / QSR: parameters averaged once per round of ``mean_period`` steps on
    average (module docstring). ``mode``: the runtime's ``--sync`` text, for the reports."""

    mean_period: float
    mode: str = "local"
    rounds: int | None = None
    steps: int | None = None

    def __post_init__(self) -> None:
        if not self.mean_period >= 1:
            raise ValueError(f"mean_period: expected >= 1, got {self.mean_period!r}")

    @property
    def name(self) -> str:
        return self.mode

    def schedule(self, ready_ms: Sequence[Sequence[float]], bucket_ms: Sequence[float]) -> SyncSchedule:
        """No bucket is sent; every group waits for the slowest one's backward (the barrier
        of the round, paid per step on average)."""
        if not bucket_ms:
            return SyncSchedule([], [])
        barrier = max(r[-1] if len(r) else 0.0 for r in ready_ms) if ready_ms else 0.0
        n = len(bucket_ms)
        return SyncSchedule([barrier] * n, [barrier] * n)

    def round_ms(self, comm: CommModel, param_bytes: int, buffer_bytes: int) -> float:
        """One round's averaging all-reduce and its statistics all-reduce."""
        return float(comm.allreduce_ms(param_bytes + buffer_bytes) + comm.allreduce_ms(32))

    def per_step_ms(self, comm: CommModel, param_bytes: int, buffer_bytes: int) -> float:
        return self.round_ms(comm, param_bytes, buffer_bytes) / self.mean_period

    def describe(self) -> str:
        """One line for the CLI: the mode, its rounds and mean period."""
        return (f"sync {self.mode}: {self.rounds} rounds in {self.steps} steps (mean H "
                f"{self.mean_period:.2f}); no gradient all-reduce, each round's parameter "
                "averaging paid after the optimizer, averaged over its steps")


def sync_model_for(text: str | None, *, lr: float = 0.05, lr_schedule: str = "constant",
                   steps: int = 100) -> SyncModel | None:
    """The replayer's sync model of a runtime ``--sync`` text (None or ``ddp``: DDP's, the
    default); QSR's rounds from the learning-rate schedule of a ``steps``-step run."""
    if text is None:
        return None
    mode = parse_sync(text)
    if mode.kind == "ddp":
        return None
    n = round_count(mode, parse_schedule(lr_schedule, lr, steps), steps)
    return PeriodicSync(mean_period=steps / n, mode=mode.describe(), rounds=n, steps=steps)
