"""Fault injection for the runtime's tests: a plan of faults handed to the trainer.

A :class:`FaultPlan` says which rank fails how at which steps: exits abruptly (``die_at``),
stalls alive and silent (``hang_at``), gets a NaN loss (``nan_at``), or exits abruptly in the
save of a step's checkpoint after writing its own file, before the set is committed
(``die_in_save``). The trainer asks it at those points (:meth:`FaultPlan.at_step`,
:meth:`FaultPlan.nan_loss`, :meth:`FaultPlan.in_save`); :data:`NO_FAULTS` injects nothing.

The torchrun ranks are separate processes, so their tests set environment variables
(:data:`ENV`); :meth:`FaultPlan.from_env` reads them once, at the worker's entry
(:mod:`qsync_opt.job.rank`), never inside a step::

    QSYNC_TEST_DIE_AT_STEP="RANK:STEP[,STEP...]"
    QSYNC_TEST_HANG_AT_STEP="RANK:STEP[,STEP...]"
    QSYNC_TEST_NAN_AT_STEP="RANK:STEP[,STEP...]"
    QSYNC_TEST_DIE_IN_SAVE="RANK:STEP[,STEP...]"
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from qsync_opt.core.errors import QsyncInputError

__all__ = ["DIE_EXIT_CODE", "ENV", "NO_FAULTS", "FaultPlan", "RankSteps", "parse_rank_steps"]

#: rank -> the steps at which a fault strikes it
RankSteps = Mapping[int, frozenset[int]]

#: The exit code of an injected death.
DIE_EXIT_CODE = 17
#: How long an injected hang stalls (the run's collective timeout ends it first).
HANG_S = 3600.0

#: FaultPlan field -> the environment variable that sets it for a torchrun rank.
ENV = {"die_at": "QSYNC_TEST_DIE_AT_STEP", "hang_at": "QSYNC_TEST_HANG_AT_STEP",
       "nan_at": "QSYNC_TEST_NAN_AT_STEP", "die_in_save": "QSYNC_TEST_DIE_IN_SAVE"}

_RANK_STEPS = re.compile(r"(\d+):(\d+(?:,\d+)*),?")


def parse_rank_steps(text: str, where: str) -> dict[int, frozenset[int]]:
    """``"RANK:STEP[,STEP...]"`` as ``{rank: steps}``; QsyncInputError names ``where``."""
    m = _RANK_STEPS.fullmatch(text.strip())
    if m is None:
        raise QsyncInputError(f"{where}: expected RANK:STEP[,STEP...] (e.g. 1:3), got {text!r}")
    return {int(m[1]): frozenset(int(s) for s in m[2].split(","))}


def _exit(code: int) -> None:
    os._exit(code)  # looked up when called, so a test may stand in for it


@dataclass(frozen=True)
class FaultPlan:
    """Which rank fails how at which steps (module docstring). ``exit`` ends the process
    (``os._exit`` by default; a test may pass a function that raises instead)."""

    die_at: RankSteps = field(default_factory=dict)
    hang_at: RankSteps = field(default_factory=dict)
    nan_at: RankSteps = field(default_factory=dict)
    die_in_save: RankSteps = field(default_factory=dict)
    exit: Callable[[int], None] = _exit
    hang_s: float = HANG_S

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FaultPlan:
        """The faults the environment's :data:`ENV` variables ask for (none unset)."""
        env = os.environ if environ is None else environ

        def read(name: str) -> dict[int, frozenset[int]]:
            var = ENV[name]
            return parse_rank_steps(env[var], var) if env.get(var) else {}

        return cls(die_at=read("die_at"), hang_at=read("hang_at"), nan_at=read("nan_at"),
                   die_in_save=read("die_in_save"))

    @property
    def empty(self) -> bool:
        return not (self.die_at or self.hang_at or self.nan_at or self.die_in_save)

    def at_step(self, rank: int, step: int) -> None:
        """Before ``rank``'s forward of ``step``: die or hang there when planned."""
        if step in self.die_at.get(rank, ()):
            self.exit(DIE_EXIT_CODE)
        if step in self.hang_at.get(rank, ()):
            time.sleep(self.hang_s)

    def nan_loss(self, rank: int, step: int) -> bool:
        """Whether ``rank``'s loss of ``step`` is to be made NaN."""
        return step in self.nan_at.get(rank, ())

    def in_save(self, rank: int, step: int) -> None:
        """After ``rank`` wrote its file of ``step``'s checkpoint set: die when planned."""
        if step in self.die_in_save.get(rank, ()):
            self.exit(DIE_EXIT_CODE)


#: No faults.
NO_FAULTS = FaultPlan()
