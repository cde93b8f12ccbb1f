"""Fused training arrays end to end (qsync_opt.hfta): a workload converted into a B-array
equals B separate models, in every mode; the torch.func route equals the fused one; a sweep
model equals its `train` run; a NaN stays in its model; exported models resume in `train`."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from qsync_opt.models import get_workload

from qsync_opt.cli import main
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.hfta.convert import fuse
from qsync_opt.hfta.functional import FuncArray
from qsync_opt.hfta.trainer import ArrayTrainer, SweepSpec, Variant
from support.harness import max_abs_diff, run_cli, run_params

#: one torch thread, as the ranks run (conftest)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _models(name: str, B: int) -> list[torch.nn.Module]:
    wl = get_workload(name)
    out = []
    for s in range(B):
        torch.manual_seed(s)
        out.append(wl.build().double().train())
    return out


def _inputs(name: str, B: int, n: int) -> torch.Tensor:
    wl = get_workload(name)
    torch.manual_seed(123)
    (x,) = wl.make_inputs(B * n, torch.device("cpu"))
    return x.double().view(B, n, *x.shape[1:])


def _grads(mods: list[torch.nn.Module]) -> list[dict[str, torch.Tensor]]:
    return [{k: p.grad.clone() for k, p in m.named_parameters()} for m in mods]


@pytest.mark.parametrize("name", ["digits_cnn", "digits_resnet"])
@pytest.mark.parametrize("mode", ["fused", "serial", "partial", "separate"])
def test_array_equals_separate_models(name, mode):
    """Forward, backward and BatchNorm's running statistics of the array equal B separate
    models (float64), fully fused, fully serial, partially fused (fused trunk, unfused head)
    and separate."""
    B = 3
    ref = _models(name, B)
    arr = fuse(_models(name, B))
    if mode == "serial":
        for op in arr.op_names:
            arr.set_mode(op, "serial")
    elif mode == "partial":
        heads = [op for op in arr.op_names if op.startswith("fc")]
        assert heads
        for op in heads:
            arr.set_mode(op, "serial")
    elif mode == "separate":
        arr.separate = True
    x = _inputs(name, B, 5)
    w = torch.randn(B, 5, 10, dtype=torch.float64)
    out = arr(x)
    (out * w).sum().backward()
    outs = []
    for b, m in enumerate(ref):
        y = m(x[b])
        (y * w[b]).sum().backward()
        outs.append(y)
    assert torch.allclose(out, torch.stack(outs), atol=1e-10, rtol=0)
    for b, g in enumerate(_grads(ref)):
        for k in g:  # the fused parameter's slice b holds model b's gradient
            target, _, leaf = k.rpartition(".")
            mine = getattr(arr.fused[target.replace(".", "__")], leaf).grad[b]
            assert torch.allclose(mine, g[k], atol=1e-10, rtol=0), k
        sd = arr.export(b).state_dict()  # weights and running statistics
        for k, v in ref[b].state_dict().items():
            assert torch.allclose(sd[k].double(), v.double(), atol=1e-12), k


def test_torch_func_route_equals_fused_route():
    B = 4
    arr = fuse(_models("digits_cnn", B))
    fa = FuncArray(_models("digits_cnn", B))
    x = _inputs("digits_cnn", B, 6)
    w = torch.randn(B, 6, 10, dtype=torch.float64)
    o1, o2 = arr(x), fa(x)
    assert torch.allclose(o1, o2, atol=1e-10, rtol=0)
    (o1 * w).sum().backward()
    (o2 * w).sum().backward()
    fused = dict(arr.named_parameters())
    for name, p in zip(fa.names, fa.params, strict=True):
        target, _, leaf = name.rpartition(".")
        q = fused[f"fused.{target.replace('.', '__')}.{leaf}"]
        assert torch.allclose(p.grad, q.grad, atol=1e-10, rtol=0), name
    bufs = dict(arr.named_buffers())
    for i, name in enumerate(fa.buffer_names):
        target, _, leaf = name.rpartition(".")
        mine = bufs[f"fused.{target.replace('.', '__')}.{leaf}"]
        theirs = getattr(fa, f"buf{i}")
        if mine.dim():
            assert torch.allclose(mine.double(), theirs.double(), atol=1e-12), name


def test_replicated_inputs_feed_every_model_the_same_batch():
    B = 3
    ref = _models("digits_cnn", B)
    arr = fuse(_models("digits_cnn", B), input_mode="replicated")
    x = _inputs("digits_cnn", 1, 4)[0]
    out = arr(x)
    assert torch.allclose(out, torch.stack([m(x) for m in ref]), atol=1e-10, rtol=0)


@pytest.mark.slow
def test_unsupported_models_are_refused_by_name():
    """vit_b16 reads its class token (a Parameter) outside a module: no fused form."""
    with pytest.raises(QsyncInputError, match="hfta: 'class_token' is a parameter"):
        fuse(_models("vit_b16", 2))


def _train_run(tmp: Path, seed: int, steps: int, lr: float, *extra: str) -> dict:
    out = tmp / f"train{seed}"
    code, _, err = run_cli("train", "--model", "digits_cnn", "--seed", str(seed), "--lr",
                           str(lr), "--steps", str(steps), "--out", str(out), "--emulate-dp",
                           *extra)
    assert code == 0, err
    return run_params(out, 0, buffers=True)


@pytest.mark.slow
def test_sweep_model_equals_its_train_run(tmp_path):
    """Model s of the sweep is `train --seed s --nproc 1`: same initial weights, same
    batches, same optimizer. Float32 sums reorder between a grouped and a plain
    convolution (1e-8 at the first step); at lr 0.01 over 20 steps they stay below 1e-7 (at
    lr 0.05 a ReLU/max-pool tie flipped at step 9 in one model and moved it by 7e-5)."""
    spec = SweepSpec("digits_cnn", [Variant(s, 0.01, 0.0) for s in (0, 1, 2)], steps=20)
    tr = ArrayTrainer(spec)
    tr.train()
    for s in (0, 2):
        ref = _train_run(tmp_path, s, 20, 0.01)
        assert max_abs_diff(tr.export(s).state_dict(), ref) <= 1e-5


def test_a_nan_stays_in_its_model():
    spec = SweepSpec("digits_cnn", [Variant(s, 0.05, 0.0) for s in (0, 1, 2)], steps=4)
    clean, dirty = ArrayTrainer(spec), ArrayTrainer(spec)
    before = None
    for step in range(4):
        clean.train_step()
        if step == 2:
            before = dirty.export(1).state_dict()
            dirty.train_step(poison=[1])
            after = dirty.export(1).state_dict()
            # model 1 untouched, BN running statistics included (num_batches_tracked is one
            # count shared by the array's models: it counts the array's steps)
            assert max_abs_diff({k: v for k, v in before.items() if "num_batches" not in k},
                             after) == 0.0
        else:
            dirty.train_step()
    assert dirty.skipped == [0, 1, 0] and clean.skipped == [0, 0, 0]
    for b in (0, 2):
        assert max_abs_diff(clean.export(b).state_dict(), dirty.export(b).state_dict()) == 0.0
    assert max_abs_diff(clean.export(1).state_dict(), dirty.export(1).state_dict()) > 0


def test_plan_precisions_reach_the_fused_ops(tmp_path):
    from qsync_opt.core.precision import Precision
    from qsync_opt.costs.cluster import parse_shorthand
    from qsync_opt.graph import trace
    from qsync_opt.problem.plan import make_plan

    plan = make_plan(trace("digits_cnn", 64), parse_shorthand("v100x1+t4x1"),
                     {"t4": {"conv2": "int8", "fc1": "fp16"}}, provenance={"solver": "test"})
    path = tmp_path / "p.json"
    plan.save(path)
    out = tmp_path / "sweep"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["sweep", "--model", "digits_cnn", "--seeds", "0-1", "--steps", "2",
                     "--plan", str(path), "--group", "t4", "--fuse", "fused",
                     "--out", str(out)]) == 0
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["group"] == "t4" and len(doc["models"]) == 2
    spec = SweepSpec("digits_cnn", [Variant(0, 0.05, 0.0), Variant(1, 0.05, 0.0)], steps=1,
                     precisions={"conv2": "int8", "fc1": "fp16"})
    tr = ArrayTrainer(spec)
    assert tr.array.fused["conv2"].precision == Precision.int8
    assert tr.array.fused["fc1"].precision == Precision.fp16
    assert tr.array.fused["conv1"].precision == Precision.fp32
    tr.train()
    assert all(x == x for x in tr.last_loss)  # finite


@pytest.mark.slow
def test_exported_models_resume_in_train(tmp_path):
    out = tmp_path / "sweep"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["sweep", "--model", "digits_cnn", "--seeds", "0-2", "--lr", "0.01",
                     "--steps", "5", "--out", str(out), "--export", "--fuse", "fused"]) == 0
    doc = json.loads((out / "sweep.json").read_text())
    assert len(doc["exported"]) == 3
    run = out / "model1"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", "--model", "digits_cnn", "--seed", "1", "--lr", "0.01",
                     "--steps", "10", "--out", str(run), "--emulate-dp"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from_step"] == 5
    resumed = run_params(run, 0, buffers=True)
    straight = _train_run(tmp_path, 1, 10, 0.01)
    assert max_abs_diff(resumed, straight) <= 1e-5


def test_time_pairs_alternate_the_order():
    from qsync_opt.hfta.choice import time_pairs

    calls: list[str] = []
    a, b = time_pairs(lambda: calls.append("a"), lambda: calls.append("b"), 4)
    assert len(a) == len(b) == 4
    assert calls == ["a", "b"] + ["a", "b", "b", "a", "a", "b", "b", "a"]  # warm-up, pairs


def test_time_pairs_go_on_alternating_after_the_first_pairs():
    from qsync_opt.hfta.choice import time_pairs

    calls: list[str] = []
    time_pairs(lambda: calls.append("a"), lambda: calls.append("b"), 2, first=3)
    assert calls == ["b", "a", "a", "b"]  # no warm-up; pair 3 is standalone-first


def _choice_on(monkeypatch, rounds: list[list[float]], B: int = 2):
    """measure_choice with the whole-step pairs replaced: each call of time_pairs gives
    the array 100 ms and the standalone models the next of ``rounds``; returns the choice
    and the calls' (reps, first)."""
    from qsync_opt.hfta import choice as ch
    from qsync_opt.hfta.trainer import per_model_losses

    calls: list[tuple[int, int]] = []

    def fake(f, g, reps, device=None, first=0):
        calls.append((reps, first))
        standalone = rounds[len(calls) - 1]
        assert len(standalone) == reps
        return [100.0] * reps, list(standalone)

    monkeypatch.setattr(ch, "time_pairs", fake)
    monkeypatch.setattr(ch, "time_step", lambda f, g, reps, device=None: (1.0, 2.0))
    tr = ArrayTrainer(SweepSpec("digits_cnn", [Variant(s, 0.05, 0.0) for s in range(B)],
                                steps=1, batch=4))
    x, y = tr.batch_at(0)
    c = ch.measure_choice(tr.array, x, lambda o: per_model_losses(tr.wl, o, x, y).sum(),
                          lambda o, b: tr.wl.loss_of(o, (), y[b]), reps=3)
    return c, calls


@pytest.mark.parametrize(("rounds", "separate", "pairs"), [
    # every pair 10-15% ahead: the array, on the first 3 pairs
    ([[112.0, 110.0, 115.0]], False, 3),
    # 3-4% ahead or behind, every pair under the margin: the standalone models, 3 pairs
    ([[103.0, 104.0, 90.0]], True, 3),
    ([[99.0, 98.0, 100.0]], True, 3),
    # a near tie (pairs on both sides of 1.05): timed again; 1 lost pair of 9, median 1.10
    ([[112.0, 95.0, 110.0], [111.0, 108.0, 113.0], [109.0, 112.0, 110.0]], False, 9),
    # a near tie where the array loses a third of the pairs: not taken, median 1.10 or not
    ([[112.0, 95.0, 110.0]] * 3, True, 9),
    # a near tie whose further pairs fall under the margin: median 1.02
    ([[112.0, 95.0, 110.0], [101.0, 102.0, 100.0], [103.0, 99.0, 102.0]], True, 9),
])
def test_the_array_is_taken_only_past_the_margin(monkeypatch, rounds, separate, pairs):
    """The standalone models are the one-by-one code itself: the array must beat them by
    ARRAY_MARGIN (median of the pairs' ratios) and lose at most a quarter of the pairs to be
    taken; a near tie is timed again, up to MAX_PAIRS_FACTOR times the first pairs."""
    import statistics

    from qsync_opt.hfta.choice import MAX_PAIRS_FACTOR

    c, calls = _choice_on(monkeypatch, rounds)
    ratios = [s / 100.0 for r in rounds for s in r][:pairs]
    assert c.separate is separate
    assert c.ratios == pytest.approx(ratios) and len(c.ratios) <= MAX_PAIRS_FACTOR * 3
    assert calls == [(3, 0), (3, 3), (3, 6)][:len(calls)] and 3 * len(calls) == pairs
    assert c.gain == pytest.approx(statistics.median(ratios))
    assert ("under the 5% margin" in c.summary()) is separate
    assert f"over {pairs} pairs" in c.summary()
    assert json.loads(json.dumps(c.to_json()))["ratios"] == [round(r, 4) for r in c.ratios]


def test_the_captured_inputs_are_let_go_before_the_whole_steps(monkeypatch):
    """Each op's captured input (together about a step's activations) is let go once its
    op is timed: none is alive while the whole steps are timed, nor after."""
    import gc
    import weakref

    from qsync_opt.hfta import choice as ch
    from qsync_opt.hfta.trainer import per_model_losses

    refs: list[weakref.ref] = []
    capture = ch._capture

    def watched(array, inputs):
        seen = capture(array, inputs)
        refs.extend(weakref.ref(t) for t in seen.values())
        return seen

    alive: list[int] = []
    pairs = ch.time_pairs

    def whole(f, g, reps, device=None, first=0):
        if not inop:
            gc.collect()
            alive.append(sum(r() is not None for r in refs))
        return pairs(f, g, reps, device, first)

    inop: list[bool] = []
    step = ch.time_step

    def per_op(f, g, reps, device=None):
        inop.append(True)
        try:
            return step(f, g, reps, device)
        finally:
            inop.pop()

    monkeypatch.setattr(ch, "_capture", watched)
    monkeypatch.setattr(ch, "time_pairs", whole)
    monkeypatch.setattr(ch, "time_step", per_op)
    tr = ArrayTrainer(SweepSpec("digits_cnn", [Variant(s, 0.05, 0.0) for s in range(2)],
                                steps=1, batch=4))
    x, y = tr.batch_at(0)
    c = ch.measure_choice(tr.array, x, lambda o: per_model_losses(tr.wl, o, x, y).sum(),
                          lambda o, b: tr.wl.loss_of(o, (), y[b]), reps=1)
    gc.collect()
    assert len(refs) == len(c.ops) == len(tr.array.op_names) and alive and set(alive) == {0}
    assert all(r() is None for r in refs)


def test_a_one_model_array_runs_standalone_untimed(monkeypatch):
    c, calls = _choice_on(monkeypatch, [], B=1)
    assert c.separate and not calls and not c.ops and not c.ratios
    assert c.summary().startswith("standalone: one model, nothing to fuse")
    assert json.loads(json.dumps(c.to_json()))["separate"] is True


def test_measured_choice_records_and_restores(capsys):
    from qsync_opt.hfta.choice import MAX_PAIRS_FACTOR, decide, measure_choice
    from qsync_opt.hfta.trainer import per_model_losses

    spec = SweepSpec("digits_cnn", [Variant(s, 0.05, 0.0) for s in range(4)], steps=1,
                     batch=8)
    tr = ArrayTrainer(spec)
    before = {k: v.clone() for k, v in tr.array.state_dict().items()}
    x, y = tr.batch_at(0)
    c = measure_choice(tr.array, x, lambda o: per_model_losses(tr.wl, o, x, y).sum(),
                       lambda o, b: tr.wl.loss_of(o, (), y[b]), reps=2)
    assert set(c.ops) == set(tr.array.op_names)
    for op, v in c.ops.items():
        assert v["fused_ms"] > 0 and v["serial_ms"] > 0
        assert tr.array.mode_of(op) == v["mode"] == ("fused" if v["fused_ms"] <= v["serial_ms"]
                                                     else "serial")
    assert c.array_ms > 0 and c.separate_ms > 0
    assert 2 <= len(c.ratios) <= 2 * MAX_PAIRS_FACTOR and c.gain > 0
    assert c.separate == (not decide(c.ratios))
    assert json.loads(json.dumps(c.to_json()))["separate"] == c.separate
    after = tr.array.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in tr.array.parameters())


@pytest.mark.parametrize("argv,needle", [
    (["--seeds", "3-1"], "--seeds"),
    (["--seeds", "0,0"], "--seeds: seed 0 is given twice"),
    (["--lr", "0,0.1"], "--lr"),
    (["--wd", "-1"], "--wd"),
    (["--plan", "x.json"], "--plan and --group"),
    (["--export"], "--export: needs --out"),
    (["--lr-schedule", "bogus"], "--lr-schedule"),
    (["--model", "nosuch"], "--model"),
    (["--device", "tpu"], "--device: expected cpu, cuda or cuda:N"),
    (["--device", "cuda:x"], "--device: expected cpu, cuda or cuda:N"),
])
def test_sweep_bad_input_is_one_line(capsys, argv, needle):
    base = ["sweep", "--model", "digits_cnn", "--steps", "1"]
    try:
        rc = main([*base, *argv])
    except SystemExit as exc:  # refused when parsed, by the flag's type
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.count("\n") == 1, err


def test_sweep_checks_memory_before_building(capsys, monkeypatch):
    import qsync_opt.hfta.sweep as sweep

    monkeypatch.setattr(sweep, "memory_capacity",
                        lambda plan, group, device=None: (10_000, "the test card"))
    built = []
    monkeypatch.setattr("qsync_opt.hfta.trainer.ArrayTrainer.__init__",
                        lambda self, spec: built.append(spec))
    rc = main(["sweep", "--model", "digits_cnn", "--seeds", "0-7", "--steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "memory: 8 models" in err and "the test card" in err, err
    assert not built


def test_load_standalone_models_into_an_array():
    arr = fuse(_models("digits_cnn", 2))
    others = _models("digits_cnn", 4)[2:]  # seeds 2 and 3
    arr.load_models(others)
    for b in range(2):
        sd = arr.export(b).state_dict()
        for k, v in others[b].state_dict().items():
            assert torch.equal(sd[k], v), k
    with pytest.raises(QsyncInputError, match="holds 2"):
        arr.load_models(others[:1])


@pytest.mark.slow
def test_standalone_fallback_equals_the_array(tmp_path):
    """Where the standalone models win the measurement, the sweep trains them one by one:
    the same models as the array trains (float32 reordering only), the same NaN rule, and
    their exports resume in `train` like the array's."""
    spec = SweepSpec("digits_cnn", [Variant(s, 0.01, 1e-4) for s in (0, 1, 2)], steps=6)
    fused, alone = ArrayTrainer(spec), ArrayTrainer(spec)
    alone.use_standalone()
    for step in range(6):
        poison = [2] if step == 3 else []
        fused.train_step(poison=poison)
        alone.train_step(poison=poison)
    assert alone.skipped == fused.skipped == [0, 0, 1]
    for b in range(3):  # (the array's num_batches_tracked counts its steps, skipped or not)
        mine = {k: v for k, v in alone.export(b).state_dict().items() if "num_batches" not in k}
        assert max_abs_diff(mine, fused.export(b).state_dict()) <= 1e-5
    ev_f, ev_a = fused.evaluate(), alone.evaluate()
    for a, b in zip(ev_f, ev_a, strict=True):
        assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-4
    out = tmp_path / "sweep"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["sweep", "--model", "digits_cnn", "--seeds", "0-1", "--lr", "0.01",
                     "--steps", "5", "--out", str(out), "--export", "--fuse", "separate"]) == 0
    run = out / "model1"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", "--model", "digits_cnn", "--seed", "1", "--lr", "0.01",
                     "--steps", "10", "--out", str(run), "--emulate-dp"]) == 0
    resumed = run_params(run, 0, buffers=True)
    assert max_abs_diff(resumed, _train_run(tmp_path, 1, 10, 0.01)) <= 1e-5


@pytest.mark.parametrize("name", ["digits_cnn", "tiny_gpt"])
def test_func_route_loads_and_exports_standalone_models(name):
    fa = FuncArray(_models(name, 2))
    others = _models(name, 4)[2:]
    fa.load_models(others)
    for b in range(2):
        sd = fa.export(b).state_dict()
        for k, v in others[b].state_dict().items():
            assert torch.equal(sd[k], v), k


def test_the_sweep_library_runs_without_a_parser(tmp_path):
    """``hfta.sweep.run_sweep`` is the sweep (the command is a thin layer over it): a
    request of plain values, its checks before any work, the document it returns."""
    from qsync_opt.hfta.sweep import SweepRequest, check_request, run_sweep

    said: list[str] = []
    req = SweepRequest(model="digits_cnn", seeds=[0, 1], lrs=[0.05], wds=[0.0], steps=2,
                       fuse="fused", eval_batches=1, out=str(tmp_path / "s"))
    doc = run_sweep(req, said.append)
    assert [m["seed"] for m in doc["models"]] == [0, 1] and doc["steps"] == 2
    assert json.loads((tmp_path / "s" / "sweep.json").read_text())["steps"] == 2
    assert any(line.startswith("sweep: 2 models of digits_cnn") for line in said)
    for bad, needle in ((dict(export=True, out=None), "--export"),
                        (dict(optimizer="adamw", momentum=0.5), "--momentum"),
                        (dict(lr_schedule="step:every=0"), "--lr-schedule")):
        with pytest.raises(QsyncInputError, match=needle):
            check_request(SweepRequest(**{**req.__dict__, **bad}))
