"""The solvers' proofs: an unproven value is never a proof, the time limit bounds every
path, an infeasible problem is infeasible for every backend, extreme but finite costs give
every backend the same answer (or one refusal), and CP-SAT names HiGHS when it stops with a
gap. Small synthetic problems; nothing timed beyond a generous "within the limit + 1 s"."""

from __future__ import annotations

import dataclasses
import time

import pytest
from qsync_opt.solvers import SolveOptions, driver, get_backend, registry, timing
from qsync_opt.solvers import fastest as fastest_mod
from qsync_opt.solvers.acceptance import LinearState
from qsync_opt.solvers.checks import check_resolution
from qsync_opt.solvers.cpsat import CpSat
from qsync_opt.solvers.fastest import FastestTimeLimit, fastest_plans, fastest_results
from qsync_opt.solvers.greedy import Greedy
from qsync_opt.solvers.pulp_runs import Outcome
from qsync_opt.solvers.timing import Stopwatch

import qsync_opt.planner.joint as joint_mod
import qsync_opt.planner.refine as refine_mod
from qsync_opt import estimate, parse_shorthand
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.planner.solve import InfeasibleError, SolveTimeLimit, reachable_ms, solve
from qsync_opt.problem.program import AllocationProblem, ProblemOptions
from qsync_opt.problem.synthetic import random_indicator, synthetic_graph

EXACT = ["highs", "cbc", "cpsat"]
ALL = [*EXACT, "greedy", "greedy-per-ms"]


def _problem(layers: int = 12, shorthand: str = "a100x1+t4x1", costs=None,
             options: ProblemOptions | None = None) -> AllocationProblem:
    g = synthetic_graph(layers, batch=256, width=1024)
    c = parse_shorthand(shorthand)
    table = estimate(g, c)
    if costs is not None:
        table = costs(table)
    return AllocationProblem(g, c, table, random_indicator(g), options)


def _downgrade(monkeypatch: pytest.MonkeyPatch, bound_of: object) -> None:
    """Make every fastest-plan program stop "at its time limit" with its plan unproven and
    the lower bound ``bound_of(ms) -> ms`` (the constant part included)."""
    real = fastest_mod.run

    def run(pulp, prog, backend, options, limit, start, sw, messages):
        out = real(pulp, prog, backend, options, limit, start, sw, messages)
        if out.status != "OPTIMAL":
            return out
        const = prog.form.objective.constant
        ms = (out.objective or 0.0) + const
        return Outcome("FEASIBLE", bound_of(ms) - const, out.solve_s,  # type: ignore[operator]
                       objective=out.objective)

    monkeypatch.setattr(fastest_mod, "run", run)


# --------------------------------------------------------------------------- unproven


def test_an_unproven_fastest_is_never_taken_as_the_least(monkeypatch) -> None:
    prob = _problem()
    proven = fastest_results(prob)
    assert all(r is not None and r.proven and r.bound_ms == r.ms for r in proven.values())
    _downgrade(monkeypatch, lambda ms: 0.9 * ms)
    got = fastest_results(prob)
    for name, r in got.items():
        assert r is not None and not r.proven
        assert r.bound_ms <= r.ms and r.ms == pytest.approx(proven[name].ms)  # type: ignore[union-attr]
    with pytest.raises(FastestTimeLimit, match="not proven"):
        fastest_plans(prob)
    with pytest.raises(FastestTimeLimit):
        reachable_ms(prob)  # the reachable makespan is never an unproven figure


def _out_of_reach() -> AllocationProblem:
    """A target just below the smallest reachable makespan: no plan exists."""
    prob = _problem()
    best = reachable_ms(prob)
    assert best is not None
    return prob.retarget(best - 1e-3 * (best - prob.tail_ms))


@pytest.mark.parametrize("name", ["greedy", "greedy-per-ms"])
def test_greedy_does_not_call_an_unproven_start_infeasible(monkeypatch, name) -> None:
    prob = _out_of_reach()
    plan, rep = get_backend(name).solve(prob, SolveOptions())
    assert plan is None and rep.status == "INFEASIBLE"  # proven: the exact fastest misses it
    _downgrade(monkeypatch, lambda ms: 0.5 * ms)  # unproven, its bound below the budget
    plan, rep = get_backend(name).solve(prob, SolveOptions())
    assert plan is None and rep.status == "TIME_LIMIT", rep.messages
    assert any("a faster plan may exist" in m for m in rep.messages)
    with pytest.raises(SolveTimeLimit):
        solve(prob, name)
    monkeypatch.undo()
    _downgrade(monkeypatch, lambda ms: ms)  # unproven, but its bound above the budget: proof
    plan, rep = get_backend(name).solve(prob, SolveOptions())
    assert plan is None and rep.status == "INFEASIBLE", rep.messages


def test_greedy_takes_an_unproven_plan_that_meets_the_budget(monkeypatch) -> None:
    """An unproven exact plan is a plan: where it meets the budget it is a start."""
    prob = _problem()
    best = reachable_ms(prob)
    assert best is not None
    prob = prob.retarget(best * (1 + 1e-6))
    _downgrade(monkeypatch, lambda ms: 0.5 * ms)
    plan, rep = Greedy().solve(prob, SolveOptions())
    assert plan is not None and rep.status == "FEASIBLE", rep.messages


# --------------------------------------------------------------------------- deadlines


def test_greedy_memory_fit_stops_at_the_deadline() -> None:
    prob = _problem()
    lin = LinearState(prob, Greedy.fastest(prob))
    gi = 1
    lin.groups[gi] = dataclasses.replace(lin.groups[gi], capacity_bytes=1.0)  # never fits
    fits, _, moves = Greedy._fit_memory(lin, gi, deadline=0.0, sw=Stopwatch())
    assert not fits and moves == 0
    fits, _, moves = Greedy._fit_memory(lin, gi)  # no deadline: it tries every move
    assert not fits and moves > 0


@pytest.mark.parametrize("limit", [1e-4, 0.05])
def test_greedy_never_runs_past_its_limit(monkeypatch, limit) -> None:
    """Every exact fallback gets at most what is left of the limit (it once got >= 1 s),
    and the verdict at a limit too short is TIME_LIMIT, never INFEASIBLE."""
    prob = _out_of_reach()
    given: list[float] = []
    real = fastest_mod.fastest_results

    def spy(problem, backend="highs", time_limit_s=60.0, skip=frozenset()):
        given.append(time_limit_s)
        return real(problem, backend, time_limit_s, skip)

    monkeypatch.setattr(fastest_mod, "fastest_results", spy)  # what group_fastest calls
    t0 = time.perf_counter()
    plan, rep = Greedy().solve(prob, SolveOptions(time_limit_s=limit))
    assert time.perf_counter() - t0 < limit + 1.0
    assert all(s <= limit for s in given), given
    assert plan is None and rep.status in ("TIME_LIMIT", "INFEASIBLE")
    if rep.status == "INFEASIBLE":  # only with a proof found within the limit
        assert any("no faster" in m or "exact fastest" in m for m in rep.messages)


@pytest.mark.parametrize("first_status", ["OPTIMAL", "FEASIBLE"])
def test_the_joint_split_solves_the_given_split_first(monkeypatch, first_status) -> None:
    """Building a candidate split's problem takes (fake) time: the given split is built and
    solved before the others, the others only while time is left, and the answer is the
    given split's plan with a message, not "no plan within the limit" (also when its first
    solve was not proven and no time is left to solve it again)."""
    prob = _problem(8)
    prob = prob.retarget((prob.target_ms + max(prob.reference_times.values())
                          + prob.tail_ms) / 2)  # the given split has a plan
    now = [0.0]
    real_clock = timing.clock
    monkeypatch.setattr(timing, "clock", lambda: real_clock() + now[0])
    real_with = AllocationProblem.with_cluster
    built: list[dict[str, int]] = []

    def slow(self, cluster, options=None):
        built.append({g.name: g.batch_per_device for g in cluster.groups})
        now[0] += 1.0  # each candidate takes a (fake) second to build
        return real_with(self, cluster, options)

    monkeypatch.setattr(AllocationProblem, "with_cluster", slow)
    real_run = joint_mod.run_backend

    def first_run(*args, **kwargs):
        plan, rep, ev = real_run(*args, **kwargs)
        if rep.status == "OPTIMAL":
            rep = rep.model_copy(update={"status": first_status})
        return plan, rep, ev

    monkeypatch.setattr(joint_mod, "run_backend", first_run)
    monkeypatch.setattr(refine_mod, "run_backend", first_run)
    own = {g.name: g.batch_per_device or prob.graph.batch_size for g in prob.cluster.groups}
    plan, rep = solve(prob, "highs", SolveOptions(time_limit_s=4.0), joint_split=True,
                      refine=0, compare_ties=False)
    assert built[0] == own
    assert {n: g.batch_per_device for n, g in plan.groups.items()} == own
    assert any("not built: the time limit ran out" in m for m in rep.messages), rep.messages
    assert len(built) < len(joint_mod.batch_splits(prob, None, joint_mod.MAX_SPLITS))


# --------------------------------------------------------------------------- infeasible


def _tiny_budget(prob: AllocationProblem, extra: float) -> AllocationProblem:
    return prob.retarget(prob.tail_ms + extra)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("extra", [1e-6, 1e-12, 0.0, -1.0])
def test_a_budget_no_plan_meets_is_infeasible_for_every_backend(name, extra) -> None:
    """The target at the tail + 1e-6 ms (CP-SAT refused it as "cannot be scaled"), at the
    tail, below it: INFEASIBLE from every backend, no input error."""
    prob = _tiny_budget(_problem(), extra)
    plan, rep = get_backend(name).solve(prob, SolveOptions(time_limit_s=20))
    assert plan is None and rep.status == "INFEASIBLE", (name, rep.messages)
    with pytest.raises(InfeasibleError):
        solve(prob, name, SolveOptions(time_limit_s=20))


@pytest.mark.parametrize("name", ALL)
def test_nothing_fits_memory_is_infeasible_for_every_backend_and_mode(name) -> None:
    prob = _problem(options=ProblemOptions(memory_headroom=0.999))
    plan, rep = get_backend(name).solve(prob, SolveOptions(time_limit_s=20))
    assert plan is None and rep.status == "INFEASIBLE", (name, rep.messages)
    for kwargs in ({}, {"mode": "budget", "degradation_budget": 0.0}):
        with pytest.raises(InfeasibleError):
            solve(prob, name, SolveOptions(time_limit_s=20), **kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- extreme costs


def _with_tail(ms: float):
    def edit(table):
        last = table.buckets[-1].model_copy(update={"allreduce_ms": ms})
        return table.model_copy(update={"buckets": [*table.buckets[:-1], last]})
    return edit


@pytest.mark.parametrize("ms", [1e300, 1e100, 1e20])
@pytest.mark.parametrize("name", ALL)
def test_a_tail_no_makespan_can_resolve_is_refused_by_every_backend(name, ms) -> None:
    prob = _problem(costs=_with_tail(ms))
    with pytest.raises(QsyncInputError, match="no makespan can resolve the compute") as info:
        solve(prob, name)
    assert not isinstance(info.value, InfeasibleError)
    if name != "greedy-per-ms":
        with pytest.raises(QsyncInputError, match="last bucket's all-reduce"):
            get_backend(name).solve(prob, SolveOptions())


def test_a_large_but_resolvable_tail_is_planned() -> None:
    prob = _problem(costs=_with_tail(1e3))
    check_resolution(prob)  # 1e3 ms beside ~ms of compute: resolvable
    plan, rep = solve(prob, "highs")
    assert rep.status == "OPTIMAL"


def _with_op(ms: float, precision: str):
    def edit(table):
        hit = [False]

        def one(e):
            if not hit[0] and e.device == "t4" and e.precision.value == precision \
                    and e.op.endswith(".fc"):
                hit[0] = True
                return e.model_copy(update={"fwd_ms": ms})
            return e
        return table.model_copy(update={"entries": [one(e) for e in table.entries]})
    return edit


@pytest.mark.parametrize("ms", [1e300, 1e30, 1e12])
@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_an_extreme_op_cost_gives_every_exact_backend_the_same_answer(ms, precision) -> None:
    """One op's cost at 1e300 ms on one precision: that choice is hopeless (fixed to 0 in
    the formulation, its coefficient never reaching a solver), and HiGHS, CBC and CP-SAT
    agree (before: HiGHS ERROR, CBC INFEASIBLE, CP-SAT an input error)."""
    prob = _problem(costs=_with_op(ms, precision))
    got = {}
    for name in EXACT:
        plan, rep = get_backend(name).solve(prob, SolveOptions(time_limit_s=30, rel_gap=1e-9))
        got[name] = (rep.status, rep.objective)
        assert rep.status in ("OPTIMAL", "INFEASIBLE"), (name, rep.messages)
    statuses = {s for s, _ in got.values()}
    assert len(statuses) == 1, got
    objs = [o for _, o in got.values() if o is not None]
    assert all(o == pytest.approx(objs[0], rel=1e-6, abs=1e-12) for o in objs), got


# --------------------------------------------------------------------------- CP-SAT's gap


def test_cpsat_stopped_with_a_gap_names_highs(monkeypatch) -> None:
    prob = _problem()
    prob = prob.retarget((prob.target_ms + max(prob.reference_times.values())
                          + prob.tail_ms) / 2)
    real = CpSat._solve_raw

    def unproven(self, *args, **kwargs):
        solved, nv, nc = real(self, *args, **kwargs)
        if solved.status == "OPTIMAL":
            solved = dataclasses.replace(solved, status="FEASIBLE")
        return solved, nv, nc

    monkeypatch.setattr(CpSat, "_solve_raw", unproven)
    monkeypatch.setattr(driver, "MIN_RETRY_S", 1e9)  # no second pass
    plan, rep = CpSat().solve(prob, SolveOptions(time_limit_s=20))
    if rep.status == "OPTIMAL":
        pytest.skip("every part was answered without a CP-SAT run")
    assert rep.status == "FEASIBLE"
    assert any("prefer --solver highs" in m for m in rep.messages), rep.messages


def test_registry_is_covered() -> None:
    exact = {n for n, b in registry().items() if b.exact}
    assert exact <= set(EXACT)
