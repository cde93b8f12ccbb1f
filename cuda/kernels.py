"""ctypes bindings of the qsync CUDA kernels (the C ABI of ``qsync_kernels.h``).

:func:`load` returns a :class:`CudaKernels` or None when the kernels cannot run here (torch
without CUDA, no library and no nvcc to build one, an ABI mismatch, or a device the library
has no code for); :func:`load_error` says why. ``QSYNC_CUDA_LIB`` may name a prebuilt
library; otherwise the library is built (and cached) with :func:`qsync_opt.cuda.build.build`.

Every wrapper takes contiguous CUDA tensors, launches on the tensor device's current torch
stream and returns a new tensor; the numerics are those of ``qsync_kernels.h``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path
from types import MappingProxyType

import torch
from qsync_opt.cuda.build import CudaBuildError, build

log = logging.getLogger(__name__)

ABI_VERSION = 3
ENV_LIB = "QSYNC_CUDA_LIB"
DTYPE_CODES = MappingProxyType({torch.float32: 0, torch.float16: 1, torch.bfloat16: 2})
FLOAT_DTYPES = tuple(DTYPE_CODES)

_c_void_p = ctypes.c_void_p
_c_int = ctypes.c_int
_c_i64 = ctypes.c_int64
_c_u64 = ctypes.c_uint64
_c_float = ctypes.c_float

# name -> (argtypes, restype)
_SIGNATURES = MappingProxyType({
    "qsync_cuda_abi_version": ([], _c_int),
    "qsync_cuda_error_string": ([_c_int], ctypes.c_char_p),
    "qsync_quantize_int8": (
        [_c_void_p, _c_int, _c_void_p, _c_void_p, _c_i64, _c_i64, _c_int, _c_u64, _c_void_p],
        _c_int,
    ),
    "qsync_quantize_int4": (
        [_c_void_p, _c_int, _c_void_p, _c_void_p, _c_i64, _c_i64, _c_int, _c_u64, _c_void_p],
        _c_int,
    ),
    "qsync_pack_int4": ([_c_void_p, _c_void_p, _c_i64, _c_i64, _c_void_p], _c_int),
    "qsync_int4_gemm": (
        [_c_void_p, _c_void_p, _c_void_p, _c_i64, _c_i64, _c_i64, _c_void_p], _c_int),
    "qsync_dequantize_int8": (
        [_c_void_p, _c_void_p, _c_void_p, _c_int, _c_i64, _c_i64, _c_void_p],
        _c_int,
    ),
    "qsync_rescale_int32": (
        [_c_void_p, _c_float, _c_void_p, _c_void_p, _c_void_p, _c_int, _c_i64, _c_i64, _c_void_p],
        _c_int,
    ),
    "qsync_rescale_int32_rows": (
        [_c_void_p, _c_void_p, _c_void_p, _c_void_p, _c_void_p, _c_int, _c_i64, _c_i64,
         _c_void_p],
        _c_int,
    ),
    "qsync_hash_uniform": ([_c_void_p, _c_i64, _c_u64, _c_void_p], _c_int),
})


def _check_tensor(
    name: str,
    t: object,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None = None,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must have dtype {names}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t


def _rescale_inputs(acc: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """An int32 GEMM result ``acc [m, n]``, its per-column scales ``sw [n]`` and the optional
    ``bias [n]``, checked (the rescale kernels' shared inputs)."""
    acc = _check_tensor("acc", acc, (torch.int32,))
    if acc.dim() != 2:
        raise ValueError(f"acc must be 2-D [m, n], got shape {tuple(acc.shape)}")
    n = acc.shape[1]
    sw = _check_tensor("sw", sw, (torch.float32,), acc.device)
    if sw.numel() != n:
        raise ValueError(f"sw has {sw.numel()} elements, expected n = {n}")
    if bias is not None:
        bias = _check_tensor("bias", bias, (torch.float32,), acc.device)
        if bias.numel() != n:
            raise ValueError(f"bias has {bias.numel()} elements, expected n = {n}")
    return acc, sw, bias


def _out_code(out_dtype: torch.dtype) -> int:
    if out_dtype not in DTYPE_CODES:
        raise ValueError(f"out_dtype must be one of {list(FLOAT_DTYPES)}, got {out_dtype}")
    return DTYPE_CODES[out_dtype]


def _check_inner(inner: int, n: int, channels: int, name: str) -> int:
    inner = int(inner)
    if inner <= 0:
        raise ValueError(f"inner must be positive, got {inner}")
    if n % inner != 0:
        raise ValueError(f"inner={inner} does not divide the {n} elements")
    if n > 0 and channels != n // inner:
        raise ValueError(f"{name} has {channels} elements, expected n / inner = {n // inner}")
    return inner


class CudaKernels:
    """The loaded library. Build one with :func:`load`."""

    def __init__(self, lib: ctypes.CDLL, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lib = lib
        for fname, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(lib, fname)
            fn.argtypes = argtypes
            fn.restype = restype

    def __repr__(self) -> str:
        return f"CudaKernels({str(self.path)!r})"

    # -- helpers ---------------------------------------------------------------------------

    def abi_version(self) -> int:
        return int(self._lib.qsync_cuda_abi_version())

    def error_string(self, code: int) -> str:
        msg = self._lib.qsync_cuda_error_string(int(code))
        return msg.decode(errors="replace") if msg else f"CUDA error {code}"

    def _check(self, fname: str, code: int) -> None:
        if code != 0:
            raise RuntimeError(f"{fname} failed: {self.error_string(code)} (CUDA error {code})")

    @staticmethod
    def _stream(device: torch.device) -> int:
        return torch.cuda.current_stream(device).cuda_stream

    # -- kernels ---------------------------------------------------------------------------

    def _quantize(self, fn: str, x: torch.Tensor, inv_scale: torch.Tensor, inner: int,
                  stochastic: bool, seed: int) -> torch.Tensor:
        """One symmetric quantization kernel (``qsync_quantize_int8`` or ``_int4``) of ``x``
        viewed as [C, inner], into int8 storage; argument checks first."""
        x = _check_tensor("x", x, FLOAT_DTYPES)
        inv_scale = _check_tensor("inv_scale", inv_scale, (torch.float32,), x.device)
        n = x.numel()
        inner = _check_inner(inner, n, inv_scale.numel(), "inv_scale")
        q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
        if n == 0:
            return q
        with torch.cuda.device(x.device):
            code = getattr(self._lib, fn)(
                x.data_ptr(), DTYPE_CODES[x.dtype], q.data_ptr(), inv_scale.data_ptr(), n,
                inner, 1 if stochastic else 0, int(seed) & 0xFFFFFFFFFFFFFFFF,
                self._stream(x.device))
        self._check(fn, code)
        return q

    def quantize_int8(
        self,
        x: torch.Tensor,
        inv_scale: torch.Tensor,
        inner: int,
        stochastic: bool,
        seed: int,
    ) -> torch.Tensor:
        """Symmetric int8 quantization of ``x`` viewed as [C, inner].

        ``inv_scale``: float32[C], 127 / amax per channel (amax 0 replaced by 1). Stochastic
        rounding draws the counter-based uniform of element i (low 32 bits of ``seed``).
        """
        return self._quantize("qsync_quantize_int8", x, inv_scale, inner, stochastic, seed)

    def quantize_int4(
        self,
        x: torch.Tensor,
        inv_scale: torch.Tensor,
        inner: int,
        stochastic: bool,
        seed: int,
    ) -> torch.Tensor:
        """Symmetric int4 quantization ([-7, 7], int8 storage) of ``x`` viewed as [C, inner];
        ``inv_scale`` = 7 / amax per channel. Rounding as :meth:`quantize_int8`."""
        return self._quantize("qsync_quantize_int4", x, inv_scale, inner, stochastic, seed)

    def pack_int4(self, q: torch.Tensor) -> torch.Tensor:
        """int4 values of a 2-D int8 [rows, k] tensor packed two per byte (low nibble first):
        uint8 [rows, (k + 1) / 2]."""
        q = _check_tensor("q", q, (torch.int8,))
        if q.dim() != 2:
            raise ValueError(f"q must be 2-D [rows, k], got shape {tuple(q.shape)}")
        rows, k = q.shape
        out = torch.empty((rows, (k + 1) // 2), dtype=torch.uint8, device=q.device)
        if rows * k == 0:
            return out
        with torch.cuda.device(q.device):
            code = self._lib.qsync_pack_int4(q.data_ptr(), out.data_ptr(), rows, k,
                                             self._stream(q.device))
        self._check("qsync_pack_int4", code)
        return out

    def int4_gemm(self, a: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
        """int32 [M, N] = A @ B^T for packed int4 ``a`` [M, ceil(k/2)] and ``b`` [N, ceil(k/2)]
        (:meth:`pack_int4`), exact int32 accumulation (a CUDA-core reference kernel)."""
        a = _check_tensor("a", a, (torch.uint8,))
        b = _check_tensor("b", b, (torch.uint8,), a.device)
        k = int(k)
        kp = (k + 1) // 2
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != kp or b.shape[1] != kp:
            raise ValueError(f"a and b must be 2-D with {kp} packed columns for k={k}, got "
                             f"{tuple(a.shape)} and {tuple(b.shape)}")
        m, n = a.shape[0], b.shape[0]
        out = torch.empty((m, n), dtype=torch.int32, device=a.device)
        if m * n == 0:
            return out
        with torch.cuda.device(a.device):
            code = self._lib.qsync_int4_gemm(a.data_ptr(), b.data_ptr(), out.data_ptr(), m, n,
                                             k, self._stream(a.device))
        self._check("qsync_int4_gemm", code)
        return out

    def dequantize_int8(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        inner: int,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """``q * scale[channel]`` ([C, inner] view), as ``out_dtype`` (round to nearest even)."""
        q = _check_tensor("q", q, (torch.int8,))
        scale = _check_tensor("scale", scale, (torch.float32,), q.device)
        code_dtype = _out_code(out_dtype)
        n = q.numel()
        inner = _check_inner(inner, n, scale.numel(), "scale")
        out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
        if n == 0:
            return out
        with torch.cuda.device(q.device):
            code = self._lib.qsync_dequantize_int8(
                q.data_ptr(),
                scale.data_ptr(),
                out.data_ptr(),
                code_dtype,
                n,
                inner,
                self._stream(q.device),
            )
        self._check("qsync_dequantize_int8", code)
        return out

    def rescale_int32(
        self,
        acc: torch.Tensor,
        sx: float,
        sw: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """``acc[m, n] * (sx * sw[n]) (+ bias[n])`` of an int32 GEMM result, as ``out_dtype``."""
        acc, sw, bias = _rescale_inputs(acc, sw, bias)
        m, n = acc.shape
        code_dtype = _out_code(out_dtype)
        out = torch.empty((m, n), dtype=out_dtype, device=acc.device)
        if m * n == 0:
            return out
        with torch.cuda.device(acc.device):
            code = self._lib.qsync_rescale_int32(
                acc.data_ptr(),
                float(sx),
                sw.data_ptr(),
                None if bias is None else bias.data_ptr(),
                out.data_ptr(),
                code_dtype,
                m,
                n,
                self._stream(acc.device),
            )
        self._check("qsync_rescale_int32", code)
        return out

    def rescale_int32_rows(
        self,
        acc: torch.Tensor,
        sx: torch.Tensor,
        sw: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """``acc[m, n] * (sx[m] * sw[n]) (+ bias[n])``: one scale per row, as ``out_dtype``."""
        acc, sw, bias = _rescale_inputs(acc, sw, bias)
        m, n = acc.shape
        sx = _check_tensor("sx", sx, (torch.float32,), acc.device)
        if sx.numel() != m:
            raise ValueError(f"sx has {sx.numel()} elements, expected m = {m}")
        code_dtype = _out_code(out_dtype)
        out = torch.empty((m, n), dtype=out_dtype, device=acc.device)
        if m * n == 0:
            return out
        with torch.cuda.device(acc.device):
            code = self._lib.qsync_rescale_int32_rows(
                acc.data_ptr(), sx.data_ptr(), sw.data_ptr(),
                None if bias is None else bias.data_ptr(), out.data_ptr(), code_dtype, m, n,
                self._stream(acc.device))
        self._check("qsync_rescale_int32_rows", code)
        return out

    def hash_uniform(
        self, n: int, seed: int, device: torch.device | str | int | None = None
    ) -> torch.Tensor:
        """float32[n]: the stochastic-rounding uniform of elements 0..n-1 for ``seed``."""
        n = int(n)
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        dev = torch.device("cuda") if device is None else torch.device(device)
        if isinstance(device, int):
            dev = torch.device("cuda", device)
        if dev.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {dev}")
        out = torch.empty(n, dtype=torch.float32, device=dev)
        if n == 0:
            return out
        with torch.cuda.device(out.device):
            code = self._lib.qsync_hash_uniform(
                out.data_ptr(), n, int(seed) & 0xFFFFFFFFFFFFFFFF, self._stream(out.device)
            )
        self._check("qsync_hash_uniform", code)
        return out


def _open(path: str | None) -> CudaKernels:
    """Open (building first when no path is given) and check the library; raises on failure."""
    if not torch.cuda.is_available():
        raise OSError(
            f"torch {torch.__version__} has no usable CUDA "
            f"(built with CUDA {torch.version.cuda or 'none'})"
        )
    if path is None:
        try:
            lib_path = build()
        except CudaBuildError as exc:
            raise OSError(f"the CUDA library is missing and cannot be built: {exc}") from exc
    else:
        lib_path = Path(path)
        if not lib_path.is_file():
            raise OSError(f"CUDA library {lib_path} does not exist")
    lib = ctypes.CDLL(str(lib_path))
    try:
        version_fn = lib.qsync_cuda_abi_version
    except AttributeError as exc:
        raise OSError(f"{lib_path} has no qsync_cuda_abi_version: not a qsync library") from exc
    version_fn.restype = ctypes.c_int
    version = int(version_fn())
    if version != ABI_VERSION:
        raise OSError(f"ABI mismatch: {lib_path} has version {version}, expected {ABI_VERSION}")
    missing = [name for name in _SIGNATURES if not hasattr(lib, name)]
    if missing:
        raise OSError(f"ABI mismatch: {lib_path} lacks {', '.join(missing)}")
    kernels = CudaKernels(lib, lib_path)
    # A probe launch on the current device: catches a driver older than the toolkit that built
    # the library, and devices the library has no code for (e.g. sm_70 with CUDA 13).
    device = torch.device("cuda", torch.cuda.current_device())
    try:
        kernels.hash_uniform(1, 0, device)
        torch.cuda.current_stream(device).synchronize()
    except RuntimeError as exc:
        name = torch.cuda.get_device_name(device)
        raise OSError(f"{lib_path} cannot run on {device} ({name}): {exc}") from exc
    return kernels


@functools.cache  # the lru_cache on load: one attempt per library path
def _load_cached(path: str | None) -> tuple[CudaKernels | None, str | None]:
    try:
        kernels = _open(path)
    except OSError as exc:
        reason = str(exc)
        log.info("qsync CUDA kernels unavailable: %s", reason)
        return None, reason
    log.info("qsync CUDA kernels loaded from %s", kernels.path)
    return kernels, None


def _resolve(path: str | os.PathLike[str] | None) -> str | None:
    if path is not None:
        return str(path)
    return os.environ.get(ENV_LIB) or None


def load(path: str | os.PathLike[str] | None = None) -> CudaKernels | None:
    """The kernels, or None when they cannot run here (the reason: :func:`load_error`).

    ``path`` (else ``$QSYNC_CUDA_LIB``, else a cached build) names the library. The result
    is cached per path, so the reason is logged once at INFO.
    """
    return _load_cached(_resolve(path))[0]


def load_error(path: str | os.PathLike[str] | None = None) -> str | None:
    """Why :func:`load` returned None for this path (None when it loaded)."""
    return _load_cached(_resolve(path))[1]


__all__ = ["ABI_VERSION", "CudaKernels", "DTYPE_CODES", "load", "load_error"]
