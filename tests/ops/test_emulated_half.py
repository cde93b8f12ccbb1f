"""``ops.emulated_half``: CPU 16-bit GEMMs and convolutions run in fp32 on the 16-bit values,
results rounded to 16 bit — the numbers of a 16-bit GEMM with fp32 accumulation, up to the
order of the adds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qsync_opt import ops


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 4 * (2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7)  # a few 16-bit ulps
    assert (a - b).abs().max() <= tol * b.abs().max()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linear_conv_matmul_forward_and_backward(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, 9, 9, generator=g)
    w = torch.randn(6, 4, 3, 3, generator=g)
    a = torch.randn(3, 17, 24, generator=g)
    b = torch.randn(3, 24, 5, generator=g)
    lw = torch.randn(7, 24, generator=g)

    def run() -> list[torch.Tensor]:
        xs, ws, as_, lws = (t.clone().requires_grad_() for t in (x, w, a, lw))
        y1 = F.conv2d(xs.to(dtype), ws.to(dtype), padding=1)
        y2 = torch.bmm(as_.to(dtype), b.to(dtype))
        y3 = F.linear(as_.to(dtype), lws.to(dtype))
        assert y1.dtype == y2.dtype == y3.dtype == dtype
        (y1.float().square().mean() + y2.float().sum() + y3.float().square().sum()).backward()
        return [y1.float(), y2.float(), y3.float(), xs.grad, ws.grad, as_.grad, lws.grad]

    real = run()
    with ops.emulated_half():
        emu = run()
    for r, e in zip(real, emu, strict=True):
        assert r is not None and e is not None
        _close(e, r, dtype)


@pytest.mark.parametrize("fn", ["int8_linear", "int4_linear", "int8_conv2d"])
def test_integer_ops_16bit_backward(fn: str) -> None:
    """The integer ops' 16-bit backward GEMMs (inside their custom ops) are emulated too;
    the forward is the same integer GEMM."""
    g = torch.Generator().manual_seed(1)
    if fn == "int8_conv2d":
        x, w = torch.randn(4, 3, 8, 8, generator=g), torch.randn(5, 3, 3, 3, generator=g)
        kw: dict = {"padding": 1}
    else:
        x, w = torch.randn(32, 40, generator=g), torch.randn(12, 40, generator=g)
        kw = {}
    outs = []
    for enabled in (False, True):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        with ops.emulated_half(enabled):
            y = getattr(ops, fn)(xs, ws, None, seed=5, **kw)
            y.square().sum().backward()
        outs.append((y.detach(), xs.grad, ws.grad))
    assert torch.equal(outs[0][0], outs[1][0])
    for r, e in zip(outs[0][1:], outs[1][1:], strict=True):
        assert r is not None and e is not None
        _close(e, r, ops.default_bwd_dtype(torch.device("cpu")))


def test_fp32_untouched_and_switch_restores() -> None:
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(9, 7, generator=g), torch.randn(7, 3, generator=g)
    with ops.emulated_half():
        assert torch.equal(a @ b, torch.mm(a, b))
        assert ops._half_emulated
    assert not ops._half_emulated
