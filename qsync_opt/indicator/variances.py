"""The error model's per-element variances of a tensor represented in a precision's kinds
(:mod:`.errormodel` states the model and its derivation; this module computes it on
tensors, so it is the part that needs torch)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from qsync_opt.indicator.errormodel import FLOAT_KINDS, INT4_QMAX


def element_variance(t: Tensor, kind: str, *, per_channel: bool = False,
                     stochastic: bool = True, channel_dim: int = -1, groups: int = 1) -> Tensor:
    """Per-element error variance of representing ``t`` in ``kind`` (see module docstring).

    ``per_channel``: int8 scales per slice along axis 0 (weights); ``int8+col`` adds the
    re-quantization per input column that int8_full's backward applies to the weight: one
    scale per column of the weight viewed ``[out, -1]`` (a conv's ``(in, kh, kw)``), within
    each of ``groups`` groups of output channels, as the kernels' input-gradient GEMM takes
    it. ``int4n``: int4 rounded to nearest. An output gradient's ``int8row`` (one scale per
    position across the channels at ``channel_dim``: per token) and ``int8gcol`` (one per
    channel) are int8_full's two quantizations of it.
    """
    x = t.detach().to(torch.float32)
    if kind in ("int8row", "int8gcol"):
        cd = channel_dim % max(x.dim(), 1)
        if kind == "int8gcol" or x.dim() < 2:
            return int_variance(x, cd if x.dim() else None, stochastic, 127)
        moved = x.movedim(cd, -1)
        v = int_variance(moved.reshape(-1, moved.shape[-1]), 0, stochastic, 127)
        return v.reshape(moved.shape).movedim(-1, cd)
    if kind in ("int4", "int4n"):
        return int_variance(x, 0 if per_channel else None,
                             stochastic and kind == "int4", INT4_QMAX)
    if kind == "int8col":
        return column_variance(x, groups, stochastic)
    if kind in ("int8", "int8+col"):
        v = int8_variance(x, 0 if per_channel else None, stochastic)
        if kind == "int8+col":
            v = v + column_variance(x, groups, stochastic)
        return v
    mbits, emin, fmax = FLOAT_KINDS[kind]
    scale = 1.0
    if fmax is not None:
        amax = float(x.abs().max()) if x.numel() else 0.0
        scale = fmax / amax if amax > 0 else 1.0
    xs = x.abs() * scale
    exp = torch.floor(torch.log2(torch.where(xs > 0, xs, torch.ones_like(xs))))
    exp = torch.clamp(exp, min=float(emin))
    ulp = torch.exp2(exp - mbits)
    v = ulp * ulp / 12.0 / (scale * scale)
    return torch.where(xs > 0, v, torch.zeros_like(v))


def int8_variance(x: Tensor, axis: int | None, stochastic: bool) -> Tensor:
    return int_variance(x, axis, stochastic, 127)


def column_variance(w: Tensor, groups: int, stochastic: bool) -> Tensor:
    """int8 rounding variance of weight ``w`` [out, ...] with one scale per column of its
    ``[out, -1]`` view within each group of ``out / groups`` rows (int8_full's re-quantized
    weight); a 1-D ``w``: per element."""
    if w.dim() < 2:
        return int8_variance(w, 0, stochastic)
    g = groups if groups > 0 and w.shape[0] % groups == 0 else 1
    cols = w.reshape(g, w.shape[0] // g, -1).permute(0, 2, 1)  # [g, cols, out/g]
    v = int8_variance(cols.reshape(-1, cols.shape[2]), 0, stochastic)  # one per (g, col)
    return v.reshape(cols.shape).permute(0, 2, 1).reshape(w.shape)


def int_variance(x: Tensor, axis: int | None, stochastic: bool, qmax: int) -> Tensor:
    """Per-element rounding variance of symmetric ``qmax``-level quantization (scale
    ``amax / qmax`` per tensor or per slice along ``axis``)."""
    if axis is None:
        amax = x.abs().amax() if x.numel() else x.new_tensor(0.0)
        shape: Sequence[int] = ()
    else:
        dims = [d for d in range(x.dim()) if d != axis]
        amax = x.abs().amax(dim=dims, keepdim=True)
        shape = amax.shape
    amax = torch.where(amax > 0, amax, torch.ones_like(amax)).reshape(shape)
    s = amax / torch.full_like(amax, float(qmax))  # true division on a GPU too
    y = x / s
    if stochastic:
        r = y - torch.floor(y)
        return s * s * r * (1.0 - r)
    e = torch.round(y) - y
    return s * s * e * e
