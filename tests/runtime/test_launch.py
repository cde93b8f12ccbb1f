"""``qsync-opt train``'s launcher (qsync_opt.job.launch), without launching ranks."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import pytest

from qsync_opt.cli.parsers.train import add_train_parser
from qsync_opt.cli.train import cmd_train, train_request
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.costs.cluster import parse_shorthand
from qsync_opt.job import launch
from qsync_opt.pipeline.spec import PipelineRequest
from qsync_opt.problem.plan import make_plan
from qsync_opt.runtime.config import TrainConfig


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qsync-opt")
    add_train_parser(parser.add_subparsers(dest="command"))
    return parser


def _args(*argv: str) -> argparse.Namespace:
    return _parser().parse_args(["train", *argv])


@pytest.fixture(scope="module")
def plans(tmp_path_factory, digits_graph) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plans")
    out = {}
    for key, shorthand in (("hybrid", "cpux1@16+cpu/2x1@16"),
                           ("gpus", "v100x2@16+t4x2@16"),
                           ("nodes", "t4x4@8+t4x4@8")):
        # "nodes": two groups of 4 devices per node -> 2 nodes of 4 ranks.
        cluster = parse_shorthand(shorthand, devices_per_node=4)
        plan = make_plan(digits_graph, cluster, {})
        out[key] = root / f"{key}.json"
        plan.save(out[key])
    return out


def test_the_config_written_for_a_hybrid_cpu_cluster(plans, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    args = _args("--model", "digits_cnn", "--plan", str(plans["hybrid"]), "--nproc", "2",
                 "--steps", "7", "--lr", "0.1", "--optimizer", "adam", "--seed", "3",
                 "--out", str(out), "--checkpoint-every", "2", "--no-resume",
                 "--timeout", "30", "--dry-run")
    assert args.fn.resolve() is cmd_train
    assert cmd_train(args) == 0
    cfg = TrainConfig.load(out / "train_config.json")
    assert cfg.workload == "digits_cnn"
    assert cfg.rank_groups == ["cpu", "cpu_2"]
    assert cfg.slowdown == {"cpu_2": 2.0}
    assert (cfg.steps, cfg.lr, cfg.optimizer, cfg.seed) == (7, 0.1, "adam", 3)
    assert (cfg.checkpoint_every, cfg.resume, cfg.timeout_s, cfg.emulate_dp) == (2, False, 30.0,
                                                                                False)
    assert Path(cfg.plan_path) == plans["hybrid"].resolve()
    assert Path(cfg.out_dir) == out.resolve()
    text = capsys.readouterr().out
    assert "cpu_2 x2" in text and "emulation" in text
    assert "torch.distributed.run --nproc-per-node 2 --master-port" in text
    assert "-m qsync_opt.job.rank" in text and str(out / "train_config.json") in text
    # The file is plain JSON that every rank reads.
    assert json.loads((out / "train_config.json").read_text())["schema_name"] == "TrainConfig"


def test_default_mapping_one_rank_per_device(plans, tmp_path) -> None:
    args = _args("--model", "digits_cnn", "--plan", str(plans["gpus"]), "--out",
                 str(tmp_path), "--dry-run")
    assert cmd_train(args) == 0
    cfg = TrainConfig.load(tmp_path / "train_config.json")
    assert cfg.rank_groups == ["v100", "v100", "t4", "t4"]
    assert cfg.slowdown == {}


def test_explicit_rank_groups(plans, tmp_path) -> None:
    args = _args("--model", "digits_cnn", "--plan", str(plans["gpus"]), "--nproc", "2",
                 "--rank-groups", "1:v100, 0:t4", "--out", str(tmp_path), "--dry-run")
    assert cmd_train(args) == 0
    assert TrainConfig.load(tmp_path / "train_config.json").rank_groups == ["t4", "v100"]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--plan", "missing.json"], "file not found"),
        (["--model", "resnet18"], "made for model 'digits_cnn', not 'resnet18'"),
        (["--rank-groups", "0:v100,1:a100"], "rank 1's group 'a100' is not in the plan"),
        (["--rank-groups", "0:v100,1:t4", "--nproc", "3"], "does not match --rank-groups"),
        (["--nproc", "2"], "pass --nproc 4, or say which group each rank runs"),
        (["--rank-groups", "0:v100,2:t4"], "missing 1"),
        (["--rank-groups", "0:v100,0:t4"], "rank 0 is given twice"),
        (["--rank-groups", "v100,t4"], "is not RANK:GROUP"),
    ],
)
def test_bad_input_is_one_line(plans, tmp_path, extra, needle) -> None:
    base = {"--model": "digits_cnn", "--plan": str(plans["gpus"]), "--out": str(tmp_path)}
    for flag, value in zip(extra[::2], extra[1::2], strict=True):
        base[flag] = value if flag != "--plan" else str(tmp_path / value)
    argv = [x for kv in base.items() for x in kv] + ["--dry-run"]
    with pytest.raises(QsyncInputError) as exc:
        cmd_train(_args(*argv))
    assert needle in str(exc.value)
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "train_config.json").exists()


@pytest.mark.parametrize("extra", [["--nproc", "0"], ["--steps", "0"], ["--seed", "9" * 30]])
def test_bad_numbers_are_refused_when_parsed(extra) -> None:
    """Every numeric flag is checked by its argparse type (exit 2, one line
    naming the flag), before anything is built."""
    from support.harness import run_cli

    code, _, err = run_cli("train", "--model", "digits_cnn", *extra)
    assert code == 2 and f"argument {extra[0]}: expected" in err and err.count("\n") == 1, err


def test_a_file_that_is_not_a_plan(plans, tmp_path) -> None:
    other = tmp_path / "cfg.json"
    other.write_text(json.dumps({"schema_name": "ClusterSpec", "groups": []}))
    with pytest.raises(QsyncInputError, match="Plan"):
        cmd_train(_args("--model", "digits_cnn", "--plan", str(other), "--dry-run"))


def test_print_command_multinode(plans, tmp_path, capsys) -> None:
    args = _args("--model", "digits_cnn", "--plan", str(plans["nodes"]), "--out",
                 str(tmp_path), "--print-command")
    assert cmd_train(args) == 0
    out = capsys.readouterr().out
    cfg = tmp_path / "train_config.json"
    assert cfg.exists()
    assert "# 2 node(s) x 4 rank(s)" in out
    for node in (0, 1):
        assert (f"torchrun --nnodes 2 --node-rank {node} --nproc-per-node 4 --master-addr HOST0 "
                f"--master-port 29500 -m qsync_opt.job.rank {cfg}") in out
    assert "# node 1: ranks 4..7 (t4_2)" in out
    # Explicit rank groups: one node running them all.
    args = _args("--model", "digits_cnn", "--plan", str(plans["gpus"]), "--out", str(tmp_path),
                 "--rank-groups", "0:v100,1:t4", "--print-command")
    assert cmd_train(args) == 0
    assert "--nnodes 1 --node-rank 0 --nproc-per-node 2" in capsys.readouterr().out


def _fake_torchrun(script: str):
    def command(config_path, nproc, port):
        return [sys.executable, "-c", script]
    return command


def test_launch_streams_output_and_passes_the_env(plans, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(launch, "local_command", _fake_torchrun(
        "import os; print('hello from ranks'); print('omp', os.environ['OMP_NUM_THREADS'])"))
    args = _args("--model", "digits_cnn", "--plan", str(plans["hybrid"]), "--out",
                 str(tmp_path))
    assert cmd_train(args) == 0
    out = capsys.readouterr().out
    assert "hello from ranks" in out and "omp 1" in out


def _summary_writer(out: Path, **fields: object) -> str:
    """A fake torchrun that writes the run's summary.json (as rank 0 would) and exits 0."""
    doc = {"steps": 5, "world_size": 2, "batches": [48, 16], "final_loss": 0.25,
           "eval_loss": 0.5, "eval_accuracy": 0.875, "skipped_steps": 0, **fields}
    return (f"import json, pathlib; pathlib.Path({str(out / 'summary.json')!r})"
            f".write_text(json.dumps({doc!r}))")


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, "final loss 0.2500, eval loss 0.5000, eval accuracy 0.875, 0 skipped step(s)"),
    # A run whose last step was skipped (non-finite loss) or that diverged: the runtime
    # writes its non-finite losses as null (strict JSON). It used to crash with a TypeError.
    ({"final_loss": None, "skipped_steps": 2},
     "final loss not finite, eval loss 0.5000, eval accuracy 0.875, 2 skipped step(s)"),
    ({"final_loss": None, "eval_loss": None, "eval_accuracy": None},
     "final loss not finite, eval loss not finite, 0 skipped step(s)"),
])
def test_the_summary_line_of_a_finished_run(plans, tmp_path, capsys, monkeypatch, fields,
                                            expected) -> None:
    monkeypatch.setattr(launch, "local_command",
                        _fake_torchrun(_summary_writer(tmp_path, **fields)))
    args = _args("--model", "digits_cnn", "--plan", str(plans["hybrid"]), "--out",
                 str(tmp_path))
    assert cmd_train(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == (f"trained 5 steps on 2 rank(s) (cpu, cpu_2; batches [48, 16]): "
                         f"{expected}; {tmp_path}")


ROOT_CAUSE = r'''
import sys
print("boom on rank 1", flush=True)
print("""torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
qsync_opt.job.rank FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2025-01-01_00:00:00
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : 3 (pid: 1234)
  error_file: <N/A>
============================================================""", file=sys.stderr)
sys.exit(1)
'''


def test_a_failed_rank_is_named(plans, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(launch, "local_command", _fake_torchrun(ROOT_CAUSE))
    args = _args("--model", "digits_cnn", "--plan", str(plans["hybrid"]), "--out",
                 str(tmp_path))
    assert cmd_train(args) == 1
    cap = capsys.readouterr()
    assert "boom on rank 1" in cap.out
    assert "rank 1 (cpu_2) failed first (exit code 3)" in cap.err
    monkeypatch.setattr(launch, "local_command", _fake_torchrun("raise SystemExit(5)"))
    assert cmd_train(args) == 1
    assert "exited with code 5" in capsys.readouterr().err


def test_emulate_dp_runs_in_process(plans, tmp_path, monkeypatch) -> None:
    import qsync_opt.cli.train as cli_train

    seen = []
    monkeypatch.setattr(cli_train, "emulate", lambda config: seen.append(config))
    monkeypatch.setattr(launch, "run_streaming", lambda *a: pytest.fail("must not launch"))
    args = _args("--model", "digits_cnn", "--plan", str(plans["hybrid"]), "--out",
                 str(tmp_path), "--emulate-dp")
    assert cmd_train(args) == 0
    assert len(seen) == 1 and seen[0].emulate_dp and seen[0].rank_groups == ["cpu", "cpu_2"]


@pytest.mark.parametrize(("every", "steps", "noted"), [
    (0, 5, False), (1, 5, False), (4, 5, False), (5, 5, True), (6, 5, True),
    (10**9, 5, True), (1, 1, True)])
def test_a_checkpoint_interval_not_below_steps_is_said(plans, tmp_path, capsys, every, steps,
                                                       noted) -> None:
    """Every run writes a checkpoint at its end, so an interval of --steps or more is
    accepted and the launcher says that the end's checkpoint is the only one."""
    args = _args("--model", "digits_cnn", "--plan", str(plans["hybrid"]), "--nproc", "2",
                 "--steps", str(steps), "--checkpoint-every", str(every),
                 "--out", str(tmp_path / "run"), "--dry-run")
    assert cmd_train(args) == 0
    text = capsys.readouterr().out
    line = [ln for ln in text.splitlines() if ln.startswith("--checkpoint-every")]
    if noted:
        assert line == [f"--checkpoint-every {every} is not below --steps {steps}: the run's "
                        f"one checkpoint is the one every run writes at its end "
                        f"(step {steps})"]
    else:
        assert line == []


def test_train_help_says_the_end_checkpoint() -> None:
    sub = _parser()._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    assert "every run also writes one at its end" in " ".join(sub.format_help().split())


def test_an_interval_beyond_steps_still_checkpoints_the_end(plans, tmp_path, capsys) -> None:
    """The run itself: no checkpoint inside it, the end's one written."""
    from qsync_opt.cli import main
    from qsync_opt.runtime.checkpoint import latest_checkpoint, load_checkpoint

    out = tmp_path / "run"
    rc = main(["train", "--model", "digits_cnn", "--plan", str(plans["hybrid"]),
               "--nproc", "2", "--emulate-dp", "--steps", "2", "--checkpoint-every", "7",
               "--out", str(out)])
    assert rc == 0
    assert "--checkpoint-every 7 is not below --steps 2" in capsys.readouterr().out
    latest = latest_checkpoint(out)
    assert latest is not None
    assert load_checkpoint(latest)["step"] == 2


# ----------------------------------------------------------------------------- typed request


def test_the_launcher_takes_plain_values_not_argparse(plans, tmp_path) -> None:
    """The command line turns its flags into a frozen TrainRequest; the launcher builds the
    same config from one made by hand (no argparse in between), and cannot change it."""
    request = launch.TrainRequest(model="digits_cnn", plan=str(plans["hybrid"]),
                                  out=str(tmp_path / "run"), steps=3)
    config = launch.build_config(request)
    assert config.lr == launch.DEFAULT_LR and config.rank_groups == ["cpu", "cpu_2"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.lr = 1.0  # type: ignore[misc]
    assert train_request(_args("--model", "digits_cnn", "--plan", str(plans["hybrid"]),
                               "--out", str(tmp_path / "run"), "--steps", "3")) == request


@pytest.mark.parametrize("field,value,flag", [
    ("cuts", "conv2", "--cuts"), ("micro_batches", 2, "--micro-batches"),
    ("compress_act", "topk:0.1", "--compress-act"), ("compress_grad", "quant:8", "--compress-grad"),
    ("feedback", "ef", "--feedback"), ("compress_at_eval", True, "--compress-at-eval")])
def test_every_pipeline_flag_without_stages_is_refused_by_name(field, value, flag) -> None:
    request = launch.TrainRequest(model="digits_cnn",
                                  pipeline=PipelineRequest(**{field: value}))
    with pytest.raises(QsyncInputError, match=f"^{flag}: only with --pipeline-stages N"):
        launch.resolve_defaults(request)


@pytest.mark.parametrize("stages", [0, 1, 65, -3])
def test_a_stage_count_out_of_range_is_refused(stages) -> None:
    request = launch.TrainRequest(model="digits_cnn", pipeline=PipelineRequest(stages=stages))
    with pytest.raises(QsyncInputError, match="^--pipeline-stages: expected 2 to 64"):
        launch.resolve_defaults(request)


def test_a_pipeline_defaults_to_one_rank_per_stage() -> None:
    request = launch.TrainRequest(model="digits_cnn", pipeline=PipelineRequest(stages=3))
    resolved = launch.resolve_defaults(request)
    assert resolved.nproc == 3 and resolved.lr == launch.DEFAULT_LR and request.nproc is None
