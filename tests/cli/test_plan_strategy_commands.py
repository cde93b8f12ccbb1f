"""``replay --plan P`` predicts a version-2 plan's own strategy and ``report --plan P``
shows it; a ``--sync`` that contradicts the plan is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qsync_opt.documents.jobstrategy import PipelineStrategy, Strategy
from support.harness import run_cli
from support.strategy_plans import write_strategy_plans


@pytest.fixture(scope="module")
def plans(tmp_path_factory, digits_graph) -> dict[str, Path]:
    pipe = PipelineStrategy(stages=2, stage_groups=["v100", "t4"])
    return write_strategy_plans(tmp_path_factory.mktemp("v2"), digits_graph, "v100x2+t4x2", {
        "local": Strategy(sync="local:4", risks=["a stated risk"]),
        "fp16": Strategy(transport="fp16"), "pipe": Strategy(pipeline=pipe)})


def _replay(plan: Path, *flags: str) -> tuple[int, str, str]:
    return run_cli("replay", "--model", "digits_cnn", "--plan", str(plan), *flags)


def test_replay_runs_the_plans_sync_mode(plans) -> None:
    code, out, err = _replay(plans["local"])
    assert code == 0, err
    assert "strategy from the plan: sync local:4" in out and "sync local:4" in out
    code, out_v1, _ = _replay(plans["v1"], "--sync", "local:4")
    assert code == 0
    # the same iteration as the version-1 plan replayed with --sync local:4
    pick = [ln for ln in out.splitlines() if ln.startswith("plan: iteration")]
    assert pick == [ln for ln in out_v1.splitlines() if ln.startswith("plan: iteration")]


def test_replay_prices_the_plans_transport(plans) -> None:
    code, fp16, _ = _replay(plans["fp16"], "--json")
    code32, fp32, _ = _replay(plans["v1"], "--json")
    assert code == code32 == 0
    a, b = json.loads(fp16)["plan"], json.loads(fp32)["plan"]
    comm16, comm32 = a["groups"]["v100"]["exposed_comm_ms"], b["groups"]["v100"]["exposed_comm_ms"]
    assert 0 < comm16 < comm32  # half the bytes over the same ring
    assert a["iteration_ms"] < b["iteration_ms"]


def test_replay_refuses_a_sync_that_contradicts_the_plan(plans) -> None:
    code, _, err = _replay(plans["local"], "--sync", "local:2")
    assert code == 2 and "the plan's strategy says local:4 (plan field strategy.sync)" in err
    assert len(err.strip().splitlines()) == 1
    code, _, err = _replay(plans["local"], "--sync", "local:04")  # the same, parsed
    assert code == 0, err


def test_replay_takes_the_plans_pipeline(plans) -> None:
    code, out, err = _replay(plans["pipe"])
    assert code == 0, err
    assert "stage" in out.lower()


def test_report_shows_the_strategy_and_its_risks(plans) -> None:
    code, out, err = run_cli("report", "--plan", str(plans["local"]))
    assert code == 0, err
    assert "strategy: sync local:4, transport fp32, no pipeline" in out
    assert "risk: a stated risk" in out
    code, out, _ = run_cli("report", "--plan", str(plans["v1"]))
    assert "strategy:" not in out  # a version-1 plan's report reads as before
    code, out, _ = run_cli("report", "--plan", str(plans["fp16"]), "--json")
    assert json.loads(out)["strategy"]["transport"] == "fp16"
