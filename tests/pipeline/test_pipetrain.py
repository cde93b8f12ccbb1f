"""``qsync-opt train --pipeline-stages N``: one rank per stage, each stage at its rank group's
plan, compressed boundaries, checkpoints and resume (qsync_opt.pipeline.run)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qsync_opt.cli import main
from qsync_opt.costs.cluster import parse_shorthand
from qsync_opt.graph import trace
from qsync_opt.problem.plan import make_plan

ROOT = Path(__file__).resolve().parents[2]


#: one torch thread, as the ranks run (conftest)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def mixed_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """digits_cnn on v100 + t4, the t4's stage at int8 and fp16, the v100's conv2 at fp16."""
    g = trace("digits_cnn", 64)
    plan = make_plan(g, parse_shorthand("v100x1+t4x1"),
                     {"v100": {"conv2": "fp16"}, "t4": {"conv2": "int8", "fc1": "fp16"}},
                     provenance={"solver": "test"})
    path = tmp_path_factory.mktemp("plan") / "mixed.plan.json"
    plan.save(path)
    return path


def _train(out: Path, *extra: str, emulate: bool = True) -> dict:
    argv = ["train", "--model", "digits_cnn", "--out", str(out), *extra]
    if emulate:
        assert main([*argv, "--emulate-dp"]) == 0
    else:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        r = subprocess.run([sys.executable, "-m", "qsync_opt.cli", *argv], env=env,
                           capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads((out / "summary.json").read_text())


def _states(out: Path, ranks: int) -> list[dict]:
    docs = []
    for r in range(ranks):
        f = sorted(glob.glob(str(out / "ckpt" / "step-*" / f"rank{r}.pt")))[-1]
        docs.append(torch.load(f, weights_only=True))
    return docs


def _max_diff(a: list[dict], b: list[dict]) -> float:
    return max(float((x["model"][k].double() - y["model"][k].double()).abs().max())
               for x, y in zip(a, b, strict=True) for k in x["model"])


def _bytes_match(summary: dict) -> None:
    assert summary["boundaries"]
    for b in summary["boundaries"]:
        assert b["act_bytes"] == b["act_bytes_predicted"] > 0, b
        assert b["grad_bytes"] == b["grad_bytes_predicted"] > 0, b


def test_each_stage_runs_its_groups_plan(tmp_path, mixed_plan, monkeypatch):
    s = _train(tmp_path / "a", "--plan", str(mixed_plan), "--pipeline-stages", "2",
               "--cuts", "conv2", "--steps", "3", "--compress-act", "quant:8")
    assert s["mode"] == "pipeline" and s["rank_groups"] == ["v100", "t4"]
    stage0, stage1 = s["stages"]
    assert stage0["group"] == "v100" and stage0["precisions"] == {"fp32": 1}  # conv1 only
    assert stage1["group"] == "t4" and stage1["precisions"] == {"int8": 1, "fp16": 1}
    _bytes_match(s)
    assert s["eval_loss"] is not None and s["eval_loss_compressed"] is not None


@pytest.mark.slow
def test_ranks_equal_the_one_process_pipeline_and_resume(tmp_path, mixed_plan, monkeypatch):
    """One gloo rank per stage (int8 and fp16 on the t4's stage, EF21 on TopK) equals the
    same pipeline in one process; killed after a checkpoint and resumed, it reproduces it."""
    flags = ["--plan", str(mixed_plan), "--pipeline-stages", "2", "--cuts", "conv2",
             "--micro-batches", "2", "--compress-act", "topk:0.1", "--compress-grad",
             "quant:4", "--feedback", "ef21"]
    one = _train(tmp_path / "one", *flags, "--steps", "6")
    ranks = _train(tmp_path / "ranks", *flags, "--steps", "6", emulate=False)
    assert _max_diff(_states(tmp_path / "one", 2), _states(tmp_path / "ranks", 2)) <= 1e-6
    assert abs(one["final_loss"] - ranks["final_loss"]) <= 1e-6
    _bytes_match(ranks)
    assert [b["act_bytes"] for b in one["boundaries"]] == \
        [b["act_bytes"] for b in ranks["boundaries"]]
    # stopped at step 3 (its checkpoint), then resumed to 6 in new processes
    _train(tmp_path / "res", *flags, "--steps", "3", emulate=False)
    resumed = _train(tmp_path / "res", *flags, "--steps", "6", emulate=False)
    assert resumed["resumed_from_step"] == 3
    assert _max_diff(_states(tmp_path / "ranks", 2), _states(tmp_path / "res", 2)) == 0.0
    assert resumed["final_loss"] == ranks["final_loss"]
    _bytes_match(resumed)  # the byte counters travel in the checkpoint


@pytest.mark.parametrize("feedback,act", [("ef", "topk:0.05"), ("aqsgd", "quant:2")])
def test_resume_reproduces_the_run(tmp_path, monkeypatch, feedback, act):
    """Under EF and AQ-SGD the codec state is in the checkpoint: stop, resume, same run."""
    flags = ["--pipeline-stages", "3", "--micro-batches", "2", "--compress-act", act,
             "--feedback", feedback, "--batch", "32"]
    full = _train(tmp_path / "full", *flags, "--steps", "6")
    _train(tmp_path / "part", *flags, "--steps", "2")
    again = _train(tmp_path / "part", *flags, "--steps", "6")
    assert again["resumed_from_step"] == 2
    assert _max_diff(_states(tmp_path / "full", 3), _states(tmp_path / "part", 3)) == 0.0
    assert again["final_loss"] == full["final_loss"]
    _bytes_match(again)
    rows = [json.loads(x) for x in (tmp_path / "part" / "metrics.rank0.jsonl").read_text()
            .splitlines()]
    assert [r["step"] for r in rows] == list(range(6))
    if feedback == "aqsgd":  # first visits whole, later the quantized change: fewer bytes
        assert again["aqsgd_buffers"].startswith("AQ-SGD buffers:")


def test_heterogeneous_balance_gives_the_slower_stage_less(tmp_path):
    from qsync_opt.models import get_workload

    from qsync_opt.pipeline.stages import split_stages, stage_costs

    torch.manual_seed(0)
    wl = get_workload("tiny_gpt")
    model = wl.build()
    x = wl.make_inputs(2, torch.device("cpu"))
    even = split_stages(model, n_stages=2, example_inputs=x)
    from qsync_opt.pipeline.cuts import _default_costs

    c = _default_costs(model, x)
    slow = {k: 3 * v for k, v in c.items()}
    uneven = split_stages(model, n_stages=2, costs=[slow, c])
    assert uneven.cuts != even.cuts
    s0 = stage_costs(uneven, slow)[0]
    s1 = stage_costs(uneven, c)[1]
    assert max(s0, s1) == pytest.approx(max(uneven.costs))
    # no cut at any other candidate point is better
    e0 = stage_costs(even, slow)[0]
    e1 = stage_costs(even, c)[1]
    assert max(s0, s1) <= max(e0, e1) + 1e-9


@pytest.mark.parametrize("argv,needle", [
    (["--cuts", "conv2"], "--cuts: only with --pipeline-stages"),
    (["--compress-act", "quant:4"], "--compress-act: only with --pipeline-stages"),
    (["--pipeline-stages", "3", "--cuts", "conv2"], "--cuts: 3 stages need 2 cuts"),
    (["--pipeline-stages", "2", "--cuts", "nosuchop"], "nosuchop"),
    (["--pipeline-stages", "2", "--compress-act", "topk:7"], "--compress-act"),
    (["--pipeline-stages", "2", "--compress-grad", "quant:99"], "--compress-grad"),
    (["--pipeline-stages", "1"], "--pipeline-stages: expected an integer from 2 to 64"),
    (["--pipeline-stages", "2", "--micro-batches", "100", "--batch", "8"], "--micro-batches"),
    (["--pipeline-stages", "2", "--sync", "local:4"], "--sync and --comm"),
])
def test_bad_pipeline_flags_are_one_line(tmp_path, capsys, argv, needle):
    try:
        rc = main(["train", "--model", "digits_cnn", "--out", str(tmp_path / "o"), "--dry-run",
                   *argv])
    except SystemExit as exc:  # refused when parsed, by the flag's type
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert needle in err and err.count("\n") == 1, err


def test_aqsgd_needs_indexed_samples(tmp_path, capsys):
    rc = main(["train", "--model", "resnet18", "--batch", "2", "--pipeline-stages", "2",
               "--feedback", "aqsgd", "--out", str(tmp_path / "o"), "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and "--feedback aqsgd" in err and err.count("\n") == 1, err


def test_plan_devices_and_stages_must_agree(tmp_path, mixed_plan, capsys):
    rc = main(["train", "--model", "digits_cnn", "--plan", str(mixed_plan),
               "--pipeline-stages", "3", "--out", str(tmp_path / "o"), "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and "--rank-groups (e.g. 0:v100,1:t4,2:t4)" in err, err
    # the same without a plan: the stages against --cluster, no --nproc the user never gave
    rc = main(["train", "--model", "digits_cnn", "--cluster", "v100x1+t4x1",
               "--pipeline-stages", "3", "--out", str(tmp_path / "c"), "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--nproc" not in err, err
    assert "--cluster has 2 devices" in err and "0:v100,1:t4,2:t4" in err, err
    rc = main(["train", "--model", "digits_cnn", "--plan", str(mixed_plan),
               "--pipeline-stages", "3", "--rank-groups", "0:v100,1:t4,2:t4",
               "--out", str(tmp_path / "o"), "--dry-run"])
    assert rc == 0, capsys.readouterr().err
    cfg = json.loads((tmp_path / "o" / "train_config.json").read_text())
    assert cfg["pipeline"]["stages"] == 3 and len(cfg["pipeline"]["cuts"]) == 2


def test_resume_under_another_pipeline_is_refused(tmp_path, capsys, monkeypatch):
    _train(tmp_path / "o", "--pipeline-stages", "2", "--steps", "1", "--batch", "16")
    before = (tmp_path / "o" / "train_config.json").read_text()
    rc = main(["train", "--model", "digits_cnn", "--out", str(tmp_path / "o"),
               "--pipeline-stages", "2", "--steps", "2", "--batch", "16",
               "--compress-act", "topk:0.1", "--emulate-dp"])
    err = capsys.readouterr().err
    assert rc == 2 and "pipeline" in err and "--no-resume" in err, err
    assert (tmp_path / "o" / "train_config.json").read_text() == before


# ----------------------------------------------------------------------------- replay


def _replay(capsys, *argv: str) -> dict:
    assert main(["replay", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_replay_predicts_the_compressed_pipeline(capsys):
    from qsync_opt.costs.roofline import estimate
    from qsync_opt.strategy.codecs import parse_compressor

    base = ["--model", "tiny_gpt", "--batch", "16", "--cluster", "t4x2",
            "--pipeline-stages", "2", "--micro-batches", "4", "--link-gbps", "1,10"]
    plain = _replay(capsys, *base)
    comp = _replay(capsys, *base, "--compress-act", "quant:4", "--compress-grad", "topk:0.1")
    assert plain["cuts"] == comp["cuts"] and plain["micro_batch"] == 4
    for s in plain["steps"]:  # identity: the same both ways
        assert s["compressed_ms"] == pytest.approx(s["uncompressed_ms"])
    slow, fast = comp["steps"]
    assert slow["compressed_ms"] < slow["uncompressed_ms"]
    assert slow["uncompressed_ms"] > fast["uncompressed_ms"]  # the link matters
    (b,) = comp["boundaries"]
    n = 4 * 128 * 128
    assert b["shape"] == [4, 128, 128] and b["raw_bytes"] == 4 * n
    assert b["act_bytes"] == parse_compressor("quant:4").wire_bytes(n, 4)
    assert b["grad_bytes"] == parse_compressor("topk:0.1").wire_bytes(n, 4)
    # the stages' compute is the model's ops at the micro-batch (the loss is not charged)
    table = estimate(trace("tiny_gpt", 4), parse_shorthand("t4x1"))
    total = sum(e.fwd_ms for e in table.entries if e.precision.value == "fp32"
                and not e.op.startswith("loss"))
    assert sum(s["fwd_ms"] for s in comp["stages"]) == pytest.approx(total, rel=1e-6)


def test_replay_pipeline_follows_the_plan(capsys, mixed_plan):
    fp32 = _replay(capsys, "--model", "digits_cnn", "--cluster", "v100x1+t4x1",
                   "--pipeline-stages", "2", "--cuts", "conv2")
    low = _replay(capsys, "--model", "digits_cnn", "--plan", str(mixed_plan),
                  "--pipeline-stages", "2", "--cuts", "conv2")
    assert [s["device"] for s in low["stages"]] == ["v100", "t4"]
    # the t4's stage at int8 / fp16 is faster than at fp32; the v100's (conv1 only) equal
    assert low["stages"][1]["fwd_ms"] < fp32["stages"][1]["fwd_ms"]
    assert low["stages"][0]["fwd_ms"] == pytest.approx(fp32["stages"][0]["fwd_ms"])


@pytest.mark.parametrize("argv,needle", [
    (["--cluster", "t4x2", "--cuts", "conv2"], "--cuts: only with --pipeline-stages"),
    (["--cluster", "t4x2", "--pipeline-stages", "2", "--link-gbps", "0"], "--link-gbps"),
    (["--cluster", "t4x2", "--pipeline-stages", "3"], "--rank-groups"),
    (["--cluster", "t4x2", "--pipeline-stages", "2", "--compress-act", "bogus"], "compressor"),
])
def test_replay_pipeline_bad_input(capsys, argv, needle):
    try:
        rc = main(["replay", "--model", "digits_cnn", *argv])
    except SystemExit as exc:  # refused when parsed, by the flag's type
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.count("\n") == 1, err


# ----------------------------------- stages without parameters, the summary, bad cuts


@pytest.mark.parametrize("flags", [["--pipeline-stages", "4"], ["--pipeline-stages", "8"],
                                   ["--pipeline-stages", "3", "--cuts", "relu1,conv2"],
                                   ["--pipeline-stages", "5", "--cuts",
                                    "relu1,conv2,maxpool,flatten"]])
def test_stages_without_parameters_train_and_resume(tmp_path, capsys, flags):
    """4 or more stages of digits_cnn, balanced or given, make stages with no parameters
    (relu1, maxpool, flatten alone): they train (exit 0, a NoOptimizer each), checkpoint
    and resume to the same run."""
    out = tmp_path / "p"
    s = _train(out, *flags, "--batch", "16", "--micro-batches", "2", "--steps", "2")
    n = int(flags[1])
    assert len(s["stages"]) == n
    # 8 stages of 11 ops (6 with parameters), and the cuts given, leave some stage bare
    assert any(st["params"] == 0 for st in s["stages"]) == (n >= 8 or "--cuts" in flags)
    assert s["final_loss"] is not None and s["skipped_steps"] == 0
    again = _train(out, *flags, "--batch", "16", "--micro-batches", "2", "--steps", "3")
    assert again["resumed_from_step"] == 2
    full = _train(tmp_path / "f", *flags, "--batch", "16", "--micro-batches", "2",
                  "--steps", "3")
    assert _max_diff(_states(out, n), _states(tmp_path / "f", n)) == 0.0
    assert again["final_loss"] == full["final_loss"]
    assert "Traceback" not in capsys.readouterr().err


def test_the_pipeline_summary_says_micro_batches_and_the_global_batch(tmp_path, capsys):
    s = _train(tmp_path / "p", "--pipeline-stages", "2", "--batch", "20", "--micro-batches",
               "3", "--steps", "1")
    assert "batches" not in s  # no per-rank data-parallel batches in a pipeline
    assert (s["global_batch"], s["micro_batches"], s["micro_batch_sizes"]) == (20, 3, [7, 7, 6])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("trained"))
    assert "(cpu, cpu as 2 pipeline stages; global batch 20 in 3 micro-batches of 7, 7, 6)" \
        in line, line
    assert "batches [" not in line


@pytest.mark.parametrize(("model", "cuts", "needle"), [
    ("tiny_gpt", "transformer.wpe", "--cuts: stage 1 (from 'transformer.wpe') would receive"),
    ("digits_cnn", "conv1", "--cuts: 'conv1' is the model's first op"),
    ("digits_cnn", "fc1,conv2", "--cuts: expected distinct cuts in forward order"),
])
def test_a_cut_that_cannot_work_is_refused_in_one_line_before_anything_runs(
        tmp_path, capsys, model, cuts, needle):
    n = len(cuts.split(",")) + 1
    rc = main(["train", "--model", model, "--batch", "4", "--pipeline-stages", str(n),
               "--cuts", cuts, "--out", str(tmp_path / "o"), "--emulate-dp", "--steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.count("\n") == 1, err
    assert not (tmp_path / "o" / "train_config.json").exists()


@pytest.mark.slow
def test_parameter_less_stages_under_torchrun_with_progress_lines(tmp_path):
    """A parameter-less stage under torchrun (a rank holding relu1 alone trains), and the progress
    lines a run whose output is a pipe prints (rank 0, through the launcher)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "qsync_opt.cli", "train", "--model",
                        "digits_cnn", "--out", str(tmp_path / "o"), "--pipeline-stages", "3",
                        "--cuts", "relu1,conv2", "--batch", "16", "--steps", "3",
                        "--progress-every", "0.000001"], env=env, capture_output=True,
                       text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    text = r.stdout + r.stderr
    assert "train: step 3/3, loss " in text and " steps/s, " in text, text[-2000:]
    assert "as 3 pipeline stages; global batch 16 in 1 micro-batch of 16" in r.stdout
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert [st["params"] == 0 for st in s["stages"]] == [False, True, False]
