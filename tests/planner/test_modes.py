"""Beyond one plan per budget: joint batch split, objective modes, solve-replay refinement,
the Pareto frontier, what tying costs, and infeasibility explained."""

from __future__ import annotations

import functools
import itertools

import pytest
from qsync_opt.solvers.ilp import PulpIlp

from qsync_opt import estimate, parse_shorthand, trace
from qsync_opt.planner.frontier import frontier, plot_frontier
from qsync_opt.planner.solve import InfeasibleError, solve
from qsync_opt.planner.splits import batch_splits
from qsync_opt.problem.evaluator import evaluate
from qsync_opt.problem.program import AllocationProblem, ProblemOptions
from qsync_opt.problem.synthetic import perturb_costs, random_indicator, synthetic_graph


@pytest.fixture(autouse=True)
def _needs_highs() -> None:
    """HiGHS (highspy) is a dependency of the package: these tests fail without it."""
    assert PulpIlp("highs").is_available(), "highs is not available here (highspy is required)"


@functools.cache
def _graph(n: int, seed: int):
    return synthetic_graph(n, seed=seed, batch=128, width=1024)


def _small(seed: int, shorthand: str = "a100x1@128+t4x1@128") -> AllocationProblem:
    g = _graph(3, seed)
    c = parse_shorthand(shorthand)
    return AllocationProblem(g, c, estimate(g, c), random_indicator(g, seed))


def _brute(prob: AllocationProblem) -> float | None:
    """The least objective over every assignment that meets the target and fits."""
    best = 0.0
    budget = prob.group_budget_ms()
    for g in prob.groups:
        vals = [g.weight * g.degradation(a) for a in itertools.product(
            *[range(len(c)) for c in g.choices])
            if g.time_ms(a) <= budget * (1 + 1e-9) and g.memory_bytes(a) <= g.capacity_bytes]
        if not vals:
            return None
        best += min(vals)
    return best


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_joint_split_is_never_worse_than_the_best_fixed_split(seed):
    from qsync_opt.planner.solve import reachable_ms

    base = _small(seed)
    ref = base.makespan_ms(base.reference_assignment())
    prob = base.retarget((reachable_ms(base) + ref) / 2)
    splits = batch_splits(prob, 32)
    assert {"a100": 128, "t4": 128} in splits
    assert all(s["a100"] + s["t4"] == 256 for s in splits)
    fixed = []
    for split in splits:
        cluster = prob.cluster.model_copy(update={"groups": [
            g.model_copy(update={"batch_per_device": split[g.name]})
            for g in prob.cluster.groups]})
        sub = prob.with_cluster(cluster, ProblemOptions(target_ms=prob.target_ms))
        opt = _brute(sub)
        if opt is not None:
            fixed.append(opt)
    plan, rep = solve(prob, "highs", joint_split=True, batch_multiple=32, refine=0,
                      compare_ties=False)
    assert rep.objective == pytest.approx(min(fixed), rel=1e-6, abs=1e-12)
    assert sum(g.batch_per_device * c.count for g, c in
               zip(plan.groups.values(), plan.cluster.groups, strict=True)) == 256
    assert "joint batch split" in rep.messages[0]


@pytest.mark.parametrize("seed", [0, 1])
def test_joint_split_falls_back_lexicographically_when_the_default_target_is_out_of_reach(seed):
    """The default target is the strong group's time at its *given* batch: a split that moves
    samples onto it cannot meet it. Auto mode must then take the smallest makespan any split
    reaches and the least degradation within the slack of it (it raised INFEASIBLE)."""
    from qsync_opt.planner.solve import LEXICOGRAPHIC_SLACK, reachable_ms

    prob = _small(seed)
    splits = batch_splits(prob, 8)
    subs = []
    for split in splits:
        cluster = prob.cluster.model_copy(update={"groups": [
            g.model_copy(update={"batch_per_device": split[g.name]})
            for g in prob.cluster.groups]})
        subs.append(prob.with_cluster(cluster, ProblemOptions(target_ms=prob.target_ms)))
    best = min(r for r in (reachable_ms(s) for s in subs) if r is not None)
    assert best > prob.target_ms  # the premise: no split meets the default target
    with pytest.raises(InfeasibleError):
        solve(prob, "highs", joint_split=True, batch_multiple=8, mode="target", refine=0,
              compare_ties=False)
    plan, rep = solve(prob, "highs", joint_split=True, batch_multiple=8, refine=0,
                      compare_ties=False)
    assert "lexicographic" in rep.mode and "every batch split" in rep.messages[0]
    target = best * (1 + LEXICOGRAPHIC_SLACK)
    ev = evaluate(prob, plan)
    assert ev.makespan_ms <= target * (1 + 1e-6)
    optima = [o for o in (_brute(s.retarget(target)) for s in subs) if o is not None]
    assert rep.objective == pytest.approx(min(optima), rel=1e-6, abs=1e-12)


def test_refinement_ends_within_its_bound_and_meets_the_target_in_the_replayer():
    """BERT on two nodes exposes all-reduce the linear model does not charge: the first
    exact plan misses the target in the replayer; refinement tightens and re-solves."""
    g = trace("bert_base")
    c = parse_shorthand("a100x8+t4x8")
    prob = AllocationProblem(g, c, estimate(g, c), random_indicator(g)).retarget(390.0)
    plan, rep = solve(prob, "highs", refine=3, compare_ties=False)
    assert 2 <= len(rep.rounds) <= 4
    assert rep.rounds[0]["replay_makespan_ms"] > 390.0  # the unrefined plan missed it
    ev = evaluate(prob, plan)
    assert ev.replay_makespan_ms <= 390.0 * (1 + 1e-7)
    assert "meets the target" in rep.messages[-1]
    targets = [r["target_ms"] for r in rep.rounds]
    assert targets == sorted(targets, reverse=True)
    _, rep0 = solve(prob, "highs", refine=0, compare_ties=False)
    assert len(rep0.rounds) == 1 and "does NOT meet" in rep0.messages[-1]


def test_lexicographic_mode_when_the_default_target_is_out_of_reach():
    g = trace("bert_base")
    c = parse_shorthand("a100x8+t4x8")
    prob = AllocationProblem(g, c, estimate(g, c), random_indicator(g))
    with pytest.raises(InfeasibleError):
        solve(prob, "highs", mode="target", compare_ties=False)
    plan, rep = solve(prob, "highs", refine=0, compare_ties=False)
    assert rep.mode.startswith("lexicographic") and "out of reach" in rep.mode
    assert evaluate(prob, plan).makespan_ms > prob.target_ms
    given = prob.with_options(target_ms=prob.target_ms)  # a target the user gave: no fallback
    with pytest.raises(InfeasibleError, match="fastest makespan reachable"):
        solve(given, "highs", compare_ties=False)


def test_budget_mode_finds_the_least_makespan_within_the_degradation_budget():
    from qsync_opt.planner.solve import reachable_ms

    prob = _small(4)
    ref = prob.makespan_ms(prob.reference_assignment())
    mid = (reachable_ms(prob) + ref) / 2
    low = prob.retarget(mid)
    _, at_low = solve(low, "highs", refine=0, compare_ties=False)
    budget = at_low.objective
    plan, rep = solve(prob, "highs", mode="budget", degradation_budget=budget,
                      compare_ties=False)
    ev = evaluate(prob, plan)
    assert ev.objective <= budget * (1 + 1e-9)
    assert ev.makespan_ms <= mid * (1 + 1e-3)
    assert "least makespan under degradation budget" in rep.mode
    with pytest.raises(Exception, match="degradation_budget"):
        solve(prob, "highs", mode="budget")


def test_frontier_is_monotone_and_undominated(tmp_path):
    g = trace("resnet18", 32)
    c = parse_shorthand("v100x4+t4x4")
    prob = AllocationProblem(g, c, perturb_costs(estimate(g, c), 1), random_indicator(g, 1))
    pts = frontier(prob, points=4, batch_multiple=8)
    exact = sorted((p for p in pts if p.allocator == "exact" and p.objective is not None),
                   key=lambda p: p.target_ms)
    assert len(exact) >= 2
    objs = [p.objective for p in exact]
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(objs))  # non-increasing
    joint = [p for p in pts if p.allocator == "exact+split" and p.objective is not None]
    assert joint
    for p in pts:
        if p.objective is None or p.allocator.startswith("exact"):
            continue
        if p.global_batch == prob.global_batch:
            assert not any(p.dominates(e) for e in joint), p
        same_split = [e for e in exact if e.batches == p.batches]
        assert not any(p.dominates(e) for e in same_split), p
    png = plot_frontier(pts, tmp_path / "f.png", "resnet18")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_tying_reports_what_it_costs():
    g = trace("bert_base", 2, tie="blocks")
    c = parse_shorthand("a100x1+t4x1")
    prob = AllocationProblem(g, c, estimate(g, c), random_indicator(g))
    prob = prob.retarget((prob.target_ms + max(prob.reference_times.values())) / 2)
    plan, rep = solve(prob, "highs", refine=0)
    note = next(m for m in rep.messages if m.startswith("tie groups"))
    assert "tying restricts the problem and costs" in note
    free = AllocationProblem(g, c, prob.costs, prob.indicator,
                             ProblemOptions(ties=False, target_ms=prob.target_ms))
    _, frep = solve(free, "highs", refine=0, compare_ties=False)
    assert frep.objective < rep.objective  # tying costs optimality here
    assert len(free.units) > len(prob.units)


def test_infeasible_memory_is_explained(capsys):
    from qsync_opt.cli import main

    code = main(["solve", "--model", "resnet50", "--cluster", "v100x16@384+t4x16@384",
                 "--method", "random", "--solver", "highs", "--target-ms", "5000",
                 "--out", "/nonexistent/never.json"])
    err = capsys.readouterr().err
    assert code == 3  # infeasible: its own exit code (bad input is 2)
    assert "t4 (t4): needs" in err and "has 15.0 GiB" in err
    assert "Traceback" not in err


def test_a_matched_extra_target_is_not_solved():
    """An exact point as fast and as little degraded as another allocator's point matches
    it (no solve at that makespan could show more); slower or more degraded does not."""
    from qsync_opt.planner.frontier import FrontierPoint, matched

    def pt(ms, obj):
        return FrontierPoint("exact", ms, "OPTIMAL", obj, ms, ms, 1e3 / ms, 1e3 / ms, 1,
                             None, True)

    assert matched(pt(10.0, 5.0), 10.0, 5.0)
    assert matched(pt(9.0, 4.0), 10.0, 5.0)
    assert not matched(pt(10.5, 4.0), 10.0, 5.0)
    assert not matched(pt(9.0, 5.5), 10.0, 5.0)
    assert not matched(FrontierPoint("exact", 9.0, "INFEASIBLE", None, None, None, None,
                                     None, None, None, False), 10.0, 5.0)
