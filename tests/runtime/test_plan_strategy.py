"""``train --plan P`` with a version-2 plan runs the plan's strategy with no other flag; a
flag that contradicts it is refused in one line naming the flag and the plan's field;
``--override`` runs the flag and records it in the run's config; a version-1 plan leaves
the flags to choose."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qsync_opt.cli import build_parser, main
from qsync_opt.documents.jobstrategy import PipelineStrategy, Strategy
from qsync_opt.documents.schemas import Plan
from qsync_opt.runtime.config import TrainConfig
from support.strategy_plans import write_strategy_plans

PIPE = PipelineStrategy(stages=2, stage_groups=["cpu", "cpu_2"], micro_batches=2,
                        compress_act="topk:0.5")


@pytest.fixture(scope="module")
def plans(tmp_path_factory, digits_graph) -> dict[str, Path]:
    return write_strategy_plans(tmp_path_factory.mktemp("plans"), digits_graph,
                                "cpux1@16+cpu/2x1@16", {
                                    "local": Strategy(sync="local:4"),
                                    "fp16": Strategy(transport="fp16"),
                                    "pipe": Strategy(pipeline=PIPE)})


def _train(plan: Path, out: Path, *flags: str) -> int:
    return main(["train", "--model", "digits_cnn", "--plan", str(plan), "--out", str(out),
                 "--steps", "2", "--dry-run", *flags])


def _config(out: Path) -> TrainConfig:
    return TrainConfig.load(out / "train_config.json")


@pytest.mark.parametrize(("key", "sync", "comm"), [
    ("local", "local:4", "allreduce"), ("fp16", "ddp", "fp16")])
def test_the_plan_alone_says_the_strategy(plans, tmp_path, capsys, key, sync, comm) -> None:
    assert _train(plans[key], tmp_path / "run") == 0
    cfg = _config(tmp_path / "run")
    assert (cfg.sync, cfg.comm, cfg.pipeline, cfg.overrides) == (sync, comm, None, [])
    assert "strategy from the plan: sync" in capsys.readouterr().out


def test_the_plan_alone_says_the_pipeline(plans, tmp_path) -> None:
    assert _train(plans["pipe"], tmp_path / "run") == 0
    cfg = _config(tmp_path / "run")
    assert cfg.pipeline is not None and cfg.rank_groups == ["cpu", "cpu_2"]
    assert (cfg.pipeline.stages, cfg.pipeline.micro_batches, cfg.pipeline.compress_act) == \
        (2, 2, "topk:0.5")


@pytest.mark.parametrize(("key", "flags", "needle"), [
    ("local", ["--sync", "local:8"], "--sync local:8: the plan's strategy says local:4 "
                                     "(plan field strategy.sync)"),
    ("local", ["--sync", "ddp"], "(plan field strategy.sync)"),
    ("fp16", ["--comm", "allreduce"], "--comm allreduce: the plan's strategy says fp16"),
    ("fp16", ["--comm", "dlcp:p=0.01,stress"], "(plan field strategy.transport)"),
    ("local", ["--pipeline-stages", "2", "--rank-groups", "0:cpu,1:cpu_2"],
     "--pipeline-stages 2: the plan's strategy says no pipeline"),
    ("pipe", ["--pipeline-stages", "3"], "says 2 (plan field strategy.pipeline)"),
    ("pipe", ["--pipeline-stages", "2", "--compress-act", "quant:4"],
     "(plan field strategy.pipeline.compress_act)"),
    ("pipe", ["--pipeline-stages", "2", "--rank-groups", "0:cpu_2,1:cpu"],
     "(plan field strategy.pipeline.stage_groups)"),
    ("pipe", ["--pipeline-stages", "2", "--micro-batches", "4"],
     "(plan field strategy.pipeline.micro_batches)"),
    ("v1", ["--override"], "--override: only beside a version-2 plan"),
])
def test_a_flag_that_contradicts_the_plan_is_one_line(plans, tmp_path, capsys, key, flags,
                                                      needle) -> None:
    assert _train(plans[key], tmp_path / "run", *flags) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err
    assert not (tmp_path / "run" / "train_config.json").exists()


@pytest.mark.parametrize(("key", "flags"), [
    ("local", ["--sync", "local:04"]), ("local", ["--sync", " LOCAL:4 "]),
    ("fp16", ["--comm", "fp16"]),
    ("pipe", ["--pipeline-stages", "2", "--compress-act", "topk:50%"]),
])
def test_a_flag_that_says_the_same_as_the_plan_is_taken(plans, tmp_path, key, flags) -> None:
    assert _train(plans[key], tmp_path / "run", *flags) == 0
    assert _config(tmp_path / "run").overrides == []


def test_override_runs_the_flag_and_records_it(plans, tmp_path, capsys) -> None:
    assert _train(plans["local"], tmp_path / "run", "--sync", "local:8", "--override") == 0
    cfg = _config(tmp_path / "run")
    assert cfg.sync == "local:8"
    assert cfg.overrides == ["--sync local:8 over the plan's local:4"]
    assert "OVERRIDE --sync local:8" in capsys.readouterr().out


def test_override_into_an_impossible_pair_is_still_refused(plans, tmp_path, capsys) -> None:
    assert _train(plans["local"], tmp_path / "run", "--comm", "fp16", "--override") == 2
    assert "--comm" in capsys.readouterr().err


def test_a_version_1_plan_leaves_the_flags_to_choose(plans, tmp_path) -> None:
    assert _train(plans["v1"], tmp_path / "a") == 0
    assert (_config(tmp_path / "a").sync, _config(tmp_path / "a").comm) == ("ddp", "allreduce")
    assert _train(plans["v1"], tmp_path / "b", "--sync", "local:3") == 0
    assert _config(tmp_path / "b").sync == "local:3"


def test_a_hand_edited_impossible_plan_is_refused_before_anything_is_written(
        plans, tmp_path, capsys) -> None:
    data = json.loads(plans["local"].read_text())
    data["strategy"]["transport"] = "fp16"  # fp16 gradients under Local SGD: no gradients
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    assert _train(bad, tmp_path / "run") == 2
    err = capsys.readouterr().err.strip()
    assert "plan: strategy: sync local:4 with transport fp16" in err and "\n" not in err
    assert not (tmp_path / "run").exists()


def test_the_train_help_names_override() -> None:
    help_text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "--override" in help_text and "version-2 plan" in help_text


@pytest.mark.slow
def test_a_solved_version_2_plan_trains_its_strategy_on_two_gloo_ranks(tmp_path, capsys
                                                                        ) -> None:
    """``solve --sync local:4`` writes the strategy; ``train --plan`` alone runs it on two
    gloo ranks: 8 steps in 2 rounds, and the run prints the plan's prediction beside it."""
    plan = tmp_path / "plan.json"
    assert main(["solve", "--model", "digits_cnn", "--cluster", "cpux1@16+cpu/2x1@16",
                 "--method", "random", "--solver", "highs", "--sync", "local:4",
                 "--out", str(plan)]) == 0
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", "--model", "digits_cnn", "--plan", str(plan), "--out", str(out),
                 "--steps", "8", "--timeout", "60"]) == 0
    text = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sync"] == "local:4" and summary["overrides"] == []
    comm = summary["communication"]
    assert (comm["rounds"], comm["steps"]) == (2, 8)
    assert "sync local:4: 2 round(s) in 8 step(s)" in text
    assert "the plan predicted" in text and "0.25 syncs a step" in text
    predicted = Plan.load(plan).strategy.predicted
    measured = comm["bytes_sent"] / comm["steps"]
    # the payload: the FP32 parameters (and the few buffer bytes) once per round
    assert measured == pytest.approx(predicted.bytes_per_step, rel=0.02)
