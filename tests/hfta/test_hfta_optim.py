"""Fused HFTA optimizers (qsync_opt.hfta.optim) against B separate torch optimizers.

Every comparison feeds the same random gradients to the fused optimizer (parameters
``[B, ...]``) and to ``B`` standalone ``torch.optim.SGD`` / ``AdamW`` instances on cloned
slices, in float64, and asserts each slice agrees to ``TOL`` = 1e-12 (the agreement seen is
at the level of a few float64 ulps, often bit-exact).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.hfta.lr_schedules import FusedLRSchedule, fused_schedule
from qsync_opt.hfta.optim import FusedAdamW, FusedSGD
from qsync_opt.strategy.schedule import parse_schedule

B = 4
SHAPES = [(B, 5, 3), (B, 7), (B, 2, 3, 3, 3), (B,)]
STEPS = 20
TOL = 1e-12

SGD_HP: dict[str, Any] = {"lr": [0.1, 0.05, 0.2, 0.01], "momentum": [0.9, 0.0, 0.5, 0.99],
          "weight_decay": [0.0, 1e-2, 5e-4, 0.1]}
ADAMW_HP: dict[str, Any] = {"lr": [1e-3, 3e-3, 1e-2, 5e-4], "betas": [(0.9, 0.999), (0.8, 0.99),
                                                       (0.95, 0.9), (0.5, 0.999)],
            "eps": [1e-8, 1e-6, 1e-8, 1e-4], "weight_decay": [1e-2, 0.0, 0.1, 0.3]}


def make_params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True)
            for s in SHAPES]


def make_grads(n_steps: int, seed: int = 1) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
            for _ in range(n_steps)]


def slices(params: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Model b's standalone leaves: clones of every parameter's b-th slice."""
    return [[p.detach()[b].clone().requires_grad_(True) for p in params] for b in range(B)]


def per_model(hp: dict[str, Any], b: int) -> dict[str, Any]:
    return {k: (v[b] if isinstance(v, list) else v) for k, v in hp.items()}


def max_diff(fused: Sequence[torch.Tensor], refs: Sequence[Sequence[torch.Tensor]]) -> float:
    return max(float((p.detach()[b] - r.detach()).abs().max())
               for b in range(B) for p, r in zip(fused, refs[b], strict=True))


def run_pair(fused_cls: type, ref_cls: type, hp: dict[str, Any], *,
             masked: dict[int, set[int]] | None = None,
             lr_at: Callable[[int], list[float]] | None = None,
             none_grad: frozenset[int] | set[int] = frozenset()) -> tuple[list, list, float]:
    """Run the fused optimizer and B torch ones for STEPS steps; return params + max diff.

    ``masked``: step -> models left out of that step; ``none_grad``: parameter indices whose
    gradient is None on every step; ``lr_at``: per-model learning rates set before each step.
    """
    params = make_params()
    refs = slices(params)
    opt = fused_cls(params, B, **hp)
    ref_opts = [ref_cls(refs[b], **per_model(hp, b)) for b in range(B)]
    worst = 0.0
    for step, grads in enumerate(make_grads(STEPS)):
        if lr_at is not None:
            lrs = lr_at(step)
            opt.set_lr(lrs)
            for b in range(B):
                for group in ref_opts[b].param_groups:
                    group["lr"] = lrs[b]
        skip = (masked or {}).get(step, set())
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            p.grad = None if i in none_grad else g.clone()
            for b in range(B):
                refs[b][i].grad = None if i in none_grad else g[b].clone()
        mask = torch.tensor([b not in skip for b in range(B)]) if masked else None
        opt.step(mask=mask)
        for b in range(B):
            if b not in skip:
                ref_opts[b].step()
        worst = max(worst, max_diff(params, refs))
    return params, refs, worst


def ops_in(fn: Callable[[], Any]) -> int:
    """How many aten ops ``fn()`` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


# ----------------------------------------------------------------------------- equivalence

def test_sgd_matches_torch_per_model() -> None:
    params, refs, worst = run_pair(FusedSGD, torch.optim.SGD, SGD_HP)
    assert worst <= TOL, worst
    # the parameters really moved, by different amounts per model
    start = make_params()
    moved = [float((p.detach()[b] - s.detach()[b]).abs().max()) for b in range(B)
             for p, s in zip(params, start, strict=True)]
    assert min(moved) > 1e-3


@pytest.mark.parametrize("variant", [
    {"nesterov": True, "dampening": 0.0, "momentum": [0.9, 0.5, 0.1, 0.99]},
    {"dampening": 0.3},
    {"dampening": [0.0, 0.1, 0.5, 0.9]},
])
def test_sgd_nesterov_and_dampening(variant: dict[str, Any]) -> None:
    hp = {**SGD_HP, **variant}
    _, _, worst = run_pair(FusedSGD, torch.optim.SGD, hp)
    assert worst <= TOL, worst


def test_sgd_no_momentum_creates_no_buffer() -> None:
    hp = {"lr": SGD_HP["lr"], "weight_decay": SGD_HP["weight_decay"]}
    params, _, worst = run_pair(FusedSGD, torch.optim.SGD, hp)
    assert worst <= TOL, worst


def test_sgd_scalar_hyper_parameters_broadcast() -> None:
    _, _, worst = run_pair(FusedSGD, torch.optim.SGD,
                           {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3})
    assert worst <= TOL, worst


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamw_matches_torch_per_model(amsgrad: bool) -> None:
    _, _, worst = run_pair(FusedAdamW, torch.optim.AdamW, {**ADAMW_HP, "amsgrad": amsgrad})
    assert worst <= TOL, worst


def test_adamw_defaults_and_betas_as_two_arrays() -> None:
    hp = {"lr": ADAMW_HP["lr"]}
    _, _, worst = run_pair(FusedAdamW, torch.optim.AdamW, hp)
    assert worst <= TOL, worst
    # the two-arrays form of betas equals the B-pairs form
    params = make_params()
    a = FusedAdamW(params, B, betas=ADAMW_HP["betas"])
    b1 = torch.tensor([bp[0] for bp in ADAMW_HP["betas"]], dtype=torch.float64)
    b2 = [bp[1] for bp in ADAMW_HP["betas"]]
    b = FusedAdamW(make_params(), B, betas=(b1, b2))
    c = FusedAdamW(make_params(), B, betas=torch.tensor(ADAMW_HP["betas"], dtype=torch.float64))
    assert torch.equal(a.param_groups[0]["betas"], b.param_groups[0]["betas"])
    assert torch.equal(a.param_groups[0]["betas"], c.param_groups[0]["betas"])
    assert a.param_groups[0]["betas"].shape == (B, 2)


@pytest.mark.parametrize("cls,ref_cls,hp", [
    (FusedAdamW, torch.optim.AdamW, ADAMW_HP),
    (FusedSGD, torch.optim.SGD, {**SGD_HP, "momentum": [0.9, 0.5, 0.99, 0.8]}),
])
@pytest.mark.parametrize("masked", [None, {3: {1}}])
def test_fast_path_equals_general_path(cls: type, ref_cls: type, hp: dict[str, Any],
                                       masked: dict[int, set[int]] | None,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-place common case repeats the general path's arithmetic: bit for bit, also
    after a masked step left the models at different step counts; and it runs fewer ops."""
    fast, _, _ = run_pair(cls, ref_cls, hp, masked=masked)
    monkeypatch.setattr(cls, "fast_path", False)
    general, _, _ = run_pair(cls, ref_cls, hp, masked=masked)
    for p, q in zip(fast, general, strict=True):
        assert torch.equal(p.detach(), q.detach())

    def ops_per_step(use_fast: bool) -> int:
        monkeypatch.setattr(cls, "fast_path", use_fast)
        params = make_params()
        opt = cls(params, B, **hp)
        n = 0
        for grads in make_grads(2):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            n = ops_in(opt.step)
        return n  # the second step's: buffers started

    assert ops_per_step(True) < ops_per_step(False)


@pytest.mark.parametrize("cls,ref_cls,hp", [
    (FusedAdamW, torch.optim.AdamW, ADAMW_HP),
    (FusedSGD, torch.optim.SGD, {**SGD_HP, "momentum": [0.9, 0.5, 0.99, 0.8]}),
])
def test_fast_path_in_slices_equals_whole(cls: type, ref_cls: type, hp: dict[str, Any],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A large parameter's fast path runs in column slices of CHUNK_ELEMENTS (all models at
    once): bit for bit the whole-tensor arithmetic, still torch's, in more (smaller) ops;
    a non-contiguous gradient takes the whole-tensor route."""
    from qsync_opt.hfta import optim as fused_optim

    monkeypatch.setattr(fused_optim, "CHUNK_ELEMENTS", 0)
    whole, _, _ = run_pair(cls, ref_cls, hp)
    monkeypatch.setattr(fused_optim, "CHUNK_ELEMENTS", 8)  # 60-, 28- and 216-element params
    sliced, _, worst = run_pair(cls, ref_cls, hp)
    assert worst < TOL
    for p, q in zip(whole, sliced, strict=True):
        assert torch.equal(p.detach(), q.detach())

    def ops_second_step(chunk: int, contiguous: bool = True) -> int:
        monkeypatch.setattr(fused_optim, "CHUNK_ELEMENTS", chunk)
        params = make_params()
        opt = cls(params, B, **hp)
        n = 0
        for grads in make_grads(2):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone() if contiguous or g.dim() < 3 else (
                    g.transpose(1, 2).contiguous().transpose(1, 2))
            n = ops_in(opt.step)
        return n

    assert ops_second_step(8) > ops_second_step(0)
    assert ops_second_step(8, contiguous=False) < ops_second_step(8)


def test_fused_step_has_no_loop_over_models() -> None:
    """One set of ops per parameter: the op count does not grow with B."""
    def count_ops(nb: int) -> int:
        p = torch.randn(nb, 3, 2, dtype=torch.float64, requires_grad=True)
        opt = FusedAdamW([p], nb, lr=[1e-3] * nb, weight_decay=0.1)
        p.grad = torch.randn_like(p)
        opt.step()  # state created
        p.grad = torch.randn_like(p)
        return ops_in(lambda: opt.step(mask=torch.tensor([True] * (nb - 1) + [False])))

    assert count_ops(2) == count_ops(16)


# ----------------------------------------------------------------------------- mask

@pytest.mark.parametrize("cls,ref_cls,hp", [
    (FusedSGD, torch.optim.SGD, SGD_HP),
    (FusedSGD, torch.optim.SGD, {**SGD_HP, "dampening": 0.2}),
    (FusedAdamW, torch.optim.AdamW, ADAMW_HP),
    (FusedAdamW, torch.optim.AdamW, {**ADAMW_HP, "amsgrad": True}),
])
def test_mask_leaves_model_untouched(cls: type, ref_cls: type, hp: dict[str, Any]) -> None:
    masked = {5: {2}, 9: {2}}
    params, refs, worst = run_pair(cls, ref_cls, hp, masked=masked)
    assert worst <= TOL, worst
    # model 2 really differs from a run where it stepped every time
    unmasked, _, _ = run_pair(cls, ref_cls, hp)
    assert max(float((p.detach()[2] - q.detach()[2]).abs().max())
               for p, q in zip(params, unmasked, strict=True)) > 1e-6
    for b in (0, 1, 3):  # the others are unaffected, bit for bit
        for p, q in zip(params, unmasked, strict=True):
            assert torch.equal(p.detach()[b], q.detach()[b])


def test_mask_freezes_state_and_step_count() -> None:
    params = make_params()
    opt = FusedAdamW(params, B, **ADAMW_HP)
    grads = make_grads(3)
    for g, p in zip(grads[0], params, strict=True):
        p.grad = g
    opt.step()
    before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    p0 = params[0].detach().clone()
    for g, p in zip(grads[1], params, strict=True):
        p.grad = g
    opt.step(mask=torch.tensor([True, False, True, False]))
    after = opt.state[params[0]]
    assert after["step"].tolist() == [2.0, 1.0, 2.0, 1.0]
    for b in (1, 3):
        assert torch.equal(params[0].detach()[b], p0[b])
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(after[k][b], before[k][b])
    for b in (0, 2):
        assert not torch.equal(params[0].detach()[b], p0[b])
    # an all-False mask changes nothing at all
    snap = [p.detach().clone() for p in params]
    opt.step(mask=torch.zeros(B, dtype=torch.bool))
    assert all(torch.equal(p.detach(), s) for p, s in zip(params, snap, strict=True))
    assert after["step"].tolist() == [2.0, 1.0, 2.0, 1.0]


def test_mask_before_first_step_sgd_momentum_buffer() -> None:
    """A model masked on the very first step starts its momentum buffer later (clone of its
    own first gradient), like a torch SGD that first steps then."""
    _, _, worst = run_pair(FusedSGD, torch.optim.SGD, {**SGD_HP, "dampening": 0.4},
                           masked={0: {1, 3}, 1: {3}, 7: {0}})
    assert worst <= TOL, worst


# ----------------------------------------------------------------------------- grad None

@pytest.mark.parametrize("cls,ref_cls,hp", [(FusedSGD, torch.optim.SGD, SGD_HP),
                                            (FusedAdamW, torch.optim.AdamW, ADAMW_HP)])
def test_grad_none_param_skipped(cls: type, ref_cls: type, hp: dict[str, Any]) -> None:
    start = make_params()
    params, refs, worst = run_pair(cls, ref_cls, hp, none_grad={1})
    assert worst <= TOL, worst
    assert torch.equal(params[1].detach(), start[1].detach())  # untouched, even by decay
    assert not torch.equal(params[0].detach(), start[0].detach())


def test_grad_none_param_has_no_state() -> None:
    params = make_params()
    opt = FusedAdamW(params, B, **ADAMW_HP)
    for i, p in enumerate(params):
        p.grad = None if i == 2 else torch.ones_like(p)
    opt.step()
    assert params[2] not in opt.state
    assert opt.state[params[0]]["step"].tolist() == [1.0] * B


# ----------------------------------------------------------------------------- state dict

def _feed(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()


@pytest.mark.parametrize("cls,hp", [
    (FusedSGD, SGD_HP), (FusedSGD, {**SGD_HP, "nesterov": True,
                                    "momentum": [0.9, 0.5, 0.1, 0.99]}),
    (FusedAdamW, ADAMW_HP), (FusedAdamW, {**ADAMW_HP, "amsgrad": True})])
def test_state_dict_round_trip_mid_run(cls: type, hp: dict[str, Any]) -> None:
    grads = make_grads(STEPS)
    masks = {3: [True, True, False, True], 12: [False, True, True, True]}
    sched = lambda s: [0.5 ** (s // 5) * x for x in hp["lr"]]  # noqa: E731

    def run(params: list[torch.Tensor], opt: Any, steps: range) -> None:
        for s in steps:
            opt.set_lr(sched(s))
            _feed(params, grads[s])
            m = masks.get(s)
            opt.step(mask=None if m is None else torch.tensor(m))

    ref_params = make_params()
    ref = cls(ref_params, B, **hp)
    run(ref_params, ref, range(STEPS))

    params = make_params()
    opt = cls(params, B, **hp)
    run(params, opt, range(10))
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "params": [p.detach().clone() for p in params]}, buf)
    opt.set_lr([9.0] * B)  # a later change does not leak into the saved copy
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert torch.equal(saved["opt"]["param_groups"][0]["lr"],
                       torch.tensor(sched(9), dtype=torch.float64))

    params2 = [t.clone().requires_grad_(True) for t in saved["params"]]
    # a fresh optimizer built with other hyper-parameters gets the saved ones back
    opt2 = cls(params2, B, lr=1.0)
    opt2.load_state_dict(saved["opt"])
    for k, v in saved["opt"]["param_groups"][0].items():
        if k != "params":
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(opt2.param_groups[0][k])), k
    run(params2, opt2, range(10, STEPS))
    for p, q in zip(params2, ref_params, strict=True):
        assert torch.equal(p.detach(), q.detach())
    for p, q in zip(params2, ref_params, strict=True):
        for k, v in ref.state[q].items():
            assert torch.equal(opt2.state[p][k], v), k


def test_load_state_dict_refuses_other_B() -> None:
    opt = FusedSGD(make_params(), B, lr=0.1, momentum=0.9)
    other = FusedSGD([torch.zeros(3, 2, dtype=torch.float64, requires_grad=True)
                      for _ in SHAPES], 3, lr=0.1)
    with pytest.raises(QsyncInputError, match="load_state_dict.*4 values"):
        opt.load_state_dict(other.state_dict())


def test_lr_attribute_and_set_lr() -> None:
    params = make_params()
    groups: list[dict[str, Any]] = [{"params": params[:2]}, {"params": params[2:], "lr": 0.5}]
    opt = FusedSGD(groups, B, lr=0.1)
    assert opt.param_groups[1]["lr"].tolist() == [0.5] * B
    opt.lr = [0.1, 0.2, 0.3, 0.4]
    assert opt.lr.tolist() == [0.1, 0.2, 0.3, 0.4]
    assert all(g["lr"].tolist() == [0.1, 0.2, 0.3, 0.4] for g in opt.param_groups)
    opt.set_lr(torch.tensor([1.0, 2.0, 3.0, 4.0]), group=1)
    assert opt.param_groups[0]["lr"].tolist() == [0.1, 0.2, 0.3, 0.4]
    assert opt.param_groups[1]["lr"].tolist() == [1.0, 2.0, 3.0, 4.0]
    opt.lr.zero_()  # a copy: the optimizer's rates are unchanged
    assert opt.lr.tolist() == [0.1, 0.2, 0.3, 0.4]
    # a plain float assigned to a group is honoured at the next step
    opt.param_groups[0]["lr"] = 0.0
    p0 = params[0].detach().clone()
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert torch.equal(params[0].detach(), p0)


# ----------------------------------------------------------------------------- schedules

def test_fused_schedule_lr_at_matches_each_model() -> None:
    texts = ["cosine:warmup=3,final=0.1", "constant", "step:every=4,gamma=0.5,warmup=2",
             "cosine"]
    lrs = [0.1, 0.05, 0.2, 0.01]
    fs = fused_schedule(texts, lrs, STEPS)
    assert isinstance(fs, FusedLRSchedule) and fs.B == B
    singles = [parse_schedule(t, lr, STEPS) for t, lr in zip(texts, lrs, strict=True)]
    for step in range(-1, STEPS + 3):
        got = fs.lr_at(step)
        assert got.dtype == torch.float64 and got.shape == (B,)
        assert got.tolist() == [s.lr_at(step) for s in singles]
    # per-model step counts
    assert fs.lr_at([0, 1, 2, 3]).tolist() == [s.lr_at(k) for k, s in enumerate(singles)]
    assert FusedLRSchedule(singles).lr_at(7).tolist() == fs.lr_at(7).tolist()
    # one text for every model
    assert fused_schedule("cosine:warmup=2", lrs, STEPS).describe() == ["cosine:warmup=2"] * B


def test_cosine_warmup_schedule_drives_sgd() -> None:
    fs = fused_schedule("cosine:warmup=5,final=0.05", SGD_HP["lr"], STEPS)
    params = make_params()
    opt = FusedSGD(params, B, **SGD_HP)
    seen = []

    def lr_at(step: int) -> list[float]:
        lrs = fs.lr_at(step).tolist()
        seen.append(lrs)
        return lrs

    _, _, worst = run_pair(FusedSGD, torch.optim.SGD, SGD_HP, lr_at=lr_at)
    assert worst <= TOL, worst
    assert seen[0] == [lr / 5 for lr in SGD_HP["lr"]]  # warm-up
    assert seen[-1] == pytest.approx([0.05 * lr for lr in SGD_HP["lr"]], rel=1e-12)
    # apply() sets the optimizer's rates
    got = fs.apply(opt, 3)
    assert torch.equal(opt.lr, got) and torch.equal(got, fs.lr_at(3))


def test_schedule_bad_input() -> None:
    with pytest.raises(QsyncInputError, match="2 schedule texts for 3"):
        fused_schedule(["constant", "cosine"], [0.1, 0.2, 0.3], 10)
    with pytest.raises(QsyncInputError, match="model 1: lr_schedule"):
        fused_schedule(["constant", "bogus"], [0.1, 0.2], 10)
    fs = fused_schedule("constant", [0.1, 0.2], 10)
    with pytest.raises(QsyncInputError, match="2 models, the optimizer B=4"):
        fs.apply(FusedSGD(make_params(), B, lr=0.1), 0)
    with pytest.raises(QsyncInputError, match="2 integers"):
        fs.lr_at([1, 2, 3])


# ----------------------------------------------------------------------------- bad input

def test_bad_input_raises_clear_errors() -> None:
    params = make_params()
    with pytest.raises(QsyncInputError, match=r"FusedSGD lr: expected a float or 4 values.*"
                                              r"got 3 values"):
        FusedSGD(params, B, lr=[0.1, 0.2, 0.3])
    with pytest.raises(QsyncInputError, match=r"momentum: .*tensor of shape \[5\]"):
        FusedSGD(params, B, lr=0.1, momentum=torch.zeros(5))
    with pytest.raises(QsyncInputError, match=r"weight_decay: model 2's value must be >= 0"):
        FusedSGD(params, B, lr=0.1, weight_decay=[0.0, 0.0, -1.0, 0.0])
    with pytest.raises(QsyncInputError, match=r"leading dim B=4.*shape \[3, 5\]"):
        FusedSGD(params + [torch.zeros(3, 5, requires_grad=True)], B, lr=0.1)
    with pytest.raises(QsyncInputError, match=r"parameter 'w' of shape \[\]"):
        FusedAdamW([("w", torch.zeros((), requires_grad=True))], B)
    with pytest.raises(QsyncInputError, match="Nesterov"):
        FusedSGD(params, B, lr=0.1, momentum=[0.9, 0.0, 0.9, 0.9], nesterov=True)
    with pytest.raises(QsyncInputError, match=r"FusedAdamW eps: expected a float or 4"):
        FusedAdamW(params, B, eps=[1e-8, 1e-8])
    with pytest.raises(QsyncInputError, match=r"betas\[beta2\]: model 1's value must be in"):
        FusedAdamW(params, B, betas=[(0.9, 0.99), (0.9, 1.0), (0.9, 0.99), (0.9, 0.99)])
    with pytest.raises(QsyncInputError, match="betas: expected a pair"):
        FusedAdamW(params, B, betas=[(0.9, 0.99)] * 3)
    with pytest.raises(QsyncInputError, match="reads both as two"):
        FusedAdamW([torch.zeros(2, 3, requires_grad=True)], 2,
                   betas=[[0.9, 0.99], [0.8, 0.999]])
    with pytest.raises(QsyncInputError, match="B .* must be an integer >= 1"):
        FusedSGD(params, 0, lr=0.1)
    opt = FusedSGD(params, B, lr=0.1)
    with pytest.raises(QsyncInputError, match=r"set_lr: lr: expected a float or 4"):
        opt.set_lr([0.1, 0.2])
    with pytest.raises(QsyncInputError, match=r"lr: model 0's value must be finite"):
        opt.set_lr([float("nan"), 0.1, 0.1, 0.1])
    for p in params:
        p.grad = torch.zeros_like(p)
    with pytest.raises(QsyncInputError, match=r"mask must have shape \[4\]"):
        opt.step(mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(QsyncInputError, match="mask must be a bool tensor"):
        opt.step(mask=torch.ones(4))


def test_closure_loss_returned() -> None:
    p = torch.ones(B, 2, dtype=torch.float64, requires_grad=True)
    opt = FusedSGD([p], B, lr=[0.1, 0.2, 0.3, 0.4])

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (p ** 2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert float(loss.detach()) == 2.0 * B
    assert torch.allclose(p.detach()[:, 0], torch.tensor([0.8, 0.6, 0.4, 0.2],
                                                         dtype=torch.float64), atol=0)
