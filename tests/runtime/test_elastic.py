"""Elastic runs at unit level: the membership schedule and its hostile inputs, a resume that
may change the world and nothing else, a checkpoint mapped across world sizes, the
checkpoint interval, the launcher's bookkeeping files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from qsync_opt.cli.elastic import last_world, summary_line
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.documents.schemas import Plan
from qsync_opt.job.elastic import (
    ElasticTrainer,
    Node,
    WorldPlan,
    derived_rng,
    logical_order,
    world_plan,
)
from qsync_opt.job.elastic_launch import cluster_commands
from qsync_opt.job.launch import free_port
from qsync_opt.job.rank import build_model, emulate, load_checkpoint, prepare
from qsync_opt.runtime.checkpoint import qseeds
from qsync_opt.runtime.config import TrainConfig, check_resume, latest_complete_set
from qsync_opt.runtime.events import EventLog, read_events
from qsync_opt.runtime.membership import (
    ElasticSpec,
    checkpoint_interval,
    leave_requests,
    parse_endpoint,
    parse_membership,
    reset_run_state,
    take_exits,
    write_exit,
)
from qsync_opt.sync.replicas import make_sync
from support.harness import run_cli

GROUPS = ["cpu", "cpu_2"]


# ----------------------------------------------------------------------------- schedule


def test_membership_parses_in_step_order_with_modes() -> None:
    got = parse_membership("cpu_2+@9, cpu_2-@3:crash ,cpu-@5", GROUPS, 10)
    assert [(c.group, c.leave, c.step, c.mode) for c in got] == [
        ("cpu_2", True, 3, "crash"), ("cpu", True, 5, "graceful"), ("cpu_2", False, 9,
                                                                      "graceful")]
    assert [c.text() for c in got] == ["cpu_2-@3:crash", "cpu-@5:graceful", "cpu_2+@9"]


@pytest.mark.parametrize(("text", "why"), [
    ("", "empty value"), ("   ", "empty value"), ("cpu", "expected GROUP-@STEP"),
    ("cpu-3", "expected GROUP-@STEP"), ("cpu-@", "expected GROUP-@STEP"),
    ("cpu-@-3", "expected GROUP-@STEP"), ("cpu-@3.5", "expected GROUP-@STEP"),
    ("cpu-@１", "printable ASCII"), ("cpu-@٣", "printable ASCII"),
    ("cpu-@3\n", "printable ASCII"), ("cpu-@" + "9" * 12, "expected GROUP-@STEP"),
    ("cpu-@3:boom", "expected GROUP-@STEP"), ("cpu+@3:crash", "a return has no mode"),
    ("gpu-@3", "no group 'gpu'"), ("cpu-@0", "at least 1"), ("cpu-@10", "below --steps 10"),
    ("cpu+@3", "returns before leaving"), ("cpu-@3,cpu-@5", "leaves again"),
    ("cpu-@5,cpu+@5", "increasing steps"), ("cpu-@5,cpu+@4", "returns before leaving"),
    (",".join(["cpu-@1", "cpu+@2"] * 40), "at most 64 changes"), ("x" * 5000, "at most 4096"),
    ("cpu-@3,,cpu+@5", "expected GROUP-@STEP"),
])
def test_membership_refuses_hostile_text_naming_the_flag(text: str, why: str) -> None:
    with pytest.raises(QsyncInputError) as e:
        parse_membership(text, GROUPS, 10)
    msg = str(e.value)
    assert msg.startswith("--membership: ") and why in msg and "\n" not in msg


@pytest.mark.parametrize("argv", [
    ("--membership", "cpu-@2"),  # without --elastic
    ("--elastic", "--membership", "cpu-@0"), ("--elastic", "--membership", "gpu-@2"),
    ("--elastic", "--max-lost-s", "0"), ("--elastic", "--max-lost-s", "nan"),
    ("--elastic", "--max-lost-s", "-1"), ("--elastic", "--all-gone-timeout", "inf"),
    ("--elastic", "--max-restarts", "-1"), ("--elastic", "--max-restarts", "1e9"),
    ("--elastic", "--sync", "local:2"), ("--elastic", "--emulate-dp"),
    ("--rdzv-endpoint", "head:29400"),  # without --elastic
    ("--elastic", "--rdzv-endpoint", "head:29400"),  # without --print-command: ignored else
    ("--elastic", "--print-command", "--rdzv-endpoint", "head:0"),
    ("--elastic", "--print-command", "--rdzv-endpoint", "head:٣"),
    ("--elastic", "--print-command", "--rdzv-endpoint", "$(reboot):1"),
    ("--elastic", "--inject-slowdown", "cpu_2@3=nan"),
])
def test_train_elastic_flags_refused_in_one_line_before_writing(argv: tuple[str, ...],
                                                                tmp_path: Path) -> None:
    out = tmp_path / "run"
    code, _, err = run_cli("train", "--model", "digits_cnn", "--cluster", "cpux1+cpu/2x1",
                           "--steps", "6", "--out", str(out), "--dry-run", *argv)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert not (out / "train_config.json").exists()


@pytest.mark.parametrize("text", ["head:29400", "10.0.0.1:1", "[::1]:65535", "a.b-c.example:80",
                                  "h" * 253 + ":29400"])
def test_an_endpoint_is_host_and_port(text: str) -> None:
    assert parse_endpoint(text) == text


@pytest.mark.parametrize("text", [
    "", "head", "head:", ":29400", "head:0", "head:65536", "head:-1", "head:29400x",
    "head:٣٣", "héad:1", "a b:1", "head:29400;rm -rf /", "$(x):1", "-head:1", "[zz]:1",
    "h" * 300 + ":1", "head:1\n", "head:" + "9" * 50,
])
def test_a_hostile_endpoint_is_refused_naming_the_flag(text: str) -> None:
    with pytest.raises(QsyncInputError) as e:
        parse_endpoint(text)
    msg = str(e.value)
    assert msg.startswith("--rdzv-endpoint: expected HOST:PORT") and "\n" not in msg
    assert len(msg) < 400


@pytest.mark.parametrize(("flag", "value"), [
    ("--rdzv-endpoint", "head:0"), ("--inject-slowdown", "cpu_2@3=0.5"),
    ("--membership", "cpu-@x"), ("--sync", "local:0"), ("--comm", "dlcp:p=2"),
])
def test_a_refused_spec_flag_is_named_once(flag: str, value: str, tmp_path: Path) -> None:
    code, _, err = run_cli("train", "--model", "digits_cnn", "--cluster", "cpux1+cpu/2x1",
                           "--steps", "6", "--out", str(tmp_path / "run"), "--dry-run",
                           "--elastic", "--print-command", flag, value)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.count(flag) == 1, err


def test_the_printed_cluster_commands_carry_the_endpoint(tmp_path: Path) -> None:
    code, out, err = run_cli("train", "--model", "digits_cnn", "--cluster", "cpux1+cpu/2x1",
                             "--steps", "6", "--out", str(tmp_path / "run"), "--elastic",
                             "--print-command", "--rdzv-endpoint", "[fd00::1]:29500")
    assert code == 0, err
    assert "--store '[fd00::1]:29500'" in out and "--rdzv-endpoint '[fd00::1]:29500'" in out


def test_an_elastic_run_takes_its_replan_indicator(tmp_path: Path) -> None:
    """``--replan-indicator`` reaches the elastic run's re-plan problem (it was ignored: a
    missing file passed); a bad one is refused before the commands are printed."""
    out = tmp_path / "run"
    code, got, err = run_cli("train", "--model", "digits_cnn", "--cluster", "cpux1+cpu/2x1",
                             "--steps", "6", "--out", str(out), "--elastic", "--print-command",
                             "--replan", "auto", "--replan-indicator",
                             str(tmp_path / "missing.json"))
    assert code == 2 and "missing.json" in err and len(err.strip().splitlines()) == 1, err
    assert "torch.distributed.run" not in got and not (out / "elastic" / "spec.json").exists()


def test_the_store_host_refuses_a_bad_or_taken_address_in_one_line() -> None:
    cmd = [sys.executable, "-m", "qsync_opt.job.elastic_launch", "--store"]
    bad = subprocess.run([*cmd, "head:99999"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert "--rdzv-endpoint: expected HOST:PORT" in bad.stderr
    port = free_port()
    taken = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    try:
        got = subprocess.run([*cmd, f"elsewhere.invalid:{port}"], capture_output=True,
                             text=True, timeout=120)
    finally:
        del taken
    line = [x for x in got.stderr.splitlines() if x.startswith("qsync-opt")]
    assert got.returncode == 1 and len(line) == 1, got.stderr
    assert f"cannot host the rendezvous store at elsewhere.invalid:{port}" in line[0]
    assert "Traceback" not in got.stderr


def test_elastic_needs_one_rank_per_device(tmp_path: Path) -> None:
    code, _, err = run_cli("train", "--model", "digits_cnn", "--cluster", "cpux2",
                           "--nproc", "1", "--rank-groups", "0:cpu", "--steps", "4",
                           "--out", str(tmp_path / "r"), "--elastic", "--dry-run")
    assert code == 2 and "one rank per device" in err, err


def test_checkpoint_interval_bounds_the_work_lost() -> None:
    assert checkpoint_interval(0.1, 30.0) == 300
    assert checkpoint_interval(40.0, 30.0) == 1  # a step longer than the budget: every step
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        assert checkpoint_interval(bad, 30.0) == 1
    for step_s in (0.013, 0.5, 2.9):
        n = checkpoint_interval(step_s, 30.0)
        assert n * step_s <= 30.0 < (n + 1) * step_s


# ----------------------------------------------------------------------------- files


def test_leave_requests_read_steps_and_ignore_strangers(tmp_path: Path) -> None:
    (tmp_path / "leave").mkdir()
    (tmp_path / "leave" / "cpu").write_text("12\n")
    (tmp_path / "leave" / "cpu_2").write_text("whenever")
    (tmp_path / "leave" / "gpu").write_text("3")
    assert leave_requests(tmp_path, GROUPS) == {"cpu": 12, "cpu_2": None}
    assert leave_requests(tmp_path / "nowhere", GROUPS) == {}


def test_exit_records_are_taken_once(tmp_path: Path) -> None:
    write_exit(tmp_path, 0, 7, "graceful leave of cpu_2", GROUPS)
    write_exit(tmp_path, 1, 7, "graceful leave of cpu_2", GROUPS)
    (tmp_path / "elastic" / "exit.rank9.json").write_text("{not json")
    got = take_exits(tmp_path)
    assert sorted(e["step"] for e in got) == [7, 7]
    assert take_exits(tmp_path) == []


def test_logical_order_is_the_plans_whatever_the_rendezvous() -> None:
    a = [Node(0, "cpu_2", 0, "cpu/2"), Node(1, "cpu", 1, "cpu"), Node(2, "cpu", 0, "cpu")]
    b = [Node(0, "cpu", 0, "cpu"), Node(1, "cpu", 1, "cpu"), Node(2, "cpu_2", 0, "cpu/2")]
    def key(nodes: list[Node]) -> list[tuple[str, int]]:
        return [(n.group, n.local) for n in logical_order(nodes, GROUPS)]
    assert key(a) == key(b) == [("cpu", 0), ("cpu", 1), ("cpu_2", 0)]


# ----------------------------------------------------------------------------- resume


def _config(plan: Path, out: Path, **kw: object) -> TrainConfig:
    base: dict[str, object] = dict(workload="digits_cnn", plan_path=str(plan),
                                   rank_groups=GROUPS, steps=6, out_dir=str(out),
                                   eval_batches=1, timeout_s=20, checkpoint_every=3)
    base.update(kw)
    return TrainConfig(**base)  # type: ignore[arg-type]


def _elastic_fingerprinted(cfg: TrainConfig, out: Path) -> None:
    """Mark ``out``'s newest set as an elastic run's (its commit's fingerprint)."""
    cs = latest_complete_set(out)
    assert cs is not None
    doc = json.loads((cs.path / "commit.json").read_text())
    doc["run"]["elastic"] = True
    (cs.path / "commit.json").write_text(json.dumps(doc))


@pytest.fixture(scope="module")
def two_rank_set(digits_mixed_plan: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint set of a two-rank world (cpu fp32, cpu_2 mixed precision) at step 3."""
    out = tmp_path_factory.mktemp("two")
    emulate(_config(digits_mixed_plan, out, steps=3, emulate_dp=True))
    _elastic_fingerprinted(_config(digits_mixed_plan, out), out)
    return out


def test_an_elastic_resume_accepts_another_world_and_nothing_else(
        digits_mixed_plan: Path, two_rank_set: Path) -> None:
    one = _config(digits_mixed_plan, two_rank_set, rank_groups=["cpu_2"], elastic=True)
    cs = check_resume(one, Plan.load(digits_mixed_plan))
    assert cs is not None and cs.step == 3
    with pytest.raises(QsyncInputError, match=r"--lr 0\.05 -> 0\.1"):
        check_resume(one.model_copy(update={"lr": 0.1}), Plan.load(digits_mixed_plan))
    with pytest.raises(QsyncInputError, match="--seed"):
        check_resume(one.model_copy(update={"seed": 4}), Plan.load(digits_mixed_plan))
    plain = _config(digits_mixed_plan, two_rank_set, rank_groups=["cpu_2"])
    with pytest.raises(QsyncInputError, match="world size 2 -> 1"):
        check_resume(plain, Plan.load(digits_mixed_plan))


def _trainer(plan: Path, out: Path, groups: list[str]) -> ElasticTrainer:
    cfg = _config(plan, out, rank_groups=groups, elastic=True)
    setup = prepare(cfg)
    models = [build_model(setup, r, torch.device("cpu")) for r in range(len(groups))]
    sync = make_sync(cfg, len(groups), torch.device("cpu"), emulated=True,
                     cluster=setup.plan.cluster, setup=setup)
    spec = ElasticSpec(groups=GROUPS, ranks={g: 1 for g in GROUPS},
                       devices={"cpu": "cpu", "cpu_2": "cpu"}, replan_cache="unused")
    wp = WorldPlan(Plan.load(plan), 1.0)
    return ElasticTrainer(setup, list(range(len(groups))), models, sync,
                          torch.device("cpu"), spec=spec, world_plan=wp, events=None)


def test_a_checkpoint_maps_onto_a_smaller_and_a_larger_world(digits_mixed_plan: Path,
                                                            two_rank_set: Path) -> None:
    cs = latest_complete_set(two_rank_set)
    assert cs is not None
    old = [load_checkpoint(cs.rank_file(r)) for r in (0, 1)]
    # one world of cpu_2 alone: weights and optimizer from the old world's (equal) replicas,
    # its own place (cpu_2, local 0) existed: its RNG and quantisation seeds kept
    small = _trainer(digits_mixed_plan, two_rank_set, ["cpu_2"])
    small.restore(cs)
    assert small.step == 3
    for k, v in small.models[0].state_dict().items():
        assert torch.equal(v, old[1]["model"][k]) and torch.equal(v, old[0]["model"][k]), k
    assert torch.equal(small.rngs[0], old[1]["replicas"][0]["rng"])
    assert qseeds(small.models[0]) == old[1]["replicas"][0]["qseeds"]
    opt_state = small.opts[0].state_dict()["state"]
    for i, st in old[0]["optimizer"]["state"].items():
        assert torch.equal(opt_state[i]["momentum_buffer"], st["momentum_buffer"])
    # three ranks: a second cpu rank had no place in the old world: derived, deterministic
    big = _trainer(digits_mixed_plan, two_rank_set, ["cpu", "cpu", "cpu_2"])
    big.restore(cs)
    assert torch.equal(big.rngs[0], old[0]["replicas"][0]["rng"])
    assert torch.equal(big.rngs[1], derived_rng(0, 3, 1))
    assert not torch.equal(big.rngs[1], big.rngs[0])
    again = _trainer(digits_mixed_plan, two_rank_set, ["cpu", "cpu", "cpu_2"])
    again.restore(cs)
    assert torch.equal(again.rngs[1], big.rngs[1])
    assert qseeds(again.models[1]) == qseeds(big.models[1])
    for m in big.models:
        for k, v in m.state_dict().items():
            assert torch.equal(v, old[0]["model"][k]), k


def test_no_plan_for_the_survivors_stops_with_the_checkpoint_intact(
        digits_mixed_plan: Path, two_rank_set: Path, tmp_path: Path) -> None:
    """The re-plan refuses (the survivors cannot hold the global batch): every rank gets
    None, rank 0 writes the ``stop`` event naming the groups and what lacks, the newest
    checkpoint set is untouched."""
    out = tmp_path / "run"
    shutil.copytree(two_rank_set, out)
    before = {p.name: p.read_bytes() for p in latest_complete_set(out).path.iterdir()}  # type: ignore[union-attr]
    cfg = _config(digits_mixed_plan, out, elastic=True)
    spec = ElasticSpec(groups=GROUPS, ranks={g: 1 for g in GROUPS},
                       devices={"cpu": "cpu", "cpu_2": "cpu"}, replan_cache="unused")
    why = ("global_batch: no plan of cpu_2 holds the global batch 64: cpu_2 needs 17.2 GiB "
           "at its least, has 16 GiB")

    def refuse(groups: list[str], global_batch: int) -> WorldPlan:
        assert groups == ["cpu_2"] and global_batch == 64
        raise QsyncInputError(why)

    store = dist.HashStore()
    assert world_plan(store, cfg, spec, ["cpu_2"], 0, refuse) is None
    assert world_plan(store, cfg, spec, ["cpu_2"], 1, refuse) is None  # the answer, read
    stop = read_events(out)[-1]
    assert stop["kind"] == "stop" and stop["step"] == 3
    assert "no plan fits the groups present (cpu_2)" in stop["reason"] and why in stop["reason"]
    cs = latest_complete_set(out)
    assert cs is not None and cs.step == 3
    assert {p.name: p.read_bytes() for p in cs.path.iterdir()} == before


def test_the_cluster_commands_host_the_store_apart_and_name_each_group(tmp_path: Path) -> None:
    spec = ElasticSpec(groups=["v100", "t4"], ranks={"v100": 8, "t4": 4},
                       devices={"v100": "v100", "t4": "t4"}, replan_cache="unused")
    lines = cluster_commands(spec, tmp_path / "train_config.json", "run-1", 100,
                             "head:29400")
    assert "python -m qsync_opt.job.elastic_launch --store head:29400" in lines
    agents = [x for x in lines if "torch.distributed.run" in x]
    assert len(agents) == 2
    for group, n in (("v100", 8), ("t4", 4)):
        line = next(x for x in agents if f"QSYNC_NODE_GROUP={group} " in x)
        for part in ("--nnodes 1:2", f"--nproc-per-node {n}", "--rdzv-backend c10d",
                     "--rdzv-endpoint head:29400", "--rdzv-id run-1", "is_host=false",
                     "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", "-m qsync_opt.cli.elastic"):
            assert part in line, (part, line)


def test_the_store_host_serves_until_stopped() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "qsync_opt.job.elastic_launch", "--store",
                             f"127.0.0.1:{port}"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and "rendezvous store" in proc.stdout.readline()
        client = dist.TCPStore("127.0.0.1", port, is_master=False,
                               timeout=timedelta(seconds=30))
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        proc.kill()
        proc.wait()
    bad = subprocess.run([sys.executable, "-m", "qsync_opt.job.elastic_launch", "--store"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_a_launch_clears_what_an_earlier_launch_left(tmp_path: Path) -> None:
    write_exit(tmp_path, 0, 5, "graceful leave of cpu_2", GROUPS)
    (tmp_path / "elastic" / "world.json").write_text("{}")
    (tmp_path / "elastic" / "fault-fired").write_text("17\n")
    (tmp_path / "elastic" / "spec.json").write_text("{}")
    (tmp_path / "leave").mkdir()
    (tmp_path / "leave" / "cpu_2").write_text("")
    (tmp_path / "events.jsonl").write_text("")
    reset_run_state(tmp_path, GROUPS)
    assert sorted(p.name for p in (tmp_path / "elastic").iterdir()) == ["spec.json"]
    assert leave_requests(tmp_path, GROUPS) == {}
    assert (tmp_path / "events.jsonl").exists()


@pytest.mark.parametrize(("every_flag", "chosen", "says"), [
    (0, 120, "a checkpoint every 120 step(s) (chosen from the last world's measured step "
             "time: at most 30 s of work lost to a crash)"),
    (5, 5, "a checkpoint every 5 step(s) (--checkpoint-every)"),
    (0, 0, "no checkpoint interval chosen in the last world"),
])
def test_the_summary_says_the_changes_the_steps_lost_and_the_interval(
        digits_mixed_plan: Path, tmp_path: Path, every_flag: int, chosen: int,
        says: str) -> None:
    cfg = _config(digits_mixed_plan, tmp_path, elastic=True, checkpoint_every=every_flag)
    (tmp_path / "summary.json").write_text(json.dumps({"checkpoint_every": chosen,
                                                       "max_lost_s": 30.0}))
    with EventLog(tmp_path) as ev:
        for lost in (0, 3):
            ev.write("membership", 4, old_groups=GROUPS, new_groups=["cpu"],
                     old_predicted_ms=2.0, new_predicted_ms=3.0, change_to_first_step_s=5.0,
                     lost_steps=lost)
    line = summary_line(cfg)
    assert line is not None and "2 membership change(s), 3 step(s) lost" in line
    assert says in line
    assert summary_line(_config(digits_mixed_plan, tmp_path / "none", elastic=True)) is None


def test_the_summary_line_names_the_last_worlds_ranks(digits_mixed_plan: Path,
                                                       tmp_path: Path) -> None:
    cfg = _config(digits_mixed_plan, tmp_path, elastic=True)
    assert last_world(cfg).rank_groups == GROUPS  # no summary yet: the launch's
    (tmp_path / "summary.json").write_text(json.dumps({"rank_groups": ["cpu"]}))
    assert last_world(cfg).rank_groups == ["cpu"]
    (tmp_path / "summary.json").write_text(json.dumps({"rank_groups": [3]}))
    assert last_world(cfg).rank_groups == GROUPS
