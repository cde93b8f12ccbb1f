"""Stages, compressed boundaries and the single-process GPipe schedule."""

from __future__ import annotations

import copy
import functools
import io

import pytest
import torch
from helpers import load_benchmark
from qsync_opt.models import get_workload

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.pipeline.stages import Boundary, Pipeline, split_stages
from qsync_opt.runtime.data import IndexedBatches
from qsync_opt.strategy.codecs import Identity, Plain, Quant, TopK


def _model(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return get_workload(name).build()


def _grads_match(pipe: Pipeline, ref: torch.nn.Module, atol: float = 0.0) -> int:
    rg = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    count = 0
    for k, st in enumerate(pipe.stages):
        for n, p in st.named_parameters(remove_duplicate=False):
            g = rg[pipe.original_names[k][n]]
            assert torch.allclose(p.grad, g, atol=atol, rtol=0), n
            count += 1
    return count


@pytest.mark.parametrize(("name", "cuts", "stages"), [
    ("digits_cnn", ["fc1"], None), ("digits_cnn", None, 3),
    ("tiny_gpt", ["transformer.h.2"], None), ("tiny_gpt", None, 3),
    ("digits_resnet", None, 3),
    # inside a residual block: the skip tensor crosses from stage 0 straight to stage 2
    ("digits_resnet", ["layer1.0.conv2", "layer1.0.bn2"], None)])
def test_identity_boundaries_reproduce_the_model_bit_for_bit(name, cuts, stages):
    wl = get_workload(name)
    model = _model(name)
    x, y, idx = IndexedBatches(wl, 0, 8).batch(0)
    pipe = Pipeline(split_stages(model, cuts=cuts, n_stages=stages, example_inputs=x))
    assert len(pipe.stages) == (stages or len(cuts) + 1)
    ref = copy.deepcopy(model)
    ref_loss = wl.loss_of(ref(*x), x, y)
    ref_loss.backward()
    loss = pipe.train_step(wl.loss_of, x, y)
    assert loss == float(ref_loss.detach())
    assert _grads_match(pipe, ref) == len(list(ref.named_parameters(remove_duplicate=False)))
    pipe.eval()
    ref.eval()
    with torch.no_grad():
        assert torch.equal(pipe(*x), ref(*x))


def test_tied_weights_are_held_by_both_stages_and_their_gradient_summed():
    wl = get_workload("tiny_gpt")
    model = _model("tiny_gpt")
    pipe = Pipeline(split_stages(model, cuts=["transformer.h.1", "transformer.h.3"]))
    assert len(pipe.ties) == 1
    (k0, n0), (k1, n1) = pipe.ties[0]
    assert {pipe.original_names[k0][n0], pipe.original_names[k1][n1]} == {
        "transformer.wte.weight", "lm_head.weight"}
    w0, w1 = pipe.stages[k0].get_parameter(n0), pipe.stages[k1].get_parameter(n1)
    assert w0 is not w1 and torch.equal(w0, w1)  # two copies, as two processes hold them
    x, y, _ = IndexedBatches(wl, 0, 4).batch(0)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        pipe.train_step(wl.loss_of, x, y)
        opt.step()
    assert torch.equal(w0, w1)  # the summed gradient keeps the copies identical


def test_micro_batches_give_the_whole_batch_gradient():
    wl = get_workload("tiny_gpt")  # no BatchNorm: micro-batches change nothing but sums
    model = _model("tiny_gpt").double()
    x, y, _ = IndexedBatches(wl, 1, 8).batch(0)
    ref = copy.deepcopy(model)
    wl.loss_of(ref(*x), x, y).backward()
    pipe = Pipeline(split_stages(model, n_stages=2, example_inputs=x))
    pipe.train_step(wl.loss_of, x, y, micro_batches=4)
    _grads_match(pipe, ref, atol=1e-12)
    a, g = pipe.wire_bytes()
    assert a == g == 8 * 128 * 128 * 8  # the residual stream, float64, once each way


def test_the_boundary_passes_gradcheck_in_float64():
    b = Boundary("t", 0, 1, (Plain(Identity()), Plain(Identity())),
                 (Plain(Identity()), Plain(Identity())), Identity())
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: b(t * t, 0, None), (x,))


def test_a_compressed_boundary_compresses_both_ways_and_counts_exact_bytes():
    wl = get_workload("digits_cnn")
    model = _model("digits_cnn")
    x, y, _ = IndexedBatches(wl, 0, 16).batch(0)
    pipe = Pipeline(split_stages(model, cuts=["fc1"]), act=functools.partial(TopK, 0.1),
                    grad=functools.partial(Quant, 4))
    pipe.train_step(wl.loss_of, x, y, micro_batches=2)
    n = 8 * 1024  # one micro-batch's flattened activation: 8 x 1024 floats
    a, g = pipe.wire_bytes()
    assert a == 2 * TopK(0.1).wire_bytes(n, 4)
    assert g == 2 * Quant(4).wire_bytes(n, 4)
    # the gradient that reached stage 0 is not the exact one
    ref = copy.deepcopy(model)
    wl.loss_of(ref(*x), x, y).backward()
    with pytest.raises(AssertionError):
        _grads_match(pipe, ref, atol=1e-6)


def test_compress_at_eval_switch():
    wl = get_workload("digits_cnn")
    model = _model("digits_cnn")
    x, _, _ = IndexedBatches(wl, 0, 16).batch(0)
    pipe = Pipeline(split_stages(model, cuts=["fc1"]), act=functools.partial(TopK, 0.05))
    pipe.eval()
    model.eval()
    with torch.no_grad():
        assert torch.equal(pipe(*x), model(*x))
        pipe.set_compress_at_eval(True)
        assert not torch.allclose(pipe(*x), model(*x))
    assert pipe.wire_bytes() == (0, 0)  # evaluation is not training traffic


@pytest.mark.parametrize("feedback", ["ef", "ef21", "aqsgd"])
def test_checkpoint_and_resume_reproduce_the_run(feedback):
    wl = get_workload("digits_cnn")
    data = IndexedBatches(wl, 0, 16)

    def build() -> tuple[Pipeline, torch.optim.Optimizer]:
        model = _model("digits_cnn", seed=5)
        pipe = Pipeline(split_stages(model, cuts=["conv2", "fc1"]),
                        act=functools.partial(TopK, 0.1),
                        grad=functools.partial(Quant, 4, stochastic=True, seed=2),
                        feedback=feedback, n_samples=data.n_samples)
        return pipe, torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)

    def steps(pipe: Pipeline, opt: torch.optim.Optimizer, lo: int, hi: int) -> None:
        for s in range(lo, hi):
            x, y, idx = data.batch(s % 3)  # samples revisited, so AQ-SGD's buffers matter
            opt.zero_grad()
            pipe.train_step(wl.loss_of, x, y, micro_batches=2, idx=idx)
            opt.step()

    straight, opt = build()
    steps(straight, opt, 0, 6)
    first, opt1 = build()
    steps(first, opt1, 0, 3)
    buf = io.BytesIO()
    torch.save({"pipe": first.full_state_dict(), "opt": opt1.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=False)
    resumed, opt2 = build()
    resumed.load_full_state_dict(state["pipe"])
    opt2.load_state_dict(state["opt"])
    steps(resumed, opt2, 3, 6)
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    assert straight.wire_bytes() == resumed.wire_bytes()


def test_aqsgd_through_the_pipeline_needs_the_sample_indices():
    wl = get_workload("digits_cnn")
    data = IndexedBatches(wl, 0, 8)
    x, y, idx = data.batch(0)
    pipe = Pipeline(split_stages(_model("digits_cnn"), cuts=["fc1"]),
                    act=functools.partial(TopK, 0.1), feedback="aqsgd",
                    n_samples=data.n_samples)
    with pytest.raises(QsyncInputError, match="index"):
        pipe.train_step(wl.loss_of, x, y)
    pipe.train_step(wl.loss_of, x, y, idx=idx)
    b = next(iter(pipe.boundaries.values()))
    assert b.act_bytes == 8 * 1024 * 4 + TopK(0.1).wire_bytes(0, 4)  # first visit: whole


def test_fixed_windows_give_a_sample_the_same_tokens_at_every_visit():
    wl = get_workload("tiny_gpt")
    data = IndexedBatches(wl, 0, 4)
    seen: dict[int, torch.Tensor] = {}
    for s in range(40):
        (x,), y, idx = data.batch(s)
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row, i in zip(x, idx.tolist(), strict=True):
            if i in seen:
                assert torch.equal(seen[i], row)
            seen[i] = row
    assert x.shape == (4, 128)


@pytest.mark.parametrize(("cuts", "match"), [(["nonsense"], "names no op"),
                                             (["fc1", "conv2"], "forward order"),
                                             (["conv1"], "first op")])
def test_bad_cuts_are_refused_by_name(cuts, match):
    with pytest.raises(QsyncInputError, match=match):
        split_stages(_model("digits_cnn"), cuts=cuts)


def test_balancing_refuses_more_stages_than_cut_points():
    x = torch.zeros(2, 1, 8, 8)
    with pytest.raises(QsyncInputError, match="stages"):
        split_stages(_model("digits_cnn"), n_stages=40, example_inputs=x)


def _bench_compression():
    return load_benchmark("bench_compression")


def test_the_compression_study_runs_and_counts_bytes_by_formula():
    bench = _bench_compression()
    report = bench.aqsgd_report("digits_cnn", 2)
    assert "1438 training samples" in report and "MiB" in report
    base = bench.train_one("digits_cnn", 2, bench.Config("none", "both", "none"), 0, micro=2,
                           steps=3)
    q = bench.train_one("digits_cnn", 2, bench.Config("quant:4", "grad", "none"), 0, micro=2,
                        steps=3)
    assert base["eval_plain"] == base["eval_compressed"]
    assert q["act_bytes_per_step"] == base["act_bytes_per_step"]  # activations untouched
    per_mb = base["act_bytes_per_step"] / 2 / 4  # elements of one micro-batch's activation
    assert q["grad_bytes_per_step"] == 2 * Quant(4).wire_bytes(int(per_mb), 4)


def test_stages_balance_on_a_cost_table_too():
    from qsync_opt import estimate, parse_shorthand, trace
    from qsync_opt.pipeline.stages import op_costs_from_table

    graph = trace("tiny_gpt", 4)
    table = estimate(graph, parse_shorthand("t4x1"))
    costs = op_costs_from_table(table, "t4")
    split = split_stages(_model("tiny_gpt"), n_stages=4, costs=costs)
    assert len(split.costs) == 4 and sum(split.costs) == pytest.approx(
        sum(v for k, v in costs.items() if not k.startswith("loss")), rel=1e-9)
    assert max(split.costs) < 0.5 * sum(split.costs)
    with pytest.raises(QsyncInputError, match="no fp32 entries"):
        op_costs_from_table(table, "v100")


def test_stage_costs_add_up_to_the_model_and_follow_the_cuts():
    from qsync_opt import estimate, parse_shorthand, trace
    from qsync_opt.pipeline.stages import op_costs_from_table, stage_costs

    table = estimate(trace("digits_cnn", 16), parse_shorthand("t4x1"))
    fwd = op_costs_from_table(table, "t4", part="fwd")
    bwd = op_costs_from_table(table, "t4", part="bwd")
    both = op_costs_from_table(table, "t4")
    split = split_stages(_model("digits_cnn"), cuts=["fc1"])
    f, b = stage_costs(split, fwd), stage_costs(split, bwd)
    assert [x + y for x, y in zip(f, b, strict=True)] == pytest.approx(stage_costs(split, both))
    head = sum(fwd[k] for k in ("fc1", "relu3", "fc2"))
    assert f[1] == pytest.approx(head)
    assert sum(f) == pytest.approx(sum(v for k, v in fwd.items() if not k.startswith("loss")))


# ---------------------------------------------------------------- cuts balanced and checked


def _digits_costs() -> dict[str, float]:
    from qsync_opt import estimate, parse_shorthand, trace
    from qsync_opt.pipeline.stages import op_costs_from_table

    return op_costs_from_table(estimate(trace("digits_cnn", 16), parse_shorthand("cpux1")),
                               "cpu")


def _brute_force(model: torch.nn.Module, n_stages: int, costs: dict[str, float], x):
    """Every split over every scope change, by enumeration: the least largest stage, and the
    fewest bytes crossing among the splits within the balancing's slack of it."""
    import itertools

    from qsync_opt.pipeline.cuts import (
        BALANCE_SLACK,
        _compute_nodes,
        _crossings,
        _node_costs,
        _scope,
        trace_model,
    )

    gm = trace_model(model)
    nodes = _compute_nodes(gm)
    cross = _crossings(gm, nodes, x)
    w = _node_costs(nodes, costs)
    cand = [i for i in range(1, len(nodes)) if _scope(nodes[i]) != _scope(nodes[i - 1])
            and cross.blocker[i] is None]
    rows = []
    for cut in itertools.combinations(cand, n_stages - 1):
        b = [0, *cut, len(nodes)]
        rows.append((max(sum(w[b[k]:b[k + 1]]) for k in range(n_stages)),
                     sum(cross.nbytes[c] for c in cut)))
    least = min(r[0] for r in rows)
    cheapest = min(r[1] for r in rows if r[0] <= least * (1 + BALANCE_SLACK) + 1e-12)
    return least, cheapest, cross


@pytest.mark.parametrize(("name", "stages"), [("digits_cnn", 3), ("digits_cnn", 4),
                                              ("digits_resnet", 3), ("tiny_gpt", 2)])
def test_balanced_cuts_balance_first_then_send_the_fewest_bytes(name, stages):
    """The dynamic program against enumeration of every split: the largest stage within the
    slack of the least possible (over every scope change, not only the fewest-crossing
    points), and no balanced split sends fewer bytes."""
    from qsync_opt import estimate, parse_shorthand, trace
    from qsync_opt.pipeline.cuts import BALANCE_SLACK, _compute_nodes, op_costs_from_table

    wl = get_workload(name)
    x = wl.make_inputs(4, torch.device("cpu"))
    costs = op_costs_from_table(estimate(trace(name, 4), parse_shorthand("t4x1")), "t4")
    model = _model(name)
    split = split_stages(model, n_stages=stages, costs=costs, example_inputs=x)
    least, cheapest, cross = _brute_force(model, stages, costs, x)
    assert max(split.costs) <= least * (1 + BALANCE_SLACK) + 1e-9
    nodes = _compute_nodes(split.gm)
    cut_pos = [next(i for i, n in enumerate(nodes) if split.stage_of[n.name] == k)
               for k in range(1, stages)]
    assert sum(cross.nbytes[p] for p in cut_pos) == cheapest


def test_the_balance_is_not_limited_to_the_fewest_crossing_points():
    """tiny_gpt in 3 on FLOPs: the old rule cut only at block boundaries (its largest stage
    15% above the least possible); every scope change is a candidate now."""
    wl = get_workload("tiny_gpt")
    x = wl.make_inputs(4, torch.device("cpu"))
    model = _model("tiny_gpt")
    split = split_stages(model, n_stages=3, example_inputs=x)
    from qsync_opt.pipeline.cuts import _default_costs

    least, _, _ = _brute_force(model, 3, _default_costs(model, x), x)
    blocks = split_stages(model, cuts=["transformer.h.1.ln_2", "transformer.h.3"],
                          example_inputs=x)
    from qsync_opt.pipeline.cuts import stage_costs

    old = max(stage_costs(blocks, _default_costs(model, x)))
    assert old > 1.1 * least  # the old rule's split is not balanced
    assert max(split.costs) <= 1.1 * least + 1e-9


@pytest.mark.parametrize("stages", list(range(2, 12)))
def test_every_stage_count_builds_and_trains_stages_without_parameters_too(stages):
    """digits_cnn has 11 ops, 6 with parameters: from 4 stages on some stage may hold none
    (relu1 alone crashed the optimizer). Every count trains, and a parameter-less stage gets
    a NoOptimizer."""
    from qsync_opt.pipeline.run import NoOptimizer, _optimizer
    from qsync_opt.runtime.config import TrainConfig

    wl = get_workload("digits_cnn")
    x, y, _ = IndexedBatches(wl, 0, 8).batch(0)
    model = _model("digits_cnn")
    ref = copy.deepcopy(model)
    wl.loss_of(ref(*x), x, y).backward()
    pipe = Pipeline(split_stages(model, n_stages=stages, costs=_digits_costs(),
                                 example_inputs=x))
    assert len(pipe.stages) == stages
    pipe.train_step(wl.loss_of, x, y)
    assert _grads_match(pipe, ref, atol=1e-6) == len(list(ref.parameters()))
    cfg = TrainConfig.model_construct(lr=0.1, momentum=0.9, weight_decay=0.0, optimizer="sgd")
    bare = 0
    for st in pipe.stages:
        opt = _optimizer(cfg, st)
        assert isinstance(opt, NoOptimizer) == (not list(st.parameters()))
        bare += isinstance(opt, NoOptimizer)
        opt.zero_grad(set_to_none=True)
        opt.step()
        opt.load_state_dict(opt.state_dict())  # a checkpoint round trip
    assert bare >= stages - 6  # 6 ops hold parameters: the rest of the stages hold none


def test_a_parameter_less_first_stage_gets_its_gradient_back_as_across_processes():
    """Stage 0 = a ReLU on the input (nothing needs its gradient): the one-process pipeline
    still sends the gradient back, as the receiving process (which cannot know) does."""
    model = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(4, 3))
    pipe = Pipeline(split_stages(model, cuts=["1"]))
    x = torch.randn(6, 4)
    loss = pipe.train_step(lambda out, inp, t: ((out - t) ** 2).mean(), [x],
                           torch.zeros(6, 3), micro_batches=2)
    assert loss > 0
    a, g = pipe.wire_bytes()
    assert a == g == 6 * 4 * 4
    assert pipe.stages[1].get_parameter("1.weight").grad is not None


@pytest.mark.parametrize(("cuts", "needle"), [
    (["transformer.wpe"], "stage 1 (from 'transformer.wpe') would receive 'narrow'"),
    (["transformer.h.0", "transformer.h.0.attn.c_attn"],
     "stage 2 (from 'transformer.h.0.attn.c_attn') would receive 'size_1'"),
])
def test_a_cut_across_which_an_integer_would_cross_is_refused_naming_the_stage(cuts, needle):
    wl = get_workload("tiny_gpt")
    x = wl.make_inputs(2, torch.device("cpu"))
    with pytest.raises(QsyncInputError, match="not a floating-point tensor") as exc:
        split_stages(_model("tiny_gpt"), cuts=cuts, example_inputs=x)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_balancing_never_cuts_where_an_integer_crosses():
    from qsync_opt.pipeline.cuts import _compute_nodes, _crossings

    wl = get_workload("tiny_gpt")
    x = wl.make_inputs(2, torch.device("cpu"))
    for stages in (2, 5, 9):
        split = split_stages(_model("tiny_gpt"), n_stages=stages, example_inputs=x)
        nodes = _compute_nodes(split.gm)
        cross = _crossings(split.gm, nodes, x)
        for k in range(1, stages):
            p = next(i for i, n in enumerate(nodes) if split.stage_of[n.name] == k)
            assert cross.blocker[p] is None, (stages, k, nodes[p].name)
