"""GEMM calls at a precision: what the precision layers (:mod:`.layers`) and the per-call
dispatcher (:mod:`.dispatch`) share.

* :func:`run_linear` / :func:`run_gemm` run one linear or matmul-like call at a precision
  (16 bit: operands cast, the result cast back; int8 / int4: the qsync integer GEMM or
  int8 / int4 fake-quantization, rounded as ``qsync_opt.ops.NUMERICS`` says: int8
  stochastically, int4 to nearest; fp8: e4m3 fake-quantization); a matmul-like call at
  int8_full also quantizes its output gradient in backward (:func:`int8_full_gemm`), as
  the integer linears do;
* :class:`RuntimeStep` is the ``step`` of the attention decomposition
  (:mod:`qsync_opt.ops.attention`) that runs its GEMM steps at their planned precisions;
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

from qsync_opt import ops
from qsync_opt.core.precision import Precision
from qsync_opt.documents.schemas import OpKind
from qsync_opt.models.layers import MatMul
from qsync_opt.ops.kinds import is_conv1d_like

__all__ = ["COUNTERS", "HALF_DTYPES", "QMixin", "RuntimeStep", "gemm_operand_roles",
           "int8_full_gemm", "quantize_output_grad", "record_call", "run_gemm", "run_linear",
           "swappable_kind"]

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
    if p == Precision.int8_full:
        return int8_full_gemm(fn, args, kwargs, base)
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


def gemm_operand_roles(fn: Callable[..., Any], n_floats: int) -> list[str]:
    """The role of each floating-point operand of a matmul-like call, in argument order:
    ``"a"`` (the left operand: its gradient is ``G @ B^T``), ``"b"`` (the right one: ``A^T @
    G``) or ``""`` (neither: ``baddbmm``'s added input, an einsum's third operand). The
    indicator's forms (:func:`qsync_opt.indicator.calls.functional_form`) take the same two."""
    name = getattr(fn, "__name__", "")
    roles = [""] * n_floats
    if name == "baddbmm":
        order = [1, 2]
    elif name == "__rmatmul__":  # self.__rmatmul__(other) computes other @ self
        order = [1, 0]
    else:
        order = [0, 1]
    for role, i in zip(("a", "b"), order, strict=True):
        if i < n_floats:
            roles[i] = role
    return roles


def quantize_output_grad(g: Tensor, role: str, seed: int) -> Tensor:
    """int8_full's output gradient ``g`` of a matmul-like call as one operand's gradient GEMM
    uses it, fake-quantized to int8 (``ops.NUMERICS``: rounding ``grad_stochastic``, scales
    ``grad_scale``). ``"a"`` (``G @ B^T``): one scale per row, i.e. per position across the
    last axis, with ``grad_scale`` row or rowcol; ``"b"`` (``A^T @ G``): one per last-axis
    channel across every other axis with rowcol; else one per tensor. A 1-D gradient takes one
    scale per element for both (each element is its own row and channel), a 0-D one one scale.
    The indicator's ``int8row`` / ``int8gcol`` kinds are these, element for element."""
    n = ops.NUMERICS
    stochastic = n.grad_stochastic
    per = {"a": n.grad_scale in ("row", "rowcol"), "b": n.grad_scale == "rowcol"}[role]
    if g.dim() == 0 or not per:
        return ops.fake_quant_int8(g, None, stochastic, seed)
    if g.dim() == 1:
        return ops.fake_quant_int8(g, 0, stochastic, seed)
    flat = g.reshape(-1, g.shape[-1])
    return ops.fake_quant_int8(flat, 0 if role == "a" else 1, stochastic, seed).reshape(g.shape)


class _GradQuantizedGemm(torch.autograd.Function):
    """``call(*floats)`` (the operands already fake-quantized) whose backward hands each
    operand's vector-Jacobian product its own quantization of the output gradient
    (:func:`quantize_output_grad` by :func:`gemm_operand_roles`); the forward's graph is
    kept, so backward runs only the two gradient GEMMs."""

    @staticmethod
    def forward(ctx: Any, call: Callable[..., Tensor], roles: list[str], seed: int,
                *floats: Tensor) -> Tensor:
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in floats]
        with torch.enable_grad():
            out = call(*leaves)
        ctx.graph, ctx.leaves, ctx.roles, ctx.seed = out, leaves, roles, seed
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        grads: list[Tensor | None] = [None] * len(ctx.leaves)
        wanted = [i for i, t in enumerate(ctx.leaves) if t.requires_grad]
        for k, role in enumerate(("a", "b", "")):
            idx = [i for i in wanted if ctx.roles[i] == role]
            if not idx:
                continue
            g = grad if not role else quantize_output_grad(
                grad, role, (ctx.seed + (k + 1) * 0x9E37) & 0x7FFFFFFF)
            got = torch.autograd.grad(ctx.graph, [ctx.leaves[i] for i in idx], g,
                                      retain_graph=True, allow_unused=True)
            for i, gi in zip(idx, got, strict=True):
                grads[i] = gi
        return (None, None, None, *grads)


def int8_full_gemm(fn: Callable[..., Any], args: Any, kwargs: Any, base: int) -> Tensor:
    """A matmul-like call at int8_full: every float operand fake-quantized to int8 as at
    int8 (seeds ``2 * base + k``), the product in the operands' dtype, and in backward the
    output gradient quantized to int8 for each operand's gradient GEMM
    (:func:`quantize_output_grad`; seeds from ``base``), as ``qsync::int8_linear`` does with
    ``int8_backward``: what the cost model (``rules.GRAD_QUANTIZE_PASSES``) charges and the
    indicator's int8_full error model assumes."""
    flat, spec = tree_flatten((args, kwargs))
    pos = [i for i, t in enumerate(flat) if isinstance(t, Tensor) and t.is_floating_point()]
    quantized = [ops.fake_quant_int8(flat[i], seed=(2 * base + k) & 0x7FFFFFFF)
                 for k, i in enumerate(pos)]

    def call(*floats: Tensor) -> Tensor:
        leaves = list(flat)
        for i, t in zip(pos, floats, strict=True):
            leaves[i] = t
        a2, k2 = tree_unflatten(leaves, spec)
        return fn(*a2, **k2)

    if not (torch.is_grad_enabled() and any(t.requires_grad for t in quantized)):
        return call(*quantized)
    out: Tensor = _GradQuantizedGemm.apply(call, gemm_operand_roles(fn, len(pos)), base,
                                           *quantized)
    return out


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
    see :class:`~qsync_opt.ops.layers.QMultiheadAttention`), else None."""
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
