"""Python references of the low-precision kernels: the CPU fallback and the test oracle.

Every compiled kernel (C++ on the CPU, CUDA behind the C ABI of cuda/) computes exactly
these formulas, in this order, so results agree bit for bit:

* **Counter-based RNG** for stochastic rounding. Element ``i`` of a contiguous tensor and a
  seed ``s`` give ``u(i, s)`` in [0, 1) with 24 random bits::

      h  = lo32(i) * 0x9E3779B9
      h ^= hi32(i) * 0x85EBCA6B
      h += lo32(s) * 0xC2B2AE35 + 0x27D4EB2F
      h  = fmix32(h)                      # murmur3's finaliser
      u  = (h >> 8) / 2**24

  A counter-based generator needs no state, so a kernel can be run in any order, on any
  device, and still draw the same number for the same element.
* **Symmetric int8 quantization**, per tensor or per channel (axis 0 of a contiguous
  ``[C, inner]`` view)::

      amax  = max |x| over the channel (0 replaced by 1)
      scale = amax / 127,  inv = 127 / amax          (float32)
      y = float(x) * inv
      q = clamp(floor(y + u) if stochastic else round_half_even(y), -127, 127)

  Stochastic rounding is unbiased (E[q] = y away from the clamp) and its error has variance
  frac*(1-frac) per element, 1/6 of a step squared on average over uniform fractions;
  round-to-nearest has step^2/12. The indicator assumes whichever the op uses.
* **Symmetric int4 quantization**: the same with ``qmax = 7`` in place of 127 (scale
  ``amax / 7``, ``q`` clamped to [-7, 7], 15 levels), the values kept in int8 storage; per
  channel for weights, per tensor or per group of ``G`` consecutive rows for activations
  (``amax`` of a row is the max over its group). On this CPU the int4 GEMM is the int8 GEMM
  on those values: exact, not faster. Per-row scales rescale as
  ``v = float(acc[m, n]) * (sx[m] * sw[n]) + bias[n]``.
* **Dequantize**: ``float(q) * scale[c]``.
* **Fused rescale + bias + cast** of an int32 GEMM result ``acc[M, N]``::

      v = float(acc[m, n]) * (sx * sw[n]);  v = v + bias[n];  cast to the output dtype
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for int64 ``a`` in [0, 2**32), without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (a * lo + ((a * hi) & 0xFFFF) * 65536) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def hash_uniform(n: int, seed: int, device: torch.device | str = "cpu",
                 offset: int = 0) -> torch.Tensor:
    """u(i, seed) for i in [offset, offset + n), float32."""
    i = torch.arange(offset, offset + n, dtype=torch.int64, device=device)
    lo = i & _M32
    hi = (i >> 32) & _M32
    h = _mul32(lo, 0x9E3779B9)
    h = h ^ _mul32(hi, 0x85EBCA6B)
    s = int(seed) & _M32
    h = (h + ((s * 0xC2B2AE35 + 0x27D4EB2F) & _M32)) & _M32
    h = _fmix32(h)
    return (h >> 8).to(torch.float32) * (1.0 / 16777216.0)


def channel_amax(x: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """abs-max per channel (axis 0) or per tensor, float32, zeros replaced by one."""
    xf = x.detach().to(torch.float32)
    if per_channel:
        amax = xf.reshape(xf.shape[0], -1).abs().amax(dim=1) if xf.numel() else xf.new_zeros(
            xf.shape[0])
    else:
        amax = xf.abs().amax().reshape(1) if xf.numel() else xf.new_zeros(1)
    return torch.where(amax > 0, amax, torch.ones_like(amax))


INT8_QMAX = 127
INT4_QMAX = 7


def scale_of(amax: torch.Tensor, qmax: int) -> torch.Tensor:
    """``amax / qmax``: the correctly rounded float32 division on every device.

    A CUDA tensor divided by a Python number is multiplied by the number's reciprocal
    instead (torch's CUDA division kernel does so for a CPU-scalar divisor), which can be one
    bit off the division: the scales, and every output rescaled by them, then differed
    between the CPU and a GPU (seen on an H200). A divisor tensor on the tensor's own device
    takes the true division on both. (``inv = qmax / amax`` is ``reciprocal(amax) * qmax``
    in torch on every device, so it needs no such care.)"""
    return amax / torch.full_like(amax, float(qmax))


def quantize_int8(x: torch.Tensor, inv_scale: torch.Tensor, stochastic: bool,
                  seed: int) -> torch.Tensor:
    """Quantize contiguous ``x`` (viewed [C, inner], C = len(inv_scale)) to int8."""
    return quantize_levels(x, inv_scale, stochastic, seed, INT8_QMAX)


def quantize_int4(x: torch.Tensor, inv_scale: torch.Tensor, stochastic: bool,
                  seed: int) -> torch.Tensor:
    """Quantize contiguous ``x`` (viewed [C, inner]) to int4 values [-7, 7] in int8 storage."""
    return quantize_levels(x, inv_scale, stochastic, seed, INT4_QMAX)


def group_amax(x: torch.Tensor, group_rows: int) -> torch.Tensor:
    """abs-max of 2-D ``x`` per group of ``group_rows`` consecutive rows, one value per row
    (the last group may be shorter), float32, zeros replaced by one."""
    rows = channel_amax(x, per_channel=True)
    m = rows.numel()
    pad = -m % group_rows
    padded = torch.cat([rows, rows.new_zeros(pad)]) if pad else rows
    per_group = padded.reshape(-1, group_rows).amax(dim=1)
    return per_group.repeat_interleave(group_rows)[:m].contiguous()


def quantize_levels(x: torch.Tensor, inv_scale: torch.Tensor, stochastic: bool,
                    seed: int, qmax: int) -> torch.Tensor:
    """Quantize contiguous ``x`` (viewed [C, inner]) to integers in [-qmax, qmax] (int8)."""
    c = inv_scale.numel()
    y = x.reshape(c, -1).to(torch.float32) * inv_scale.reshape(c, 1)
    if stochastic:
        u = hash_uniform(x.numel(), seed, x.device).reshape(c, -1)
        r = torch.floor(y + u)
    else:
        r = torch.round(y)  # round half to even
    return torch.clamp(r, -float(qmax), float(qmax)).to(torch.int8).reshape(x.shape)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    c = scale.numel()
    return (q.reshape(c, -1).to(torch.float32) * scale.reshape(c, 1)).to(dtype).reshape(q.shape)


def rescale_int32(acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor,
                  bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``acc`` [M, N] int32 -> ``acc * (sx * sw) + bias`` in ``dtype``."""
    s = sx.to(torch.float32).reshape(()) * sw.to(torch.float32)
    v = acc.to(torch.float32) * s
    if bias is not None:
        v = v + bias.to(torch.float32)
    return v.to(dtype)


def rescale_int32_rows(acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor,
                       bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``acc`` [M, N] int32 with per-row ``sx`` [M] -> ``acc * (sx[m] * sw[n]) + bias``."""
    s = sx.to(torch.float32).reshape(-1, 1) * sw.to(torch.float32).reshape(1, -1)
    v = acc.to(torch.float32) * s
    if bias is not None:
        v = v + bias.to(torch.float32)
    return v.to(dtype)


def int_mm_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 [M,K] x int8 [K,N] -> exact int64 product (the oracle for integer GEMMs)."""
    return a.to(torch.int64) @ b.to(torch.int64)
