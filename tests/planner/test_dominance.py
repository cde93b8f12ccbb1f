"""A returned plan that a cheap baseline dominates: ``solve``'s note, and the plan the demo
trains (qsync_opt.planner.dominance, qsync_opt.cli.walkthrough.choose_plan)."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
from qsync_opt.solvers import SolveOptions

from qsync_opt import estimate, parse_shorthand, trace
from qsync_opt.cli.walkthrough import choose_plan
from qsync_opt.planner.compare import compare
from qsync_opt.planner.dominance import (
    CHEAP_BASELINES,
    MARK_LEGEND,
    Candidate,
    baseline_candidates,
    dominance_note,
    dominated_by,
    dominates,
    dominators,
    marked_table,
    note_for,
    recommend,
    recommend_row,
)
from qsync_opt.planner.solve import reachable_ms, solve
from qsync_opt.problem.evaluator import Evaluation, evaluate
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.problem.synthetic import random_indicator, synthetic_graph
from support.harness import run_cli


def _ev(samples_per_s: float, objective: float, *, fits: bool = True, batch: int = 64,
        ) -> Evaluation:
    ms = batch / samples_per_s * 1e3 if samples_per_s > 0 else float("inf")
    return Evaluation(objective=objective, makespan_ms=ms, replay_makespan_ms=ms,
                      samples_per_s=samples_per_s, global_batch=batch, target_ms=ms,
                      meets_target=True, replay_meets_target=True, fits=fits, groups={},
                      violations=[] if fits else ["memory"])


# ------------------------------------------------------------------------ the predicate

@pytest.mark.parametrize(("a", "b", "expected"), [
    ((110.0, 0.0), (100.0, 5e-5), True),      # faster and less degraded
    ((100.0, 0.0), (100.0, 5e-5), True),      # as fast, less degraded
    ((110.0, 5e-5), (100.0, 5e-5), True),     # faster, as degraded
    ((100.0, 5e-5), (100.0, 5e-5), False),    # the same: nothing strictly better
    ((100.0 * (1 + 1e-9), 5e-5), (100.0, 5e-5 * (1 + 1e-9)), False),  # within the tolerance
    ((110.0, 6e-5), (100.0, 5e-5), False),    # faster but more degraded
    ((90.0, 0.0), (100.0, 5e-5), False),      # less degraded but slower
    ((float("nan"), 0.0), (100.0, 5e-5), False),
    ((110.0, float("nan")), (100.0, 5e-5), False),
    ((float("inf"), 0.0), (100.0, 5e-5), False),
    ((110.0, 0.0), (float("nan"), 5e-5), False),
])
def test_dominates_needs_as_good_on_both_and_better_on_one(a, b, expected) -> None:
    assert dominates(_ev(*a), _ev(*b)) is expected
    if expected:  # never both ways
        assert not dominates(_ev(*b), _ev(*a))


def test_a_plan_that_does_not_fit_dominates_nothing() -> None:
    assert not dominates(_ev(200.0, 0.0, fits=False), _ev(100.0, 1.0))


def test_speed_is_throughput_so_fewer_groups_are_compared_fairly() -> None:
    """The strong groups alone end their iteration sooner with half the global batch:
    shorter makespan, lower throughput, so they do not dominate."""
    alone = _ev(2224.1, 0.0, batch=32)   # 14.39 ms
    both = _ev(2503.5, 5.7e-5, batch=64)  # 25.56 ms
    assert alone.replay_makespan_ms < both.replay_makespan_ms
    assert not dominates(alone, both)


def test_dominators_put_an_undominated_one_first() -> None:
    plan = Candidate("highs", None, _ev(100.0, 5e-5))  # type: ignore[arg-type]
    slow_zero = Candidate("highs+split", None, _ev(101.0, 0.0))  # type: ignore[arg-type]
    fast_zero = Candidate("dynamic-batching", None, _ev(130.0, 0.0))  # type: ignore[arg-type]
    fast_some = Candidate("greedy", None, _ev(140.0, 4e-5))  # type: ignore[arg-type]
    got = dominators(plan.ev, [slow_zero, fast_some, fast_zero])
    # the undominated ones first (least degraded first), then the rest
    assert [c.solver for c in got] == ["dynamic-batching", "greedy", "highs+split"]
    assert not any(dominates(c.ev, got[0].ev) for c in got[1:])


def test_dominators_first_is_undominated_even_within_the_tolerance() -> None:
    """An objective lower by less than the tolerance sorts first but is a tie: the faster
    plan at that tie dominates it and comes first."""
    plan = _ev(100.0, 1e-3)
    tiny_less = Candidate("a", None, _ev(110.0, 5e-13))  # type: ignore[arg-type]
    faster = Candidate("b", None, _ev(150.0, 1e-12))  # type: ignore[arg-type]
    assert dominates(faster.ev, tiny_less.ev)
    assert [c.solver for c in dominators(plan, [tiny_less, faster])] == ["b", "a"]


# --------------------------------------------------------------------------- problems

@functools.cache
def _digits(shorthand: str) -> AllocationProblem:
    """digits_cnn on catalog estimates, the random indicator: deterministic."""
    g = trace("digits_cnn")
    c = parse_shorthand(shorthand)
    return AllocationProblem(g, c, estimate(g, c), random_indicator(g, 0))


@functools.cache
def _synthetic(batch: int) -> AllocationProblem:
    """A synthetic MLP on an A100 and a T4: at batch 128 per card the all-reduce over the
    T4's PCIe link costs more than the T4 adds (the A100 alone dominates); at 2048 nothing
    dominates the exact plan."""
    g = synthetic_graph(3, seed=0, batch=batch, width=1024)
    c = parse_shorthand(f"a100x1@{batch}+t4x1@{batch}")
    return AllocationProblem(g, c, estimate(g, c), random_indicator(g, 0))


def _as_the_demo(problem: AllocationProblem) -> AllocationProblem:
    """The demo's retarget: the smallest reachable makespan + 2% when the default target is
    out of reach."""
    best = reachable_ms(problem)
    if best is not None and best > problem.target_ms:
        return problem.retarget(best * 1.02, source="smallest reachable makespan + 2%")
    return problem


def _solved(problem: AllocationProblem) -> tuple:
    plan, _ = solve(problem, "highs")
    return plan, evaluate(problem, plan)


def _independent(problem: AllocationProblem, ev: Evaluation) -> list[str]:
    """The baselines that dominate, recomputed here from their evaluations' fields."""
    out = []
    for c in baseline_candidates(problem, SolveOptions()):
        e = c.ev
        if (e.fits and e.samples_per_s >= ev.samples_per_s and e.objective <= ev.objective
                and (e.samples_per_s > ev.samples_per_s * 1.001
                     or e.objective < ev.objective - 1e-9)):
            out.append(c.solver)
    return out


@pytest.mark.parametrize(("problem", "who", "remedy"), [
    (lambda: _digits("a100x1+t4x1"), "dynamic batching (baseline)", "re-run with --joint-split"),
    (lambda: _digits("v100x2+t4x2"), "dynamic batching (baseline)", "re-run with --joint-split"),
    (lambda: _synthetic(128), "the strong groups alone (baseline)",
     "the group(s) t4 do not pay here: leave them out of --cluster"),
])
def test_a_dominated_plan_gets_one_note_naming_the_baseline_and_the_remedy(
        problem, who, remedy) -> None:
    prob = problem()
    plan, ev = _solved(prob)
    assert _independent(prob, ev)
    note = dominance_note(prob, plan, ev, "highs", SolveOptions())
    assert note is not None and "\n" not in note
    assert note.startswith(f"note: {who} reaches ")
    assert f"dominating this plan ({ev.replay_makespan_ms:.2f} ms" in note
    assert remedy in note


@pytest.mark.parametrize("problem", [lambda: _digits("l4x1+t4x1"), lambda: _synthetic(2048)])
def test_an_undominated_plan_gets_no_note(problem) -> None:
    prob = problem()
    plan, ev = _solved(prob)
    assert _independent(prob, ev) == []
    assert dominance_note(prob, plan, ev, "highs", SolveOptions()) is None


def test_after_the_joint_split_the_remedy_is_a_lower_target() -> None:
    """The plan already came from the joint split: a dominating split is found by a lower
    target, not by the flag the user gave."""
    prob = _digits("a100x1+t4x1")
    plan, ev = _solved(prob)
    cands = baseline_candidates(prob, SolveOptions())
    dyn = next(c for c in cands if c.solver == "dynamic-batching")
    note = note_for(prob, plan, ev, [dyn], joint_split=True)
    assert note is not None and "--joint-split" not in note
    assert f"lower --target-ms (its linear makespan is {dyn.ev.makespan_ms:.2f} ms)" in note


def test_the_check_skips_the_solver_itself() -> None:
    prob = _digits("a100x1+t4x1")
    cands = baseline_candidates(prob, SolveOptions(), skip=("dynamic-batching",))
    assert {c.solver for c in cands} == set(CHEAP_BASELINES) - {"dynamic-batching"}


# -------------------------------------------------------------------------- the CLI

@pytest.mark.parametrize(("cluster", "dominated"), [("a100x1+t4x1", True),
                                                    ("l4x1+t4x1", False)])
def test_solve_prints_the_note_only_when_dominated(tmp_path, cluster, dominated) -> None:
    base = ("solve", "--model", "digits_cnn", "--cluster", cluster, "--method", "random",
            "--solver", "highs", "--out", str(tmp_path / "p.json"))
    code, out, err = run_cli(*base)
    assert code == 0, err
    notes = [x for x in out.splitlines() if x.startswith("note: ")]
    assert len(notes) == (1 if dominated else 0)
    if dominated:
        assert "dynamic batching (baseline)" in notes[0] and "--joint-split" in notes[0]
    code, out, err = run_cli(*base, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["dominated"] is not None) == dominated
    if dominated:
        assert doc["dominated"] == notes[0]


# ------------------------------------------------------------------ the demo's choice

def test_demo_trains_the_dominating_plan_and_says_why() -> None:
    prob = _as_the_demo(_digits("a100x1+t4x1"))
    rows = compare(prob, ["highs", "greedy", "uniform", "dynamic-batching", "strong-only"])
    got = choose_plan(prob, rows)
    assert got is not None
    chosen, why = got
    assert chosen.solver == "dynamic-batching"
    assert why is not None and why.startswith("dynamic batching (baseline) dominates highs's plan")
    exact = next(r for r in rows if r.solver == "highs")
    assert dominates(chosen.ev, evaluate(prob, exact.plan))


def test_demo_keeps_the_exact_plan_when_nothing_dominates_it() -> None:
    prob = _as_the_demo(_synthetic(2048))
    rows = compare(prob, ["highs", "uniform", "dynamic-batching", "strong-only"])
    got = choose_plan(prob, rows)
    assert got is not None
    chosen, why = got
    assert chosen.solver == "highs" and why is None


def test_demo_trains_only_plans_its_two_ranks_can_run() -> None:
    """At batch 128 the A100 alone dominates most (no degradation, the highest throughput),
    but the demo trains both groups: it takes dynamic batching, which dominates too."""
    prob = _as_the_demo(_synthetic(128))
    rows = compare(prob, ["highs", "uniform", "dynamic-batching", "strong-only"])
    exact = evaluate(prob, next(r for r in rows if r.solver == "highs").plan)
    cands = [Candidate(r.solver, r.plan, evaluate(prob, r.plan)) for r in rows if r.plan]
    assert dominators(exact, cands)[0].solver == "strong-only"
    got = choose_plan(prob, rows)
    assert got is not None
    chosen, why = got
    assert chosen.solver == "dynamic-batching" and why is not None
    assert set(chosen.plan.groups) == {"a100", "t4"}


def test_demo_has_no_plan_without_a_feasible_exact_row() -> None:
    prob = _as_the_demo(_digits("a100x1+t4x1"))
    rows = compare(prob, ["highs", "dynamic-batching"])
    rows = [dataclasses.replace(r, feasible=False) if r.solver == "highs" else r for r in rows]
    assert choose_plan(prob, rows) is None


def test_recommend_without_others_keeps_the_plan() -> None:
    c = Candidate("highs", None, _ev(100.0, 1.0))  # type: ignore[arg-type]
    assert recommend(c, [c]) == (c, None)


# ------------------------------------------------- the demo's part 2 and compare's marks

def test_part_2_takes_the_joint_split_when_it_dominates_the_exact_plan() -> None:
    """At batch 2048 the joint split reaches a shorter makespan at less degradation than the
    exact plan at the given split: the recommended plan is the joint split's, with why."""
    prob = _synthetic(2048)
    rows = compare(prob, ["highs", "greedy", "dynamic-batching", "strong-only"],
                   joint_split=True)
    got = recommend_row(rows)
    assert got is not None
    best, why, exact = got
    assert best.solver == "highs+split" and exact.solver == "highs"
    assert why is not None and why.startswith(
        "the joint split (highs with --joint-split) dominates highs's plan")
    assert dominates(best.ev, evaluate(prob, exact.plan))
    # nothing in the table dominates the recommended plan
    assert not any(dominates(evaluate(prob, r.plan), best.ev) for r in rows if r.plan)


def test_part_2_keeps_the_exact_plan_and_may_take_a_plan_over_fewer_groups() -> None:
    """Part 2 writes, it does not train: a plan leaving the T4 out competes (part 1's choice
    does not); with nothing dominating, the exact plan stands."""
    prob = _as_the_demo(_synthetic(128))
    rows = compare(prob, ["highs", "uniform", "dynamic-batching", "strong-only"])
    got = recommend_row(rows)
    assert got is not None
    best, why, _ = got
    assert best.solver == "strong-only" and why is not None
    got = recommend_row(rows, every_group=["a100", "t4"])
    assert got is not None and got[0].solver == "dynamic-batching"
    rows = compare(_as_the_demo(_synthetic(2048)),
                   ["highs", "uniform", "dynamic-batching", "strong-only"])
    got = recommend_row(rows)
    assert got is not None
    best, why, _ = got
    assert best.solver == "highs" and why is None
    assert recommend_row([dataclasses.replace(r, feasible=False) for r in rows]) is None


def test_compare_marks_exactly_the_dominated_rows() -> None:
    """Each row's mark names a row whose plan dominates it (by dominates over the rows'
    evaluations), one no other row dominates; an undominated row, or one without a plan,
    has none; the legend is printed once, only when a row is marked."""
    for prob, joint in ((_synthetic(2048), True), (_as_the_demo(_synthetic(128)), False),
                        (_as_the_demo(_digits("a100x1+t4x1")), True)):
        rows = compare(prob, ["highs", "greedy", "uniform", "dynamic-batching",
                              "strong-only"], joint_split=joint)
        evs = {r.solver: evaluate(prob, r.plan) for r in rows if r.plan is not None}
        marks = dominated_by(rows)
        for r, m in zip(rows, marks, strict=True):
            beaten = [o for o in evs if o != r.solver and r.solver in evs
                      and dominates(evs[o], evs[r.solver])]
            assert (m is not None) == bool(beaten), (r.solver, m, beaten)
            if m is not None:
                assert m in beaten and not any(dominates(evs[o], evs[m]) for o in evs)
        text = marked_table(rows)
        lines = text.splitlines()
        for r, m in zip(rows, marks, strict=True):
            line = next(x for x in lines if x.startswith(f"{r.solver:>17} "))
            assert line.endswith(f"  [dominated by {m}]") == (m is not None), line
        assert (lines[-1] == MARK_LEGEND) == any(marks)
        assert text.count(MARK_LEGEND) == (1 if any(marks) else 0)


def test_compare_cli_marks_rows_and_gives_them_in_json(tmp_path) -> None:
    base = ["compare", "--model", "digits_cnn", "--cluster", "a100x1+t4x1", "--method",
            "random", "--solvers", "highs,uniform,dynamic-batching,strong-only"]
    code, out, err = run_cli(*base, "--json", str(tmp_path / "rows.json"))
    assert code == 0, err
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    by = {r["solver"]: r["dominated_by"] for r in rows}
    assert by["strong-only"] == "dynamic-batching" and by["dynamic-batching"] is None
    for r in rows:
        line = next(x for x in out.splitlines() if x.startswith(f"{r['solver']:>17} "))
        assert ("[dominated by " in line) == (r["dominated_by"] is not None)
        if r["dominated_by"]:
            assert line.endswith(f"[dominated by {r['dominated_by']}]")
    assert out.count(MARK_LEGEND) == 1


@pytest.mark.slow
@pytest.mark.xdist_group("demo_part_2")  # the session's run: made once
def test_demo_part_2_writes_the_plan_nothing_in_its_table_dominates(demo_part_2) -> None:
    """resnet50 on v100x16+t4x16 (the random indicator): the joint split dominates the exact
    plan, so plan.json is the joint split's, one line says why, and no row of the table
    (its printed figures, every row taken to fit) dominates the plan written."""
    from qsync_opt.documents.io import load
    from qsync_opt.documents.schemas import ClusterSpec, CostTable, IndicatorTable, ModelGraph, Plan

    code, out, err, tmp_path = demo_part_2
    assert code == 0, err
    lines = out.splitlines()
    why = [x for x in lines if x.startswith("plan.json gets ")]
    assert why == [x for x in why if x.startswith(
        "plan.json gets highs+split's plan, not highs's: the joint split (highs with "
        "--joint-split) dominates highs's plan")] and len(why) == 1
    assert "highs+split's plan (OPTIMAL):" in lines
    table = {x.split()[0]: x for x in lines if x[:17].strip() and x.startswith(" ")
             and len(x.split()) > 8 and x.split()[1] in ("OPTIMAL", "FEASIBLE", "INFEASIBLE")}
    assert table["highs"].endswith("[dominated by highs+split]")
    assert "[dominated" not in table["highs+split"]
    prob = AllocationProblem(load(tmp_path / "graph.json", ModelGraph),
                             load(tmp_path / "cluster.json", ClusterSpec),
                             load(tmp_path / "costs.json", CostTable),
                             load(tmp_path / "indicator.json", IndicatorTable))
    plan = Plan.load(tmp_path / "plan.json")
    ev = evaluate(prob, plan)
    split_batches = table["highs+split"].split()[9].rstrip(";")
    assert ",".join(str(g.batch_per_device) for g in plan.groups.values()) == split_batches
    for name, x in table.items():
        f = x.split()
        if name == "highs+split" or f[3] == "-":
            continue
        assert not dominates(_ev(float(f[6]), float(f[3])), ev), x


@pytest.mark.parametrize(("split", "said"), [((32, 32), False), ((43, 21), True),
                                              ((21, 43), True)])
def test_the_demo_says_what_a_batch_split_changes(split, said) -> None:
    """The demo's part 1 may train a plan with another batch split than its fp32 run (the
    dynamic-batching plan): it says the averaged gradient is still the whole batch's and
    where a gap comes from (benchmarks/bench_split_gradient.py), only then."""
    from qsync_opt.cli.walkthrough import split_note
    from qsync_opt.problem.plan import make_plan

    graph = trace("digits_cnn")
    even = make_plan(graph, parse_shorthand("cpux1@32+cpu/2x1@32"), {})
    plan = make_plan(graph, parse_shorthand(f"cpux1@{split[0]}+cpu/2x1@{split[1]}"), {})
    note = split_note(plan, even)
    if said:
        assert note is not None and f"({split[0]}/{split[1]} against 32/32)" in note
        assert "bench_split_gradient.py" in note
    else:
        assert note is None
