"""The replayer's sync model takes a sync period: Local SGD / QSR pay their
communication once per round, and the planner spends the time it frees."""

from __future__ import annotations

import random

import pytest

from qsync_opt import estimate, load_cluster, trace
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.planner.solve import solve
from qsync_opt.problem.program import AllocationProblem, ProblemOptions
from qsync_opt.problem.synthetic import random_indicator
from qsync_opt.replayer import PeriodicSync, Replayer, sync_model_for
from qsync_opt.strategy.modes import parse_sync, rounds
from qsync_opt.strategy.schedule import parse_schedule


@pytest.fixture(scope="module")
def setup():
    g = trace("tiny_gpt", 8)
    cluster = load_cluster("v100x1+t4x1")
    return g, cluster, estimate(g, cluster)


def test_sync_model_for_reads_the_runtime_modes() -> None:
    assert sync_model_for(None) is None and sync_model_for("ddp") is None
    m = sync_model_for("local:4", steps=100)
    assert isinstance(m, PeriodicSync) and m.mean_period == 4 and m.rounds == 25
    m = sync_model_for("local:3", steps=10)
    assert m.rounds == 4 and m.mean_period == pytest.approx(2.5)  # 3, 3, 3 and the cut 1
    q = sync_model_for("qsr:alpha=0.2,h_base=2", lr=0.1, lr_schedule="cosine", steps=400)
    want = rounds(parse_sync("qsr:alpha=0.2,h_base=2"), parse_schedule("cosine", 0.1, 400), 400)
    assert q.rounds == len(want) < 200 and q.mean_period == pytest.approx(400 / len(want))
    with pytest.raises(QsyncInputError, match="^sync: "):
        sync_model_for("local:0")


def test_a_round_pays_one_averaging_spread_over_its_steps(setup) -> None:
    g, cluster, costs = setup
    ddp = Replayer(g, cluster, costs)
    plan = ddp.uniform("highest")
    base = ddp.simulate(plan)
    per_h = {}
    for h in (1, 2, 8, 64):
        rep = Replayer(g, cluster, costs, sync=PeriodicSync(float(h), f"local:{h}"))
        tl = rep.simulate(plan)
        slowest = max(x.compute_ms for x in tl.groups.values())
        avg = (costs.comm.allreduce_ms(g.param_bytes + g.buffer_bytes)
               + costs.comm.allreduce_ms(32))
        opt = max(grp.optimizer_ms for grp in rep.groups)
        assert tl.iteration_ms == pytest.approx(slowest + opt + avg / h, rel=1e-9)
        assert not tl.bucket_end_ms or max(tl.bucket_end_ms) <= slowest + 1e-9
        assert not any(e.kind == "allreduce" for e in tl.events)
        per_h[h] = tl.iteration_ms
    assert per_h[64] < per_h[8] < per_h[2] < per_h[1]
    # H = 1 averages parameters every step, after the optimizer: never cheaper than DDP,
    # whose all-reduce overlaps backward
    assert per_h[1] >= base.iteration_ms - 1e-9


def test_incremental_equals_full_under_a_period(setup) -> None:
    g, cluster, costs = setup
    rep = Replayer(g, cluster, costs, sync=PeriodicSync(6.0, "local:6"))
    rng = random.Random(0)
    for _ in range(20):
        plan = {grp.name: {op.name: rng.choice([p for p in op.allowed_precisions
                                                if p in grp.menu])
                           for op in g.choosable_ops() if not op.tie_group}
                for grp in rep.groups}
        inc = rep.incremental(plan)
        assert inc.state().iteration_ms == pytest.approx(
            rep.simulate(plan, events=False).iteration_ms, rel=1e-9)


def test_the_planner_spends_the_communication_a_period_frees(setup) -> None:
    """At one target, a plan for Local SGD keeps more ops at high precision than one for
    DDP (the all-reduce tail is gone; the averaging is paid once per 16 steps)."""
    g, cluster, costs = setup
    ind = random_indicator(g, seed=0)
    ddp = AllocationProblem(g, cluster, costs, ind)
    fp32 = ddp.makespan_ms({gm.name: list(gm.reference) for gm in ddp.groups})
    target = 0.96 * fp32  # the T4 straggles at fp32; its fastest plan is about 0.88 x fp32
    local = AllocationProblem(g, cluster, costs, ind,
                              ProblemOptions(sync=PeriodicSync(16.0, "local:16")))
    assert local.tail_ms < ddp.tail_ms
    p_ddp, _ = solve(ddp.retarget(target), "highs", mode="target")
    p_loc, _ = solve(local.retarget(target), "highs", mode="target")

    def low(plan):
        return sum(1 for p in plan.groups["t4"].precisions.values()
                   if Precision(p) != Precision.fp32)

    assert ddp.objective(ddp.assignment(p_ddp)) > local.objective(local.assignment(p_loc))
    assert low(p_loc) < low(p_ddp)
    # the options travel (a copy of the problem keeps its sync model)
    again = local.with_options(target_ms=target)
    assert isinstance(again.options.sync, PeriodicSync) and again.tail_ms == local.tail_ms
