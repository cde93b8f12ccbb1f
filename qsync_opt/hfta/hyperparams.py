"""The per-model hyper-parameters of a fused optimizer (:mod:`qsync_opt.hfta.optim`): each one
a float for every model or ``B`` values, checked and kept as a float64 CPU tensor ``[B]``;
AdamW's betas as ``[B, 2]``; the per-model step mask as a bool ``[B]``. Bad input (an array
of the wrong length, a value out of range) raises
:class:`~qsync_opt.core.errors.QsyncInputError` naming the field.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any, TypeGuard

import torch
from torch import Tensor

from qsync_opt.core.errors import QsyncInputError

__all__ = ["F64", "PerModel", "PerModelBetas", "Params", "check_fused_count", "is_number",
           "per_model", "per_model_betas", "shape_text", "step_mask"]

#: A per-model hyper-parameter: one float for every model, or ``B`` values.
PerModel = float | Sequence[float] | Tensor
#: What the optimizers take as ``params`` (as torch: tensors, named tensors or groups).
Params = Iterable[Tensor] | Iterable[tuple[str, Tensor]] | Iterable[dict[str, Any]] | Tensor
#: AdamW's betas: one pair, ``B`` pairs (or a ``[B, 2]`` tensor), or two per-model arrays.
PerModelBetas = tuple[float, float] | Sequence[Sequence[float]] | Sequence[PerModel] | Tensor

#: The dtype of the per-model arrays.
F64 = torch.float64


def check_fused_count(B: object, owner: str) -> int:
    """``B`` as the number of fused models (an integer >= 1, else refused naming ``owner``)."""
    if isinstance(B, bool) or not isinstance(B, numbers.Integral) or int(B) < 1:
        raise QsyncInputError(f"{owner}: B (the number of fused models) must be an integer "
                              f">= 1, got {B!r}")
    return int(B)


def is_number(x: object) -> TypeGuard[numbers.Real]:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def shape_text(t: Tensor) -> str:
    return "[" + ", ".join(str(int(s)) for s in t.shape) + "]"


def per_model(value: object, B: int, field: str, *, lo: float = 0.0,
               hi: float = math.inf, hi_open: bool = False) -> Tensor:
    """``value`` (a float, ``B`` floats or a 1-D tensor of ``B``) -> float64 CPU ``[B]``,
    every entry finite and in ``[lo, hi]`` (``[lo, hi)`` with ``hi_open``)."""
    if isinstance(value, Tensor):
        if value.is_complex() or value.dtype == torch.bool:
            raise QsyncInputError(f"{field}: expected real numbers, got a {value.dtype} tensor")
        if value.dim() == 0:
            out = value.detach().to("cpu", F64).reshape(1).expand(B).clone()
        elif value.dim() == 1 and value.numel() == B:
            out = value.detach().to("cpu", F64).clone()
        else:
            raise QsyncInputError(f"{field}: expected a float or {B} values (one per model, "
                                  f"B={B}), got a tensor of shape {shape_text(value)}")
    elif is_number(value):
        out = torch.full((B,), float(value), dtype=F64)
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != B:
            raise QsyncInputError(f"{field}: expected a float or {B} values (one per model, "
                                  f"B={B}), got {len(value)} values")
        bad = [i for i, v in enumerate(value)
               if not (is_number(v) or (isinstance(v, Tensor) and v.numel() == 1))]
        if bad:
            raise QsyncInputError(f"{field}: model {bad[0]}'s value must be a number, got "
                                  f"{value[bad[0]]!r}")
        out = torch.tensor([float(v) for v in value], dtype=F64)
    else:
        raise QsyncInputError(f"{field}: expected a float or {B} values (one per model), got "
                              f"{type(value).__name__}")
    for i, v in enumerate(out.tolist()):
        if not math.isfinite(v):
            raise QsyncInputError(f"{field}: model {i}'s value must be finite, got {v!r}")
        if v < lo or v > hi or (hi_open and v >= hi):
            upper = ")" if hi_open else "]"
            rng = f">= {lo:g}" if math.isinf(hi) else f"in [{lo:g}, {hi:g}{upper}"
            raise QsyncInputError(f"{field}: model {i}'s value must be {rng}, got {v:g}")
    return out


def _is_pair(x: object) -> bool:
    return (isinstance(x, Sequence) and not isinstance(x, (str, bytes)) and len(x) == 2
            and all(is_number(v) for v in x))


def per_model_betas(value: object, B: int, field: str) -> Tensor:
    """Betas -> float64 CPU ``[B, 2]`` (row ``b`` is model ``b``'s ``(beta1, beta2)``).

    Accepted: one pair ``(b1, b2)``; ``B`` pairs ``[(b1, b2), ...]``; a tensor ``[2]`` or
    ``[B, 2]``; two per-model arrays ``(b1s, b2s)`` (each a float, ``B`` floats or a 1-D
    tensor). With ``B == 2`` a 2 x 2 nested list reads both as two pairs and as two arrays;
    where the readings differ it is refused (pass a ``[2, 2]`` tensor, rows are models, or
    the two arrays as tensors)."""
    def check(out: Tensor) -> Tensor:
        for j, name in enumerate(("beta1", "beta2")):
            per_model(out[:, j], B, f"{field}[{name}]", lo=0.0, hi=1.0, hi_open=True)
        return out

    if isinstance(value, Tensor):
        if value.dim() == 1 and value.numel() == 2:
            return check(value.detach().to("cpu", F64).reshape(1, 2).expand(B, 2).clone())
        if value.dim() == 2 and tuple(value.shape) == (B, 2):
            return check(value.detach().to("cpu", F64).clone())
        raise QsyncInputError(f"{field}: expected a pair, {B} pairs (a [B, 2] tensor, "
                              f"B={B}) or two arrays of {B}, got a tensor of shape "
                              f"{shape_text(value)}")
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise QsyncInputError(f"{field}: expected a pair (beta1, beta2), {B} pairs or two "
                              f"arrays of {B}, got {type(value).__name__}")
    pairs = None
    if len(value) == B and all(_is_pair(v) for v in value):
        pairs = torch.tensor([[float(a), float(b)] for a, b in value], dtype=F64)
    arrays = None
    if len(value) == 2:
        try:
            arrays = torch.stack([per_model(value[0], B, f"{field}[beta1]", lo=-math.inf),
                                  per_model(value[1], B, f"{field}[beta2]", lo=-math.inf)],
                                 dim=1)
        except QsyncInputError:
            if pairs is None:
                raise
    if pairs is not None and arrays is not None and not torch.equal(pairs, arrays):
        raise QsyncInputError(f"{field}: with B=2 the nested list {value!r} reads both as two "
                              f"(beta1, beta2) pairs and as two per-model arrays; pass a "
                              f"[2, 2] tensor (row b = model b's pair) or the two arrays as "
                              f"tensors")
    out = pairs if pairs is not None else arrays
    if out is None:
        raise QsyncInputError(f"{field}: expected a pair (beta1, beta2), {B} pairs or two "
                              f"arrays of {B}, got {len(value)} entries")
    return check(out)


def step_mask(mask: object, B: int, owner: str) -> Tensor | None:
    """The step mask -> bool CPU ``[B]``, or None when every model steps."""
    if mask is None:
        return None
    if isinstance(mask, Tensor):
        if mask.dtype != torch.bool:
            raise QsyncInputError(f"{owner}.step: mask must be a bool tensor of {B} (one per "
                                  f"model), got dtype {mask.dtype}")
        m = mask.detach().to("cpu")
    elif isinstance(mask, Sequence) and all(isinstance(v, bool) for v in mask):
        m = torch.tensor(list(mask), dtype=torch.bool)
    else:
        raise QsyncInputError(f"{owner}.step: mask must be a bool tensor of {B} (one per "
                              f"model), got {type(mask).__name__}")
    if tuple(m.shape) != (B,):
        raise QsyncInputError(f"{owner}.step: mask must have shape [{B}] (one entry per "
                              f"model), got {shape_text(m)}")
    return m

