"""Decomposed attention and per-call dispatch of functional GEMMs: one computation for the
tracers and the runtime, so the planner sees exactly the GEMMs the runtime runs.

* :func:`mha_forward` computes ``nn.MultiheadAttention`` as its sub-ops: ``in_proj`` (or
  ``q_proj``/``k_proj``/``v_proj``, ``q_proj``/``kv_proj`` for cross-attention), ``qk``, a
  softmax, ``av`` and ``out_proj``; :func:`sdpa_forward` computes
  ``F.scaled_dot_product_attention`` as ``qk``, a softmax and ``av``. Both run every step
  through ``step(suffix, kind, fn, *args)``: the tracers record each step as an op (under the
  saved-tensor recorder), the runtime runs the GEMM steps at their planned precision.
* :class:`FunctionalDispatch` (installed by :func:`~qsync_opt.runtime.apply_plan` when a plan
  names functional ops) is a ``TorchFunctionMode`` active during the root model's forward,
  with module hooks tracking the scope; it names each top-level ``F.linear`` / ``matmul`` /
  ``bmm`` / ``@`` / SDPA call with :class:`qsync_opt.graph.CallNamer` (the tracers' rule;
  counters reset per root forward) and runs it at its planned precision. Calls inside leaf
  modules (Linear, the Q* layers, ...) are theirs and never re-dispatched.
* :func:`count_calls` counts, per op name, the calls each precision saw.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..precision import Precision
from ..schemas import OpKind
from .layers import COUNTERS, QMixin, record_call, run_gemm, swappable_kind

__all__ = ["FunctionalDispatch", "count_calls", "mha_forward", "mha_gemms", "sdpa_forward",
           "MHA_GEMMS", "SDPA_GEMMS"]

log = logging.getLogger(__name__)

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
    # Bring everything to (L, B, E), keeping which inputs are the same tensor.
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
    q_in, k_in, v_in = pick[id(query)], pick[id(key)], pick[id(value)]
    L, B = q_in.shape[0], q_in.shape[1]
    S = k_in.shape[0]
    b = mha.in_proj_bias
    bq, bk, bv = (None, None, None) if b is None else (b[:E], b[E:2 * E], b[2 * E:])
    if names == ("in_proj",):
        qkv = step("in_proj", OpKind.linear, F.linear, q_in, mha.in_proj_weight, b)
        q, k, v = step("split", OpKind.reshape, lambda t: tuple(t.chunk(3, dim=-1)), qkv)
    elif names == ("q_proj", "kv_proj"):
        w = mha.in_proj_weight
        q = step("q_proj", OpKind.linear, F.linear, q_in, w[:E], bq)
        kv = step("kv_proj", OpKind.linear, F.linear, k_in, w[E:],
                  None if b is None else b[E:])
        k, v = step("split", OpKind.reshape, lambda t: tuple(t.chunk(2, dim=-1)), kv)
    else:
        if mha._qkv_same_embed_dim:
            w = mha.in_proj_weight
            wq, wk, wv = w[:E], w[E:2 * E], w[2 * E:]
        else:
            wq, wk, wv = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
        q = step("q_proj", OpKind.linear, F.linear, q_in, wq, bq)
        k = step("k_proj", OpKind.linear, F.linear, k_in, wk, bk)
        v = step("v_proj", OpKind.linear, F.linear, v_in, wv, bv)

    def heads(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return (q.reshape(L, B * H, hd).transpose(0, 1), k.reshape(S, B * H, hd).transpose(0, 1),
                v.reshape(S, B * H, hd).transpose(0, 1))

    q, k, v = step("heads", OpKind.reshape, heads, q, k, v)
    q = step("scale", OpKind.elementwise, torch.mul, q, 1.0 / math.sqrt(hd))
    kt = step("k_t", OpKind.reshape, torch.transpose, k, -2, -1)
    scores = step("qk", OpKind.matmul, torch.bmm, q, kt)  # (B*H, L, S)
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


# ----------------------------------------------------------------------------- runtime steps


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


def base_name(name: str) -> str:
    """``name`` without a repeat suffix (``x.qk_1`` -> ``x.qk``)."""
    return _REPEAT.sub("", name)


def _gemm_call_kind(func: Any) -> str | None:
    from ..graph import gemm_call_kind  # graph imports this module lazily; no import cycle

    return gemm_call_kind(func)


class _Mode(TorchFunctionMode):
    def __init__(self, owner: FunctionalDispatch) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        o = self.owner
        if o.depth > 0:
            return func(*args, **kwargs)
        kind = _gemm_call_kind(func)
        if kind is None:
            return func(*args, **kwargs)
        name = o.namer.name(kind, o.scope[-1] if o.scope else "", (args, kwargs))
        o.seen.add(name)
        if kind == "sdpa":
            o.seen.update(f"{name}.{s}" for s in SDPA_GEMMS)
            subs = {s: o.precisions[f"{name}.{s}"] for s in SDPA_GEMMS
                    if f"{name}.{s}" in o.precisions}
            if all(p in (Precision.fp32, Precision.tf32) for p in subs.values()):
                for s in SDPA_GEMMS:
                    record_call(f"{name}.{s}", subs.get(s, Precision.fp32))
                return func(*args, **kwargs)
            return sdpa_forward(RuntimeStep(name, subs, o.next_seed), *args, **kwargs)
        p = o.precisions.get(name, Precision.fp32)
        record_call(name, p)
        return run_gemm(kind, func, args, kwargs, p, o.next_seed)


class FunctionalDispatch:
    """Per-call precisions for the functional GEMMs and SDPA calls of ``model``'s forward.

    ``precisions`` maps op names (as the tracers give them: :class:`qsync_opt.graph.CallNamer`;
    SDPA sub-ops ``<call>.qk`` / ``<call>.av``) to precisions; calls not named run as written
    (fp32) and are still counted. Installs hooks on ``model`` and its submodules;
    :meth:`remove` takes them off. One forward of the root resets the call counters.
    """

    def __init__(self, model: nn.Module, precisions: Mapping[str, Precision],
                 seed: int = 0) -> None:
        from ..graph import CallNamer, is_leaf_module

        self.model = model
        self.precisions = dict(precisions)
        self.namer = CallNamer({})
        self.scope: list[str] = []
        self.depth = 0
        self.active = 0
        self.seed = seed & 0x7FFFFFFF
        self.mode: _Mode | None = None
        self.seen: set[str] = set()  # op names dispatched so far
        self.checked = False
        self.handles: list[Any] = []
        self.handles.append(model.register_forward_pre_hook(self._root_pre))
        self.handles.append(model.register_forward_hook(self._root_post, always_call=True))
        for name, mod in model.named_modules():
            if not name:
                continue
            if is_leaf_module(mod) or isinstance(mod, QMixin):
                self.handles.append(mod.register_forward_pre_hook(self._leaf_pre))
                self.handles.append(mod.register_forward_hook(self._leaf_post, always_call=True))
            else:
                self.handles.append(mod.register_forward_pre_hook(self._scope_pre(name)))
                self.handles.append(mod.register_forward_hook(self._scope_post,
                                                              always_call=True))

    def next_seed(self) -> int:
        self.seed = (self.seed + 1) & 0x7FFFFFFF
        return self.seed

    def _root_pre(self, mod: nn.Module, args: Any) -> None:
        if self.active == 0:
            self.namer.param_names = {id(p): n for n, p in self.model.named_parameters()}
            self.namer.reset()
            self.scope.clear()
            self.depth = 0
            self.mode = _Mode(self)
            self.mode.__enter__()
        self.active += 1

    def _root_post(self, mod: nn.Module, args: Any, out: Any) -> None:
        self.active -= 1
        if self.active == 0 and self.mode is not None:
            mode, self.mode = self.mode, None
            mode.__exit__(None, None, None)
            if not self.checked:
                self.checked = True
                unseen = self.unseen()
                if unseen:
                    log.warning("plan: %d planned op(s) did not run in the first forward, so "
                                "their precisions are not used: %s", len(unseen),
                                ", ".join(unseen[:5]) + (" ..." if len(unseen) > 5 else ""))

    def unseen(self) -> list[str]:
        """Planned functional ops no forward has run so far (a name the model's calls do
        not produce: the plan was made for another model, or another code path)."""
        return sorted(set(self.precisions) - self.seen)

    def _leaf_pre(self, mod: nn.Module, args: Any) -> None:
        self.depth += 1

    def _leaf_post(self, mod: nn.Module, args: Any, out: Any) -> None:
        self.depth -= 1

    def _scope_pre(self, name: str) -> Callable[[nn.Module, Any], None]:
        return _ScopePush(self, name)

    def _scope_post(self, mod: nn.Module, args: Any, out: Any) -> None:
        if self.scope:
            self.scope.pop()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class _ScopePush:
    """A scope pre-hook as an object (not a closure), so a deep copy of the model gets hooks
    that push onto the copy's dispatcher."""

    def __init__(self, owner: FunctionalDispatch, name: str) -> None:
        self.owner, self.name = owner, name

    def __call__(self, mod: nn.Module, args: Any) -> None:
        self.owner.scope.append(self.name)


def functional_op_exists(model: nn.Module, name: str) -> bool:
    """Whether ``name`` can be a functional op of ``model`` under the tracers' naming: a
    parameter's name (a call reading it), ``<module>.linear|matmul``, or
    ``<module>.sdpa.qk|av`` (each with an optional ``_N`` repeat suffix) for a module of
    ``model`` (the root: no prefix)."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    base = base_name(name)
    if base in params:
        return True
    scope, _, last = base.rpartition(".")
    if last in ("linear", "matmul"):
        return scope in modules
    if last in SDPA_GEMMS:
        scope2, _, call = scope.rpartition(".")
        return base_name(call) == "sdpa" and scope2 in modules
    return False


@contextmanager
def count_calls(model: nn.Module) -> Iterator[dict[str, dict[str, int]]]:
    """Count, per op name, the calls each precision saw while the block runs:
    ``{op: {precision: n}}``. The Q* layers and the dispatcher count what they run; GEMM
    modules left as they are count as fp32 (nn.MultiheadAttention by its sub-ops), and
    functional GEMMs outside a plan too (a dispatcher with no precisions is installed for the
    block when ``model`` has none)."""
    counts: dict[str, dict[str, int]] = {}
    COUNTERS.append(counts)
    handles: list[Any] = []

    def count_module(name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            record_call(name, Precision.fp32)
        return hook

    def count_mha(name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any, kwargs: Any) -> None:
            qkv = list(args[:3])
            for key in ("query", "key", "value")[len(qkv):]:
                qkv.append(kwargs.get(key))
            for s in mha_gemms(mod, *qkv):
                record_call(f"{name}.{s}" if name else s, Precision.fp32)
        return hook

    for name, mod in model.named_modules():
        if isinstance(mod, QMixin):
            continue
        if isinstance(mod, nn.MultiheadAttention):
            handles.append(mod.register_forward_pre_hook(count_mha(name), with_kwargs=True))
        elif swappable_kind(mod) is not None:
            handles.append(mod.register_forward_hook(count_module(name)))
    temp = None if getattr(model, "_qsync_dispatch", None) else FunctionalDispatch(model, {})
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()
        if temp is not None:
            temp.remove()
        COUNTERS.remove(counts)
