"""The int8 ops inside the blocks real models are made of, trained for a few steps.

A ConvNeXt block (depthwise 7x7 conv -> LayerNorm -> Linear -> GELU -> Linear, residual) and
a MobileNetV3 / EfficientNet squeeze-excitation block (1x1 convs on a 1x1 map with in-place
activations) with a MobileNet head (Linear -> Hardswish(inplace=True)), every Linear and
Conv2d at int8 or int8_full, on the C++ kernels and on the Python references: training stays
finite and close to the same steps in fp32, and every integer GEMM gets operands with a valid
leading dimension (the layouts oneDNN's s8 GEMM, behind ``torch._int_mm`` on AVX512-VNNI
CPUs, misread: non-finite ConvNeXt blocks from the second step).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qsync_opt.core.precision import Precision
from qsync_opt.runtime import apply_precisions
from support.ops_backends import strict_int_mm, use_backend


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)  # NHWC: a non-contiguous input to the Linear
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)


class SqueezeExcite(nn.Module):
    def __init__(self, dim: int, squeeze: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(dim, squeeze, 1)  # 1x1 conv on a 1x1 map
        self.act = nn.SiLU(inplace=True)
        self.fc2 = nn.Conv2d(squeeze, dim, 1)
        self.gate = nn.Hardsigmoid(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(self.fc2(self.act(self.fc1(self.pool(x)))))


class TinyNet(nn.Module):
    """Stem, a ConvNeXt block, an inverted-residual block with squeeze-excitation, and a
    MobileNetV3 head."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 2, stride=2)
        self.convnext = ConvNeXtBlock(8)
        self.expand = nn.Conv2d(8, 16, 1)
        self.expand_act = nn.Hardswish(inplace=True)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.dw_act = nn.ReLU(inplace=True)
        self.se = SqueezeExcite(16, 4)
        self.project = nn.Conv2d(16, 8, 1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(8, 32)
        self.head_act = nn.Hardswish(inplace=True)
        self.classifier = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.convnext(self.stem(x))
        y = self.dw_act(self.dw(self.expand_act(self.expand(x))))
        x = x + self.project(self.se(y))
        return self.classifier(self.head_act(self.head(self.pool(x).flatten(1))))


def _train(precision: Precision | None, steps: int, batch: int
           ) -> tuple[list[float], list[dict[str, torch.Tensor]], nn.Module]:
    torch.manual_seed(0)
    model = TinyNet()
    if precision is not None:
        names = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
        apply_precisions(model, {n: precision for n in names}, seed=1)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, 10, 10, generator=gen)
    y = torch.randint(0, 5, (batch,), generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return losses, grads, model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("backend", ["cpp", "python"])
@pytest.mark.parametrize("precision", [Precision.int8, Precision.int8_full])
@pytest.mark.parametrize("batch", [1, 6])
def test_convnext_and_squeeze_excitation_train_close_to_fp32(backend: str,
                                                             precision: Precision,
                                                             batch: int) -> None:
    steps = 3
    ref_losses, ref_grads, ref_model = _train(None, steps, batch)
    with use_backend(backend), strict_int_mm():
        losses, grads, model = _train(precision, steps, batch)
    assert all(torch.isfinite(torch.tensor(losses)))
    for p in model.parameters():
        assert torch.isfinite(p).all()
    # The first step sees the same weights: every gradient within int8's error of fp32's
    # (the misread operands gave relative errors of 4e4 to 9e5).
    for name, g in grads[0].items():
        assert _rel(g, ref_grads[0][name]) < 0.25, name
    # Three steps on: losses and weights still close to the fp32 run.
    for got, want in zip(losses, ref_losses, strict=True):
        assert abs(got - want) <= 0.01 * abs(want) + 0.005
    ref_params = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        assert _rel(p.detach(), ref_params[name].detach()) < 0.05, name
