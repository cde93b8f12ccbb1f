"""The strategy search: pruning by the no-straggler bound never discards the strategy a
full search chooses (brute force over small spaces), every solved step is at least its
bound, the transports price the buckets as stated, the chosen plan is version 2 with its
prediction and risks, and ``solve --allow`` refuses bad spaces in one line."""

from __future__ import annotations

import functools
import json

import pytest
from qsync_opt.solvers import SolveOptions

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.costs.cluster import parse_shorthand
from qsync_opt.costs.roofline import estimate
from qsync_opt.documents.schemas import Plan
from qsync_opt.netsim.cluster import parse_comm_model, transport_costs
from qsync_opt.planner.risks import strategy_risks
from qsync_opt.planner.solve import solve
from qsync_opt.planner.strategies import search_strategies
from qsync_opt.problem.plan import check_plan
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.problem.synthetic import random_indicator, synthetic_graph
from qsync_opt.strategy.space import Candidate, candidates, parse_allow
from support.harness import run_cli

SPACE = ["sync=ddp,local:2-4,qsr", "transport=fp32,fp16,dlcp:0.05"]


@functools.cache
def _problem(seed: int, shorthand: str, gbps: float) -> AllocationProblem:
    g = synthetic_graph(4, seed=seed, batch=64, width=512)
    c = parse_shorthand(shorthand).model_copy(update={"inter_node_bandwidth_gb_per_s": gbps})
    return AllocationProblem(g, c, estimate(g, c), random_indicator(g, seed))


def _one(problem: AllocationProblem, opts: SolveOptions):
    return solve(problem, "highs", opts, refine=1, compare_ties=False)


def _search(problem: AllocationProblem, prune: bool, space: list[str] = SPACE):
    return search_strategies(problem, parse_allow(space), _one, SolveOptions(time_limit_s=60),
                             prune=prune)


CASES = [(seed, shorthand, gbps) for seed in (0, 1, 2)
         for shorthand in ("v100x2+t4x2", "a100x4+t4x4")
         for gbps in (0.05, 1.0, 12.5, 1000.0)]


@pytest.mark.parametrize(("seed", "shorthand", "gbps"), CASES)
def test_pruning_never_discards_the_chosen_strategy(seed, shorthand, gbps) -> None:
    problem = _problem(seed, shorthand, gbps)
    pruned, full = _search(problem, True), _search(problem, False)
    n = len(candidates(parse_allow(SPACE)))
    assert n == 6  # ddp over three transports; local:2, local:4 and qsr over fp32
    assert full.pruned == 0 and full.solved == len(full.rows) == n
    assert pruned.solved + pruned.pruned == len(pruned.rows) == n
    assert pruned.chosen.candidate == full.chosen.candidate
    # the same plan (its provenance holds the time limit left and the wall time)
    assert pruned.plan.groups == full.plan.groups
    assert pruned.plan.strategy == full.plan.strategy
    for row in full.rows:  # the bound holds on every solved candidate
        if row.status == "solved":
            assert row.step_ms >= row.bound_ms * (1 - 1e-9), row.candidate
    best = min(r.step_ms for r in full.rows if r.status == "solved")
    assert full.chosen.step_ms <= best * (1 + 1e-9)
    for row in pruned.rows:  # a pruned candidate is slower than the chosen one could be
        if row.status == "pruned":
            assert row.bound_ms > pruned.chosen.step_ms


def test_a_slow_link_makes_the_search_leave_ddp_over_fp32() -> None:
    slow = _search(_problem(0, "a100x4+t4x4", 0.05), True)
    assert slow.chosen.candidate != Candidate()  # the link is the bottleneck
    fast = _search(_problem(0, "a100x4+t4x4", 12.5), False)
    steps = {r.candidate: r.step_ms for r in fast.rows}
    slow_full = _search(_problem(0, "a100x4+t4x4", 0.05), False)
    slow_steps = {r.candidate: r.step_ms for r in slow_full.rows}
    # every strategy is slower on the slower link; sending less helps there most
    assert all(slow_steps[c] >= steps[c] for c in steps)
    fp16 = Candidate("ddp", "fp16")
    assert slow_steps[fp16] < slow_steps[Candidate()]


def test_the_chosen_plan_is_version_2_with_its_prediction() -> None:
    problem = _problem(1, "v100x2+t4x2", 0.05)
    search = _search(problem, True)
    plan = search.plan
    assert plan.schema_version == 2 and plan.strategy is not None
    c = search.chosen.candidate
    assert (plan.strategy.sync, plan.strategy.transport) == (c.sync, c.transport)
    pred = plan.strategy.predicted
    assert pred is not None and pred.step_ms == search.chosen.evaluation.replay_makespan_ms
    assert pred.samples_per_s == pytest.approx(problem.global_batch / pred.step_ms * 1000)
    assert pred.comm_ms == pytest.approx(max(0.0, pred.step_ms - pred.compute_ms))
    assert plan.strategy.risks == strategy_risks(c)
    assert plan.strategy.space == parse_allow(SPACE).describe()
    check_plan(plan, problem.graph)
    back = Plan.model_validate_json(plan.model_dump_json())
    assert back == plan
    doc = search.to_json()
    assert doc["solved"] + doc["pruned"] == doc["candidates"] == 6
    json.dumps(doc)


def test_the_transports_price_the_buckets_as_stated() -> None:
    problem = _problem(0, "v100x2+t4x2", 1.0)
    analytic = parse_comm_model(None)
    args = (problem.graph, problem.cluster, problem.costs)
    fp32 = transport_costs(*args, "fp32", analytic)
    fp16 = transport_costs(*args, "fp16", analytic)
    dlcp = transport_costs(*args, "dlcp:p=0.05", analytic)
    assert fp32 is problem.costs and dlcp is problem.costs  # the analytic ring loses nothing
    for a, b in zip(fp32.buckets, fp16.buckets, strict=True):
        assert b.bytes == a.bytes  # the memory model's buckets stay FP32
        assert b.allreduce_ms == problem.costs.comm.allreduce_ms(a.bytes // 2)
        assert b.allreduce_ms < a.allreduce_ms


def test_risks_name_the_measured_studies() -> None:
    assert strategy_risks(Candidate()) == []
    local = strategy_risks(Candidate("local:4"))
    assert len(local) == 1 and "Local SGD and QSR" in local[0] and "0.0040" in local[0]
    assert "DLCP" in strategy_risks(Candidate("ddp", "dlcp:p=0.01"))[0]
    assert "not measured" in strategy_risks(Candidate("ddp", "fp16"))[0]


def test_the_allowed_space_expands_and_filters() -> None:
    space = parse_allow(["sync=ddp,local:2-8,qsr", "transport=fp32,fp16,dlcp:0.01-0.05"],
                        lr=0.05)
    assert space.sync == ("ddp", "local:2", "local:4", "local:8", "qsr:alpha=0.1,h_base=2")
    assert len(space.transport) == 4
    cands = candidates(space)
    assert len(cands) == 8 and cands[0] == Candidate()  # ddp x 4, local/qsr over fp32 only
    assert parse_allow(["sync=local:3-5"]).sync == ("local:3", "local:4", "local:5")
    assert parse_allow(None).is_default and candidates(parse_allow([])) == [Candidate()]
    assert parse_allow(["transport=dlcp:p=0.02,policy=random"]).transport[0].startswith(
        "dlcp:p=0.02,policy=random")
    assert parse_allow(["sync=qsr:alpha=0.3,h_base=4,local:2"]).sync == (
        "qsr:alpha=0.3,h_base=4", "local:2")


@pytest.mark.parametrize(("items", "needle"), [
    (["sync="], "expected KNOB=VALUES"), (["speed=fast"], "expected KNOB=VALUES"),
    (["sync"], "expected KNOB=VALUES"),
    (["sync=ddp", "sync=local:2"], "sync given twice"),
    (["sync=local:0-4"], "from 1 to"), (["sync=local:8-2"], "A <= B"),
    (["sync=local:٣"], "sync"), (["sync=local:2-٣"], "ASCII digits"),
    (["sync=local:1-99999999999999999999"], "from 1 to"),
    (["sync=bsp"], "allow: sync: expected ddp"),
    (["transport=fp8"], "allow: transport: expected"),
    (["transport=dlcp:0.6"], "dlcp's bound must be in (0, 0.5]"),
    (["transport=dlcp:nan"], "ASCII digits"), (["transport=dlcp:0-0.1"], "(0, 0.5]"),
    (["pipeline=0"], "from 1 (no pipeline)"), (["pipeline=1-99"], "to 64"),
    (["pipeline=-2"], "A <= B"),
    (["sync=local:2", "transport=fp16"], "no strategy of"),
    (["sync=qsr", "transport=dlcp:0.01"], "needs sync ddp"),
    (["transport=fp16", "pipeline=2"], "allow: no strategy"),
])
def test_a_bad_allowance_is_one_line_naming_it(items, needle) -> None:
    with pytest.raises(QsyncInputError) as err:
        parse_allow(items)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_solve_allow_from_the_command_line(tmp_path) -> None:
    out, png = tmp_path / "plan.json", tmp_path / "s.png"
    base = ["solve", "--model", "digits_cnn", "--cluster", "l4x1+t4x1", "--method", "random",
            "--solver", "highs", "--out", str(out)]
    code, stdout, stderr = run_cli(*base, "--allow", "sync=ddp,local:2", "--allow",
                                   "transport=fp32,fp16", "--png", str(png))
    assert code == 0, stderr
    assert "strategy search: 3 candidate(s)" in stdout and "chosen (*)" in stdout
    plan = Plan.load(out)
    assert plan.schema_version == 2 and plan.strategy.predicted is not None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, stdout, _ = run_cli(*base, "--allow", "sync=ddp,local:2", "--json")
    doc = json.loads(stdout)
    assert doc["search"]["candidates"] == 2 and doc["plan"] == str(out)


@pytest.mark.parametrize(("flags", "needle"), [
    (["--allow", "sync=ddp", "--sync", "local:2"], "--sync: with --allow"),
    (["--no-prune"], "--no-prune: only with --allow"),
    (["--png", "x.png"], "--png: only with --allow"),
    (["--allow", "sync=local:0"], "allow: sync"),
    (["--allow", "transport=fp16", "--mode", "budget", "--budget", "1"], "--mode budget"),
    (["--allow", "transport=fp16", "--allow", "pipeline=2"], "allow: no strategy"),
])
def test_solve_allow_refuses_in_one_line(tmp_path, flags, needle) -> None:
    code, _, stderr = run_cli("solve", "--model", "digits_cnn", "--cluster", "l4x1+t4x1",
                              "--method", "random", "--solver", "highs", "--out",
                              str(tmp_path / "p.json"), *flags)
    assert code == 2 and needle in stderr
    assert len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "p.json").exists()


def test_solve_sync_records_the_mode_in_the_plan(tmp_path) -> None:
    out = tmp_path / "plan.json"
    code, _, stderr = run_cli("solve", "--model", "digits_cnn", "--cluster", "l4x1+t4x1",
                              "--method", "random", "--solver", "highs", "--out", str(out),
                              "--sync", "local:04")
    assert code == 0, stderr
    plan = Plan.load(out)
    assert plan.schema_version == 2 and plan.strategy.sync == "local:4"
    assert plan.strategy.predicted.syncs_per_step == pytest.approx(0.25)


@pytest.mark.parametrize("command", ["compare", "pareto"])
def test_compare_and_pareto_list_strategies_as_rows(tmp_path, command) -> None:
    extra = (["--solvers", "highs", "--json", str(tmp_path / "c.json")] if command == "compare"
             else ["--out", str(tmp_path / "c.json"), "--points", "2", "--no-split"])
    code, out, err = run_cli(command, "--model", "digits_cnn", "--cluster", "l4x1+t4x1",
                             "--method", "random", "--allow", "sync=ddp,local:2",
                             "--allow", "transport=fp32,fp16", *extra)
    assert code == 0, err
    doc = json.loads((tmp_path / "c.json").read_text())["strategies"]
    assert doc["candidates"] == doc["solved"] == 3 and doc["pruned"] == 0
    assert "strategy search: 3 candidate(s)" in out
    if command == "compare":
        assert "against the precision-only plan's (ddp / fp32)" in out


def test_a_pipeline_candidate_is_predicted_and_its_plan_trains(tmp_path) -> None:
    """``--allow pipeline=2`` alone: the pipeline is the only candidate, predicted by the
    GPipe model at fp32 (ddp was not solved), written as the plan's pipeline, which
    ``train --plan`` runs with no other flag; 3 stages on 2 devices have no plan."""
    out = tmp_path / "plan.json"
    base = ["solve", "--model", "digits_cnn", "--cluster", "cpux1@32+cpu/2x1@32", "--method",
            "random", "--solver", "highs", "--out", str(out)]
    code, stdout, err = run_cli(*base, "--allow", "pipeline=2-3")
    assert code == 0, err
    assert "2 stages need" not in stdout and "3 stages need 3 devices" in stdout
    plan = Plan.load(out)
    pipe = plan.strategy.pipeline
    assert pipe is not None and pipe.stages == 2 and pipe.stage_groups == ["cpu", "cpu_2"]
    assert pipe.micro_batches == 4 and pipe.cuts and plan.strategy.predicted.step_ms > 0
    assert any("pipeline of 2 stages" in r for r in plan.strategy.risks)
    code, stdout, err = run_cli("train", "--model", "digits_cnn", "--plan", str(out),
                                "--out", str(tmp_path / "run"), "--steps", "2", "--dry-run")
    assert code == 0, err
    assert "pipeline: 2 stages at " + pipe.cuts[0] in stdout


def test_a_pipeline_is_chosen_by_samples_a_second_not_by_its_step() -> None:
    """A pipeline is one replica of its batch: on a cluster of many devices its step can be
    shorter than data parallelism's while it trains far fewer samples a second."""
    from qsync_opt.documents.jobstrategy import StrategyPrediction
    from qsync_opt.planner.strategies import StrategyRow, _better

    def row(cand: Candidate, step: float, per_s: float) -> StrategyRow:
        pred = StrategyPrediction(step_ms=step, compute_ms=step, comm_ms=0.0,
                                  bytes_per_step=0.0, syncs_per_step=1.0,
                                  samples_per_s=per_s, degradation=0.0, comm_model="x")
        return StrategyRow(cand, 0.0, "solved", prediction=pred)

    dp = row(Candidate(), 396.0, 10344.0)
    pipe = row(Candidate(stages=4), 162.0, 790.0)
    assert _better(dp, pipe) and not _better(pipe, dp)
