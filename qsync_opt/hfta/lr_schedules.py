"""Per-model learning-rate schedules for a fused optimizer (:mod:`qsync_opt.hfta.optim`).

:class:`FusedLRSchedule` (built from schedule texts by :func:`fused_schedule`) holds one
:class:`~qsync_opt.strategy.schedule.LRSchedule` per model; ``lr_at(step)`` gives all ``B``
rates and ``apply(optimizer, step)`` sets them.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.hfta.hyperparams import F64, PerModel, is_number
from qsync_opt.hfta.optim import FusedOptimizer
from qsync_opt.strategy.schedule import LRSchedule, parse_schedule

__all__ = ["FusedLRSchedule", "fused_schedule"]


class FusedLRSchedule:
    """One :class:`~qsync_opt.strategy.schedule.LRSchedule` per fused model.

    ``lr_at(step)`` is every model's learning rate at optimizer step ``step`` (an int for
    all, or ``B`` per-model step counts) as a float64 tensor ``[B]``; ``apply(optimizer,
    step)`` sets a fused optimizer's per-model rates to it (and returns them)."""

    def __init__(self, schedules: Sequence[LRSchedule]) -> None:
        if isinstance(schedules, LRSchedule) or not isinstance(schedules, Sequence):
            raise QsyncInputError("FusedLRSchedule: expected a sequence of LRSchedule (one "
                                  f"per model), got {type(schedules).__name__}")
        if len(schedules) < 1:
            raise QsyncInputError("FusedLRSchedule: expected at least one schedule (one per "
                                  "model), got none")
        for i, s in enumerate(schedules):
            if not isinstance(s, LRSchedule):
                raise QsyncInputError(f"FusedLRSchedule: model {i}'s schedule must be an "
                                      f"LRSchedule, got {type(s).__name__}")
        self.schedules: tuple[LRSchedule, ...] = tuple(schedules)

    @property
    def B(self) -> int:
        return len(self.schedules)

    def lr_at(self, step: int | Sequence[int] | Tensor) -> Tensor:
        """Every model's learning rate at ``step`` (float64 ``[B]``)."""
        B = self.B
        if isinstance(step, Tensor) and step.dim() == 0:
            step = int(step.item())
        if isinstance(step, numbers.Integral) and not isinstance(step, bool):
            steps = [int(step)] * B
        else:
            vals = step.tolist() if isinstance(step, Tensor) else step
            if (not isinstance(vals, Sequence) or len(vals) != B
                    or not all(float(v).is_integer() for v in vals)):
                raise QsyncInputError(f"FusedLRSchedule.lr_at: step must be an integer or "
                                      f"{B} integers (one per model), got {step!r}")
            steps = [int(v) for v in vals]
        return torch.tensor([s.lr_at(k) for s, k in zip(self.schedules, steps, strict=True)], dtype=F64)

    def apply(self, optimizer: FusedOptimizer, step: int | Sequence[int] | Tensor) -> Tensor:
        """Set ``optimizer``'s per-model learning rates to ``lr_at(step)``; return them."""
        ob = getattr(optimizer, "B", None)
        if not hasattr(optimizer, "set_lr") or ob is None:
            raise QsyncInputError("FusedLRSchedule.apply: expected a fused optimizer "
                                  f"(FusedSGD, FusedAdamW), got {type(optimizer).__name__}")
        if ob != self.B:
            raise QsyncInputError(f"FusedLRSchedule.apply: the schedule has {self.B} models, "
                                  f"the optimizer B={ob}")
        lrs = self.lr_at(step)
        optimizer.set_lr(lrs)
        return lrs

    def describe(self) -> list[str]:
        """Each model's canonical schedule text."""
        return [s.describe() for s in self.schedules]


def fused_schedule(texts: str | Sequence[str], lrs: PerModel, total_steps: int) -> FusedLRSchedule:
    """One schedule per model from ``--lr-schedule`` texts (one text for all, or ``B``) and
    per-model base learning rates ``lrs`` (``B`` values), each over ``total_steps``."""
    if isinstance(lrs, Tensor):
        lr_list = lrs.detach().reshape(-1).tolist()
    elif isinstance(lrs, Sequence) and not isinstance(lrs, (str, bytes)):
        lr_list = list(lrs)
    elif is_number(lrs):
        lr_list = [float(lrs)] * (1 if isinstance(texts, str) else len(texts))
    else:
        raise QsyncInputError(f"fused_schedule: lrs must be {len(texts)} numbers (one per "
                              f"model), got {type(lrs).__name__}")
    if isinstance(texts, str):
        text_list = [texts] * len(lr_list)
    else:
        text_list = list(texts)
    if len(text_list) != len(lr_list):
        raise QsyncInputError(f"fused_schedule: {len(text_list)} schedule texts for "
                              f"{len(lr_list)} learning rates (one each per model)")
    if not text_list:
        raise QsyncInputError("fused_schedule: expected at least one model, got none")
    out = []
    for i, (text, lr) in enumerate(zip(text_list, lr_list, strict=True)):
        if not isinstance(text, str):
            raise QsyncInputError(f"fused_schedule: model {i}'s schedule must be a string, "
                                  f"got {type(text).__name__}")
        try:
            out.append(parse_schedule(text, float(lr), total_steps))
        except QsyncInputError as e:
            raise QsyncInputError(f"fused_schedule: model {i}: {e}") from None
    return FusedLRSchedule(out)
