"""The training runtime's reliability: checkpoint sets survive a kill at any moment of a save, a
resume refuses another run's checkpoint, ranks die with the launcher, bad numbers are one
line at the launcher."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from qsync_opt.cli.parsers.train import add_train_parser
from qsync_opt.cli.train import cmd_train
from qsync_opt.core.errors import QsyncInputError, describe_validation_error
from qsync_opt.core.precision import Precision
from qsync_opt.documents.schemas import Plan
from qsync_opt.job import rank as rt
from qsync_opt.runtime import config as rc
from qsync_opt.runtime.config import (
    MAX_BATCH_PER_DEVICE,
    TrainConfig,
    check_resume,
    commit_document,
    latest_complete_set,
    remove_stale,
    run_fingerprint,
    set_path,
)
from support.harness import assert_same_tree, run_cli

REPO = Path(__file__).resolve().parents[2]
#: Only a hang reaches it.
RUN_LIMIT_S = 600
#: Collective timeout of the two-rank runs: a rank starting late on a loaded machine is fine.
COLLECTIVE_TIMEOUT_S = 300


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def plan_path(digits_mixed_plan: Path) -> Path:
    """digits_cnn, groups "cpu" (fp32, batch 48) and "cpu_2" (mixed precisions, batch 16)."""
    return digits_mixed_plan


def _config(plan: Path, out: Path, **kw: object) -> TrainConfig:
    base: dict[str, object] = dict(workload="digits_cnn", plan_path=str(plan),
                                   rank_groups=["cpu", "cpu_2"], steps=6, out_dir=str(out),
                                   emulate_dp=True, eval_batches=1, timeout_s=20)
    base.update(kw)
    return TrainConfig(**base)  # type: ignore[arg-type]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("QSYNC_LAUNCHER_PID", None)
    env.update(extra)
    return env


def _args(*argv: str):  # type: ignore[no-untyped-def]
    import argparse

    parser = argparse.ArgumentParser(prog="qsync-opt")
    add_train_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["train", *argv])


def _cli(*argv: str, timeout: float = RUN_LIMIT_S, **env: str
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qsync_opt.cli", *argv], env=_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def _metrics(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in
            (out / f"metrics.rank{rank}.jsonl").read_text().splitlines()]


def _untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("step_ms", "compute_ms", "sync_ms", "comm_ms")}
            for r in rows]


def _ckpt(out: Path, rank: int) -> dict:
    path = rt.latest_checkpoint(out, rank)
    assert path is not None, out
    return rt.load_checkpoint(path)


def _fake_set(out: Path, step: int, world: int, run: dict, *, commit: bool = True,
              ranks: list[int] | None = None) -> Path:
    folder = set_path(out, step)
    folder.mkdir(parents=True, exist_ok=True)
    for r in range(world) if ranks is None else ranks:
        (folder / f"rank{r}.pt").write_bytes(b"x")
    if commit:
        (folder / "commit.json").write_text(commit_document(step, world, run))
    return folder


# ----------------------------------------------------------------------------- set layout


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 60), st.sampled_from(
    ["complete", "no-marker", "missing-rank", "bad-marker", "wrong-step"])),
    max_size=8, unique_by=lambda t: t[0]))
def test_resume_picks_the_newest_complete_set(tmp_path_factory, sets) -> None:
    """Whatever a kill left (a set without its marker, without a rank's file, a torn or
    foreign marker), the newest set with its marker and every rank's file is the one."""
    out = tmp_path_factory.mktemp("sets")
    for step, kind in sets:
        folder = _fake_set(out, step, 2, {"k": step}, commit=kind != "no-marker",
                           ranks=[0] if kind == "missing-rank" else None)
        if kind == "bad-marker":
            (folder / "commit.json").write_text('{"step": ' + "[" * 5000)
        if kind == "wrong-step":
            (folder / "commit.json").write_text(commit_document(step + 1, 2, {}))
    want = max((s for s, kind in sets if kind == "complete"), default=None)
    cs = latest_complete_set(out)
    assert (cs.step if cs else None) == want
    if cs is not None:
        assert cs.world_size == 2 and cs.run == {"k": want}
        assert rt.latest_checkpoint(out, 1) == cs.path / "rank1.pt"
        assert rt.latest_checkpoint(out, 2) is None


def test_the_start_removes_stale_tmp_files_and_other_sets(tmp_path: Path) -> None:
    keep = _fake_set(tmp_path, 4, 2, {})
    older = _fake_set(tmp_path, 2, 2, {})
    torn = _fake_set(tmp_path, 6, 2, {}, commit=False, ranks=[0])
    stale = [tmp_path / ".summary.json.abc.tmp", keep / ".rank1.pt.x1.tmp",
             tmp_path / "ckpt" / ".step.tmp"]
    for p in stale:
        p.write_bytes(b"half")
    (tmp_path / "notes.tmp").write_text("a user's file, not ours")
    cs = latest_complete_set(tmp_path)
    assert cs is not None and cs.path == keep
    remove_stale(tmp_path, cs)
    assert keep.is_dir() and not older.exists() and not torn.exists()
    assert not any(p.exists() for p in stale)
    assert (tmp_path / "notes.tmp").exists()
    remove_stale(tmp_path, None)  # a run that starts afresh keeps no set
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


class _Killed(BaseException):
    """Stands in for the process dying (os._exit) inside a save."""


@pytest.mark.parametrize("die_rank", [0, 1])
def test_a_kill_inside_a_save_resumes_from_the_last_complete_set(
        plan_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, die_rank: int
        ) -> None:
    """Emulated two ranks (one process), checkpoint every 2 steps; the process dies in the
    save of step 4 after a rank's file is written, before the marker. With one file per rank
    the ranks were at steps 4 and 2 and the resume refused; now the set of step 2 is the
    last complete one, the resume takes it and ends equal to the straight run, bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        straight = rt.emulate(_config(plan_path, tmp_path / "a", checkpoint_every=2))
        out = tmp_path / "b"

        def die(code: int) -> None:
            raise _Killed(code)

        monkeypatch.setenv("QSYNC_TEST_DIE_IN_SAVE", f"{die_rank}:4")
        monkeypatch.setattr(rt.os, "_exit", die)
        with pytest.raises(_Killed):
            rt.emulate(_config(plan_path, out, checkpoint_every=2))
        monkeypatch.undo()
        torn = set_path(out, 4)
        assert (torn / f"rank{die_rank}.pt").is_file() and not (torn / "commit.json").exists()
        cs = latest_complete_set(out)
        assert cs is not None and cs.step == 2
        (out / "ckpt" / ".x.tmp").write_bytes(b"")  # as a kill inside torch.save leaves
        resumed = rt.emulate(_config(plan_path, out, checkpoint_every=2))
    finally:
        torch.set_num_threads(threads)
    assert resumed["resumed_from_step"] == 2
    assert resumed["state_sha256"] == straight["state_sha256"]
    for r in (0, 1):
        assert_same_tree(_ckpt(out, r), _ckpt(tmp_path / "a", r), f"rank{r}")
        assert _untimed(_metrics(out, r)) == _untimed(_metrics(tmp_path / "a", r))
    assert [s for s, _ in rc.step_folders(out)] == [6]  # older sets gone once 6 committed
    assert not (out / "ckpt" / ".x.tmp").exists()
    assert rt.load_checkpoint(out / "checkpoint.pt")["step"] == 6  # the link, for old readers


# ----------------------------------------------------------------------------- resume check


@pytest.mark.parametrize(("change", "needle"), [
    ({"seed": 1}, "--seed 0 -> 1"),
    ({"lr": 0.1}, "--lr 0.05 -> 0.1"),
    ({"momentum": 0.5}, "--momentum 0.9 -> 0.5"),
    ({"loss_scale": 8.0}, "loss_scale None -> 8"),
    ({"rank_groups": ["cpu_2", "cpu"]}, "--rank-groups ['cpu', 'cpu_2'] -> ['cpu_2', 'cpu']"),
])
def test_another_runs_checkpoint_is_refused_unless_resume_anyway(
        plan_path: Path, tmp_path: Path, change: dict, needle: str) -> None:
    plan = Plan.load(plan_path)
    old = _config(plan_path, tmp_path)
    _fake_set(tmp_path, 3, 2, run_fingerprint(old, plan))
    assert check_resume(old, plan).step == 3  # the same run resumes
    new = _config(plan_path, tmp_path, **change)
    with pytest.raises(QsyncInputError) as exc:
        check_resume(new, plan)
    msg = str(exc.value)
    assert needle in msg and "--resume-anyway" in msg and "\n" not in msg
    if "rank_groups" in change:
        assert "batch split [48, 16] -> [16, 48]" in msg
    assert check_resume(new.model_copy(update={"resume_anyway": True}), plan).step == 3
    assert check_resume(new.model_copy(update={"resume": False}), plan) is None


def test_a_plan_changed_under_the_run_is_refused(plan_path: Path, tmp_path: Path) -> None:
    plan = Plan.load(plan_path)
    cfg = _config(plan_path, tmp_path)
    _fake_set(tmp_path, 3, 2, run_fingerprint(cfg, plan))
    groups = dict(plan.groups)
    groups["cpu_2"] = groups["cpu_2"].model_copy(
        update={"precisions": {**groups["cpu_2"].precisions, "fc1": Precision.fp32}})
    with pytest.raises(QsyncInputError, match=r"plan \(hash of the ranks' groups\) '\w+' -> "):
        check_resume(cfg, plan.model_copy(update={"groups": groups}))


@pytest.mark.parametrize(("change", "needle"), [
    ({"optimizer": "adam"}, "--optimizer 'sgd' -> 'adam'"),
    ({"workload": "tiny_gpt"}, "--model 'digits_cnn' -> 'tiny_gpt'"),
    ({"rank_groups": ["cpu"]}, "world size 2 -> 1"),
])
def test_what_no_resume_can_bridge_is_refused_even_anyway(plan_path: Path, tmp_path: Path,
                                                          change: dict, needle: str) -> None:
    plan = Plan.load(plan_path)
    _fake_set(tmp_path, 3, 2, run_fingerprint(_config(plan_path, tmp_path), plan))
    new = _config(plan_path, tmp_path, resume_anyway=True, **change)
    with pytest.raises(QsyncInputError, match="--no-resume") as exc:
        check_resume(new, plan)
    assert needle in str(exc.value)


def test_a_checkpoint_past_steps_and_the_old_layout_are_refused(plan_path: Path,
                                                                tmp_path: Path) -> None:
    plan = Plan.load(plan_path)
    cfg = _config(plan_path, tmp_path / "a", steps=2)
    _fake_set(tmp_path / "a", 3, 2, run_fingerprint(cfg, plan))
    with pytest.raises(QsyncInputError, match=r"--steps 2: .* already at step 3"):
        check_resume(cfg, plan)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "checkpoint.rank0.pt").write_bytes(b"x")
    with pytest.raises(QsyncInputError, match="earlier qsync-opt's layout"):
        check_resume(_config(plan_path, tmp_path / "b"), plan)
    assert check_resume(_config(plan_path, tmp_path / "b", resume=False), plan) is None


def test_train_refuses_to_resume_another_run_and_keeps_its_config(plan_path: Path,
                                                                  tmp_path: Path) -> None:
    """The campaign's case: same --out, another seed and lr. It resumed the old checkpoint,
    trained 0 steps, printed the old loss and rewrote the config; now it is refused before
    anything in --out changes, and --resume-anyway continues the checkpoint."""
    out = tmp_path / "run"
    base = ("--model", "digits_cnn", "--plan", str(plan_path), "--nproc", "2",
            "--rank-groups", "0:cpu,1:cpu_2", "--out", str(out), "--emulate-dp")
    assert cmd_train(_args(*base, "--steps", "2")) == 0
    cfg_file = out / "train_config.json"
    before = cfg_file.read_bytes()
    with pytest.raises(QsyncInputError) as exc:
        cmd_train(_args(*base, "--steps", "3", "--seed", "1", "--lr", "0.1"))
    msg = str(exc.value)
    assert "--seed 0 -> 1" in msg and "--lr 0.05 -> 0.1" in msg and "(step 2)" in msg
    assert cfg_file.read_bytes() == before
    assert rt.latest_checkpoint(out, 0).parent.name == "step-00000002"
    # the rank (a config given directly) refuses it as well
    with pytest.raises(QsyncInputError, match="--seed 0 -> 1"):
        rt.emulate(_config(plan_path, out, steps=3, seed=1))
    assert cmd_train(_args(*base, "--steps", "3", "--seed", "1", "--resume-anyway")) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["resumed_from_step"], summary["steps"]) == (2, 3)
    cfg = TrainConfig.load(cfg_file)
    assert cfg.seed == 1 and cfg.resume_anyway
    # the new set records the new settings: a plain resume of them is no longer refused
    assert check_resume(cfg.model_copy(update={"resume_anyway": False, "steps": 4}),
                        Plan.load(plan_path)).step == 3


# ----------------------------------------------------------------------------- bad numbers


FLOAT_FLAGS = {"--lr": "lr", "--timeout": "timeout_s", "--momentum": "momentum"}
BAD_FLOATS = st.sampled_from(["inf", "-inf", "nan", "-1", "0", "1e400"]) | st.floats(
    max_value=0, allow_nan=False, allow_infinity=False).map(repr)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag=st.sampled_from(sorted(FLOAT_FLAGS)), value=BAD_FLOATS)
def test_non_finite_or_negative_numbers_are_refused_naming_the_flag(
        plan_path: Path, tmp_path_factory, flag: str, value: str) -> None:
    """`--lr inf` and `--timeout inf` passed the launcher and failed in the ranks (exit 1)."""
    if flag == "--momentum" and value in ("0", "-0.0", "0.0"):
        value = "1"  # 0 is a valid momentum; 1 is not
    from support.harness import run_cli

    out = tmp_path_factory.mktemp("bad")
    # refused when the command line is parsed, by the flag's bounded type
    code, _, err = run_cli("train", "--model", "digits_cnn", "--plan", str(plan_path),
                           "--nproc", "2", "--rank-groups", "0:cpu,1:cpu_2", "--out", str(out),
                           "--dry-run", f"{flag}={value}")
    assert code == 2 and f"argument {flag}: expected" in err and err.count("\n") == 1, err
    assert not (out / "train_config.json").exists()


@pytest.mark.parametrize(("field", "value"), [
    ("lr", float("inf")), ("lr", float("nan")), ("timeout_s", float("inf")),
    ("timeout_s", 1e300), ("momentum", float("nan")), ("loss_scale", float("inf")),
    ("seed", 10 ** 30), ("steps", True), ("lr", True),
    ("slowdown", {"cpu_2": float("inf")}), ("slowdown", {"cpu_2": 1e9}),
])
def test_a_config_file_with_bad_numbers_is_refused(plan_path: Path, tmp_path: Path,
                                                   field: str, value: object) -> None:
    with pytest.raises(ValidationError) as exc:
        _config(plan_path, tmp_path, **{field: value})
    msg = describe_validation_error(exc.value)
    assert field in msg and "\n" not in msg


def test_lr_inf_at_the_command_line_is_exit_2_and_one_line(plan_path: Path,
                                                           tmp_path: Path) -> None:
    code, _, err = run_cli("train", "--model", "digits_cnn", "--plan", str(plan_path),
                           "--nproc", "2", "--rank-groups", "0:cpu,1:cpu_2", "--out",
                           str(tmp_path), "--lr", "inf", "--timeout", "60")
    assert code == 2, err
    assert err.count("\n") == 1 and "--lr" in err and "Traceback" not in err
    assert not (tmp_path / "train_config.json").exists()


def test_a_plan_batch_beyond_the_limit_is_one_line(plan_path: Path, tmp_path: Path) -> None:
    """A plan batch of 10**12 under `train` was a traceback (an allocation of it)."""
    plan = Plan.load(plan_path)
    groups = dict(plan.groups)
    groups["cpu_2"] = groups["cpu_2"].model_copy(update={"batch_per_device": 10 ** 12})
    big = tmp_path / "big.json"
    plan.model_copy(update={"groups": groups}).save(big)
    with pytest.raises(QsyncInputError, match=str(MAX_BATCH_PER_DEVICE)):
        rt.prepare(_config(big, tmp_path / "o"))
    with pytest.raises(QsyncInputError, match=str(MAX_BATCH_PER_DEVICE)):
        cmd_train(_args("--model", "digits_cnn", "--plan", str(big), "--nproc", "2",
                        "--rank-groups", "0:cpu,1:cpu_2", "--out", str(tmp_path / "o")))
    assert not (tmp_path / "o").exists()  # refused before anything is written
    code, _, err = run_cli("train", "--model", "digits_cnn", "--plan", str(big), "--nproc",
                           "2", "--rank-groups", "0:cpu,1:cpu_2", "--out", str(tmp_path / "o"),
                           "--emulate-dp")
    assert code == 2, err[-2000:]
    assert err.count("\n") == 1 and "batch" in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_an_infinite_slowdown_is_refused_by_the_hooks_too() -> None:
    """cpu/inf reached SlowdownHooks as a factor whose sleep never ends (OverflowError)."""
    from qsync_opt.runtime.emulate import SlowdownHooks

    for bad in (float("inf"), float("nan"), 0.5):
        with pytest.raises(ValueError, match="finite number >= 1"):
            SlowdownHooks(torch.nn.Linear(2, 2), bad)


# ----------------------------------------------------------------------------- signals


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _tagged(tag: str) -> list[int]:
    """Live processes whose environment holds ``QSYNC_TEST_TAG=tag`` (our run's)."""
    found = []
    needle = f"QSYNC_TEST_TAG={tag}".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0") and _alive(int(d.name)):
            found.append(int(d.name))
    return found


def _wait_gone(pids: list[int], limit_s: float) -> list[int]:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _kill_all(pids: list[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


#: A stand-in for torchrun: starts a "rank" in its own session (as torchrun does), prints
#: both pids, and waits. The rank runs the runtime's parent watchdog, as a real rank does.
FAKE_TORCHRUN = textwrap.dedent("""
    import subprocess, sys, time
    rank = subprocess.Popen([sys.executable, "-c",
        "import time; from qsync_opt.job.launch import watch_parents; "
        "watch_parents(0); time.sleep(600)"], start_new_session=True,
        env=__import__("os").environ | {"TORCHELASTIC_RUN_ID": "x"})
    import os
    print("pids", os.getpid(), rank.pid, flush=True)
    time.sleep(600)
""")

LAUNCHER = textwrap.dedent("""
    import signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    from qsync_opt.job.launch import run_streaming
    import os
    rc, _ = run_streaming([sys.executable, "-c", sys.argv[1]], dict(os.environ))
    print("launcher returned", rc, flush=True)
""")


def _start_launcher(script: str, tag: str) -> tuple[subprocess.Popen[str], list[int]]:
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, script],
                            env=_env(QSYNC_TEST_TAG=tag), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until the fake torchrun runs (only a hang waits)
    assert line.startswith("pids"), (line, proc.poll())
    return proc, [int(x) for x in line.split()[1:]]


@pytest.mark.parametrize("sig", [
    signal.SIGTERM,
    pytest.param(signal.SIGINT, marks=pytest.mark.slow),
    pytest.param(signal.SIGKILL, marks=pytest.mark.slow),  # and with torchrun, below
])
@pytest.mark.slow
def test_the_child_and_its_ranks_die_with_the_launcher(sig: int) -> None:
    """SIGKILL: torchrun's parent-death signal and the rank's watchdog; SIGTERM and SIGINT:
    forwarded to torchrun's process group, then the launcher dies of the same signal."""
    tag = uuid.uuid4().hex
    proc, pids = _start_launcher(FAKE_TORCHRUN, tag)
    try:
        assert all(_alive(p) for p in pids)
        os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=60)  # only a hang reaches it
        assert proc.returncode == -sig, err
        if sig != signal.SIGKILL:
            assert err.count("\n") == 1 and signal.Signals(sig).name in err, err
        assert _wait_gone(pids, 10) == [], "a child outlived the launcher by 10 s"
    finally:
        _kill_all(_tagged(tag))


# ----------------------------------------------------------------------------- two ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(plan: Path, out: Path, steps: int, *extra: str, **env: str
           ) -> subprocess.CompletedProcess[str]:
    return _cli("train", "--model", "digits_cnn", "--plan", str(plan), "--nproc", "2",
                "--rank-groups", "0:cpu,1:cpu_2", "--steps", str(steps), "--out", str(out),
                "--backend", "gloo", "--timeout", str(COLLECTIVE_TIMEOUT_S), *extra, **env)


@pytest.mark.slow
@pytest.mark.xdist_group("gloo_straight")  # the session's run: made once
def test_two_gloo_ranks_killed_inside_a_save_resume_bit_for_bit(plan_path: Path,
                                                                 gloo_straight: Path,
                                                                 tmp_path: Path) -> None:
    """torchrun, two gloo ranks, a checkpoint every 2 steps: rank 0 dies in the save of step
    4 after writing its file, before the marker (the old layout left the ranks' files at
    steps 4 and 2 and the resume refused). The resume takes the set of step 2 on both ranks
    and ends equal to a run never stopped (the session's, same plan and flags): summaries,
    metrics and checkpoints, bit for bit."""
    straight = gloo_straight
    out = tmp_path / "killed"
    p = _train(plan_path, out, 6, "--checkpoint-every", "2", QSYNC_LOG_STATE_HASH="1",
               QSYNC_TEST_DIE_IN_SAVE="0:4")
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    torn = set_path(out, 4)
    assert (torn / "rank0.pt").is_file() and not (torn / "commit.json").exists()
    cs = latest_complete_set(out)
    assert cs is not None and cs.step == 2 and cs.world_size == 2
    p = _train(plan_path, out, 6, "--checkpoint-every", "2", QSYNC_LOG_STATE_HASH="1")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for r in (0, 1):
        s = json.loads((out / f"summary.rank{r}.json").read_text())
        want = json.loads((straight / f"summary.rank{r}.json").read_text())
        assert (s["resumed_from_step"], s["steps"]) == (2, 6)
        for key in ("state_sha256", "eval_per_rank", "final_loss", "loss_scale"):
            assert s[key] == want[key], (r, key)
        assert _untimed(_metrics(out, r)) == _untimed(_metrics(straight, r)), r
        assert_same_tree(_ckpt(out, r), _ckpt(straight, r), f"rank{r}")
    assert [s for s, _ in rc.step_folders(out)] == [6]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killing_qsync_opt_train_leaves_no_rank_alive(plan_path: Path, tmp_path: Path,
                                                      sig: int) -> None:
    """The campaign's fault: after SIGKILL or SIGTERM to `qsync-opt train`, torchrun and both
    ranks kept training. Now none of them is alive 10 s later."""
    tag = uuid.uuid4().hex
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "qsync_opt.cli", "train", "--model", "digits_cnn", "--plan",
           str(plan_path), "--nproc", "2", "--rank-groups", "0:cpu,1:cpu_2", "--steps",
           "1000000", "--out", str(out), "--backend", "gloo", "--timeout",
           str(COLLECTIVE_TIMEOUT_S)]
    proc = subprocess.Popen(cmd, env=_env(QSYNC_TEST_TAG=tag), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + RUN_LIMIT_S  # only a hang reaches it
        while not all((out / f"metrics.rank{r}.jsonl").is_file() and
                      (out / f"metrics.rank{r}.jsonl").stat().st_size > 0 for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < end, "the run did not train"
            time.sleep(0.2)
        run = [p for p in _tagged(tag) if p != proc.pid]
        assert len(run) >= 3  # torchrun and two ranks at least
        os.kill(proc.pid, sig)
        proc.wait(timeout=60)
        assert _wait_gone(run, 10) == [], "torchrun or a rank outlived the launcher by 10 s"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill_all(_tagged(tag))
    assert math.isfinite(_metrics(out, 0)[0]["loss"])
