"""Replayer: hand-computed iterations, properties against the oracle, traces, refusals."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qsync_opt import ModelGraph, QsyncInputError, estimate, load_cluster, trace
from qsync_opt.core.precision import DType, Precision
from qsync_opt.documents.schemas import (
    CastCost,
    ClusterSpec,
    CommModel,
    CostTable,
    Edge,
    Efficiencies,
    GradBucket,
    OpCost,
    OpKind,
    OpNode,
    OpRole,
    OptimizerCost,
)
from qsync_opt.replayer import AllReduceSync, Replayer, simulate

P = Precision


def _op(name: str, role: OpRole, *, weight: int = 0, in_numel: int = 1000,
        out_numel: int = 1000, saved: int = 4000, shared: int = 0) -> OpNode:
    kind = {OpRole.choosable: OpKind.linear, OpRole.pinned: OpKind.norm,
            OpRole.pass_through: OpKind.activation, OpRole.promote: OpKind.elementwise}[role]
    allowed = {OpRole.choosable: [P.fp32, P.fp16, P.int8], OpRole.pinned: [P.fp32]}.get(role, [])
    return OpNode(
        name=name, kind=kind, target="test", role=role, allowed_precisions=allowed,
        pin_reason="test pin" if role == OpRole.pinned else None,
        input_shapes=[[in_numel]], output_shapes=[[out_numel]],
        weight_shape=[weight] if weight else None, param_count=weight,
        input_numel=in_numel, output_numel=out_numel, fwd_flops=1, bwd_flops=1, fwd_bytes=1,
        saved_bytes=saved, saved_shared_bytes=shared, depth=0)


def _chain_graph() -> ModelGraph:
    ops = [_op("a", OpRole.choosable, weight=100, in_numel=500),
           _op("b", OpRole.pass_through, saved=4000, shared=4000),
           _op("c", OpRole.choosable, weight=100, saved=4000, shared=4000)]
    edges = [Edge(src="a", dst="b", shape=[1000], numel=1000, bytes=4000),
             Edge(src="b", dst="c", shape=[1000], numel=1000, bytes=4000)]
    return ModelGraph(workload="chain", batch_size=1, inputs=[], ops=ops, edges=edges,
                      max_depth=2, param_count=200, param_bytes=800, buffer_bytes=0,
                      trace_method="hand", torch_version="n/a")


COSTS = {  # op -> precision -> (fwd_ms, bwd_ms)
    "a": {P.fp32: (2.0, 4.0), P.fp16: (1.0, 2.0), P.int8: (0.5, 2.0)},
    "b": {P.fp32: (0.5, 0.5), P.fp16: (0.25, 0.25)},
    "c": {P.fp32: (3.0, 6.0), P.fp16: (1.5, 3.0), P.int8: (1.0, 3.0)},
}


def _chain_costs(graph: ModelGraph, devices: dict[str, float]) -> CostTable:
    """``devices``: device -> slowdown factor applied to every op cost."""
    entries, casts, opt = [], [], []
    for dev, factor in devices.items():
        for op, row in COSTS.items():
            for p, (f, b) in row.items():
                entries.append(OpCost(device=dev, batch_size=1, op=op, precision=p,
                                      fwd_ms=f * factor, bwd_ms=b * factor, source="estimated"))
        for src, dst in [(DType.fp32, DType.fp16), (DType.fp16, DType.fp32),
                         (DType.fp32, DType.int8), (DType.fp16, DType.int8)]:
            casts.append(CastCost(device=dev, src=src, dst=dst, a_ms_per_element=0.001,
                                  b_ms=0.01, source="estimated"))
        for kind in ("sgd", "adam"):
            opt.append(OptimizerCost(device=dev, optimizer=kind, ms=0.5, state_bytes=800))
    comm = CommModel(world_size=2, bandwidth_gb_per_s=1.0, latency_us=0.0, bottleneck="test",
                     source="estimated")
    buckets = [GradBucket(index=0, ops=["c"], bytes=400, allreduce_ms=1.0),
               GradBucket(index=1, ops=["a"], bytes=400, allreduce_ms=2.0)]
    return CostTable(workload="chain", graph_hash=graph.structure_hash(), entries=entries,
                     casts=casts, comm=comm, buckets=buckets, bucket_cap_bytes=400,
                     optimizer=opt, efficiencies=Efficiencies())


def _cluster(*groups: tuple[str, str]) -> ClusterSpec:
    return ClusterSpec(groups=[{"name": n, "device": d, "count": 1, "batch_per_device": 1}
                               for n, d in groups])


def test_three_op_chain_by_hand() -> None:
    g = _chain_graph()
    tl = simulate(g, _cluster(("t4", "t4")), _chain_costs(g, {"t4": 1.0}),
                  {"t4": {"a": "fp16", "c": "fp32"}}, context_bytes=0)
    grp = tl.groups["t4"]
    # Forward: input cast fp32->fp16 (500 el) 0.51, weight cast (100 el) 0.11, a 1.0,
    # b runs in fp16 0.25, cast fp16->fp32 before c (1000 el) 1.01, c 3.0.
    assert grp.forward_ms == pytest.approx(0.51 + 0.11 + 1.0 + 0.25 + 1.01 + 3.0)
    # Backward: c 6.0, its input gradient fp32->fp16 1.01, b 0.25, a 2.0, a's weight
    # gradient fp16->fp32 0.11.
    assert grp.backward_ms == pytest.approx(6.0 + 1.01 + 0.25 + 2.0 + 0.11)
    assert grp.n_casts == 5
    assert grp.cast_ms == pytest.approx(0.51 + 0.11 + 1.01 + 1.01 + 0.11)
    # Bucket 0 (c) is ready after c's backward and its gradient cast: 5.88 + 7.01 = 12.89;
    # bucket 1 (a) at the end of backward, 15.25, after bucket 0 ended at 13.89.
    assert tl.bucket_start_ms == pytest.approx([12.89, 15.25])
    assert tl.bucket_end_ms == pytest.approx([13.89, 17.25])
    assert grp.exposed_comm_ms == pytest.approx(2.0)
    assert tl.iteration_ms == pytest.approx(17.25 + 0.5)
    # Memory: weights + grads + SGD state, a's fp16 weight copy, activations: a saves its
    # cast fp16 input (4000 * 2/4); b (fp16, no cast) shares what it saves; c saves the
    # new fp32 tensor its input cast made (4000). The largest working set is c's: fp32 in
    # (the cast's result) and fp32 out.
    mem = grp.memory
    assert mem["weights_fp32"] == 800 and mem["grads_fp32"] == 800
    assert mem["optimizer_state"] == 800
    assert mem["weight_copies"] == 100 * 2
    assert mem["activations"] == 2000 + 0 + 4000
    assert mem["workspace"] == 1000 * 4 + 1000 * 4
    assert mem["context"] == 0


def test_uniform_fp32_inserts_no_cast_and_matches_sums() -> None:
    g = _chain_graph()
    tl = simulate(g, _cluster(("t4", "t4")), _chain_costs(g, {"t4": 1.0}),
                  {"t4": {"a": "fp32", "c": "fp32"}})
    grp = tl.groups["t4"]
    assert grp.n_casts == 0 and grp.cast_ms == 0
    assert grp.forward_ms == pytest.approx(2.0 + 0.5 + 3.0)
    assert grp.backward_ms == pytest.approx(6.0 + 0.5 + 4.0)


def test_two_groups_wait_for_the_slower_per_bucket() -> None:
    g = _chain_graph()
    costs = _chain_costs(g, {"v100": 1.0, "t4": 3.0})
    tl = simulate(g, _cluster(("fast", "v100"), ("slow", "t4")), costs,
                  {"fast": {"a": "fp32", "c": "fp32"}, "slow": {"a": "fp32", "c": "fp32"}})
    fast, slow = tl.groups["fast"], tl.groups["slow"]
    # Fast: forward 5.5, c's backward ends 11.5, all 16.0; slow: x3.
    assert fast.compute_ms == pytest.approx(16.0) and slow.compute_ms == pytest.approx(48.0)
    assert tl.bucket_start_ms == pytest.approx([3 * 11.5, 48.0])
    assert tl.bucket_end_ms == pytest.approx([3 * 11.5 + 1.0, 50.0])
    assert fast.straggler_wait_ms == pytest.approx(32.0) and slow.straggler_wait_ms == 0
    # Only the tail after the slowest backward is exposed communication, for both groups.
    assert fast.exposed_comm_ms == pytest.approx(2.0) == slow.exposed_comm_ms
    assert tl.straggler == "slow"
    assert tl.iteration_ms == pytest.approx(50.5)
    assert [s["kind"] for s in tl.critical_path] == ["compute", "allreduce", "optimizer"]
    assert tl.critical_path[0]["group"] == "slow"


def test_sync_model_is_pluggable() -> None:
    class NoComm:
        name = "none"

        def schedule(self, ready_ms, bucket_ms):
            return AllReduceSync().schedule(ready_ms, [0.0] * len(bucket_ms))

    g = _chain_graph()
    plan = {"t4": {"a": "fp32", "c": "fp32"}}
    tl = simulate(g, _cluster(("t4", "t4")), _chain_costs(g, {"t4": 1.0}), plan, sync=NoComm())
    assert tl.iteration_ms == pytest.approx(16.0 + 0.5)


def test_refusals_name_op_group_and_allowed() -> None:
    g = _chain_graph()
    rep = Replayer(g, _cluster(("v100", "v100")), _chain_costs(g, {"v100": 1.0}))
    with pytest.raises(QsyncInputError, match=r"group v100 \(v100\), op a: int8 is not allowed; "
                                              r"allowed: fp32, fp16"):
        rep.simulate({"v100": {"a": "int8"}})
    with pytest.raises(QsyncInputError, match="names op 'zz'"):
        rep.simulate({"v100": {"zz": "fp16"}})
    with pytest.raises(QsyncInputError, match="no group t4"):
        rep.simulate({"t4": {"a": "fp16"}})
    with pytest.raises(QsyncInputError, match="pass_through"):
        rep.simulate({"v100": {"b": "fp16"}})
    with pytest.raises(QsyncInputError, match="unknown precision"):
        rep.simulate({"v100": {"a": "fp4"}})


def test_costs_for_another_graph_or_batch_are_refused(digits_graph: ModelGraph) -> None:
    cluster = load_cluster("t4x2")
    costs = estimate(digits_graph, cluster)
    other = trace("resnet18", batch=2)
    with pytest.raises(QsyncInputError, match="not this graph"):
        Replayer(other, cluster, costs)
    with pytest.raises(QsyncInputError, match=r"batch 32.*batches=\[32\]"):
        Replayer(digits_graph, load_cluster("t4x2@32"), costs)


# ------------------------------------------------------------------ on traced graphs

CLUSTERS = ["v100x2+t4x2", "a100x2+t4x2", "h100x2+l4x2+t4x2"]


@pytest.fixture(scope="module")
def prepared() -> dict[tuple[str, str], Replayer]:
    out = {}
    for model, batch in (("tiny_gpt", 4), ("digits_cnn", 8), ("resnet18", 2)):
        graph = trace(model, batch=batch)
        for shorthand in CLUSTERS:
            cluster = load_cluster(shorthand)
            out[(model, shorthand)] = Replayer(graph, cluster, estimate(graph, cluster))
    return out


def _random_plan(rep: Replayer, data: st.DataObject) -> dict[str, dict[str, Precision]]:
    plan: dict[str, dict[str, Precision]] = {}
    for grp in rep.groups:
        row = {}
        ties: dict[str, Precision] = {}
        for op in rep.graph.choosable_ops():
            allowed = [p for p in op.allowed_precisions if p in grp.menu]
            p = data.draw(st.sampled_from(allowed))
            if op.tie_group:
                p = ties.setdefault(op.tie_group, p)
            row[op.name] = p
        plan[grp.name] = row
    return plan


SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(data=st.data())
def test_incremental_equals_full(prepared, data) -> None:
    rep = prepared[data.draw(st.sampled_from(sorted(prepared)))]
    inc = rep.incremental(_random_plan(rep, data))
    for _ in range(data.draw(st.integers(1, 8))):
        grp = data.draw(st.sampled_from(rep.groups))
        op = data.draw(st.sampled_from([o for o in rep.graph.choosable_ops() if not o.tie_group]))
        p = data.draw(st.sampled_from([q for q in op.allowed_precisions if q in grp.menu]))
        if data.draw(st.booleans()):
            got = inc.set(grp.name, op.name, p)
        else:
            before = inc.state()
            inc.what_if(grp.name, op.name, p)
            got = inc.state()
            assert got.iteration_ms == pytest.approx(before.iteration_ms, rel=1e-9)
        full = rep.simulate(inc.plan(), events=False)
        assert got.iteration_ms == pytest.approx(full.iteration_ms, rel=1e-9)
        assert got.peak_memory_bytes == {n: g.peak_memory_bytes for n, g in full.groups.items()}
        assert got.fits == full.fits


@SETTINGS
@given(data=st.data())
def test_reference_precision_inserts_no_cast(prepared, data) -> None:
    rep = prepared[data.draw(st.sampled_from(sorted(prepared)))]
    ref = data.draw(st.sampled_from([P.fp32, P.tf32]))
    plan = {g.name: {o.name: (ref if ref in g.menu else P.fp32)
                     for o in rep.graph.choosable_ops()} for g in rep.groups}
    tl = rep.simulate(plan)
    for grp in tl.groups.values():
        assert grp.n_casts == 0 and grp.cast_ms == 0
    assert not [e for e in tl.events if "cast" in e.kind]


@SETTINGS
@given(data=st.data())
def test_a_slower_op_never_makes_the_iteration_faster(prepared, data) -> None:
    key = data.draw(st.sampled_from(sorted(prepared)))
    rep = prepared[key]
    plan = _random_plan(rep, data)
    base = rep.simulate(plan, events=False).iteration_ms
    costs = rep.costs
    i = data.draw(st.integers(0, len(costs.entries) - 1))
    extra_f = data.draw(st.floats(0, 5))
    extra_b = data.draw(st.floats(0, 5))
    entries = list(costs.entries)
    e = entries[i]
    entries[i] = e.model_copy(update={"fwd_ms": e.fwd_ms + extra_f, "bwd_ms": e.bwd_ms + extra_b})
    slower = Replayer(rep.graph, rep.cluster, costs.model_copy(update={"entries": entries}))
    assert slower.simulate(plan, events=False).iteration_ms >= base - 1e-9


@SETTINGS
@given(data=st.data())
def test_memory_falls_when_saved_activations_shrink(prepared, data) -> None:
    rep = prepared[data.draw(st.sampled_from(sorted(prepared)))]
    plan = _random_plan(rep, data)
    before = rep.simulate(plan, events=False)
    i = data.draw(st.integers(0, len(rep.graph.ops) - 1))
    frac = data.draw(st.floats(0, 1))
    op = rep.graph.ops[i]
    smaller = op.model_copy(update={"saved_bytes": int(op.saved_bytes * frac),
                                    "saved_shared_bytes": int(op.saved_shared_bytes * frac)})
    ops = list(rep.graph.ops)
    ops[i] = smaller
    graph = rep.graph.model_copy(update={"ops": ops})
    after = Replayer(graph, rep.cluster, rep.costs).simulate(plan, events=False)
    for name, g in after.groups.items():
        assert g.peak_memory_bytes <= before.groups[name].peak_memory_bytes


def test_resnet50_straggler_and_lowest_plan(resnet50_graph: ModelGraph) -> None:
    cluster = load_cluster("v100x16+t4x16")
    rep = Replayer(resnet50_graph, cluster, estimate(resnet50_graph, cluster))
    high = rep.uniform("highest")
    tl = rep.simulate(high)
    assert tl.straggler == "t4"
    assert tl.groups["v100"].straggler_wait_ms > 0
    low = {"v100": high["v100"], "t4": rep.uniform("lowest")["t4"]}
    tl_low = rep.simulate(low)
    t4_low, t4_high = tl_low.groups["t4"], tl.groups["t4"]
    assert t4_low.n_casts > 0 and t4_low.cast_ms > 0
    # the GEMMs themselves run faster at the lowest precision; whether the whole group does
    # depends on its casts (int8_full quantizes each output gradient twice, per row and per
    # channel: on the T4 its casts outweigh the gain), and the iteration follows the group
    assert t4_low.compute_ms - t4_low.cast_ms < t4_high.compute_ms
    assert (tl_low.iteration_ms < tl.iteration_ms) == (t4_low.compute_ms < t4_high.compute_ms)
    # Peak memory at fp32 stays under the T4's 15 GiB at batch 128 in this model.
    assert tl.groups["t4"].fits


def test_chrome_trace(resnet50_graph: ModelGraph, tmp_path) -> None:
    cluster = load_cluster("v100x2+t4x2")
    rep = Replayer(resnet50_graph, cluster, estimate(resnet50_graph, cluster))
    plan = {"v100": rep.uniform()["v100"], "t4": rep.uniform("lowest")["t4"]}
    trace_doc = json.loads(rep.simulate(plan).chrome_trace_json())
    events = trace_doc["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e.get("name") == "process_name"}
    assert {n.split()[0] for _, n in names} == {"v100", "t4"}
    threads = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert threads == {"compute", "comm"}
    casts = [e for e in events if e.get("cat") == "cast"]
    assert casts and all(e["cname"] == "terrible" for e in casts)
    assert any(e.get("cat") == "allreduce" and e["tid"] == 2 for e in events)
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
