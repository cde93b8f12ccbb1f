"""The profiler: measured CostTables in the estimator's shape, the cast fit, merging."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from qsync_opt import ModelGraph, QsyncInputError, estimate, trace
from qsync_opt.cluster import parse_shorthand
from qsync_opt.io import load
from qsync_opt.profile import (
    Profile,
    add_profile_parser,
    fit_cast,
    measure_dispatch_us,
    merge,
    profile,
    profile_detailed,
)
from qsync_opt.replayer import Replayer
from qsync_opt.schemas import CostTable


@pytest.fixture(scope="module")
def digits_profile(digits_graph: ModelGraph) -> Profile:
    return profile_detailed("digits_cnn", device="cpu", repeats=3, warmup=1, threads=1,
                            graph=digits_graph)


def _keys(table: CostTable) -> list[tuple[str, int, str, str]]:
    return sorted((e.device, e.batch_size, e.op, e.precision.value) for e in table.entries)


def test_profile_has_the_estimators_shape(digits_graph: ModelGraph,
                                          digits_profile: Profile) -> None:
    table = digits_profile.table
    # Round-trips through the schema (validation of every field).
    again = CostTable.model_validate(json.loads(table.model_dump_json()))
    assert again == table
    est = estimate(digits_graph, parse_shorthand("cpux1"))
    assert _keys(table) == _keys(est)
    assert {(c.device, c.src, c.dst) for c in table.casts} == \
        {(c.device, c.src, c.dst) for c in est.casts}
    assert [b.ops for b in table.buckets] == [b.ops for b in est.buckets]
    assert {(o.device, o.optimizer) for o in table.optimizer} == \
        {(o.device, o.optimizer) for o in est.optimizer}
    assert table.graph_hash == digits_graph.structure_hash()
    # Every op of digits_cnn can be rebuilt, so every entry is a measurement.
    assert all(e.source == "measured" for e in table.entries)
    assert all(c.source == "measured" for c in table.casts)
    assert all(e.fwd_ms > 0 for e in table.entries)
    assert any(e.bwd_ms > 0 for e in table.entries)
    # Spread recorded per entry, environment and dispatch overhead in the notes.
    assert set(digits_profile.spread) == {(e.op, e.precision.value) for e in table.entries}
    notes = "\n".join(table.notes)
    assert "torch" in notes and "CUDA cpu" in notes and "1 threads" in notes
    assert "dispatch overhead" in notes and "spread" in notes
    assert digits_profile.dispatch_us > 0
    assert table.efficiencies.launch_overhead_us == pytest.approx(digits_profile.dispatch_us)
    assert table.comm.source == "estimated"  # no process group here, and the notes say so
    assert "not initialised" in notes


def test_replayer_accepts_a_profiled_table(digits_graph: ModelGraph,
                                           digits_profile: Profile) -> None:
    rep = Replayer(digits_graph, parse_shorthand("cpux1"), digits_profile.table)
    tl = rep.simulate(rep.uniform("highest"), events=False)
    assert tl.iteration_ms > 0


def test_restricted_precisions_keep_estimates(digits_graph: ModelGraph) -> None:
    table = profile("digits_cnn", device="cpu", repeats=1, warmup=0, precisions=["fp32"],
                    graph=digits_graph, threads=1)
    est = estimate(digits_graph, parse_shorthand("cpux1"))
    assert _keys(table) == _keys(est)
    for e in table.entries:
        assert e.source == ("measured" if e.precision.value == "fp32" else "estimated")


def test_fit_cast_recovers_known_coefficients() -> None:
    rng = random.Random(0)
    a, b = 2.5e-7, 0.004  # ms per element, ms
    sizes = [2**k for k in range(10, 22)]
    times = [(a * n + b) * (1 + rng.gauss(0, 0.01)) for n in sizes]
    fa, fb = fit_cast(sizes, times)
    assert fa == pytest.approx(a, rel=0.05)
    # The intercept is set by the small sizes; relative noise there is small in absolute terms.
    times_small = [(a * n + b) + rng.gauss(0, 0.01 * b) for n in sizes]
    fa, fb = fit_cast(sizes, times_small)
    assert fa == pytest.approx(a, rel=0.05)
    assert fb == pytest.approx(b, rel=0.05)
    assert fit_cast([1, 2], [3.0, 5.0]) == pytest.approx((2.0, 1.0))
    with pytest.raises(QsyncInputError):
        fit_cast([4, 4], [1.0, 2.0])
    with pytest.raises(QsyncInputError):
        fit_cast([1], [1.0])


def test_dispatch_overhead_is_measured() -> None:
    us = measure_dispatch_us("cpu", repeats=20)
    assert 0 < us < 10_000


def test_merge_keeps_provenance(digits_graph: ModelGraph, digits_profile: Profile) -> None:
    other = estimate(digits_graph, parse_shorthand("t4x1"))
    merged = merge([digits_profile.table, other])
    assert len(merged.entries) == len(digits_profile.table.entries) + len(other.entries)
    by_dev = {(e.device, e.source) for e in merged.entries}
    assert by_dev == {("cpu", "measured"), ("t4", "estimated")}
    assert {c.device for c in merged.casts} == {"cpu", "t4"}
    assert {o.device for o in merged.optimizer} == {"cpu", "t4"}
    assert any(n.startswith("cpu: measured on") for n in merged.notes)
    assert any(n.startswith("[t4] ") for n in merged.notes)
    # The replayer takes the merged table for a hybrid of both devices.
    Replayer(digits_graph, parse_shorthand("cpux1+t4x1"), merged)


def test_merge_refuses_mismatches(digits_graph: ModelGraph, digits_profile: Profile) -> None:
    other_graph = trace("digits_cnn", 32)
    other = estimate(other_graph, parse_shorthand("t4x1"))
    with pytest.raises(QsyncInputError, match="graph"):
        merge([digits_profile.table, other])
    with pytest.raises(QsyncInputError, match="device cpu"):
        merge([digits_profile.table, digits_profile.table])
    with pytest.raises(QsyncInputError):
        merge([])


def test_cli_profile_writes_a_cost_table(tmp_path, digits_graph: ModelGraph) -> None:
    parser = argparse.ArgumentParser()
    add_profile_parser(parser.add_subparsers())
    out = tmp_path / "costs.json"
    args = parser.parse_args(["profile", "--model", "digits_cnn", "--device", "cpu",
                              "--repeats", "1", "--warmup", "0", "--threads", "1",
                              "--out", str(out)])
    assert args.fn(args) == 0
    table = load(out, CostTable)
    assert table.graph_hash == digits_graph.structure_hash()
    assert {e.device for e in table.entries} == {"cpu"}
