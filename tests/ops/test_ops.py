"""Low-precision ops: exact integer GEMMs, opcheck, references, stochastic rounding; outputs
that own their memory (in-place ops after them), every op against its reference over groups,
1x1 maps, strides and layouts, on the C++ kernels and on the Python references."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import qsync_opt.ops as ops
from qsync_opt.ops import reference as ref
from qsync_opt.ops._build import load_cpu
from support.ops_backends import BACKENDS as OPS_BACKENDS
from support.ops_backends import strict_int_mm, use_backend

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
                                                   0, torch.bfloat16, True, 2)
    g = torch.randn(8, 12, generator=gen)
    bf = torch.bfloat16
    return [
        ("quantize_int8", torch.ops.qsync.quantize_int8, (x.detach(), None, True, 3)),
        ("quantize_int8 axis", torch.ops.qsync.quantize_int8, (w.detach(), 0, False, 0)),
        ("dequantize_int8", torch.ops.qsync.dequantize_int8, (q, s, 0, torch.float32)),
        ("rescale_int32", torch.ops.qsync.rescale_int32,
         (acc, torch.tensor(0.5), torch.rand(12, generator=gen), b.detach(), torch.float32)),
        ("int8_linear", torch.ops.qsync.int8_linear, (x, w, b, False, True, 1, bf, True, 2)),
        ("int8_linear full", torch.ops.qsync.int8_linear, (x, w, None, True, True, 1, bf, True, 2)),
        ("int8_linear full tensor", torch.ops.qsync.int8_linear,
         (x, w, None, True, True, 1, bf, True, 0)),
        ("int8_linear_backward", torch.ops.qsync.int8_linear_backward,
         (g, qx, sx, qw, sw, True, True, 1, bf, torch.float32, torch.float32, 2)),
        ("rescale_int32_rows", torch.ops.qsync.rescale_int32_rows,
         (acc, torch.rand(8, generator=gen), torch.rand(12, generator=gen), b.detach(),
          torch.float32)),
        ("int8_conv2d", torch.ops.qsync.int8_conv2d,
         (xc, wc, None, [1, 1], [1, 1], [1, 1], 2, False, True, 2, bf, True, 2)),
        ("int8_conv2d full", torch.ops.qsync.int8_conv2d,
         (xc, wc, None, [2, 2], [0, 0], [1, 1], 2, True, True, 2, bf, True, 2)),
        ("int8_conv2d full row", torch.ops.qsync.int8_conv2d,
         (xc, wc, None, [2, 2], [0, 0], [1, 1], 2, True, True, 2, bf, False, 1)),
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
                                                   True, 9, torch.float32, True, 2)
    xd = ref.dequantize_int8(qx, sx.reshape(1), torch.float32).requires_grad_()
    wd = ref.dequantize_int8(qw, sw, torch.float32).requires_grad_()
    bd = b.detach().clone().requires_grad_()
    F.linear(xd, wd, bd).backward(g.reshape(-1, 8))
    assert torch.allclose(x.grad.reshape(-1, 16), xd.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(w.grad, wd.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(b.grad, bd.grad)


def _ref_quant(t: torch.Tensor, axis: int | None, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's int8 quantization of 2-D ``t`` (stochastic), per tensor or per slice
    along ``axis`` (the element order of ``t`` with ``axis`` moved first)."""
    moved = t if axis in (None, 0) else t.t().contiguous()
    amax = ref.channel_amax(moved, axis is not None)
    q = ref.quantize_int8(moved, 127.0 / amax, True, seed)
    scale = ref.scale_of(amax, 127)
    q = q if axis in (None, 0) else q.t()
    return q, scale.reshape(()) if axis is None else scale


@pytest.mark.parametrize("grad_scale", ["tensor", "row", "rowcol"])
def test_int8_full_backward_equals_its_reference_formula(grad_scale: str) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(20, 16, generator=gen, requires_grad=True)
    w = torch.randn(8, 16, generator=gen, requires_grad=True)
    go = torch.randn(20, 8, generator=gen) * torch.logspace(-2, 1, 20).reshape(-1, 1)
    ops.int8_linear(x, w, int8_backward=True, seed=3, grad_scale=grad_scale).backward(go)
    _, qx, sx, qw, sw = torch.ops.qsync.int8_linear(x.detach(), w.detach(), None, True, True, 3,
                                                   torch.bfloat16, True, 0)
    s0, s1, s2, s3 = 3, 3 + 0x9E37, 3 + 2 * 0x9E37, 3 + 3 * 0x9E37
    if grad_scale == "tensor":
        (qgr, sgr) = (qgc, sgc) = _ref_quant(go, None, s2)
    else:  # per row for grad_x; per column (rowcol) or one scale for grad_w, 4th stream
        qgr, sgr = _ref_quant(go, 0, s2)
        qgc, sgc = _ref_quant(go, 1 if grad_scale == "rowcol" else None, s2 + 4 * 0x9E37)
    wdeq = ref.dequantize_int8(qw, sw, torch.float32)
    qwc, swc = _ref_quant(wdeq, 1, s3)
    gx_acc = ref.int_mm_reference(qgr, qwc).to(torch.int32)
    gw_acc = ref.int_mm_reference(qgc.t(), qx).to(torch.int32)
    if sgr.dim() == 0:
        gx = ref.rescale_int32(gx_acc, sgr, swc, None, torch.float32)
    else:
        gx = ref.rescale_int32_rows(gx_acc, sgr, swc, None, torch.float32)
    sgw = (sgc * sx).expand(8) if sgc.dim() == 0 else sgc * sx
    gw = ref.rescale_int32_rows(gw_acc, sgw, torch.ones(16), None, torch.float32)
    assert torch.equal(x.grad, gx) and torch.equal(w.grad, gw)
    assert s0 == 3 and s1  # the seed streams documented in ops.int8.seeds


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


@pytest.mark.slow
def test_python_fallback_when_cpp_is_disabled() -> None:
    code = ("import torch, qsync_opt.ops as o; a = o.available()['cpu']; "
            "q, s = o.quantize_int8(torch.arange(-5., 6.), stochastic=False); "
            "print(a.split(' (')[0], q.tolist())")
    env = {**os.environ, "QSYNC_DISABLE_CPP": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "Python references [-127, -102, -76, -51, -25, 0, 25, 51, 76, 102, 127]"


def test_available_reports_everyuse_backend() -> None:
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
    # many scales at once: a GPU scale computed as amax * (1/qmax) instead of amax / qmax is
    # one bit off for about 4% of int8's and half of int4's amax values (seen on an H200)
    rows = torch.randn(4096, 8, generator=gen) * torch.rand(4096, 1, generator=gen) * 50
    for quantize in (ops.quantize_int8, ops.quantize_int4):
        q_gpu, s_gpu = quantize(rows.cuda(), axis=0, stochastic=True, seed=5)
        q_cpu, s_cpu = quantize(rows, axis=0, stochastic=True, seed=5)
        assert torch.equal(s_gpu.cpu(), s_cpu) and torch.equal(q_gpu.cpu(), q_cpu)
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


# ------------------------------------------------------------------ outputs own their memory
#
# Every op runs on both CPU implementations: the C++ kernels ("cpp") and the Python
# references that serve when they are not built or QSYNC_DISABLE_CPP is set ("python").

BACKENDS = list(OPS_BACKENDS)


def _owns_its_memory(outs: tuple[torch.Tensor, ...], ins: tuple[object, ...]) -> None:
    tensors = [t for t in ins if isinstance(t, torch.Tensor)]
    for i, t in enumerate(outs):
        assert not t._is_view(), f"output {i} is a view"
        for j, other in enumerate(tensors + list(outs[:i])):
            assert t.numel() == 0 or other.numel() == 0 or (
                t.untyped_storage().data_ptr() != other.untyped_storage().data_ptr()), \
                f"output {i} aliases tensor {j}"


def _alias_cases() -> list[tuple[str, object, tuple]]:
    gen = torch.Generator().manual_seed(20)
    bf, f32 = torch.bfloat16, torch.float32
    cases: list[tuple[str, object, tuple]] = []
    for shape_x, n in (((1, 8), 4), ((2, 3, 8), 4), ((5, 8), 1), ((5, 1), 3), ((1, 1), 1)):
        x = torch.randn(shape_x, generator=gen)
        w = torch.randn(n, shape_x[-1], generator=gen)
        for full in (False, True):
            cases.append((f"int8_linear x{shape_x} n{n} full={full}", torch.ops.qsync.int8_linear,
                          (x, w, None, full, True, 1, bf, True, 2)))
            _, qx, sx, qw, sw = torch.ops.qsync.int8_linear(x, w, None, full, True, 1, bf,
                                                           True, 2)
            g = torch.randn(qx.shape[0], n, generator=gen)
            cases.append((f"int8_linear_backward x{shape_x} n{n} full={full}",
                          torch.ops.qsync.int8_linear_backward,
                          (g, qx, sx, qw, sw, full, True, 1, bf, f32, f32, 2)))
    conv_shapes = (((2, 8, 1, 1), (4, 8, 1, 1), 1, 0, 1),   # squeeze-excitation 1x1 on 1x1
                   ((1, 4, 1, 1), (4, 1, 3, 3), 4, 1, 1),   # depthwise on a 1x1 map
                   ((2, 4, 5, 5), (4, 1, 3, 3), 4, 1, 2),   # depthwise, stride 2
                   ((1, 4, 4, 4), (1, 4, 1, 1), 1, 0, 1),   # one output channel
                   ((2, 4, 3, 3), (6, 2, 1, 1), 2, 0, 2))   # grouped 1x1, stride 2
    for xs, ws, groups, pad, stride in conv_shapes:
        x = torch.randn(xs, generator=gen)
        w = torch.randn(ws, generator=gen)
        conv = ([stride] * 2, [pad] * 2, [1, 1], groups)
        for full in (False, True):
            cases.append((f"int8_conv2d x{xs} w{ws} full={full}", torch.ops.qsync.int8_conv2d,
                          (x, w, None, *conv, full, True, 2, bf, True, 2)))
            out, qx, sx, qw, sw = torch.ops.qsync.int8_conv2d(x, w, None, *conv, full, True, 2,
                                                             bf, True, 2)
            g = torch.randn(out.shape, generator=gen)
            cases.append((f"int8_conv2d_backward x{xs} w{ws} full={full}",
                          torch.ops.qsync.int8_conv2d_backward,
                          (g, qx, sx, qw, sw, *conv, full, True, 2, bf, f32, f32, 2)))
    for shape in ((1, 6), (6, 1), (1, 1), (3, 1, 1)):
        t = torch.randn(shape, generator=gen)
        for axis in (None, 0, len(shape) - 1):
            cases.append((f"quantize_int8 {shape} axis={axis}", torch.ops.qsync.quantize_int8,
                          (t, axis, True, 3)))
            q, s = torch.ops.qsync.quantize_int8(t, axis, True, 3)
            cases.append((f"dequantize_int8 {shape} axis={axis}",
                          torch.ops.qsync.dequantize_int8, (q, s, axis, f32)))
            cases.append((f"fake_quant_int8 {shape} axis={axis}",
                          torch.ops.qsync.fake_quant_int8, (t, axis, True, 3)))
    acc = torch.randint(-100, 100, (1, 5), dtype=torch.int32, generator=gen)
    cases.append(("rescale_int32 1x5", torch.ops.qsync.rescale_int32,
                  (acc, torch.tensor(0.5), torch.rand(5, generator=gen), None, f32)))
    cases.append(("rescale_int32_rows 1x5", torch.ops.qsync.rescale_int32_rows,
                  (acc, torch.rand(1, generator=gen), torch.rand(5, generator=gen), None, f32)))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        t = torch.randn(1, 7, generator=gen).to(dtype)
        for fmt in ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2"):
            cases.append((f"fake_quant_float {dtype} -> {fmt}", torch.ops.qsync.fake_quant_float,
                          (t, fmt)))
    return cases


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", _alias_cases(), ids=lambda c: c[0])
def test_no_op_output_is_a_view_or_an_alias(case, backend: str) -> None:
    """No output of a qsync op is a view, or shares memory with an input or another output
    (a view would make any following in-place op raise; fake_quant_float of an fp16 tensor
    to fp16 returned its input)."""
    _, op, args = case
    with use_backend(backend):
        out = op(*args)
    _owns_its_memory(out if isinstance(out, tuple) else (out,), args)


_INPLACE = {
    "relu_": (lambda y: y.relu_(), F.relu),
    "silu_": (lambda y: F.silu(y, inplace=True), F.silu),
    "hardswish_": (lambda y: F.hardswish(y, inplace=True), F.hardswish),
    "add_": (lambda y: y.add_(1.0), lambda y: y + 1.0),
}


def _inplace_cases() -> list[tuple[str, tuple[int, ...], tuple[int, ...], dict]]:
    lin = [(f"linear x{xs} n{n}", xs, (n, xs[-1]), {})
           for xs, n in (((1, 8), 4), ((3, 8), 4), ((2, 3, 8), 5), ((4, 8), 1))]
    conv = [(f"conv x{xs} w{ws} g{g}", xs, ws, {"groups": g, "padding": p})
            for xs, ws, g, p in (((1, 8, 1, 1), (4, 8, 1, 1), 1, 0),    # SE / MobileNet head
                                 ((2, 8, 1, 1), (8, 1, 1, 1), 8, 0),    # depthwise 1x1 on 1x1
                                 ((2, 4, 5, 5), (4, 1, 3, 3), 4, 1),    # depthwise 3x3
                                 ((1, 4, 1, 1), (1, 4, 1, 1), 1, 0))]   # one output channel
    return lin + conv


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("full", [False, True], ids=["int8", "int8_full"])
@pytest.mark.parametrize("inplace", list(_INPLACE))
@pytest.mark.parametrize("case", _inplace_cases(), ids=lambda c: c[0])
def test_inplace_op_after_int8_op(case, inplace: str, full: bool, backend: str) -> None:
    """An in-place op after an int8 / int8_full linear or conv runs, and gives exactly the
    gradients of its out-of-place version; the gradients own their memory."""
    _, xs, ws, conv = case
    fn_inplace, fn = _INPLACE[inplace]
    gen = torch.Generator().manual_seed(21)
    x0, w0, b0 = torch.randn(xs, generator=gen), torch.randn(ws, generator=gen), \
        torch.randn(ws[0], generator=gen)
    results = []
    with use_backend(backend):
        for f in (fn_inplace, fn):
            x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
            if len(xs) == 4:
                y = ops.int8_conv2d(x, w, b, int8_backward=full, seed=4, **conv)
            else:
                y = ops.int8_linear(x, w, b, int8_backward=full, seed=4)
            g = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
            z = f(y)
            (z * g).sum().backward()
            results.append((z.detach(), x.grad, w.grad, b.grad))
            _owns_its_memory((x.grad, w.grad, b.grad), (g, z))
    for got, want in zip(results[0], results[1], strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inplace", list(_INPLACE))
def test_inplace_op_after_fake_quant(inplace: str, backend: str) -> None:
    fn_inplace, fn = _INPLACE[inplace]
    with use_backend(backend):
        for quant in (lambda t: ops.fake_quant_int8(t, seed=2),
                      lambda t: ops.fake_quant_int8(t, axis=0, seed=2),
                      lambda t: ops.fake_quant_float(t, "fp8_e4m3"),
                      lambda t: ops.fake_quant_float(t, "bf16")):
            for shape in ((1, 1), (1, 5), (3, 1)):
                x = torch.randn(shape, requires_grad=True)
                x2 = x.detach().clone().requires_grad_()
                (fn_inplace(quant(x)) * 3).sum().backward()
                (fn(quant(x2)) * 3).sum().backward()
                assert torch.equal(x.grad, x2.grad)


# ------------------------------------------------------------------ every op == its reference
#
# Integer-valued operands whose abs-max is 127 (per tensor for inputs and gradients) and
# weights of +-127 (abs-max 127 per output channel and per input column) quantize exactly,
# by stochastic rounding too (floor(y + u) = y for an integer y and u < 1). Every int8 op is
# then an exact integer computation, equal to float64 autograd bit for bit, whatever the
# groups, strides, paddings, dilations, map sizes and input layouts.


def _int_operand(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    t = torch.randint(-127, 128, shape, generator=gen).to(torch.float32)
    t.view(-1)[0] = 127.0
    return t


def _grad_operand(shape: tuple[int, ...], gen: torch.Generator, conv: bool) -> torch.Tensor:
    """An integer output gradient whose abs-max is 127 per tensor, per row (token / output
    position) and per column (output channel): int8_full's every scale then quantizes it
    exactly."""
    t = _int_operand(shape, gen)
    if conv:  # rows are (b, h, w), columns the channels (axis 1)
        t[:, 0] = 127.0
        t[0, :, 0, 0] = 127.0
    else:
        t[..., 0] = 127.0
        t.reshape(-1, shape[-1])[0] = 127.0
    return t


def _sign_weight(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return (torch.randint(0, 2, shape, generator=gen) * 254 - 127).to(torch.float32)


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values in another memory layout (a non-contiguous view, or channels_last)."""
    if layout == "channels_last":
        return t.clone(memory_format=torch.channels_last)
    if layout == "permuted":  # stored with the last two axes swapped
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "sliced":  # every other element of a larger buffer
        big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1])
        big[..., 1::2] = t
        return big[..., 1::2]
    return t.clone()


conv_cases = st.fixed_dictionaries({
    "batch": st.sampled_from([1, 2]),
    "groups": st.sampled_from([1, 2, 4]),
    "cin_g": st.sampled_from([1, 1, 2, 3]),   # 1: one input channel per group
    "cout_g": st.sampled_from([1, 2]),
    "k": st.sampled_from([(1, 1), (3, 3), (1, 3), (7, 7)]),
    "hw": st.sampled_from([(1, 1), (2, 3), (5, 5), (8, 7)]),
    "stride": st.sampled_from([1, 2]),
    "padding": st.sampled_from([0, 1, 3]),
    "dilation": st.sampled_from([1, 2]),
    "layout": st.sampled_from(["contiguous", "channels_last", "permuted", "sliced"]),
    "bias": st.booleans(),
})


def _conv_fits(case: dict) -> bool:
    (kh, kw), (h, w), p, d = case["k"], case["hw"], case["padding"], case["dilation"]
    return h + 2 * p - d * (kh - 1) >= 1 and w + 2 * p - d * (kw - 1) >= 1


def _check_conv_exact(case: dict, full: bool, gen: torch.Generator) -> None:
    groups, cin_g, cout_g = case["groups"], case["cin_g"], case["cout_g"]
    (kh, kw), (h, w), s, p, d = case["k"], case["hw"], case["stride"], case["padding"], \
        case["dilation"]
    x0 = _int_operand((case["batch"], groups * cin_g, h, w), gen)
    w0 = _sign_weight((groups * cout_g, cin_g, kh, kw), gen)
    b0 = torch.randint(-5, 6, (groups * cout_g,), generator=gen).float() if case["bias"] else None
    x = _layout(x0, case["layout"]).requires_grad_()
    wt = _layout(w0, case["layout"]).requires_grad_()
    bt = None if b0 is None else b0.clone().requires_grad_()
    out = ops.int8_conv2d(x, wt, bt, s, p, d, groups, int8_backward=full, seed=7,
                          bwd_dtype=torch.float32)
    g = _grad_operand(tuple(out.shape), gen, conv=True)
    out.backward(g)
    xr, wr = x0.detach().double().requires_grad_(), w0.detach().double().requires_grad_()
    br = None if b0 is None else b0.double().requires_grad_()
    want = F.conv2d(xr, wr, br, s, p, d, groups)
    want.backward(g.double())
    assert torch.equal(out.double(), want)
    assert torch.equal(x.grad.double(), xr.grad)
    assert torch.equal(wt.grad.double(), wr.grad)
    if b0 is not None:
        assert torch.equal(bt.grad.double(), br.grad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("full", [False, True], ids=["int8", "int8_full"])
@settings(max_examples=40, deadline=None, derandomize=True)
@given(case=conv_cases, seed=st.integers(0, 2**16))
def test_int8_conv2d_forward_and_backward_are_exact(backend: str, full: bool, case: dict,
                                                     seed: int) -> None:
    """int8 / int8_full conv2d, forward and both gradients, equal float64 autograd exactly
    over groups {1, 2, 4, C}, 1x1 maps, strides, paddings, dilations and input layouts; every
    integer GEMM gets operands with a valid leading dimension."""
    assume(_conv_fits(case))
    with use_backend(backend), strict_int_mm():
        _check_conv_exact(case, full, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("full", [False, True], ids=["int8", "int8_full"])
@pytest.mark.parametrize("groups", [1, 2, 4, "C"])
def test_int8_conv2d_exact_for_each_groups_class(backend: str, full: bool, groups) -> None:
    """The named classes, each for sure: groups 1, 2, 4 and C (depthwise 7x7, ConvNeXt) with
    one channel per group, on a 1x1 map and on a 7x7 map."""
    c = 8
    g = c if groups == "C" else groups
    base = {"batch": 2, "groups": g, "cin_g": c // g if groups != "C" else 1, "cout_g": 1,
            "stride": 1, "dilation": 1, "layout": "contiguous", "bias": True}
    with use_backend(backend), strict_int_mm():
        for k, hw, p in (((7, 7), (7, 7), 3), ((7, 7), (1, 1), 3), ((1, 1), (1, 1), 0)):
            _check_conv_exact({**base, "k": k, "hw": hw, "padding": p}, full,
                              torch.Generator().manual_seed(g))


linear_cases = st.fixed_dictionaries({
    "lead": st.sampled_from([(1,), (3,), (2, 3), (1, 1)]),
    "k": st.sampled_from([1, 5, 16]),
    "n": st.sampled_from([1, 6]),
    "layout": st.sampled_from(["contiguous", "permuted", "sliced"]),
    "bias": st.booleans(),
})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("full", [False, True], ids=["int8", "int8_full"])
@settings(max_examples=30, deadline=None, derandomize=True)
@given(case=linear_cases, seed=st.integers(0, 2**16))
def test_int8_linear_forward_and_backward_are_exact(backend: str, full: bool, case: dict,
                                                     seed: int) -> None:
    """int8 / int8_full linear equals float64 autograd exactly, with batch 1, one input or
    one output feature and non-contiguous inputs."""
    gen = torch.Generator().manual_seed(seed)
    x0 = _int_operand((*case["lead"], case["k"]), gen)
    w0 = _sign_weight((case["n"], case["k"]), gen)
    b0 = torch.randint(-5, 6, (case["n"],), generator=gen).float() if case["bias"] else None
    x = _layout(x0, case["layout"]).requires_grad_()
    w = _layout(w0, case["layout"]).requires_grad_()
    b = None if b0 is None else b0.clone().requires_grad_()
    with use_backend(backend), strict_int_mm():
        out = ops.int8_linear(x, w, b, int8_backward=full, seed=3, bwd_dtype=torch.float32)
        g = _grad_operand(tuple(out.shape), gen, conv=False)
        out.backward(g)
    xr, wr = x0.detach().double().requires_grad_(), w0.detach().double().requires_grad_()
    br = None if b0 is None else b0.double().requires_grad_()
    want = F.linear(xr, wr, br)
    want.backward(g.double())
    assert torch.equal(out.double(), want)
    assert torch.equal(x.grad.double(), xr.grad) and torch.equal(w.grad.double(), wr.grad)
    if b0 is not None:
        assert torch.equal(b.grad.double(), br.grad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("conv", [
    dict(c=16, groups=16, k=7, padding=3, hw=7),     # ConvNeXt depthwise 7x7
    dict(c=16, groups=16, k=3, padding=1, hw=1),     # depthwise on a 1x1 map
    dict(c=8, groups=4, k=3, padding=2, hw=6, dilation=2),
    dict(c=8, groups=1, k=1, padding=0, hw=1),       # squeeze-excitation 1x1 on 1x1
], ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_int8_full_conv_gradients_within_quantization_error(backend: str, conv: dict) -> None:
    """Random float operands: int8_full gradients against fp32 autograd, relative error within
    int8's (a few percent; the misread GEMM operand gave 4e4-9e5)."""
    c, groups, k, hw = conv["c"], conv["groups"], conv["k"], conv["hw"]
    gen = torch.Generator().manual_seed(30)
    x0 = torch.randn(4, c, hw, hw, generator=gen)
    w0 = torch.randn(c, c // groups, k, k, generator=gen)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    args = (1, conv["padding"], conv.get("dilation", 1), groups)
    with use_backend(backend), strict_int_mm():
        out = ops.int8_conv2d(x, w, None, *args, int8_backward=True, seed=5)
        g = torch.randn(out.shape, generator=gen)
        out.backward(g)
    xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    want = F.conv2d(xr, wr, None, *args)
    want.backward(g)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).detach().norm() / b.detach().norm())

    assert rel(out, want) < 0.05
    assert rel(x.grad, xr.grad) < 0.1 and rel(w.grad, wr.grad) < 0.1


@pytest.mark.slow
def test_inplace_and_depthwise_with_cpp_disabled_by_environment() -> None:
    """QSYNC_DISABLE_CPP=1 (the Python references, selected as a user would): an in-place
    ReLU after int8 linear and an exact int8_full depthwise conv with an in-place add."""
    code = """
import torch, torch.nn.functional as F, qsync_opt.ops as o
assert o.available()['cpu'].startswith('Python references')
x = torch.randn(1, 8, requires_grad=True); w = torch.randn(4, 8, requires_grad=True)
o.int8_linear(x, w, int8_backward=True).relu_().sum().backward()
x = torch.randint(-127, 128, (2, 4, 5, 5)).float(); x[0, 0, 0, 0] = 127; x.requires_grad_()
w = (torch.randint(0, 2, (4, 1, 3, 3)) * 254 - 127).float().requires_grad_()
y = o.int8_conv2d(x, w, None, 1, 1, 1, 4, int8_backward=True, bwd_dtype=torch.float32)
g = torch.randint(-127, 128, y.shape).float(); g[:, 0] = 127; g[0, :, 0, 0] = 127
y.add_(1.0).backward(g)
xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
F.conv2d(xr, wr, None, 1, 1, 1, 4).backward(g.double())
print(torch.equal(x.grad.double(), xr.grad), torch.equal(w.grad.double(), wr.grad))
"""
    env = {**os.environ, "QSYNC_DISABLE_CPP": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "True True"


def _degenerate_layouts() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(40)
    col = torch.randint(-127, 128, (9, 1), dtype=torch.int8, generator=gen)
    return [
        ("[1,K] strides (1,1): a transposed column", col.t()),
        ("[M,1] strides (1,L): im2col of one channel",  # [B, 1, L] -> [B*L, 1]
         torch.randint(-127, 128, (2, 1, 9), dtype=torch.int8, generator=gen)
         .transpose(1, 2).reshape(18, 1)),
        ("[1,K] from movedim over a size-1 axis", col.movedim(0, 1).contiguous()),
        ("[K,N] transposed weight", torch.randint(-127, 128, (4, 9), dtype=torch.int8,
                                                  generator=gen).t()),
        ("[M,K] row-major slice", torch.randint(-127, 128, (9, 20), dtype=torch.int8,
                                                generator=gen)[:, 3:12]),
    ]


@pytest.mark.parametrize("case", _degenerate_layouts(), ids=lambda c: c[0])
@pytest.mark.parametrize("side", ["a", "b"])
def test_int_mm_gives_torch_int_mm_valid_leading_dimensions(case, side: str) -> None:
    _, t = case
    gen = torch.Generator().manual_seed(41)
    if side == "a":
        a, b = t, torch.randint(-127, 128, (t.shape[1], 5), dtype=torch.int8, generator=gen)
    else:
        a, b = torch.randint(-127, 128, (3, t.shape[0]), dtype=torch.int8, generator=gen), t
    with strict_int_mm() as calls:
        got = ops.int_mm(a, b)
    assert calls and torch.equal(got.to(torch.int64), ref.int_mm_reference(a, b))


def test_scales_are_the_correctly_rounded_division() -> None:
    """``amax / qmax`` as one float32 division, the same on every device; the reciprocal
    product that torch's CUDA kernel uses for a Python-number divisor is not (it is one bit
    off for many amax values: the scales then differed between the CPU and a GPU)."""
    gen = torch.Generator().manual_seed(3)
    amax = torch.rand(100_000, generator=gen) * 100 + 1e-3
    for qmax in (ref.INT8_QMAX, ref.INT4_QMAX):
        s = ref.scale_of(amax, qmax)
        assert torch.equal(s, (amax.double() / qmax).float())  # float32 operands: exact
        recip = amax * torch.tensor(1.0 / qmax, dtype=torch.float32)
        assert (recip != s).any()  # the GPU's shortcut would be caught by the GPU test
        _, scale = (ops.quantize_int8 if qmax == ref.INT8_QMAX else ops.quantize_int4)(
            amax.view(-1, 1), axis=0, stochastic=False)
        assert torch.equal(scale, s)
