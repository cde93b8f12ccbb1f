"""Every GEMM that can run at int8_full computes what the indicator's error model assumes.

The indicator charges int8_full a quantized output gradient (one scale per row for the
left operand's gradient, one per last-axis channel for the right one's) and a weight
re-quantized per input column; the cost model charges two quantizations of the output
gradient (``rules.GRAD_QUANTIZE_PASSES``). For each way an op is run (GEMM modules through
the precision layers, functional matmuls through ``run_gemm`` as the dispatcher and the
attention steps call it), the measured squared error of both operand gradients over many
stochastic-rounding seeds must match the indicator's prediction for that op's form
(``indicator_calls``' forms, ``indicator.kinds_for``). An op whose backward stopped
quantizing its output gradient (as attention matmuls once did) measures about half the
predicted error and fails.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from qsync_opt.models.layers import MatMul
from torch import Tensor, nn

from qsync_opt.core.precision import Precision
from qsync_opt.costs import rules
from qsync_opt.documents.schemas import OpKind
from qsync_opt.indicator import SPECS, element_variance, kinds_for
from qsync_opt.indicator.calls import Bilinear, functional_form, module_bilinear
from qsync_opt.ops.gemm import gemm_operand_roles, run_gemm
from qsync_opt.runtime import apply_precisions

SEEDS = 300
P = Precision.int8_full


def _uniform(shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
    """Operands without outliers: their one int8 scale suits every element."""
    return torch.rand(shape, generator=gen) * 2 - 1


def _outliers(shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
    """An output gradient whose elements span 1000x (cubes of normals): its quantization
    error dominates the operands' unless its rows and channels get scales of their own."""
    return torch.randn(shape, generator=gen) ** 3


def _predicted(bl: Bilinear, a: Tensor, b: Tensor, g: Tensor) -> tuple[float, float]:
    """The indicator's E||d grad_a||^2 and E||d grad_b||^2 at int8_full."""
    k = kinds_for(P, bl.b_is_weight)
    assert k is not None

    def var(t: Tensor, kind: str, weight: bool = False) -> Tensor:
        return element_variance(t, kind, per_channel=weight, channel_dim=bl.channel_dim)

    ga = bl.grad_a(a.shape, b.square(), var(g, k.g)) + bl.grad_a(
        a.shape, var(b, k.b_bwd, bl.b_is_weight), g.square())
    gb = bl.grad_b(var(a, k.a_bwd), b.shape, g.square()) + bl.grad_b(
        a.square(), b.shape, var(g, k.g_w))
    return float(ga.sum()), float(gb.sum())


Run = Callable[[Tensor, Tensor, int], tuple[Tensor, Tensor, Tensor]]


def _measured(run: Run, bl: Bilinear, a: Tensor, b: Tensor, g: Tensor) -> tuple[float, float]:
    exact_a = bl.grad_a(a.shape, b.double(), g.double())
    exact_b = bl.grad_b(a.double(), b.shape, g.double())
    ea = eb = 0.0
    for s in range(SEEDS):
        out, ar, br = run(a, b, s)
        out.backward(g)
        assert ar.grad is not None and br.grad is not None
        ea += float((ar.grad.double() - exact_a).square().sum()) / SEEDS
        eb += float((br.grad.double() - exact_b).square().sum()) / SEEDS
    return ea, eb


def _module_case(mod: nn.Module, a: Tensor) -> tuple[Run, Bilinear, Tensor, Tensor]:
    """A GEMM module at int8_full through the precision layers; ``b`` its weight."""
    bl = module_bilinear(mod)
    assert bl is not None
    w = mod.weight.detach().clone()

    def run(a0: Tensor, _: Tensor, s: int) -> tuple[Tensor, Tensor, Tensor]:
        model = nn.Sequential(copy.deepcopy(mod))
        apply_precisions(model, {"0": P}, seed=s)
        x = a0.clone().requires_grad_()
        return model[0](x), x, model[0].weight
    return run, bl, a, w


def _functional_case(fn: Callable[..., Any], args: Callable[[Tensor, Tensor], tuple[Any, ...]],
                     a: Tensor, b: Tensor) -> tuple[Run, Bilinear, Tensor, Tensor]:
    """A functional matmul-like call at int8_full as the dispatcher runs it; its form and
    operand roles as the indicator takes them."""
    got = functional_form("matmul", fn, args(a, b), {})
    assert got is not None
    fa, fb, bl = got
    assert fa is a and fb is b  # the indicator's a and b are the runtime's "a" and "b"
    floats = [t for t in args(a, b) if isinstance(t, Tensor) and t.is_floating_point()]
    roles = gemm_operand_roles(fn, len(floats))
    assert floats[roles.index("a")] is a and floats[roles.index("b")] is b

    def run(a0: Tensor, b0: Tensor, s: int) -> tuple[Tensor, Tensor, Tensor]:
        ar, br = a0.clone().requires_grad_(), b0.clone().requires_grad_()
        return run_gemm("matmul", fn, args(ar, br), {}, P, lambda: s), ar, br
    return run, bl, a, b


def _cases() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(11)
    torch.manual_seed(11)
    a3 = _uniform((2, 6, 8), gen)
    b3 = _uniform((2, 8, 5), gen)
    extra = torch.randn(2, 6, 5, generator=gen)
    lin = nn.Linear(8, 5, bias=False)
    conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
    grouped = nn.Conv2d(4, 6, 3, padding=1, groups=2, bias=False)
    conv1d = nn.Conv1d(3, 4, 3, padding=1, bias=False)
    return {
        OpKind.linear: _module_case(lin, _uniform((12, 8), gen)),
        OpKind.conv: _module_case(conv, _uniform((2, 3, 5, 5), gen)),
        "grouped conv": _module_case(grouped, _uniform((2, 4, 5, 5), gen)),
        "conv1d": _module_case(conv1d, _uniform((2, 3, 7), gen)),
        OpKind.matmul: _module_case_matmul(a3, b3),
        "matmul": _functional_case(torch.matmul, lambda a, b: (a, b), a3, b3),
        "bmm": _functional_case(torch.bmm, lambda a, b: (a, b), a3, b3),
        "einsum": _functional_case(torch.einsum, lambda a, b: ("bij,bjk->bik", a, b), a3, b3),
        "baddbmm": _functional_case(torch.baddbmm, lambda a, b: (extra, a, b), a3, b3),
        "rmatmul": _functional_case(Tensor.__rmatmul__, lambda a, b: (b, a), a3, b3),
    }


def _module_case_matmul(a: Tensor, b: Tensor) -> tuple[Run, Bilinear, Tensor, Tensor]:
    """The attention MatMul module at int8_full through the precision layers."""
    bl = module_bilinear(MatMul())
    assert bl is not None

    def run(a0: Tensor, b0: Tensor, s: int) -> tuple[Tensor, Tensor, Tensor]:
        model = nn.Sequential(MatMul())
        apply_precisions(model, {"0": P}, seed=s)
        ar, br = a0.clone().requires_grad_(), b0.clone().requires_grad_()
        return model[0](ar, br), ar, br
    return run, bl, a, b


CASES = _cases()


def test_every_op_kind_that_can_run_int8_full_is_covered() -> None:
    kinds = {k for k in CASES if isinstance(k, OpKind)}
    assert kinds == {OpKind.linear, OpKind.conv, OpKind.matmul}
    assert rules.GRAD_QUANTIZE_PASSES[P] == 2  # the two quantizations the model assumes
    k = SPECS[P]
    assert k is not None and (k.g, k.g_w) == ("int8row", "int8gcol")


@pytest.mark.parametrize("name", list(CASES), ids=str)
def test_int8_full_gradients_err_as_the_indicator_predicts(name: Any) -> None:
    run, bl, a, b = CASES[name]
    g = _outliers(tuple(bl.f(a, b).shape), torch.Generator().manual_seed(5))
    pred_a, pred_b = _predicted(bl, a, b, g)
    meas_a, meas_b = _measured(run, bl, a, b, g)
    assert meas_a == pytest.approx(pred_a, rel=0.12)
    assert meas_b == pytest.approx(pred_b, rel=0.12)
