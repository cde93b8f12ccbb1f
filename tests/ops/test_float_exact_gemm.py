"""``ops.float_exact_gemm``: the CPU integer GEMM run as fp32 GEMMs over pieces of K is bit
for bit the integer GEMM (every piece's partial sums are integers of size <= 2**24)."""

from __future__ import annotations

import pytest
import torch

from qsync_opt import ops


@pytest.mark.parametrize("k", [1, 7, 1023, 1024, 1025, 2500])
def test_equals_int_mm_bit_for_bit(k: int) -> None:
    g = torch.Generator().manual_seed(k)
    a = torch.randint(-128, 128, (33, k), dtype=torch.int8, generator=g)
    b = torch.randint(-128, 128, (k, 9), dtype=torch.int8, generator=g)
    a[0], b[:, 0] = -128, -128  # the extreme product 16384 in every term of one entry
    a[1], b[:, 1] = 127, -128
    want = torch.ops.aten._int_mm(a, b) if k >= 8 else (a.long() @ b.long()).int()
    with ops.float_exact_gemm():
        got = ops.int_mm(a, b)
    assert got.dtype == torch.int32
    assert torch.equal(got, want)
    assert int(got[0, 0]) == 16384 * k


def test_transposed_operand_and_the_switch_restores() -> None:
    g = torch.Generator().manual_seed(1)
    a = torch.randint(-128, 128, (40, 300), dtype=torch.int8, generator=g)
    w = torch.randint(-128, 128, (16, 300), dtype=torch.int8, generator=g)
    want = ops.int_mm(a, w.t())
    with ops.float_exact_gemm():
        assert torch.equal(ops.int_mm(a, w.t()), want)
        with ops.float_exact_gemm(False):
            assert torch.equal(ops.int_mm(a, w.t()), want)
        assert ops._float_gemm
    assert not ops._float_gemm


@pytest.mark.parametrize("op", ["int8", "int4"])
def test_linears_forward_and_backward_unchanged(op: str) -> None:
    """The integer linears (forward and the int8 backward) give identical outputs and
    gradients under the switch: same rounding seeds, same integer GEMMs."""
    fn = ops.int8_linear if op == "int8" else ops.int4_linear
    kw = {"int8_backward": True} if op == "int8" else {}
    outs = []
    for enabled in (False, True):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(64, 200, generator=g, requires_grad=True)
        w = torch.randn(48, 200, generator=g, requires_grad=True)
        bias = torch.randn(48, generator=g)
        with ops.float_exact_gemm(enabled):
            y = fn(x, w, bias, seed=11, **kw)
            y.square().sum().backward()
        outs.append((y.detach(), x.grad, w.grad))
    for u, v in zip(*outs, strict=True):
        assert u is not None and v is not None
        assert torch.equal(u, v)
