"""Where fp16's loss scale starts, the run's loud warnings and train's default lr.

A model whose fp16 gradients overflow at 2**16 used to skip every step of a short run (the
scale halved once a step) while the run exited 0; now a fresh run probes its first batch at
2**16, 2**12, ..., 1 and starts at the first finite scale, so step 0 trains; a run that
still skips most steps, or whose loss explodes, says so first on its summary line.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest

from qsync_opt.costs.cluster import parse_shorthand
from qsync_opt.documents.io import save
from qsync_opt.graph import trace
from qsync_opt.job.rank import emulate
from qsync_opt.problem.plan import make_plan
from qsync_opt.runtime.config import DEFAULT_LR, USER_MODEL_LR, TrainConfig
from qsync_opt.runtime.metrics import run_warnings
from qsync_opt.runtime.scaler import PROBE_SCALES, probe_scale
from support.harness import run_cli

# fc1 and fc2 run at fp16 on the t4; the logits are multiplied by 30, so at a loss scale of
# 2**16 the output gradient reaching fc2 overflows fp16 (the probe finds 2**12 finite) while
# the model still trains at the model-file default lr.
OVERFLOW = """
import torch
from torch import nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)
    def forward(self, x):
        return self.out(torch.relu(self.fc2(torch.relu(self.fc1(x))))) * 30.0
def build():
    torch.manual_seed(0)
    return Net(), (torch.randn(8, 6),)
"""


@pytest.fixture()
def overflow_plan(tmp_path: Path) -> tuple[str, Path]:
    src = tmp_path / "src" / "overflow.py"
    src.parent.mkdir()
    src.write_text(textwrap.dedent(OVERFLOW))
    spec = f"{src}:build"
    graph = trace(spec)
    plan = make_plan(graph, parse_shorthand("a100x1+t4x1"),
                     {"t4": {"fc1": "fp16", "fc2": "fp16"}})
    return spec, save(plan, tmp_path / "plan.json")


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.rank0.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- the rule


def test_probe_takes_the_first_finite_scale_and_the_last_when_none() -> None:
    assert PROBE_SCALES == (2.0 ** 16, 2.0 ** 12, 2.0 ** 8, 2.0 ** 4, 1.0)
    assert probe_scale(lambda s: True) == (2.0 ** 16, [2.0 ** 16])
    assert probe_scale(lambda s: s <= 300) == (2.0 ** 8, [2.0 ** 16, 2.0 ** 12, 2.0 ** 8])
    assert probe_scale(lambda s: False) == (1.0, list(PROBE_SCALES))
    assert probe_scale(lambda s: math.isnan(s)) == (1.0, list(PROBE_SCALES))


def test_a_model_overflowing_at_2_pow_16_trains_from_step_0(overflow_plan, tmp_path) -> None:
    spec, plan = overflow_plan
    code, out, err = run_cli("train", "--model", spec, "--plan", str(plan), "--emulate-dp",
                             "--steps", "3", "--out", str(tmp_path / "run"))
    assert code == 0, err
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["skipped_steps"] == 0 and s["warnings"] == []
    assert s["scale_probe"]["tried"][0] == 2.0 ** 16
    assert s["scale_probe"]["scale"] < 2.0 ** 16  # it did overflow there
    rows = _rows(tmp_path / "run")
    assert [r["skipped"] for r in rows] == [False, False, False]
    assert rows[0]["loss_scale"] == s["scale_probe"]["scale"]
    assert not out.startswith("WARNING") and "WARNING" not in err


def test_the_same_model_at_a_fixed_huge_scale_skips_and_says_so_first(overflow_plan,
                                                                     tmp_path) -> None:
    """The config's loss_scale turns the probe off: from 2**24 every step of three skips
    (2**24, 2**23, 2**22 all overflow), the run still exits normally, the summary warns."""
    spec, plan = overflow_plan
    from qsync_opt.graph import load_user_workload

    wl = load_user_workload(spec)
    cfg = TrainConfig(workload=wl.name, plan_path=str(plan), rank_groups=["a100", "t4"],
                      steps=3, out_dir=str(tmp_path / "fixed"), emulate_dp=True,
                      eval_batches=1, loss_scale=2.0 ** 24, max_bad_steps=10)
    s = emulate(cfg)
    assert s["skipped_steps"] == 3 and "scale_probe" not in s
    assert s["warnings"][0].startswith("3 of 3 steps were skipped")
    assert len(s["warnings"]) == 1  # no step ran: nothing to call exploded


def test_the_cli_puts_warnings_first_on_the_summary_line(tmp_path, capsys) -> None:
    from qsync_opt.cli.train import _print_summary

    out = tmp_path / "run"
    out.mkdir()
    doc = {"steps": 3, "world_size": 2, "batches": [8, 8], "final_loss": 1.0,
           "eval_loss": 2.0, "skipped_steps": 3,
           "warnings": ["3 of 3 steps were skipped (x)", "the loss exploded (y)"]}
    (out / "summary.json").write_text(json.dumps(doc))
    cfg = TrainConfig(workload="digits_cnn", plan_path="p.json", rank_groups=["a", "b"],
                      steps=3, out_dir=str(out), emulate_dp=True)
    _print_summary(cfg)
    o, e = capsys.readouterr()
    assert o.startswith("WARNING: 3 of 3 steps were skipped (x). WARNING: the loss exploded "
                        "(y). trained 3 steps on 2 rank(s)")
    assert e.count("qsync-opt: train: WARNING: ") == 2
    doc["warnings"] = []
    (out / "summary.json").write_text(json.dumps(doc))
    _print_summary(cfg)
    o, e = capsys.readouterr()
    assert o.startswith("trained 3 steps") and e == ""


# ----------------------------------------------------------------------------- warnings


@pytest.mark.parametrize("steps, skipped, warned", [
    (3, 3, True), (3, 2, True), (4, 2, False), (5, 3, True), (1, 1, True), (1, 0, False),
    (0, 0, False), (100, 50, False), (100, 51, True)])
def test_most_steps_skipped_warns(steps: int, skipped: int, warned: bool) -> None:
    w = run_warnings(steps, skipped, 2.0, 2.0, 2.0)
    assert any("steps were skipped" in x for x in w) == warned


@pytest.mark.parametrize("first, final, ev, warned", [
    (6.9, 24295.0, 24295.0, True),          # ResNet-50 at lr 0.05: the loss grew
    (6.9, 3.0, 24295.0, True),              # the held-out loss alone
    (6.9, 6.0, None, False),                # no held-out batches
    (6.9, float("nan"), None, True),        # not finite
    (6.9, 6.9, float("inf"), True),
    (0.01, 0.2, 0.2, False),                # 20x, but well under a nat
    (0.5, 4.0, 4.0, False),                 # 8x
    (0.5, 5.6, 5.6, True),                  # 11x and 5 nats up
    (float("nan"), 1e9, 1e9, False),        # no finite first loss to compare with
    (None, 1e9, 1e9, False),                # no step ran in this process
])
def test_an_exploded_loss_warns(first, final, ev, warned) -> None:
    w = run_warnings(10, 0, first, final, ev)
    assert any("exploded" in x for x in w) == warned, w


# ----------------------------------------------------------------------------- default lr


def test_train_lr_defaults_per_kind_of_model(overflow_plan, tmp_path) -> None:
    spec, plan = overflow_plan
    assert (DEFAULT_LR, USER_MODEL_LR) == (0.05, 0.005)
    code, out, err = run_cli("train", "--model", spec, "--plan", str(plan), "--steps", "1",
                             "--out", str(tmp_path / "dry"), "--dry-run")
    assert code == 0, err
    assert f"no --lr: {USER_MODEL_LR}" in out
    cfg = json.loads((tmp_path / "dry" / "train_config.json").read_text())
    assert cfg["lr"] == USER_MODEL_LR
    code, out, err = run_cli("train", "--model", spec, "--plan", str(plan), "--steps", "1",
                             "--lr", "0.2", "--out", str(tmp_path / "given"), "--dry-run")
    assert code == 0, err
    assert json.loads((tmp_path / "given" / "train_config.json").read_text())["lr"] == 0.2
    assert "no --lr" not in out
    assert TrainConfig(workload="digits_cnn", plan_path="p", rank_groups=["a"], steps=1,
                       out_dir=str(tmp_path)).lr == DEFAULT_LR
