"""The re-plan API (qsync_opt/planner/replan.py): the problem built once, a re-plan a solve.

Every case runs on the CPU workloads with a random indicator (no model is run) and the
fixed ``cpu`` figures, so the plans do not depend on this machine.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

import qsync_opt as qs
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.planner.replan import ReplanCache, even_cluster
from qsync_opt.planner.solve import solve
from qsync_opt.problem.evaluator import evaluate
from qsync_opt.problem.plan import check_plan
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.problem.synthetic import random_indicator

#: (workload, cluster): two and three groups of emulated CPUs, batches even.
CASES = {"digits": ("digits_cnn", "cpux1@32+cpu/2x1@32"),
         "gpt": ("tiny_gpt", "cpux1@8+cpu/2x2@8")}


@pytest.fixture(autouse=True, scope="module")
def _fixed_cpu(fixed_cpu_module: Any) -> Any:
    return fixed_cpu_module


@functools.cache
def _inputs(case: str) -> tuple[Any, Any, Any]:
    workload, shorthand = CASES[case]
    graph = qs.trace(workload)
    return graph, qs.load_cluster(shorthand), random_indicator(graph, 0)


def _fresh(case: str, cluster: Any) -> Any:
    """A plan solved from scratch on ``cluster`` as a re-plan solves (joint split, CP-SAT,
    no refinement)."""
    graph, _, ind = _inputs(case)
    problem = AllocationProblem(graph, cluster, qs.estimate(graph, cluster), ind)
    plan, _ = solve(problem, "cpsat", refine=0, joint_split=True, compare_ties=False)
    return plan


@functools.cache
def _cache(case: str) -> ReplanCache:
    graph, cluster, ind = _inputs(case)
    return ReplanCache.build(_fresh(case, cluster), graph, indicator=ind)


def _names(case: str) -> list[str]:
    return [g.name for g in _inputs(case)[1].groups]


def _scored(case: str, plan: Any, factors: dict[str, float]) -> tuple[float, dict[str, float]]:
    return _cache(case).predict(plan, factors)


# ---------------------------------------------------------------- subsets and slowdowns


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_change_gives_the_original_plan(case: str) -> None:
    cache = _cache(case)
    for slowdown in ({}, dict.fromkeys(_names(case), 1.0)):
        got = cache.replan(_names(case), slowdown)
        assert got.plan.groups == cache.plan.groups
        assert got.plan.cluster.groups == cache.plan.cluster.groups
        assert not any(line.startswith("batch split moved") for line in got.changes)
        assert got.solve_s > 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_subset_equals_a_fresh_solve_of_the_subset(case: str) -> None:
    cache = _cache(case)
    names = _names(case)
    graph = _inputs(case)[0]
    for keep in (names[:1], names[1:], names[::-1][:2]):
        got = cache.replan(list(reversed(keep)))  # order does not matter
        sub, total = even_cluster(cache.plan.cluster, keep, cache.global_batch)
        assert total == cache.global_batch
        fresh = _fresh(case, sub)
        assert got.plan.groups == fresh.groups
        assert [g.name for g in got.plan.cluster.groups] == [n for n in names if n in keep]
        check_plan(got.plan, graph)
        ev = evaluate(cache.problem, got.plan)
        assert ev.fits and ev.global_batch == cache.global_batch
        assert math.isclose(got.predicted_step_ms, ev.makespan_ms, rel_tol=1e-9)
        assert set(got.predicted_group_ms) == set(keep)
        gone = any(line.startswith("groups gone:") for line in got.changes)
        assert gone == (len(keep) < len(names))


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_slowed_group_is_lightened_and_never_slower(case: str) -> None:
    cache = _cache(case)
    names = _names(case)
    for slow in names:
        for f in (1.3, 2.0, 4.0):
            got = cache.replan(names, {slow: f})
            old_step, old_groups = _scored(case, cache.plan, {slow: f})
            assert got.predicted_step_ms <= old_step * (1 + 1e-9)
            new_batch = got.plan.groups[slow].batch_per_device
            old_batch = cache.plan.groups[slow].batch_per_device
            # less compute asked of the slowed group: a smaller batch, or lower precisions
            assert (new_batch < old_batch
                    or got.predicted_group_ms[slow] <= old_groups[slow] * (1 + 1e-9))
            assert any(f"scaled by {f:g}" in line for line in got.changes)
            check_plan(got.plan, cache.problem.graph)
    # a real slowdown of the straggler moves its samples away or lowers it
    got = cache.replan(names, {names[-1]: 4.0})
    assert got.plan.groups != cache.plan.groups


def test_slowdown_scales_the_predicted_compute() -> None:
    cache = _cache("digits")
    names = _names("digits")
    _, base = _scored("digits", cache.plan, {})
    _, slowed = _scored("digits", cache.plan, {names[1]: 2.5})
    assert math.isclose(slowed[names[1]], 2.5 * base[names[1]], rel_tol=1e-12)
    assert slowed[names[0]] == base[names[0]]


def test_global_batch_given_lowered_and_refused() -> None:
    cache = _cache("digits")
    names = _names("digits")
    got = cache.replan(names, global_batch=48)
    assert sum(p.batch_per_device for p in got.plan.groups.values()) == 48
    assert f"global batch {cache.global_batch} -> 48 (as asked)" in got.changes
    # an odd global batch over the 2 CPUs of gpt's last group alone cannot be split exactly
    gpt = _cache("gpt")
    last = _names("gpt")[-1]
    got = gpt.replan([last], global_batch=33)
    assert got.plan.groups[last].batch_per_device == 16
    assert got.changes[1].startswith("global batch 33 -> 32: no split over cpu_2 x2")
    with pytest.raises(QsyncInputError, match="global_batch: 1 samples cannot give each"):
        gpt.replan(_names("gpt"), global_batch=1)


def test_survivors_that_cannot_hold_the_batch_are_named() -> None:
    graph, cluster, ind = _inputs("digits")
    small = qs.load_cluster("cpux1@32+cpu/2:4mx1@32")
    plan = _fresh("digits", small)
    cache = ReplanCache.build(plan, graph, indicator=ind)
    with pytest.raises(QsyncInputError, match=r"^global_batch: no plan of cpu_2 holds the "
                                              r"global batch 64: .*cpu_2"):
        cache.replan(["cpu_2"])


# ---------------------------------------------------------------- hostile inputs


@pytest.mark.parametrize(("groups", "slowdown", "batch", "match"), [
    ([], {}, None, "groups: no group present"),
    ("cpu", {}, None, "groups: expected a list of group names"),
    (["cpu", "nope"], {}, None, "groups: unknown group.*'nope'"),
    ([0], {}, None, "groups: unknown group"),
    (["cpu"], {"nope": 2.0}, None, "slowdown: unknown group 'nope'"),
    (["cpu"], {"cpu": float("nan")}, None, "slowdown: group cpu: expected a factor"),
    (["cpu"], {"cpu": float("inf")}, None, "slowdown: group cpu"),
    (["cpu"], {"cpu": 0}, None, "slowdown: group cpu"),
    (["cpu"], {"cpu": -2.0}, None, "slowdown: group cpu"),
    (["cpu"], {"cpu": 0.5}, None, "slowdown: group cpu"),
    (["cpu"], {"cpu": 1e9}, None, "slowdown: group cpu"),
    (["cpu"], {"cpu": True}, None, "slowdown: group cpu"),
    (["cpu"], {"cpu": "2"}, None, "slowdown: group cpu"),
    (["cpu"], [("cpu", 2.0)], None, "slowdown: expected group -> factor"),
    (["cpu"], {}, 0, "global_batch: expected a whole number"),
    (["cpu"], {}, -4, "global_batch"),
    (["cpu"], {}, 32.0, "global_batch"),
    (["cpu"], {}, True, "global_batch"),
    (["cpu"], {}, "٣٢", "global_batch"),
    (["cpu"], {}, 10**12, "global_batch"),
])
def test_hostile_inputs_are_refused_naming_the_field(groups: Any, slowdown: Any, batch: Any,
                                                      match: str) -> None:
    with pytest.raises(QsyncInputError, match=match):
        _cache("digits").replan(groups, slowdown, batch)


def test_a_slowdown_of_an_absent_group_is_ignored() -> None:
    cache = _cache("digits")
    assert cache.replan(["cpu"], {"cpu_2": 3.0}).plan.groups == cache.replan(["cpu"]).plan.groups


# ---------------------------------------------------------------- the file


def test_the_file_round_trip_gives_the_same_replans(tmp_path: Path) -> None:
    cache = _cache("gpt")
    path = tmp_path / "run" / "replan.json"
    path.parent.mkdir()
    cache.save(path)
    back = ReplanCache.load(path)
    names = _names("gpt")
    for args in ((names, {}), (names[1:], {}), (names, {names[0]: 1.7})):
        a, b = cache.replan(*args), back.replan(*args)
        assert a.plan.groups == b.plan.groups
        assert a.predicted_step_ms == b.predicted_step_ms
        assert a.changes == b.changes
    cache.save(path)  # over an existing file: replaced atomically, nothing else left
    assert sorted(os.listdir(path.parent)) == ["replan.json"]


def test_a_planted_link_is_neither_written_through_nor_read(tmp_path: Path) -> None:
    cache = _cache("digits")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    link = tmp_path / "replan.json"
    link.symlink_to(victim)
    with pytest.raises(QsyncInputError, match="replan.json"):
        cache.save(link)
    assert victim.read_text() == "keep me"
    with pytest.raises(QsyncInputError, match="replan.json"):
        ReplanCache.load(link)


@pytest.mark.parametrize(("content", "match"), [
    (b"", "not a JSON file"),
    (b"\xff\xfe garbage", "not a JSON file"),
    (b'{"kind": "qsync-opt replan cache", "version": 1', "not a JSON file"),
    (b"[1, 2]", "not a replan cache"),
    (b'{"kind": "something else", "version": 1}', "not a replan cache"),
    (b'{"kind": "qsync-opt replan cache", "version": 99}', "version 99"),
    (b'{"kind": "qsync-opt replan cache", "version": 1}', "corrupt"),
])
def test_a_foreign_or_corrupt_file_is_refused_in_one_line(tmp_path: Path, content: bytes,
                                                          match: str) -> None:
    path = tmp_path / "replan.json"
    path.write_bytes(content)
    with pytest.raises(QsyncInputError, match=match) as err:
        ReplanCache.load(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_a_tampered_document_inside_is_refused(tmp_path: Path) -> None:
    cache = _cache("digits")
    doc = json.loads(cache.to_json())
    doc["plan"]["groups"]["cpu"]["batch_per_device"] = -3
    path = tmp_path / "replan.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(QsyncInputError, match=r"replan cache .*replan.json: .*batch_per_device"):
        ReplanCache.load(path)
    with pytest.raises(QsyncInputError, match="no such file"):
        ReplanCache.load(tmp_path / "missing.json")
