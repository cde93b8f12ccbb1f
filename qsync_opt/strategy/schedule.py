"""Learning-rate schedules: the learning rate of every step as a pure function.

A schedule is written ``KIND[:key=value,...]`` (the ``qsync-opt train --lr-schedule`` flag,
``TrainConfig.lr_schedule``):

``constant``
    ``lr`` at every step (the default; with ``warmup=W``, a linear warm-up first).
``cosine[:warmup=W,final=F]``
    A linear warm-up over the first ``W`` steps (step s < W runs at ``lr * (s + 1) / W``),
    then a cosine from ``lr`` down to ``F * lr`` at the last step (``F`` default 0).
``step:every=N[,gamma=G,warmup=W]``
    The warm-up, then ``lr * G ** floor((s - W) / N)`` (``G`` default 0.1).

The trainer sets every parameter group's learning rate to :meth:`LRSchedule.lr_at` before
each optimizer step, so a schedule holds no state: a resumed run computes the same rates,
and the schedule's text is part of the run's fingerprint (a resume under another schedule is
refused like one under another ``--lr``). Every metrics row carries its step's ``lr``.

The same function serves the QSR sync rule (:mod:`qsync_opt.strategy.modes`), which reads the learning rate
at the start of each round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.limits import parse_float

__all__ = ["LRSchedule", "SCHEDULE_KINDS", "SCHEDULE_SYNTAX", "parse_options",
           "parse_schedule"]

SCHEDULE_KINDS = ("constant", "cosine", "step")


def parse_options(text: str, field: str, allowed: dict[str, type]) -> tuple[str, dict[str, float]]:
    """``KIND[:k=v,...]`` -> (kind, {k: v}); every key in ``allowed`` (its type: int or
    float), each value finite; QsyncInputError names ``field`` and what was expected."""
    kind, _, rest = text.strip().partition(":")
    kind = kind.strip().lower()
    opts: dict[str, float] = {}
    if rest.strip():
        for item in rest.split(","):
            key, eq, val = item.partition("=")
            key = key.strip().lower()
            if not eq or not key:
                raise QsyncInputError(f"{field}: expected key=value after '{kind}:', got "
                                      f"{item.strip()!r}")
            if key not in allowed:
                raise QsyncInputError(
                    f"{field}: {kind} takes {', '.join(allowed) or 'no options'}, got {key!r}")
            if key in opts:
                raise QsyncInputError(f"{field}: {key} given twice")
            got = parse_float(val)
            if got is None:  # ASCII digits only: never '٣', '²' or '1_0'
                raise QsyncInputError(f"{field}: {key} must be a finite number in ASCII "
                                      f"digits, got {val.strip()!r}")
            num = got
            if allowed[key] is int:
                if not num.is_integer():
                    raise QsyncInputError(f"{field}: {key} must be an integer, got "
                                          f"{val.strip()!r}")
                num = int(num)
            opts[key] = num
    return kind, opts


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate of every step of a run of ``total_steps`` (module docstring)."""

    kind: str
    lr: float
    total_steps: int
    warmup: int = 0
    final: float = 0.0   # cosine: the last step's lr as a fraction of ``lr``
    every: int = 0       # step: steps between decays
    gamma: float = 0.1   # step: the decay factor

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULE_KINDS:
            raise QsyncInputError(f"lr_schedule: expected one of {', '.join(SCHEDULE_KINDS)}, "
                                  f"got {self.kind!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise QsyncInputError(f"lr: expected a finite number > 0, got {self.lr!r}")
        if self.total_steps < 1:
            raise QsyncInputError(f"steps: expected an integer >= 1, got {self.total_steps}")
        if not 0 <= self.warmup < self.total_steps:
            raise QsyncInputError(f"lr_schedule: warmup must be >= 0 and below the run's "
                                  f"{self.total_steps} steps, got {self.warmup}")
        if not 0 <= self.final <= 1:
            raise QsyncInputError(f"lr_schedule: final must be in [0, 1], got {self.final:g}")
        if self.kind == "step" and self.every < 1:
            raise QsyncInputError("lr_schedule: step needs every=N with N >= 1 (steps between "
                                  "decays)")
        if not 0 < self.gamma <= 1:
            raise QsyncInputError(f"lr_schedule: gamma must be in (0, 1], got {self.gamma:g}")

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based)."""
        s = min(max(int(step), 0), self.total_steps - 1)
        if s < self.warmup:
            return self.lr * (s + 1) / self.warmup
        if self.kind == "constant":
            return self.lr
        if self.kind == "step":
            return self.lr * self.gamma ** ((s - self.warmup) // self.every)
        span = self.total_steps - 1 - self.warmup
        frac = 1.0 if span <= 0 else (s - self.warmup) / span
        lo = self.final * self.lr
        return lo + (self.lr - lo) * 0.5 * (1.0 + math.cos(math.pi * frac))

    def in_warmup(self, step: int) -> bool:
        return step < self.warmup

    def describe(self) -> str:
        """The canonical text (what the fingerprint and the checkpoint hold)."""
        parts = []
        if self.warmup:
            parts.append(f"warmup={self.warmup}")
        if self.kind == "cosine" and self.final:
            parts.append(f"final={self.final:g}")
        if self.kind == "step":
            parts += [f"every={self.every}", f"gamma={self.gamma:g}"]
        return self.kind + (":" + ",".join(parts) if parts else "")


_SCHEDULE_KEYS: dict[str, dict[str, type]] = {
    "constant": {"warmup": int},
    "cosine": {"warmup": int, "final": float},
    "step": {"every": int, "gamma": float, "warmup": int},
}
#: The keys a kind needs, and the letter each value is written as in the syntax.
_REQUIRED = {"step": ("every",)}
_LETTERS = {"warmup": "W", "final": "F", "every": "N", "gamma": "G"}


def _syntax(kind: str) -> str:
    keys = _SCHEDULE_KEYS[kind]
    need = [k for k in keys if k in _REQUIRED.get(kind, ())]
    rest = [k for k in keys if k not in need]
    text = kind + (":" + ",".join(f"{k}={_LETTERS[k]}" for k in need) if need else "")
    if rest:
        text += ("[," if need else "[:") + ",".join(f"{k}={_LETTERS[k]}" for k in rest) + "]"
    return text


#: Every schedule and every key :func:`parse_schedule` takes, as the help texts show them.
SCHEDULE_SYNTAX = (", ".join(_syntax(k) for k in list(_SCHEDULE_KEYS)[:-1]) + " or "
                   + _syntax(list(_SCHEDULE_KEYS)[-1]))


def parse_schedule(text: str, lr: float, total_steps: int) -> LRSchedule:
    """``--lr-schedule`` text -> :class:`LRSchedule` (QsyncInputError names the field)."""
    kind, _, _ = text.strip().partition(":")
    kind = kind.strip().lower()
    if kind not in _SCHEDULE_KEYS:
        raise QsyncInputError(f"lr_schedule: expected {SCHEDULE_SYNTAX}, got "
                              f"{text.strip()!r}")
    kind, opts = parse_options(text, "lr_schedule", _SCHEDULE_KEYS[kind])
    return LRSchedule(kind=kind, lr=float(lr), total_steps=int(total_steps),
                      warmup=int(opts.get("warmup", 0)), final=float(opts.get("final", 0.0)),
                      every=int(opts.get("every", 0)), gamma=float(opts.get("gamma", 0.1)))
