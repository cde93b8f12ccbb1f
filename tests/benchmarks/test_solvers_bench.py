"""benchmarks/bench_solvers.py times cold solves: every repeat starts from an empty memo of
solved parts (with the memo kept, HiGHS's and CBC's repeats 2-3 are answered by it in 1-2%
of the first run's time, so the median would time a cache look-up)."""

from __future__ import annotations

import pytest
from helpers import load_benchmark
from qsync_opt.solvers import SolveOptions, get_backend

from qsync_opt import estimate, parse_shorthand
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.problem.synthetic import random_indicator, synthetic_graph


def _bench():
    return load_benchmark("bench_solvers")


def _small(*_: object) -> AllocationProblem:
    g = synthetic_graph(10, batch=256, width=1024)
    c = parse_shorthand("a100x1+t4x1")
    prob = AllocationProblem(g, c, estimate(g, c), random_indicator(g))
    return prob.retarget((prob.target_ms + max(prob.reference_times.values())
                          + prob.tail_ms) / 2)


@pytest.mark.parametrize("warm", [False, True])
def test_every_repeat_is_cold_unless_asked(monkeypatch, capsys, warm) -> None:
    bench = _bench()
    monkeypatch.setattr(bench, "INSTANCES", [("small", "a100x1+t4x1", None)])
    monkeypatch.setattr(bench, "build", _small)
    reports: list[list[str]] = []
    backend = get_backend("highs")
    real = type(backend).solve

    def spy(self, problem, options: SolveOptions):
        plan, rep = real(self, problem, options)
        reports.append(list(rep.messages))
        return plan, rep

    monkeypatch.setattr(type(backend), "solve", spy)
    assert bench.main(["--repeats", "3", "--solvers", "highs", *(["--warm"] if warm else [])]) == 0
    out = capsys.readouterr().out
    assert len(reports) == 3
    memo = [any("solved before in this process" in m for m in msgs) for msgs in reports]
    assert not memo[0]  # the first repeat runs the solver either way
    if warm:
        assert "each warm" in out and all(memo[1:])
    else:
        assert "each cold (the memo of solved parts cleared before it)" in out
        assert not any(memo)
