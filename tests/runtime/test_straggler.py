"""The straggler detector (qsync_opt/runtime/straggler.py): pure, so every case is exact."""

from __future__ import annotations

import random
from typing import Any

import pytest

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.runtime.straggler import (
    Fire,
    StragglerDetector,
    StragglerRule,
    coefficient_of_variation,
)

PRED = {"fast": 10.0, "slow": 20.0}


def _run(det: StragglerDetector, steps: list[dict[str, float]], start: int = 0
         ) -> list[Fire]:
    fires = []
    for k, m in enumerate(steps):
        got = det.observe(start + k, m)
        if got is not None:
            fires.append(got)
    return fires


def _steady(n: int, fast: float = 13.0, slow: float = 26.0) -> list[dict[str, float]]:
    return [{"fast": fast, "slow": slow} for _ in range(n)]


def test_a_uniformly_wrong_cost_model_never_fires() -> None:
    # measured 1.3x the prediction on every group and every step: the calibration absorbs it
    det = StragglerDetector(StragglerRule(threshold=0.1, window=3, calibration=2), PRED)
    assert _run(det, _steady(200)) == []


def test_a_sustained_slowdown_fires_after_window_steps_with_its_factor() -> None:
    det = StragglerDetector(StragglerRule(threshold=0.1, window=4, calibration=2), PRED)
    steps = _steady(10) + _steady(10, slow=26.0 * 1.5)
    fires = _run(det, steps)
    assert len(fires) == 1
    assert fires[0].step == 10 + 4 - 1  # the 4th slow step
    assert fires[0].factors == {"slow": pytest.approx(1.5)}
    # waiting for the re-plan: nothing more fires
    assert _run(det, _steady(20, slow=100.0), start=20) == []


def test_a_slowdown_of_every_group_alike_never_fires() -> None:
    # the machine gets busy: every group 2x slower from step 10 on (nothing to re-balance)
    det = StragglerDetector(StragglerRule(threshold=0.1, window=3, calibration=2), PRED)
    assert _run(det, _steady(10) + _steady(50, fast=26.0, slow=52.0)) == []
    # one group alone: measured against its own prediction
    solo = StragglerDetector(StragglerRule(threshold=0.1, window=3, calibration=2),
                             {"only": 10.0})
    assert len(_run(solo, [{"only": 10.0}] * 5 + [{"only": 20.0}] * 3)) == 1


def test_an_isolated_slow_step_never_fires() -> None:
    det = StragglerDetector(StragglerRule(threshold=0.1, window=3, calibration=2), PRED)
    steps = _steady(5)
    for _ in range(20):  # two slow steps, one normal, again and again: never 3 in a row
        steps += _steady(2, slow=80.0) + _steady(1)
    assert _run(det, steps) == []
    assert _run(det, _steady(1, slow=80.0) * 3, start=100)  # three in a row do


def test_after_a_replan_it_calibrates_again_and_does_not_flip_flop() -> None:
    rule = StragglerRule(threshold=0.1, window=3, calibration=4)
    det = StragglerDetector(rule, PRED)
    fires = _run(det, _steady(1 + 4) + _steady(3, slow=52.0))  # warm-up, calibration, slow
    assert [f.factors for f in fires] == [{"slow": pytest.approx(2.0)}]
    # the re-plan predicts the slowed group at 2x: the same measured times are normal now
    det.replanned({"fast": 10.0, "slow": 40.0})
    assert _run(det, _steady(100, slow=52.0), start=10) == []
    # the slowdown goes away: against the others, "fast" now looks 2x slower; one fire,
    # whose factor folded with the first (the run normalises them: job/online.py) gives
    # back the first prediction, and then nothing more fires
    fires = _run(det, _steady(100, slow=26.0), start=110)
    assert [f.factors for f in fires] == [{"fast": pytest.approx(2.0)}]
    det.replanned(PRED)
    assert _run(det, _steady(100), start=300) == []


@pytest.mark.parametrize("first", [{"fast": 39.0, "slow": 26.0}, {"fast": 13.0, "slow": 9.0},
                                   {"fast": 130.0, "slow": 260.0}])
def test_each_plans_warm_up_step_is_not_calibrated(first: dict[str, float]) -> None:
    """A plan's first step (allocations, a switched layer's first run) is neither calibrated
    nor detected: calibrated on it, a median of two steps would take a slow first step for
    the group's normal pace and make the steady steps after it a slowdown of the other."""
    rule = StragglerRule(threshold=0.1, window=3, calibration=2)
    det = StragglerDetector(rule, PRED)
    assert _run(det, [first] + _steady(50)) == []
    det.replanned(PRED)  # and again at every new plan's start
    assert _run(det, [first] + _steady(50), start=100) == []


def test_noise_below_the_threshold_never_fires() -> None:
    rng = random.Random(0)
    det = StragglerDetector(StragglerRule(), PRED)  # the defaults: 10% over 20 steps
    steps = [{"fast": 13.0 * rng.uniform(0.95, 1.05), "slow": 26.0 * rng.uniform(0.95, 1.05)}
             for _ in range(2000)]
    assert _run(det, steps) == []
    assert 0.02 < coefficient_of_variation([s["slow"] for s in steps]) < 0.04


def test_a_missing_or_bad_measurement_is_no_evidence() -> None:
    det = StragglerDetector(StragglerRule(threshold=0.1, window=3, calibration=1), PRED)
    steps = _steady(1) + _steady(2, slow=60.0) + [{"fast": 13.0, "slow": float("nan")}]
    steps += _steady(2, slow=60.0) + [{"fast": 13.0}] + _steady(2, slow=60.0)
    assert _run(det, steps) == []


@pytest.mark.parametrize("kw", [
    {"threshold": 0}, {"threshold": -0.1}, {"threshold": float("nan")},
    {"threshold": float("inf")}, {"threshold": 11}, {"threshold": True}, {"threshold": "0.1"},
    {"window": 0}, {"window": -3}, {"window": 2.5}, {"window": 10**9}, {"window": True},
    {"calibration": 0}, {"calibration": "٣"},
])
def test_a_hostile_rule_is_refused_naming_the_field(kw: dict[str, Any]) -> None:
    field = next(iter(kw))
    with pytest.raises(QsyncInputError, match=f"^replan_{field}: "):
        StragglerRule(**kw)


@pytest.mark.parametrize("pred", [{}, {"a": 0.0}, {"a": -1.0}, {"a": float("nan")},
                                  {"a": float("inf")}])
def test_bad_predictions_are_refused(pred: dict[str, float]) -> None:
    with pytest.raises(QsyncInputError, match="predicted_group_ms"):
        StragglerDetector(StragglerRule(), pred)
