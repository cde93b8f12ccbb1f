"""Low-precision ops: exact integer GEMMs, opcheck, references, stochastic rounding."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import qsync_opt.ops as ops
from qsync_opt.ops import reference as ref
from qsync_opt.ops._build import load_cpu

CPP = load_cpu()[0]
needs_cpp = pytest.mark.skipif(not CPP, reason=f"C++ kernels not built: {load_cpu()[1]}")


def _unit_scale_ints(shape: tuple[int, ...], gen: torch.Generator, per_row: bool = False
                     ) -> torch.Tensor:
    """Integer-valued float32 in [-127, 127] whose abs-max is 127 (per row if asked), so
    quantization has unit scale and is exact."""
    x = torch.randint(-127, 128, shape, generator=gen).to(torch.float32)
    if per_row:
        x[:, 0] = 127.0
    else:
        x.view(-1)[0] = -127.0
    return x


@pytest.mark.parametrize("stochastic", [True, False])
def test_int8_linear_is_the_exact_integer_product(stochastic: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x = _unit_scale_ints((33, 64), gen)
    w = _unit_scale_ints((24, 64), gen, per_row=True)
    out = ops.int8_linear(x, w, stochastic=stochastic, seed=5)
    exact = ref.int_mm_reference(x.to(torch.int8), w.to(torch.int8).t())
    assert out.dtype == torch.float32
    assert torch.equal(out.to(torch.int64), exact)  # |values| < 2**24: exact in float32
    bias = torch.arange(24, dtype=torch.float32)
    assert torch.equal(ops.int8_linear(x, w, bias, stochastic=stochastic), exact.float() + bias)


def test_int_mm_matches_int64_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(-128, 128, (37, 53), dtype=torch.int8, generator=gen)
    b = torch.randint(-128, 128, (53, 29), dtype=torch.int8, generator=gen)
    assert torch.equal(ops.int_mm(a, b).to(torch.int64), ref.int_mm_reference(a, b))


@pytest.mark.parametrize("groups", [1, 2])
def test_int8_conv2d_is_the_exact_integer_conv(groups: int) -> None:
    gen = torch.Generator().manual_seed(2)
    x = _unit_scale_ints((2, 4, 7, 7), gen)
    w = torch.randint(-127, 128, (6, 4 // groups, 3, 3), generator=gen).float()
    w[:, 0, 0, 0] = 127.0
    out = ops.int8_conv2d(x, w, None, stride=2, padding=1, groups=groups)
    exact = F.conv2d(x.double(), w.double(), None, 2, 1, 1, groups)
    assert torch.equal(out.double(), exact)
    one = ops.int8_conv2d(x, torch.ones(5, 4, 1, 1) * 127)  # the 1x1 fast path
    assert torch.equal(one.double(), F.conv2d(x.double(), torch.ones(5, 4, 1, 1).double() * 127))


# ------------------------------------------------------------------ opcheck


def _opcheck_cases() -> list[tuple[str, object, tuple]]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 16, generator=gen, requires_grad=True)
    w = torch.randn(12, 16, generator=gen, requires_grad=True)
    b = torch.randn(12, generator=gen, requires_grad=True)
    xc = torch.randn(2, 4, 6, 6, generator=gen, requires_grad=True)
    wc = torch.randn(6, 2, 3, 3, generator=gen, requires_grad=True)
    q, s = ops.quantize_int8(w.detach(), 0)
    acc = torch.randint(-1000, 1000, (8, 12), dtype=torch.int32, generator=gen)
    _, qx, sx, qw, sw = torch.ops.qsync.int8_linear(x.detach(), w.detach(), None, False, True,
                                                   0, torch.bfloat16)
    g = torch.randn(8, 12, generator=gen)
    bf = torch.bfloat16
    return [
        ("quantize_int8", torch.ops.qsync.quantize_int8, (x.detach(), None, True, 3)),
        ("quantize_int8 axis", torch.ops.qsync.quantize_int8, (w.detach(), 0, False, 0)),
        ("dequantize_int8", torch.ops.qsync.dequantize_int8, (q, s, 0, torch.float32)),
        ("rescale_int32", torch.ops.qsync.rescale_int32,
         (acc, torch.tensor(0.5), torch.rand(12, generator=gen), b.detach(), torch.float32)),
        ("int8_linear", torch.ops.qsync.int8_linear, (x, w, b, False, True, 1, bf)),
        ("int8_linear full", torch.ops.qsync.int8_linear, (x, w, None, True, True, 1, bf)),
        ("int8_linear_backward", torch.ops.qsync.int8_linear_backward,
         (g, qx, sx, qw, sw, True, True, 1, bf, torch.float32, torch.float32)),
        ("int8_conv2d", torch.ops.qsync.int8_conv2d,
         (xc, wc, None, [1, 1], [1, 1], [1, 1], 2, False, True, 2, bf)),
        ("int8_conv2d full", torch.ops.qsync.int8_conv2d,
         (xc, wc, None, [2, 2], [0, 0], [1, 1], 2, True, True, 2, bf)),
        ("fake_quant_int8", torch.ops.qsync.fake_quant_int8, (x, None, True, 4)),
        ("fake_quant_float", torch.ops.qsync.fake_quant_float, (x, "fp8_e4m3")),
    ]


@pytest.mark.parametrize("case", _opcheck_cases(), ids=lambda c: c[0])
def test_opcheck(case) -> None:
    _, op, args = case
    torch.library.opcheck(op, args)


# ------------------------------------------------------------------ gradients


def test_int8_linear_backward_equals_autograd_of_the_dequantized_product() -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 5, 16, generator=gen, requires_grad=True)
    w = torch.randn(8, 16, generator=gen, requires_grad=True)
    b = torch.randn(8, generator=gen, requires_grad=True)
    out = ops.int8_linear(x, w, b, seed=9, bwd_dtype=torch.float32)
    g = torch.randn(out.shape, generator=gen)
    out.backward(g)
    # The same quantized operands, through torch's own autograd in float32.
    _, qx, sx, qw, sw = torch.ops.qsync.int8_linear(x.detach(), w.detach(), b.detach(), False,
                                                   True, 9, torch.float32)
    xd = ref.dequantize_int8(qx, sx.reshape(1), torch.float32).requires_grad_()
    wd = ref.dequantize_int8(qw, sw, torch.float32).requires_grad_()
    bd = b.detach().clone().requires_grad_()
    F.linear(xd, wd, bd).backward(g.reshape(-1, 8))
    assert torch.allclose(x.grad.reshape(-1, 16), xd.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(w.grad, wd.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(b.grad, bd.grad)


def test_int8_full_backward_equals_its_reference_formula() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(20, 16, generator=gen, requires_grad=True)
    w = torch.randn(8, 16, generator=gen, requires_grad=True)
    ops.int8_linear(x, w, int8_backward=True, seed=3).backward(torch.ones(20, 8))
    _, qx, sx, qw, sw = torch.ops.qsync.int8_linear(x.detach(), w.detach(), None, True, True, 3,
                                                   torch.bfloat16)
    s0, s1, s2, s3 = 3, 3 + 0x9E37, 3 + 2 * 0x9E37, 3 + 3 * 0x9E37
    go = torch.ones(20, 8)
    a_go = ref.channel_amax(go, False)
    qgo = ref.quantize_int8(go, 127.0 / a_go, True, s2)
    sgo = (a_go / 127.0).reshape(())
    wdeq = ref.dequantize_int8(qw, sw, torch.float32)
    a_wc = ref.channel_amax(wdeq.t().contiguous(), True)
    qwc = ref.quantize_int8(wdeq.t().contiguous(), 127.0 / a_wc, True, s3).t()
    gx = ref.rescale_int32(ref.int_mm_reference(qgo, qwc).to(torch.int32), sgo, a_wc / 127.0,
                           None, torch.float32)
    gw = ref.rescale_int32(ref.int_mm_reference(qgo.t(), qx).to(torch.int32), sgo * sx,
                           torch.ones(16), None, torch.float32)
    assert torch.equal(x.grad, gx) and torch.equal(w.grad, gw)
    assert s0 == 3 and s1  # the seed streams documented in ops._seeds


def test_bf16_backward_and_gradient_dtypes() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(6, 8, requires_grad=True)
    ops.int8_linear(x, w).sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    exact = torch.ones(4, 6) @ w.detach()
    assert torch.allclose(x.grad, exact, rtol=0.05, atol=0.05)


def test_fake_quant_gradients_pass_straight_through() -> None:
    x = torch.randn(10, dtype=torch.float64, requires_grad=True)
    ops.fake_quant_float(x.float(), "bf16").sum().backward()
    assert torch.equal(x.grad, torch.ones(10, dtype=torch.float64))
    y = torch.randn(10, requires_grad=True)
    (ops.fake_quant_int8(y) * 3).sum().backward()
    assert torch.equal(y.grad, torch.full((10,), 3.0))


def test_fake_quant_float_rounds_like_the_format() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(6))
    assert torch.equal(ops.fake_quant_float(x, "fp16"), x.half().float())
    assert torch.equal(ops.fake_quant_float(x, "bf16"), x.bfloat16().float())
    e4 = ops.fake_quant_float(x, "fp8_e4m3")
    rel = ((e4 - x).abs() / x.abs().clamp_min(1e-3)).median()
    assert 0 < rel < 2**-3  # 3 mantissa bits
    with pytest.raises(ValueError, match="fmt"):
        ops.fake_quant_float(x, "fp4")


# ------------------------------------------------------------------ compiled == reference


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("stochastic", [True, False])
def test_cpp_quantize_equals_reference(dtype, per_channel, stochastic) -> None:
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(37, 1031, generator=gen) * 3).to(dtype)
    amax = ref.channel_amax(x, per_channel)
    inv = 127.0 / amax
    for seed in (0, 1, 2**40 + 17):
        got = torch.ops.qsync_cpu.quantize_int8(x, inv, stochastic, seed)
        assert torch.equal(got, ref.quantize_int8(x, inv, stochastic, seed))


@needs_cpp
def test_cpp_rng_dequantize_and_rescale_equal_reference() -> None:
    gen = torch.Generator().manual_seed(8)
    for seed, offset in ((0, 0), (12345, 2**33 - 100)):
        assert torch.equal(torch.ops.qsync_cpu.hash_uniform(5000, seed, offset),
                           ref.hash_uniform(5000, seed, offset=offset))
    q = torch.randint(-127, 128, (16, 300), dtype=torch.int8, generator=gen)
    scale = torch.rand(16, generator=gen)
    acc = torch.randint(-2**20, 2**20, (33, 300), dtype=torch.int32, generator=gen)
    sw = torch.rand(300, generator=gen)
    bias = torch.randn(300, generator=gen)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(torch.ops.qsync_cpu.dequantize_int8(q, scale, dt),
                           ref.dequantize_int8(q, scale, dt))
        for b in (bias, None):
            assert torch.equal(torch.ops.qsync_cpu.rescale_int32(acc, torch.tensor(0.01), sw, b, dt),
                               ref.rescale_int32(acc, torch.tensor(0.01), sw, b, dt))


def test_reference_rng_against_scalar_python() -> None:
    def scalar(i: int, s: int) -> float:
        m = 0xFFFFFFFF
        h = ((i & m) * 0x9E3779B9) & m
        h ^= (((i >> 32) & m) * 0x85EBCA6B) & m
        h = (h + (s & m) * 0xC2B2AE35 + 0x27D4EB2F) & m
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & m
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & m
        h ^= h >> 16
        return (h >> 8) / 2**24

    got = ref.hash_uniform(50, 99, offset=2**35)
    assert got.tolist() == [scalar(2**35 + i, 99) for i in range(50)]


def test_python_fallback_when_cpp_is_disabled() -> None:
    code = ("import torch, qsync_opt.ops as o; a = o.available()['cpu']; "
            "q, s = o.quantize_int8(torch.arange(-5., 6.), stochastic=False); "
            "print(a.split(' (')[0], q.tolist())")
    env = {**os.environ, "QSYNC_DISABLE_CPP": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "Python references [-127, -102, -76, -51, -25, 0, 25, 51, 76, 102, 127]"


def test_available_reports_every_backend() -> None:
    info = ops.available()
    assert set(info) >= {"cpu", "cuda", "int_mm"}
    assert info["cpu"].startswith("C++ kernels" if CPP else "Python references")


# ------------------------------------------------------------------ stochastic rounding


def test_stochastic_rounding_is_unbiased_with_variance_step2_over_6() -> None:
    n = 1_000_000
    gen = torch.Generator().manual_seed(10)
    x = torch.rand(n, generator=gen) * 254 - 127  # step 1 (amax ~127): fractions uniform
    x[0] = 127.0
    q, scale = ops.quantize_int8(x, stochastic=True, seed=11)
    err = q.double() * float(scale) - x.double()
    step = float(scale)
    # Mean error: 0 within 4 standard errors (sd of one element's error <= step/2).
    assert abs(err.mean().item()) < 4 * (step / 2) / n**0.5
    # Variance: E[f(1-f)] = 1/6 of step^2 over uniform fractions; tolerance 2%.
    assert (err.pow(2).mean().item() / step**2) == pytest.approx(1 / 6, rel=0.02)
    q_rtn, s_rtn = ops.quantize_int8(x, stochastic=False)
    err_rtn = q_rtn.double() * float(s_rtn) - x.double()
    assert (err_rtn.pow(2).mean().item() / step**2) == pytest.approx(1 / 12, rel=0.02)


def test_stochastic_rounding_is_seeded_and_per_element_unbiased() -> None:
    x = torch.full((4096,), 0.3) * 127 / 127
    x[0] = 1.0  # amax 1: y = 0.3 * 127 = 38.1
    runs = torch.stack([ops.quantize_int8(x, seed=s)[0][1:].float() for s in range(64)])
    assert torch.equal(ops.quantize_int8(x, seed=5)[0], ops.quantize_int8(x, seed=5)[0])
    assert not torch.equal(ops.quantize_int8(x, seed=5)[0], ops.quantize_int8(x, seed=6)[0])
    mean = runs.mean().item()
    y = 0.3 * 127
    assert set(runs.unique().tolist()) == {38.0, 39.0}
    assert mean == pytest.approx(y, abs=4 * 0.5 / (runs.numel()) ** 0.5)


def test_per_channel_scales_and_axis() -> None:
    w = torch.tensor([[1.0, -2.0], [0.5, 0.25], [0.0, 0.0]])
    q, s = ops.quantize_int8(w, axis=0, stochastic=False)
    assert torch.allclose(s, torch.tensor([2 / 127, 0.5 / 127, 1 / 127]))
    assert q.tolist() == [[64, -127], [127, 64], [0, 0]]
    q1, s1 = ops.quantize_int8(w, axis=1, stochastic=False)
    assert s1.shape == (2,) and q1.shape == w.shape
    back = ops.dequantize_int8(q1, s1, axis=1)
    assert torch.allclose(back, w, atol=float(s1.max()) / 2 + 1e-7)
    with pytest.raises(ValueError, match="x: expected float32"):
        ops.quantize_int8(torch.arange(4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ops_equal_the_cpu_references() -> None:
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(64, 96, generator=gen)
    w = torch.randn(48, 96, generator=gen)
    for stochastic in (True, False):
        q_gpu, s_gpu = ops.quantize_int8(x.cuda(), axis=None, stochastic=stochastic, seed=3)
        q_cpu, s_cpu = ops.quantize_int8(x, axis=None, stochastic=stochastic, seed=3)
        assert torch.equal(q_gpu.cpu(), q_cpu) and torch.equal(s_gpu.cpu(), s_cpu)
    xi = _unit_scale_ints((40, 96), gen)
    wi = _unit_scale_ints((48, 96), gen, per_row=True)
    out = ops.int8_linear(xi.cuda(), wi.cuda())
    assert torch.equal(out.cpu().to(torch.int64),
                       ref.int_mm_reference(xi.to(torch.int8), wi.to(torch.int8).t()))
    y = ops.int8_linear(x.cuda().requires_grad_(), w.cuda().requires_grad_())
    y.sum().backward()


def test_a_stale_build_lock_is_cleared_and_a_live_one_kept(tmp_path):
    """A builder that died leaves torch's lock file behind, which would make every later load
    wait forever; an old lock is removed, a fresh one (a build in progress) is kept."""
    import os
    import time

    from qsync_opt.ops._build import STALE_LOCK_S, _clear_stale_lock

    lock = tmp_path / "lock"
    lock.touch()
    _clear_stale_lock(tmp_path)
    assert lock.exists()
    old = time.time() - STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    _clear_stale_lock(tmp_path)
    assert not lock.exists()
