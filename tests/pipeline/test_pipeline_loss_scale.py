"""The pipeline's fp16 loss-scale start and run warnings: the data-parallel rule
(tests/runtime/test_loss_scale_start.py) on ``train --pipeline-stages``, in one process and in one
process per stage (qsync_opt.pipeline.scale)."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from qsync_opt import models
from qsync_opt.costs.cluster import parse_shorthand
from qsync_opt.graph import trace
from qsync_opt.problem.plan import make_plan
from qsync_opt.runtime.scaler import PROBE_SCALES
from support.harness import run_cli

ROOT = Path(__file__).resolve().parents[2]

# digits_cnn with fc2's weights and bias times K: the gradient reaching the t4's fp16 fc1
# grows K-fold. K=30 overflows fp16 at a loss scale of 2**16 (the probe finds 2**12 finite)
# and trains at lr 0.001; K=1e7 overflows at every scale down to 1.
PATCH = """
import dataclasses, torch
from qsync_opt import models
_wl = models.WORKLOADS["digits_cnn"]
def _build(_real=_wl.build, _k={k}):
    m = _real()
    with torch.no_grad():
        m.fc2.weight.mul_(_k)
        m.fc2.bias.mul_(_k)
    return m
models.WORKLOADS["digits_cnn"] = dataclasses.replace(_wl, build=_build)
"""


#: one torch thread, as the ranks run (conftest)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _scaled(monkeypatch: pytest.MonkeyPatch, k: float) -> None:
    wl = models.WORKLOADS["digits_cnn"]

    def build():
        m = wl.build()
        with torch.no_grad():
            m.fc2.weight.mul_(k)
            m.fc2.bias.mul_(k)
        return m

    monkeypatch.setitem(models.WORKLOADS, "digits_cnn", dataclasses.replace(wl, build=build))


@pytest.fixture(scope="module")
def fp16_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """digits_cnn on v100 + t4, the t4's conv2 and fc1 at fp16 (its stage: conv2 onwards)."""
    plan = make_plan(trace("digits_cnn", 64), parse_shorthand("v100x1+t4x1"),
                     {"t4": {"conv2": "fp16", "fc1": "fp16"}})
    path = tmp_path_factory.mktemp("plan") / "fp16.plan.json"
    plan.save(path)
    return path


def _pipe_args(plan: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", "digits_cnn", "--plan", str(plan), "--pipeline-stages", "2",
            "--cuts", "conv2", "--out", str(out), *extra]


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.rank0.jsonl").read_text().splitlines()]


def _states(out: Path, ranks: int) -> list[dict]:
    return [torch.load(sorted(glob.glob(str(out / "ckpt" / "step-*" / f"rank{r}.pt")))[-1],
                       weights_only=True) for r in range(ranks)]


def _same_states(a: Path, b: Path) -> None:
    for x, y in zip(_states(a, 2), _states(b, 2), strict=True):
        for k in x["model"]:
            assert torch.equal(x["model"][k], y["model"][k]), k


def _probed(fp16_plan: Path, out: Path, *extra: str) -> tuple[int, str, str]:
    """The one-process pipeline at K=30 (the caller scales the model): 3 steps at lr 0.001,
    its loss scale probed; (exit code, stdout, stderr)."""
    return run_cli(*_pipe_args(fp16_plan, out, "--steps", "3", "--lr", "0.001",
                               "--emulate-dp", *extra))


@pytest.fixture(scope="module")
def probed_one_process(fp16_plan: Path, tmp_path_factory: pytest.TempPathFactory
                       ) -> tuple[Path, int, str, str]:
    """:func:`_probed` without extra flags, run once for the module: (its --out, exit code,
    stdout, stderr). The one-process run the probe tests check and the ranks must equal."""
    out = tmp_path_factory.mktemp("probed") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run
    try:
        with pytest.MonkeyPatch.context() as mp:
            _scaled(mp, 30.0)
            code, o, err = _probed(fp16_plan, out)
    finally:
        torch.set_num_threads(threads)
    return out, code, o, err


@pytest.mark.parametrize("extra", [[], ["--micro-batches", "2", "--compress-act", "topk:0.3",
                                        "--feedback", "aqsgd"]])
@pytest.mark.slow
def test_a_pipeline_overflowing_at_2_pow_16_trains_from_step_0(tmp_path, fp16_plan, monkeypatch,
                                                               request, extra) -> None:
    """One process: the probe overflows at 2**16, starts at 2**12, every step trains, no
    warning; it leaves no trace (feedback buffers, byte counters, seeds included): the run
    equals one started at 2**12 with no probe, bit for bit. Without extra flags the run is
    the module's (the one the ranks are compared with)."""
    if extra:
        _scaled(monkeypatch, 30.0)
        out = tmp_path / "run"
        code, o, err = _probed(fp16_plan, out, *extra)
    else:  # the fixture scales the model itself: take it before scaling here
        out, code, o, err = request.getfixturevalue("probed_one_process")
        _scaled(monkeypatch, 30.0)  # for the run at a fixed start below
    assert code == 0, err
    s = json.loads((out / "summary.json").read_text())
    assert s["scale_probe"] == {"tried": [2.0 ** 16, 2.0 ** 12], "scale": 2.0 ** 12}
    assert s["skipped_steps"] == 0 and s["warnings"] == [], s
    assert [r["skipped"] for r in _rows(out)] == [False, False, False]
    assert _rows(out)[0]["loss_scale"] == 2.0 ** 12
    assert s["first_loss"] == _rows(out)[0]["loss"]
    assert not o.startswith("WARNING") and "WARNING" not in err
    # the same run at a fixed start of 2**12: no probe, the same bytes and states
    from qsync_opt.job.rank import emulate
    from qsync_opt.runtime.config import TrainConfig

    doc = json.loads((out / "train_config.json").read_text())
    fixed = TrainConfig.model_validate({**doc, "loss_scale": 2.0 ** 12,
                                        "out_dir": str(tmp_path / "fixed")})
    f = emulate(fixed)
    assert "scale_probe" not in f and f["final_loss"] == s["final_loss"]
    assert f["boundaries"] == s["boundaries"]
    _same_states(out, tmp_path / "fixed")


@pytest.mark.slow
def test_a_pipeline_skipping_most_steps_says_so_first(tmp_path, fp16_plan, monkeypatch,
                                                     capsys) -> None:
    """Overflowing at every scale: the probe tries them all and starts at 1, every step is
    skipped, and the warning is in the summary and first on its line."""
    _scaled(monkeypatch, 1e7)
    out = tmp_path / "run"
    code, o, err = run_cli(*_pipe_args(fp16_plan, out, "--steps", "3", "--emulate-dp"))
    assert code == 0, err
    s = json.loads((out / "summary.json").read_text())
    assert s["scale_probe"] == {"tried": list(PROBE_SCALES), "scale": 1.0}
    assert s["skipped_steps"] == 3 and s["loss_scale"] == 1.0
    assert len(s["warnings"]) == 1 and s["warnings"][0].startswith("3 of 3 steps were skipped")
    line = next(x for x in o.splitlines() if "trained 3 steps" in x)  # the summary line
    assert line.startswith("WARNING: 3 of 3 steps were skipped"), o
    assert "qsync-opt: train: WARNING: 3 of 3 steps" in err


@pytest.mark.slow
def test_a_resumed_or_fp32_or_fixed_scale_pipeline_does_not_probe(tmp_path, fp16_plan,
                                                                  monkeypatch) -> None:
    _scaled(monkeypatch, 30.0)
    out = tmp_path / "run"
    assert run_cli(*_pipe_args(fp16_plan, out, "--steps", "2", "--lr", "0.001",
                               "--emulate-dp"))[0] == 0
    code, _, err = run_cli(*_pipe_args(fp16_plan, out, "--steps", "3", "--lr", "0.001",
                                       "--emulate-dp"))
    assert code == 0, err
    s = json.loads((out / "summary.json").read_text())
    assert s["resumed_from_step"] == 2 and "scale_probe" not in s  # the checkpoint's scale
    assert s["loss_scale"] == 2.0 ** 12 and s["warnings"] == []
    code, _, err = run_cli("train", "--model", "digits_cnn", "--pipeline-stages", "2",
                           "--steps", "1", "--emulate-dp", "--out", str(tmp_path / "fp32"))
    assert code == 0, err
    s = json.loads((tmp_path / "fp32" / "summary.json").read_text())
    assert "scale_probe" not in s and s["loss_scale"] == 1.0


@pytest.mark.slow
def test_the_ranks_agree_on_the_scale_and_equal_one_process(tmp_path, fp16_plan,
                                                           probed_one_process) -> None:
    """One process per stage (torchrun): each stage checks its own gradients, the count is
    all-reduced, both ranks start at 2**12, and the run equals the one-process pipeline (the
    module's, same plan and flags but --emulate-dp)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(PATCH.format(k=30.0)))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "ranks"
    argv = _pipe_args(fp16_plan, out, "--steps", "3", "--lr", "0.001")
    r = subprocess.run([sys.executable, "-m", "qsync_opt.cli", *argv], env=env,
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    one, code, _, err = probed_one_process
    assert code == 0, err
    outs = {how: json.loads((path / "summary.json").read_text())
            for how, path in (("ranks", out), ("one", one))}
    for s in outs.values():
        assert s["scale_probe"] == {"tried": [2.0 ** 16, 2.0 ** 12], "scale": 2.0 ** 12}
        assert s["skipped_steps"] == 0 and s["warnings"] == []
    for r in range(2):
        rows = [json.loads(x) for x in
                (tmp_path / "ranks" / f"metrics.rank{r}.jsonl").read_text().splitlines()]
        assert [x["loss_scale"] for x in rows] == [2.0 ** 12] * 3
    assert abs(outs["one"]["final_loss"] - outs["ranks"]["final_loss"]) <= 1e-6
