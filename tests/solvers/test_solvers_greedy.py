"""QSync's greedy allocator and the baselines: brute force on small random problems, the
replayer's verdict, casts, reverted moves, dynamic batching and the strong-only cluster."""

from __future__ import annotations

import functools
import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from qsync_opt.solvers import SolveOptions
from qsync_opt.solvers import greedy as greedy_mod
from qsync_opt.solvers.acceptance import REL_TOL, LinearState, ReplayAcceptance
from qsync_opt.solvers.baselines import DynamicBatching, StrongOnly, Uniform
from qsync_opt.solvers.greedy import Greedy
from qsync_opt.solvers.timing import Stopwatch

from qsync_opt import ModelGraph, QsyncInputError, estimate, parse_shorthand, trace
from qsync_opt.core.precision import DType, Precision
from qsync_opt.documents.schemas import OpRole
from qsync_opt.problem.evaluator import evaluate
from qsync_opt.problem.program import AllocationProblem, ProblemOptions
from qsync_opt.problem.synthetic import perturb_costs, random_indicator, synthetic_graph

P = Precision
LINEAR = SolveOptions(acceptance="linear")
REPLAYER = SolveOptions(acceptance="replayer")
CLUSTERS = ("a100x2+t4x2", "v100x2+t4x4", "t4x2+a100x1", "v100x4", "a100x1+v100x2+t4x2")
GRAPH_KEYS = ((2, 0), (3, 1), (4, 2), (3, 3))


@functools.cache
def graph(key: tuple[int, int]) -> ModelGraph:
    """Traced once per session (hypothesis would print a fixture's graphs on failure)."""
    n, seed = key
    return synthetic_graph(n, seed=seed)


def build(graph: ModelGraph, cluster: str, seed: int, frac: float) -> AllocationProblem:
    """A random problem whose target lies between the fastest plan and the reference."""
    c = parse_shorthand(cluster)
    base = AllocationProblem(graph, c, perturb_costs(estimate(graph, c), seed),
                             random_indicator(graph, seed), ProblemOptions(lower_reference=True))
    fast = Greedy.fastest(base)
    lo = max(g.time_ms(fast[g.name]) for g in base.groups)
    hi = max(lo, max(g.time_ms(g.reference) for g in base.groups))
    return base.with_options(target_ms=base.tail_ms + lo + frac * (hi - lo) + 1e-6)


def linear_ok(problem: AllocationProblem, a: dict[str, list[int]]) -> bool:
    tol = REL_TOL * problem.target_ms
    return all(g.time_ms(a[g.name]) <= problem.group_budget_ms() + tol
               and g.memory_bytes(a[g.name]) <= g.capacity_bytes * (1 + REL_TOL)
               for g in problem.groups)


def brute_force(problem: AllocationProblem) -> float | None:
    """The linear model's optimum (groups are independent under a fixed target)."""
    budget = problem.group_budget_ms() + REL_TOL * problem.target_ms
    total = 0.0
    for g in problem.groups:
        best = None
        for a in itertools.product(*[range(len(c)) for c in g.choices]):
            if g.time_ms(a) <= budget and g.memory_bytes(a) <= g.capacity_bytes * (1 + REL_TOL):
                d = g.weight * g.degradation(a)
                best = d if best is None else min(best, d)
        if best is None:
            return None
        total += best
    return total


problems = st.tuples(st.sampled_from(GRAPH_KEYS), st.sampled_from(CLUSTERS),
                     st.integers(0, 10_000), st.floats(-0.1, 1.2))
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- linear model


@SETTINGS
@given(case=problems, per_ms=st.booleans())
def test_linear_greedy_never_beats_brute_force(case, per_ms) -> None:
    key, cluster, seed, frac = case
    problem = build(graph(key), cluster, seed, frac)
    opt = brute_force(problem)
    plan, report = Greedy(per_ms=per_ms).solve(problem, LINEAR)
    assert report.solver == ("greedy-per-ms" if per_ms else "greedy")
    # Some plan exists exactly when the fastest plan is feasible, and greedy then finds one.
    if opt is None:
        assert plan is None and report.status == "INFEASIBLE"
        assert any("fastest" in m or "memory" in m for m in report.messages)
        return
    assert plan is not None and report.status == "FEASIBLE"
    a = problem.assignment(plan)
    assert linear_ok(problem, a)
    assert report.objective == pytest.approx(problem.objective(a))
    assert report.objective >= opt - 1e-9 * max(1.0, abs(opt))
    ev = evaluate(problem, plan)
    assert ev.feasible, ev.violations
    assert report.options["replayer_calls"] == 0
    assert report.options["checks"] >= report.options["accepted"]
    # The baseline is never better than the optimum either, where it is feasible.
    uplan, urep = Uniform().solve(problem, LINEAR)
    assert uplan is not None
    assert urep.status == ("FEASIBLE" if evaluate(problem, uplan).feasible else "INFEASIBLE")
    ua = problem.assignment(uplan)
    if linear_ok(problem, ua):
        assert problem.objective(ua) >= opt - 1e-9 * max(1.0, abs(opt))


@settings(max_examples=15, deadline=None, derandomize=True)
@given(case=problems, moves=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 50),
                                               st.integers(0, 5)), max_size=40))
def test_linear_state_tracks_the_exact_evaluators(case, moves) -> None:
    key, cluster, seed, frac = case
    problem = build(graph(key), cluster, seed, frac)
    lin = LinearState(problem, Greedy.fastest(problem))
    for gi, u, k in moves:
        gi %= len(problem.groups)
        g = problem.groups[gi]
        u %= len(g.choices)
        k %= len(g.choices[u])
        predicted = lin.memory_after(gi, u, k)
        lin.move(gi, u, k)
        assert lin.memory(gi) == pytest.approx(predicted, rel=1e-12)
    real = lin.assignment()
    for gi, g in enumerate(problem.groups):
        a = real[g.name]
        assert lin.a[gi] == g.complete(a)  # derived units follow their inputs
        assert lin.time[gi] == pytest.approx(g.time_ms(a), rel=1e-9, abs=1e-9)
        assert lin.memory(gi) == pytest.approx(g.memory_bytes(a), rel=1e-12)


# ----------------------------------------------------------------------------- replayer


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=problems, per_ms=st.booleans())
def test_replayer_greedy_meets_the_target_in_the_replayer(case, per_ms) -> None:
    key, cluster, seed, frac = case
    problem = build(graph(key), cluster, seed, frac)
    plan, report = Greedy(per_ms=per_ms).solve(problem, REPLAYER)
    if brute_force(problem) is None:
        assert plan is None and report.status == "INFEASIBLE"
        return
    assert plan is not None and report.status == "FEASIBLE"
    tl = problem.replayer.simulate(plan, events=False)
    # The target's makespan in the replayer: every group's compute (casts included) plus
    # the tail (last bucket, optimizer), not the all-reduce the backward leaves exposed.
    replay_ms = max(g.compute_ms for g in tl.groups.values()) + problem.tail_ms
    assert replay_ms <= problem.target_ms * (1 + 1e-7)
    for g in problem.groups:
        assert tl.groups[g.name].peak_memory_bytes <= g.capacity_bytes
    # The incremental replay the moves were checked on ends equal to a fresh replay of the
    # returned plan: no rejected move was left behind in it.
    assert report.options["makespan_ms"] == pytest.approx(replay_ms, rel=1e-9)
    assert report.options["replay_iteration_ms"] == pytest.approx(tl.iteration_ms, rel=1e-9)
    ev = evaluate(problem, plan)
    assert ev.feasible, ev.violations
    assert ev.makespan_ms == pytest.approx(replay_ms, rel=1e-9)  # the linear model agrees
    assert ev.objective == pytest.approx(report.objective)
    assert report.options["replayer_calls"] >= report.options["accepted"]


def test_reverting_a_rejected_move_restores_the_replay() -> None:
    problem = build(graph((4, 2)), "a100x2+t4x2", 7, 0.3)
    start = Greedy.fastest(problem)
    acc = ReplayAcceptance(problem, start)
    a = {k: list(v) for k, v in start.items()}
    kept = rejected = 0
    for gi, g in enumerate(problem.groups):
        for u in range(len(g.choices)):
            for k in range(len(g.choices[u])):
                old = a[g.name][u]
                if k == old:
                    continue
                acc.apply(gi, u, k)
                if acc.ok(gi) and kept < 3:
                    a[g.name][u] = k
                    kept += 1
                else:
                    acc.apply(gi, u, old)  # the revert
                    rejected += 1
    assert kept and rejected
    fresh = problem.replayer.incremental(problem.precisions(a))
    inc = acc.inc
    assert inc.prec == fresh.prec and inc.din == fresh.din and inc.dout == fresh.dout
    for gi in range(len(problem.groups)):
        assert inc.fwd[gi].vals == pytest.approx(fresh.fwd[gi].vals, rel=1e-12, abs=1e-12)
        assert inc.bwd[gi].vals == pytest.approx(fresh.bwd[gi].vals, rel=1e-12, abs=1e-12)
        assert inc.mem[gi] == fresh.mem[gi]  # every op's memory terms
    now, ref = inc.state(), fresh.state()
    assert now.iteration_ms == pytest.approx(ref.iteration_ms, rel=1e-12)
    assert now.peak_memory_bytes == ref.peak_memory_bytes
    sim = problem.replayer.simulate(problem.make_plan(a), events=False)
    assert now.iteration_ms == pytest.approx(sim.iteration_ms, rel=1e-9)


# ----------------------------------------------------------------------------- casts


def _cast_chain() -> AllocationProblem:
    """fc0 -> relu -> fc1 -> relu -> fc2 -> relu -> head on V100s (fp32 or fp16), with op
    costs set by hand: fp16 cheap, fp32 dear, fp16<->fp32 casts of an activation 30 ms. The
    middle layer has by far the largest indicator, so every greedy tries it first."""
    graph = synthetic_graph(3, seed=0, batch=4096, residual_every=100, norm_every=100)
    cluster = parse_shorthand("v100x2")
    costs = estimate(graph, cluster)
    choosable = {o.name for o in graph.ops if o.role == OpRole.choosable}
    entries = []
    for e in costs.entries:
        if e.op in choosable:
            v = 10.0 if e.precision == P.fp32 else 0.5
            e = e.model_copy(update={"fwd_ms": v, "bwd_ms": v})
        entries.append(e)
    casts = [k.model_copy(update={"a_ms_per_element": 15.0 / 2**20, "b_ms": 0.0})
             if {k.src, k.dst} == {DType.fp16, DType.fp32} else k for k in costs.casts]
    costs = costs.model_copy(update={"entries": entries, "casts": casts})
    ind = random_indicator(graph, 0)
    scale = {"blocks.0.fc": 2.0, "blocks.1.fc": 100.0, "blocks.2.fc": 1.0}
    values = {name: {p: 0.0 if p == P.fp32 else scale[name] * (7 - p.info.rank) for p in row}
              for name, row in ind.values.items()}
    return AllocationProblem(graph, cluster, costs, ind.model_copy(update={"values": values}),
                             ProblemOptions(lower_reference=True))  # the V100s alone: strong


def test_a_cast_against_the_neighbours_changes_greedys_choice() -> None:
    base = _cast_chain()
    g = base.groups[0]
    start = Greedy.fastest(base)["v100"]
    assert start == [1, 1, 1]  # everything fp16
    slack = 60.0
    problem = base.with_options(target_ms=g.time_ms(start) + base.tail_ms + slack)
    raised = [1, 0, 1]
    alone = g.time1[1][0] - g.time1[1][1]  # the middle layer's own time, fp16 -> fp32
    with_casts = g.time_ms(raised) - g.time_ms(start)
    assert alone < slack < with_casts  # cheap alone, dear against fp16 neighbours
    for options in (LINEAR, REPLAYER):
        plan, report = Greedy().solve(problem, options)
        assert plan is not None and report.status == "FEASIBLE"
        a = problem.assignment(plan)["v100"]
        assert a[1] == 1, options.acceptance  # the middle layer stays fp16
        # The replayer agrees with the pair-term accounting: that raise misses the target.
        inc = problem.replayer.incremental(plan)
        assert inc.what_if("v100", "blocks.1.fc", P.fp32).iteration_ms > problem.target_ms
        # An additive check (unary time only, QSync's wrong-neighbour gain) would take it.
        assert g.time_ms(a) + alone <= problem.group_budget_ms()


def test_sweeps_retry_moves_that_casts_made_affordable(monkeypatch) -> None:
    base = _cast_chain()
    g = base.groups[0]
    start = [1, 1, 1]
    # Raising fc1 first costs its casts on both edges (rejected); raising fc0 and fc2 fits;
    # then raising fc1 removes both casts and saves time: only a sweep finds it.
    slack = (g.time_ms([0, 1, 0]) - g.time_ms(start)) + 3.0
    assert g.time_ms([1, 0, 1]) - g.time_ms(start) > slack
    problem = base.with_options(target_ms=g.time_ms(start) + base.tail_ms + slack)
    assert brute_force(problem) == 0.0
    for options in (LINEAR, REPLAYER):
        plan, report = Greedy().solve(problem, options)
        assert plan is not None and problem.assignment(plan)["v100"] == [0, 0, 0]
        assert report.objective == 0.0
        assert any("sweep" in m and "1 more accepted" in m for m in report.messages)
    monkeypatch.setattr(greedy_mod, "MAX_SWEEPS", 0)
    plan, report = Greedy().solve(problem, LINEAR)
    assert plan is not None and problem.assignment(plan)["v100"] == [0, 1, 0]
    assert report.objective > 0


# ----------------------------------------------------------------------------- the start


def brute_fastest(problem: AllocationProblem) -> dict[str, float | None]:
    """Per group, the least linear time over assignments that fit its memory (None: none
    fits): the exact fastest plan, by enumeration."""
    out: dict[str, float | None] = {}
    for g in problem.groups:
        best = None
        for a in itertools.product(*[range(len(c)) for c in g.choices]):
            if g.memory_bytes(a) <= g.capacity_bytes:
                t = g.time_ms(a)
                best = t if best is None else min(best, t)
        out[g.name] = best
    return out


def random_instance(seed: int) -> AllocationProblem:
    """A small random problem whose target lies near the exact fastest makespan (at it,
    above it, or below it) and whose memory sometimes binds; native or fp32 flow."""
    rng = random.Random(seed)
    graph_ = graph(rng.choice(GRAPH_KEYS))
    c = parse_shorthand(rng.choice(CLUSTERS))
    costs = perturb_costs(estimate(graph_, c), seed)
    if rng.random() < 0.25:  # as if profiled on the runtime: fp32 flow, timeline memory
        costs = costs.model_copy(update={"activation_flow": "fp32"})
    opts = {} if rng.random() < 0.3 else {"lower_reference": True}
    base = AllocationProblem(graph_, c, costs, random_indicator(graph_, seed),
                             ProblemOptions(**opts))
    if rng.random() < 0.4:  # a capacity between a group's smallest and largest plan
        g = rng.choice(base.groups)
        mems = [g.memory_bytes(a) for a in itertools.product(*[range(len(x)) for x in g.choices])]
        cap = min(mems) + rng.uniform(0.0, 1.0) * (max(mems) - min(mems))
        base = base.with_options(memory_headroom=max(0.0, 1 - cap / g.usable_bytes))
    fast = brute_fastest(base)
    reach = max((t for t in fast.values() if t is not None), default=1.0) + base.tail_ms
    factor = rng.choice((1 + 1e-12, 1 + 1e-6, 1 + rng.uniform(0, 0.3), 1 - rng.uniform(0, 0.1)))
    return base.retarget(reach * factor)


def test_greedy_finds_a_plan_whenever_the_fastest_plan_is_feasible() -> None:
    """Both acceptances, both rankings, on random small instances: a plan the evaluator
    calls feasible exactly when the exact fastest plan (memory-feasible, linear makespan
    within the target, the target's own definition) is feasible; INFEASIBLE otherwise."""
    outcomes = {"feasible": 0, "infeasible": 0}
    for seed in range(80):
        problem = random_instance(seed)
        fast = brute_fastest(problem)
        feasible = all(t is not None and t <= problem.group_budget_ms()
                       for t in fast.values())
        outcomes["feasible" if feasible else "infeasible"] += 1
        for options in (REPLAYER, LINEAR):
            for per_ms in (False, True):
                plan, report = Greedy(per_ms=per_ms).solve(problem, options)
                where = (seed, options.acceptance, per_ms, report.messages[-2:])
                if feasible:
                    assert plan is not None and report.status == "FEASIBLE", where
                    ev = evaluate(problem, plan)
                    assert ev.feasible, (where, ev.violations)
                    assert report.objective == pytest.approx(ev.objective)
                else:
                    assert plan is None and report.status == "INFEASIBLE", where
    assert min(outcomes.values()) >= 10, outcomes  # both kinds of instance were drawn


def test_replayer_acceptance_keeps_the_evaluators_linear_memory(fixed_cpu) -> None:
    """On an fp32-flow table the replayer's memory is the runtime's timeline, the linear
    model's a sum that bounds it from above, and the evaluator checks both. With a capacity
    between the two for the fp32 plan, the replayer admits raises the linear rows refuse:
    the plan returned still passes the evaluator. (The cpu's figures are fixed: greedy's
    path, and so whether it tries such a raise, hangs on the machine's measured speeds.)"""
    g = trace("tiny_gpt", 4)
    cl = parse_shorthand("cpux1@4")
    costs = estimate(g, cl).model_copy(update={"activation_flow": "fp32"})
    base = AllocationProblem(g, cl, costs, random_indicator(g, 0),
                             ProblemOptions(lower_reference=True))
    gm = base.groups[0]
    fp32 = list(gm.reference)
    bf16 = [c.index(P.bf16) for c in gm.choices]
    cap = (gm.memory_bytes(bf16) + gm.memory_bytes(fp32)) / 2
    problem = base.with_options(memory_headroom=1 - cap / gm.usable_bytes,
                                target_ms=10 * base.makespan_ms({"cpu": fp32}))
    gm = problem.groups[0]
    timeline = problem.replayer.simulate(problem.make_plan({"cpu": fp32}), events=False)
    assert timeline.groups["cpu"].peak_memory_bytes <= gm.capacity_bytes < gm.memory_bytes(fp32)
    plan, report = Greedy().solve(problem, REPLAYER)
    assert plan is not None and report.status == "FEASIBLE"
    ev = evaluate(problem, plan)
    assert ev.feasible, ev.violations
    assert report.options["linear_vetoes"] > 0
    assert any("refused by the evaluator's linear rows" in m for m in report.messages)


def test_the_exact_fastest_plan_rescues_a_start_that_misses(monkeypatch) -> None:
    """Where the allocator's own start misses a group's budget (here: forced to QSync's
    cast-blind unary-fastest start), the exact fastest plan replaces it, and the report
    says so."""
    def blind(self, lin, gi, deadline, sw):
        fits, _, moves = self._fit_memory(lin, gi)
        g = lin.groups[gi]
        return ("unary-fastest", lin.time[gi], list(lin.a[gi][:g.n_units]), moves) if fits else None

    monkeypatch.setattr(Greedy, "_start_group", blind)
    rescued = 0
    for seed in range(40):
        problem = random_instance(seed)
        fast = brute_fastest(problem)
        if not all(t is not None and t <= problem.group_budget_ms() for t in fast.values()):
            continue
        lin = LinearState(problem, Greedy.fastest(problem))
        blind_ok = all(blind(Greedy(), lin, gi, 1e9, None) is not None
                       and lin.time[gi] <= problem.group_budget_ms()
                       for gi in range(len(problem.groups)))
        plan, report = Greedy().solve(problem, REPLAYER)
        assert plan is not None and evaluate(problem, plan).feasible, seed
        used = [m for m in report.messages if "the exact fastest plan (highs" in m]
        assert bool(used) == (not blind_ok), (seed, report.messages)
        rescued += bool(used)
    assert rescued >= 5, rescued


# ----------------------------------------------------------------------------- refusals


def test_greedy_reports_an_unreachable_target_and_memory() -> None:
    problem = build(graph((3, 1)), "a100x2+t4x2", 3, 0.5)
    tight = problem.with_options(target_ms=problem.tail_ms * 0.5)
    for options in (LINEAR, REPLAYER):
        plan, report = Greedy().solve(tight, options)
        assert plan is None and report.status == "INFEASIBLE"
        assert any("fastest memory-feasible plan takes" in m for m in report.messages)
        assert report.options["fastest_makespan_ms"] > tight.target_ms
    full = problem.with_options(memory_headroom=0.99)
    plan, report = Greedy().solve(full, LINEAR)
    assert plan is None and report.status == "INFEASIBLE"
    assert any("cannot fit memory" in m and "bytes" in m for m in report.messages)
    with pytest.raises(QsyncInputError, match="acceptance"):
        Greedy().solve(problem, SolveOptions(acceptance="bogus"))


def test_greedy_moves_units_to_fit_memory(resnet50_graph) -> None:
    c = parse_shorthand("v100x16+t4x16")
    # perturbed costs: at the catalog's estimate the T4's fastest op is fp16 everywhere (its
    # int8_full casts cost more than they save), which is also its least memory; here some
    # ops are fastest at int8, so the fastest plan holds more than fp16 does
    base = AllocationProblem(resnet50_graph, c, perturb_costs(estimate(resnet50_graph, c), 1),
                             random_indicator(resnet50_graph, 0), ProblemOptions(target_ms=900))
    t4 = base.group("t4")
    need = t4.memory_bytes(Greedy.fastest(base)["t4"])
    fp16 = t4.memory_bytes([c.index(P.fp16) for c in t4.choices])  # less than the fastest
    assert fp16 < need
    problem = base.with_options(memory_headroom=1 - (need + fp16) / 2 / t4.usable_bytes)
    t4 = problem.group("t4")
    gi = problem.groups.index(t4)
    # From the unary-fastest plan, which does not fit, units move to lower-memory choices.
    lin = LinearState(problem, Greedy.fastest(problem))
    assert lin.memory(gi) > t4.capacity_bytes
    fits, mem, moves = Greedy._fit_memory(lin, gi)
    assert fits and moves > 0 and mem == lin.memory(gi) <= t4.capacity_bytes
    fitted_ms = lin.time[gi]
    # The start is the fastest memory-feasible candidate: no slower than that one.
    found = Greedy()._start_group(LinearState(problem, Greedy.fastest(problem)), gi, 1e9,
                                  Stopwatch())
    assert found is not None and found[1] <= fitted_ms
    assert t4.memory_bytes(found[2]) <= t4.capacity_bytes
    for options in (LINEAR, REPLAYER):
        plan, report = Greedy().solve(problem, options)
        assert plan is not None and report.status == "FEASIBLE"
        assert any(m.startswith("start: group t4:") and f"{found[1]:.4f} ms" in m
                   for m in report.messages), report.messages
        assert evaluate(problem, plan).feasible


# ----------------------------------------------------------------------------- resnet50


@pytest.fixture(scope="module")
def resnet_problem(resnet50_graph) -> AllocationProblem:
    c = parse_shorthand("v100x16+t4x16")
    return AllocationProblem(resnet50_graph, c, estimate(resnet50_graph, c),
                             random_indicator(resnet50_graph, 0), ProblemOptions(target_ms=850))


@pytest.mark.parametrize("per_ms", [False, True])
@pytest.mark.parametrize("acceptance", ["replayer", "linear"])
def test_greedy_on_resnet50_is_valid(resnet_problem, acceptance, per_ms) -> None:
    plan, report = Greedy(per_ms=per_ms).solve(resnet_problem,
                                               SolveOptions(acceptance=acceptance))
    assert plan is not None and report.status == "FEASIBLE"
    ev = evaluate(resnet_problem, plan)
    assert ev.feasible, ev.violations
    assert linear_ok(resnet_problem, resnet_problem.assignment(plan))
    # Both acceptances score the target's makespan; the replayer's equals the linear one.
    assert report.options["makespan_ms"] == pytest.approx(ev.makespan_ms, rel=1e-9)
    assert ev.objective == pytest.approx(report.objective)
    assert report.options["accepted"] > 0
    assert ev.objective < resnet_problem.objective(
        {g.name: g.lowest() for g in resnet_problem.groups})


# ----------------------------------------------------------------------------- baselines


def test_uniform_runs_strong_at_reference_and_weak_at_lowest(resnet_problem) -> None:
    plan, report = Uniform().solve(resnet_problem, SolveOptions())
    assert plan is not None and report.solver == "uniform"
    ev = evaluate(resnet_problem, plan)
    assert report.status == ("FEASIBLE" if ev.feasible else "INFEASIBLE")
    a = resnet_problem.assignment(plan)
    assert a["v100"] == resnet_problem.group("v100").reference
    assert a["t4"] == resnet_problem.group("t4").lowest()
    assert any("UP" in m for m in report.messages)
    # On the T4 INT8 gives out FP32 and pays casts: uniform FP16 is its fastest.
    fplan, freport = Uniform().solve(resnet_problem, SolveOptions(
        extra={"uniform_precision": "fastest"}))
    assert fplan is not None
    t4 = resnet_problem.group("t4")
    fa = resnet_problem.assignment(fplan)["t4"]
    assert {t4.choices[u][k] for u, k in enumerate(fa)} == {P.fp16}
    assert evaluate(resnet_problem, fplan).makespan_ms <= ev.makespan_ms
    with pytest.raises(QsyncInputError, match="uniform_precision"):
        Uniform().solve(resnet_problem, SolveOptions(extra={"uniform_precision": "fp7"}))


def test_dynamic_batching_keeps_the_global_batch_and_fits(resnet_problem) -> None:
    plan, report = DynamicBatching().solve(resnet_problem, SolveOptions(
        extra={"batch_multiple": 8}))
    assert plan is not None and report.solver == "dynamic-batching"
    batches = {g.name: g.batch_per_device for g in plan.cluster.groups}
    counts = {g.name: g.count for g in plan.cluster.groups}
    assert sum(counts[n] * batches[n] for n in batches) == resnet_problem.global_batch
    assert all(b % 8 == 0 for b in batches.values())
    assert batches["t4"] < batches["v100"]  # the slower card gets less data
    ev = evaluate(resnet_problem, plan)
    assert ev.fits and ev.global_batch == resnet_problem.global_batch
    assert report.status == ("FEASIBLE" if ev.feasible else "INFEASIBLE")
    times = [e.linear_ms for e in ev.groups.values()]
    assert max(times) / min(times) < 1.1  # balanced
    assert any("re-split" in m for m in report.messages)
    # The plan holds every choosable op at the reference precision of its group.
    sub = resnet_problem.with_cluster(plan.cluster)
    assert sub.assignment(plan) == sub.reference_assignment()


def test_dynamic_batching_respects_memory(resnet50_graph) -> None:
    c = parse_shorthand("a100x16+t4x16")
    base = AllocationProblem(resnet50_graph, c, estimate(resnet50_graph, c),
                             random_indicator(resnet50_graph, 0))
    free, _ = DynamicBatching().solve(base, SolveOptions())
    assert free is not None
    t4_free = {g.name: g.batch_per_device for g in free.cluster.groups}["t4"]
    # Headroom such that the T4 cannot hold the balanced batch.
    sub = base.with_cluster(free.cluster)
    t4 = sub.group("t4")
    need = t4.memory_bytes(t4.reference)
    tight = base.with_options(memory_headroom=1 - 0.99 * need / t4.usable_bytes)
    plan, report = DynamicBatching().solve(tight, SolveOptions())
    assert plan is not None
    ev = evaluate(tight, plan)
    assert ev.fits
    t4_tight = {g.name: g.batch_per_device for g in plan.cluster.groups}["t4"]
    assert t4_tight < t4_free  # type: ignore[operator]
    assert ev.global_batch == base.global_batch


def test_strong_only_leaves_the_weak_cards_out(resnet_problem) -> None:
    plan, report = StrongOnly().solve(resnet_problem, SolveOptions())
    assert plan is not None and report.solver == "strong-only"
    assert [g.name for g in plan.cluster.groups] == list(resnet_problem.strong_groups)
    assert set(plan.groups) == set(resnet_problem.strong_groups)
    ev = evaluate(resnet_problem, plan)
    assert report.status == ("FEASIBLE" if ev.feasible else "INFEASIBLE")
    strong = resnet_problem.group("v100")
    assert ev.global_batch == strong.count * strong.batch
    assert all(p == P.fp32 for gp in plan.groups.values() for p in gp.precisions.values())
    assert any("left out" in m for m in report.messages)


@SETTINGS
@given(case=problems)
def test_every_baseline_plan_passes_the_evaluator(case) -> None:
    key, cluster, seed, frac = case
    problem = build(graph(key), cluster, seed, frac)
    for solver in (Uniform(), DynamicBatching(), StrongOnly()):
        plan, report = solver.solve(problem, SolveOptions())
        assert plan is not None and not solver.exact
        ev = evaluate(problem, plan)
        assert report.status == ("FEASIBLE" if ev.feasible else "INFEASIBLE")
        # The report quotes the evaluator's figures for the plan it returns.
        assert report.messages[-1].startswith(
            f"evaluated: linear makespan {ev.makespan_ms:.3f} ms, replayer "
            f"{ev.replay_makespan_ms:.3f} ms"), report.messages
        assert report.options["samples_per_s"] == pytest.approx(ev.samples_per_s)
        if solver.name == "strong-only":
            assert set(plan.groups) == set(problem.strong_groups)
        else:
            assert ev.global_batch == problem.global_batch
