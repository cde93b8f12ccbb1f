"""``train --emulate-link``: the flag checked in one line (exit 2), the link recorded in the
run's config (round trip), said at launch, refused where it would do nothing; and on two real
gloo ranks (slow): every metrics row's ``link_ms`` is the formula over the step's real
bytes, the measured comm time holds it, fp16 halves the buckets' share, a resume under the
same link goes on, a pipeline's payload is charged its compressed bytes; without the flag
nothing changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from qsync_opt.models import get_workload

from qsync_opt.costs.cluster import load_cluster
from qsync_opt.costs.link import allreduce_s, broadcast_s, resolve_link, send_s
from qsync_opt.documents.io import load
from qsync_opt.documents.schemas import Plan, to_json
from qsync_opt.runtime.config import TrainConfig, run_fingerprint
from qsync_opt.runtime.faults import ENV
from support.harness import run_cli, run_rows

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("runtime_quiet")


def _dry(out: Path, *extra: str) -> tuple[int, str, str]:
    return run_cli("train", "--model", "digits_cnn", "--nproc", "2", "--out", str(out),
                   "--steps", "3", *extra, "--dry-run")


def test_the_link_is_recorded_in_the_config_and_said(tmp_path: Path) -> None:
    rc, out, err = _dry(tmp_path, "--emulate-link", "bw=1.25,latency_us=50")
    assert rc == 0, err
    assert "emulation: link emulated 1.25 GB/s, 50 us between the ranks" in out
    config = load(tmp_path / "train_config.json", TrainConfig)
    assert config.link is not None and config.link.source == "flag"
    assert (config.link.bandwidth_gb_per_s, config.link.latency_us) == (1.25, 50.0)
    assert config.link.rank_groups == config.rank_groups == ["cpu", "cpu"]
    again = TrainConfig.model_validate_json(to_json(config))
    assert again == config and again.link == config.link


def test_the_cluster_link_takes_the_plans_figures(tmp_path: Path) -> None:
    rc, out, err = _dry(tmp_path, "--cluster", "cpux1+cpu/2x1", "--emulate-link", "cluster")
    assert rc == 0, err
    config = load(tmp_path / "train_config.json", TrainConfig)
    cluster = load_cluster("cpux1+cpu/2x1")
    assert config.link == resolve_link("cluster", cluster, ["cpu", "cpu_2"])
    assert "emulation: link emulated 12.5 GB/s, 10 us (the plan's cluster)" in out


def test_without_the_flag_nothing_changes(tmp_path: Path) -> None:
    rc, out, err = _dry(tmp_path)
    assert rc == 0, err
    assert "emulation: link" not in out and "emulated" not in out
    assert load(tmp_path / "train_config.json", TrainConfig).link is None
    # the config is the one written before the link existed: no key for it
    assert "link" not in json.loads((tmp_path / "train_config.json").read_text())


@pytest.mark.parametrize("extra, says", [
    (("--emulate-link", ""), "argument --emulate-link: expected cluster"),
    (("--emulate-link", "bw=-1,latency_us=5"), "argument --emulate-link: bw must be"),
    (("--emulate-link", "bw=nan,latency_us=5"), "argument --emulate-link: bw must be"),
    (("--emulate-link", "bw=inf,latency_us=5"), "argument --emulate-link: bw must be"),
    (("--emulate-link", "bw=1e400,latency_us=5"), "argument --emulate-link: bw must be"),
    (("--emulate-link", "bw=٣,latency_us=5"), "argument --emulate-link: bw must be"),
    (("--emulate-link", "bw=1,latency_us=5,speed=9"), "unknown key 'speed'"),
    (("--emulate-link", "bw=0,latency_us=0"), "argument --emulate-link: bw must be"),
    (("--emulate-link", "cluster", "--emulate-dp"), "--emulate-link: only with ranks of "
                                                    "their own"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, extra: tuple[str, ...],
                                          says: str) -> None:
    rc, out, err = _dry(tmp_path, *extra)
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1 and says in lines[0], err
    assert not (tmp_path / "train_config.json").exists()


def test_one_rank_has_no_link_to_emulate(tmp_path: Path) -> None:
    rc, _, err = run_cli("train", "--model", "digits_cnn", "--nproc", "1", "--out",
                         str(tmp_path), "--emulate-link", "cluster", "--dry-run")
    assert rc == 2 and "--emulate-link: a run of one rank sends nothing" in err


def test_a_hand_edited_config_is_refused_naming_the_flag(tmp_path: Path) -> None:
    rc, _, err = _dry(tmp_path, "--emulate-link", "bw=1,latency_us=5")
    assert rc == 0, err
    doc = json.loads((tmp_path / "train_config.json").read_text())
    doc["link"]["rank_groups"] = ["cpu"]
    with pytest.raises(ValueError, match="--emulate-link: the link's ranks"):
        TrainConfig.model_validate(doc)
    doc["link"]["rank_groups"] = ["cpu", "cpu"]
    doc["link"]["latency_us"] = -1
    with pytest.raises(ValueError, match="latency_us"):
        TrainConfig.model_validate(doc)


def test_the_link_is_not_part_of_what_a_resume_must_match(tmp_path: Path) -> None:
    """The link changes the time of a run, never what it computes: a checkpoint resumes
    under the same link, another one or none."""
    rc, _, err = _dry(tmp_path, "--emulate-link", "bw=1,latency_us=5")
    assert rc == 0, err
    config = load(tmp_path / "train_config.json", TrainConfig)
    plan = Plan.load(config.plan_path)  # the fp32 plan the dry run wrote
    plain = config.model_copy(update={"link": None})
    assert run_fingerprint(config, plan) == run_fingerprint(plain, plan)


# ----------------------------------------------------------------------------- two gloo ranks


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "qsync_opt.cli", "train", "--model", "digits_cnn",
           "--nproc", "2", "--out", str(out), "--backend", "gloo", "--timeout", "300", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for var in ENV.values():
        env.pop(var, None)
    env.pop("QSYNC_LAUNCHER_PID", None)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


BW, LAT = 0.05, 500.0
LINK = f"bw={BW:g},latency_us={LAT:g}"


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _ddp_step_s(grad_bytes: int) -> float:
    """The link's time for one DDP step of digits_cnn on two ranks: its one bucket (under
    DDP's first 1 MiB), the 32-byte statistics, a broadcast per buffer dtype."""
    assert grad_bytes < 1 << 20
    by_dtype: dict[str, int] = {}
    for b in get_workload("digits_cnn").build().buffers():
        by_dtype[str(b.dtype)] = by_dtype.get(str(b.dtype), 0) + b.numel() * b.element_size()
    return (allreduce_s(grad_bytes, 2, BW, LAT) + allreduce_s(32, 2, BW, LAT)
            + sum(broadcast_s(n, 2, BW, LAT) for n in by_dtype.values()))


@pytest.mark.slow
def test_two_gloo_ranks_pay_the_link_fp16_half_and_resume_under_it(tmp_path: Path) -> None:
    out = tmp_path / "fp32"
    p = _train(out, "--steps", "2", "--emulate-link", LINK)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"(link emulated {BW:g} GB/s, {LAT:g} us)" in p.stdout
    resumed = _train(out, "--steps", "3", "--emulate-link", LINK)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2 and summary["link"] == "emulated 0.05 GB/s, 500 us"
    grad = 0
    for rank in (0, 1):
        rows = run_rows(out, rank)
        assert [r["step"] for r in rows] == [0, 1, 2]
        for r in rows:
            grad = r["bytes_allreduced"]
            assert r["link"] == "emulated 0.05 GB/s, 500 us"
            assert r["link_ms"] == _ms(_ddp_step_s(grad)), r
            assert r["comm_ms"] >= r["link_ms"] and r["step_ms"] >= r["link_ms"]
    half = tmp_path / "fp16"
    p = _train(half, "--steps", "2", "--comm", "fp16", "--emulate-link", LINK)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for r in run_rows(half, 0):
        assert r["bytes_allreduced"] == grad // 2
        assert r["link_ms"] == _ms(_ddp_step_s(grad // 2))
        assert r["comm_ms"] >= r["link_ms"]
    # the buckets' share of the delay: exactly half of fp32's bandwidth term
    fp32_rows, fp16_rows = run_rows(out, 0), run_rows(half, 0)
    assert fp32_rows[0]["link_ms"] - fp16_rows[0]["link_ms"] == pytest.approx(
        _ms(grad / 2 / (BW * 1e9)), abs=2e-3)


@pytest.mark.slow
def test_a_pipeline_payload_is_charged_its_compressed_bytes(tmp_path: Path) -> None:
    out = tmp_path / "pipe"
    p = _train(out, "--steps", "2", "--pipeline-stages", "2", "--compress-act", "quant:8",
               "--emulate-link", LINK)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["link"] == "emulated 0.05 GB/s, 500 us"
    (b,) = summary["boundaries"]
    act, grad = int(b["act_bytes_per_step"]), int(b["grad_bytes_per_step"])
    assert act < b["act_raw_bytes"] / 2 / 3  # 8-bit codes: a quarter of a step's fp32
    stats = 2 * allreduce_s(8, 2, BW, LAT)  # the skip flag and the loss, every step
    for rank, received in ((1, act), (0, grad)):  # each side pays what it receives
        for r in run_rows(out, rank):
            assert r["link"] == "emulated 0.05 GB/s, 500 us"
            assert r["link_ms"] == _ms(send_s(received, BW, LAT) + stats), (rank, r)
            assert r["step_ms"] >= r["link_ms"]
