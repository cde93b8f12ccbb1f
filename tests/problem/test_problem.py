"""The allocation problem's linear model against the replayer, and the evaluator."""

from __future__ import annotations

import random

import pytest

from qsync_opt import Plan, estimate, parse_shorthand, trace
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.problem.evaluator import evaluate
from qsync_opt.problem.program import AllocationProblem, ProblemOptions
from qsync_opt.problem.synthetic import perturb_costs, random_indicator, synthetic_graph


def _problem(graph, shorthand, options=None, seed=0, perturb=False):
    cluster = parse_shorthand(shorthand)
    costs = estimate(graph, cluster)
    if perturb:
        costs = perturb_costs(costs, seed)
    return AllocationProblem(graph, cluster, costs, random_indicator(graph, seed), options)


def _random_assignment(problem, rng):
    return {g.name: [rng.randrange(len(c)) for c in g.choices] for g in problem.groups}


@pytest.mark.parametrize("model,shorthand", [
    ("resnet50", "v100x16+t4x16"),
    ("bert_base", "a100x8+t4x8"),
    ("gpt2_small", "h100x8+l4x8+t4x8"),
    ("tiny_gpt", "a100x2+t4x2"),
    ("digits_cnn", "l4x1+t4x1"),
])
def test_linear_model_equals_replayer_compute_and_memory(model, shorthand):
    """The linear model's per-group time and memory are the replayer's, for any plan: its
    coefficients come from the replayer's own cost rules, split per in-edge."""
    graph = trace(model, 4)
    # Every group free (the strong ones too), so random plans cover them all.
    prob = _problem(graph, shorthand, ProblemOptions(lower_reference=True), perturb=True)
    assert prob.held_groups == ()
    # No approximation is needed on the catalog models.
    assert not [n for n in prob.notes if n.startswith("linear model")]
    rng = random.Random(1)
    for _ in range(12):
        a = _random_assignment(prob, rng)
        tl = prob.replayer.simulate(prob.make_plan(a), events=False)
        for g in prob.groups:
            assert g.time_ms(a[g.name]) == pytest.approx(tl.groups[g.name].compute_ms, rel=1e-12)
            assert g.memory_bytes(a[g.name]) == pytest.approx(
                tl.groups[g.name].peak_memory_bytes, abs=4)


def test_residual_adds_become_derived_units(resnet50_graph):
    """ResNet's downsampling adds are fed by two convs (through batch norm, which passes
    dtypes through): their dtype follows the convs' and sets the next block's input casts."""
    prob = _problem(resnet50_graph, "t4x1", ProblemOptions(lower_reference=True))
    g = prob.groups[0]
    assert g.derived and all(len(d.inputs) >= 1 for d in g.derived)
    assert "layer1.0.add" in {d.op for d in g.derived}
    fp16 = [c.index(Precision.fp16) for c in g.choices]
    full = g.complete(fp16)
    assert all(g.all_choices[d.index][full[d.index]] == Precision.fp16 for d in g.derived)
    rows = g.derived_rows()
    assert rows and all(d >= g.n_units for d, _, _ in rows)


def test_pair_terms_are_the_casts_between_neighbours():
    """On a Linear -> ReLU -> Linear chain the only pair cost is the cast on that edge: zero
    when producer and consumer agree on the dtype, positive when they differ."""
    graph = synthetic_graph(3, seed=3, residual_every=99, norm_every=99)
    prob = _problem(graph, "t4x1", ProblemOptions(lower_reference=True))
    g = prob.groups[0]
    assert g.pairs, "consecutive Linear ops must share a pair term"
    pair = g.pairs[0]
    ch_a, ch_b = g.choices[pair.a], g.choices[pair.b]
    fp16_a, fp16_b = ch_a.index(Precision.fp16), ch_b.index(Precision.fp16)
    fp32_a = ch_a.index(Precision.fp32)
    assert pair.time[fp16_a][fp16_b] == 0  # fp16 out, fp16 in: no cast
    assert pair.time[fp32_a][fp16_b] > 0  # fp32 out, fp16 in: a cast


def test_objective_weights_groups_by_batch_share(resnet50_graph):
    prob = _problem(resnet50_graph, "v100x16@32+t4x16@96")
    w = {g.name: g.weight for g in prob.groups}
    assert w["v100"] == pytest.approx(0.25) and w["t4"] == pytest.approx(0.75)
    a = {g.name: g.lowest() for g in prob.groups}
    expect = sum(g.weight * g.degradation(a[g.name]) for g in prob.groups)
    assert prob.objective(a) == pytest.approx(expect)
    assert prob.global_batch == 16 * 32 + 16 * 96


def test_default_target_is_the_strong_group_at_reference(resnet50_graph):
    prob = _problem(resnet50_graph, "v100x16+t4x16")
    assert prob.strong_groups == ("v100",)
    ref = prob.reference_assignment()
    assert prob.makespan_ms({**ref, "t4": ref["t4"]}) > prob.target_ms  # the t4 straggles
    v100 = prob.group("v100")
    assert v100.time_ms(ref["v100"]) + prob.tail_ms == pytest.approx(prob.target_ms)
    given = prob.with_options(target_ms=123.0)
    assert given.target_ms == 123.0 and given.target_source == "given"


def test_evaluate_reports_target_and_memory_violations(resnet50_graph):
    prob = _problem(resnet50_graph, "v100x16+t4x16")
    ref = prob.make_plan(prob.reference_assignment())
    ev = evaluate(prob, ref)
    assert not ev.meets_target and any("exceeds the target" in v for v in ev.violations)
    assert ev.samples_per_s == pytest.approx(prob.global_batch / ev.replay_makespan_ms * 1e3)
    tight = AllocationProblem(resnet50_graph, parse_shorthand("v100x16+t4x16"), prob.costs,
                              prob.indicator, ProblemOptions(memory_headroom=0.9))
    ev2 = evaluate(tight, ref)
    assert not ev2.fits and any("memory" in v for v in ev2.violations)


def test_plan_round_trips_and_foreign_plans_are_refused(tmp_path, resnet50_graph, bert_graph):
    prob = _problem(resnet50_graph, "v100x16+t4x16")
    plan = prob.make_plan({g.name: g.lowest() for g in prob.groups}, {"solver": "test"})
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    other = _problem(bert_graph, "a100x8+t4x8")
    with pytest.raises(QsyncInputError, match="ops the graph lacks: conv1"):
        evaluate(other, plan)


def test_options_are_validated_with_the_field_named(resnet50_graph):
    with pytest.raises(QsyncInputError, match="memory_headroom"):
        ProblemOptions(memory_headroom=1.5)
    with pytest.raises(QsyncInputError, match="reference"):
        ProblemOptions(reference="int8")
    with pytest.raises(QsyncInputError, match="target_ms"):
        ProblemOptions(target_ms=-1)
    with pytest.raises(QsyncInputError, match="pinned: graph resnet50 has no op"):
        _problem(resnet50_graph, "v100x1+t4x1", ProblemOptions(pinned={"nope": "fp16"}))
    with pytest.raises(QsyncInputError, match="cannot run at int8 on group v100"):
        _problem(resnet50_graph, "v100x1+t4x1", ProblemOptions(pinned={"conv1": "int8"}))


def test_pins_and_reference(resnet50_graph):
    prob = _problem(resnet50_graph, "a100x1+t4x1",
                    ProblemOptions(pinned={"conv1": "fp16"}, reference="bf16"))
    u = prob.unit_of["conv1"]
    assert all(g.choices[u] == (Precision.fp16,) for g in prob.groups)
    a100 = prob.group("a100")
    assert a100.choices[1][a100.reference[1]] == Precision.bf16
    t4 = prob.group("t4")  # no bf16 on a T4: its reference falls back to fp32
    assert t4.choices[1][t4.reference[1]] == Precision.fp32


def test_tie_groups_share_one_decision():
    graph = trace("bert_base", 2, tie="blocks")
    prob = _problem(graph, "a100x1+t4x1")
    tied = [u for u in prob.units if len(u.ops) > 1]
    assert tied and len(prob.units) < len(graph.choosable_ops())
    plan = prob.make_plan({g.name: g.lowest() for g in prob.groups})
    for unit in tied:
        assert len({plan.groups["t4"].precisions[op] for op in unit.ops}) == 1


def test_other_batch_split_is_scored_on_its_own_costs(resnet50_graph):
    prob = _problem(resnet50_graph, "v100x16+t4x16")
    cluster = prob.cluster.model_copy(update={"groups": [
        g.model_copy(update={"batch_per_device": 160 if g.name == "v100" else 96})
        for g in prob.cluster.groups]})
    sub = prob.with_cluster(cluster)
    plan = sub.make_plan(sub.reference_assignment())
    ev = evaluate(prob, plan)
    assert ev.global_batch == 16 * 160 + 16 * 96
    assert ev.groups["t4"].batch == 96
