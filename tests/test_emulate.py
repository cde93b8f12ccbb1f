"""Slowdown emulation (qsync_opt.runtime.emulate): time stretched, numbers untouched."""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from torch import nn

from qsync_opt.runtime.emulate import SlowdownHooks, add_slowdown


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(inplace=True), nn.Linear(1024, 1024),
                         nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list]:
    model.zero_grad(set_to_none=True)
    out = model(x)
    loss = nn.functional.cross_entropy(out, y)
    loss.backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def _median_step_s(model: nn.Module, x: torch.Tensor, y: torch.Tensor, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        _step(model, x, y)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _timed_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    t0 = time.perf_counter()
    _step(model, x, y)
    return time.perf_counter() - t0


def test_factor_three_takes_about_three_times_as_long() -> None:
    model = _mlp()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(128, 512, generator=g), torch.randint(0, 10, (128,), generator=g)
    hooks = SlowdownHooks(model, 1.0)
    _step(model, x, y)  # warm-up
    # Base and slowed steps interleaved (the factor is mutable), so both see the same load of
    # this shared machine; a behaviour check with a generous band, retried when noisy.
    ratios = []
    for _attempt in range(3):
        pairs = []
        for _ in range(5):
            hooks.factor = 1.0
            base = _timed_step(model, x, y)
            hooks.factor = 3.0
            pairs.append(_timed_step(model, x, y) / base)
        ratios.append(statistics.median(pairs))
        if 2.0 < ratios[-1] < 4.5:
            break
    assert 2.0 < ratios[-1] < 4.5, ratios
    # The accounting is exact: sleep added = (factor - 1) x compute seen, at factor 3.
    hooks.reset_stats()
    _step(model, x, y)
    assert hooks.slept_s == pytest.approx(2.0 * hooks.measured_s, rel=0.1)
    hooks.remove()
    t_removed = _median_step_s(model, x, y)
    hooks.reset_stats()
    _step(model, x, y)
    assert hooks.measured_s == 0 and hooks.slept_s == 0  # removed: no hook fires
    assert t_removed > 0


def test_outputs_and_gradients_are_bit_identical() -> None:
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(32, 512, generator=g), torch.randint(0, 10, (32,), generator=g)
    ref_out, ref_grads = _step(_mlp(), x, y)
    model = _mlp()
    with SlowdownHooks(model, 2.5):
        out, grads = _step(model, x, y)
    assert torch.equal(out, ref_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))


def test_backward_is_stretched_too() -> None:
    model = _mlp()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(128, 512, generator=g), torch.randint(0, 10, (128,), generator=g)
    _step(model, x, y)
    hooks = SlowdownHooks(model, 3.0)
    out = model(x)
    fwd_slept = hooks.slept_s
    nn.functional.cross_entropy(out, y).backward()
    assert hooks.slept_s - fwd_slept > 0.5 * fwd_slept  # backward costs ~2x forward
    hooks.remove()


def test_works_with_inplace_relu_convnets_and_no_grad() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                          nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    x = torch.randn(4, 3, 8, 8)
    with SlowdownHooks(model, 2.0) as hooks:
        model(x).sum().backward()
        with torch.no_grad():
            model(x)
        assert hooks.slept_s > 0
    assert all(p.grad is not None for p in model.parameters())


def test_a_leaf_root_and_factor_one() -> None:
    lin = nn.Linear(4, 4)
    with SlowdownHooks(lin, 2.0) as hooks:
        lin(torch.randn(2, 4)).sum().backward()
        assert hooks.measured_s > 0
    assert add_slowdown(lin, 1.0) is None
    h = add_slowdown(lin, 2.0)
    assert isinstance(h, SlowdownHooks)
    h.remove()
    h.remove()  # idempotent
    with pytest.raises(ValueError, match=">= 1"):
        SlowdownHooks(lin, 0.5)
