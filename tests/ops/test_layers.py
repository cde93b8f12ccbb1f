"""Precision-specific layers: swaps keep state_dict keys and FP32 masters, refuse bad names."""

from __future__ import annotations

import pytest
import torch
from qsync_opt.models import compute_loss, get_workload
from qsync_opt.models.layers import MatMul

from qsync_opt import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.runtime import QLinear, QMatMul, apply_precisions


@pytest.mark.parametrize("precision", [p for p in Precision])
def test_every_precision_runs_and_keeps_fp32_masters(precision: Precision) -> None:
    wl = get_workload("tiny_gpt")
    torch.manual_seed(0)
    model = wl.build()
    keys = list(model.state_dict())
    names = ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.qk_matmul",
             "transformer.h.1.mlp.c_fc"]
    applied = apply_precisions(model, {n: precision for n in names})
    assert applied == {n: precision for n in names}
    assert list(model.state_dict()) == keys
    assert isinstance(model.transformer.h[0].attn.c_attn, QLinear)
    assert isinstance(model.transformer.h[0].attn.qk_matmul, QMatMul)
    x, y = wl.make_inputs(2, torch.device("cpu")), wl.make_targets(2, torch.device("cpu"))
    loss = compute_loss(wl, model(*x), y)
    loss.backward()
    assert torch.isfinite(loss)
    w = model.transformer.h[0].attn.c_attn.weight
    assert w.dtype == torch.float32 and w.grad.dtype == torch.float32


def test_int8_layer_matches_the_op_and_advances_its_seed() -> None:
    lin = torch.nn.Linear(16, 8)
    model = torch.nn.Sequential(lin)
    apply_precisions(model, {"0": "int8"}, seed=3)
    x = torch.randn(4, 16)
    first = model(x)
    second = model(x)
    assert not torch.equal(first, second)  # fresh stochastic rounding per call
    with torch.no_grad():
        exact = x @ lin.weight.t() + lin.bias
    assert torch.allclose(first, exact, rtol=0.1, atol=0.1)


def test_refusals_name_the_module() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with pytest.raises(QsyncInputError, match="no module named 'x'"):
        apply_precisions(model, {"x": "int8"})
    with pytest.raises(QsyncInputError, match="1 is a ReLU"):
        apply_precisions(model, {"1": "int8"})
    with pytest.raises(QsyncInputError, match="unknown precision"):
        apply_precisions(model, {"0": "int2"})


# ------------------------------------------------------------------ in-place ops after a layer

_INPLACE = {
    "ReLU": (torch.nn.ReLU(inplace=True), torch.nn.ReLU()),
    "SiLU": (torch.nn.SiLU(inplace=True), torch.nn.SiLU()),
    "Hardswish": (torch.nn.Hardswish(inplace=True), torch.nn.Hardswish()),
}


def _layer_cases() -> list[tuple[str, object, list[tuple[int, ...]]]]:
    return [
        ("linear batch1", lambda: torch.nn.Linear(8, 4), [(1, 8)]),
        ("linear 3d", lambda: torch.nn.Linear(8, 5), [(2, 3, 8)]),
        ("linear one output", lambda: torch.nn.Linear(8, 1), [(3, 8)]),
        ("conv1x1 on 1x1 (SE)", lambda: torch.nn.Conv2d(8, 4, 1), [(1, 8, 1, 1)]),
        ("depthwise on 1x1", lambda: torch.nn.Conv2d(4, 4, 3, padding=1, groups=4),
         [(2, 4, 1, 1)]),
        ("depthwise 3x3", lambda: torch.nn.Conv2d(4, 4, 3, padding=1, groups=4), [(2, 4, 5, 5)]),
        ("matmul", lambda: MatMul(), [(2, 3, 4), (2, 4, 5)]),
        ("matmul 1x1", lambda: MatMul(), [(1, 1, 4), (1, 4, 1)]),
    ]


@pytest.mark.parametrize("act", list(_INPLACE))
@pytest.mark.parametrize("precision", [p for p in Precision])
@pytest.mark.parametrize("case", _layer_cases(), ids=lambda c: c[0])
def test_inplace_activation_after_every_layer_and_precision(case, precision: Precision,
                                                            act: str) -> None:
    """Every layer at every precision followed by an in-place activation (squeeze-excitation
    blocks, MobileNet heads) runs forward and backward, with exactly the gradients of the
    out-of-place activation."""
    _, make, shapes = case
    inplace, outofplace = _INPLACE[act]
    gen = torch.Generator().manual_seed(1)
    inputs0 = [torch.randn(s, generator=gen) for s in shapes]
    results = []
    for activation in (inplace, outofplace):
        torch.manual_seed(2)
        model = torch.nn.Sequential(make())
        apply_precisions(model, {"0": precision}, seed=5)
        inputs = [t.clone().requires_grad_() for t in inputs0]
        y = activation(model[0](*inputs))
        g = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
        (y * g).sum().backward()
        grads = [t.grad for t in inputs] + [p.grad for p in model.parameters()]
        assert all(torch.isfinite(t).all() for t in grads)
        results.append([y.detach(), *grads])
    for got, want in zip(results[0], results[1], strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
@pytest.mark.parametrize("precision", [p for p in Precision])
def test_conv_padding_mode_is_honoured_at_every_precision(mode: str, precision: Precision
                                                          ) -> None:
    """A Conv2d with padding_mode reflect / replicate / circular pads the same way at every
    precision (the low-precision paths used to zero-pad)."""
    torch.manual_seed(3)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1, padding_mode=mode)
    x = torch.randn(2, 3, 6, 6) + 2.0  # away from zero: zero padding would differ clearly
    with torch.no_grad():
        want = conv(x)
        padded = torch.nn.functional.pad(x, conv._reversed_padding_repeated_twice, mode=mode)
        model = torch.nn.Sequential(conv)
        apply_precisions(model, {"0": precision})
        seed = model[0].qseed + 1  # the seed this call's stochastic rounding takes
        got = model(x)
    rel = float((got - want).norm() / want.norm())
    if precision == Precision.int4:
        # int4's rounding alone is ~10% here: check the padding against the int4 op itself
        from qsync_opt import ops

        exact = ops.int4_conv2d(padded, conv.weight, conv.bias, 1, 0, seed=seed)
        assert torch.equal(got, exact)
        assert rel < 0.25, rel
    else:
        assert rel < 0.05, rel


# ------------------------------------------------------------------ what fp8 and int8 matmuls compute


def test_fp8_is_emulated_e4m3_operands_fp32_gemm_and_fp32_gradients() -> None:
    """fp8 Linear: inputs and weight rounded to e4m3 (scaled per tensor), the GEMM and both
    gradients in FP32 on the rounded operands (straight through the rounding; no e5m2). What
    `qsync-opt devices` and the README say; a real FP8 GEMM must change them both."""
    torch.manual_seed(4)
    lin = torch.nn.Linear(16, 8)
    model = torch.nn.Sequential(lin)
    apply_precisions(model, {"0": "fp8"})
    x = torch.randn(5, 16, requires_grad=True)
    y = model(x)
    g = torch.randn(5, 8)
    y.backward(g)
    from qsync_opt import ops

    xq = ops.fake_quant_float(x.detach(), "fp8_e4m3")
    wq = ops.fake_quant_float(lin.weight.detach(), "fp8_e4m3")
    assert torch.equal(y.detach(), torch.nn.functional.linear(xq, wq, lin.bias.detach()))
    assert y.dtype == torch.float32
    assert torch.allclose(x.grad, g @ wq, rtol=1e-6, atol=1e-6)
    assert torch.allclose(lin.weight.grad, g.t() @ xq, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("precision", [Precision.int8, Precision.int8_full])
def test_int8_attention_matmul_is_emulated(precision: Precision) -> None:
    """int8 / int8_full attention matmuls: both operands fake-quantized to int8 (per tensor,
    stochastic rounding), the matmul in FP32. int8 passes the gradient through unquantized;
    int8_full quantizes it, per row for the left operand's gradient and per last-axis
    channel for the right one's, as its integer linears do."""
    from qsync_opt import ops
    from qsync_opt.ops.gemm import quantize_output_grad

    gen = torch.Generator().manual_seed(5)
    a0, b0 = torch.randn(2, 3, 4, generator=gen), torch.randn(2, 4, 5, generator=gen)
    g = torch.randn(2, 3, 5, generator=gen) * torch.logspace(-2, 0, 3).reshape(1, 3, 1)
    model = torch.nn.Sequential(MatMul())
    apply_precisions(model, {"0": precision}, seed=2)
    s = model[0].qseed + 1
    a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
    y = model[0](a, b)
    aq, bq = ops.fake_quant_int8(a0, seed=2 * s), ops.fake_quant_int8(b0, seed=2 * s + 1)
    assert torch.equal(y.detach(), torch.matmul(aq, bq))
    y.backward(g)
    ga, gb = g, g
    if precision == Precision.int8_full:
        ga = quantize_output_grad(g, "a", (s + 0x9E37) & 0x7FFFFFFF)
        gb = quantize_output_grad(g, "b", (s + 2 * 0x9E37) & 0x7FFFFFFF)
        assert not torch.equal(ga, g) and not torch.equal(gb, g)
    assert torch.allclose(a.grad, ga @ bq.transpose(1, 2), rtol=1e-6, atol=1e-6)
    assert torch.allclose(b.grad, aq.transpose(1, 2) @ gb, rtol=1e-6, atol=1e-6)


def test_devices_command_says_what_is_emulated(capsys) -> None:
    from qsync_opt.cli import main

    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "fp8 = e4m3-rounded inputs and weights, FP32 GEMM, FP32 gradients" in out
    assert "attention matmuls = int8-rounded operands, FP32 matmul" in out
