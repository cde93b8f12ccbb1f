"""The profiler: measured CostTables in the estimator's shape, the cast fit, merging."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from qsync_opt import ModelGraph, QsyncInputError, estimate, trace
from qsync_opt.cli.parsers.profile import add_profile_parser
from qsync_opt.costs.cluster import parse_shorthand
from qsync_opt.documents.io import load
from qsync_opt.documents.schemas import CostTable
from qsync_opt.profile import (
    Profile,
    fit_cast,
    measure_dispatch_us,
    merge,
    profile,
    profile_detailed,
)
from qsync_opt.replayer import Replayer

#: The batch this module profiles digits_cnn at. Every profile here measures fp16, whose
#: conv backward on a CPU without fp16 kernels costs about 20 ms a sample (1.3 s a step at
#: the default batch 64); what these tests check (the table's shape, its provenance, its
#: sums) is the same at any batch.
BATCH = 8


@pytest.fixture(scope="module")
def digits_graph() -> ModelGraph:
    """digits_cnn traced at :data:`BATCH` (for this module, in place of the session's)."""
    return trace("digits_cnn", BATCH)


@pytest.fixture(scope="module")
def digits_profile(digits_graph: ModelGraph) -> Profile:
    return profile_detailed("digits_cnn", BATCH, device="cpu", repeats=2, warmup=0,
                            threads=1, graph=digits_graph)


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
    # In context a choosable entry is its marginal cost (the schema clamps it at 0); the fp32
    # entries add up to the measured uniform fp32 step, forward and backward.
    f, b = digits_profile.uniform_ms["fp32"]
    fp32 = [e for e in table.entries if e.precision.value == "fp32"]
    assert len(fp32) == len(digits_graph.ops)
    assert sum(e.fwd_ms for e in fp32) == pytest.approx(f, rel=1e-9)
    assert sum(e.bwd_ms for e in fp32) == pytest.approx(b, rel=1e-9)
    assert table.activation_flow == "fp32"
    # Spread recorded per measured entry (choosable ops in context, the rest in isolation),
    # environment and dispatch overhead in the notes.
    keys = {(e.op, e.precision.value) for e in table.entries}
    assert set(digits_profile.spread) <= keys
    assert {(o.name, "fp32") for o in digits_graph.choosable_ops()} <= set(digits_profile.spread)
    notes = "\n".join(table.notes)
    assert "torch" in notes and "CUDA cpu" in notes and "1 threads" in notes
    assert "dispatch overhead" in notes and "spread" in notes
    assert table.efficiencies.launch_overhead_us == digits_profile.dispatch_us
    assert f"forward+backward): {digits_profile.dispatch_us:.1f} us, measured" in notes
    assert table.comm.source == "estimated"  # no process group here, and the notes say so
    assert "not initialised" in notes


def test_replayer_accepts_a_profiled_table(digits_graph: ModelGraph,
                                           digits_profile: Profile) -> None:
    table = digits_profile.table
    rep = Replayer(digits_graph, parse_shorthand("cpux1"), table)
    tl = rep.simulate(rep.uniform("highest"), events=False)
    # One CPU, all fp32: the measured step, then the measured SGD step; no casts, nothing to
    # communicate.
    f, b = digits_profile.uniform_ms["fp32"]
    (sgd,) = [o.ms for o in table.optimizer if (o.device, o.optimizer) == ("cpu", "sgd")]
    g = tl.groups["cpu"]
    assert (g.cast_ms, g.n_casts, g.exposed_comm_ms) == (0.0, 0, 0.0)
    assert g.optimizer_ms == sgd
    assert tl.iteration_ms == pytest.approx(f + b + sgd, rel=1e-9)


def test_restricted_precisions_keep_estimates(digits_graph: ModelGraph) -> None:
    table = profile("digits_cnn", BATCH, device="cpu", repeats=1, warmup=0, precisions=["fp32"],
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


def test_dispatch_overhead_is_the_median_after_warmup(monkeypatch) -> None:
    """On a scripted clock: 20 warm-up runs (1 s each) are dropped, the median (not the
    mean, 4 us) of the timed runs, 3 us, is returned, in microseconds."""
    import qsync_opt.profile as prof

    durations = [1.0] * 20 + [1e-6, 2e-6, 10e-6, 3e-6, 4e-6]
    readings, t = [], 0.0
    for d in durations:  # two clock readings per run: before and after
        readings += [t, t + d]
        t += d + 0.5
    it = iter(readings)
    monkeypatch.setattr(prof.Timer, "now", lambda self: next(it))
    assert measure_dispatch_us("cpu", repeats=5) == pytest.approx(3.0, rel=1e-6)
    assert next(it, None) is None  # every reading used, no more


def test_merge_keeps_provenance(digits_graph: ModelGraph, digits_profile: Profile) -> None:
    """One profile per machine: each entry keeps its device and source, each device its
    environment (hardware, torch, CUDA, threads, method)."""
    table = digits_profile.table
    assert table.environment["cpu"]["torch"] and table.environment["cpu"]["cuda"] == "cpu"
    assert table.environment["cpu"]["method"] == "context"
    # "Another machine": the same profile under another device name and environment.
    other = table.model_copy(update={
        "entries": [e.model_copy(update={"device": "l4"}) for e in table.entries],
        "casts": [c.model_copy(update={"device": "l4"}) for c in table.casts],
        "optimizer": [o.model_copy(update={"device": "l4"}) for o in table.optimizer],
        "environment": {"l4": {**table.environment["cpu"], "hardware": "NVIDIA L4",
                               "cuda": "12.4"}},
        "notes": [n.replace("cpu:", "l4:", 1) for n in table.notes]})
    merged = merge([table, other])
    assert len(merged.entries) == 2 * len(table.entries)
    assert {(e.device, e.source) for e in merged.entries} == {("cpu", "measured"),
                                                              ("l4", "measured")}
    assert {c.device for c in merged.casts} == {"cpu", "l4"}
    assert {o.device for o in merged.optimizer} == {"cpu", "l4"}
    assert merged.environment["l4"]["cuda"] == "12.4"
    assert merged.environment["cpu"] == table.environment["cpu"]
    assert merged.activation_flow == "fp32"
    assert any(n.startswith("cpu: measured on") for n in merged.notes)
    assert any(n.startswith("l4: measured on") for n in merged.notes)
    merged = CostTable.model_validate(json.loads(merged.model_dump_json()))  # schema-valid
    # Estimates (native flow) do not mix with in-context profiles (fp32 flow) ...
    est = estimate(digits_graph, parse_shorthand("t4x1"))
    with pytest.raises(QsyncInputError, match="activation flows"):
        merge([table, est])
    # ... but do with isolated profiles, and the replayer takes the result.
    iso = profile("digits_cnn", BATCH, device="cpu", repeats=1, warmup=0, precisions=["fp32"],
                  graph=digits_graph, method="isolated")
    both = merge([iso, est])
    assert {(e.device, e.source) for e in both.entries} >= {("cpu", "measured"),
                                                            ("t4", "estimated")}
    assert any(n.startswith("[t4] ") for n in both.notes)
    Replayer(digits_graph, parse_shorthand("cpux1+t4x1"), both)


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
                              "--batch", str(BATCH), "--repeats", "1", "--warmup", "0", "--threads", "1",
                              "--out", str(out)])
    assert args.fn(args) == 0
    table = load(out, CostTable)
    assert table.graph_hash == digits_graph.structure_hash()
    assert {e.device for e in table.entries} == {"cpu"}


# ----------------------------------------------------------------------------- in context


def test_intervals_attribute_time_by_execution_order() -> None:
    from qsync_opt.profile.incontext import HEAD, TAIL, intervals

    ev = [("fpre", "a", 1.0), ("fpost", "a", 3.0), ("fpre", "b", 4.0), ("fpost", "b", 7.0),
          ("bpre", "b", 11.0), ("bpost", "b", 14.0), ("bpre", "a", 15.0), ("bpost", "a", 15.0)]
    fwd, bwd = intervals(ev, 0.0, 10.0, 20.0)
    assert fwd == {("seg", HEAD): 1.0, ("op", "a"): 2.0, ("seg", "a"): 1.0, ("op", "b"): 3.0,
                   ("seg", "b"): 3.0}
    # "a" needs no input gradient: its hooks fire together before its backward runs, and the
    # time after them is its own.
    assert bwd == {("seg", TAIL): 1.0, ("op", "b"): 3.0, ("seg", "b"): 1.0, ("op", "a"): 0.0,
                   ("seg", "a"): 5.0}
    fwd, bwd = intervals(ev, 0.0, 10.0, 20.0, early={"a"})
    assert bwd[("op", "a")] == 5.0 and ("seg", "a") not in bwd
    assert sum(fwd.values()) == 10.0 and sum(bwd.values()) == 10.0


def test_in_context_runs_only_uniform_plans_and_predicts_mixed_ones(
        digits_graph: ModelGraph, digits_profile: Profile) -> None:
    """A mixed plan's prediction uses no measurement of that plan: the profiler only ran
    uniform assignments, and the prediction is a sum over the table's entries."""
    from qsync_opt.core.precision import Precision
    from qsync_opt.problem.plan import make_plan

    ran = digits_profile.assignments_run
    # one uniform assignment per precision of the CPU's menu, and nothing else
    from qsync_opt.costs.devices import get_device

    menu = [p.value for p in get_device("cpu").precisions]
    assert len(menu) == 5  # fp32, bf16, fp16, int8, int8_full
    assert ran == [{o.name: p for o in digits_graph.choosable_ops()} for p in menu]
    assert sorted(digits_profile.uniform_ms) == sorted(menu)
    table = digits_profile.table
    cluster = parse_shorthand("cpux1")
    replayer = Replayer(digits_graph, cluster, table)
    # written directly (a solver's problem may hold this only group at its reference)
    assigned = {"conv1": "int8", "conv2": "bf16", "fc1": "int8"}
    assert {o.name for o in digits_graph.choosable_ops()} == set(assigned)
    plan = make_plan(digits_graph, cluster, {"cpu": assigned})
    assert assigned not in ran
    tl = replayer.simulate(plan, events=False)
    by = table.lookup()
    want = sum(by[("cpu", digits_graph.batch_size, o.name,
                   Precision(assigned.get(o.name, "fp32")))].fwd_ms for o in digits_graph.ops)
    assert tl.groups["cpu"].forward_ms == pytest.approx(want)
    # The uniform fp32 plan reproduces its measured step (by construction of the table).
    fp32 = make_plan(digits_graph, cluster, {})
    f, b = digits_profile.uniform_ms["fp32"]
    g = replayer.simulate(fp32, events=False).groups["cpu"]
    assert g.forward_ms == pytest.approx(f, rel=1e-6)
    assert g.backward_ms == pytest.approx(b, rel=1e-6)


def test_isolated_method_is_still_available(digits_graph: ModelGraph) -> None:
    table = profile("digits_cnn", BATCH, device="cpu", repeats=1, warmup=0, precisions=["fp32"],
                    graph=digits_graph, method="isolated")
    assert table.activation_flow == "native"
    assert "in isolation" in table.notes[1]
    with pytest.raises(QsyncInputError, match="method"):
        profile("digits_cnn", device="cpu", repeats=1, method="sideways")


def test_derive_builds_a_slower_cpu_from_the_cpu_entries(digits_graph: ModelGraph,
                                                        digits_profile: Profile) -> None:
    from qsync_opt.profile import derive

    table = derive(digits_profile.table, ["cpu", "cpu/2", "cpu/3~t4"])
    by = table.lookup()
    b = digits_graph.batch_size
    for e in digits_profile.table.entries:
        d = by[("cpu/2", b, e.op, e.precision)]
        assert d.fwd_ms == pytest.approx(2 * e.fwd_ms) and d.bwd_ms == pytest.approx(2 * e.bwd_ms)
    # The T4 menu has no bf16: cpu/3~t4 gets no bf16 entries for choosable ops.
    assert not any(e.device == "cpu/3~t4" and e.precision.value == "bf16"
                   and e.op == "conv1" for e in table.entries)
    assert {o.device for o in table.optimizer} == {"cpu", "cpu/2", "cpu/3~t4"}
    Replayer(digits_graph, parse_shorthand("cpux1+cpu/2x1"), table)  # accepted
    with pytest.raises(QsyncInputError, match="no cpu entries"):
        derive(table.model_copy(update={"entries": [e for e in table.entries
                                                    if e.device != "cpu"]}), ["cpu/4"])


def test_pin_malloc_is_idempotent() -> None:
    from qsync_opt.core.machine import pin_malloc

    first = pin_malloc()
    assert pin_malloc() is first


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_in_context_profile_on_cuda(digits_graph: ModelGraph) -> None:
    prof = profile_detailed("digits_cnn", BATCH, device="cuda", repeats=2, warmup=1,
                            precisions=["fp32", "bf16", "fp16"], graph=digits_graph)
    table = prof.table
    CostTable.model_validate(json.loads(table.model_dump_json()))
    assert table.activation_flow == "fp32"
    assert table.environment[next(iter(table.environment))]["cuda"] not in ("", "cpu")
    assert set(prof.uniform_ms) >= {"fp32", "bf16"}
