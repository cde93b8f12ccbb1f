"""The strong groups stay at their reference precision unless the user, the target or memory
says otherwise: the "no straggler" default target never lowers the strong cards themselves."""

from __future__ import annotations

import random

import pytest
from qsync_opt.solvers import get_backend

from qsync_opt import estimate, parse_shorthand, trace
from qsync_opt.core.precision import Precision
from qsync_opt.planner.solve import InfeasibleError, solve
from qsync_opt.problem.evaluator import evaluate
from qsync_opt.problem.program import AllocationProblem, ProblemOptions
from qsync_opt.problem.synthetic import random_indicator

EXACT = ("highs", "cbc", "cpsat")
CLUSTER = "v100x16+t4x16"


def _lowered(plan, group):
    return sorted(op for op, p in plan.groups[group].precisions.items() if p != Precision.fp32)


@pytest.fixture(scope="module")
def setups(resnet50_graph, bert_graph):
    cluster = parse_shorthand(CLUSTER)
    return {g.workload: (g, cluster, estimate(g, cluster)) for g in (bert_graph, resnet50_graph)}


@pytest.mark.parametrize("backend", EXACT)
@pytest.mark.parametrize("model", ["bert_base", "resnet50"])
def test_default_target_keeps_the_strong_group_at_fp32(setups, model, backend):
    """Every exact backend, three random indicators: the V100s (the strong group, which sets
    the default target) run every op at fp32; the T4s are lowered to keep up. BERT's
    all-reduce leaves time exposed in the replayer that the linear target does not count,
    so refinement used to tighten the target below the V100s' own time and lower 5-6 of
    their ops."""
    assert get_backend(backend).is_available(), f"{backend} is missing"
    graph, cluster, costs = setups[model]
    for seed in range(3):
        prob = AllocationProblem(graph, cluster, costs, random_indicator(graph, seed))
        assert prob.strong_groups == ("v100",) and prob.held_groups == ("v100",)
        plan, report = solve(prob, backend, compare_ties=False)
        assert _lowered(plan, "v100") == [], (seed, report.messages)
        assert _lowered(plan, "t4"), seed  # the weak group does the catching up
        ev = evaluate(prob, plan)
        assert ev.feasible, ev.violations
        assert ev.groups["v100"].degradation == 0.0


def test_lower_reference_frees_the_strong_group(setups):
    """With lower_reference=True the solver may lower the V100s; refinement then does so on
    BERT to win back the exposed all-reduce; held, no plan beats the V100s' own time in
    the replayer, and the problem says why."""
    graph, cluster, costs = setups["bert_base"]
    ind = random_indicator(graph, 0)
    held = AllocationProblem(graph, cluster, costs, ind)
    free = AllocationProblem(graph, cluster, costs, ind, ProblemOptions(lower_reference=True))
    assert free.held_groups == () and free.target_ms == held.target_ms
    assert all(len(c) > 1 for c in free.group("v100").choices if len(c) > 1) and any(
        len(c) > 1 for c in free.group("v100").choices)
    assert all(len(c) == 1 for c in held.group("v100").choices)
    plan, _ = solve(free, "highs", compare_ties=False)
    assert _lowered(plan, "v100")
    replay = held.no_straggler_replay_ms()
    assert replay > held.target_ms
    assert any(f"{replay:.3f} ms" in n and "no plan meets the target in the replayer" in n
               for n in held.notes), held.notes
    hplan, _ = solve(held, "highs", compare_ties=False)
    assert evaluate(held, hplan).replay_makespan_ms >= replay * (1 - 1e-9)


def test_a_target_below_the_strong_groups_reference_frees_them(setups):
    """A given target the V100s cannot meet at fp32: by default they may be lowered (with a
    note); lower_reference=False holds them and the problem has no plan, the diagnosis
    naming the hold."""
    graph, cluster, costs = setups["resnet50"]
    ind = random_indicator(graph, 1)
    base = AllocationProblem(graph, cluster, costs, ind)
    tight = 0.9 * base.reference_makespan_ms
    auto = base.with_options(target_ms=tight)
    assert auto.held_groups == ()
    assert any("below the strong group(s)'" in n and "may be lowered" in n for n in auto.notes)
    plan, _ = solve(auto, "highs", compare_ties=False)
    assert _lowered(plan, "v100")
    loose = base.with_options(target_ms=1.5 * base.reference_makespan_ms)
    assert loose.held_groups == ("v100",)  # a target it meets at fp32: held
    hold = base.with_options(target_ms=tight, lower_reference=False)
    assert hold.held_groups == ("v100",)
    with pytest.raises(InfeasibleError) as exc:
        solve(hold, "highs", compare_ties=False)
    assert any("v100: held at its reference precision (fp32)" in line
               and "--lower-reference" in line for line in exc.value.lines), exc.value.lines


def test_a_strong_group_whose_reference_does_not_fit_is_lowered_and_the_notes_say_why(
        resnet50_graph):
    """ResNet-50 at batch 192 needs 17.9 GiB at fp32, more than a 16 GB V100 has: the V100s
    (still the strong group) are not held, the solver lowers what they need, and the
    problem's notes say so (the CLI prints them)."""
    cluster = parse_shorthand("v100_pciex16@192+t4x16@192")
    prob = AllocationProblem(resnet50_graph, cluster, estimate(resnet50_graph, cluster),
                             random_indicator(resnet50_graph, 2))
    v100 = prob.group("v100_pcie")
    assert prob.strong_groups == ("v100_pcie",) and prob.held_groups == ()
    assert v100.memory_bytes(v100.reference) > v100.capacity_bytes
    assert any(n.startswith("strong group v100_pcie (v100_pcie) is not held at its reference "
                            "fp32: its reference plan needs 17.87 GiB, has 16.00 GiB")
               and "fit memory" in n for n in prob.notes), prob.notes
    plan, _ = solve(prob, "highs", compare_ties=False)
    assert _lowered(plan, "v100_pcie")
    ev = evaluate(prob, plan)
    assert ev.feasible and ev.groups["v100_pcie"].fits, ev.violations


@pytest.mark.parametrize("model,shorthand,reference", [
    ("resnet50", "a100x2+t4x2", "fp16"),  # derived units (residual adds) on the held group
    ("bert_base", "v100x2+t4x2", "fp32"),
    ("gpt2_small", "h100x2+l4x2", "bf16"),
])
def test_a_held_group_costs_what_the_free_group_costs_at_its_reference(model, shorthand,
                                                                       reference):
    """Holding slices the free group's coefficients (pair terms with one side held become
    unary or constant): any plan of the held problem has the free problem's time, memory and
    degradation, and the replayer's."""
    graph = trace(model, 4)
    cluster = parse_shorthand(shorthand)
    costs = estimate(graph, cluster)
    ind = random_indicator(graph, 3)
    held = AllocationProblem(graph, cluster, costs, ind, ProblemOptions(reference=reference))
    free = AllocationProblem(graph, cluster, costs, ind,
                             ProblemOptions(reference=reference, lower_reference=True))
    strong = held.held_groups[0]
    hg, fg = held.group(strong), free.group(strong)
    assert all(len(c) == 1 for c in hg.choices)
    assert hg.choices == [(c[r],) for c, r in zip(fg.choices, fg.reference, strict=True)]
    assert len(hg.pairs) < len(fg.pairs)
    assert hg.time_ms(hg.reference) == pytest.approx(fg.time_ms(fg.reference), rel=1e-12)
    assert hg.memory_bytes(hg.reference) == pytest.approx(fg.memory_bytes(fg.reference),
                                                          rel=1e-12)
    if reference == "fp16":
        assert any(len(d.choices) < len(fd.choices)
                   for d, fd in zip(hg.derived, fg.derived, strict=True))
    rng = random.Random(0)
    for _ in range(4):
        a = {g.name: [rng.randrange(len(c)) for c in g.choices] for g in held.groups}
        plan = held.make_plan(a)
        fa = free.assignment(plan)
        tl = held.replayer.simulate(plan, events=False)
        for g in held.groups:
            f = free.group(g.name)
            assert g.time_ms(a[g.name]) == pytest.approx(f.time_ms(fa[g.name]), rel=1e-12)
            assert g.time_ms(a[g.name]) == pytest.approx(tl.groups[g.name].compute_ms, rel=1e-12)
            assert g.memory_bytes(a[g.name]) == pytest.approx(f.memory_bytes(fa[g.name]),
                                                              rel=1e-12)
            assert g.degradation(a[g.name]) == f.degradation(fa[g.name])
        assert held.objective(a) == pytest.approx(free.objective(fa), rel=1e-12)


def test_a_plan_that_lowers_a_held_group_is_refused_with_the_way_out(setups):
    graph, cluster, costs = setups["resnet50"]
    ind = random_indicator(graph, 0)
    free = AllocationProblem(graph, cluster, costs, ind, ProblemOptions(lower_reference=True))
    held = AllocationProblem(graph, cluster, costs, ind)
    plan = free.make_plan({g.name: g.lowest() for g in free.groups})
    with pytest.raises(Exception, match="v100 is held at its reference precision"):
        evaluate(held, plan)
    assert evaluate(free, plan).objective > 0
