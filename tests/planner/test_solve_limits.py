"""`solve()` as a whole: the time limit bounds the whole call, a time limit is never called
infeasibility, solve-replay refinement stops at a floor and keeps its best round, and in
auto mode greedy falls back to the lexicographic mode as the exact backends do."""

from __future__ import annotations

import functools

import pytest
from qsync_opt.solvers import SolveOptions, parts, row_repair, timing
from qsync_opt.solvers.cpsat import CpSat
from qsync_opt.solvers.greedy import Greedy
from qsync_opt.solvers.ilp import PulpIlp, fastest_plans
from qsync_opt.solvers.report import finish
from qsync_opt.solvers.timing import Stopwatch

import qsync_opt.planner.call as call_mod
from qsync_opt import estimate, parse_shorthand, trace
from qsync_opt.planner.solve import InfeasibleError, SolveTimeLimit, reachable_ms, solve
from qsync_opt.problem.evaluator import evaluate
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.problem.synthetic import random_indicator, synthetic_graph

EXACT = ["highs", "cbc", "cpsat"]
BACKENDS = {"highs": PulpIlp("highs"), "cbc": PulpIlp("cbc"), "cpsat": CpSat()}


def _exact(name: str):
    b = BACKENDS[name]
    assert b.is_available(), f"{name} is not installed here; the exact backends are required"
    return b


@functools.cache
def _comm_bound() -> AllocationProblem:
    """20 Linear layers at batch 8 on 4 A100 + 4 T4: the all-reduce the backward does not
    hide dominates, so the replayer's makespan of any plan is more than twice a target 5%
    above the smallest linear makespan (that drove the refined target below 0)."""
    g = synthetic_graph(20, batch=8, width=1024)
    c = parse_shorthand("a100x4+t4x4")
    return AllocationProblem(g, c, estimate(g, c), random_indicator(g))


@functools.cache
def _two_cards() -> AllocationProblem:
    """20 Linear layers at batch 256 on one A100 and one T4: the replayer's makespan depends
    on the plan (the all-fp32 plan is slower than the fastest)."""
    g = synthetic_graph(20, batch=256, width=1024)
    c = parse_shorthand("a100x1+t4x1")
    return AllocationProblem(g, c, estimate(g, c), random_indicator(g))


@functools.cache
def _large() -> AllocationProblem:
    """Two groups, each with a program to solve (the tests using it turn off the shortcut
    for parts whose least-degradation plan meets the target: the a100 group's does)."""
    g = synthetic_graph(150, batch=256, width=1024)
    c = parse_shorthand("a100x2+t4x2")
    prob = AllocationProblem(g, c, estimate(g, c), random_indicator(g))
    ref = max(prob.reference_times.values()) + prob.tail_ms
    return prob.with_options(target_ms=(prob.target_ms + ref) / 2)


@functools.cache
def _bert() -> AllocationProblem:
    g = trace("bert_base")
    c = parse_shorthand("a100x8+t4x8")
    return AllocationProblem(g, c, estimate(g, c), random_indicator(g))


# --------------------------------------------------------------------------- refinement


@pytest.mark.parametrize("name", EXACT)
def test_refinement_stops_at_the_floor_and_says_the_target_cannot_be_met(name) -> None:
    _exact(name)
    base = _comm_bound()
    reach = reachable_ms(base)
    assert reach is not None
    prob = base.retarget(reach * 1.05)
    plan, rep = solve(prob, name, refine=4, compare_ties=False)
    ev = evaluate(prob, plan)
    assert rep.rounds[0]["replay_makespan_ms"] > 2 * prob.target_ms  # the case that crashed
    targets = [r["target_ms"] for r in rep.rounds]
    assert all(t >= reach * (1 - 1e-12) for t in targets), targets  # never below the floor
    assert targets[-1] == pytest.approx(reach, rel=1e-12)  # ... and it was reached
    assert len(rep.rounds) < 5  # stopped at the floor, not by the round count
    assert "cannot be met by re-targeting the linear model" in rep.messages[-1]
    assert "does NOT meet" in rep.messages[-1]
    kept = [r for r in rep.rounds if r["kept"]]
    assert len(kept) == 1
    assert kept[0]["replay_makespan_ms"] == min(r["replay_makespan_ms"] for r in rep.rounds)
    assert ev.replay_makespan_ms == pytest.approx(kept[0]["replay_makespan_ms"], rel=1e-12)
    assert ev.objective == pytest.approx(kept[0]["objective"], rel=1e-12, abs=1e-12)


class _Scripted:
    """A backend answering each solve with the next of a list of real plans (a test double
    of ``backend.solve(problem, options) -> (plan, report)``)."""

    name = "scripted"
    exact = True

    def __init__(self, assignments):
        self.assignments = list(assignments)
        self.targets: list[float] = []

    def is_available(self) -> bool:
        return True

    def solve(self, problem, options):
        self.targets.append(problem.target_ms)
        a = self.assignments.pop(0)
        return finish(problem, self.name, a, status="FEASIBLE", mode="scripted",
                      options=options, sw=Stopwatch())


def test_refinement_keeps_the_best_round_not_the_last(monkeypatch) -> None:
    """Round 0 gives the fastest plan, round 1 (tighter target) a slower one: neither meets
    the replayer's target, so the round with the least replayer makespan is returned."""
    prob0 = _two_cards()
    fast = {name: v[1] for name, v in fastest_plans(prob0).items() if v is not None}
    ref = prob0.reference_assignment()
    r_fast = evaluate(prob0, prob0.make_plan(fast)).replay_makespan_ms
    r_ref = evaluate(prob0, prob0.make_plan(ref)).replay_makespan_ms
    assert r_ref > r_fast
    reach = reachable_ms(prob0)
    assert reach is not None
    assert r_fast > reach
    prob = prob0.retarget(reach + 0.75 * (r_fast - reach))  # round 1 lands above the floor
    scripted = _Scripted([fast, ref])
    monkeypatch.setattr(call_mod, "get_backend", lambda name: scripted)
    plan, rep = solve(prob, "scripted", refine=1, compare_ties=False)
    assert len(rep.rounds) == 2 and scripted.targets[1] < scripted.targets[0]
    assert prob.assignment(plan) == fast
    assert [r["kept"] for r in rep.rounds] == [True, False]
    assert "round 0 of rounds 0-1 kept" in rep.messages[-1]


# --------------------------------------------------------------------------- time limits


@pytest.mark.parametrize("name", EXACT)
def test_a_tiny_limit_is_a_time_limit_not_infeasibility(name) -> None:
    backend = _exact(name)
    prob = _large()
    with pytest.raises(SolveTimeLimit, match=r"no plan found within 1e-06 s") as info:
        solve(prob, name, SolveOptions(time_limit_s=1e-6))
    assert not isinstance(info.value, InfeasibleError)
    assert info.value.report is not None and info.value.report.status == "TIME_LIMIT"
    assert "best bound on the degradation 0 (the trivial one" in str(info.value)
    plan, rep = backend.solve(prob, SolveOptions(time_limit_s=1e-6))  # the backend alone
    assert plan is None and rep.status == "TIME_LIMIT"
    assert rep.bound == 0.0  # its best bound: here the trivial one (Omega is 0 at fp32)


def test_the_cli_prints_a_time_limit_as_one_line(tmp_path, capsys) -> None:
    from qsync_opt.cli import main

    code = main(["solve", "--model", "resnet50", "--cluster", "v100x16+t4x16", "--method",
                 "random", "--solver", "highs", "--time-limit", "0.000001",
                 "--out", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert code == 4  # a time limit: its own exit code (infeasible is 3, bad input 2)
    assert err.count("\n") == 1 and "no plan found within 1e-06 s" in err, err
    assert "infeasible" not in err.replace("not infeasible", "")


@pytest.mark.parametrize("name", EXACT)
def test_every_solver_run_gets_at_most_the_time_left(monkeypatch, name) -> None:
    """A fake clock that advances only while a solver runs (each run uses 30% of the limit it
    is given): every run of every phase (per-group programs, the lexicographic fallback's
    fastest plans, refinement rounds, the diagnosis) is given no more than what remains of
    the call's 10 s, and the call never spends more than 10 s."""
    _exact(name)
    prob = _bert()  # the default target is out of reach: fallback, then refinement rounds
    now = [1000.0]
    monkeypatch.setattr(timing, "clock", lambda: now[0])
    end = now[0] + 10.0
    seen: list[tuple[float, float]] = []  # (limit given, time left)

    def spend(limit: float) -> None:
        seen.append((limit, end - now[0]))
        now[0] += 0.3 * max(limit, 0.0)

    real_run = PulpIlp._run

    def run(self, pulp, prog, options, time_limit, start, sw, messages):
        spend(time_limit)
        return real_run(self, pulp, prog, options, time_limit, start, sw, messages)

    real_raw = CpSat._solve_raw

    def raw(self, cp_model, problem, gis, ints, hints, options, t_end, sc, sw):
        spend(t_end - now[0])
        return real_raw(self, cp_model, problem, gis, ints, hints, options, t_end, sc, sw)

    monkeypatch.setattr(PulpIlp, "_run", run)
    monkeypatch.setattr(CpSat, "_solve_raw", raw)
    try:
        plan, rep = solve(prob, name, SolveOptions(time_limit_s=10.0), compare_ties=False)
        assert plan is not None and rep.mode.startswith("lexicographic")
    except SolveTimeLimit as exc:
        assert "no plan found within 10 s" in str(exc)
    # several phases ran (the fastest plans, the lexicographic solve, refinement rounds;
    # the a100 group's parts need no run: its least-degradation plan meets every target,
    # and CP-SAT's first solve none: the t4 group's least time alone proves no plan)
    assert len(seen) >= 2
    for limit, left in seen:
        assert limit <= left + 1e-12, seen
    lefts = [left for _, left in seen]
    assert lefts == sorted(lefts, reverse=True)
    assert now[0] - 1000.0 <= 10.0 + 1e-9


@pytest.mark.parametrize("name", ["highs", "cbc"])
def test_per_group_programs_share_the_time_that_remains(monkeypatch, name) -> None:
    """The first group's program runs out of its share without a plan; the call does not
    end there: the other group is solved, then the first one again with all that is left."""
    backend = _exact(name)
    prob = _large()
    now = [0.0]
    monkeypatch.setattr(timing, "clock", lambda: now[0])
    monkeypatch.setattr(parts, "least_part", lambda problem, gis: None)
    limits: list[tuple[str, float]] = []
    real = row_repair.solve_program

    def program(run_once, pulp, p, hints, forbid=None):
        limits.append((p.tag, p.deadline - now[0]))
        if len(limits) == 1:  # the first run: its whole share passes without a plan
            now[0] = p.deadline
        return real(run_once, pulp, p, hints, forbid)

    monkeypatch.setattr(row_repair, "solve_program", program)
    plan, rep = backend.solve(prob, SolveOptions(time_limit_s=8.0))
    first = prob.groups[0].name
    assert [t for t, _ in limits] == [first, prob.groups[1].name, first]
    assert limits[0][1] == pytest.approx(4.0)  # an equal share of 8 s
    assert limits[1][1] == pytest.approx(4.0)  # what remains, for the one left
    assert limits[2][1] == pytest.approx(4.0)  # the second pass: all that is left
    assert plan is not None and rep.status == "OPTIMAL"
    assert any("second pass" in m for m in rep.messages)


def test_cpsat_groups_share_the_time_that_remains(monkeypatch) -> None:
    """The same for CP-SAT: its first group's time passes without a plan (outer and inner
    model), the second group is solved, then the first again in a second pass."""
    prob = _large()
    now = [0.0]
    monkeypatch.setattr(timing, "clock", lambda: now[0])
    monkeypatch.setattr(parts, "least_part", lambda problem, gis: None)
    runs: list[tuple[str, float]] = []
    real = CpSat._solve_raw

    def raw(self, cp_model, problem, gis, ints, hints, options, t_end, sc, sw):
        runs.append((problem.groups[gis[0]].name, t_end - now[0]))
        if len(runs) == 1:
            now[0] = t_end + 1.0  # the first group's whole share passes
        return real(self, cp_model, problem, gis, ints, hints, options, t_end, sc, sw)

    monkeypatch.setattr(CpSat, "_solve_raw", raw)
    plan, rep = _exact("cpsat").solve(prob, SolveOptions(time_limit_s=8.0))
    first, second = prob.groups[0].name, prob.groups[1].name
    names = [n for n, _ in runs]
    assert names[:3] == [first, first, second], runs  # outer, inner (no time), next group
    assert first in names[3:]  # the second pass
    assert plan is not None and rep.status == "OPTIMAL"
    assert any("second pass" in m for m in rep.messages)


# --------------------------------------------------------------------------- greedy


def test_greedy_falls_back_to_lexicographic_with_its_own_figure() -> None:
    prob = _bert()
    assert prob.options.target_ms is None  # the default target
    _, alone = Greedy().solve(prob, SolveOptions())
    own = alone.options.get("fastest_makespan_ms")
    assert alone.status == "INFEASIBLE" and isinstance(own, float), alone.messages
    plan, rep = solve(prob, "greedy", compare_ties=False)
    assert rep.mode.startswith("lexicographic")
    assert f"smallest makespan greedy reaches (its fastest plan) {own:.3f} ms" in rep.mode
    assert plan is not None and evaluate(prob, plan).fits
    # A target the user gave: no fallback, and the error leads with greedy's own figure.
    given = prob.with_options(target_ms=prob.target_ms)
    with pytest.raises(InfeasibleError) as info:
        solve(given, "greedy", compare_ties=False)
    assert info.value.lines[0].startswith(f"greedy's fastest plan takes {own:.3f} ms")
    assert all(ln.startswith("exact model: ") for ln in info.value.lines[1:])


class _ReferenceOnly:
    """A backend that is not exact and knows one plan, the reference (all at the reference
    precision): it meets a target at or above that plan's makespan, else it reports
    INFEASIBLE with that makespan as its own fastest figure, as greedy does."""

    name = "reference-only"
    exact = False

    def is_available(self) -> bool:
        return True

    def solve(self, problem, options):
        a = problem.reference_assignment()
        ms = problem.makespan_ms(a)
        if ms > problem.target_ms:
            return finish(problem, self.name, None, status="INFEASIBLE", mode="reference",
                          options=options, sw=Stopwatch(),
                          messages=[f"the reference plan takes {ms:.3f} ms"],
                          extra_options={"fastest_makespan_ms": ms})
        return finish(problem, self.name, a, status="FEASIBLE", mode="reference",
                      options=options, sw=Stopwatch())


def test_a_backend_that_is_not_exact_falls_back_on_its_own_figure(monkeypatch) -> None:
    """Its fastest plan is far slower than the exact model's: the fallback target comes from
    its own figure (the exact one would leave it without a plan again)."""
    prob = _bert()
    exact = reachable_ms(prob)
    own = prob.makespan_ms(prob.reference_assignment())
    assert exact is not None and own > exact * 1.1 and own > prob.target_ms
    backend = _ReferenceOnly()
    monkeypatch.setattr(call_mod, "get_backend", lambda name: backend)
    plan, rep = solve(prob, "reference-only", compare_ties=False)
    assert prob.assignment(plan) == prob.reference_assignment()
    assert rep.mode.startswith("lexicographic")
    assert f"smallest makespan reference-only reaches (its fastest plan) {own:.3f} ms" in rep.mode
    assert rep.messages[0] == (f"default target {prob.target_ms:.3f} ms out of reach: smallest "
                               f"makespan reference-only reaches (its fastest plan) {own:.3f} ms")
