"""Attention decomposed into its sub-ops: one computation for the tracers and the runtime, so
the planner sees exactly the GEMMs the runtime runs.

* :func:`mha_forward` computes ``nn.MultiheadAttention`` as its sub-ops: ``in_proj`` (or
  ``q_proj``/``k_proj``/``v_proj``, ``q_proj``/``kv_proj`` for cross-attention), ``qk``, a
  softmax, ``av`` and ``out_proj``; :func:`sdpa_forward` computes
  ``F.scaled_dot_product_attention`` as ``qk``, a softmax and ``av``. Both run every step
  through ``step(suffix, kind, fn, *args)``: the tracers record each step as an op (under the
  saved-tensor recorder), the runtime runs the GEMM steps at their planned precision
  (:class:`qsync_opt.ops.gemm.RuntimeStep`).
* :func:`mha_gemms` names the GEMM sub-ops a call runs; :func:`base_name` strips a repeat
  suffix (``x.qk_1`` -> ``x.qk``).

It needs only torch and the op kinds, so it sits below both the graph's tracers and the
runtime (the layers stay acyclic).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qsync_opt.documents.schemas import OpKind

__all__ = ["MHA_GEMMS", "SDPA_GEMMS", "Step", "base_name", "mha_forward", "mha_gemms",
           "sdpa_forward"]

Step = Callable[..., Any]

#: The GEMM sub-ops of nn.MultiheadAttention and of F.scaled_dot_product_attention.
MHA_GEMMS = ("in_proj", "q_proj", "k_proj", "v_proj", "kv_proj", "qk", "av", "out_proj")
SDPA_GEMMS = ("qk", "av")
_REPEAT = re.compile(r"_\d+$")


def _causal_fill(scores: Tensor) -> Tensor:
    L, S = scores.shape[-2], scores.shape[-1]
    keep = torch.ones(L, S, dtype=torch.bool, device=scores.device).tril()
    return scores.masked_fill(keep.logical_not(), float("-inf"))


def sdpa_forward(step: Step, query: Tensor, key: Tensor, value: Tensor,
                 attn_mask: Tensor | None = None, dropout_p: float = 0.0,
                 is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False) -> Tensor:
    """``F.scaled_dot_product_attention`` as steps ``qk`` (matmul), ``softmax``, ``av``
    (matmul), with its scale, boolean or additive mask, causal mask, dropout and grouped
    query heads (torch's math reference)."""
    sc = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    if enable_gqa and key.size(-3) != query.size(-3):
        rep = query.size(-3) // key.size(-3)
        key, value = step("gqa", OpKind.reshape, lambda k, v: (
            k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)), key, value)
    kt = step("k_t", OpKind.reshape, torch.transpose, key, -2, -1)
    scores = step("qk", OpKind.matmul, torch.matmul, query, kt)
    scores = step("scale", OpKind.elementwise, torch.mul, scores, sc)
    if is_causal:
        scores = step("causal", OpKind.elementwise, _causal_fill, scores)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = step("mask", OpKind.elementwise, lambda s, m: s.masked_fill(
                m.logical_not(), float("-inf")), scores, attn_mask)
        else:
            scores = step("mask", OpKind.elementwise, torch.add, scores, attn_mask)
    probs = step("softmax", OpKind.softmax, torch.softmax, scores, -1)
    if dropout_p > 0.0:
        probs = step("dropout", OpKind.dropout, F.dropout, probs, dropout_p, True)
    return step("av", OpKind.matmul, torch.matmul, probs, value)


def _mha_proj_names(mha: nn.MultiheadAttention, query: Tensor, key: Tensor,
                    value: Tensor) -> tuple[str, ...]:
    if not mha._qkv_same_embed_dim:
        return ("q_proj", "k_proj", "v_proj")
    if query is key and key is value:
        return ("in_proj",)
    return ("q_proj", "kv_proj") if key is value else ("q_proj", "k_proj", "v_proj")


def mha_gemms(mha: nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor
              ) -> tuple[str, ...]:
    """The GEMM sub-ops a call ``mha(query, key, value)`` runs (self-attention with packed
    weights: ``in_proj, qk, av, out_proj``); none when the call cannot be decomposed."""
    if not _decomposable(mha):
        return ()
    return (*_mha_proj_names(mha, query, key, value), "qk", "av", "out_proj")


def _decomposable(mha: nn.MultiheadAttention) -> bool:
    return mha.bias_k is None and mha.bias_v is None and not mha.add_zero_attn


def _float_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    if mask is None or mask.is_floating_point():
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        mask, float("-inf"))


def _inputs_lbe(step: Step, mha: nn.MultiheadAttention, query: Tensor, key: Tensor,
                value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Step ``inputs``: query, key and value brought to (L, B, E), keeping which inputs are
    the same tensor (one step output each)."""
    batched = query.dim() == 3
    distinct: list[Tensor] = []
    for t in (query, key, value):
        if not any(t is d for d in distinct):
            distinct.append(t)

    def to_lbe(*xs: Tensor) -> tuple[Tensor, ...]:
        out = []
        for x in xs:
            if not batched:
                x = x.unsqueeze(1)
            elif mha.batch_first:
                x = x.transpose(0, 1)
            out.append(x)
        return tuple(out)

    moved = step("inputs", OpKind.reshape, to_lbe, *distinct)
    pick = {id(d): m for d, m in zip(distinct, moved, strict=True)}
    return pick[id(query)], pick[id(key)], pick[id(value)]


def _projections(step: Step, mha: nn.MultiheadAttention, names: tuple[str, ...],
                 q_in: Tensor, k_in: Tensor, v_in: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The input projections as the steps ``names`` says (one packed ``in_proj``, ``q_proj``
    and a packed ``kv_proj``, or three), and the ``split`` of a packed one."""
    E = mha.embed_dim
    b = mha.in_proj_bias
    bq, bk, bv = (None, None, None) if b is None else (b[:E], b[E:2 * E], b[2 * E:])
    if names == ("in_proj",):
        qkv = step("in_proj", OpKind.linear, F.linear, q_in, mha.in_proj_weight, b)
        q, k, v = step("split", OpKind.reshape, lambda t: tuple(t.chunk(3, dim=-1)), qkv)
        return q, k, v
    if names == ("q_proj", "kv_proj"):
        w = mha.in_proj_weight
        q = step("q_proj", OpKind.linear, F.linear, q_in, w[:E], bq)
        kv = step("kv_proj", OpKind.linear, F.linear, k_in, w[E:],
                  None if b is None else b[E:])
        k, v = step("split", OpKind.reshape, lambda t: tuple(t.chunk(2, dim=-1)), kv)
        return q, k, v
    if mha._qkv_same_embed_dim:
        w = mha.in_proj_weight
        wq, wk, wv = w[:E], w[E:2 * E], w[2 * E:]
    else:
        wq, wk, wv = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
    q = step("q_proj", OpKind.linear, F.linear, q_in, wq, bq)
    k = step("k_proj", OpKind.linear, F.linear, k_in, wk, bk)
    v = step("v_proj", OpKind.linear, F.linear, v_in, wv, bv)
    return q, k, v


def _masked(step: Step, scores: Tensor, attn_mask: Tensor | None,
            key_padding_mask: Tensor | None, is_causal: bool, H: int, S: int) -> Tensor:
    """The scores with the causal fill (``causal``) or the attention and key-padding masks
    added (``mask_prep``, ``mask``)."""
    mask = _float_mask(attn_mask, scores.dtype)
    if mask is None and is_causal:
        scores = step("causal", OpKind.elementwise, _causal_fill, scores)
    kpm = _float_mask(key_padding_mask, scores.dtype)
    if mask is not None or kpm is not None:
        def merged(mask: Tensor | None, kpm: Tensor | None) -> Tensor:
            m = None
            if mask is not None:
                m = mask.unsqueeze(0) if mask.dim() == 2 else mask
            if kpm is not None:
                k2 = kpm.reshape(-1, S).view(-1, 1, 1, S).expand(-1, H, -1, -1).reshape(
                    -1, 1, S)
                m = k2 if m is None else m + k2
            assert m is not None
            return m

        full = step("mask_prep", OpKind.elementwise, merged, mask, kpm)
        scores = step("mask", OpKind.elementwise, torch.add, scores, full)
    return scores


def mha_forward(step: Step, mha: nn.MultiheadAttention, query: Tensor, key: Tensor,
                value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None,
                average_attn_weights: bool = True, is_causal: bool = False
                ) -> tuple[Tensor, Tensor | None]:
    """``nn.MultiheadAttention.forward`` as steps (torch's ``multi_head_attention_forward``,
    need_weights path): projections, ``qk``, mask, ``softmax``, dropout, ``av``,
    ``out_proj``. batch_first or not, batched or not, boolean or float masks (True = masked,
    as torch), ``key_padding_mask``, self- and cross-attention, packed or separate
    projection weights. With ``bias_k``/``add_zero_attn`` it is one step ``attention``
    (torch's own forward, kind other)."""
    if not _decomposable(mha):
        return step("attention", OpKind.other, nn.MultiheadAttention.forward, mha, query, key,
                    value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                    is_causal)
    names = _mha_proj_names(mha, query, key, value)
    batched = query.dim() == 3
    E, H = mha.embed_dim, mha.num_heads
    hd = E // H
    q_in, k_in, v_in = _inputs_lbe(step, mha, query, key, value)
    L, B = q_in.shape[0], q_in.shape[1]
    S = k_in.shape[0]
    q, k, v = _projections(step, mha, names, q_in, k_in, v_in)

    def heads(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return (q.reshape(L, B * H, hd).transpose(0, 1), k.reshape(S, B * H, hd).transpose(0, 1),
                v.reshape(S, B * H, hd).transpose(0, 1))

    q, k, v = step("heads", OpKind.reshape, heads, q, k, v)
    q = step("scale", OpKind.elementwise, torch.mul, q, 1.0 / math.sqrt(hd))
    kt = step("k_t", OpKind.reshape, torch.transpose, k, -2, -1)
    scores = step("qk", OpKind.matmul, torch.bmm, q, kt)  # (B*H, L, S)
    scores = _masked(step, scores, attn_mask, key_padding_mask, is_causal, H, S)
    probs = step("softmax", OpKind.softmax, torch.softmax, scores, -1)
    dropped = probs
    if mha.training and mha.dropout > 0.0:
        dropped = step("dropout", OpKind.dropout, F.dropout, probs, mha.dropout, True)
    out = step("av", OpKind.matmul, torch.bmm, dropped, v)  # (B*H, L, hd)
    out = step("merge", OpKind.reshape,
               lambda t: t.transpose(0, 1).contiguous().view(L * B, E), out)
    out = step("out_proj", OpKind.linear, F.linear, out, mha.out_proj.weight, mha.out_proj.bias)

    def back(t: Tensor) -> Tensor:
        t = t.view(L, B, t.shape[-1])
        if not batched:
            return t.squeeze(1)
        return t.transpose(0, 1) if mha.batch_first else t

    out = step("output", OpKind.reshape, back, out)
    weights = None
    if need_weights:
        def attn_weights(p: Tensor) -> Tensor:
            w = p.view(B, H, L, S)
            w = w.mean(dim=1) if average_attn_weights else w
            return w.squeeze(0) if not batched else w

        weights = step("weights", OpKind.reshape, attn_weights, probs)
    return out, weights


def base_name(name: str) -> str:
    """``name`` without a repeat suffix (``x.qk_1`` -> ``x.qk``)."""
    return _REPEAT.sub("", name)
