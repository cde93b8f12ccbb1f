"""Slowdown emulation (qsync_opt.runtime.emulate): time stretched, numbers untouched.

The time tests run on a fake clock that stands in for the module's ``time``: time moves only
when a test's "compute" advances it or the hooks sleep, so every stretch is an exact number,
whatever the load of the machine (sums of powers of two: exact in floating point).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qsync_opt.runtime.emulate as emulate_mod
from qsync_opt.runtime.emulate import SlowdownHooks, add_slowdown


class FakeClock:
    """``perf_counter`` and ``sleep`` of a clock that moves only when told (or slept on);
    ``oversleep`` makes every sleep last that fraction longer than asked."""

    def __init__(self, oversleep: float = 0.0) -> None:
        self.now = 0.0
        self.oversleep = oversleep
        self.sleeps: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s * (1 + self.oversleep)

    def advance(self, s: float) -> None:
        self.now += s


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    c = FakeClock()
    monkeypatch.setattr(emulate_mod, "time", c)
    return c


class _Scaled(torch.autograd.Function):
    """y = x * w, whose backward takes ``bwd_s`` on the fake clock."""

    @staticmethod
    def forward(ctx, x, w, clock, bwd_s):  # type: ignore[no-untyped-def]
        ctx.clock, ctx.bwd_s = clock, bwd_s
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        ctx.clock.advance(ctx.bwd_s)
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum().reshape(w.shape), None, None


class Work(nn.Module):
    """A leaf op whose forward and backward take known times on the fake clock."""

    def __init__(self, clock: FakeClock, fwd_s: float, bwd_s: float) -> None:
        super().__init__()
        self.clock, self.fwd_s, self.bwd_s = clock, fwd_s, bwd_s
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.advance(self.fwd_s)
        return _Scaled.apply(x, self.w, self.clock, self.bwd_s)


class Compute(nn.Module):
    """Wraps a real module: its forward also takes ``fwd_s`` on the fake clock."""

    def __init__(self, clock: FakeClock, inner: nn.Module, fwd_s: float) -> None:
        super().__init__()
        self.clock, self.inner, self.fwd_s = clock, inner, fwd_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.advance(self.fwd_s)
        return self.inner(x)


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


#: one torch thread, as the ranks run (conftest)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_factor_three_takes_three_times_as_long_forward_and_backward(
        clock: FakeClock) -> None:
    model = nn.Sequential(Work(clock, 2.0 ** -3, 2.0 ** -2), Work(clock, 2.0 ** -4, 2.0 ** -3))
    hooks = SlowdownHooks(model, 3.0, min_sleep_s=2.0 ** -20)
    x = torch.ones(4)
    t0 = clock.now
    out = model(x)
    assert clock.now - t0 == 3 * (2.0 ** -3 + 2.0 ** -4)  # the forward took 3x its compute
    assert (hooks.measured_s, hooks.slept_s) == (0.1875, 0.375)
    # the stretch lands op by op: each op's sleep right after it
    assert clock.sleeps == [2 * 2.0 ** -3, 2 * 2.0 ** -4]
    clock.advance(1.0)  # between forward and backward (the loss): not stretched
    t1 = clock.now
    out.sum().backward()
    assert clock.now - t1 == 3 * (2.0 ** -2 + 2.0 ** -3)  # the backward took 3x too
    assert (hooks.measured_s, hooks.slept_s) == (0.5625, 1.125)
    # Factor changed between steps (emulation runs each group's micro-batch at its factor),
    # then removed: no hook fires, no time added.
    hooks.factor = 1.0
    hooks.reset_stats()
    t2 = clock.now
    model(x).sum().backward()
    assert clock.now - t2 == 2.0 ** -3 + 2.0 ** -4 + 2.0 ** -2 + 2.0 ** -3
    assert (hooks.measured_s, hooks.slept_s) == (0.5625, 0.0)
    hooks.remove()
    hooks.reset_stats()
    n_sleeps = len(clock.sleeps)
    model(x).sum().backward()
    assert (hooks.measured_s, hooks.slept_s, len(clock.sleeps)) == (0.0, 0.0, n_sleeps)


def test_short_sleeps_are_deferred_and_oversleep_is_credited(monkeypatch) -> None:
    # 8 ops of 1/1024 s at factor 2 with sleeps of at least 1/256 s: one sleep per 4 ops.
    clock = FakeClock()
    monkeypatch.setattr(emulate_mod, "time", clock)
    model = nn.Sequential(*[Work(clock, 2.0 ** -10, 0.0) for _ in range(8)])
    hooks = SlowdownHooks(model, 2.0, min_sleep_s=2.0 ** -8)
    model(torch.ones(2))
    assert clock.sleeps == [2.0 ** -8, 2.0 ** -8] and hooks.slept_s == 2.0 ** -7
    # A debt below the minimum is paid at the end of the forward (pay_all).
    model3 = nn.Sequential(*[Work(clock, 2.0 ** -10, 0.0) for _ in range(3)])
    h3 = SlowdownHooks(model3, 2.0, min_sleep_s=2.0 ** -8)
    before = len(clock.sleeps)
    model3(torch.ones(2))
    assert clock.sleeps[before:] == [3 * 2.0 ** -10] and h3.slept_s == 3 * 2.0 ** -10
    # Every sleep lasts 50% longer than asked: the excess is taken off the next debt, so
    # the forward is stretched by 9/64 s for an ideal 8/64, not 12/64.
    over = FakeClock(oversleep=0.5)
    monkeypatch.setattr(emulate_mod, "time", over)
    model2 = nn.Sequential(Work(over, 2.0 ** -4, 0.0), Work(over, 2.0 ** -4, 0.0))
    h2 = SlowdownHooks(model2, 2.0, min_sleep_s=2.0 ** -20)
    model2(torch.ones(2))
    assert over.sleeps == [2.0 ** -4, 2.0 ** -5] and h2.slept_s == 9 / 64


def test_outputs_and_gradients_are_bit_identical() -> None:
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(32, 512, generator=g), torch.randint(0, 10, (32,), generator=g)
    ref_out, ref_grads = _step(_mlp(), x, y)
    model = _mlp()
    with SlowdownHooks(model, 2.5):
        out, grads = _step(model, x, y)
    assert torch.equal(out, ref_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))


def test_works_with_inplace_relu_convnets_and_no_grad(clock: FakeClock) -> None:
    torch.manual_seed(0)
    dt = 2.0 ** -6  # each layer's forward on the fake clock
    layers = [nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.Flatten(),
              nn.Linear(8 * 6 * 6, 4)]
    model = nn.Sequential(*[Compute(clock, m, dt) for m in layers])
    ref = nn.Sequential(*[Compute(FakeClock(), m, dt) for m in layers])
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        want = ref(x)
    with SlowdownHooks(model, 2.0, min_sleep_s=2.0 ** -20) as hooks:
        model(x).sum().backward()
        assert (hooks.measured_s, hooks.slept_s) == (5 * dt, 5 * dt)
        t0 = clock.now
        with torch.no_grad():
            got = model(x)
        assert clock.now - t0 == 2 * 5 * dt  # a no-grad forward is stretched too
        assert (hooks.measured_s, hooks.slept_s) == (10 * dt, 10 * dt)
    assert torch.equal(got, want)  # BatchNorm in train mode: the same batch, same output
    assert all(p.grad is not None for p in model.parameters())


def test_a_leaf_root_and_factor_one(clock: FakeClock) -> None:
    leaf = Work(clock, 2.0 ** -5, 2.0 ** -4)  # the root is itself the only leaf
    with SlowdownHooks(leaf, 2.0, min_sleep_s=2.0 ** -20) as hooks:
        leaf(torch.ones(3)).sum().backward()
        assert (hooks.measured_s, hooks.slept_s) == (3 * 2.0 ** -5, 3 * 2.0 ** -5)
    assert add_slowdown(leaf, 1.0) is None
    h = add_slowdown(leaf, 2.0)
    assert type(h) is SlowdownHooks and h.factor == 2.0 and h.model is leaf
    h.remove()
    h.remove()  # idempotent
    with pytest.raises(ValueError, match=">= 1"):
        SlowdownHooks(leaf, 0.5)
