"""The time limit bounds the whole call, the solvers' own overrun included: a
HiGHS/CBC run is handed what is left less a stated margin (solvers.timing.solver_limit), a
run with too little left is not started, and no joint-split candidate starts with less than
MIN_CANDIDATE_S left. The solvers' time is charged to a fake clock."""

from __future__ import annotations

import math

import pytest
from qsync_opt.solvers import SolveOptions, pulp_model, pulp_runs, relaxation, timing
from qsync_opt.solvers.formulation import formulate
from qsync_opt.solvers.timing import (
    AFTER_RUN_S,
    MIN_RUN_S,
    SOLVER_OVERRUN,
    Stopwatch,
    solver_limit,
)

import qsync_opt.planner.joint as joint_mod
from qsync_opt import estimate, parse_shorthand
from qsync_opt.planner.solve import SolveTimeLimit, solve
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.problem.synthetic import random_indicator, synthetic_graph


def _problem(layers: int = 8) -> AllocationProblem:
    g = synthetic_graph(layers, batch=256, width=1024)
    c = parse_shorthand("a100x1+t4x1")
    prob = AllocationProblem(g, c, estimate(g, c), random_indicator(g))
    return prob.retarget((prob.target_ms + max(prob.reference_times.values())
                          + prob.tail_ms) / 2)  # the given split has a plan


@pytest.mark.parametrize("seconds", [0.08, 0.1, 0.5, 2.0, 2.65, 60.0, 1e6])
def test_a_run_handed_its_limit_ends_in_time_even_at_the_stated_overrun(seconds) -> None:
    handed = solver_limit(seconds)
    assert 0 < handed < seconds
    assert handed * (1 + SOLVER_OVERRUN) + AFTER_RUN_S == pytest.approx(seconds)


@pytest.mark.parametrize("seconds", [0.0, -1.0, 1e-9, MIN_RUN_S, AFTER_RUN_S, 0.07,
                                     float("nan"), -math.inf])
def test_too_little_left_starts_nothing(seconds) -> None:
    assert solver_limit(seconds) == 0.0


@pytest.mark.parametrize("backend", ["highs", "cbc"])
def test_a_run_with_too_little_left_is_not_started(monkeypatch, backend) -> None:
    if not pulp_runs.available(backend):
        pytest.skip(f"{backend} missing")
    pulp = pulp_runs.pulp_module()
    prob = _problem()
    prog = pulp_model.to_pulp(pulp, formulate(prob, [0]), "margin")
    started: list[float] = []
    monkeypatch.setattr(prog.lp, "solve", lambda solver: started.append(1.0))
    msgs: list[str] = []
    out = pulp_runs.run(pulp, prog, backend, SolveOptions(), 0.06, False, Stopwatch(), msgs)
    assert out.status == "TIME_LIMIT" and not started
    assert any("not started" in m for m in msgs), msgs
    status, value = relaxation.lp_relaxation(formulate(prob, [0]),
                                             SolveOptions().with_time_left(0.06))
    assert (status, value) == ("TIME_LIMIT", None)


def _charged(monkeypatch: pytest.MonkeyPatch) -> tuple[list[float], list[tuple[float, float]]]:
    """A fake clock; every HiGHS run takes its whole handed limit plus the stated overrun
    (the worst case), and records (asked, handed)."""
    now = [0.0]
    real_clock = timing.clock
    monkeypatch.setattr(timing, "clock", lambda: real_clock() + now[0])
    runs: list[tuple[float, float]] = []
    real_run = pulp_runs.run
    real_class = pulp_runs._highs_class

    def charged_class(pulp):
        base = real_class(pulp)

        class Slow(base):  # type: ignore[misc, valid-type]
            def actualSolve(self, lp):
                got = super().actualSolve(lp)
                now[0] += self.timeLimit * (1 + SOLVER_OVERRUN)
                return got

        return Slow

    def spy(pulp, prog, backend, options, time_limit, *rest):
        out = real_run(pulp, prog, backend, options, time_limit, *rest)
        runs.append((time_limit, solver_limit(time_limit)))
        return out

    monkeypatch.setattr(pulp_runs, "_highs_class", charged_class)
    from qsync_opt.solvers import ilp

    monkeypatch.setattr(ilp, "run", spy)
    return now, runs


@pytest.mark.parametrize("limit", [1.0, 4.0])
def test_the_joint_split_ends_within_its_limit_when_highs_overruns(monkeypatch, limit) -> None:
    """Every HiGHS run overruns its handed limit by the stated 35%: the whole joint split
    still ends within the limit (plus a generous bound for the unchecked work after the
    last run), and each run was handed its share less the margin."""
    _, runs = _charged(monkeypatch)
    prob = _problem()
    t0 = timing.clock()
    try:
        solve(prob, "highs", SolveOptions(time_limit_s=limit), joint_split=True, refine=0,
              compare_ties=False)
    except SolveTimeLimit:
        pass  # no plan within the limit is an answer too: the call ended in time
    assert timing.clock() - t0 <= limit + 1.0
    assert any(handed > 0 for _, handed in runs)
    for asked, handed in runs:  # handed 0: not started
        assert handed == 0 or handed * (1 + SOLVER_OVERRUN) + AFTER_RUN_S <= asked + 1e-9


def test_no_candidate_starts_with_less_than_the_minimum_left(monkeypatch) -> None:
    """Once the candidates are built, less than MIN_CANDIDATE_S is left (a fake jump of the
    clock; the minimum raised to 30 s so that the given split's run fits before it): the
    given split's plan (solved first) is the answer, no other candidate is started, and
    the report says so."""
    now, runs = _charged(monkeypatch)
    prob = _problem()
    real_bounds = joint_mod.split_bounds

    def late(*args, **kwargs):
        got = real_bounds(*args, **kwargs)
        now[0] += 1e6  # all but about 20 s of the limit is gone
        return got

    monkeypatch.setattr(joint_mod, "split_bounds", late)
    limit = 1e6 + 20.0
    n_runs: list[int] = []
    real_first = joint_mod.joint_first

    def first(*args, **kwargs):
        n_runs.append(len(runs))
        return real_first(*args, **kwargs)

    monkeypatch.setattr(joint_mod, "joint_first", first)
    monkeypatch.setattr(joint_mod, "MIN_CANDIDATE_S", 30.0)
    plan, rep = solve(prob, "highs", SolveOptions(time_limit_s=limit), joint_split=True,
                      refine=0, compare_ties=False)
    own = {g.name: g.batch_per_device or prob.graph.batch_size for g in prob.cluster.groups}
    assert {n: g.batch_per_device for n, g in plan.groups.items()} == own
    assert not n_runs  # no candidate but the given split's was started
    assert any("not started (under 30 s of the limit left)" in m for m in rep.messages), \
        rep.messages
