"""Elastic runs end to end: two torchrun elastic agents on this machine (one per group of a
digits_cnn plan), a group removed and restored by the membership switch, and the bad cases.

The reference run (a graceful leave at step 3, the return at step 6) is made once; the
replays of the same schedule with a rank killed in a checkpoint's write, or in the re-plan,
must end with bit-identical weights and train every step exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qsync_opt.runtime.checkpoint import check_set_files
from qsync_opt.runtime.config import latest_complete_set
from qsync_opt.runtime.events import read_events

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
#: Only a hang reaches it.
RUN_LIMIT_S = 600
SCHEDULE = "cpu_2-@3,cpu_2+@6"
STEPS = 8


def _train(plan: Path, out: Path, *extra: str, steps: int = STEPS,
           **env: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "qsync_opt.cli", "train", "--model", "digits_cnn",
           "--plan", str(plan), "--steps", str(steps), "--out", str(out), "--elastic",
           "--checkpoint-every", "2", "--progress-every", "0", "--timeout", "120", *extra]
    full = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
                QSYNC_LOG_STATE_HASH="1", **env)
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=RUN_LIMIT_S)


def _steps(out: Path, rank: int = 0) -> list[int]:
    rows = [json.loads(x) for x in (out / f"metrics.rank{rank}.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows]


def _hashes(out: Path) -> list[str]:
    rows = [json.loads(x) for x in (out / "metrics.rank0.jsonl").read_text().splitlines()]
    return [r["state_sha256"] for r in rows]


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def reference(digits_mixed_plan: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("elastic") / "ref"
    r = _train(digits_mixed_plan, out, "--membership", SCHEDULE)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def test_a_group_leaves_and_returns_and_every_step_runs_once(reference: Path) -> None:
    events = read_events(reference)
    changes = [e for e in events if e["kind"] == "membership"]
    assert [(e["step"], e["old_groups"], e["new_groups"], e["lost_steps"]) for e in changes] == [
        (3, ["cpu", "cpu_2"], ["cpu"], 0), (6, ["cpu"], ["cpu", "cpu_2"], 0)]
    for e in changes:
        assert e["change_to_first_step_s"] is not None and e["change_to_first_step_s"] > 0
        assert e["old_predicted_ms"] > 0 and e["new_predicted_ms"] > 0
    worlds = [e for e in events if e["kind"] == "world"]
    assert [(e["step"], e["groups"]) for e in worlds] == [
        (0, ["cpu", "cpu_2"]), (3, ["cpu"]), (6, ["cpu", "cpu_2"])]
    assert [e["kind"] for e in events][-1] == "stop" and events[-1]["reason"] == "done"
    assert {e["step"] for e in events if e["kind"] == "checkpoint"} >= {3, 6, 8}
    assert _steps(reference) == list(range(STEPS))  # never back, never a step skipped
    assert _summary(reference)["steps"] == STEPS
    assert not (reference / "leave" / "cpu_2").exists()  # the request consumed


@pytest.mark.parametrize("fault", [{"QSYNC_TEST_DIE_IN_SAVE": "1:2"},
                                   {"QSYNC_TEST_DIE_IN_REPLAN": "1"}],
                         ids=["killed-in-checkpoint-write", "killed-in-replan"])
def test_a_replay_with_a_kill_is_bit_exact(reference: Path, digits_mixed_plan: Path,
                                           tmp_path: Path, fault: dict[str, str]) -> None:
    out = tmp_path / "replay"
    r = _train(digits_mixed_plan, out, "--membership", SCHEDULE, **fault)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (out / "elastic" / "fault-fired").exists()  # the kill did strike
    assert _steps(out) == list(range(STEPS))
    assert _hashes(out) == _hashes(reference)
    assert _summary(out)["state_sha256"] == _summary(reference)["state_sha256"]


def test_a_crash_loses_the_steps_after_the_checkpoint_and_no_more(digits_mixed_plan: Path,
                                                                   tmp_path: Path) -> None:
    out = tmp_path / "crash"
    r = _train(digits_mixed_plan, out, "--membership", "cpu_2-@3:crash,cpu_2+@5", steps=7)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    changes = [e for e in read_events(out) if e["kind"] == "membership"]
    assert [(e["step"], e["new_groups"], e["lost_steps"]) for e in changes] == [
        (2, ["cpu"], 1), (5, ["cpu", "cpu_2"], 0)]
    assert _steps(out) == list(range(7))


def test_all_groups_gone_stops_with_the_checkpoint_intact(digits_mixed_plan: Path,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "gone"
    r = _train(digits_mixed_plan, out, "--membership", "cpu-@3,cpu_2-@3",
               "--all-gone-timeout", "1", steps=6)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert "every group is gone" in last and "step 3" in last and "intact" in last, r.stderr
    stop = read_events(out)[-1]
    assert stop["kind"] == "stop" and "every group is gone" in stop["reason"]
    cs = latest_complete_set(out)
    assert cs is not None and cs.step == 3
    check_set_files(cs, "train")  # every rank file loads


def test_a_group_back_with_another_device_is_refused_by_name(digits_mixed_plan: Path,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "device"
    r = _train(digits_mixed_plan, out, "--membership", "cpu_2-@2,cpu_2+@4=cpu/3", steps=6)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = r.stdout + r.stderr
    assert "group cpu_2 returned with device cpu/3, it left with cpu: refused" in text
    worlds = [e["groups"] for e in read_events(out) if e["kind"] == "world"]
    assert ["cpu", "cpu_2"] not in worlds[1:]
    assert _steps(out) == list(range(6))


def _agent_pid(group: str) -> int | None:
    """The pid of the torchrun agent of ``group`` (its environment names the group; its
    command line runs torchrun), or None while there is none."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if f"QSYNC_NODE_GROUP={group}".encode() in env and b"torch.distributed.run" in cmd:
            return int(proc.name)
    return None


def test_sigterm_to_an_agent_is_a_graceful_leave(digits_mixed_plan: Path,
                                                 tmp_path: Path) -> None:
    """The inference service's signal: SIGTERM to the group's agent mid-run; its ranks
    checkpoint at the next step boundary, the others go on without it, no step lost."""
    out = tmp_path / "signal"
    cmd = [sys.executable, "-m", "qsync_opt.cli", "train", "--model", "digits_cnn",
           "--plan", str(digits_mixed_plan), "--steps", "400", "--out", str(out),
           "--elastic", "--checkpoint-every", "50", "--progress-every", "0"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + RUN_LIMIT_S
        metrics = out / "metrics.rank0.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
                break
            time.sleep(0.2)
        pid = _agent_pid("cpu_2")
        assert pid is not None and proc.poll() is None
        os.kill(pid, signal.SIGTERM)
        text, _ = proc.communicate(timeout=RUN_LIMIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, text[-3000:]
    changes = [e for e in read_events(out) if e["kind"] == "membership"]
    assert changes and changes[0]["new_groups"] == ["cpu"] and changes[0]["lost_steps"] == 0
    assert "the agent stops its ranks" in " ".join(changes[0]["reasons"])
    assert 5 <= changes[0]["step"] < 400
    assert _steps(out) == list(range(400))
