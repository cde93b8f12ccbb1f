"""The cost-and-memory rules (qsync_opt.costs.rules), case by case, on a five-op graph worked by
hand: the dtype chain, the casts between neighbours, compute lookups, the memory of an op in
each precision, a group's static memory and the three memory views; and the replayer and the
linear model built on the same rules agreeing with them."""

from __future__ import annotations

import pytest

from qsync_opt import ModelGraph, QsyncInputError
from qsync_opt.core.precision import DType, Precision
from qsync_opt.costs.rules import (
    DEFAULT_CONTEXT_BYTES,
    GRAD_DTYPE,
    PASS_PRECISION,
    CostRules,
    allowed_on,
    check_plan_entry,
    check_tie,
    fidelity,
    pass_precision,
    widest,
    widest_precision,
)
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

P = Precision
D = DType
#: Every tabled cast costs 0.001 ms per element plus 0.01 ms.
A, B = 0.001, 0.01


def cast(numel: float) -> float:
    return A * numel + B


def _op(name: str, role: OpRole, kind: OpKind, *, weight: int = 0, in_numel: int = 1000,
        saved: int = 0, shared: int = 0) -> OpNode:
    allowed = {OpRole.choosable: [P.fp32, P.bf16, P.fp16, P.int8],
               OpRole.pinned: [P.fp32]}.get(role, [])
    return OpNode(
        name=name, kind=kind, target="test", role=role, allowed_precisions=allowed,
        pin_reason="test pin" if role == OpRole.pinned else None,
        input_shapes=[[in_numel]], output_shapes=[[1000]],
        weight_shape=[weight] if weight else None, param_count=weight,
        input_numel=in_numel, output_numel=1000, fwd_flops=1, bwd_flops=1, fwd_bytes=1,
        saved_bytes=saved, saved_shared_bytes=shared, depth=0)


def _graph() -> ModelGraph:
    """a (choosable, reads the model input) -> b (pass-through) -> c (choosable);
    d = b + c (promote) -> e (pinned)."""
    ops = [_op("a", OpRole.choosable, OpKind.linear, weight=100, in_numel=500, saved=2000),
           _op("b", OpRole.pass_through, OpKind.activation, saved=4000, shared=4000),
           _op("c", OpRole.choosable, OpKind.linear, weight=100, saved=4000, shared=4000),
           _op("d", OpRole.promote, OpKind.elementwise),
           _op("e", OpRole.pinned, OpKind.norm, saved=4000)]
    edges = [Edge(src=s, dst=t, shape=[1000], numel=1000, bytes=4000)
             for s, t in (("a", "b"), ("b", "c"), ("b", "d"), ("c", "d"), ("d", "e"))]
    return ModelGraph(workload="rules", batch_size=1, inputs=[], ops=ops, edges=edges,
                      max_depth=3, param_count=200, param_bytes=800, buffer_bytes=0,
                      trace_method="hand", torch_version="n/a")


#: op -> precision -> (fwd_ms, bwd_ms)
COSTS = {
    "a": {P.fp32: (2.0, 4.0), P.fp16: (1.0, 2.0), P.int8: (0.5, 2.0)},
    "b": {P.fp32: (0.5, 0.5), P.fp16: (0.25, 0.25)},
    "c": {P.fp32: (3.0, 6.0), P.fp16: (1.5, 3.0), P.int8: (1.0, 3.0)},
    "d": {P.fp32: (0.4, 0.4), P.fp16: (0.2, 0.2)},
    "e": {P.fp32: (0.3, 0.6)},
}


def _costs(graph: ModelGraph, flow: str = "native") -> CostTable:
    entries = [OpCost(device="t4", batch_size=1, op=op, precision=p, fwd_ms=f, bwd_ms=b,
                      source="estimated")
               for op, row in COSTS.items() for p, (f, b) in row.items()]
    # No fp16 -> int8 entry: that cast goes through fp32.
    casts = [CastCost(device="t4", src=s, dst=t, a_ms_per_element=A, b_ms=B,
                      source="estimated")
             for s, t in ((D.fp32, D.fp16), (D.fp16, D.fp32), (D.fp32, D.int8))]
    opt = [OptimizerCost(device="t4", optimizer=k, ms=0.5, state_bytes=800)
           for k in ("sgd", "adam")]
    comm = CommModel(world_size=2, bandwidth_gb_per_s=1.0, latency_us=0.0, bottleneck="test",
                     source="estimated")
    buckets = [GradBucket(index=0, ops=["c"], bytes=400, allreduce_ms=1.0),
               GradBucket(index=1, ops=["a"], bytes=400, allreduce_ms=2.0)]
    return CostTable(workload="rules", graph_hash=graph.structure_hash(), entries=entries,
                     casts=casts, comm=comm, buckets=buckets, bucket_cap_bytes=400,
                     optimizer=opt, efficiencies=Efficiencies(), activation_flow=flow)


def _cluster(count: int = 2) -> ClusterSpec:
    return ClusterSpec(groups=[{"name": "t4", "device": "t4", "count": count,
                                "batch_per_device": 1}])


def _rules(flow: str = "native", count: int = 2) -> CostRules:
    g = _graph()
    return CostRules(g, _cluster(count), _costs(g, flow))


def _row(rules: CostRules, **precs: Precision) -> list[Precision | None]:
    return [precs.get(o.name, P.fp32) if o.role == OpRole.choosable else None
            for o in rules.ops]


# ----------------------------------------------------------------------- precisions here


def test_the_dtype_precision_map_is_the_pass_through_precisions() -> None:
    assert PASS_PRECISION == {D.fp32: P.fp32, D.fp16: P.fp16, D.bf16: P.bf16}
    for d, p in PASS_PRECISION.items():
        assert p.info.takes_in == p.info.gives_out == d
    assert pass_precision(D.int8) == P.fp32 and pass_precision(D.fp8_e4m3) == P.fp32


@pytest.mark.parametrize("dtypes, expected", [
    ([], D.fp32), ([D.fp16], D.fp16), ([D.bf16, D.bf16], D.bf16), ([D.fp16, D.fp32], D.fp32),
    ([D.fp16, D.bf16], D.fp32)])
def test_widest_is_autocasts_promotion(dtypes: list[DType], expected: DType) -> None:
    assert widest(dtypes) == expected
    if dtypes:
        assert widest_precision(set(dtypes)) == PASS_PRECISION[expected]


def test_allowed_and_on_the_menu_keeps_the_ops_order() -> None:
    rules = _rules()
    a = rules.ops[0]
    grp = rules.groups[0]
    assert allowed_on(a, [P.int8, P.fp16, P.fp32]) == [P.fp32, P.fp16, P.int8]
    assert grp.allowed(a) == [P.fp32, P.fp16, P.int8]  # a T4 runs no bf16
    assert grp.allowed(rules.ops[1]) == []  # a pass-through op has no choice
    assert sorted([P.fp16, P.int8, P.fp32, P.bf16], key=fidelity) == [
        P.int8, P.bf16, P.fp16, P.fp32]


def test_a_plan_entry_is_set_kept_or_refused_by_one_rule() -> None:
    """check_plan_entry: a choosable op within the allowed set is set, a pinned op at a
    precision it allows is kept (True), anything else refused in one line."""
    ops = {o.name: o for o in _graph().ops}
    where = "plan: group t4"
    assert check_plan_entry(ops["a"], P.fp16, [P.fp32, P.fp16], where, "a", "t4") is False
    assert check_plan_entry(ops["e"], P.fp32, [], where, "e", "t4") is True
    with pytest.raises(QsyncInputError, match=r"^plan: group t4 \(t4\), op a: int8 is not "
                                              r"allowed; allowed: fp32, fp16$"):
        check_plan_entry(ops["a"], P.int8, [P.fp32, P.fp16], where, "a", "t4")
    with pytest.raises(QsyncInputError, match=r"allowed; allowed: none$"):
        check_plan_entry(ops["a"], P.int8, [], where, "a", "t4")
    with pytest.raises(QsyncInputError, match=r"^plan: group t4, op e is pinned \(test pin\); "
                                              r"its precision cannot be set to fp16$"):
        check_plan_entry(ops["e"], P.fp16, [P.fp32, P.fp16], where, "e", "t4")
    with pytest.raises(QsyncInputError, match=r"^plan: group t4, op b is pass_through; its "
                                              r"precision cannot be set to fp32$"):
        check_plan_entry(ops["b"], P.fp32, [P.fp32], where, "b", "t4")


def test_ops_of_one_tie_group_get_one_precision() -> None:
    ties: dict[str, tuple[str, Precision]] = {}
    check_tie(ties, "module:m", "a", P.fp16, "plan: group t4")
    check_tie(ties, "module:m", "c", P.fp16, "plan: group t4")
    check_tie(ties, "other", "b", P.fp32, "plan: group t4")
    assert ties == {"module:m": ("a", P.fp16), "other": ("b", P.fp32)}
    with pytest.raises(QsyncInputError, match=r"^plan: group t4: ops a and d share tie group "
                                              r"module:m but get fp16 and int8$"):
        check_tie(ties, "module:m", "d", P.int8, "plan: group t4")
    with pytest.raises(QsyncInputError, match=r"ops 'a' and 'd\\x00' share tie group "):
        check_tie(ties, "module:m", "d\x00", P.int8, "plan: group t4", repr)


def test_a_plan_row_from_one_choice_per_unit() -> None:
    """plan_row: every op of a unit at the unit's choice, None where no unit holds the op."""
    rules = _rules()
    assert rules.plan_row([("a",), ("c",)], [P.fp16, P.int8]) == \
        [P.fp16, None, P.int8, None, None]
    assert rules.plan_row([("a", "c")], [P.bf16]) == [P.bf16, None, P.bf16, None, None]
    with pytest.raises(ValueError):
        rules.plan_row([("a",), ("c",)], [P.fp16])


def test_the_gradient_dtype_of_each_precision() -> None:
    assert set(GRAD_DTYPE) == set(Precision)
    assert GRAD_DTYPE[P.fp32] == GRAD_DTYPE[P.tf32] == D.fp32
    assert GRAD_DTYPE[P.int8] == GRAD_DTYPE[P.fp16] == D.fp16
    assert GRAD_DTYPE[P.fp8] == GRAD_DTYPE[P.bf16] == D.bf16


# ----------------------------------------------------------------------- dtype chain


@pytest.mark.parametrize("a, c, expected_in, expected_out", [
    # a fp16 gives fp16; b carries it; c fp32; d = widest(fp16, fp32); e pinned fp32
    (P.fp16, P.fp32, [D.fp16, D.fp16, D.fp32, D.fp32, D.fp32],
     [D.fp16, D.fp16, D.fp32, D.fp32, D.fp32]),
    # both fp16: the add runs in fp16, the pinned op still takes fp32
    (P.fp16, P.fp16, [D.fp16, D.fp16, D.fp16, D.fp16, D.fp32],
     [D.fp16, D.fp16, D.fp16, D.fp16, D.fp32]),
    # int8 takes int8 and gives fp32
    (P.int8, P.fp16, [D.int8, D.fp32, D.fp16, D.fp32, D.fp32],
     [D.fp32, D.fp32, D.fp16, D.fp32, D.fp32]),
])
def test_dtype_chain(a: Precision, c: Precision, expected_in: list[DType],
                     expected_out: list[DType]) -> None:
    rules = _rules()
    din, dout = rules.dtypes(_row(rules, a=a, c=c))
    assert din == expected_in
    assert dout == expected_out


def test_on_the_fp32_flow_every_activation_is_fp32() -> None:
    rules = _rules("fp32")
    assert not rules.native_flow
    din, dout = rules.dtypes(_row(rules, a=P.fp16, c=P.int8))
    assert set(din) == set(dout) == {D.fp32}
    assert rules.takes_in(P.int8) == rules.gives_out(P.fp16) == D.fp32


# ----------------------------------------------------------------------- casts and compute


def test_cast_cost_tabled_untabled_and_missing() -> None:
    rules = _rules()
    grp = rules.groups[0]
    assert rules.cast_ms(grp, D.fp16, D.fp16, 1000) == 0.0
    assert rules.cast_ms(grp, D.fp32, D.fp16, 0) == 0.0
    assert rules.cast_ms(grp, D.fp32, D.fp16, 1000) == pytest.approx(cast(1000))
    # fp16 -> int8 is not tabled: through fp32, two casts
    assert rules.cast_ms(grp, D.fp16, D.int8, 1000) == pytest.approx(2 * cast(1000))
    with pytest.raises(QsyncInputError, match="no cast model bf16 -> fp16 for t4"):
        rules.cast_ms(grp, D.bf16, D.fp16, 10)


def _items(rules: CostRules, name: str, prec: list[Precision | None],
           edges: list[tuple[int, int]] | None = None
           ) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    din, dout = rules.dtypes(prec)
    f, b = rules.op_items(rules.groups[0], rules.index[name], prec, din, dout, edges)
    return [(k, ms) for k, _, ms, _ in f], [(k, ms) for k, _, ms, _ in b]


def test_casts_between_neighbours() -> None:
    rules = _rules()
    prec = _row(rules, a=P.fp16, c=P.fp32)
    # a reads the fp32 model input (500 elements) and casts its weight (100)
    fa, ba = _items(rules, "a", prec)
    assert fa == [("cast", pytest.approx(cast(500))), ("weight_cast", pytest.approx(cast(100))),
                  ("fwd", 1.0)]
    assert ba == [("bwd", 2.0), ("grad_cast", pytest.approx(cast(100)))]
    # b carries a's fp16: no cast on its edge, runs at its fp16 entry
    assert _items(rules, "b", prec) == ([("fwd", 0.25)], [("bwd", 0.25)])
    # c (fp32) after the fp16 b: cast in, its fp32 input gradient cast back to fp16
    fc, bc = _items(rules, "c", prec)
    assert fc == [("cast", pytest.approx(cast(1000))), ("fwd", 3.0)]
    assert bc == [("bwd", 6.0), ("cast", pytest.approx(cast(1000)))]
    # d promotes fp16 (b) and fp32 (c) to fp32: a cast on b's edge only, both ways
    fd, bd = _items(rules, "d", prec)
    assert fd == [("cast", pytest.approx(cast(1000))), ("fwd", 0.4)]
    assert bd == [("bwd", 0.4), ("cast", pytest.approx(cast(1000)))]
    # e is pinned and fed fp32: no cast
    assert _items(rules, "e", prec) == ([("fwd", 0.3)], [("bwd", 0.6)])


def test_an_int8_op_quantizes_through_fp32_where_the_pair_is_not_tabled() -> None:
    rules = _rules()
    fc, bc = _items(rules, "c", _row(rules, a=P.fp16, c=P.int8))
    assert fc == [("cast", pytest.approx(2 * cast(1000))),
                  ("weight_cast", pytest.approx(cast(100))), ("fwd", 1.0)]
    # int8's input gradient is fp16, what b gives out: no cast back
    assert bc == [("bwd", 3.0), ("grad_cast", pytest.approx(cast(100)))]


def test_items_are_additive_over_in_edges() -> None:
    rules = _rules()
    prec = _row(rules, a=P.fp16, c=P.fp32)
    din, dout = rules.dtypes(prec)
    grp, i = rules.groups[0], rules.index["d"]
    base = rules.op_ms(grp, i, prec, din, dout, [])
    assert base == pytest.approx(0.8)
    per_edge = [rules.op_ms(grp, i, prec, din, dout, [e]) - base for e in rules.in_edges[i]]
    assert per_edge == [pytest.approx(2 * cast(1000)), pytest.approx(0.0)]
    assert rules.op_ms(grp, i, prec, din, dout) == pytest.approx(base + sum(per_edge))


def test_on_the_fp32_flow_an_op_is_its_measured_cost() -> None:
    rules = _rules("fp32")
    prec = _row(rules, a=P.fp16, c=P.int8)
    assert _items(rules, "a", prec) == ([("fwd", 1.0)], [("bwd", 2.0)])
    assert _items(rules, "c", prec) == ([("fwd", 1.0)], [("bwd", 3.0)])
    assert _items(rules, "d", prec) == ([("fwd", 0.4)], [("bwd", 0.4)])


def test_compute_lookup() -> None:
    rules = _rules()
    grp = rules.groups[0]
    assert rules.compute_ms(grp, rules.index["c"], P.int8, D.fp32) == (1.0, 3.0)
    assert rules.compute_ms(grp, rules.index["b"], None, D.fp16) == (0.25, 0.25)
    assert rules.compute_ms(grp, rules.index["b"], None, D.int8) == (0.5, 0.5)  # fp32 entry
    assert rules.compute_ms(grp, rules.index["e"], None, D.fp16) == (0.3, 0.6)  # its pin
    with pytest.raises(QsyncInputError, match="no bf16 entry for op b on t4 at batch 1"):
        rules.compute_ms(grp, rules.index["b"], None, D.bf16)


# ----------------------------------------------------------------------- memory


@pytest.mark.parametrize("c, expected", [
    # cast in from b's fp16: a new fp32 tensor saved whole; no copy; fp32 in and out
    (P.fp32, (4000.0, 0.0, 8000.0)),
    # no cast: the tensor is b's, shared (unique part 0); fp16 weight copy; fp16 in and out
    (P.fp16, (0.0, 200.0, 4000.0)),
    # quantized on the way in: int8 saved (a quarter), int8 weight copy, int8 in, fp32 out
    (P.int8, (1000.0, 100.0, 5000.0)),
])
def test_memory_of_an_op_in_each_precision(c: Precision, expected: tuple[float, ...]) -> None:
    rules = _rules()
    prec = _row(rules, a=P.fp16, c=c)
    din, dout = rules.dtypes(prec)
    got = rules.op_memory(rules.groups[0], rules.index["c"], prec, din, dout)
    assert got == pytest.approx(expected)
    assert rules.mem_terms(rules.groups[0], rules.index["c"], prec, din, dout) == got


def test_memory_of_an_op_on_the_model_input_and_of_a_pinned_op() -> None:
    rules = _rules()
    prec = _row(rules, a=P.fp16, c=P.fp16)
    din, dout = rules.dtypes(prec)
    grp = rules.groups[0]
    # a casts the model input to fp16: its own copy, saved at 2 bytes; 500 and 1000 fp16
    assert rules.op_memory(grp, 0, prec, din, dout) == pytest.approx((1000.0, 200.0, 3000.0))
    # e (pinned) casts d's fp16 to fp32 and saves that fp32 tensor; fp32 in and out
    assert rules.op_memory(grp, 4, prec, din, dout) == pytest.approx((4000.0, 0.0, 8000.0))


@pytest.mark.parametrize("c, expected", [
    (None, (0.0, 0.0, 8000.0, 8000.0)),
    (P.fp32, (0.0, 0.0, 8000.0, 8000.0)),
    (P.fp16, (2000.0, 200.0, 10000.0, 12200.0)),
    (P.bf16, (2000.0, 200.0, 10000.0, 12200.0)),
    (P.int8, (1004.0, 500.0, 12000.0, 14400.0)),
    (P.fp8, (4000.0, 400.0, 12000.0, 8000.0)),
])
def test_runtime_memory_of_an_op_in_each_precision(c: Precision | None,
                                                   expected: tuple[float, ...]) -> None:
    """The runtime's allocations (fp32 flow) of c, a Linear of 100 weights, 1000 in and out."""
    rules = _rules("fp32")
    got = rules.runtime_op_memory(rules.groups[0], rules.index["c"], c)
    assert got == pytest.approx(expected)
    prec = _row(rules, c=c or P.fp32)
    din, dout = rules.dtypes(prec)
    i = rules.index["c"]
    if c is not None:
        assert rules.mem_terms(rules.groups[0], i, prec, din, dout) == got
        assert rules.op_memory(rules.groups[0], i, prec, din, dout) == pytest.approx(
            (got[0], got[1], max(got[2], got[3])))


def test_static_memory() -> None:
    native = _rules()
    assert native.static_memory(native.groups[0]) == {
        "weights_fp32": 800, "grads_fp32": 800, "optimizer_state": 800, "buffers": 0,
        "context": DEFAULT_CONTEXT_BYTES}
    # the runtime's DDP keeps one more copy of the gradients, with more than one rank
    fp32 = _rules("fp32")
    assert fp32.static_memory(fp32.groups[0])["ddp_buckets"] == 800
    alone = _rules("fp32", count=1)
    assert "ddp_buckets" not in alone.static_memory(alone.groups[0])


def _cols(rules: CostRules, prec: list[Precision | None]) -> list[list[float]]:
    din, dout = rules.dtypes(prec)
    terms = [rules.mem_terms(rules.groups[0], i, prec, din, dout) for i in range(rules.n)]
    return [[t[c] for t in terms] for c in range(rules.n_mem_terms)]


def test_the_summed_view_on_the_native_flow() -> None:
    rules = _rules()
    prec = _row(rules, a=P.fp16, c=P.fp32)
    grp = rules.groups[0]
    mem = rules.peak_memory(grp, _cols(rules, prec))
    assert mem == rules.summed_memory(grp, _cols(rules, prec)) == rules.group_memory(grp, prec)
    # a: 1000 saved + 200 copy; b: shared; c: 4000 (cast in); d: 0; e: 4000 saved fp32
    assert mem["activations"] == 1000 + 4000 + 4000
    assert mem["weight_copies"] == 200
    assert mem["workspace"] == 8000
    assert sum(mem.values()) == 3 * 800 + DEFAULT_CONTEXT_BYTES + 9000 + 200 + 8000


@pytest.mark.parametrize("a, c", [(P.fp32, P.fp32), (P.fp16, P.int8), (P.int8, P.fp16)])
def test_the_timeline_view_is_below_the_linear_bound(a: Precision, c: Precision) -> None:
    """On the fp32 flow the replayer reports the runtime's timeline; the integer program
    sums the same terms (every saved tensor, copy and fp32 gradient at once, the largest
    transient): an upper bound, on purpose."""
    rules = _rules("fp32")
    grp = rules.groups[0]
    prec = _row(rules, a=a, c=c)
    cols = _cols(rules, prec)
    peak = rules.peak_memory(grp, cols)
    assert peak == rules.timeline_memory(grp, cols) == rules.group_memory(grp, prec)
    din, dout = rules.dtypes(prec)
    terms = [rules.op_memory(grp, i, prec, din, dout) for i in range(rules.n)]
    bound = (sum(rules.static_memory(grp).values()) + sum(t[0] + t[1] for t in terms)
             + max(t[2] for t in terms))
    assert sum(peak.values()) <= bound
    assert peak["grads_fp32"] <= rules.graph.param_bytes


def test_the_timeline_peak_by_hand() -> None:
    """All fp32 on the fp32 flow: a saves 2000 bytes and e 4000 (b, c and d share theirs).
    The peak is e's forward: 6000 saved and its transient (1000 in, 1000 out, fp32), no
    gradient yet; a's backward holds less (2000 saved, 800 of gradients, out 4000 and its
    input gradient 2000)."""
    rules = _rules("fp32")
    grp = rules.groups[0]
    mem = rules.group_memory(grp, _row(rules))
    assert mem["activations"] == 6000 and mem["weight_copies"] == 0
    assert mem["grads_fp32"] == 0
    assert mem["workspace"] == 8000
    assert sum(mem.values()) == sum(rules.static_memory(grp).values()) - 800 + 6000 + 8000


# ----------------------------------------------------------------------- who uses them


def test_the_replayer_reports_what_the_rules_give() -> None:
    from qsync_opt.replayer import Replayer

    for flow in ("native", "fp32"):
        g = _graph()
        rep = Replayer(g, _cluster(), _costs(g, flow))
        rules = rep.rules
        for a, c in ((P.fp16, P.fp32), (P.int8, P.fp16), (P.fp32, P.int8)):
            plan = {"t4": {"a": a, "c": c}}
            prec = rep.precisions_for(plan)[0]
            gt = rep.simulate(plan, events=False).groups["t4"]
            din, dout = rules.dtypes(prec)
            ms = sum(rules.op_ms(rules.groups[0], i, prec, din, dout) for i in range(rules.n))
            assert gt.compute_ms == pytest.approx(ms)
            assert gt.memory == rules.group_memory(rules.groups[0], prec)
            assert rep.incremental(plan).state().peak_memory_bytes["t4"] == \
                gt.peak_memory_bytes


def test_one_definition_of_each_rule() -> None:
    """The replayer, the problem and the costs take the rules' names, not copies."""
    from qsync_opt import replayer
    from qsync_opt.costs import roofline as costs
    from qsync_opt.costs import rules
    from qsync_opt.problem import groupmodel

    assert replayer.GRAD_DTYPE is rules.GRAD_DTYPE
    assert replayer.widest is rules.widest
    assert replayer.DEFAULT_CONTEXT_BYTES == rules.DEFAULT_CONTEXT_BYTES
    assert groupmodel.widest_precision is rules.widest_precision
    assert costs.PASS_PRECISION is rules.PASS_PRECISION
