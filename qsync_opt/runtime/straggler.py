"""The straggler detector: when a group is slower than its plan predicts, for long enough.

Pure and deterministic: it sees one step's per-group measured compute time at a time (the
same numbers on every rank: they are shared by one all-reduce per step), so every rank
takes the same decision at the same step.

The rule (:class:`StragglerRule`, the defaults below, ``train --replan-*`` flags):

* **Calibration.** For the first ``calibration`` steps of each plan (the run's first, and
  every re-plan's) the detector only records, per group, the ratio measured / predicted;
  the group's calibration is the median of those ratios. A cost model that is uniformly
  off (the planner's figures are for a card, the measurement is this CPU) is absorbed
  there and never fires.
* **Detection.** Afterwards each step's ratio is divided by the calibration: the group's
  *excess*. A group whose excess is above ``1 + threshold`` on ``window`` consecutive steps
  fires; one step at or below it restarts the count, so one slow step never fires.
* **The factor.** The median excess over those ``window`` steps: what the group's compute
  costs are scaled by in the re-plan (cumulative with earlier re-plans' factors).
* **Hysteresis.** After a fire the detector waits for the re-plan (:meth:`replanned`) and
  then calibrates again, so two re-plans are at least ``calibration + window`` steps apart;
  only slowdowns fire (a faster group never does) and factors only grow, so a constant
  slowdown gives one re-plan, and noise around the calibration gives none.

Defaults: a threshold of 10% over 20 steps, calibrated on 5. The measured coefficient of
variation of the per-group compute time on the CPU test workloads is a few percent
(benchmarks/bench_elastic.py ``noise`` prints it), so 20 consecutive steps over +10% by
chance is far out of reach, while an injected 1.5x slowdown is seen on every step.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

from qsync_opt.core.errors import QsyncInputError

__all__ = ["DEFAULT_CALIBRATION", "DEFAULT_THRESHOLD", "DEFAULT_WINDOW", "Fire",
           "StragglerDetector", "StragglerRule", "coefficient_of_variation"]

#: A group must be this much slower than calibrated (relative) ...
DEFAULT_THRESHOLD = 0.10
#: ... on this many consecutive steps ...
DEFAULT_WINDOW = 20
#: ... after this many steps of each plan calibrated the prediction.
DEFAULT_CALIBRATION = 5
#: The most steps of either (a window longer than any run is "never").
MAX_STEPS = 1_000_000


@dataclass(frozen=True)
class StragglerRule:
    """The detector's settings (module docstring); refused in one line naming the field."""

    threshold: float = DEFAULT_THRESHOLD
    window: int = DEFAULT_WINDOW
    calibration: int = DEFAULT_CALIBRATION

    def __post_init__(self) -> None:
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (
                math.isfinite(t) and 0 < t <= 10):
            raise QsyncInputError(f"replan_threshold: expected a fraction in (0, 10] (0.1: "
                                  f"10% slower), got {t!r}")
        for name in ("window", "calibration"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_STEPS:
                raise QsyncInputError(f"replan_{name}: expected a whole number of steps "
                                      f"from 1 to {MAX_STEPS}, got {v!r}")


@dataclass(frozen=True)
class Fire:
    """A decision to re-plan: the step it was taken at, and the slower groups' factors."""

    step: int
    factors: dict[str, float]


@dataclass
class _Group:
    calib: list[float] = field(default_factory=list)
    scale: float | None = None  # the calibration (median ratio), once made
    run: list[float] = field(default_factory=list)  # the current run of excess steps


class StragglerDetector:
    """Feed :meth:`observe` one step at a time; it returns a :class:`Fire` or None."""

    def __init__(self, rule: StragglerRule, predicted_ms: Mapping[str, float]) -> None:
        self.rule = rule
        self.waiting = False
        self._set(predicted_ms)

    def _set(self, predicted_ms: Mapping[str, float]) -> None:
        bad = [g for g, v in predicted_ms.items() if not (math.isfinite(v) and v > 0)]
        if bad or not predicted_ms:
            raise QsyncInputError(f"predicted_group_ms: expected positive times per group, "
                                  f"got {dict(predicted_ms)!r}")
        self.predicted = dict(predicted_ms)
        self.groups = {g: _Group() for g in self.predicted}

    def replanned(self, predicted_ms: Mapping[str, float]) -> None:
        """A new plan runs from the next step: calibrate again against its predictions."""
        self.waiting = False
        self._set(predicted_ms)

    def excess(self, group: str) -> list[float]:
        """The current run of excess ratios of ``group`` (for the log)."""
        return list(self.groups[group].run)

    def observe(self, step: int, measured_ms: Mapping[str, float]) -> Fire | None:
        """One step's measured compute time per group (ms); a :class:`Fire` when some
        group has been slow for ``window`` consecutive steps after calibration."""
        if self.waiting:
            return None
        rule = self.rule
        fired: dict[str, float] = {}
        for g, st in self.groups.items():
            m = measured_ms.get(g)
            if m is None or not math.isfinite(m) or m <= 0:
                st.run.clear()  # no measurement: no evidence either way
                continue
            ratio = m / self.predicted[g]
            if st.scale is None:
                st.calib.append(ratio)
                if len(st.calib) >= rule.calibration:
                    st.scale = statistics.median(st.calib)
                continue
            ex = ratio / st.scale
            if ex > 1.0 + rule.threshold:
                st.run.append(ex)
                if len(st.run) >= rule.window:
                    fired[g] = statistics.median(st.run[-rule.window:])
            else:
                st.run.clear()
        if not fired:
            return None
        self.waiting = True
        return Fire(step=step, factors=fired)


def coefficient_of_variation(values: list[float]) -> float:
    """Standard deviation over mean (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    mean = statistics.fmean(values)
    return statistics.stdev(values) / mean if mean > 0 else 0.0
