"""The fused arrays on a CUDA device (``sweep --device cuda``), and the timing of the
fuse-or-not choice there.

Without a CUDA device the GPU tests skip; what is checked on every machine: the timings of
the choice wait for a CUDA device's queue (a CUDA kernel runs after its launch returns, so a
wall clock that does not wait times the launches), and ``--device`` is refused with one line
where it names no device this process has.
"""

from __future__ import annotations

import json

import pytest
import torch
from qsync_opt.models import get_workload

from qsync_opt.hfta.convert import fuse
from qsync_opt.hfta.trainer import ArrayTrainer, SweepSpec, Variant
from support.harness import max_abs_diff, run_cli, run_params

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ------------------------------------------------------------------ every machine


def test_choice_timings_wait_for_a_cuda_device(monkeypatch):
    from qsync_opt.hfta import choice as ch

    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    ms = ch._median_ms(lambda: events.append("run"), 2, torch.device("cuda", 0))
    assert events == ["sync", "run", "sync"] * 2 and len(ms) == 2
    events.clear()
    ch.time_pairs(lambda: events.append("a"), lambda: events.append("b"), 2,
                  torch.device("cuda", 0))
    # warm-up, then each timed call between two waits
    assert events == ["a", "b"] + ["sync", "a", "sync", "sync", "b", "sync",
                                   "sync", "b", "sync", "sync", "a", "sync"]
    events.clear()
    ch._median_ms(lambda: events.append("run"), 1, torch.device("cpu"))
    ch._median_ms(lambda: events.append("run"), 1)
    assert events == ["run", "run"]  # nothing to wait for on the CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_sweep_on_cuda_without_a_device_is_one_line():
    code, _, err = run_cli("sweep", "--model", "digits_cnn", "--steps", "1", "--device", "cuda")
    assert code == 2 and "--device cuda: no CUDA device" in err and err.count("\n") == 1, err


# ------------------------------------------------------------------ on a CUDA device


def _models(name: str, B: int, dtype: torch.dtype) -> list[torch.nn.Module]:
    wl = get_workload(name)
    out = []
    for s in range(B):
        torch.manual_seed(s)
        out.append(wl.build().to(dtype).train())
    return out


@gpu
@pytest.mark.parametrize("name", ["digits_cnn", "digits_resnet", "tiny_gpt"])
def test_array_on_cuda_equals_the_array_on_the_cpu(name):
    """The fused operators on the GPU (grouped cuDNN convolutions, batched GEMMs, folded
    norms) give the CPU array's outputs and gradients, in float64."""
    B, n = 3, 4
    wl = get_workload(name)
    torch.manual_seed(7)
    (x,) = wl.make_inputs(B * n, torch.device("cpu"))
    x = (x.double() if x.is_floating_point() else x).view(B, n, *x.shape[1:])
    cpu = fuse(_models(name, B, torch.float64))
    dev = fuse(_models(name, B, torch.float64)).to("cuda")
    outs, grads = [], []
    for arr, xi in ((cpu, x), (dev, x.to("cuda"))):
        out = arr(xi)
        (out.double() ** 2).mean().backward()
        outs.append(out.detach().cpu())
        grads.append({k: p.grad.detach().cpu() for k, p in arr.named_parameters()})
    assert max_abs_diff({"out": outs[0]}, {"out": outs[1]}) <= 1e-10
    assert max_abs_diff(grads[0], grads[1]) <= 1e-9


@gpu
def test_sweep_on_cuda_follows_the_cpu_sweep():
    """Ten steps of the same SGD sweep on the GPU and on the CPU (float32; TF32 off) end
    within float32 reordering of each other, and the exports are CPU models."""
    prev = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        variants = [Variant(s, lr, 0.01) for s, lr in ((0, 0.01), (1, 0.02), (2, 0.01))]
        ends = []
        for device in ("cpu", "cuda"):
            tr = ArrayTrainer(SweepSpec("digits_cnn", variants, steps=10, device=device))
            assert all(p.device.type == device for p in tr.array.parameters())
            tr.train()
            ends.append([tr.export(b).state_dict() for b in range(3)])
            assert all(t.device.type == "cpu" for t in ends[-1][0].values())
        for a, b in zip(*ends, strict=True):
            assert max_abs_diff(a, b) <= 1e-4
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev


@gpu
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fused_optimizers_on_cuda_equal_the_cpu_in_float64(optimizer):
    """The fused optimizers with per-model hyper-parameters step the same on the GPU as on
    the CPU: ten steps of a float64 array, within 1e-10. (In float32 AdamW turns a gradient
    that float32 reordering leaves near zero, with its sign flipped, into a whole step of
    lr: a CPU and a GPU sweep then part by about lr a step in such weights, 0.0027 after ten
    steps at lr 0.002 on an H200, while SGD stays within 1e-4; so float64 here.)"""
    from qsync_opt.hfta.optim import FusedAdamW, FusedSGD

    B, n = 3, 8
    (x,) = get_workload("digits_cnn").make_inputs(B * n, torch.device("cpu"))
    x = x.double().view(B, n, *x.shape[1:])
    ends = []
    for device in ("cpu", "cuda"):
        arr = fuse(_models("digits_cnn", B, torch.float64)).to(device)
        params = list(arr.parameters())
        opt = (FusedAdamW(params, B, lr=[1e-3, 2e-3, 5e-4], weight_decay=[0.0, 0.01, 0.1])
               if optimizer == "adamw" else
               FusedSGD(params, B, lr=[0.01, 0.02, 0.05], momentum=0.9,
                        weight_decay=[0.0, 0.01, 0.1]))
        xd = x.to(device)
        for _ in range(10):
            opt.zero_grad(set_to_none=True)
            (arr(xd) ** 2).mean().backward()
            opt.step()
        ends.append({k: v.detach().cpu() for k, v in arr.state_dict().items()})
    assert max_abs_diff(ends[0], ends[1]) <= 1e-10


@gpu
def test_a_nan_stays_in_its_model_on_cuda():
    spec = SweepSpec("digits_cnn", [Variant(s, 0.05, 0.0) for s in (0, 1, 2)], steps=3,
                     device="cuda")
    clean, dirty = ArrayTrainer(spec), ArrayTrainer(spec)
    for step in range(3):
        clean.train_step()
        dirty.train_step(poison=[1] if step == 1 else [])
    assert dirty.skipped == [0, 1, 0]
    for b in (0, 2):
        assert max_abs_diff(clean.export(b).state_dict(), dirty.export(b).state_dict()) == 0.0


@gpu
def test_sweep_cli_on_cuda_measures_exports_and_train_resumes(tmp_path):
    """`sweep --device cuda` with the measured choice: the JSON says the device and the
    choice; the exported CPU checkpoint resumes in `train` on the CPU."""
    out = tmp_path / "sweep"
    code, stdout, err = run_cli("sweep", "--model", "digits_cnn", "--seeds", "0-3", "--lr",
                                "0.01", "--steps", "4", "--device", "cuda", "--out", str(out),
                                "--export")
    assert code == 0, err
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["device"].startswith("cuda") and doc["fuse"]["mode"] == "measure"
    assert doc["fuse"]["array_ms"] > 0 and doc["fuse"]["separate_ms"] > 0
    assert "on cuda" in stdout and len(doc["exported"]) == 4
    run = out / "model2"
    code, _, err = run_cli("train", "--model", "digits_cnn", "--seed", "2", "--lr", "0.01",
                           "--steps", "6", "--out", str(run), "--emulate-dp")
    assert code == 0, err
    assert json.loads((run / "summary.json").read_text())["resumed_from_step"] == 4
    assert all(t.device.type == "cpu" for t in run_params(run, 0).values())


@gpu
def test_a_plan_with_int8_runs_on_cuda(tmp_path):
    """A plan group's int8 and fp16 ops run on the GPU array (the fused int8 GEMM path)."""
    from qsync_opt.costs.cluster import parse_shorthand
    from qsync_opt.graph import trace
    from qsync_opt.problem.plan import make_plan

    plan = make_plan(trace("digits_cnn", 64), parse_shorthand("v100x1+t4x1"),
                     {"t4": {"conv2": "int8", "fc1": "int8", "fc2": "fp16"}},
                     provenance={"solver": "test"})
    path = tmp_path / "p.json"
    plan.save(path)
    code, _, err = run_cli("sweep", "--model", "digits_cnn", "--seeds", "0-3", "--steps", "3",
                           "--plan", str(path), "--group", "t4", "--device", "cuda",
                           "--json", str(tmp_path / "s.json"))
    assert code == 0, err
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["plan_ops"]["applied"]["fc1"] == "int8"
    assert all(r["final_loss"] == r["final_loss"] for r in doc["models"])  # finite


@gpu
def test_torch_func_route_on_cuda_equals_the_fused_route():
    from qsync_opt.hfta.functional import FuncArray

    B, n = 3, 4
    torch.manual_seed(5)
    (x,) = get_workload("digits_cnn").make_inputs(B * n, torch.device("cpu"))
    x = x.double().view(B, n, *x.shape[1:]).to("cuda")
    a = fuse(_models("digits_cnn", B, torch.float64)).to("cuda")
    f = FuncArray(_models("digits_cnn", B, torch.float64)).to("cuda")
    assert max_abs_diff({"out": a(x).detach().cpu()}, {"out": f(x).detach().cpu()}) <= 1e-10
    for arr in (a, f):  # exports follow the array to its device
        assert all(t.device.type == "cuda" for t in arr.export(1).state_dict().values())
