"""HFTA fused operators (qsync_opt.hfta.conv_ops, .linear_ops): each equals B standalone torch modules
(outputs, every gradient, BN running statistics), runs one kernel call for all B models,
round-trips through export / from_modules, and refuses modules that differ."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qsync_opt import QsyncInputError, ops
from qsync_opt.core.precision import Precision
from qsync_opt.hfta.conv_ops import FusedBatchNorm2d, FusedConv2d
from qsync_opt.hfta.layouts import conv_to_linear, fold, unfold
from qsync_opt.hfta.linear_ops import FusedEmbedding, FusedLayerNorm, FusedLinear
from qsync_opt.ops.gemm import run_linear
from qsync_opt.runtime import apply_precisions
from support.harness import count_calls

B = 3
TOL = 1e-10
F64 = torch.float64

_KERNELS: dict[Any, str] = {F.conv2d: "conv2d", torch.baddbmm: "baddbmm", torch.bmm: "bmm",
                            F.embedding: "embedding", F.batch_norm: "batch_norm",
                            F.layer_norm: "layer_norm"}


def CountKernels() -> Any:  # noqa: N802 (used as a class: ``with CountKernels() as m``)
    return count_calls(_KERNELS)


def _close(a: Tensor, b: Tensor, tol: float = TOL) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    if a.numel():
        assert (a - b).abs().max().item() <= tol


def _randomise(mods: Sequence[nn.Module]) -> None:
    with torch.no_grad():
        for m in mods:
            for p in m.parameters():
                p.normal_()


def _check_grads(fused: nn.Module, mods: Sequence[nn.Module], names: Sequence[str],
                 tol: float = TOL) -> None:
    for name in names:
        fp = getattr(fused, name)
        assert fp.grad is not None, name
        for b, m in enumerate(mods):
            _close(fp.grad[b], getattr(m, name).grad, tol)


def _fused_vs_separate(fused: nn.Module, mods: Sequence[nn.Module], xs: Tensor,
                       to_fused: Callable[[Tensor], Tensor],
                       from_fused: Callable[[Tensor], Tensor],
                       names: Sequence[str], **kw: Any) -> Tensor:
    """Forward and backward (random-weighted sum) of ``fused`` on ``to_fused(xs)`` against
    each ``mods[b]`` on ``xs[b]``; returns the fused output in model-major form."""
    x1 = xs.detach().clone().requires_grad_(xs.is_floating_point())
    x2 = xs.detach().clone().requires_grad_(xs.is_floating_point())
    out = from_fused(fused(to_fused(x1), **kw))
    ref = torch.stack([m(x2[b]) for b, m in enumerate(mods)])
    _close(out, ref)
    g = torch.randn_like(ref)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    if xs.is_floating_point():
        assert x1.grad is not None and x2.grad is not None
        _close(x1.grad, x2.grad)
    _check_grads(fused, mods, names)
    return out


def _state_equal(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _roundtrip(fused: Any, plain: type[nn.Module]) -> None:
    """export(b) is a plain torch module holding copies; fusing the exports gives the same
    parameters and buffers."""
    exported = [fused.export(b) for b in range(fused.B)]
    for b, m in enumerate(exported):
        assert type(m) is plain
        for name, t in m.state_dict().items():
            src = fused.state_dict()[name]
            assert torch.equal(t, src if name == "num_batches_tracked" else src[b]), name
            if t.dim():
                assert t.data_ptr() != src.data_ptr()
    again = type(fused).from_modules(exported)
    _state_equal(again, fused)
    if getattr(fused, "weight", None) is None:
        return
    with torch.no_grad():  # copies: changing an export leaves the fused module as it was
        exported[0].weight.add_(1.0)
    assert not torch.equal(exported[0].weight, fused.weight[0])


def _count(fused: nn.Module, x: Tensor, **kw: Any) -> Counter[str]:
    with CountKernels() as mode:
        fused(x, **kw)
    return mode.counts


# ----------------------------------------------------------------------------- Linear


@pytest.mark.parametrize(("mid", "bias"), [((6,), True), ((2, 3), True), ((5,), False)])
def test_linear_equals_separate_linears(mid: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    mods = [nn.Linear(5, 4, bias=bias, dtype=F64) for _ in range(B)]
    _randomise(mods)
    fused = FusedLinear.from_modules(mods)
    assert fused.B == B and fused.weight.shape == (B, 4, 5)
    xs = torch.randn(B, *mid, 5, dtype=F64)
    names = ["weight", "bias"] if bias else ["weight"]
    out = _fused_vs_separate(fused, mods, xs, lambda x: x, lambda y: y, names)
    assert out.shape == (B, *mid, 4)
    assert _count(fused, xs) == Counter({"baddbmm" if bias else "bmm": 1})
    _roundtrip(fused, nn.Linear)


@pytest.mark.parametrize("precision", [Precision.bf16, Precision.fp16])
def test_linear_half_equals_separate_half_linears(precision: Precision) -> None:
    """One 16-bit batched GEMM equals B 16-bit F.linear calls cast the same way (the
    runtime's run_linear / QLinear): outputs and gradients, bit for bit."""
    torch.manual_seed(1)
    fused = FusedLinear(B, 24, 16)
    fused.precision = precision
    xs = torch.randn(B, 2, 8, 24)
    x1, x2 = xs.clone().requires_grad_(), xs.clone().requires_grad_()
    out = fused(x1)
    d = torch.bfloat16 if precision == Precision.bf16 else torch.float16
    ws = [fused.weight[b].detach().clone().requires_grad_() for b in range(B)]
    bs = [fused.bias[b].detach().clone().requires_grad_() for b in range(B)]
    ref = torch.stack([F.linear(x2[b].to(d), ws[b].to(d), bs[b].to(d)).to(xs.dtype)
                       for b in range(B)])
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    runtime = torch.stack([run_linear(xs[b], ws[b], bs[b], precision, lambda: 0)
                           for b in range(B)])
    assert torch.equal(out, runtime)
    g = torch.randn_like(ref)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    assert torch.equal(x1.grad, x2.grad)
    for b in range(B):
        assert torch.equal(fused.weight.grad[b], ws[b].grad)
        assert torch.equal(fused.bias.grad[b], bs[b].grad)
    assert _count(fused, xs) == Counter({"baddbmm": 1})


@pytest.mark.parametrize("precision", [Precision.int8, Precision.int8_full, Precision.int4,
                                       Precision.fp8])
def test_linear_quantized_equals_separate_runtime_calls(precision: Precision) -> None:
    torch.manual_seed(2)
    fused = FusedLinear(B, 24, 16)
    fused.precision = precision
    fused.qseed = 40
    assert fused.int8_mode == "loop"
    xs = torch.randn(B, 6, 24)
    x1, x2 = xs.clone().requires_grad_(), xs.clone().requires_grad_()
    out = fused(x1)
    assert fused.qseed == 40 + (B if precision != Precision.fp8 else 0)
    seeds = iter(range(41, 41 + B))
    ws = [fused.weight[b].detach().clone().requires_grad_() for b in range(B)]
    bs = [fused.bias[b].detach().clone().requires_grad_() for b in range(B)]
    ref = torch.stack([run_linear(x2[b], ws[b], bs[b], precision, lambda: next(seeds))
                       for b in range(B)])
    assert torch.equal(out, ref)
    g = torch.randn_like(ref)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    assert torch.equal(x1.grad, x2.grad)
    for b in range(B):
        assert torch.equal(fused.weight.grad[b], ws[b].grad)
        assert torch.equal(fused.bias.grad[b], bs[b].grad)
    again = fused(xs)  # a fresh seed per call: different stochastic rounding
    if precision not in (Precision.fp8, Precision.int4):  # int4 rounds to nearest
        assert not torch.equal(again, out)
    else:
        assert torch.equal(again, out)


def test_linear_int8_equals_runtime_qlinears_and_has_no_float64_path() -> None:
    torch.manual_seed(3)
    mods = [nn.Linear(16, 8) for _ in range(B)]
    models = [nn.Sequential(m) for m in mods]
    for model in models:
        apply_precisions(model, {"0": "int8"})
    for b, m in enumerate(mods):
        m.qseed = 100 + b  # type: ignore[assignment]
    fused = FusedLinear.from_modules(mods)  # a QLinear's precision comes along
    assert fused.precision == Precision.int8
    fused.qseed = 100
    x = torch.randn(B, 5, 16)
    # the fused counter draws 101, 102, 103; each QLinear draws its own next seed
    assert torch.equal(fused(x), torch.stack([mods[b](x[b]) for b in range(B)]))
    f64 = FusedLinear(B, 4, 2, dtype=F64)
    f64.precision = Precision.int8
    with pytest.raises(ValueError, match="float32"):
        f64(torch.randn(B, 3, 4, dtype=F64))


def test_linear_refusals() -> None:
    fused = FusedLinear(B, 4, 2)
    with pytest.raises(QsyncInputError, match="expected input"):
        fused(torch.randn(B + 1, 3, 4))
    with pytest.raises(QsyncInputError, match="expected input"):
        fused(torch.randn(B, 3, 5))
    fused.precision = "int3"  # type: ignore[assignment]
    with pytest.raises(QsyncInputError, match="unknown precision 'int3'"):
        fused(torch.randn(B, 3, 4))
    fused.precision = Precision.int8
    fused.int8_mode = "batched"
    with pytest.raises(QsyncInputError, match="int8_mode"):
        fused(torch.randn(B, 3, 4))
    with pytest.raises(QsyncInputError, match="model index 3"):
        fused.export(3)


# ----------------------------------------------------------------------------- Conv2d

CONV_CASES = [
    dict(in_channels=4, out_channels=6, kernel_size=3, stride=1, padding=1),
    dict(in_channels=4, out_channels=6, kernel_size=(3, 2), stride=2, padding=(1, 0),
         groups=2, bias=False),
    dict(in_channels=6, out_channels=3, kernel_size=3, padding="same", dilation=2, groups=3),
    dict(in_channels=2, out_channels=4, kernel_size=1, stride=(2, 1)),
    dict(in_channels=2, out_channels=2, kernel_size=(2, 3), padding="same", dilation=(1, 2)),
    dict(in_channels=6, out_channels=3, kernel_size=3, padding=2, dilation=2, groups=3),
]


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("cfg", CONV_CASES)
def test_conv2d_equals_separate_convs(cfg: dict[str, Any]) -> None:
    torch.manual_seed(4)
    mods = [nn.Conv2d(**cfg, dtype=F64) for _ in range(B)]
    _randomise(mods)
    fused = FusedConv2d.from_modules(mods)
    assert fused.weight.shape == (B, *mods[0].weight.shape)
    xs = torch.randn(B, 2, cfg["in_channels"], 7, 8, dtype=F64)  # [B, N, C, H, W]
    names = ["weight", "bias"] if cfg.get("bias", True) else ["weight"]
    _fused_vs_separate(fused, mods, xs, fold, lambda y: unfold(y, B), names)
    assert _count(fused, fold(xs)) == Counter({"conv2d": 1})
    _roundtrip(fused, nn.Conv2d)


@pytest.mark.parametrize("cfg", [CONV_CASES[1], CONV_CASES[5]])
@pytest.mark.parametrize("precision", ["int8", "int8_full", "int4", "fp8"])
def test_conv2d_quantized_equals_runtime_qconv2d(cfg: dict[str, Any], precision: str) -> None:
    torch.manual_seed(5)
    mods = [nn.Conv2d(**cfg) for _ in range(B)]
    fused = FusedConv2d.from_modules(mods)
    fused.precision = Precision(precision)
    fused.qseed = 7
    for b, m in enumerate(mods):
        apply_precisions(nn.Sequential(m), {"0": precision})
        m.qseed = 7 + b  # type: ignore[assignment]
    xs = torch.randn(B, 2, cfg["in_channels"], 6, 6)
    x1, x2 = xs.clone().requires_grad_(), xs.clone().requires_grad_()
    out = unfold(fused(fold(x1)), B)
    ref = torch.stack([m(x2[b]) for b, m in enumerate(mods)])
    assert torch.equal(out, ref)
    g = torch.randn_like(ref)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    assert torch.equal(x1.grad, x2.grad)
    for b, m in enumerate(mods):
        assert torch.equal(fused.weight.grad[b], m.weight.grad)


def test_conv2d_int8_same_padding_pads_as_torch() -> None:
    torch.manual_seed(14)
    fused = FusedConv2d(B, 2, 2, (2, 3), padding="same", dilation=(1, 2))
    fused.precision = Precision.int8
    fused.qseed = 20
    xs = torch.randn(B, 2, 2, 5, 6)
    out = unfold(fused(fold(xs)), B)
    # height: total 1 (0 before, 1 after); width: total 4 (2 and 2)
    ref = torch.stack([ops.int8_conv2d(F.pad(xs[b], (2, 2, 0, 1)), fused.weight[b],
                                       fused.bias[b], 1, 0, (1, 2), seed=21 + b)
                       for b in range(B)])
    assert out.shape == (B, 2, 2, 5, 6) and torch.equal(out, ref)
    exact = torch.stack([F.conv2d(xs[b], fused.weight[b], fused.bias[b], padding="same",
                                  dilation=(1, 2)) for b in range(B)])
    assert (out - exact).abs().max().item() < 0.1 * exact.abs().max().item()


def test_conv2d_half_is_one_call_near_separate_convs() -> None:
    torch.manual_seed(6)
    mods = [nn.Conv2d(4, 6, 3, padding=1, groups=2) for _ in range(B)]
    fused = FusedConv2d.from_modules(mods)
    fused.precision = Precision.bf16
    xs = torch.randn(B, 2, 4, 5, 5)
    out = unfold(fused(fold(xs)), B)
    assert out.dtype == torch.float32
    d = torch.bfloat16
    ref = torch.stack([F.conv2d(xs[b].to(d), m.weight.to(d), m.bias.to(d), padding=1,
                                groups=2).float() for b, m in enumerate(mods)])
    assert (out - ref).abs().max().item() <= 0.05 * ref.abs().max().item()
    assert _count(fused, fold(xs)) == Counter({"conv2d": 1})


def test_conv2d_refusals() -> None:
    with pytest.raises(QsyncInputError, match="padding_mode"):
        FusedConv2d.from_modules([nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect")
                                  for _ in range(B)])
    with pytest.raises(QsyncInputError, match="divisible by groups"):
        FusedConv2d(B, 3, 4, 3, groups=2)
    fused = FusedConv2d(B, 2, 4, 3)
    with pytest.raises(QsyncInputError, match="B\\*in=6"):
        fused(torch.randn(1, 4, 5, 5))


# ----------------------------------------------------------------------------- BatchNorm2d


def _batchnorms(momentum: float | None) -> list[nn.BatchNorm2d]:
    mods = [nn.BatchNorm2d(4, eps=1e-4, momentum=momentum, dtype=F64) for _ in range(B)]
    with torch.no_grad():
        for m in mods:
            m.weight.normal_()
            m.bias.normal_()
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)
            m.num_batches_tracked.fill_(3)
    return mods


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_equals_separate_batchnorms_train_and_eval(momentum: float | None) -> None:
    torch.manual_seed(7)
    mods = _batchnorms(momentum)
    fused = FusedBatchNorm2d.from_modules(mods)
    assert fused.running_mean is not None and fused.running_var is not None
    for b, m in enumerate(mods):
        assert torch.equal(fused.running_mean[b], m.running_mean)
    xs = torch.randn(B, 5, 4, 3, 3, dtype=F64) * 2 + 1
    _fused_vs_separate(fused, mods, xs, fold, lambda y: unfold(y, B), ["weight", "bias"])
    assert int(fused.num_batches_tracked) == 4  # type: ignore[arg-type]
    for b, m in enumerate(mods):  # the running statistics were updated in place, per model
        assert int(m.num_batches_tracked) == 4
        _close(fused.running_mean[b], m.running_mean)
        _close(fused.running_var[b], m.running_var)
        assert not torch.equal(m.running_mean, _batchnorms(momentum)[b].running_mean)
    assert _count(copy.deepcopy(fused), fold(xs)) == Counter({"batch_norm": 1})
    fused.eval()
    for m in mods:
        m.eval()
        m.zero_grad()
    fused.zero_grad()
    before = fused.running_mean.clone()
    _fused_vs_separate(fused, mods, xs, fold, lambda y: unfold(y, B), ["weight", "bias"])
    assert torch.equal(fused.running_mean, before)
    assert _count(fused, fold(xs)) == Counter({"batch_norm": 1})
    _roundtrip(fused, nn.BatchNorm2d)
    assert not fused.export(0).training


def test_batchnorm_without_running_stats_or_affine() -> None:
    torch.manual_seed(8)
    mods = [nn.BatchNorm2d(2, affine=False, track_running_stats=False, dtype=F64)
            for _ in range(B)]
    fused = FusedBatchNorm2d.from_modules(mods)
    assert fused.running_mean is None and fused.weight is None
    xs = torch.randn(B, 4, 2, 3, 3, dtype=F64)
    _fused_vs_separate(fused, mods, xs, fold, lambda y: unfold(y, B), [])
    fused.eval()
    for m in mods:
        m.eval()
    _fused_vs_separate(fused, mods, xs, fold, lambda y: unfold(y, B), [])
    _roundtrip(fused, nn.BatchNorm2d)
    assert all(fused.export(b).running_mean is None for b in range(B))


# ----------------------------------------------------------------------------- LayerNorm


@pytest.mark.parametrize(("shape", "affine", "bias"),
                         [(5, True, True), ((3, 4), True, False), (5, False, False)])
def test_layernorm_equals_separate_layernorms(shape: Any, affine: bool, bias: bool) -> None:
    torch.manual_seed(9)
    mods = [nn.LayerNorm(shape, eps=1e-6, elementwise_affine=affine, bias=bias, dtype=F64)
            for _ in range(B)]
    _randomise(mods)
    fused = FusedLayerNorm.from_modules(mods)
    tail = (shape,) if isinstance(shape, int) else shape
    xs = torch.randn(B, 2, 3, *tail, dtype=F64) * 3 + 0.5
    names = [n for n, on in (("weight", affine), ("bias", affine and bias)) if on]
    _fused_vs_separate(fused, mods, xs, lambda x: x, lambda y: y, names)
    assert _count(fused, xs) == Counter({"layer_norm": 1})
    _roundtrip(fused, nn.LayerNorm)


# ----------------------------------------------------------------------------- Embedding


@pytest.mark.parametrize("padding_idx", [None, 2, -1])
@pytest.mark.parametrize("mode", ["per_model", "replicated", "replicated_inferred"])
def test_embedding_equals_separate_embeddings(padding_idx: int | None, mode: str) -> None:
    torch.manual_seed(10)
    mods = [nn.Embedding(7, 4, padding_idx=padding_idx, dtype=F64) for _ in range(B)]
    _randomise(mods)
    fused = FusedEmbedding.from_modules(mods)
    assert fused.weight.shape == (B, 7, 4)
    if mode == "per_model":
        ids = torch.randint(0, 7, (B, 5, 6))
        out = _fused_vs_separate(fused, mods, ids, lambda i: i, lambda y: y, ["weight"])
        counted = _count(fused, ids)
    else:
        shared = torch.randint(0, 7, (B, 6))  # N == B: the mode must be given explicitly
        kw = {"replicated": True}
        if mode == "replicated_inferred":
            shared = torch.randint(0, 7, (5,))  # one dim: inferred as replicated
            kw = {}
        ids = shared.expand(B, *shared.shape)
        out = _fused_vs_separate(fused, mods, ids, lambda i: i[0], lambda y: y, ["weight"],
                                 **kw)
        counted = _count(fused, shared, **kw)
    assert out.shape == (B, *ids.shape[1:], 4)
    assert counted == Counter({"embedding": 1})
    if padding_idx is not None:
        assert bool((ids == padding_idx % 7).any())  # the padding rows were read...
        assert torch.equal(fused.weight.grad[:, padding_idx],  # ...and got no gradient
                           torch.zeros(B, 4, dtype=F64))
    _roundtrip(fused, nn.Embedding)


@pytest.mark.parametrize("kw", [{"scale_grad_by_freq": True}, {"max_norm": 1.0}])
def test_embedding_options_and_refusals(kw: dict[str, Any]) -> None:
    torch.manual_seed(11)
    mods = [nn.Embedding(5, 3, **kw, dtype=F64) for _ in range(B)]
    fused = FusedEmbedding.from_modules(mods)
    ids = torch.tensor([[0, 0, 1, 4]] * B)
    ids[1, 2] = 0
    _fused_vs_separate(fused, mods, ids, lambda i: i, lambda y: y, ["weight"])
    for b, m in enumerate(mods):  # max_norm renormalised the same rows in place
        assert torch.equal(fused.weight[b], m.weight)
    with pytest.raises(QsyncInputError, match="ids outside 0..4"):
        fused(torch.tensor([[5]] * B))
    with pytest.raises(QsyncInputError, match="sparse"):
        FusedEmbedding.from_modules([nn.Embedding(5, 3, sparse=True) for _ in range(B)])


# ----------------------------------------------------------------------------- layouts


def test_fold_unfold_and_conv_to_linear() -> None:
    torch.manual_seed(12)
    xs = torch.randn(B, 2, 3, 4, 5)
    folded = fold(xs)
    assert folded.shape == (2, B * 3, 4, 5)
    for b in range(B):
        assert torch.equal(folded[:, b * 3:(b + 1) * 3], xs[b])
    assert torch.equal(unfold(folded, B), xs)
    flat = conv_to_linear(folded, B)
    assert flat.shape == (B, 2, 3 * 4 * 5)
    for b in range(B):
        assert torch.equal(flat[b], torch.flatten(xs[b], 1))
    with pytest.raises(QsyncInputError, match="B=3"):
        unfold(torch.randn(2, 4, 3), B)


def test_small_cnn_fused_equals_separate_cnns() -> None:
    """conv -> BN -> ReLU -> MaxPool -> AdaptiveAvgPool -> flatten -> Linear, end to end."""
    torch.manual_seed(13)

    def cnn() -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                             nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                             nn.Linear(16, 5)).double()

    nets = [cnn() for _ in range(B)]
    conv = FusedConv2d.from_modules([n[0] for n in nets])
    bn = FusedBatchNorm2d.from_modules([n[1] for n in nets])
    head = FusedLinear.from_modules([n[6] for n in nets])
    xs = torch.randn(B, 2, 3, 8, 8, dtype=F64)
    y = nn.Sequential(conv, bn, nn.ReLU(), nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(2))(fold(xs))
    out = head(conv_to_linear(y, B))
    ref = torch.stack([n(xs[b]) for b, n in enumerate(nets)])
    _close(out, ref)
    (out ** 2).sum().backward()
    (ref ** 2).sum().backward()
    _check_grads(conv, [n[0] for n in nets], ["weight", "bias"])
    _check_grads(bn, [n[1] for n in nets], ["weight", "bias"])
    _check_grads(head, [n[6] for n in nets], ["weight", "bias"])


# ----------------------------------------------------------------------------- from_modules


@pytest.mark.parametrize(("cls", "make", "field"), [
    (FusedLinear, lambda i: nn.Linear(4, 3 + (i == 2)), "out_features"),
    (FusedLinear, lambda i: nn.Linear(4, 3, bias=i != 1), "bias"),
    (FusedLinear, lambda i: nn.Linear(4, 3, dtype=F64 if i else None), "weight dtype"),
    (FusedConv2d, lambda i: nn.Conv2d(2, 2, 3, stride=1 + (i == 1)), "stride"),
    (FusedConv2d, lambda i: nn.Conv2d(2, 2, 3, groups=1 + (i == 1)), "groups"),
    (FusedBatchNorm2d, lambda i: nn.BatchNorm2d(2, eps=1e-5 * (1 + i)), "eps"),
    (FusedLayerNorm, lambda i: nn.LayerNorm(4 + i), "normalized_shape"),
    (FusedEmbedding, lambda i: nn.Embedding(5, 2, padding_idx=i), "padding_idx"),
])
def test_from_modules_names_what_differs(cls: Any, make: Callable[[int], nn.Module],
                                         field: str) -> None:
    with pytest.raises(QsyncInputError, match=f"{cls.__name__}.from_modules: {field}"):
        cls.from_modules([make(i) for i in range(B)])


def test_from_modules_refuses_wrong_types_empty_lists_and_uneven_batch_counts() -> None:
    with pytest.raises(QsyncInputError, match="module 1 is a Conv2d"):
        FusedLinear.from_modules([nn.Linear(2, 2), nn.Conv2d(2, 2, 1)])
    with pytest.raises(QsyncInputError, match="no modules"):
        FusedLayerNorm.from_modules([])
    bns = [nn.BatchNorm2d(2) for _ in range(B)]
    bns[1].num_batches_tracked.fill_(2)
    with pytest.raises(QsyncInputError, match="num_batches_tracked"):
        FusedBatchNorm2d.from_modules(bns)
    lins = [nn.Linear(2, 2) for _ in range(B)]
    apply_precisions(nn.Sequential(lins[0]), {"0": "bf16"})
    with pytest.raises(QsyncInputError, match="precision"):
        FusedLinear.from_modules(lins)
