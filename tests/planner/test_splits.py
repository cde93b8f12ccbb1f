"""The joint split search prunes candidates exactly (qsync_opt.planner.splits, solve._joint_attempt).

The pruned search must return the plan the reference procedure returns (every candidate
solved once, then refined in ascending order): the same plan JSON, objective and split, on
random problems with two, three and four groups, monotone costs and perturbed (non-monotone)
ones, like groups whose mirrored splits tie, and targets where a group has no plan at its
larger batches. The floors it uses are checked to be lower bounds by enumeration.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
import re

import pytest
from qsync_opt.solvers.checks import time_lower_bound
from qsync_opt.solvers.timing import Stopwatch

import qsync_opt.planner.joint as joint_mod
from qsync_opt import estimate, parse_shorthand
from qsync_opt.planner.solve import solve
from qsync_opt.planner.splits import SplitBounds, batch_splits, memory_floor
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.problem.synthetic import perturb_costs, random_indicator, synthetic_graph


@functools.cache
def _graph(n: int, seed: int):
    return synthetic_graph(n, seed=seed, batch=64, width=512)


def _problem(seed: int, shorthand: str, perturb: bool = False) -> AllocationProblem:
    g = _graph(4, seed)
    c = parse_shorthand(shorthand)
    costs = estimate(g, c)
    if perturb:
        costs = perturb_costs(costs, seed)
    return AllocationProblem(g, c, costs, random_indicator(g, seed))


def _strip(doc: dict) -> dict:
    doc = json.loads(json.dumps(doc))
    for key in ("wall_s", "option.time_limit_s"):  # timings
        doc["provenance"].pop(key, None)
    return doc


def _both(prob: AllocationProblem, multiple: int, refine: int, solver: str = "highs"):
    out = []
    for prune in (True, False):
        joint_mod.PRUNE_SPLITS = prune
        try:
            plan, rep = solve(prob, solver, joint_split=True, batch_multiple=multiple,
                              refine=refine, compare_ties=False)
        finally:
            joint_mod.PRUNE_SPLITS = True
        out.append((plan, rep))
    return out


CASES = [(seed, shorthand, perturb, frac)
         for seed, shorthand, perturb, frac in [
             (0, "a100x1@64+t4x1@64", False, 0.5), (1, "a100x1@64+t4x1@64", False, 0.2),
             (2, "v100x2@64+t4x2@64", False, 0.8), (3, "a100x1@64+t4x1@64", True, 0.5),
             (4, "a100x1@32+v100x1@32+t4x1@32", False, 0.5),
             (5, "a100x1@32+v100x1@32+t4x1@32", True, 0.3)]]


@pytest.mark.parametrize("seed,shorthand,perturb,frac", CASES)
@pytest.mark.parametrize("refine", [0, 2])
def test_pruned_search_returns_the_reference_plan(seed, shorthand, perturb, frac, refine):
    from qsync_opt.planner.solve import reachable_ms

    base = _problem(seed, shorthand, perturb)
    lo = reachable_ms(base)
    hi = base.makespan_ms(base.reference_assignment())
    prob = base.retarget(lo + (hi - lo) * frac)
    (p1, r1), (p2, r2) = _both(prob, 8, refine)
    assert _strip(p1.model_dump(mode="json")) == _strip(p2.model_dump(mode="json"))
    assert r1.objective == r2.objective and r1.status == r2.status
    assert r1.mode == r2.mode


@pytest.mark.parametrize("solver", ["cpsat", "greedy", "cbc"])
def test_other_backends_get_the_reference_plan_too(solver):
    """CP-SAT and greedy use only the floors (their objectives bound nothing); CBC the
    solved parts as HiGHS does."""
    from qsync_opt.planner.solve import reachable_ms

    base = _problem(1, "a100x1@64+t4x1@64")
    lo = reachable_ms(base)
    hi = base.makespan_ms(base.reference_assignment())
    prob = base.retarget(lo + (hi - lo) * 0.4)
    (p1, r1), (p2, r2) = _both(prob, 8, 0, solver)
    assert _strip(p1.model_dump(mode="json")) == _strip(p2.model_dump(mode="json"))
    assert r1.objective == r2.objective


def test_bounds_skip_candidates_on_monotone_costs():
    prob = _problem(0, "a100x1@64+t4x1@64")
    from qsync_opt.planner.solve import reachable_ms

    lo = reachable_ms(prob)
    hi = prob.makespan_ms(prob.reference_assignment())
    prob = prob.retarget(lo + (hi - lo) * 0.5)
    _, rep = solve(prob, "highs", joint_split=True, batch_multiple=4, refine=0,
                   compare_ties=False)
    line = rep.messages[0]
    n = len(batch_splits(prob, 4))
    solved = int(re.search(r"\): (\d+) solved", line).group(1))
    assert solved < n, line  # the bounds saved solves on this instance


def _subs(prob: AllocationProblem, multiple: int) -> list[AllocationProblem]:
    out = []
    for split in batch_splits(prob, multiple):
        cluster = prob.cluster.model_copy(update={"groups": [
            g.model_copy(update={"batch_per_device": split[g.name]})
            for g in prob.cluster.groups]})
        out.append(prob.with_cluster(cluster))
    return out


def test_monotonicity_is_checked_not_assumed():
    mono = SplitBounds(_subs(_problem(0, "a100x1@64+t4x1@64"), 8))
    assert mono.monotone == [True, True]
    bumpy = SplitBounds(_subs(_problem(3, "a100x1@64+t4x1@64", perturb=True), 8))
    # perturbed costs give each batch its own random factors: no order to rely on
    assert bumpy.monotone == [False, False]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_floors_are_lower_bounds(seed):
    prob = _problem(seed, "a100x1@64+t4x1@64")
    rng = random.Random(seed)
    for g in prob.groups:
        t_floor, m_floor = time_lower_bound(g), memory_floor(g)
        choices = [range(len(c)) for c in g.choices]
        picks = (list(itertools.product(*choices)) if len(list(itertools.product(*choices)))
                 <= 2000 else [tuple(rng.randrange(len(c)) for c in g.choices)
                               for _ in range(2000)])
        for a in picks:
            assert g.time_ms(a) >= t_floor * (1 - 1e-12)
            assert g.memory_bytes(a) >= m_floor * (1 - 1e-12)


def _targets(prob: AllocationProblem, fracs: tuple[float, ...]) -> list[AllocationProblem]:
    from qsync_opt.planner.solve import reachable_ms

    lo = reachable_ms(prob)
    hi = prob.makespan_ms(prob.reference_assignment())
    return [prob.retarget(lo * 0.97 + (hi * 1.05 - lo * 0.97) * f) for f in fracs]


@pytest.mark.parametrize("seed,shorthand,perturb",
                         [(0, "a100x1@64+t4x1@64", False), (3, "a100x1@64+t4x1@64", True),
                          (4, "a100x1@32+v100x1@32+t4x1@32", False)])
def test_lp_relaxation_bounds_each_part_and_proves_no_plan(seed, shorthand, perturb):
    """Every group's relaxation is at most its exact optimum (HiGHS with a tiny gap, one
    program per group), below the reachable makespan it proves there is no plan, and every
    INFEASIBLE relaxation is an INFEASIBLE program."""
    from qsync_opt.solvers import SolveOptions
    from qsync_opt.solvers.driver import solve_assignment
    from qsync_opt.solvers.ilp import PulpIlp
    from qsync_opt.solvers.relaxation import relaxation_bound

    opts = SolveOptions(rel_gap=1e-9)
    seen = set()
    for prob in _targets(_problem(seed, shorthand, perturb), (0.0, 0.1, 0.4, 0.7, 1.0)):
        for gi, g in enumerate(prob.groups):
            status, bound = relaxation_bound(prob, [gi], opts)
            seen.add(status)
            single = prob.retarget(prob.target_ms)
            single.groups = [g]  # the group's own program (the groups do not interact)
            got, _ = solve_assignment(PulpIlp("highs"), single, opts, Stopwatch(), [])
            st, a = got.status, got.assignment
            if status == "INFEASIBLE":
                assert st == "INFEASIBLE", (gi, prob.target_ms)
                continue
            assert status == "OPTIMAL" and st == "OPTIMAL", (status, st)
            assert a is not None
            best = g.weight * g.degradation(a[g.name])
            assert bound <= best + 1e-9 * max(1.0, abs(best)), (gi, bound, best)
            assert bound >= best - 0.5 * max(abs(best), 1e-12) or best == 0.0
    assert "OPTIMAL" in seen


def test_least_degradation_parts_need_no_solver():
    """A loose target: every group meets it at its least-Omega choices, so no program is
    solved and the plan takes them; a tight one: the shortcut does not apply."""
    from qsync_opt.solvers.parts import least_part

    prob = _problem(0, "a100x1@64+t4x1@64")
    loose = prob.retarget(prob.makespan_ms(prob.reference_assignment()) * 1.5)
    plan, rep = solve(loose, "highs", refine=0, compare_ties=False)
    assert rep.status == "OPTIMAL" and rep.n_variables == 0
    assert sum("no solver run" in m for m in rep.messages) == len(prob.groups)
    least = {g.name: [min(range(len(r)), key=r.__getitem__) for r in g.omega1]
             for g in loose.groups}
    assert loose.assignment(plan) == least
    tight = _targets(prob, (0.05,))[0]
    assert any(least_part(tight, [gi]) is None for gi in range(len(tight.groups)))


# ------------------------------------------------- the best-first search and groups alone

#: More instances for the pruned search against the reference: 2 and 3 catalog groups,
#: monotone and perturbed costs, groups of like speed (several groups of a candidate need a
#: solver, so groups are solved alone for a bound: the first two) and unlike ones.
MORE_CASES = [(seed, shorthand, perturb, frac, multiple)
              for seed, shorthand, perturb, frac, multiple in [
                  (6, "h100x1@64+a100x1@64", False, 0.3, 8),
                  (7, "a100x1@64+a100_80gbx1@64", False, 0.2, 8),
                  (8, "h100x1@64+a100x1@64", True, 0.1, 8),
                  (9, "h100x1@32+a100x1@32+a100_80gbx1@32", False, 0.5, 8),
                  (10, "h100x1@32+a100x1@32+v100x1@32", True, 0.2, 8),
                  (11, "a100x1@64+t4x1@64", False, 0.3, 4),
                  (12, "a100x1@32+v100x1@32+t4x1@32", False, 0.5, 4)]]


def _outcome(prob: AllocationProblem, multiple: int, refine: int, prune: bool
             ) -> tuple[tuple, str]:
    """The joint split's plan (stripped of timings), objective, status and mode, or its
    refusal, with the search's line ("" when refused)."""
    from qsync_opt.core.errors import QsyncInputError

    joint_mod.PRUNE_SPLITS = prune
    try:
        plan, rep = solve(prob, "highs", joint_split=True, batch_multiple=multiple,
                          refine=refine, compare_ties=False)
        return ((_strip(plan.model_dump(mode="json")), rep.objective, rep.status, rep.mode),
                _search_line(rep))
    except QsyncInputError as exc:
        return ("refused", type(exc).__name__, str(exc)), ""
    finally:
        joint_mod.PRUNE_SPLITS = True


def _search_line(rep) -> str:
    return next(m for m in rep.messages if m.startswith("joint batch split: "))


@pytest.mark.parametrize("seed,shorthand,perturb,frac,multiple", MORE_CASES)
def test_best_first_search_returns_the_reference_plan(seed, shorthand, perturb, frac,
                                                      multiple):
    """The same plan, or the same refusal where no split has one."""
    prob = _targets(_problem(seed, shorthand, perturb), (frac,))[0]
    assert _outcome(prob, multiple, 1, True)[0] == _outcome(prob, multiple, 1, False)[0]


def test_groups_solved_alone_are_used_and_change_nothing():
    """On instances whose candidates need a solver for several groups, some group is
    solved alone for a bound, and the plan is the reference's all the same."""
    used = 0
    for seed, shorthand, perturb, frac, multiple in MORE_CASES[:2]:
        prob = _targets(_problem(seed, shorthand, perturb), (frac,))[0]
        pruned, line = _outcome(prob, multiple, 0, True)
        reference, ref_line = _outcome(prob, multiple, 0, False)
        assert pruned == reference
        m = re.search(r"(\d+) group program\(s\) solved alone", line)
        used += int(m.group(1)) if m else 0
        assert "solved alone" not in ref_line  # the reference solves every copy whole
    assert used > 0


def _retargeted_subs(prob: AllocationProblem, multiple: int) -> list[AllocationProblem]:
    return [s.retarget(prob.target_ms) for s in _subs(prob, multiple)]


def _hard_candidate(prob: AllocationProblem, multiple: int) -> tuple[AllocationProblem, int]:
    """A candidate at ``prob``'s target with a group that needs a solver and has a plan
    (and the group's index); the memo is left empty."""
    from qsync_opt.solvers import SolveOptions
    from qsync_opt.solvers.driver import solve_group_alone
    from qsync_opt.solvers.ilp import PulpIlp
    from qsync_opt.solvers.memo import clear_part_memo
    from qsync_opt.solvers.parts import least_part

    for sub in _retargeted_subs(prob, multiple):
        for gi in range(len(sub.groups)):
            if least_part(sub, [gi]) is None:
                got, _ = solve_group_alone(PulpIlp("highs"), sub, gi, SolveOptions())
                clear_part_memo()
                if got is not None and got.status == "OPTIMAL":
                    return sub, gi
    raise AssertionError("no candidate needs a solver")


def test_group_alone_memo_is_keyed_by_batch_and_target():
    """A group solved alone is answered again only for the same group at the same batch
    and a target its plan meets: another batch, or a target its plan misses, is solved."""
    from qsync_opt.solvers import SolveOptions
    from qsync_opt.solvers.driver import solve_group_alone
    from qsync_opt.solvers.ilp import PulpIlp

    prob = _targets(_problem(6, "h100x1@64+a100x1@64"), (0.2,))[0]
    sub, gi = _hard_candidate(prob, 8)
    backend, opts = PulpIlp("highs"), SolveOptions()
    first, lines = solve_group_alone(backend, sub, gi, opts)
    assert first is not None and first.status == "OPTIMAL"
    assert not any("solved before in this process" in m for m in lines)
    again, lines = solve_group_alone(backend, sub, gi, opts)
    assert again is not None and again.assignment == first.assignment
    assert any(m.startswith(f"{sub.groups[gi].name}: solved before in this process (")
               for m in lines)
    # the same group at another batch: another program
    others = [s for s in _retargeted_subs(prob, 8)
              if s.groups[gi].batch != sub.groups[gi].batch]
    assert others
    _, lines = solve_group_alone(backend, others[0], gi, opts)
    assert not any("solved before" in m for m in lines)
    # a tighter target its plan misses: solved again
    g = sub.groups[gi]
    used = g.time_ms(first.assignment[g.name])
    tighter = sub.retarget(sub.tail_ms + used * (1 - 1e-3))
    _, lines = solve_group_alone(backend, tighter, gi, opts)
    assert not any("solved before" in m for m in lines)
    # other backends' options (a warm start) do not use the memo: nothing is solved alone
    hinted = SolveOptions(warm_start="greedy")
    assert solve_group_alone(backend, sub, gi, hinted) == (None, [])


def test_lines_of_a_group_solved_alone_read_as_if_solved_in_place():
    """The candidate's report after its groups were solved alone reads as the report of
    the candidate solved on its own: the memo's line is replaced by the group's own."""
    from qsync_opt.solvers import SolveOptions
    from qsync_opt.solvers.driver import solve_group_alone
    from qsync_opt.solvers.ilp import PulpIlp
    from qsync_opt.solvers.memo import clear_part_memo

    from qsync_opt.planner.call import run_backend
    from qsync_opt.planner.joint import own_lines

    prob = _targets(_problem(6, "h100x1@64+a100x1@64"), (0.2,))[0]
    sub, gi = _hard_candidate(prob, 8)
    opts = SolveOptions()
    clear_part_memo()
    _, direct, _ = run_backend(sub, "highs", opts)
    clear_part_memo()
    _, lines = solve_group_alone(PulpIlp("highs"), sub, gi, opts)
    _, after, _ = run_backend(sub, "highs", opts)
    assert any("solved before in this process" in m for m in after.messages)
    assert own_lines(sub, after.messages, {gi: lines}) == direct.messages


def test_group_optima_bound_their_candidate_and_larger_batches_only():
    """A group's optimum recorded for one candidate raises the bound of that candidate and,
    on a monotone group, of every candidate where the group has a larger batch; a group
    without a plan proves those candidates have none; other backends record nothing."""
    subs = _subs(_problem(0, "a100x1@64+t4x1@64"), 8)
    bounds = SplitBounds(subs)
    assert bounds.monotone == [True, True]
    view = bounds.at(1e9, exact=True)
    i = len(subs) // 2
    b = view.batch[i][0]
    before = [view.group_bound(j, 0) for j in range(len(subs))]
    part = max(before) + 1.0
    view.record_group(i, 0, part)
    for j in range(len(subs)):
        raised = view.group_bound(j, 0) == part
        assert raised == (view.batch[j][0] >= b), (j, view.batch[j][0], b)
        assert view.group_bound(j, 1) == bounds.at(1e9, exact=True).group_bound(j, 1)
    assert view.lower_bound(i) == sum(view.group_bound(i, gi) for gi in range(2))
    view.record_group(i, 0, None)
    for j in range(len(subs)):
        assert view.proven_infeasible(j) == (view.batch[j][0] >= b)
    # what an exact backend proved is not a proof for the views of other backends
    shared = view.at(1e9, exact=False)
    assert not any(shared.proven_infeasible(j) for j in range(len(subs)))
    assert all(shared.group_bound(j, 0) < part for j in range(len(subs)))
    other = SplitBounds(subs).at(1e9, exact=False)
    other.record_group(i, 0, 123.0)
    other.record_group(i, 0, None)
    assert not other.group_parts and not other.group_no_plan and not other.dead


def test_facts_propagate_only_across_monotone_steps():
    """A group whose coefficients fall at one step (as the strong group held at its
    reference precision at the given split does) is bounded within each monotone run of
    batches, never across the fall; the check matches _no_less taken pairwise."""
    import copy
    import dataclasses

    from qsync_opt.planner.splits import _no_less

    subs = _subs(_problem(0, "a100x1@64+t4x1@64"), 8)
    order = sorted(range(len(subs)), key=lambda i: subs[i].groups[0].batch)
    mid = order[len(order) // 2]
    bumped = copy.copy(subs[mid])
    g = bumped.groups[0]
    bumped.groups = [dataclasses.replace(g, time0=g.time0 * 10 + 1.0), *bumped.groups[1:]]
    subs[mid] = bumped
    bounds = SplitBounds(subs)
    assert bounds.monotone[0] is False
    batches = [subs[i].groups[0].batch for i in order]
    pos = order.index(mid)
    for x, lo in enumerate(batches):
        for y, hi in enumerate(batches):
            want = x < y and all(_no_less(subs[order[k]].groups[0], subs[order[k + 1]].groups[0])
                                 for k in range(x, y))
            assert bounds.rises(0, lo, hi) == want, (lo, hi)
            if x < y:  # the fall is the step out of the bumped batch, nowhere else
                assert want == (not x <= pos < y), (lo, hi)
    view = bounds.at(1e9, exact=True)
    low = order[0]
    view.record_group(low, 0, 1e6)
    for k, i in enumerate(order):
        assert (view.group_bound(i, 0) == 1e6) == (k <= pos), k


# ------------------------------------------ four groups, ties, groups without a plan

#: Classes of instance beyond two and three unlike groups: four groups (two pairs of like
#: cards: candidates where several groups need a solver, groups solved alone); four like
#: groups with perturbed costs and two like groups (candidates that tie: mirrored splits
#: have the same objective, so the replayer's makespan and then the candidate order decide);
#: tight targets where the slow group has no plan at its larger batches (proven by floors,
#: LP relaxations or monotone steps).
CLASS_CASES = {
    "four groups": (32, "a100x1@32+a100x1@32+v100x1@32+v100x1@32", False, 0.3, 8),
    "four like groups, ties": (31, "v100x1@32+v100x1@32+v100x1@32+v100x1@32", True, 0.3, 8),
    "two like groups, ties": (28, "a100x1@64+a100x1@64", False, 0.1, 8),
    "no plan at large batches": (24, "a100x1@64+t4x1@64", False, 0.05, 8),
    "no plan at large batches, finer": (25, "h100x1@64+t4x1@64", False, 0.1, 4),
}


def _counts(line: str) -> dict[str, int]:
    """The search line's counts: solved, without a plan, skipped."""
    got = re.search(r"(\d+) solved, \d+ with a plan, (\d+) without one.*?(\d+) skipped", line)
    assert got is not None, line
    return dict(zip(("solved", "no plan", "skipped"), map(int, got.groups()), strict=True))


@pytest.mark.parametrize("name", list(CLASS_CASES))
def test_search_returns_the_reference_plan_on_more_classes(name):
    """The same plan (or refusal) as the reference procedure; the pruned search saves
    solves on each instance, through the class it stands for."""
    seed, shorthand, perturb, frac, multiple = CLASS_CASES[name]
    prob = _targets(_problem(seed, shorthand, perturb), (frac,))[0]
    pruned, line = _outcome(prob, multiple, 1, True)
    reference, _ = _outcome(prob, multiple, 1, False)
    assert pruned == reference
    counts = _counts(line)
    assert counts["solved"] < len(batch_splits(prob, multiple)), line
    if name.startswith("no plan"):
        assert counts["no plan"] > 0, line


def test_mirrored_splits_of_like_groups_tie_and_the_reference_breaks_the_tie():
    """Two like groups: the chosen split and its mirror have the same least objective (the
    groups swap programs), and the pruned search keeps the reference's choice among them."""
    from qsync_opt.planner.joint import split_cluster

    seed, shorthand, perturb, frac, multiple = CLASS_CASES["two like groups, ties"]
    prob = _targets(_problem(seed, shorthand, perturb), (frac,))[0]
    pruned, _ = _outcome(prob, multiple, 0, True)
    assert pruned == _outcome(prob, multiple, 0, False)[0]
    plan = pruned[0]
    split = {name: g["batch_per_device"] for name, g in plan["groups"].items()}
    a, b = prob.cluster.groups[0].name, prob.cluster.groups[1].name
    assert split[a] != split[b]
    objectives = []
    for chosen in (split, {a: split[b], b: split[a]}):
        sub = prob.with_cluster(split_cluster(prob, chosen)).retarget(prob.target_ms)
        got, rep = solve(sub, "highs", refine=0, compare_ties=False)
        objectives.append(rep.objective)
    assert objectives[0] == pytest.approx(objectives[1], rel=1e-9)
