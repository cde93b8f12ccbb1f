"""Diagnosing a problem without a plan: the least memory (exact, tight, brute-force checked)
and explain()'s lines on memory- and time-bound problems."""

from __future__ import annotations

import functools
import itertools

import pytest
from qsync_opt.solvers import SolveOptions
from qsync_opt.solvers.ilp import PulpIlp, fastest_times

from qsync_opt import estimate, parse_shorthand
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.planner.diagnose import (
    GIB,
    InfeasibleProblem,
    explain,
    min_memory,
    pinned_shares,
)
from qsync_opt.problem.program import AllocationProblem, ProblemOptions
from qsync_opt.problem.synthetic import perturb_costs, random_indicator, synthetic_graph

HIGHS = PulpIlp("highs")
pytestmark = pytest.mark.skipif(not HIGHS.is_available(), reason="HiGHS not available")
OPTS = SolveOptions(time_limit_s=30.0, rel_gap=1e-9)
#: resnet50 at a batch the T4 (15 GiB) cannot hold at any precision; the V100 can.
BIG = "v100x16@384+t4x16@384"


@functools.cache
def _synthetic(n_layers: int, seed: int, cluster: str) -> AllocationProblem:
    # batch 256, width 1024: activations weigh against the fixed memory (a real trade-off).
    g = synthetic_graph(n_layers, seed=seed, batch=256, width=1024)
    c = parse_shorthand(cluster)
    return AllocationProblem(g, c, perturb_costs(estimate(g, c), seed), random_indicator(g, seed))


def _resnet(graph, shorthand: str, **options) -> AllocationProblem:
    c = parse_shorthand(shorthand)
    return AllocationProblem(graph, c, estimate(graph, c), random_indicator(graph, 0),
                             ProblemOptions(**options))


def _solve_status(prob: AllocationProblem) -> str:
    plan, rep = HIGHS.solve(prob, OPTS)
    assert (plan is not None) == (rep.status in ("OPTIMAL", "FEASIBLE")), rep.messages
    return rep.status


# --------------------------------------------------------------------------- min_memory


@pytest.mark.parametrize("n_layers,seed,cluster", [
    (2, 0, "a100x2+t4x2"), (3, 1, "a100x2+t4x2"), (4, 0, "a100x2+t4x2"),
    (4, 1, "v100x1@64+t4x3@32"), (3, 2, "l4x2+t4x2"),
])
def test_min_memory_equals_brute_force(n_layers, seed, cluster):
    prob = _synthetic(n_layers, seed, cluster)
    mins = min_memory(prob)
    for g in prob.groups:
        brute = min(g.memory_bytes(a)
                    for a in itertools.product(*[range(len(c)) for c in g.choices]))
        got, a = mins[g.name]
        assert got == pytest.approx(brute, rel=1e-12)
        assert g.memory_bytes(a) == got
        assert len(a) == len(g.choices)


def test_min_memory_is_tight_on_a_synthetic_problem():
    prob = _synthetic(4, 0, "a100x2+t4x2").with_options(target_ms=1e9)
    mins = min_memory(prob)
    for g in prob.groups:
        need = mins[g.name][0]
        # A headroom that leaves exactly the least memory: a plan.
        h = 1 - need / g.usable_bytes
        tight = prob.with_options(memory_headroom=h)
        tg = tight.group(g.name)
        assert tg.capacity_bytes == pytest.approx(need, rel=1e-12)
        for other in tight.groups:  # the other groups stay loose
            if other.name != g.name:
                other.capacity_bytes = other.usable_bytes
        assert _solve_status(tight) == "OPTIMAL"
        # 1e-6 less: none.
        tg.capacity_bytes = need * (1 - 1e-6)
        assert _solve_status(tight) == "INFEASIBLE"


def test_min_memory_is_tight_on_resnet50(resnet50_graph):
    base = _resnet(resnet50_graph, BIG, target_ms=1e9)
    mins = min_memory(base)
    t4 = base.group("t4")
    assert mins["t4"][0] > t4.capacity_bytes  # the T4 cannot hold this batch
    assert _solve_status(base) == "INFEASIBLE"
    for g in base.groups:
        g.capacity_bytes = mins[g.name][0]
    assert _solve_status(base) == "OPTIMAL"
    for g in base.groups:
        g.capacity_bytes = mins[g.name][0] * (1 - 1e-6)
        assert _solve_status(base) == "INFEASIBLE", g.name
        g.capacity_bytes = mins[g.name][0]


# --------------------------------------------------------------------------- explain


def test_explain_names_the_group_memory_blocks_and_the_pinned_head(resnet50_graph):
    prob = _resnet(resnet50_graph, BIG)
    d = explain(prob)
    assert d.blocking == ["t4"]
    need = d.min_memory_bytes["t4"]
    assert need == min_memory(prob)["t4"][0]
    head = d.lines[0]
    assert head.startswith(f"t4 (t4): needs {need / GIB:.1f} GiB at its least-memory plan, "
                           f"has {prob.group('t4').capacity_bytes / GIB:.1f} GiB")
    assert "usable" in head and "headroom" in head
    pins = next(line for line in d.lines if "pinned" in line)
    assert pins.startswith("t4: pinned ops hold ")
    assert "% of its least-memory plan's memory: fc (classifier head, " in pins
    assert [s.op for s in d.pinned["t4"]] == ["fc", "loss.cross_entropy"]
    assert all(0 < s.memory_share < 1 for s in d.pinned["t4"])
    # The batch it names fits with the least-memory plan (memory is linear in the batch).
    fit_line = next(line for line in d.lines if "fits with the same plan" in line)
    fit = int(fit_line.split(": batch ")[1].split()[0])
    assert 1 <= fit < 384
    smaller = prob.with_cluster(parse_shorthand(f"v100x16@384+t4x16@{fit}"))
    assert smaller.group("t4").memory_bytes(d.min_memory_assignment["t4"]) <= \
        smaller.group("t4").capacity_bytes
    larger = prob.with_cluster(parse_shorthand(f"v100x16@384+t4x16@{fit + 1}"))
    assert larger.group("t4").memory_bytes(d.min_memory_assignment["t4"]) > \
        larger.group("t4").capacity_bytes
    # The V100 fits and, at the default target, every group that fits meets it.
    assert "v100" not in d.blocking and d.fastest_ms["t4"] is None
    assert not any(line.startswith("fastest makespan") for line in d.lines)
    err = InfeasibleProblem(d)
    assert isinstance(err, QsyncInputError)
    assert "\n" not in str(err) and str(err) == "; ".join(d.lines)
    assert err.format_lines().split("\n") == d.lines == err.lines


def test_explain_names_the_target_and_the_fastest_makespan(resnet50_graph):
    prob = _resnet(resnet50_graph, "v100x16@256+t4x16@256", target_ms=300.0)
    assert _solve_status(prob) == "INFEASIBLE"
    d = explain(prob)
    ft = fastest_times(prob)
    assert d.fastest_ms == pytest.approx(ft, rel=1e-9)
    assert d.fastest_makespan_ms == pytest.approx(max(ft.values()) + prob.tail_ms)
    assert d.blocking == ["t4"]
    line = next(line for line in d.lines if line.startswith("fastest makespan"))
    assert line == (f"fastest makespan reachable: {d.fastest_makespan_ms:.1f} ms (t4 at its "
                    "fastest plan); target 300.0 ms")
    pins = next(x for x in d.lines if x.startswith("t4: pinned ops take "))
    assert "% of its fastest plan's time: fc (classifier head, " in pins
    # A target just above the fastest makespan has a plan.
    assert _solve_status(prob.with_options(
        target_ms=d.fastest_makespan_ms * (1 + 1e-6))) in ("OPTIMAL", "FEASIBLE")
    assert "\n" not in str(InfeasibleProblem(d))


def test_explain_names_user_pins_and_every_late_group(resnet50_graph):
    prob = _resnet(resnet50_graph, "v100x16@256+t4x16@256", target_ms=150.0,
                   pinned={"conv1": "fp32"})
    d = explain(prob)
    assert sorted(d.blocking) == ["t4", "v100"]
    line = next(x for x in d.lines if x.startswith("fastest makespan"))
    assert "(t4 at its fastest plan)" in line and "v100 also over it at" in line
    pins = next(x for x in d.lines if x.startswith("t4: pinned"))
    assert ": conv1 (pinned by you to fp32, " in pins  # the heaviest pin comes first
    conv1 = next(s for s in pinned_shares(prob, "t4", d.fastest_assignment["t4"])
                 if s.op == "conv1")
    assert conv1.time_ms > 0 and conv1.reason == "pinned by you to fp32"


def test_explain_says_when_each_group_can_on_its_own(resnet50_graph):
    prob = _resnet(resnet50_graph, "v100x16@256+t4x16@256")
    d = explain(prob)
    assert d.blocking == [] and d.feasible_alone
    assert d.lines == ["each group fits and can meet the target on its own: a plan exists, "
                       "and a solver that found none stopped at a limit (time limit, "
                       "tolerance)"]


def test_explain_on_a_synthetic_problem_with_a_tiny_target_and_headroom():
    prob = _synthetic(3, 1, "a100x2+t4x2")
    mins = min_memory(prob)
    need = mins["t4"][0]
    h = 1 - need * 0.999 / prob.group("t4").usable_bytes  # the t4 cannot fit
    prob = prob.with_options(target_ms=prob.tail_ms * 1.001, memory_headroom=h)
    d = explain(prob)
    assert d.blocking[0] == "t4" and "a100" in d.blocking
    assert d.lines[0].startswith("t4 (t4): needs ")
    assert f"{100 * h:.3g}% headroom)" in d.lines[0]
    # Enough decimals to tell the need from the capacity.
    numbers = d.lines[0].split("needs ")[1].split(" GiB")[0], \
        d.lines[0].split("has ")[1].split(" GiB")[0]
    assert numbers[0] != numbers[1]
    line = next(x for x in d.lines if x.startswith("fastest makespan"))
    assert "(over the groups that fit)" in line and "(a100 at its fastest plan)" in line
    assert d.fastest_ms["t4"] is None and d.fastest_ms["a100"] is not None
    assert _solve_status(prob) == "INFEASIBLE"
    assert len(str(InfeasibleProblem(d)).splitlines()) == 1


def test_infeasible_problem_is_one_line_even_with_newlines_in_a_line():
    from qsync_opt.planner.diagnose import Diagnosis

    d = Diagnosis(lines=["a\nb", "c"], min_memory_bytes={}, fastest_ms={},
                  fastest_makespan_ms=None, blocking=[])
    err = InfeasibleProblem(d)
    assert str(err) == "a b; c" and err.args == ("a b; c",)
    assert err.format_lines(indent="  ") == "  a b\n  c"
    assert err.diagnosis is d
