"""Online re-planning inside a running world and injected slowdowns (job/online.py).

The emulated runs here are in process, and their per-group compute time is made
deterministic (the group's stretch times a fixed figure, optionally with seeded noise or one
spike): what the detector, the re-plan and the switch do then depends on nothing timed.
The multi-process run (real sleeps, real gloo) is the slow test at the end.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from qsync_opt.models import get_workload

import qsync_opt as qs
from qsync_opt.cli.replanning import make_replanner
from qsync_opt.job.online import OnlineControl
from qsync_opt.job.rank import emulate
from qsync_opt.ops.layers import switch_precisions
from qsync_opt.planner.solve import solve
from qsync_opt.problem.plan import make_plan
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.problem.synthetic import random_indicator
from qsync_opt.runtime.checkpoint import qseeds
from qsync_opt.runtime.config import TrainConfig
from qsync_opt.runtime.events import read_events
from qsync_opt.runtime.metrics import state_hash
from qsync_opt.runtime.online import OnlineSpec, SlowdownInjection
from tests.support.harness import run_cli

REPO = Path(__file__).resolve().parents[2]
WINDOW, CALIBRATION = 3, 2


@pytest.fixture(autouse=True, scope="module")
def _fixed_cpu(fixed_cpu_module: Any) -> Any:
    return fixed_cpu_module


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A digits_cnn plan of cpu x1 and cpu/2 x1 (joint split, as a re-plan solves) and the
    random indicator it was made with."""
    folder = tmp_path_factory.mktemp("planned")
    graph = qs.trace("digits_cnn")
    cluster = qs.load_cluster("cpux1@32+cpu/2x1@32")
    ind = random_indicator(graph, 0)
    problem = AllocationProblem(graph, cluster, qs.estimate(graph, cluster), ind)
    plan, _ = solve(problem, "cpsat", refine=0, joint_split=True, compare_ties=False)
    plan.save(folder / "plan.json")
    ind.save(folder / "ind.json")
    return folder / "plan.json", folder / "ind.json"


def _config(planned: tuple[Path, Path], out: Path, steps: int, **online: Any) -> TrainConfig:
    plan, ind = planned
    spec = OnlineSpec(replan="auto", replan_window=WINDOW, replan_calibration=CALIBRATION,
                      indicator=str(ind), **online)
    return TrainConfig(workload="digits_cnn", plan_path=str(plan), rank_groups=["cpu", "cpu_2"],
                       steps=steps, out_dir=str(out), emulate_dp=True, eval_batches=1,
                       slowdown={"cpu_2": 2.0}, online=spec)


def _fake_compute(monkeypatch: pytest.MonkeyPatch,
                  shape: Callable[[int, str], float] = lambda step, g: 1.0) -> None:
    """Each rank's compute ms: its batch x its group's stretch now x ``shape(step, group)``
    (as compute is, proportional to the batch and the stretch)."""
    def own(self: OnlineControl) -> dict[int, float]:
        step = self.tr.step - 1
        return {r: self.tr.s.batches[r] * self.tr.stretch.get(g, 1.0) * shape(step, g)
                for r, g in enumerate(self.cfg.rank_groups)}

    monkeypatch.setattr(OnlineControl, "own_compute_ms", own)


def _kinds(out: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(out) if e["kind"] == kind]


def _batches(out: Path, rank: int) -> list[int]:
    rows = [json.loads(x) for x in (out / f"metrics.rank{rank}.jsonl").read_text().splitlines()]
    return [int(r["batch"]) for r in rows]


def test_an_injected_slowdown_is_replanned_within_window_plus_two(
        planned: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_compute(monkeypatch)
    at = 6
    cfg = _config(planned, tmp_path, 16,
                  inject_slowdown=[SlowdownInjection(group="cpu_2", step=at, factor=6.0)])
    summary = emulate(cfg, replanner=make_replanner)
    (slow,) = _kinds(tmp_path, "slowdown")
    assert (slow["step"], slow["group"], slow["old_factor"], slow["new_factor"]) == (
        at, "cpu_2", 2.0, 6.0)
    (rep,) = _kinds(tmp_path, "replan")  # one re-plan: no flip-flop afterwards
    assert at + WINDOW <= rep["step"] <= at + WINDOW + 2
    assert rep["groups"] == ["cpu_2"] and rep["factors"] == {"cpu_2": pytest.approx(3.0)}
    assert rep["new_predicted_ms"] < rep["old_predicted_ms"]
    assert rep["solve_s"] > 0 and rep["reason"]
    # the new plan's time per group, which the run's story shows for the phase it starts
    assert set(rep["predicted_group_ms"]) == {"cpu", "cpu_2"}
    assert all(v > 0 for v in rep["predicted_group_ms"].values())
    # the batch split moved at the step boundary, the global batch kept
    b0, b1 = _batches(tmp_path, 0), _batches(tmp_path, 1)
    start = json.loads(Path(cfg.plan_path).read_text())["groups"]["cpu_2"]["batch_per_device"]
    assert b1[:rep["step"]] == [start] * rep["step"]
    assert set(b1[rep["step"]:]) == {rep["batches"]["cpu_2"]} and rep["batches"]["cpu_2"] < start
    assert all(x + y == 64 for x, y in zip(b0, b1, strict=True))
    assert summary["batches"] == [rep["batches"]["cpu"], rep["batches"]["cpu_2"]]
    assert summary["online"] == {"replans": 1, "slowdown": {"cpu_2": pytest.approx(3.0)}}
    ran = qs.Plan.load(tmp_path / rep["plan"])  # the plan the run switched to, recorded
    assert {g: p.batch_per_device for g, p in ran.groups.items()} == rep["batches"]
    assert (tmp_path / "replan_cache.json").is_file()


def test_a_resume_runs_the_replanned_plan_bit_for_bit(
        planned: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped after the re-plan and resumed: the re-planned plan and the injected stretch
    are in force again, and the run ends as the uninterrupted one, bit for bit."""
    _fake_compute(monkeypatch)
    inject = [SlowdownInjection(group="cpu_2", step=6, factor=6.0)]
    whole = emulate(_config(planned, tmp_path / "whole", 16, inject_slowdown=inject),
                    replanner=make_replanner)
    emulate(_config(planned, tmp_path / "cut", 12, inject_slowdown=inject),
            replanner=make_replanner)
    again = emulate(_config(planned, tmp_path / "cut", 16, inject_slowdown=inject),
                    replanner=make_replanner)
    assert again["resumed_from_step"] == 12
    assert again["state_sha256"] == whole["state_sha256"]
    assert again["batches"] == whole["batches"] and again["online"] == whole["online"]
    assert _batches(tmp_path / "cut", 1)[-4:] == _batches(tmp_path / "whole", 1)[-4:]


def test_a_slowdown_that_goes_away_gives_the_first_plan_back(
        planned: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_compute(monkeypatch)
    inject = [SlowdownInjection(group="cpu_2", step=6, factor=6.0),
              SlowdownInjection(group="cpu_2", step=14, factor=2.0)]
    summary = emulate(_config(planned, tmp_path, 22, inject_slowdown=inject),
                      replanner=make_replanner)
    first, back = _kinds(tmp_path, "replan")
    assert first["groups"] == ["cpu_2"] and back["groups"] == ["cpu"]
    assert first["slowdown"] == {"cpu_2": pytest.approx(3.0)} and back["slowdown"] == {}
    start = json.loads(Path(planned[0]).read_text())["groups"]
    assert back["batches"] == {g: p["batch_per_device"] for g, p in start.items()}
    assert summary["online"] == {"replans": 2, "slowdown": {}}


def test_normalised_factors_are_relative_to_the_least_slowed_group() -> None:
    from qsync_opt.job.online import normalised

    assert normalised({"a": 3.0}, ["a", "b"]) == {"a": 3.0}
    assert normalised({"a": 3.0, "b": 3.0}, ["a", "b"]) == {}
    assert normalised({"a": 6.0, "b": 2.0}, ["a", "b"]) == {"a": 3.0}


def test_an_isolated_slow_step_never_replans(planned: tuple[Path, Path], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_compute(monkeypatch, lambda step, g: 8.0 if (step, g) in {(5, "cpu_2"),
                                                                     (9, "cpu")} else 1.0)
    emulate(_config(planned, tmp_path, 14), replanner=make_replanner)
    assert _kinds(tmp_path, "replan") == []


def test_noise_below_the_threshold_never_replans(planned: tuple[Path, Path], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(1)
    noise = {(s, g): rng.uniform(0.96, 1.04) for s in range(40) for g in ("cpu", "cpu_2")}
    _fake_compute(monkeypatch, lambda step, g: noise[(step, g)])
    cfg = _config(planned, tmp_path, 40)
    cfg = cfg.model_copy(update={"online": cfg.online.model_copy(  # type: ignore[union-attr]
        update={"replan_calibration": 5})})
    emulate(cfg, replanner=make_replanner)
    assert _kinds(tmp_path, "replan") == []


# ---------------------------------------------------------------- the switch in place


def _digits_plan(second: dict[str, str]) -> Any:
    return make_plan(qs.trace("digits_cnn"), qs.load_cluster("cpux1@16+cpux1@16"),
                     {"cpu_2": second})


def _trained(plan: Any, steps: int, switch_to: Any = None, at: int = 2
             ) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[dict[str, int]]]:
    """digits_cnn under ``plan``'s cpu_2 group, a few SGD steps on fixed data; switched to
    ``switch_to``'s precisions before step ``at``; the seeds before and after the switch."""
    from qsync_opt.runtime.apply import apply_plan

    torch.manual_seed(0)
    wl = get_workload("digits_cnn")
    model = wl.build().float()
    apply_plan(model, plan, "cpu_2", seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 1, 8, 8, generator=gen)
    y = torch.randint(0, 10, (16,), generator=gen)
    seeds = []
    for step in range(steps):
        if switch_to is not None and step == at:
            seeds.append(qseeds(model))
            switch_precisions(model, switch_to.groups["cpu_2"].precisions)
            seeds.append(qseeds(model))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt, seeds


def test_a_switch_keeps_weights_state_and_seeds_where_precision_is_kept() -> None:
    mixed = _digits_plan({"conv1": "bf16", "conv2": "int8", "fc1": "fp16"})
    # switching to the same precisions is no switch at all: bit for bit the same run
    a, _, _ = _trained(mixed, 5)
    b, _, _ = _trained(mixed, 5, switch_to=mixed)
    assert state_hash(a) == state_hash(b)
    # switching one op: nothing is re-made, only that op's precision changes
    torch.manual_seed(0)
    model, opt, _ = _trained(mixed, 2)
    params = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()}
    before = qseeds(model)
    changed = switch_precisions(model, _digits_plan(
        {"conv1": "bf16", "conv2": "int8", "fc1": "bf16"}).groups["cpu_2"].precisions)
    assert changed == ["fc1"]
    assert qseeds(model) == before
    for n, p in model.named_parameters():
        assert p is params[n][0] and torch.equal(p, params[n][1])
        assert all(torch.equal(opt.state[p][k], v) for k, v in state[id(p)].items())
    modules = dict(model.named_modules())
    assert str(modules["fc1"].precision) == "bf16" and str(modules["conv1"].precision) == "bf16"


def test_a_switch_refuses_an_op_the_plan_did_not_set_up() -> None:
    from qsync_opt.core.errors import QsyncInputError

    model = get_workload("digits_cnn").build()
    with pytest.raises(QsyncInputError, match="precisions: fc1: not an op the plan set up"):
        switch_precisions(model, {"fc1": "bf16"})


# ---------------------------------------------------------------- the flags


@pytest.mark.parametrize(("flags", "match"), [
    (["--replan", "maybe"], "--replan: invalid choice"),
    (["--replan-threshold", "nan"], "--replan-threshold"),
    (["--replan-threshold", "-0.1"], "--replan-threshold"),
    (["--replan-threshold", "1e400"], "--replan-threshold"),
    (["--replan-window", "0"], "--replan-window"),
    (["--replan-window", "٣"], "--replan-window"),
    (["--replan-window", "99999999999"], "--replan-window"),
    (["--replan-calibration", "-2"], "--replan-calibration"),
    (["--inject-slowdown", "cpu_2@3"], "--inject-slowdown: expected GROUP@STEP=FACTOR"),
    (["--inject-slowdown", "cpu_2@٣=2"], "--inject-slowdown: expected GROUP@STEP=FACTOR"),
    (["--inject-slowdown", "cpu_2@3=0.5"], "--inject-slowdown: factor 0.5 must be"),
    (["--inject-slowdown", "cpu_2@3=1e9"], "--inject-slowdown"),
    (["--inject-slowdown", "cpu_2@3=nan"], "--inject-slowdown"),
    (["--inject-slowdown", "cpu_2@99999999999=2"], "--inject-slowdown: step"),
    (["--inject-slowdown", "nope@3=2"], "--inject-slowdown: no group 'nope'"),
])
def test_hostile_flags_are_refused_in_one_line(planned: tuple[Path, Path], tmp_path: Path,
                                               flags: list[str], match: str) -> None:
    code, out, err = run_cli("train", "--model", "digits_cnn", "--plan", str(planned[0]),
                             "--emulate-dp", "--steps", "3", "--out", str(tmp_path / "o"),
                             "--dry-run", *flags)
    assert code == 2
    lines = [x for x in err.splitlines() if x.strip()]
    assert any(match in x for x in lines), err
    assert "Traceback" not in err


def test_a_missing_indicator_stops_the_run_in_one_line(planned: tuple[Path, Path],
                                                       tmp_path: Path) -> None:
    code, _, err = run_cli("train", "--model", "digits_cnn", "--plan", str(planned[0]),
                           "--emulate-dp", "--steps", "3", "--out", str(tmp_path),
                           "--replan", "auto", "--replan-indicator", str(tmp_path / "no.json"))
    assert code == 2
    assert "--replan auto: " in err and "no.json: file not found" in err
    assert "Traceback" not in err


def test_every_command_line_runs_the_worker_that_replans(planned: tuple[Path, Path],
                                                         tmp_path: Path) -> None:
    base = ("train", "--model", "digits_cnn", "--plan", str(planned[0]), "--steps", "3")
    code, out, _ = run_cli(*base, "--out", str(tmp_path / "a"), "--dry-run", "--replan", "auto")
    assert code == 0 and "-m qsync_opt.cli.replanning" in out
    assert "online: re-plan auto (a group 10% slower than calibrated on 20" in out
    code, out, _ = run_cli(*base, "--out", str(tmp_path / "b"), "--print-command",
                           "--replan", "auto")
    assert code == 0 and "-m qsync_opt.cli.replanning" in out
    code, out, _ = run_cli(*base, "--out", str(tmp_path / "c"), "--dry-run")
    assert code == 0 and "-m qsync_opt.job.rank" in out and "online:" not in out


def test_the_flags_default_to_off_and_write_nothing_new(planned: tuple[Path, Path],
                                                        tmp_path: Path) -> None:
    code, _, _ = run_cli("train", "--model", "digits_cnn", "--plan", str(planned[0]),
                         "--emulate-dp", "--steps", "3", "--out", str(tmp_path), "--dry-run")
    assert code == 0
    cfg = json.loads((tmp_path / "train_config.json").read_text())
    assert cfg["online"] is None


# ---------------------------------------------------------------- the multi-process run


@pytest.mark.slow
def test_a_multi_process_run_replans_an_injected_slowdown(planned: tuple[Path, Path],
                                                          tmp_path: Path) -> None:
    """Two gloo ranks, real sleeps: cpu_2's stretch 2 becomes 12 at step 4; the re-plan
    comes after the slowdown, within the window plus two steps, and every rank switches
    (one summary).

    Real timings are noisy (this test shares two cores with the suite's other worker).
    Calibrated on three steps (1-3, after the warm-up step 0), the detector first looks at
    step 4, where the slowdown starts: no step before it can join the run of slow steps (with
    two, step 3 was looked at, and a noisy one made the re-plan a step early). The median of
    three is robust to one odd step, and a threshold of +100% (the slowdown is x6) keeps
    the noise of the slow steps under it."""
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "qsync_opt.cli", "train", "--model", "digits_cnn", "--plan",
         str(planned[0]), "--steps", "12", "--out", str(out), "--replan", "auto",
         "--replan-window", str(WINDOW), "--replan-calibration", "3",
         "--replan-threshold", "1.0", "--replan-indicator", str(planned[1]),
         "--inject-slowdown", "cpu_2@4=12", "--timeout", "60"],
        env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "online: step 4: injected slowdown: group cpu_2 stretched x12" in proc.stdout
    reps = _kinds(out, "replan")
    assert reps and 4 + WINDOW <= reps[0]["step"] <= 4 + WINDOW + 2, reps
    b1 = _batches(out, 1)
    assert b1[reps[0]["step"]:] and set(b1[reps[0]["step"]:]) == {reps[0]["batches"]["cpu_2"]}
    assert json.loads((out / "summary.rank1.json").read_text())["batches"] == [
        reps[-1]["batches"]["cpu"], reps[-1]["batches"]["cpu_2"]]
