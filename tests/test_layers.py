"""Precision-specific layers: swaps keep state_dict keys and FP32 masters, refuse bad names."""

from __future__ import annotations

import pytest
import torch
from qsync_opt.models import compute_loss, get_workload

from qsync_opt import QsyncInputError
from qsync_opt.precision import Precision
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
        apply_precisions(model, {"0": "int4"})
