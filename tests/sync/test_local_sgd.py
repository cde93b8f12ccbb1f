"""Local SGD and QSR on the runtime's sync layer, in emulation: H = 1 equals DDP,
replicas agree exactly after every sync, rounds and bytes follow the schedule, and a resume
syncs at the same steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from qsync_opt import parse_shorthand, trace
from qsync_opt.job.rank import emulate
from qsync_opt.problem.plan import make_plan
from qsync_opt.runtime import checkpoint as ck
from qsync_opt.runtime.config import TrainConfig
from qsync_opt.runtime.faults import ENV, NO_FAULTS, FaultPlan
from qsync_opt.strategy.modes import parse_sync, rounds
from support.harness import run_params, run_rows


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """digits_cnn at fp32 on two groups, with equal and with uneven batches."""
    root = tmp_path_factory.mktemp("plans")
    out = {}
    for name, shorthand in (("equal", "cpux1@24+cpux1@24"), ("uneven", "cpux1@36+cpux1@12")):
        path = root / f"{name}.json"
        make_plan(trace("digits_cnn"), parse_shorthand(shorthand), {}).save(path)
        out[name] = path
    return out


pytestmark = pytest.mark.usefixtures("runtime_quiet")


def _config(plan: Path, out: Path, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(workload="digits_cnn", plan_path=str(plan),
                                rank_groups=["cpu", "cpu_2"], steps=6, out_dir=str(out),
                                emulate_dp=True, eval_batches=0, lr=0.05, momentum=0.0)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("split", ["equal", "uneven"])
def test_local_sgd_with_h1_equals_ddp(plans: dict[str, Path], tmp_path: Path, split: str) -> None:
    """Plain SGD, H = 1: averaging the parameters, weighted by the batch shares, after every
    step is DDP's averaging of the gradients (uneven batches included)."""
    emulate(_config(plans[split], tmp_path / "ddp"), faults=NO_FAULTS)
    emulate(_config(plans[split], tmp_path / "local", sync="local:1"), faults=NO_FAULTS)
    a, b = run_params(tmp_path / "ddp", 0), run_params(tmp_path / "local", 0)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=1e-6), k
    # an equal average would not: the weak rank's gradient would weigh a half, not a quarter
    if split == "uneven":
        c = run_params(tmp_path / "local", 1)
        assert all(torch.equal(b[k], c[k]) for k in b)


def test_replicas_agree_after_every_sync_and_differ_between(
        plans: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QSYNC_LOG_STATE_HASH", "1")
    out = tmp_path / "run"
    cfg = _config(plans["uneven"], out, steps=10, sync="local:3", momentum=0.9)
    emulate(cfg, faults=NO_FAULTS)
    r0, r1 = run_rows(out, 0), run_rows(out, 1)
    synced = [r["step"] for r in r0 if r["synced"]]
    assert synced == [2, 5, 8, 9]  # every 3 steps, and the cut last round at the end
    assert [r["sync_round"] for r in r0] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    for a, b in zip(r0, r1, strict=True):
        same = a["state_sha256"] == b["state_sha256"]
        assert same == a["synced"], a["step"]


def test_rounds_and_bytes_follow_the_schedule(plans: dict[str, Path], tmp_path: Path) -> None:
    """Every metrics row's bytes_sent adds up to what the schedule predicts, and
    bytes(QSR) < bytes(constant H_base) < bytes(DDP)."""
    steps, sched = 40, "cosine:warmup=4"
    totals = {}
    for name, sync in (("ddp", "ddp"), ("const", "local:2"),
                       ("qsr", "qsr:alpha=0.08,h_base=2")):
        out = tmp_path / name
        cfg = _config(plans["equal"], out, steps=steps, sync=sync, lr=0.1, lr_schedule=sched)
        emulate(cfg, faults=NO_FAULTS)
        rows = run_rows(out, 0)
        totals[name] = sum(r["bytes_sent"] for r in rows)
        if name != "ddp":
            expect = rounds(parse_sync(sync), cfg.schedule(), steps)
            assert sum(r["synced"] for r in rows) == len(expect)
            assert [r["step"] for r in rows if r["synced"]] == [s + h - 1 for s, h in expect]
            per_sync = {r["bytes_sent"] for r in rows if r["synced"]}
            assert len(per_sync) == 1 and {r["bytes_sent"] for r in rows if not r["synced"]} \
                == {0}
            assert totals[name] == len(expect) * per_sync.pop()
        assert all(r["lr"] == pytest.approx(cfg.schedule().lr_at(r["step"])) for r in rows)
    assert totals["qsr"] < totals["const"] < totals["ddp"]


class _Died(Exception):
    pass


def _die(code: int) -> None:
    raise _Died(code)


@pytest.mark.parametrize("sync", ["local:4", "qsr:alpha=0.1,h_base=2"])
def test_a_run_killed_between_syncs_resumes_bit_for_bit(plans: dict[str, Path], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        sync: str) -> None:
    """Killed at step 8 with the checkpoint of step 6 between two syncs: the resumed run syncs
    at the uninterrupted run's steps, with its replicas, losses and final parameters bit for
    bit (every replica's differing parameters are in its own rank file)."""
    monkeypatch.setenv("QSYNC_LOG_STATE_HASH", "1")
    kw: dict[str, Any] = dict(steps=14, sync=sync, momentum=0.9, checkpoint_every=3,
                              lr_schedule="cosine:warmup=2")
    whole, part = tmp_path / "whole", tmp_path / "part"
    emulate(_config(plans["uneven"], whole, **kw), faults=NO_FAULTS)
    with pytest.raises(_Died):
        emulate(_config(plans["uneven"], part, **kw),
                faults=FaultPlan(die_at={1: frozenset({8})}, exit=_die))
    s = emulate(_config(plans["uneven"], part, **kw), faults=NO_FAULTS)
    assert s["resumed_from_step"] == 6
    for r in (0, 1):
        a, b = run_rows(whole, r), run_rows(part, r)
        assert [(x["step"], x["synced"], x["sync_round"], x["loss"], x["state_sha256"])
                for x in a] == [(x["step"], x["synced"], x["sync_round"], x["loss"],
                                 x["state_sha256"]) for x in b]
    assert not run_rows(whole, 0)[6]["synced"]  # the checkpoint really is inside a round
    a0, b0 = run_params(whole, 0), run_params(part, 0)
    assert all(torch.equal(a0[k], b0[k]) for k in a0)


def test_bad_sync_and_comm_in_the_config_name_the_flag(plans: dict[str, Path],
                                                       tmp_path: Path) -> None:
    from pydantic import ValidationError

    for kw, needle in ((dict(sync="local:0"), "--sync"), (dict(comm="topk"), "--comm"),
                       (dict(sync="local:2", comm="fp16"), "--sync local:2 with --comm fp16"),
                       (dict(lr_schedule="cosine:warmup=99"), "lr_schedule")):
        with pytest.raises(ValidationError, match=needle):
            _config(plans["equal"], tmp_path / "x", **kw)


def test_fp16_comm_in_emulation_sends_half_the_bytes(plans: dict[str, Path],
                                                     tmp_path: Path) -> None:
    emulate(_config(plans["equal"], tmp_path / "a"), faults=NO_FAULTS)
    emulate(_config(plans["equal"], tmp_path / "b", comm="fp16"), faults=NO_FAULTS)
    a, b = run_rows(tmp_path / "a", 0), run_rows(tmp_path / "b", 0)
    assert b[0]["bytes_allreduced"] * 2 == a[0]["bytes_allreduced"]
    pa, pb = run_params(tmp_path / "a", 0), run_params(tmp_path / "b", 0)
    diff = max(float((pa[k] - pb[k]).abs().max()) for k in pa)
    assert 0 < diff < 1e-2  # fp16 rounding of the gradients, nothing more


# ----------------------------------------------------------------------------- two gloo ranks

REPO = Path(__file__).resolve().parents[2]
GLOO_ARGS = ("--sync", "qsr:alpha=0.15,h_base=2", "--lr", "0.1", "--lr-schedule",
             "cosine:warmup=2", "--momentum", "0.9", "--steps", "12")


def _gloo(plan: Path, out: Path, *extra: str, **env: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "qsync_opt.cli", "train", "--model", "digits_cnn",
           "--plan", str(plan), "--nproc", "2", "--rank-groups", "0:cpu,1:cpu_2",
           "--out", str(out), "--backend", "gloo", "--timeout", "300", *GLOO_ARGS, *extra]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
                    QSYNC_LOG_STATE_HASH="1", **env)
    for var in ENV.values():
        if var not in env:
            full_env.pop(var, None)
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_two_gloo_ranks_under_qsr_resume_bit_for_bit_and_match_emulation(
        plans: dict[str, Path], tmp_path: Path) -> None:
    """QSR on two real gloo ranks (uneven batches): the replicas agree exactly after every
    sync and differ between; killed inside a round (rank 1 at step 10, the checkpoint at
    step 9) and resumed, the run syncs at the same steps and ends with the same parameters,
    bit for bit; and the emulation computes the same run within 1e-5."""
    straight = tmp_path / "straight"
    p = _gloo(plans["uneven"], straight)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r0, r1 = run_rows(straight, 0), run_rows(straight, 1)
    for a, b in zip(r0, r1, strict=True):
        assert a["synced"] == b["synced"] and a["sync_round"] == b["sync_round"]
        assert (a["state_sha256"] == b["state_sha256"]) == a["synced"], a["step"]
    cfg = _config(plans["uneven"], tmp_path / "x", steps=12, sync="qsr:alpha=0.15,h_base=2",
                  lr=0.1, lr_schedule="cosine:warmup=2", momentum=0.9)
    expect = [s + h - 1 for s, h in rounds(cfg.sync_mode(), cfg.schedule(), 12)]
    assert [r["step"] for r in r0 if r["synced"]] == expect
    assert r0[-1]["synced"] and len(expect) < 12
    # the bookkeeping all-reduce runs once per round: between syncs nothing is sent
    assert {r["bytes_sent"] for r in r0 if not r["synced"]} == {0}
    # and the launcher says the rounds and bytes
    sent = sum(r["bytes_sent"] for r in r0) / 1e6
    assert (f"  sync qsr:alpha=0.15,h_base=2: {len(expect)} round(s) in 12 step(s), "
            f"{sent:.2f} MB sent per rank, ") in p.stdout, p.stdout[-2000:]

    cut = tmp_path / "cut"
    killed = _gloo(plans["uneven"], cut, "--checkpoint-every", "3",
                   QSYNC_TEST_DIE_AT_STEP="1:10")
    assert killed.returncode == 1, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert not r0[8]["synced"]  # the checkpoint of step 9 is inside a round (6..11)
    resumed = _gloo(plans["uneven"], cut, "--checkpoint-every", "3")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert json.loads((cut / "summary.json").read_text())["resumed_from_step"] == 9
    for r in (0, 1):
        a, b = run_rows(straight, r), run_rows(cut, r)
        keys = ("step", "synced", "sync_round", "loss", "state_sha256", "lr", "bytes_sent")
        assert [[x[k] for k in keys] for x in a] == [[x[k] for k in keys] for x in b], r
        pa, pb = run_params(straight, r), run_params(cut, r)
        assert all(torch.equal(pa[k], pb[k]) for k in pa)

    emu = tmp_path / "emu"
    emulate(_config(plans["uneven"], emu, steps=12, sync="qsr:alpha=0.15,h_base=2", lr=0.1,
                    lr_schedule="cosine:warmup=2", momentum=0.9), faults=NO_FAULTS)
    pa, pe = run_params(straight, 0), run_params(emu, 0)
    for k in pa:
        torch.testing.assert_close(pa[k], pe[k], rtol=1e-5, atol=1e-5, msg=k)
    assert [r["synced"] for r in run_rows(emu, 0)] == [r["synced"] for r in r0]


def test_a_commit_leaves_a_newer_set_being_written(tmp_path: Path) -> None:
    """Under Local SGD a rank runs ahead of rank 0 between syncs: it can write its file of
    the next set while rank 0 still commits this one. The commit removes only older sets
    (it removed every other set, which deleted the faster rank's new file: found by the
    two-rank resume test above, one run in four)."""
    from qsync_opt.runtime.config import set_path

    for step in (3, 6, 9):
        set_path(tmp_path, step).mkdir(parents=True)
        (set_path(tmp_path, step) / "rank1.pt").write_bytes(b"x")
    ck.commit_set(tmp_path, set_path(tmp_path, 6), 6, 2, {}, link=False)
    assert not set_path(tmp_path, 3).exists()
    assert (set_path(tmp_path, 9) / "rank1.pt").exists()
    assert (set_path(tmp_path, 6) / "commit.json").exists()


# ------------------------- rounds and bytes in the summary, optimizer-state averaging


@pytest.mark.parametrize("sync", ["local:3", "qsr:alpha=0.1,h_base=2", "ddp"])
def test_the_summary_counts_rounds_and_bytes_resumes_included(plans: dict[str, Path],
                                                              tmp_path: Path, sync: str) -> None:
    """summary.json's communication: the rounds the schedule makes, the bytes every row
    handed the collectives; a run killed and resumed counts the steps before the resume."""
    kw: dict[str, Any] = dict(steps=9, sync=sync, checkpoint_every=3)
    whole, part = tmp_path / "whole", tmp_path / "part"
    s = emulate(_config(plans["equal"], whole, **kw), faults=NO_FAULTS)
    rows = run_rows(whole, 0)
    cfg = _config(plans["equal"], whole, **kw)
    expect = (9 if sync == "ddp" else len(rounds(parse_sync(sync), cfg.schedule(), 9)))
    comm = s["communication"]
    assert (comm["rounds"], comm["steps"]) == (expect, 9)
    assert comm["bytes_sent"] == sum(r["bytes_sent"] for r in rows) > 0
    with pytest.raises(_Died):
        emulate(_config(plans["equal"], part, **kw),
                faults=FaultPlan(die_at={0: frozenset({7})}, exit=_die))
    again = emulate(_config(plans["equal"], part, **kw), faults=NO_FAULTS)
    assert again["resumed_from_step"] == 6
    assert {k: again["communication"][k] for k in ("rounds", "steps", "bytes_sent")} == \
        {k: comm[k] for k in ("rounds", "steps", "bytes_sent")}


@pytest.mark.parametrize(("sync", "line"), [
    ("local:2", "  sync local:2: 3 round(s) in 5 step(s), "),
    ("qsr:alpha=0.01,h_base=4", "  sync qsr:alpha=0.01,h_base=4: 2 round(s) in 5 step(s), "),
    ("ddp", "  sync ddp: 5 round(s) in 5 step(s), "),
])
def test_train_prints_its_rounds_and_bytes(plans: dict[str, Path], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str], sync: str,
                                           line: str) -> None:
    from qsync_opt.cli import main

    assert main(["train", "--model", "digits_cnn", "--plan", str(plans["equal"]),
                 "--rank-groups", "0:cpu,1:cpu_2", "--nproc", "2", "--steps", "5",
                 "--sync", sync, "--out", str(tmp_path / "o"), "--emulate-dp"]) == 0
    out = capsys.readouterr().out.splitlines()
    got = [x for x in out if x.startswith("  sync ")]
    assert len(got) == 1 and got[0].startswith(line), out
    assert got[0].endswith(" ms in collectives") and " MB sent per rank, " in got[0]


@pytest.mark.parametrize("argv", [[], ["--sync", "ddp"], ["--sync", "ddp", "--comm", "fp16"],
                                  ["--pipeline-stages", "2"]])
def test_average_optimizer_state_without_parameter_averaging_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    """Under ddp (every replica steps on one gradient) the flag did nothing, silently."""
    from qsync_opt.cli import main

    out = tmp_path / "o"
    rc = main(["train", "--model", "digits_cnn", "--nproc", "2", "--out", str(out),
               "--average-optimizer-state", "--dry-run", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "--average-optimizer-state: only with --sync local:H or qsr" in err, err
    assert not out.exists()  # refused before the fp32 plan is written


def test_average_optimizer_state_is_checked_in_the_config_too(plans: dict[str, Path],
                                                              tmp_path: Path) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="--average-optimizer-state: only with"):
        _config(plans["equal"], tmp_path / "x", average_optimizer_state=True)
    for sync in ("local:2", "qsr:alpha=0.1,h_base=2"):
        cfg = _config(plans["equal"], tmp_path / "x", average_optimizer_state=True, sync=sync)
        assert cfg.average_optimizer_state
