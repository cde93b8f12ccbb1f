"""int8_full's output gradient: one scale per row (token / output position) for the input
gradient and one per output channel for the weight gradient (``ops.NUMERICS``).

One scale per tensor let a few large rows (a token, a class token, an outlier) set the step
for every element, so most of the gradient rounded away: a patch embedding's weight-gradient
error rose five-fold under 1% outliers. The tests pin the chosen granularity through every
way in (linear, conv, the precision layers), that outliers keep the
error bounded, and that the compiled kernels and the references agree.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import load_benchmark
from torch import nn

from qsync_opt import ops
from qsync_opt.core.precision import Precision
from qsync_opt.indicator import SPECS, element_variance
from qsync_opt.ops import reference as ref
from qsync_opt.runtime import apply_precisions


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _conv_errors(go: torch.Tensor, grad_scale: str, seeds: int = 3) -> tuple[float, float]:
    """(weight-grad, input-grad) relative error of int8_full against fp32 on a patch
    embedding (Conv2d 3->48, 8x8, stride 8), mean over seeds."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 64, 64, generator=gen)
    w = torch.randn(48, 3, 8, 8, generator=gen) * 0.05
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    F.conv2d(xr, wr, None, 8).backward(go)
    ew = ex = 0.0
    for s in range(seeds):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        ops.int8_conv2d(xi, wi, None, 8, int8_backward=True, seed=s + 1, grad_scale=grad_scale,
                        bwd_dtype=torch.float32).backward(go)
        ew += _rel(wi.grad, wr.grad) / seeds
        ex += _rel(xi.grad, xr.grad) / seeds
    return ew, ex


@pytest.fixture(scope="module")
def grads() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    go = torch.randn(2, 48, 8, 8, generator=gen)
    rows = torch.rand(2, 1, 8, 8, generator=gen) < 0.03
    rows[0, 0, 0, 0] = True  # at least one outlier position
    return {"plain": go,
            "elements": torch.where(torch.rand(go.shape, generator=gen) < 0.01, go * 100, go),
            "rows": go * torch.where(rows, 100.0, 1.0)}


def test_the_default_is_per_row_and_per_channel() -> None:
    assert ops.NUMERICS.grad_scale == "rowcol" and ops.NUMERICS.grad_stochastic
    k = SPECS[Precision.int8_full]
    assert k is not None and (k.g, k.g_w) == ("int8row", "int8gcol")


def test_outlier_rows_leave_the_input_gradient_as_exact_as_without(grads) -> None:
    _, plain = _conv_errors(grads["plain"], "rowcol")
    _, rows = _conv_errors(grads["rows"], "rowcol")
    _, tensor = _conv_errors(grads["rows"], "tensor")
    assert rows < 1.5 * plain  # each position its own scale: the outliers touch no other row
    assert tensor > 3 * rows   # one scale: the x100 rows set every row's step


@pytest.mark.parametrize("kind", ["elements", "rows"])
def test_outliers_keep_the_weight_gradient_error_bounded(grads, kind: str) -> None:
    plain_w, _ = _conv_errors(grads["plain"], "rowcol")
    w_rc, _ = _conv_errors(grads[kind], "rowcol")
    w_t, _ = _conv_errors(grads[kind], "tensor")
    assert w_rc < 0.7 * w_t
    assert w_rc < 4 * plain_w and w_rc < 0.1


def test_per_token_scales_in_a_linear() -> None:
    """Tokens 10^4 apart in gradient size: per-row scales keep the small tokens' input
    gradients; one scale rounds them to noise."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, 32, generator=gen)
    w = torch.randn(16, 32, generator=gen)
    go = torch.randn(64, 16, generator=gen) * torch.logspace(-4, 0, 64).reshape(-1, 1)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    F.linear(xr, wr).backward(go)
    small = slice(0, 32)
    errs = {}
    for scale in ops.GRAD_SCALES:
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        ops.int8_linear(xi, wi, int8_backward=True, seed=5, grad_scale=scale,
                        bwd_dtype=torch.float32).backward(go)
        errs[scale] = _rel(xi.grad[small], xr.grad[small])
    assert errs["row"] < 0.05 and errs["rowcol"] < 0.05 and errs["tensor"] > 0.5


def test_the_layers_take_the_default(grads) -> None:
    """QLinear / QConv2d at int8_full equal the op with the default granularity, and differ
    from one scale per tensor: no caller passes its own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 5 * 5, 7))
    x = torch.randn(2, 3, 5, 5)
    apply_precisions(model, {"0": "int8_full", "2": "int8_full"}, seed=3)
    g = torch.randn(2, 7) * torch.logspace(-3, 0, 2).reshape(-1, 1)

    def grads_under(**kw) -> list[torch.Tensor]:
        s0, s2 = model[0].qseed, model[2].qseed
        model.zero_grad()
        with ops.numerics(**kw):
            model(x).backward(g)
        model[0].qseed, model[2].qseed = s0, s2  # the same seeds each time
        return [p.grad.clone() for p in model.parameters()]

    default, rowcol, tensor = grads_under(), grads_under(grad_scale="rowcol"), \
        grads_under(grad_scale="tensor")
    assert all(torch.equal(a, b) for a, b in zip(default, rowcol, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(default, tensor, strict=True))


@pytest.mark.parametrize("bad", ["rows", "", "ROW", "tensor ", None])
def test_an_unknown_granularity_is_refused(bad) -> None:
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    if bad is None:
        with pytest.raises(TypeError):
            with ops.numerics(grad_scales="row"):  # not a field
                pass
        return
    with pytest.raises(ValueError, match="grad_scale"):
        ops.int8_linear(x, w, int8_backward=True, grad_scale=bad)
    with pytest.raises(ValueError, match="grad_scale"):
        with ops.numerics(grad_scale=bad):
            pass
    assert ops.NUMERICS.grad_scale == "rowcol"  # a refused change leaves the default


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cpp_rescale_rows_equals_the_reference(dtype) -> None:
    from qsync_opt.ops import _build

    assert _build.load_cpu()[0]
    gen = torch.Generator().manual_seed(8)
    acc = torch.randint(-(2**24), 2**24, (37, 129), dtype=torch.int32, generator=gen)
    sx, sw = torch.rand(37, generator=gen) * 1e-3, torch.rand(129, generator=gen)
    for bias in (None, torch.randn(129, generator=gen)):
        want = ref.rescale_int32_rows(acc, sx, sw, bias, dtype)
        got = torch.ops.qsync_cpu.rescale_int32_rows(acc, sx, sw, bias, dtype)
        assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           want.view(torch.int16 if dtype != torch.float32 else torch.int32))
        assert torch.equal(ops.rescale_int32_rows(acc, sx, sw, bias, dtype), want)
    with pytest.raises(RuntimeError, match="one scale per row"):
        torch.ops.qsync_cpu.rescale_int32_rows(acc, sx[:3], sw, None, dtype)


def test_indicator_models_the_two_quantizations() -> None:
    """int8row: one scale per position across the channels; int8gcol: one per channel; on a
    conv gradient the channels are axis 1, on a linear's the last axis."""
    g = torch.randn(2, 6, 3, 3) * torch.logspace(-3, 0, 6).reshape(1, 6, 1, 1)
    row = element_variance(g, "int8row", channel_dim=1)
    col = element_variance(g, "int8gcol", channel_dim=1)
    one = element_variance(g, "int8")
    assert row.shape == col.shape == g.shape
    # a channel 1000x smaller keeps its own step per channel: far less variance there
    assert float(col[:, 0].sum()) < 1e-3 * float(one[:, 0].sum())
    amax_pos = g.abs().amax(1, keepdim=True)
    assert float(row.max()) <= float(((amax_pos / 127) ** 2 / 4).max()) * (1 + 1e-6)
    lin = torch.randn(5, 8)
    assert torch.equal(element_variance(lin, "int8row"),
                       element_variance(lin.t().contiguous(), "int8gcol", channel_dim=1).t())


@pytest.mark.slow
def test_the_measurement_script_ranks_the_choices_on_tiny_gpt() -> None:
    """benchmarks/bench_grad_noise.py on tiny_gpt, one seed: a row per choice, the defaults
    starred, and round-to-nearest ahead of stochastic rounding for int4's forward."""
    module = load_benchmark("bench_grad_noise")
    rows = {label: (c, e) for label, c, e in module.measure(
        "tiny_gpt", 1, {"int8_forward_stochastic": True}, 4)}
    assert len(rows) == len(module.CHOICES)
    assert rows["int4 fwd rtn *"][0] > rows["int4 fwd sr"][0]
    assert rows["int8_full grad sr rowcol *"][0] > 0.99
    assert all(-1 <= c <= 1 and e >= 0 for c, e in rows.values())


def test_the_error_model_assumes_the_kernels_rounding() -> None:
    """The indicator's default rounding is the ops' (``ops.NUMERICS``) for every role: int8
    forward operands and int8_full's output gradient as ``indicate(stochastic=...)``
    defaults, int4 by its kind (``int4n``: to nearest)."""
    import inspect

    from qsync_opt.indicator import indicate

    default = inspect.signature(indicate).parameters["stochastic"].default
    assert default == ops.NUMERICS.int8_forward_stochastic == ops.NUMERICS.grad_stochastic
    k = SPECS[Precision.int4]
    assert k is not None
    assert (k.a == "int4n") == (not ops.NUMERICS.int4_forward_stochastic)




@pytest.mark.slow
def test_stochastic_rounding_averages_out_and_round_to_nearest_does_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The bias measurement behind the rounding rule (bench_grad_noise.py --repeats), on
    tiny_gpt's int8 forward: averaged over 4 seeds, stochastic rounding's gradient error
    falls (unbiased: about 1/sqrt(4)) and ends below round to nearest's, whose error does
    not change (it draws no random numbers: all bias)."""
    module = load_benchmark("bench_grad_noise")
    monkeypatch.setattr(module, "ROLES", [r for r in module.ROLES if r[0] == "int8 forward"])
    rows = {label.rstrip(" *"): (e1, em) for _, label, _, _, e1, em in module.bias(
        "tiny_gpt", 4, 2)}
    (sr1, srm), (rtn1, rtnm) = rows["sr"], rows["rtn"]
    assert rtnm == pytest.approx(rtn1, rel=1e-9)
    assert srm < 0.7 * sr1
    assert srm < rtnm
