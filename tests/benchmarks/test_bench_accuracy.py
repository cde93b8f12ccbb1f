"""benchmarks/bench_accuracy.py's plan drawing: random plans of equal predicted time and the
target between the low end and fp32 (no training here)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_benchmark

from qsync_opt import estimate, parse_shorthand, trace
from qsync_opt.indicator import indicate
from qsync_opt.problem.program import AllocationProblem

B = load_benchmark("bench_accuracy")


@pytest.fixture(scope="module")
def prob() -> AllocationProblem:
    g = trace("digits_cnn", 32)
    cluster = parse_shorthand("v100x1@32+t4:int4x1@32")
    return AllocationProblem(g, cluster, estimate(g, cluster),
                             indicate("digits_cnn", 1, "random", batch=32, cache=False))


def test_int4_flag_uses_the_library() -> None:
    shorthand, cluster = B.build_cluster("v100x1+t4x1", 32, int4=True)
    assert [g.device for g in cluster.groups] == ["v100", "t4:int4"]
    assert shorthand == "v100x1@32+t4:int4x1@32"


def test_random_plans_within_one_percent_and_distinct(prob: AllocationProblem) -> None:
    target = B.target_for(prob, 1.0)["fp32_ms"]  # a band that holds several plans
    for seed in range(5):
        a = B.random_plan(prob, target, seed)
        assert abs(prob.makespan_ms(a) - target) <= 0.01 * target
    plans = B.random_plans(prob, target, 5)
    assert len({B.key_of(a) for _, a in plans}) == 5
    assert all(abs(prob.makespan_ms(a) - target) <= 0.01 * target for _, a in plans)
    assert all(a["v100"] == prob.group("v100").reference for _, a in plans)


def test_random_plans_refuse_a_band_too_sparse(prob: AllocationProblem) -> None:
    fastest = B.target_for(prob, 0.0)["low_ms"]  # only the fastest plan lies near it
    with pytest.raises(SystemExit, match="distinct"):
        B.random_plans(prob, fastest, 5)


def test_target_between_low_end_and_fp32(prob: AllocationProblem) -> None:
    for f in (0.0, 0.25, 0.5, 1.0):
        tg = B.target_for(prob, f)
        assert tg["low_ms"] == min(tg["up_ms"], tg["fastest_ms"])
        assert tg["low_ms"] <= tg["target_ms"] <= tg["fp32_ms"]
    tg = B.target_for(prob, 0.5)
    assert tg["target_ms"] == pytest.approx((tg["low_ms"] + tg["fp32_ms"]) / 2)


def test_versus_median_and_goal() -> None:
    d, h = B.versus_median([1.0, 2.0, 3.0], [[2.0, 3.0, 4.0], [2.1, 3.1, 4.1], [9.0, 9.0, 9.0]])
    assert d == pytest.approx(-1.1) and h == pytest.approx(0.0, abs=1e-9)
    assert not B.goal_holds(-0.1, 0.2) and B.goal_holds(-0.3, 0.2) and not B.goal_holds(0.3, 0.1)


def test_random_plans_are_never_an_excluded_plan(prob: AllocationProblem) -> None:
    target = B.target_for(prob, 1.0)["fp32_ms"]
    first = B.random_plans(prob, target, 5)
    banned = {B.key_of(a) for _, a in first[:2]}
    again = B.random_plans(prob, target, 3, exclude=banned)
    assert not banned & {B.key_of(a) for _, a in again}


def test_train_seed_range_and_results_key(prob: AllocationProblem) -> None:
    import argparse

    assert list(B.parse_seed_range("5-9")) == [5, 6, 7, 8, 9]
    assert list(B.parse_seed_range("3")) == [3]
    for bad in ("9-5", "a-b", "-1", "2-x"):
        with pytest.raises(SystemExit, match="--train-seeds"):
            B.parse_seed_range(bad)
    plan = prob.make_plan({gm.name: [0] * len(gm.choices) for gm in prob.groups})
    base = {"model": "digits_cnn", "float_gemm": False, "emulate_half": False}
    old = argparse.Namespace(**base)  # a namespace from before --lr-schedule existed
    const = argparse.Namespace(**base, lr_schedule="constant")
    cos = argparse.Namespace(**base, lr_schedule="cosine:warmup=15")
    k = [B.training_key(a, plan, 0, 150, 0.05, "sgd", 32, 8) for a in (old, const, cos)]
    assert k[0] == k[1]  # results recorded before the flag keep their keys
    assert k[2] != k[1]  # a schedule is part of what decides a training


def test_bad_study_flags_exit_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--train-seeds: needs --results"):
        B.main(["--train-seeds", "0-3"])
    with pytest.raises(SystemExit, match="--confirm-from"):
        B.main(["--seeds", "5", "--confirm-from", "4"])
    with pytest.raises(SystemExit, match="--lr-schedule"):
        B.main(["--lr-schedule", "warm:3", "--plans-only"])
