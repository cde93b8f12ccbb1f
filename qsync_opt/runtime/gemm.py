"""GEMM calls at a precision: what the precision layers (:mod:`.layers`) and the per-call
dispatcher (:mod:`.dispatch`) share.

* :func:`run_linear` / :func:`run_gemm` run one linear or matmul-like call at a precision
  (16 bit: operands cast, the result cast back; int8 / int4: the qsync integer GEMM or
  int8 / int4 fake-quantization, rounded as ``qsync_opt.ops.NUMERICS`` says: int8
  stochastically, int4 to nearest; fp8: e4m3 fake-quantization);
* :class:`RuntimeStep` is the ``step`` of the attention decomposition
  (:mod:`qsync_opt.attention`) that runs its GEMM steps at their planned precisions;
* :data:`COUNTERS` / :func:`record_call` are the active call tallies of
  :func:`~qsync_opt.runtime.count_calls`;
* :class:`QMixin` marks every precision-switching layer (its precision, seed counter and
  name); :func:`swappable_kind` says which modules have such a layer.

It imports neither the layers nor the dispatcher, so those two form no import cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import ops
from ..models.layers import MatMul
from ..precision import Precision
from ..schemas import OpKind

__all__ = ["COUNTERS", "HALF_DTYPES", "QMixin", "RuntimeStep", "record_call", "run_gemm",
           "run_linear", "swappable_kind"]

#: The 16-bit precisions and their torch dtypes.
HALF_DTYPES = {Precision.fp16: torch.float16, Precision.bf16: torch.bfloat16}

#: Active :func:`~qsync_opt.runtime.count_calls` tallies: {op: {precision: calls}}.
COUNTERS: list[dict[str, dict[str, int]]] = []


def record_call(name: str, p: Precision) -> None:
    """Count one call of op ``name`` at precision ``p`` in every active tally."""
    for c in COUNTERS:
        per = c.setdefault(name, {})
        per[p.value] = per.get(p.value, 0) + 1


def run_linear(x: Tensor, w: Tensor, b: Tensor | None, p: Precision,
               next_seed: Callable[[], int]) -> Tensor:
    """``F.linear(x, w, b)`` at precision ``p`` (as :class:`QLinear` runs it)."""
    if p in HALF_DTYPES:
        d = HALF_DTYPES[p]
        return F.linear(x.to(d), w.to(d), None if b is None else b.to(d)).to(x.dtype)
    if p in (Precision.int8, Precision.int8_full):
        return ops.int8_linear(x, w, b, int8_backward=p == Precision.int8_full,
                               seed=next_seed())
    if p == Precision.fp8:
        return F.linear(ops.fake_quant_float(x, "fp8_e4m3"), ops.fake_quant_float(w, "fp8_e4m3"),
                        b)
    if p == Precision.int4:
        return ops.int4_linear(x, w, b, seed=next_seed())
    return F.linear(x, w, b)


def run_gemm(kind: str, fn: Callable[..., Any], args: Any, kwargs: Any, p: Precision,
             next_seed: Callable[[], int]) -> Any:
    """One functional GEMM call ``fn(*args, **kwargs)`` at precision ``p``: ``kind`` linear
    (``F.linear``'s arguments) or matmul (matmul, bmm, mm, ``@``, einsum, baddbmm: every
    floating-point tensor operand cast to 16 bit, or fake-quantized to int8 / fp8 as
    :class:`QMatMul` does, the result back in the first operand's dtype)."""
    if p in (Precision.fp32, Precision.tf32):
        return fn(*args, **kwargs)
    if kind == "linear":
        names = ("input", "weight", "bias")
        vals = list(args) + [kwargs.get(n) for n in names[len(args):]]
        x, w, b = (vals + [None] * 3)[:3]
        return run_linear(x, w, b, p, next_seed)
    flat, spec = tree_flatten((args, kwargs))
    floats = [t for t in flat if isinstance(t, Tensor) and t.is_floating_point()]
    if not floats:
        return fn(*args, **kwargs)
    dtype = floats[0].dtype
    base = next_seed() if p in (Precision.int8, Precision.int8_full, Precision.int4) else 0
    k = 0

    def conv(t: Any) -> Any:
        nonlocal k
        if not (isinstance(t, Tensor) and t.is_floating_point()):
            return t
        k += 1
        if p in HALF_DTYPES:
            return t.to(HALF_DTYPES[p])
        if p == Precision.fp8:
            return ops.fake_quant_float(t, "fp8_e4m3")
        if p == Precision.int4:
            return ops.fake_quant_int4(t, seed=(2 * base + k - 1) & 0x7FFFFFFF)
        return ops.fake_quant_int8(t, seed=(2 * base + k - 1) & 0x7FFFFFFF)

    a2, k2 = tree_unflatten([conv(t) for t in flat], spec)
    out = fn(*a2, **k2)
    return out.to(dtype) if p in HALF_DTYPES and isinstance(out, Tensor) else out


class QMixin:
    """What every precision-switching layer shares: its precision, stochastic-rounding seed
    and name (the dispatcher and the trainer recognise the layers by this class)."""

    precision: Precision
    qseed: int
    qname: str = ""

    def _next_seed(self) -> int:
        self.qseed += 1
        return self.qseed

    def _count(self) -> None:
        if COUNTERS:
            record_call(self.qname, self.precision)


def swappable_kind(mod: nn.Module) -> str | None:
    """``"linear"``, ``"conv"``, ``"matmul"`` or ``"conv1d_hf"`` for a GEMM module with a
    precision-specific layer (the out_proj of an nn.MultiheadAttention is run by its parent:
    see :class:`~qsync_opt.runtime.layers.QMultiheadAttention`), else None."""
    from ..graph import is_conv1d_like

    if is_conv1d_like(mod):
        return "conv1d_hf"
    if isinstance(mod, nn.Linear):
        return "linear"
    if isinstance(mod, (nn.Conv1d, nn.Conv2d)):
        return "conv"
    if isinstance(mod, MatMul):
        return "matmul"
    return None


class RuntimeStep:
    """A ``step`` running the GEMM steps of a decomposition at their planned precision:
    ``<base>.<suffix>`` looked up in ``precisions`` (by suffix), fp32 when absent; every
    other step runs as written. Each GEMM call is counted (:func:`count_calls`)."""

    def __init__(self, base: str, precisions: Mapping[str, Precision],
                 next_seed: Callable[[], int]) -> None:
        self.base, self.precisions, self.next_seed = base, precisions, next_seed

    def __call__(self, suffix: str, kind: OpKind, fn: Callable[..., Any], *args: Any,
                 **kwargs: Any) -> Any:
        if kind not in (OpKind.linear, OpKind.matmul):
            return fn(*args, **kwargs)
        p = self.precisions.get(suffix, Precision.fp32)
        record_call(f"{self.base}.{suffix}" if self.base else suffix, p)
        return run_gemm("linear" if kind == OpKind.linear else "matmul", fn, args, kwargs, p,
                        self.next_seed)
