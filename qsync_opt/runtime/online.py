"""A run's online settings: re-planning inside the running world, and injected slowdowns.

:class:`OnlineSpec` is ``TrainConfig.online`` (None: neither). ``replan`` ``auto`` runs the
straggler detector (:mod:`qsync_opt.runtime.straggler`) on every step's per-group compute
time and re-plans when a group is slower than predicted (``train --replan auto``, with
``--replan-threshold``, ``--replan-window`` and ``--replan-calibration``; default ``off``:
the run is as before). ``inject_slowdown`` (``train --inject-slowdown GROUP@STEP=FACTOR``,
repeatable) changes an emulated group's stretch factor from step STEP on: the group's
compute is stretched FACTOR times (its device's own stretch replaced: ``cpu/2`` becoming
``cpu/3`` is FACTOR 3), slept in a multi-process run, reported in emulation, as the
device's own stretch is (:mod:`qsync_opt.runtime.emulate`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Literal

from pydantic import Field, model_validator

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.limits import MAX_STEPS
from qsync_opt.documents.base import Int, Real, Schema
from qsync_opt.runtime.straggler import (
    DEFAULT_CALIBRATION,
    DEFAULT_THRESHOLD,
    DEFAULT_WINDOW,
    StragglerRule,
)

__all__ = ["INJECT_FLAG", "MAX_FACTOR", "OnlineSpec", "SlowdownInjection", "parse_injection"]

INJECT_FLAG = "--inject-slowdown"
#: The largest stretch an injection may set (as ``TrainConfig.slowdown``'s bound).
MAX_FACTOR = 1000.0
_INJECT = re.compile(r"(?P<group>[A-Za-z0-9_.-]+)@(?P<step>[0-9]+)=(?P<factor>[0-9]*\.?[0-9]+)",
                     re.ASCII)


class SlowdownInjection(Schema):
    """From ``step`` on, group ``group``'s compute is stretched ``factor`` times."""

    group: str
    step: Int = Field(ge=0, le=MAX_STEPS)
    factor: Real = Field(ge=1, le=MAX_FACTOR)


def parse_injection(text: str) -> SlowdownInjection:
    """``GROUP@STEP=FACTOR`` (ASCII digits only) as an injection; one line naming the flag."""
    m = _INJECT.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise QsyncInputError(f"{INJECT_FLAG}: expected GROUP@STEP=FACTOR (e.g. "
                              f"cpu_2@10=3), got {text!r}")
    step, factor = int(m["step"]), float(m["factor"])
    if step > MAX_STEPS:
        raise QsyncInputError(f"{INJECT_FLAG}: step {step} is past the most steps a run has "
                              f"({MAX_STEPS})")
    if not (math.isfinite(factor) and 1 <= factor <= MAX_FACTOR):
        raise QsyncInputError(f"{INJECT_FLAG}: factor {m['factor']} must be from 1 to "
                              f"{MAX_FACTOR:g} (the group's compute stretch)")
    return SlowdownInjection(group=m["group"], step=step, factor=factor)


class OnlineSpec(Schema):
    """``TrainConfig.online``: re-planning inside the running world and injected slowdowns."""

    replan: Literal["off", "auto"] = Field(
        "off", description="auto: re-plan when a group is slower than its plan predicts "
        "(the straggler detector); off: never.")
    replan_threshold: Real = Field(DEFAULT_THRESHOLD, description="How much slower (0.1: "
                                   "10%) than calibrated a group must be to count.")
    replan_window: Int = Field(DEFAULT_WINDOW, description="Consecutive slow steps that fire.")
    replan_calibration: Int = Field(DEFAULT_CALIBRATION, description="Steps of each plan that "
                                    "calibrate its prediction before any detection.")
    indicator: str | None = Field(
        None, description="IndicatorTable file the re-plans use (None: computed on this CPU "
        "as qsync-opt solve does, and cached).")
    inject_slowdown: list[SlowdownInjection] = Field(default_factory=list, max_length=1000)

    @model_validator(mode="after")
    def _rule(self) -> OnlineSpec:
        try:
            self.rule()
        except QsyncInputError as exc:
            raise ValueError(f"--{str(exc).replace('_', '-', 1)}") from None
        return self

    def rule(self) -> StragglerRule:
        return StragglerRule(threshold=self.replan_threshold, window=self.replan_window,
                             calibration=self.replan_calibration)

    def check_groups(self, groups: Sequence[str]) -> None:
        """Every injection names a group of the run."""
        for inj in self.inject_slowdown:
            if inj.group not in groups:
                raise QsyncInputError(f"{INJECT_FLAG}: no group {inj.group!r} in this run; "
                                      f"its groups: {', '.join(dict.fromkeys(groups))}")

    def stretch_at(self, group: str, step: int, start: float) -> float:
        """Group ``group``'s stretch at ``step`` (``start``: its device's own)."""
        f = start
        for inj in sorted(self.inject_slowdown, key=lambda i: i.step):
            if inj.group == group and inj.step <= step:
                f = float(inj.factor)
        return f
