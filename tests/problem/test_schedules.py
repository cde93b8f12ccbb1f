"""A problem's other batch splits derive their coefficients from the schedule recorded
once for the problem (qsync_opt.problem.coefficients.Schedule): every coefficient equals a
derivation made afresh at that split, and a schedule is reused only where its graph, units,
choices and options are the same."""

from __future__ import annotations

import pytest

from qsync_opt import estimate, parse_shorthand, trace
from qsync_opt.core.precision import Precision
from qsync_opt.planner.joint import split_cluster
from qsync_opt.planner.splits import batch_splits
from qsync_opt.problem.program import AllocationProblem, ProblemOptions
from qsync_opt.problem.synthetic import random_indicator

CASES = [("digits_cnn", "v100x2+t4x2"), ("tiny_gpt", "a100x2+t4x2")]


def _fresh(problem: AllocationProblem) -> AllocationProblem:
    """The same problem derived without any schedule made before."""
    return AllocationProblem(problem.graph, problem.cluster, problem.costs, problem.indicator,
                             problem.options, cost_provider=problem.cost_provider)


@pytest.mark.parametrize("model,shorthand", CASES)
@pytest.mark.parametrize("casts", [True, False])
def test_other_splits_reuse_the_schedule_and_equal_a_fresh_derivation(model, shorthand, casts):
    graph = trace(model)
    cluster = parse_shorthand(shorthand)
    problem = AllocationProblem(graph, cluster, estimate(graph, cluster),
                                random_indicator(graph), ProblemOptions(casts=casts))
    recorded = dict(problem.schedules)
    assert recorded  # one schedule per distinct menu
    splits = batch_splits(problem)
    for split in [splits[0], splits[len(splits) // 2], splits[-1]]:
        other = problem.with_cluster(split_cluster(problem, split))
        assert other.schedules is problem.schedules
        assert problem.schedules == recorded  # nothing recorded again
        fresh = _fresh(other)
        assert [g.batch for g in other.groups] == [split[g.name] for g in other.groups]
        assert other.groups == fresh.groups  # every coefficient, with ==
        assert other.notes == fresh.notes


def test_a_schedule_is_not_reused_for_other_choices_or_options():
    graph = trace("digits_cnn")
    cluster = parse_shorthand("v100x2+t4x2")
    problem = AllocationProblem(graph, cluster, estimate(graph, cluster),
                                random_indicator(graph))
    n = len(problem.schedules)
    op = graph.choosable_ops()[0].name
    pinned = problem.with_options(pinned={op: "fp32"})
    assert pinned.schedules is problem.schedules and len(problem.schedules) > n
    assert pinned.groups == _fresh(pinned).groups
    assert all(g.choices[0] == (Precision.fp32,) for g in pinned.groups)
    assert any(len(g.choices[0]) > 1 for g in problem.groups)
    additive = problem.with_options(casts=False)
    assert additive.groups == _fresh(additive).groups
    assert additive.groups != problem.groups


def test_schedules_of_another_graph_object_are_not_used():
    graph = trace("digits_cnn")
    cluster = parse_shorthand("v100x2+t4x2")
    costs = estimate(graph, cluster)
    indicator = random_indicator(graph)
    problem = AllocationProblem(graph, cluster, costs, indicator)
    copy = graph.model_copy(deep=True)
    other = AllocationProblem(copy, cluster, costs, indicator, schedules=problem.schedules)
    # the copy's groups were recorded on the copy's ops, next to the original's
    assert any(s.ops is graph.ops for s in problem.schedules.values())
    assert any(s.ops is copy.ops for s in problem.schedules.values())
    assert other.groups == _fresh(other).groups
