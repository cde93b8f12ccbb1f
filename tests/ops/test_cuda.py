"""The CUDA kernels: they compile with nvcc for every architecture, the build is cached, and
(on a GPU) they equal the documented formulas bit for bit.

Without nvcc the compile tests skip, except under CI=true where they fail. Without a CUDA
device (torch CPU build) the GPU tests skip; the reference RNG and the Python-side argument
checks are still tested. With a device, kernels that do not load fail under CI=true. The C++
CPU kernels' build is checked here too: under CI=true it must have built and loaded.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from qsync_opt.cuda import source_dir
from qsync_opt.cuda.build import (
    ARCHS,
    KEY_NAME,
    LIB_NAME,
    CudaBuildError,
    build,
    find_nvcc,
    nvcc_command,
)
from qsync_opt.cuda.kernels import _SIGNATURES, CudaKernels, _load_cached, load, load_error

ENTRY_POINTS = (
    "qsync_quantize_int8",
    "qsync_quantize_int4",
    "qsync_pack_int4",
    "qsync_int4_gemm",
    "qsync_dequantize_int8",
    "qsync_rescale_int32",
    "qsync_rescale_int32_rows",
    "qsync_hash_uniform",
)
M32 = 0xFFFFFFFF
FLOATS = (torch.float32, torch.float16, torch.bfloat16)

# (index, seed, h >> 8) from a C compilation of the formula in qsync_kernels.h.
GOLDEN_HASH = [
    (0, 0, 9175879),
    (1, 0, 12647793),
    (2, 12345, 9689246),
    (12345, 12345, 9750232),
    (4294967295, 0, 2277490),
    (4294967296, 0, 6328916),
    (4294967303, 12345, 8880062),
    (1 << 40, 0x123456789, 9577629),
    (0, 0xFFFFFFFFFFFFFFFF, 12773277),
    (1, 0xFFFFFFFF, 2394911),
]


# ---------------------------------------------------------------------------- references


def ref_hash_bits(i: int, seed: int) -> int:
    """h >> 8 for element i: the RNG of qsync_kernels.h on Python ints, masked to 32 bits."""
    i &= 0xFFFFFFFFFFFFFFFF
    h = ((i & M32) * 0x9E3779B9) & M32
    h ^= (((i >> 32) & M32) * 0x85EBCA6B) & M32
    h = (h + ((((seed & M32) * 0xC2B2AE35) & M32) + 0x27D4EB2F)) & M32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    h ^= h >> 16
    return h >> 8


def ref_hash_uniform(i: int, seed: int) -> float:
    return ref_hash_bits(i, seed) * (1.0 / 16777216.0)  # exact in float32


def _mul32(a: torch.Tensor, b: int) -> torch.Tensor:
    """(a * b) & 0xFFFFFFFF for int64 a in [0, 2^32) without int64 overflow."""
    lo, hi = b & 0xFFFF, b >> 16
    return (a * lo + (((a * hi) & 0xFFFF) << 16)) & M32


def ref_hash_uniform_torch(idx: torch.Tensor, seed: int) -> torch.Tensor:
    """The RNG vectorised over int64 indices (CPU), explicit 32-bit masking throughout."""
    idx = idx.to(torch.int64)
    h = _mul32(idx & M32, 0x9E3779B9)
    h = h ^ _mul32((idx >> 32) & M32, 0x85EBCA6B)
    h = (h + ((((seed & M32) * 0xC2B2AE35) & M32) + 0x27D4EB2F)) & M32
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    h = h ^ (h >> 16)
    return (h >> 8).to(torch.float32) * (1.0 / 16777216.0)


def ref_quantize(
    x: torch.Tensor, inv_scale: torch.Tensor, inner: int, stochastic: bool, seed: int
) -> torch.Tensor:
    x = x.detach().cpu().reshape(-1)
    inv = inv_scale.detach().cpu().to(torch.float32).reshape(-1, 1)
    y = (x.float().reshape(-1, inner) * inv).reshape(-1)
    if stochastic:
        u = ref_hash_uniform_torch(torch.arange(x.numel()), seed)
        r = torch.floor(y + u)
    else:
        r = torch.round(y)  # half to even, like rintf
    return torch.clamp(r, -127.0, 127.0).to(torch.int8)


def ref_dequantize(q: torch.Tensor, scale: torch.Tensor, inner: int, dtype) -> torch.Tensor:
    q = q.cpu().reshape(-1, inner)
    return (q.float() * scale.cpu().reshape(-1, 1)).reshape(-1).to(dtype)


def ref_rescale(acc, sx: float, sw, bias, dtype) -> torch.Tensor:
    s = torch.tensor(sx, dtype=torch.float32) * sw.cpu()
    v = acc.cpu().float() * s
    if bias is not None:
        v = v + bias.cpu()
    return v.to(dtype)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.is_floating_point():
        width = {4: torch.int32, 2: torch.int16}[got.element_size()]
        got, want = got.view(width), want.view(width)
    diff = (got != want).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} elements differ, first at {diff[:5].tolist()}"


# ---------------------------------------------------------------------- reference checks


def test_reference_rng_matches_c_golden_values():
    for i, seed, bits in GOLDEN_HASH:
        assert ref_hash_bits(i, seed) == bits, (i, seed)


def test_reference_rng_torch_matches_python():
    idx = torch.cat([torch.arange(5000), torch.arange(2**32 - 2000, 2**32 + 3000)])
    for seed in (0, 12345, 0xFFFFFFFF, 2**40 + 7):
        want = torch.tensor([ref_hash_uniform(int(i), seed) for i in idx], dtype=torch.float32)
        assert torch.equal(ref_hash_uniform_torch(idx, seed), want)
    golden = torch.tensor([g[0] for g in GOLDEN_HASH])
    for k, (_, seed, bits) in enumerate(GOLDEN_HASH):
        got = ref_hash_uniform_torch(golden[k : k + 1], seed)
        assert got.item() * 16777216.0 == bits


# ------------------------------------------------------------------------------ nvcc


def _nvcc_or_skip() -> str:
    nvcc = find_nvcc()
    if nvcc is None:
        msg = "nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{msg}; CI=true requires the CUDA compile check")
        pytest.skip(msg)
    return nvcc


def _exported_symbols(lib: Path) -> set[str] | None:
    nm = shutil.which("nm")
    if nm is None:
        return None
    proc = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    return {line.split()[-1] for line in proc.stdout.splitlines() if line.strip()}


def test_nvcc_command_flags():
    cmd = nvcc_command(["a.cu", "b.cu"], "out.so", nvcc="nvcc")
    assert cmd[0] == "nvcc" and cmd[-2:] == ["a.cu", "b.cu"]
    for flag in ("-O3", "-shared", "-fmad=false", "-std=c++17", "-fPIC"):
        assert flag in cmd
    assert cmd[cmd.index("-o") + 1] == "out.so"
    gencodes = [cmd[k + 1] for k, c in enumerate(cmd) if c == "-gencode"]
    assert gencodes == [f"arch=compute_{a},code=sm_{a}" for a in ARCHS] + [
        "arch=compute_90,code=compute_90"
    ]
    with pytest.raises(ValueError, match="arch"):
        nvcc_command(["a.cu"], "o.so", archs=("sm_80",), nvcc="nvcc")


@pytest.mark.slow
def test_every_cu_compiles_with_nvcc(tmp_path):
    nvcc = _nvcc_or_skip()
    sources = sorted(source_dir().glob("*.cu"))
    assert sources, f"no .cu files in {source_dir()}"
    lib = tmp_path / LIB_NAME
    cmd = nvcc_command(sources, lib, ARCHS, nvcc=nvcc)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-4000:]}"
    assert lib.is_file()

    symbols = _exported_symbols(lib)
    if symbols is not None:
        expected = {*ENTRY_POINTS, "qsync_cuda_abi_version", "qsync_cuda_error_string"}
        assert expected <= symbols, expected - symbols
        assert not any(s.startswith("cuda") for s in symbols), "CUDA runtime re-exported"
    try:
        handle = ctypes.CDLL(str(lib))
    except OSError as exc:  # only a missing driver may excuse this
        if "libcuda" in str(exc):
            pytest.skip(f"library built; loading needs a CUDA driver: {exc}")
        raise
    assert handle.qsync_cuda_abi_version() == 3
    for name in ENTRY_POINTS:
        assert callable(getattr(handle, name, None)), name
    handle.qsync_cuda_error_string.restype = ctypes.c_char_p
    # CUDA's own messages (the runtime is linked in), even without a driver
    assert handle.qsync_cuda_error_string(0) == b"no error"
    assert handle.qsync_cuda_error_string(1) == b"invalid argument"
    # Argument checks run before any CUDA call: bad arguments fail without a device.
    handle.qsync_hash_uniform.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64,
                                          ctypes.c_void_p]
    assert handle.qsync_hash_uniform(None, 0, 0, None) == 0  # empty: nothing to launch
    assert handle.qsync_hash_uniform(None, -1, 0, None) == 1  # cudaErrorInvalidValue
    # the int4 path: argument checks before any launch
    handle.qsync_pack_int4.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                       ctypes.c_int64, ctypes.c_void_p]
    assert handle.qsync_pack_int4(None, None, 0, 5, None) == 0
    assert handle.qsync_pack_int4(None, None, -1, 5, None) == 1
    assert handle.qsync_pack_int4(None, None, 2, 5, None) == 1  # null pointers
    handle.qsync_int4_gemm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                       ctypes.c_void_p]
    assert handle.qsync_int4_gemm(None, None, None, 0, 4, 8, None) == 0
    assert handle.qsync_int4_gemm(None, None, None, 2, 4, 2**31, None) == 1  # K too long
    assert handle.qsync_int4_gemm(None, None, None, 2, 4, 8, None) == 1
    handle.qsync_quantize_int4.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                           ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p]
    assert handle.qsync_quantize_int4(None, 0, None, None, 0, 1, 0, 0, None) == 0
    assert handle.qsync_quantize_int4(None, 0, None, None, 4, 0, 0, 0, None) == 1


@pytest.mark.slow
def test_build_cache_and_cli(tmp_path, monkeypatch):
    _nvcc_or_skip()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    archs = ("80",)
    first = build(archs=archs)
    assert first.name == LIB_NAME and first.is_file()
    assert first.parent.parent == tmp_path / "cache" / "qsync-opt" / "cuda"
    assert (first.parent / KEY_NAME).is_file()
    assert not list(first.parent.glob("*.tmp"))
    mtime = first.stat().st_mtime_ns
    second = build(archs=archs)
    assert second == first and second.stat().st_mtime_ns == mtime

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "qsync_opt.cuda.build", "--arch", "80"],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path,
    )  # cwd: not the source tree, whose qsync_opt/ would shadow an installed wheel's
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(first)
    assert first.stat().st_mtime_ns == mtime  # the CLI reused the cached library

    # An explicit folder, then other archs: a different build.
    out = build(out_dir=tmp_path / "out", archs=("75", "90"))
    assert out == tmp_path / "out" / LIB_NAME and out.is_file()
    assert build(out_dir=tmp_path / "out", archs=("75", "90")).stat().st_mtime_ns == (
        out.stat().st_mtime_ns
    )


def test_build_without_nvcc_raises(monkeypatch, tmp_path):
    monkeypatch.setattr("qsync_opt.cuda.build.find_nvcc", lambda: None)
    with pytest.raises(CudaBuildError, match="nvcc not found"):
        build(out_dir=tmp_path)


def test_importing_the_package_loads_no_kernels(tmp_path):
    code = (
        "import sys, qsync_opt.cuda as c; c.source_dir(); "
        "assert 'qsync_opt.cuda.kernels' not in sys.modules; "
        "assert 'qsync_opt.cuda.build' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, cwd=tmp_path)


# ------------------------------------------------------------------ C++ CPU kernels


def test_the_cpp_cpu_kernels_built_and_loaded() -> None:
    """Under CI=true the C++ CPU kernels must build and load (tests/conftest.py sets
    QSYNC_REQUIRE_CPP there, so a failed build also fails every test that reaches an op,
    instead of the Python references serving silently). Elsewhere, a machine without a
    compiler skips this one test."""
    from qsync_opt import ops
    from qsync_opt.ops._build import CppBuildError, load_cpu

    ci = os.environ.get("CI") == "true"
    if ci:
        assert os.environ.get("QSYNC_REQUIRE_CPP") == "1"
        assert os.environ.get("QSYNC_DISABLE_CPP", "") in ("", "0")
    try:
        ok, reason = load_cpu()
    except CppBuildError as exc:
        pytest.fail(str(exc))
    if not ok:
        if ci:
            pytest.fail(f"CI=true requires the C++ CPU kernels: {reason}")
        pytest.skip(f"C++ kernels not built: {reason}")
    assert reason.startswith("compiled with -O3")
    assert int(torch.ops.qsync_cpu.abi_version()) == 1
    assert ops.available()["cpu"] == f"C++ kernels ({reason})"


def test_a_failed_cpp_build_fails_where_it_is_required(monkeypatch) -> None:
    from qsync_opt import ops
    from qsync_opt.ops import _build, reference

    failed = (False, "CalledProcessError: g++ exited with 1")
    monkeypatch.setattr(_build, "_load_cpu", lambda: failed)
    monkeypatch.delenv("QSYNC_DISABLE_CPP", raising=False)
    x = torch.linspace(-2.0, 3.0, 24).reshape(4, 6)
    want = reference.quantize_int8(x, 127.0 / x.abs().amax().reshape(1), False, 0)
    # Not required: the Python references serve, and say why.
    monkeypatch.setenv("QSYNC_REQUIRE_CPP", "0")
    assert _build.load_cpu() == failed
    assert torch.equal(ops.quantize_int8(x, stochastic=False)[0], want)
    assert ops.available()["cpu"] == f"Python references ({failed[1]})"
    # Required (CI): the build failure is an error wherever the kernels are reached.
    monkeypatch.setenv("QSYNC_REQUIRE_CPP", "1")
    with pytest.raises(_build.CppBuildError, match="QSYNC_REQUIRE_CPP.*g\\+\\+ exited with 1"):
        _build.load_cpu()
    with pytest.raises(_build.CppBuildError):
        ops.quantize_int8(x, stochastic=False)
    with pytest.raises(_build.CppBuildError):
        ops.available()
    # Disabled on purpose (the fallback's own tests): no error.
    monkeypatch.setenv("QSYNC_DISABLE_CPP", "1")
    assert _build.load_cpu() == failed


# ------------------------------------------------------------- loader, argument checks


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_load_without_cuda_returns_none_and_logs_once(caplog):
    _load_cached.cache_clear()
    try:
        with caplog.at_level("INFO", logger="qsync_opt.cuda.kernels"):
            assert load() is None
            assert load() is None
        reason = load_error()
        assert reason and "CUDA" in reason
        logged = [r for r in caplog.records if r.name == "qsync_opt.cuda.kernels"]
        assert len(logged) == 1 and reason in logged[0].getMessage()
    finally:
        _load_cached.cache_clear()


def _fake_kernels() -> CudaKernels:
    fake = types.SimpleNamespace(**{name: types.SimpleNamespace() for name in _SIGNATURES})
    return CudaKernels(fake, "fake.so")  # type: ignore[arg-type]


def test_wrappers_reject_cpu_tensors_before_calling_the_library():
    k = _fake_kernels()
    assert k._lib.qsync_quantize_int8.restype is ctypes.c_int
    with pytest.raises(ValueError, match="^x must be a CUDA tensor"):
        k.quantize_int8(torch.zeros(4), torch.ones(1), 4, False, 0)
    with pytest.raises(ValueError, match="^q must be a CUDA tensor"):
        k.dequantize_int8(torch.zeros(4, dtype=torch.int8), torch.ones(1), 4)
    with pytest.raises(ValueError, match="^acc must be a CUDA tensor"):
        k.rescale_int32(torch.zeros(2, 2, dtype=torch.int32), 1.0, torch.ones(2), None)
    with pytest.raises(ValueError, match="^acc must be a CUDA tensor"):
        k.rescale_int32_rows(torch.zeros(2, 2, dtype=torch.int32), torch.ones(2), torch.ones(2),
                             None)
    with pytest.raises(ValueError, match="^x must be a torch.Tensor"):
        k.quantize_int8([1.0], torch.ones(1), 1, False, 0)
    with pytest.raises(ValueError, match="^n must be"):
        k.hash_uniform(-1, 0)
    with pytest.raises(ValueError, match="^device must be a CUDA device"):
        k.hash_uniform(4, 0, "cpu")


# ----------------------------------------------------------------------------- GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def kernels() -> CudaKernels:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    k = load()
    if k is None:
        reason = load_error()
        if (find_nvcc() is not None or os.environ.get("QSYNC_CUDA_LIB")
                or os.environ.get("CI") == "true"):
            pytest.fail(f"the CUDA kernels did not load: {reason}")
        pytest.skip(f"the CUDA kernels are unavailable: {reason}")
    return k


def _amax_inv(x: torch.Tensor, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.float().reshape(channels, -1).abs().amax(dim=1)
    amax = torch.where(amax == 0, torch.ones_like(amax), amax)
    return amax, (127.0 / amax).to(torch.float32)


def _sample(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[0]).reshape(-1, 1)
    x[1] = 0.0  # an all-zero channel (amax 0 -> 1)
    return x.to(dtype)


@gpu
@pytest.mark.parametrize("seed", [0, 12345])
def test_hash_uniform_matches_reference(kernels, seed):
    got = kernels.hash_uniform(10_000, seed, "cuda")
    want = torch.tensor([ref_hash_uniform(i, seed) for i in range(10_000)], dtype=torch.float32)
    assert_bits_equal(got, want)
    assert float(got.min()) >= 0.0 and float(got.max()) < 1.0


@gpu
@pytest.mark.slow
def test_hash_uniform_above_2_pow_32(kernels):
    n = 2**32 + 4096
    free, _ = torch.cuda.mem_get_info()
    if free < 4 * n + (2 << 30):
        pytest.skip("needs about 18 GiB of free GPU memory")
    got = kernels.hash_uniform(n, 777, "cuda")
    tail = got[2**32 - 4096 :].cpu()
    del got
    torch.cuda.empty_cache()
    want = ref_hash_uniform_torch(torch.arange(2**32 - 4096, n), 777)
    assert_bits_equal(tail, want)


@gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("per_channel", [False, True], ids=["tensor", "channel"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["rtn", "sr"])
def test_quantize_bit_exact(kernels, dtype, per_channel, stochastic):
    x = _sample((48, 333), dtype, seed=3)
    channels = 48 if per_channel else 1
    _, inv = _amax_inv(x, channels)
    inner = x.numel() // channels
    seed = 12345
    got = kernels.quantize_int8(x.cuda(), inv.cuda(), inner, stochastic, seed)
    assert got.dtype == torch.int8 and got.shape == x.shape
    assert_bits_equal(got.reshape(-1), ref_quantize(x, inv, inner, stochastic, seed))


@gpu
@pytest.mark.parametrize("stochastic", [False, True], ids=["rtn", "sr"])
def test_quantize_ties_and_clamp(kernels, stochastic):
    # inv_scale 1: y = x exactly, so halves test round-half-to-even; inv_scale 4: clamping.
    x = torch.arange(-300, 301, dtype=torch.float32) * 0.5
    x = torch.stack([x, x])
    inv = torch.tensor([1.0, 4.0])
    got = kernels.quantize_int8(x.cuda(), inv.cuda(), x.shape[1], stochastic, 9)
    want = ref_quantize(x, inv, x.shape[1], stochastic, 9)
    assert_bits_equal(got.reshape(-1), want)
    if not stochastic:
        assert got[0, 300 + 1].item() == 0 and got[0, 300 + 3].item() == 2  # 0.5->0, 1.5->2
    assert got.max().item() == 127 and got.min().item() == -127


@gpu
def test_quantize_grid_stride_and_streams(kernels):
    # More elements than one pass of the grid (65535 blocks x 256), odd inner.
    channels, inner = 4100, 4099
    x = _sample((channels, inner), torch.float16, seed=5)
    _, inv = _amax_inv(x, channels)
    stream = torch.cuda.Stream()
    xc, invc = x.cuda(), inv.cuda()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = kernels.quantize_int8(xc, invc, inner, True, 2**33 + 5)
    stream.synchronize()
    assert_bits_equal(got.reshape(-1), ref_quantize(x, inv, inner, True, 2**33 + 5))


@gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("per_channel", [False, True], ids=["tensor", "channel"])
def test_dequantize_bit_exact(kernels, dtype, per_channel):
    g = torch.Generator().manual_seed(11)
    q = torch.randint(-128, 128, (64, 257), dtype=torch.int8, generator=g)
    channels = 64 if per_channel else 1
    scale = (torch.rand(channels, generator=g) * 10.0 + 1e-4).float() / 127.0
    inner = q.numel() // channels
    got = kernels.dequantize_int8(q.cuda(), scale.cuda(), inner, dtype)
    assert got.dtype == dtype and got.shape == q.shape
    assert_bits_equal(got.reshape(-1), ref_dequantize(q, scale, inner, dtype))


@gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_rescale_bit_exact(kernels, dtype, with_bias):
    g = torch.Generator().manual_seed(17)
    m, n = 129, 515
    acc = torch.randint(-(2**31), 2**31 - 1, (m, n), dtype=torch.int32, generator=g)
    acc[0] = torch.randint(-(2**20), 2**20, (n,), dtype=torch.int32, generator=g)
    sw = torch.rand(n, generator=g) * 1e-4
    bias = torch.randn(n, generator=g) if with_bias else None
    sx = 0.0123  # not a float32: both sides round it to float32
    got = kernels.rescale_int32(
        acc.cuda(), sx, sw.cuda(), None if bias is None else bias.cuda(), dtype
    )
    assert got.dtype == dtype and got.shape == (m, n)
    assert_bits_equal(got, ref_rescale(acc, sx, sw, bias, dtype))


@gpu
def test_stochastic_rounding_is_unbiased(kernels):
    g = torch.Generator().manual_seed(23)
    x = torch.randn(1 << 20, generator=g)
    _, inv = _amax_inv(x, 1)
    q = kernels.quantize_int8(x.cuda(), inv.cuda(), x.numel(), True, 4242).cpu().float()
    y = x * inv
    err = q - y
    assert err.abs().max().item() < 1.0
    assert abs(err.mean().item()) < 3e-3  # std of the mean is below 5e-4
    rtn = kernels.quantize_int8(x.cuda(), inv.cuda(), x.numel(), False, 0).cpu().float()
    assert (q != rtn).float().mean().item() > 0.2  # it really is stochastic
    # A constant 0.3 quantization step rounds up about 30% of the time.
    c = torch.full((1 << 20,), 0.3)
    qc = kernels.quantize_int8(c.cuda(), torch.ones(1).cuda(), c.numel(), True, 1).cpu()
    assert abs(qc.float().mean().item() - 0.3) < 3e-3


@gpu
def test_gpu_argument_checks(kernels):
    x = torch.randn(8, 6, device="cuda")
    inv = torch.ones(8, device="cuda")
    with pytest.raises(ValueError, match="^x must be contiguous"):
        kernels.quantize_int8(x.t(), inv, 8, False, 0)
    with pytest.raises(ValueError, match="^inv_scale must have dtype"):
        kernels.quantize_int8(x, inv.double(), 6, False, 0)
    with pytest.raises(ValueError, match="^inv_scale has 8 elements"):
        kernels.quantize_int8(x, inv, 4, False, 0)
    with pytest.raises(ValueError, match="^x must have dtype"):
        kernels.quantize_int8(x.double(), inv, 6, False, 0)
    q = torch.zeros(8, 6, dtype=torch.int8, device="cuda")
    with pytest.raises(ValueError, match="^out_dtype"):
        kernels.dequantize_int8(q, inv, 6, torch.float64)
    with pytest.raises(ValueError, match="^scale must be a CUDA tensor"):
        kernels.dequantize_int8(q, inv.cpu(), 6)
    acc = torch.zeros(8, 6, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="^sw has"):
        kernels.rescale_int32(acc, 1.0, inv, None)
    with pytest.raises(ValueError, match="^bias must have dtype"):
        kernels.rescale_int32(acc, 1.0, inv[:6], inv[:6].half())
    assert kernels.quantize_int8(x[:0], inv[:0], 6, False, 0).numel() == 0


# ----------------------------------------------------------------------------- GPU: int4


@gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("per_channel", [False, True], ids=["tensor", "channel"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["rtn", "sr"])
def test_quantize_int4_bit_exact(kernels, dtype, per_channel, stochastic):
    from qsync_opt.ops import reference as ref

    x = _sample((48, 333), dtype, seed=4)
    channels = 48 if per_channel else 1
    amax, _ = _amax_inv(x, channels)
    inv = (7.0 / amax).to(torch.float32)
    inner = x.numel() // channels
    got = kernels.quantize_int4(x.cuda(), inv.cuda(), inner, stochastic, 77)
    want = ref.quantize_int4(x.contiguous(), inv, stochastic, 77)
    assert_bits_equal(got.reshape(-1).cpu(), want.reshape(-1))
    assert got.abs().max().item() <= 7


@gpu
@pytest.mark.parametrize("k", [1, 64, 77])
def test_int4_pack_and_gemm_equal_the_integer_reference(kernels, k):
    g = torch.Generator().manual_seed(k)
    a = torch.randint(-7, 8, (19, k), generator=g, dtype=torch.int8)
    b = torch.randint(-7, 8, (23, k), generator=g, dtype=torch.int8)
    pa, pb = kernels.pack_int4(a.cuda()), kernels.pack_int4(b.cuda())
    assert pa.shape == (19, (k + 1) // 2) and pa.dtype == torch.uint8
    lo = (pa.cpu().to(torch.int16) & 0xF)
    assert torch.equal(torch.where(lo > 7, lo - 16, lo).to(torch.int8), a[:, 0::2])
    got = kernels.int4_gemm(pa, pb, k).cpu().to(torch.int64)
    assert torch.equal(got, a.to(torch.int64) @ b.to(torch.int64).t())
    # the runtime's path: the same values in int8 storage through torch._int_mm
    from qsync_opt.ops import int_mm

    assert torch.equal(int_mm(a.cuda(), b.cuda().t()).cpu().to(torch.int64), got)


@gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_rescale_rows_bit_exact(kernels, dtype, with_bias):
    """One scale per row (int8_full's per-token output gradient): the CUDA kernel, the C++
    kernel and the Python reference agree bit for bit."""
    from qsync_opt.ops import reference as ref

    g = torch.Generator().manual_seed(19)
    m, n = 131, 517
    acc = torch.randint(-(2**24), 2**24, (m, n), dtype=torch.int32, generator=g)
    sx = torch.rand(m, generator=g) * 1e-3
    sw = torch.rand(n, generator=g) * 1e-2
    bias = torch.randn(n, generator=g) if with_bias else None
    want = ref.rescale_int32_rows(acc, sx, sw, bias, dtype)
    got = kernels.rescale_int32_rows(acc.cuda(), sx.cuda(), sw.cuda(),
                                     None if bias is None else bias.cuda(), dtype)
    assert_bits_equal(got, want)
    assert_bits_equal(torch.ops.qsync_cpu.rescale_int32_rows(acc, sx, sw, bias, dtype), want)


@gpu
def test_int8_full_backward_on_cuda_equals_cpu(kernels):
    from qsync_opt import ops

    g = torch.Generator().manual_seed(6)
    x = torch.randn(40, 64, generator=g)
    w = torch.randn(24, 64, generator=g)
    go = torch.randn(40, 24, generator=g) * torch.logspace(-3, 1, 40).reshape(-1, 1)
    grads = []
    for dev in ("cpu", "cuda"):
        xi = x.to(dev).requires_grad_()
        wi = w.to(dev).requires_grad_()
        ops.int8_linear(xi, wi, int8_backward=True, seed=4).backward(go.to(dev))
        grads.append((xi.grad.cpu(), wi.grad.cpu()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@gpu
def test_int4_linear_on_cuda_equals_cpu(kernels):
    from qsync_opt import ops

    g = torch.Generator().manual_seed(5)
    x = torch.randn(32, 64, generator=g)
    w = torch.randn(16, 64, generator=g)
    cpu = ops.int4_linear(x, w, None, seed=3, bwd_dtype=torch.float16)
    gpu_out = ops.int4_linear(x.cuda(), w.cuda(), None, seed=3, bwd_dtype=torch.float16)
    assert torch.equal(gpu_out.cpu(), cpu)
