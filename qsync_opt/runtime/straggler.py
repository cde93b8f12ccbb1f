"""The straggler detector: when a group is slower than its plan predicts, for long enough.

Pure and deterministic: it sees one step's per-group measured compute time at a time (the
same numbers on every rank: they are shared by one all-reduce per step), so every rank
takes the same decision at the same step.

The rule (:class:`StragglerRule`, the defaults below, ``train --replan-*`` flags):

* **Calibration.** The first step of each plan (the run's first, and every re-plan's) is a
  warm-up and is not used (allocations, a switched layer's first run); for the next
  ``calibration`` steps the detector only records, per group, the ratio measured /
  predicted; the group's calibration is their median. A cost model that is off (the planner's
  figures are for a card, the measurement is this CPU) is absorbed there and never fires.
* **Detection.** Afterwards each step's ratio is divided by the calibration, and then by
  the smallest such value of any group that step (with one group, by 1): the group's
  *excess*. What slows every group alike (the machine busy with another job) cancels, and
  only what a re-plan can move (one group slower than the others) remains. A group whose excess is above ``1 + threshold`` on ``window`` consecutive steps
  fires; one step at or below it restarts the count, so one slow step never fires.
* **The factor.** The median excess over those ``window`` steps: what the group's compute
  costs are scaled by in the re-plan (cumulative with earlier re-plans' factors).
* **Hysteresis.** After a fire the detector waits for the re-plan (:meth:`replanned`) and
  then calibrates again, so two re-plans are at least ``1 + calibration + window`` steps apart;
  only a group slower than the others fires, so a constant slowdown gives one re-plan and
  noise around the calibration none. A slowdown that goes away shows as the other groups
  slower: one more re-plan, whose factors (the run folds each fire's into the last and
  divides by the least) give back the first plan; no state alternates.

Defaults: a threshold of 10% over 20 consecutive steps, calibrated on 10 after one warm-up step. What they stand on
is the noise of a group's compute time, which ``benchmarks/bench_elastic.py --section noise``
measures: its coefficient of variation, the share of steps over +10% of the median, and the
longest run of such steps. It is the run, not the threshold, that keeps noise from firing:
one step over +10% is common on a shared CPU (a quarter of the steps of a 1 ms model on two
cores shared by five jobs, with a longest run of 15 in 200 steps), 20 in a row is not, while
a real slowdown of 1.5x or more is over the threshold on every step. On a machine noisier
than that, raise ``--replan-window``; a false fire costs one re-solve, and a re-plan is
never predicted slower than the running plan.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

from qsync_opt.core.errors import QsyncInputError

__all__ = ["DEFAULT_CALIBRATION", "DEFAULT_THRESHOLD", "DEFAULT_WINDOW", "WARMUP_STEPS", "Fire",
           "StragglerDetector", "StragglerRule", "coefficient_of_variation"]

#: A group must be this much slower than calibrated (relative) ...
DEFAULT_THRESHOLD = 0.10
#: ... on this many consecutive steps ...
DEFAULT_WINDOW = 20
#: ... after this many steps of each plan calibrated the prediction. Ten, not fewer: on a
#: CPU a group's compute time can sit in two modes 30% apart for several steps (measured:
#: digits_cnn at 4.0 or 5.3 ms), and a calibration made of five steps in one mode made the
#: other mode look like a slowdown of the *other* group (a false re-plan of x1.22, and a
#: slowdown of x3 measured as x1.8 or x3.5; benchmarks/bench_elastic.py --section online).
DEFAULT_CALIBRATION = 10
#: The steps at the start of each plan that neither calibrate nor detect (the warm-up).
WARMUP_STEPS = 1
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
    calib_done: bool = False  # calibrated before this step (so this step is detected)
    warm: int = 0  # warm-up steps seen of this plan
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

    def observe(self, step: int, measured_ms: Mapping[str, float]) -> Fire | None:
        """One step's measured compute time per group (ms); a :class:`Fire` when some
        group has been slow for ``window`` consecutive steps after calibration."""
        if self.waiting:
            return None
        rule = self.rule
        fired: dict[str, float] = {}
        ratios = {g: m / self.predicted[g] for g in self.groups
                  if (m := measured_ms.get(g)) is not None and math.isfinite(m) and m > 0}
        for g, st in self.groups.items():
            if g not in ratios:
                st.run.clear()  # no measurement: no evidence either way
            elif st.warm < WARMUP_STEPS:
                st.warm += 1  # the plan's first step: allocations, a switched layer's first run
            elif st.scale is None:
                st.calib.append(ratios[g])
                if len(st.calib) >= rule.calibration:
                    st.scale = statistics.median(st.calib)
        # each group against its calibration, then against the least slowed group: what
        # slows every group alike (the machine busy, a cost model off for all) cancels, and
        # only what a re-plan can move remains
        cal = {g: ratios[g] / st.scale for g, st in self.groups.items()
               if g in ratios and st.scale is not None and st.calib_done}
        ref = min(cal.values()) if len(cal) >= 2 else 1.0
        for g, ex in cal.items():
            st = self.groups[g]
            ex /= ref
            if ex > 1.0 + rule.threshold:
                st.run.append(ex)
                if len(st.run) >= rule.window:
                    fired[g] = statistics.median(st.run[-rule.window:])
            else:
                st.run.clear()
        for st in self.groups.values():  # a group calibrated this step counts from the next
            st.calib_done = st.scale is not None
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
