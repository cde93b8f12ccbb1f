"""Training a plan: uneven-batch weighting, emulated and real (gloo) data parallelism, resume."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import GLOO_STEPS

from qsync_opt import parse_shorthand, trace
from qsync_opt.job.rank import (
    EmulatedSync,
    GlobalBatches,
    TrainingError,
    build_model,
    emulate,
    latest_checkpoint,
    load_checkpoint,
    prepare,
    rank_slice,
    weighted_backward,
)
from qsync_opt.problem.plan import make_plan
from qsync_opt.runtime.config import TrainConfig
from support.harness import assert_same_tree

REPO = Path(__file__).resolve().parents[2]


def _plan(path: Path, second: dict[str, str]) -> Path:
    """A digits_cnn plan for groups "cpu" (fp32, batch 48) and "cpu_2" (``second``, batch 16):
    written directly, so the runtime under test does not depend on what a solver picks."""
    cluster = parse_shorthand("cpux1@48+cpux1@16")  # uneven batches
    make_plan(trace("digits_cnn"), cluster, {"cpu_2": second}).save(path)
    return path


@pytest.fixture(scope="module")
def mixed_plan(digits_mixed_plan: Path) -> Path:
    # second group: conv1 bf16, conv2 int8 (stochastic rounding), fc1 fp16 (loss scaling)
    return digits_mixed_plan


@pytest.fixture(scope="module")
def fp32_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _plan(tmp_path_factory.mktemp("plan") / "fp32.json", {})


def _config(plan: Path, out: Path, **kw: object) -> TrainConfig:
    base: dict[str, object] = dict(workload="digits_cnn", plan_path=str(plan),
                                   rank_groups=["cpu", "cpu_2"], steps=6, out_dir=str(out),
                                   emulate_dp=True, eval_batches=1, timeout_s=20)
    base.update(kw)
    return TrainConfig(**base)  # type: ignore[arg-type]


def _metrics(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"metrics.rank{rank}.jsonl").read_text()
            .splitlines()]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Collective (and rendezvous) timeout of the two-rank runs that are not about timeouts: this
#: machine is shared, and a rank that starts late must not fail a run meant to succeed.
COLLECTIVE_TIMEOUT_S = 300
#: Wall-clock bound of one launched run: only a hang reaches it.
RUN_LIMIT_S = 600
#: Fields of a metrics row that are wall times (never reproducible).
TIMED = ("step_ms", "compute_ms", "sync_ms", "comm_ms")


def _cli_train(plan: Path, out: Path, steps: int, *extra: str,
               **env: str) -> subprocess.CompletedProcess[str]:
    """``qsync-opt train`` with 2 local gloo ranks (torchrun, one rank per group)."""
    cmd = [sys.executable, "-m", "qsync_opt.cli", "train", "--model", "digits_cnn",
           "--plan", str(plan), "--nproc", "2", "--rank-groups", "0:cpu,1:cpu_2",
           "--steps", str(steps), "--out", str(out), "--backend", "gloo",
           "--timeout", str(COLLECTIVE_TIMEOUT_S), *extra]
    return subprocess.run(cmd, env=_env(**env), capture_output=True, text=True,
                          timeout=RUN_LIMIT_S)


def _untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMED} for r in rows]


def _ckpt(out: Path, rank: int = 0) -> dict:
    """``rank``'s file of the newest complete checkpoint set in ``out``."""
    path = latest_checkpoint(out, rank)
    assert path is not None, out
    return load_checkpoint(path)


def _rank_checkpoints(out: Path) -> list[dict]:
    return [_ckpt(out, r) for r in (0, 1)]


def _start_two_ranks(config: Path, stdout: int, **extra: str) -> list[subprocess.Popen]:
    """Ranks 0 and 1 of ``config`` started by hand (no torchrun), stderr piped."""
    port = str(_free_port())
    return [subprocess.Popen([sys.executable, "-m", "qsync_opt.job.rank", str(config)],
                             env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra),
                             stdout=stdout, stderr=subprocess.PIPE, text=True)
            for r in (0, 1)]


# ----------------------------------------------------------------------------- weighting


def test_uneven_weighted_gradients_equal_full_batch_gradient_float64(fp32_plan: Path,
                                                                     tmp_path: Path) -> None:
    setup = prepare(_config(fp32_plan, tmp_path))
    assert setup.batches == [48, 16] and setup.offsets == [0, 48]
    model = build_model(setup, 0, torch.device("cpu")).double()
    # BatchNorm in eval mode: per-sample computation, so the decomposition is exact
    # (train-mode BN uses per-rank batch statistics, the stated policy, which differs)
    model.eval()
    replicas = [copy.deepcopy(model) for _ in range(2)]
    data = GlobalBatches(setup.workload, 3, setup.global_batch)
    (x,), y = data.batch(0)
    x = x.double()
    weighted_backward(model, setup.workload, (x,), y, weight=1.0)
    full = {n: p.grad.clone() for n, p in model.named_parameters()}
    for r, rep in enumerate(replicas):
        (xr,), yr = rank_slice(((x,), y), setup.offsets[r], setup.batches[r])
        weighted_backward(rep, setup.workload, (xr,), yr,
                          weight=setup.batches[r] * 2 / setup.global_batch)
    EmulatedSync(2).reduce(replicas)
    for rep in replicas:
        for n, p in rep.named_parameters():
            err = (p.grad - full[n]).abs().max() / full[n].abs().max().clamp_min(1e-300)
            assert err <= 1e-12, (n, float(err))


# ----------------------------------------------------------------------------- emulation


def test_emulate_dp_two_plans_learns_and_writes(mixed_plan: Path, tmp_path: Path) -> None:
    cfg = _config(mixed_plan, tmp_path / "run", steps=30, eval_batches=2)
    summary = emulate(cfg)
    assert summary["steps"] == 30 and summary["skipped_steps"] == 0
    assert summary["loss_scale"] == 2.0 ** 16  # the second group's plan has fp16
    m0, m1 = _metrics(tmp_path / "run", 0), _metrics(tmp_path / "run", 1)
    assert [r["step"] for r in m0] == list(range(30)) and len(m1) == 30
    # every step all-reduces the FP32 gradient of every parameter
    n_params = sum(q.numel() for q in build_model(prepare(cfg), 1, torch.device("cpu"))
                   .parameters())
    assert m1[0]["group"] == "cpu_2" and n_params == trace("digits_cnn").param_count
    assert {r["bytes_allreduced"] for r in m0 + m1} == {4 * n_params}
    first = sum(r["loss"] for r in m0[:5]) / 5
    last = sum(r["loss"] for r in m0[-5:]) / 5
    assert last < 0.6 * first
    assert summary["eval_accuracy"] > 0.5 and summary["final_loss"] < first
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["state_sha256"] == summary["state_sha256"]
    ck = _ckpt(tmp_path / "run")  # weights_only=True
    assert ck["step"] == 30 and "conv2.weight" in ck["model"]


def test_resume_reproduces_the_uninterrupted_run(mixed_plan: Path, tmp_path: Path) -> None:
    straight = emulate(_config(mixed_plan, tmp_path / "a", steps=6))
    emulate(_config(mixed_plan, tmp_path / "b", steps=3))
    resumed = emulate(_config(mixed_plan, tmp_path / "b", steps=6))
    assert resumed["resumed_from_step"] == 3
    assert resumed["state_sha256"] == straight["state_sha256"]
    a, b = _ckpt(tmp_path / "a", 1), _ckpt(tmp_path / "b", 1)
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    assert a["replicas"][0]["qseeds"] == b["replicas"][0]["qseeds"]
    assert [r["loss"] for r in _metrics(tmp_path / "a", 1)] == \
        [r["loss"] for r in _metrics(tmp_path / "b", 1)]


def test_nan_guard_skips_on_every_rank_then_stops(mixed_plan: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QSYNC_TEST_NAN_AT_STEP", "1:2")
    s = emulate(_config(mixed_plan, tmp_path / "one", steps=4))
    assert s["skipped_steps"] == 1 and s["loss_scale"] == 2.0 ** 15
    rows = _metrics(tmp_path / "one", 0)
    assert [r["skipped"] for r in rows] == [False, False, True, False]
    monkeypatch.setenv("QSYNC_TEST_NAN_AT_STEP", "1:1,2,3,4")
    with pytest.raises(TrainingError, match="max_bad_steps=3"):
        emulate(_config(mixed_plan, tmp_path / "many", steps=6, max_bad_steps=3))


# ----------------------------------------------------------------------------- processes


@pytest.mark.slow
@pytest.mark.xdist_group("gloo_straight")  # the session's run: made once
def test_two_process_gloo_ranks_stay_identical_and_match_emulation(
        mixed_plan: Path, gloo_straight: Path, tmp_path: Path) -> None:
    steps = GLOO_STEPS
    d0, d1 = _metrics(gloo_straight, 0), _metrics(gloo_straight, 1)
    assert [r["step"] for r in d0] == [r["step"] for r in d1] == list(range(steps))
    for a, b in zip(d0, d1, strict=True):  # FP32 weights bit-identical after every step
        assert a["state_sha256"] == b["state_sha256"], a["step"]
    assert len({r["state_sha256"] for r in d0}) == steps  # and every step changed them
    assert [r["group"] for r in d0 + d1] == ["cpu"] * steps + ["cpu_2"] * steps
    s0 = json.loads((gloo_straight / "summary.rank0.json").read_text())
    s1 = json.loads((gloo_straight / "summary.rank1.json").read_text())
    assert s0["state_sha256"] == s1["state_sha256"] == d0[-1]["state_sha256"]
    assert (s0["world_size"], s0["emulated"], s0["skipped_steps"]) == (2, False, 0)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # same kernels as the single-threaded ranks
    try:
        emulate(_config(mixed_plan, tmp_path / "emu", steps=steps))
    finally:
        torch.set_num_threads(threads)
    a = _ckpt(gloo_straight)["model"]
    b = _ckpt(tmp_path / "emu")["model"]
    for k, v in a.items():
        if v.is_floating_point():
            torch.testing.assert_close(v, b[k], rtol=1e-5, atol=1e-6, msg=k)
        else:
            assert torch.equal(v, b[k]), k
    e1 = _metrics(tmp_path / "emu", 1)
    for x, y in zip(d1, e1, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.xdist_group("gloo_straight")  # the session's run: made once
def test_two_gloo_ranks_killed_and_resumed_reproduce_the_straight_run(
        mixed_plan: Path, gloo_straight: Path, tmp_path: Path) -> None:
    """Interrupted for real (rank 1 dies after step 2, the checkpoint is at step 2), then
    resumed by a second `qsync-opt train`: every rank's final state (model, optimizer, loss
    scale, RNG, the int8 layers' rounding seeds) and every metrics row equal the run that was
    never stopped, bit for bit."""
    out = tmp_path / "resumed"
    killed = _cli_train(mixed_plan, out, GLOO_STEPS, "--checkpoint-every", "2",
                        QSYNC_LOG_STATE_HASH="1", QSYNC_TEST_DIE_AT_STEP="1:3")
    assert killed.returncode == 1, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert [c["step"] for c in _rank_checkpoints(out)] == [2, 2]
    # rank 1 logged step 2 before dying at step 3: rows past the checkpoint, to be dropped
    assert [r["step"] for r in _metrics(out, 1)] == [0, 1, 2]
    assert [r["step"] for r in _metrics(out, 0)][:2] == [0, 1]

    resumed = _cli_train(mixed_plan, out, GLOO_STEPS, QSYNC_LOG_STATE_HASH="1")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    for r in (0, 1):
        summary = json.loads((out / f"summary.rank{r}.json").read_text())
        straight = json.loads((gloo_straight / f"summary.rank{r}.json").read_text())
        assert summary["resumed_from_step"] == 2 and summary["steps"] == GLOO_STEPS
        assert summary["state_sha256"] == straight["state_sha256"]
        assert summary["eval_per_rank"] == straight["eval_per_rank"]
        assert summary["final_loss"] == straight["final_loss"]
        rows, want = _untimed(_metrics(out, r)), _untimed(_metrics(gloo_straight, r))
        assert [x["step"] for x in rows] == list(range(GLOO_STEPS))
        assert rows == want, r
    for r, (a, b) in enumerate(zip(_rank_checkpoints(out), _rank_checkpoints(gloo_straight),
                                   strict=True)):
        assert a["step"] == GLOO_STEPS
        assert_same_tree(a, b, f"checkpoint.rank{r}")


@pytest.mark.slow
@pytest.mark.xdist_group("gloo_straight")  # the session's run: made once
def test_a_nan_loss_on_one_gloo_rank_skips_the_step_on_both(mixed_plan: Path,
                                                            gloo_straight: Path,
                                                            tmp_path: Path) -> None:
    """Rank 1's loss is NaN at steps 2 and 4 (the last); rank 0's is finite. Both ranks skip
    both steps (their state after a skipped step is their state before it, and the same on
    both), halve the fp16 loss scale each time, count the skips, and train step 3."""
    out = tmp_path / "nan"
    p = _cli_train(mixed_plan, out, 5, QSYNC_LOG_STATE_HASH="1",
                   QSYNC_TEST_NAN_AT_STEP="1:2,4")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # the last step was skipped: the final loss is NaN (null in the summary), said so
    assert "final loss not finite" in p.stdout and "2 skipped step(s)" in p.stdout
    rows = [_metrics(out, r) for r in (0, 1)]
    straight = _metrics(gloo_straight, 0)
    for r, m in enumerate(rows):
        assert [x["step"] for x in m] == [0, 1, 2, 3, 4], r
        assert [x["skipped"] for x in m] == [False, False, True, False, True], r
        assert [x["loss_scale"] for x in m] == [2.0 ** k for k in (16, 16, 15, 15, 14)], r
        # steps before the NaN are the clean run's; a skipped step changed nothing
        assert [x["state_sha256"] for x in m[:2]] == [x["state_sha256"] for x in straight[:2]]
        assert m[2]["state_sha256"] == m[1]["state_sha256"], r
        assert m[3]["state_sha256"] != m[2]["state_sha256"], r  # training went on
        assert m[4]["state_sha256"] == m[3]["state_sha256"], r
    for step in (2, 4):
        assert math.isnan(rows[1][step]["loss"]) and math.isfinite(rows[0][step]["loss"])
    for a, b in zip(*rows, strict=True):
        assert a["state_sha256"] == b["state_sha256"], a["step"]
    for r in (0, 1):
        s = json.loads((out / f"summary.rank{r}.json").read_text())
        assert (s["steps"], s["skipped_steps"], s["loss_scale"]) == (5, 2, 2.0 ** 14), r
        assert s["final_loss"] is None
    c0, c1 = _rank_checkpoints(out)
    assert (c0["skipped"], c1["skipped"]) == (2, 2)
    assert_same_tree(c0["model"], c1["model"], "model")
    assert_same_tree(c0["optimizer"], c1["optimizer"], "optimizer")


@pytest.mark.slow
def test_a_dead_rank_makes_the_other_fail_within_the_timeout(mixed_plan: Path,
                                                             tmp_path: Path) -> None:
    """Ranks started by hand (no torchrun to kill the survivor): rank 0 must fail itself."""
    # The timeout also bounds the rendezvous: generous, so a rank that starts late on this
    # shared machine is not mistaken for a dead one (rank 0 notices the death by its closed
    # connection, not by the timeout). No wall-time assertion: only a hang fails by time.
    cfg = _config(mixed_plan, tmp_path / "die", steps=6, emulate_dp=False, timeout_s=60)
    path = tmp_path / "die.json"
    cfg.save(path)
    procs = _start_two_ranks(path, subprocess.PIPE, QSYNC_TEST_DIE_AT_STEP="1:2")
    try:
        outs = [p.communicate(timeout=RUN_LIMIT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[1].returncode == 17
    assert procs[0].returncode == 1, outs[0][1][-2000:]
    assert "qsync-opt train: rank 0: " in outs[0][1]
    # both ranks trained steps 0 and 1 together; rank 0 failed in step 2, the first without
    # its peer
    assert [r["step"] for r in _metrics(tmp_path / "die", 0)] == [0, 1]
    assert [r["step"] for r in _metrics(tmp_path / "die", 1)] == [0, 1]


@pytest.mark.slow
def test_a_stalled_rank_makes_the_other_fail_by_the_collective_timeout(
        mixed_plan: Path, tmp_path: Path) -> None:
    """The test waits the collective timeout out, so it is short: 5 s, which still bounds
    the rendezvous (both ranks start together here; the rows below show the run got past it
    and through two steps, so the failure is the stall's). Only a hang fails by time."""
    cfg = _config(mixed_plan, tmp_path / "hang", steps=6, emulate_dp=False, timeout_s=5)
    path = tmp_path / "hang.json"
    cfg.save(path)
    procs = _start_two_ranks(path, subprocess.DEVNULL, QSYNC_TEST_HANG_AT_STEP="1:2")
    try:
        _, err = procs[0].communicate(timeout=RUN_LIMIT_S)
        stalled_alive = procs[1].poll() is None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    # It fails, never hangs: usually with our one-line error (exit 1); gloo's C++ layer can
    # also abort the process on the timeout (SIGABRT, -6), which is a failure too.
    assert procs[0].returncode in (1, -6), (procs[0].returncode, err[-2000:])
    if procs[0].returncode == 1:
        assert "qsync-opt train: rank 0: " in err
        assert "Timed out" in err or "timeout" in err.lower()
    assert stalled_alive  # the other rank is silent, not dead: only the timeout can tell
    assert [r["step"] for r in _metrics(tmp_path / "hang", 0)] == [0, 1]


def test_single_process_run_resumes_exactly(mixed_plan: Path, tmp_path: Path) -> None:
    from qsync_opt.job.rank import run

    one = dict(emulate_dp=False, rank_groups=["cpu_2"])
    straight = run(_config(mixed_plan, tmp_path / "a", steps=4, **one))
    run(_config(mixed_plan, tmp_path / "b", steps=2, checkpoint_every=1, **one))
    resumed = run(_config(mixed_plan, tmp_path / "b", steps=4, **one))
    assert resumed["resumed_from_step"] == 2 and resumed["world_size"] == 1
    assert resumed["state_sha256"] == straight["state_sha256"]
    a, b = _untimed(_metrics(tmp_path / "a", 0)), _untimed(_metrics(tmp_path / "b", 0))
    assert [r["step"] for r in a] == [0, 1, 2, 3] and b == a


@pytest.mark.slow
def test_torchrun_with_a_dead_rank_fails_never_hangs(mixed_plan: Path, tmp_path: Path) -> None:
    cfg = _config(mixed_plan, tmp_path / "die", steps=6, emulate_dp=False, timeout_s=60)
    path = tmp_path / "die.json"
    cfg.save(path)
    proc = subprocess.run(  # only a hang reaches the timeout
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(_free_port()), "-m", "qsync_opt.job.rank", str(path)],
        env=_env(QSYNC_TEST_DIE_AT_STEP="1:2"), capture_output=True, text=True,
        timeout=RUN_LIMIT_S)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert re.search(r"exitcode\s*:\s*17\b", proc.stderr), proc.stderr[-3000:]
    assert [r["step"] for r in _metrics(tmp_path / "die", 1)] == [0, 1]


# ----------------------------------------------------------------------------- bad input


@pytest.fixture
def rank_main(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
              runtime_quiet: None) -> Callable[[Path], tuple[int, str]]:
    """The rank entry point (``python -m qsync_opt.job.rank CONFIG``) run in this process
    as a single rank started by hand: (exit code, stderr). The children of the slow tests
    above start it as its own process."""
    from qsync_opt.job.rank import main

    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "QSYNC_LAUNCHER_PID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)

    def call(path: Path) -> tuple[int, str]:
        capfd.readouterr()
        code = main([str(path)])
        return code, capfd.readouterr().err

    return call


def _run_cli(cfg: TrainConfig, tmp_path: Path,
             rank_main: Callable[[Path], tuple[int, str]]) -> tuple[int, str]:
    path = tmp_path / "cfg.json"
    cfg.save(path)
    return rank_main(path)


def test_missing_plan_file_is_one_line_exit_2(tmp_path: Path, rank_main) -> None:
    code, err = _run_cli(_config(tmp_path / "nope.json", tmp_path / "o", emulate_dp=False,
                                 rank_groups=["cpu"]), tmp_path, rank_main)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "plan_path" in err


def test_group_not_in_plan_is_one_line_exit_2(mixed_plan: Path, tmp_path: Path,
                                              rank_main) -> None:
    code, err = _run_cli(_config(mixed_plan, tmp_path / "o", emulate_dp=False,
                                 rank_groups=["v100"]), tmp_path, rank_main)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "rank_groups[0]" in err


def test_plan_for_another_model_and_world_mismatch_exit_2(mixed_plan: Path, tmp_path: Path,
                                                          rank_main) -> None:
    code, err = _run_cli(_config(mixed_plan, tmp_path / "o", workload="tiny_gpt"), tmp_path,
                         rank_main)
    assert code == 2 and "made for digits_cnn" in err
    assert len(err.strip().splitlines()) == 1
    code, err = _run_cli(_config(mixed_plan, tmp_path / "o", emulate_dp=False), tmp_path,
                         rank_main)
    assert code == 2 and "WORLD_SIZE" in err
    assert len(err.strip().splitlines()) == 1


def test_bad_config_field_is_one_line_exit_2(tmp_path: Path, rank_main) -> None:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"schema_name": "TrainConfig", "workload": "digits_cnn",
                                "plan_path": "x", "rank_groups": ["cpu"], "steps": 0,
                                "out_dir": str(tmp_path)}))
    code, err = rank_main(path)
    assert code == 2 and "steps" in err
    assert len(err.strip().splitlines()) == 1


def test_a_rank_on_another_card_is_warned(tmp_path):
    """On a GPU each rank compares its card with the plan group's (no GPU needed here)."""
    from qsync_opt import estimate, parse_shorthand, trace
    from qsync_opt.job.rank import card_mismatch, prepare
    from qsync_opt.problem.program import AllocationProblem
    from qsync_opt.problem.synthetic import random_indicator
    from qsync_opt.runtime.config import TrainConfig

    g = trace("digits_cnn")
    c = parse_shorthand("v100x1+t4x1")
    prob = AllocationProblem(g, c, estimate(g, c), random_indicator(g))
    plan = prob.make_plan(prob.reference_assignment())
    plan.save(tmp_path / "p.json")
    cfg = TrainConfig(workload="digits_cnn", plan_path=str(tmp_path / "p.json"),
                      rank_groups=["v100", "t4"], steps=1, out_dir=str(tmp_path / "o"))
    setup = prepare(cfg)
    assert card_mismatch(setup, 1, "Tesla T4") is None
    assert card_mismatch(setup, 0, "Tesla V100-SXM2-32GB") is None
    warn = card_mismatch(setup, 1, "NVIDIA H200")
    assert warn and "t4" in warn and "H200" in warn
