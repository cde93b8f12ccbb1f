"""Measured costs at batches nobody measured: the fitted batch model (qsync_opt.costs.batchmodel)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qsync_opt as qs
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.costs.batchmodel import BatchScaling, fit_line
from qsync_opt.costs.cluster import parse_shorthand
from qsync_opt.planner.compare import compare
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.problem.synthetic import random_indicator


@given(a=st.floats(0, 5), c=st.floats(0, 2),
       bs=st.lists(st.integers(1, 256), min_size=2, max_size=5, unique=True))
@settings(max_examples=60, deadline=None)
def test_fit_recovers_a_non_negative_line(a: float, c: float, bs: list[int]) -> None:
    fa, fc = fit_line([(b, a + c * b) for b in bs])
    for b in (1, 7, 300):
        assert math.isclose(fa + fc * b, a + c * b, rel_tol=1e-7, abs_tol=1e-9)


@given(pts=st.lists(st.tuples(st.integers(1, 128), st.floats(0, 100)), min_size=1, max_size=6))
@settings(max_examples=80, deadline=None)
def test_fit_never_negative(pts: list[tuple[int, float]]) -> None:
    a, c = fit_line(pts)
    assert a >= 0 and c >= 0


def test_one_batch_is_proportional() -> None:
    assert fit_line([(32, 8.0)]) == (0.0, 0.25)
    with pytest.raises(QsyncInputError):
        fit_line([])


def _measured(graph: qs.ModelGraph, shorthand: str) -> qs.CostTable:
    table = qs.estimate(graph, parse_shorthand(shorthand))
    return table.model_copy(update={"entries": [e.model_copy(update={"source": "measured"})
                                                for e in table.entries]})


def test_scaled_entries_follow_the_fitted_line_exactly() -> None:
    graph = qs.trace("digits_cnn", 32)
    t32 = _measured(graph, "v100x1@32+t4x1@32")
    # a second "measurement" at batch 16 that is exactly linear in the batch: t(16) = t(32)/2 + 0.1
    t16 = t32.model_copy(update={"entries": [e.model_copy(update={
        "batch_size": 16, "fwd_ms": e.fwd_ms / 2 + 0.1, "bwd_ms": e.bwd_ms / 2 + 0.1})
        for e in t32.entries]})
    scaled = BatchScaling([t32, t16], graph)(parse_shorthand("v100x1@32+t4x1@48"))
    at = {(e.device, e.batch_size, e.op, e.precision): e for e in scaled.entries}
    for e in t32.entries:
        if e.device != "t4":
            continue
        s = at[("t4", 48, e.op, e.precision)]
        assert s.source == "scaled"
        # the line through (16, t/2 + 0.1) and (32, t): slope (t/2 - 0.1)/16, at 48: 1.5 t - 0.1
        want = 1.5 * e.fwd_ms - 0.1
        if e.fwd_ms / 2 - 0.1 >= 0:
            assert math.isclose(s.fwd_ms, want, rel_tol=1e-9, abs_tol=1e-12)
    assert any(n.startswith("batch model: t4@48") and "16, 32" in n for n in scaled.notes)
    assert not any(e.source == "scaled" and e.device == "v100" for e in scaled.entries)


def test_world_size_change_re_evaluates_the_ring_model() -> None:
    graph = qs.trace("digits_cnn", 32)
    table = _measured(graph, "v100x2@32+t4x2@32")
    same = BatchScaling(table, graph)(parse_shorthand("v100x2@16+t4x2@48"))
    assert same.comm == table.comm and same.buckets == table.buckets
    two = BatchScaling(table, graph)(parse_shorthand("v100x2@64"))
    assert two.comm.world_size == 2
    assert two.comm.allreduce_ms(1 << 20) < table.comm.allreduce_ms(1 << 20)
    solo = BatchScaling(table, graph)(parse_shorthand("v100x1@64"))
    assert solo.comm.world_size == 1
    assert all(b.allreduce_ms == 0 for b in solo.buckets)
    assert any("re-evaluated at world size 1" in n for n in solo.notes)


def test_unknown_device_named() -> None:
    graph = qs.trace("digits_cnn", 32)
    table = _measured(graph, "v100x1@32+t4x1@32")
    with pytest.raises(QsyncInputError, match="a10"):
        BatchScaling(table, graph)(parse_shorthand("v100x1@32+a10x1@16"))


def test_compare_baselines_run_on_measured_costs() -> None:
    """Dynamic batching and strong-only re-split the batch; with measured costs they used to
    fail with "measured costs lack t4@..."; now they run on the batch model and say so."""
    graph = qs.trace("digits_cnn", 32)
    cluster = parse_shorthand("v100x1@32+t4x1@32")
    problem = AllocationProblem(graph, cluster, _measured(graph, "v100x1@32+t4x1@32"),
                                random_indicator(graph))
    rows = {r.solver: r for r in compare(problem, ["dynamic-batching", "strong-only"])}
    for name in ("dynamic-batching", "strong-only"):
        r = rows[name]
        assert r.status != "ERROR", r.messages
        assert r.plan is not None
    assert any("batch model" in m for m in rows["strong-only"].messages)  # world size 1
    db = rows["dynamic-batching"]
    assert db.plan is not None
    batches = {g.name: g.batch_per_device for g in db.plan.cluster.groups}
    if batches != {"v100": 32, "t4": 32}:  # re-split: costs at new batches came from the model
        assert any("batch model" in m for m in db.messages), db.messages
