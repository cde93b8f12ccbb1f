"""The runtime in parts: the gradient-sync seam's hooks, the fault plan handed to
the trainer, the loss scaler, the rank file's format, and the modules below the layers."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from qsync_opt import parse_shorthand, trace
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.job.rank import emulate
from qsync_opt.problem.plan import make_plan
from qsync_opt.runtime import checkpoint as ck
from qsync_opt.runtime import config as rc
from qsync_opt.runtime.config import TrainConfig
from qsync_opt.runtime.faults import ENV, NO_FAULTS, FaultPlan, parse_rank_steps
from qsync_opt.runtime.metrics import MetricsWriter, sync_totals
from qsync_opt.runtime.scaler import LossScaler, grads_finite
from qsync_opt.sync.replicas import EmulatedSync

STEPS = 4


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """digits_cnn on two groups, the second with fp16 (so the loss scale is dynamic)."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    make_plan(trace("digits_cnn"), parse_shorthand("cpux1@48+cpux1@16"),
              {"cpu_2": {"conv1": "bf16", "fc1": "fp16"}}).save(path)
    return path


pytestmark = pytest.mark.usefixtures("runtime_quiet")


def _config(plan: Path, out: Path, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(workload="digits_cnn", plan_path=str(plan),
                                rank_groups=["cpu", "cpu_2"], steps=STEPS, out_dir=str(out),
                                emulate_dp=True, eval_batches=0, timeout_s=20)
    base.update(kw)
    return TrainConfig(**base)


def _metrics(out: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in
            (out / f"metrics.rank{rank}.jsonl").read_text().splitlines()]


class RecordingSync(EmulatedSync):
    """The emulated all-reduce, recording every hook the trainer calls, with a state of its
    own (a step counter per replica) that goes through the checkpoint."""

    def __init__(self, world: int) -> None:
        super().__init__(world)
        self.calls: list[tuple[Any, ...]] = []
        self.seen: dict[int, int] = {}

    def wrap(self, model: nn.Module) -> nn.Module:
        self.calls.append(("wrap",))
        return model

    def before_backward(self, step: int, models: Sequence[nn.Module]) -> None:
        self.calls.append(("before_backward", step))

    def after_backward(self, step: int, models: Sequence[nn.Module]) -> None:
        assert all(p.grad is not None for m in models for p in m.parameters())
        self.calls.append(("after_backward", step))
        super().after_backward(step, models)

    def sum_stats(self, stats: Tensor) -> Tensor:
        self.calls.append(("sum_stats",))
        return super().sum_stats(stats)

    def after_step(self, step: int, models: Sequence[nn.Module], skipped: bool) -> None:
        self.calls.append(("after_step", step, skipped))
        for i in range(len(models)):
            self.seen[i] = self.seen.get(i, 0) + 1

    def sync_buffers(self, models: Sequence[nn.Module]) -> None:
        self.calls.append(("sync_buffers",))
        super().sync_buffers(models)

    def state_dict(self, replica: int) -> dict[str, Any]:
        self.calls.append(("state_dict", replica))
        return {"seen": self.seen.get(replica, 0)}

    def load_state_dict(self, replica: int, state: dict[str, Any]) -> None:
        self.calls.append(("load_state_dict", replica, dict(state)))
        if state:
            self.seen[replica] = int(state["seen"])


def _step_calls(step: int, skipped: bool = False) -> list[tuple[Any, ...]]:
    return [("before_backward", step), ("after_backward", step), ("sum_stats",),
            ("after_step", step, skipped), ("sync_buffers",)]


# ----------------------------------------------------------------------------- the sync seam


def test_the_sync_hooks_come_in_step_order_and_their_state_is_checkpointed(
        plan_path: Path, tmp_path: Path) -> None:
    sync = RecordingSync(2)
    out = tmp_path / "run"
    emulate(_config(plan_path, out, checkpoint_every=2), faults=NO_FAULTS, sync=sync)
    expected: list[tuple[Any, ...]] = [("wrap",), ("wrap",)]
    for step in range(STEPS):
        expected += _step_calls(step)
        if step + 1 in (2, STEPS):  # a checkpoint after steps 2 and 4: every replica's state
            expected += [("state_dict", 0), ("state_dict", 1)]
    assert sync.calls == expected
    # the mode's state is in each rank's file, next to the replica's rng and qseeds
    for r in (0, 1):
        path = ck.latest_checkpoint(out, r)
        assert path is not None
        rep = ck.load_checkpoint(path)["replicas"][0]
        assert rep["rank"] == r and rep["sync"] == {"seen": STEPS}

    # a resume hands it back, before the first step it runs
    again = RecordingSync(2)
    s = emulate(_config(plan_path, out, steps=STEPS + 2), faults=NO_FAULTS, sync=again)
    assert s["resumed_from_step"] == STEPS
    assert again.calls[:4] == [("wrap",), ("wrap",), ("load_state_dict", 0, {"seen": STEPS}),
                               ("load_state_dict", 1, {"seen": STEPS})]
    assert again.calls[4:9] == _step_calls(STEPS)
    assert again.seen == {0: STEPS + 2, 1: STEPS + 2}


def test_a_mode_without_state_writes_todays_rank_file(plan_path: Path, tmp_path: Path) -> None:
    """The default modes have no state: their rank files are format 2 exactly as before the
    seam (no ``sync`` entry), and a mode with state resumes from such a file with an empty
    state."""
    out = tmp_path / "run"
    emulate(_config(plan_path, out), faults=NO_FAULTS)
    path = ck.latest_checkpoint(out, 1)
    assert path is not None
    doc = ck.load_checkpoint(path)
    assert list(doc) == ["format", "step", "scale", "good", "bad_run", "skipped", "last_loss",
                         "model", "optimizer", "replicas"]
    assert doc["format"] == ck.FORMAT == 2
    assert [sorted(r) for r in doc["replicas"]] == [["qseeds", "rank", "rng"]]
    sync = RecordingSync(2)
    emulate(_config(plan_path, out, steps=STEPS + 1), faults=NO_FAULTS, sync=sync)
    assert ("load_state_dict", 0, {}) in sync.calls and ("load_state_dict", 1, {}) in sync.calls


# ----------------------------------------------------------------------------- faults


def test_the_fault_plan_is_handed_in_not_read_from_the_environment(
        plan_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sync = RecordingSync(2)
    s = emulate(_config(plan_path, tmp_path / "nan"),
                faults=FaultPlan(nan_at={1: frozenset({2})}), sync=sync)
    assert s["skipped_steps"] == 1 and s["loss_scale"] == 2.0 ** 15
    assert [r["skipped"] for r in _metrics(tmp_path / "nan", 0)] == [False, False, True, False]
    # the skipped step reaches the sync mode as skipped
    assert [c for c in sync.calls if c[0] == "after_step"] == [
        ("after_step", k, k == 2) for k in range(STEPS)]
    # an explicit plan wins over the environment: the step never reads it
    monkeypatch.setenv(ENV["nan_at"], "1:1,2")
    s = emulate(_config(plan_path, tmp_path / "none"), faults=NO_FAULTS)
    assert s["skipped_steps"] == 0


class _Died(BaseException):
    pass


def test_a_death_in_a_save_comes_from_the_plan(plan_path: Path, tmp_path: Path) -> None:
    codes: list[int] = []

    def die(code: int) -> None:
        codes.append(code)
        raise _Died

    out = tmp_path / "run"
    with pytest.raises(_Died):
        emulate(_config(plan_path, out, checkpoint_every=2),
                faults=FaultPlan(die_in_save={1: frozenset({2})}, exit=die))
    assert codes == [17]
    torn = rc.set_path(out, 2)
    assert (torn / "rank1.pt").is_file() and not (torn / rc.COMMIT_NAME).exists()
    assert rc.latest_complete_set(out) is None


def test_a_death_at_a_step_comes_from_the_plan() -> None:
    codes: list[int] = []
    plan = FaultPlan(die_at={0: frozenset({3})}, exit=codes.append)
    plan.at_step(1, 3)
    plan.at_step(0, 2)
    assert codes == []
    plan.at_step(0, 3)
    assert codes == [17]


def test_the_fault_plan_from_the_environment() -> None:
    env = {ENV["die_at"]: "1:3", ENV["nan_at"]: "0:2,4", ENV["die_in_save"]: "",
           "OTHER": "x"}
    plan = FaultPlan.from_env(env)
    assert plan.die_at == {1: frozenset({3})} and plan.nan_at == {0: frozenset({2, 4})}
    assert plan.hang_at == {} and plan.die_in_save == {} and not plan.empty
    assert plan.nan_loss(0, 4) and not plan.nan_loss(1, 4) and not plan.nan_loss(0, 3)
    assert FaultPlan.from_env({}).empty and NO_FAULTS.empty
    assert parse_rank_steps("2:7,", "X") == {2: frozenset({7})}
    for bad in ("3", "a:1", "1:", "1:2:3", "1,2"):
        with pytest.raises(QsyncInputError, match=f"{ENV['hang_at']}: expected RANK:STEP"):
            FaultPlan.from_env({ENV["hang_at"]: bad})


# ----------------------------------------------------------------------------- loss scaling


def _model_with_grads(*values: float) -> nn.Module:
    m = nn.Linear(len(values), 1, bias=False)
    m.weight.grad = torch.tensor([list(values)])
    return m


def test_a_scale_of_one_never_moves() -> None:
    s = LossScaler(1.0, growth_interval=2)
    assert not s.dynamic
    for skipped in (True, False, False, False, True):
        s.update(skipped)
        assert s.scale == 1.0
    m = _model_with_grads(2.0, 4.0)
    s.unscale_(m)
    assert m.weight.grad is not None and m.weight.grad.tolist() == [[2.0, 4.0]]


def test_a_dynamic_scale_halves_on_a_skip_and_doubles_after_good_steps() -> None:
    s = LossScaler(8.0, growth_interval=3, max_scale=32.0)
    assert s.dynamic
    s.update(skipped=True)
    assert (s.scale, s.good) == (4.0, 0)
    for _ in range(2):
        s.update(skipped=False)
    assert (s.scale, s.good) == (4.0, 2)
    s.update(skipped=False)
    assert (s.scale, s.good) == (8.0, 3)
    for _ in range(9):
        s.update(skipped=False)
    assert s.scale == 32.0  # capped
    for _ in range(10):
        s.update(skipped=True)
    assert s.scale == 1.0  # never below 1
    m = _model_with_grads(2.0, 4.0)
    s2 = LossScaler(4.0)
    s2.unscale_(m)
    assert m.weight.grad is not None and m.weight.grad.tolist() == [[0.5, 1.0]]


def test_the_scaler_counts_non_finite_gradients_and_losses() -> None:
    s = LossScaler(2.0 ** 16)
    good, bad = _model_with_grads(1.0, 2.0), _model_with_grads(1.0, math.inf)
    assert grads_finite(good) and not grads_finite(bad)
    assert not grads_finite(_model_with_grads(math.nan, 0.0))
    assert s.nonfinite([good, good], [0.5, 0.25]) == 0
    assert s.nonfinite([good, bad], [math.nan, 0.25]) == 2


def test_the_scalers_state_round_trips_as_the_checkpoint_holds_it() -> None:
    s = LossScaler(2.0 ** 16, growth_interval=2)
    s.update(skipped=True)
    s.update(skipped=False)
    state = s.state_dict()
    assert state == {"scale": 2.0 ** 15, "good": 1}
    t = LossScaler(2.0 ** 16, growth_interval=2)
    t.load_state_dict({**state, "bad_run": 0})  # a rank file holds other keys too
    t.update(skipped=False)
    assert (t.scale, t.good) == (2.0 ** 16, 2)


# ----------------------------------------------------------------------------- the layers below


def test_the_attention_decomposition_is_one_module_reexported() -> None:
    from qsync_opt.ops import attention, dispatch, gemm, layers

    for name in ("mha_forward", "sdpa_forward", "mha_gemms", "base_name", "MHA_GEMMS",
                 "SDPA_GEMMS"):
        assert getattr(dispatch, name) is getattr(attention, name), name
    for name in ("QMixin", "record_call", "run_gemm", "run_linear", "swappable_kind",
                 "COUNTERS"):
        assert getattr(layers, name) is getattr(gemm, name), name
    assert dispatch.RuntimeStep is gemm.RuntimeStep
    assert attention.base_name("enc.attn.qk_3") == "enc.attn.qk"


def test_the_watchdog_is_importable_from_the_launcher() -> None:
    from qsync_opt.job import launch
    from qsync_opt.runtime import watchdog

    assert launch.watch_parents is watchdog.watch_parents
    assert watchdog.pid_alive(__import__("os").getpid())


@pytest.mark.parametrize("junk", ['{"step": 1' + "0" * 5000 + "}", "[" * 100000,
                                  '{"step": "\u0663"}', '{"step": 1, "byt'])
def test_a_foreign_metrics_line_is_dropped_on_resume_and_skipped_in_the_totals(
        tmp_path: Path, junk: str) -> None:
    """The rows a resume keeps and the communication totals read past a line that is no
    row (an int too long for Python to convert, deep nesting, a unicode digit, a torn
    line), never a traceback."""
    path = tmp_path / "metrics.rank0.jsonl"
    rows = [json.dumps({"step": s, "bytes_sent": 10, "comm_ms": 1.0, "synced": True})
            for s in range(3)]
    path.write_text("\n".join([rows[0], junk, rows[1], rows[2]]) + "\n")
    assert sync_totals(path) == {"rounds": 3, "steps": 3, "bytes_sent": 30, "comm_ms": 3.0}
    MetricsWriter(path, 2).close()
    assert path.read_text() == rows[0] + "\n" + rows[1] + "\n"
