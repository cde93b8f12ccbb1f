"""Graph extraction: a workload (registry name, user file, or nn.Module) -> ModelGraph.

How it works:

1. The model is traced with ``torch.fx`` (torch.nn modules and qsync's ``MatMul`` are leaves,
   so op names are the module names users see in ``named_modules()``). For a registry
   workload the loss is spliced into the graph, so it appears as a pinned op.
2. The traced graph is run node by node on the ``meta`` device: parameters are swapped for
   meta tensors (no real allocation, whatever device the user's model lives on), inputs are
   meta tensors, autograd records as usual. Each node's output shapes come from that run,
   and each node's activations saved for backward are *measured* with
   ``torch.autograd.graph.saved_tensors_hooks`` (parameters and buffers excluded; a storage
   saved by an earlier op is recorded as shared, so memory is not counted twice).
3. Where symbolic tracing fails (data-dependent Python control flow, say), a fallback runs the
   model once on meta tensors under a ``TorchFunctionMode`` with module hooks: leaf modules
   and top-level torch functions become ops, edges follow tensor identity. If both fail,
   :class:`TraceError` says why in one line.
4. Post-processing is shared: kinds, roles (choosable / pinned with a reason / pass-through /
   promote), FLOPs (a multiply-add is 2 FLOPs), bytes, depths, the classifier head pin,
   optional tie groups.
"""

from __future__ import annotations

import inspect
import logging
import operator
import re
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .errors import QsyncInputError, TraceError
from .models import Workload, get_workload
from .models.layers import MatMul
from .precision import Precision
from .schemas import Edge, ModelGraph, OpKind, OpNode, OpRole, TensorSpec
from .user_model import UserWorkload, split_inputs

log = logging.getLogger(__name__)

ALL_GEMM_PRECISIONS = [
    Precision.fp32, Precision.tf32, Precision.bf16, Precision.fp16,
    Precision.int8, Precision.int8_full, Precision.fp8,
]
#: FP8 training kernels (Transformer Engine) cover GEMMs, not convolutions.
CONV_PRECISIONS = [p for p in ALL_GEMM_PRECISIONS if p != Precision.fp8]

PIN_REASONS = {
    OpKind.norm: "norm: fp32, as autocast runs layer_norm/group_norm (QSync let norms drop to "
    "16 bit; qsync-opt keeps autocast's choice; batch_norm runs in its input's dtype)",
    OpKind.softmax: "softmax: fp32, as autocast runs softmax/log_softmax",
    OpKind.loss: "loss: fp32, as autocast runs cross_entropy/nll_loss/mse_loss",
    OpKind.embedding: "embedding: a gather with no arithmetic to lower; runs in its weight dtype",
    OpKind.reduce: "reduction: fp32, as autocast runs sum/prod/cumsum/exp/log/pow",
}
HEAD_REASON = "classifier head: kept fp32 as QSync does (trace(..., pin_head=False) unpins it)"

# ----------------------------------------------------------------------------- op kinds

_MODULE_KINDS: list[tuple[tuple[type[nn.Module], ...], OpKind]] = [
    ((nn.Linear,), OpKind.linear),
    ((nn.Conv1d, nn.Conv2d, nn.Conv3d), OpKind.conv),
    ((MatMul,), OpKind.matmul),
    ((nn.Embedding,), OpKind.embedding),
    ((nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm), OpKind.norm),
    ((nn.Softmax, nn.LogSoftmax), OpKind.softmax),
    ((nn.modules.loss._Loss,), OpKind.loss),
    ((nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.Hardswish, nn.ReLU6,
      nn.ELU, nn.Mish, nn.Hardsigmoid), OpKind.activation),
    ((nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd,
      nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd), OpKind.pool),
    ((nn.modules.dropout._DropoutNd,), OpKind.dropout),
    ((nn.Flatten, nn.Unflatten, nn.Identity), OpKind.reshape),
]

_FUNCTION_KINDS: dict[Any, OpKind] = {}
for _fns, _kind in [
    ((torch.matmul, torch.bmm, torch.mm, operator.matmul, torch.baddbmm, torch.einsum,
      torch.Tensor.matmul, torch.Tensor.bmm, torch.Tensor.mm, torch.Tensor.__matmul__,
      torch.Tensor.__rmatmul__), OpKind.matmul),
    ((F.linear,), OpKind.linear),
    ((F.conv1d, F.conv2d, F.conv3d), OpKind.conv),
    ((F.embedding,), OpKind.embedding),
    ((F.layer_norm, F.batch_norm, F.group_norm, F.rms_norm), OpKind.norm),
    ((F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax,
      torch.Tensor.log_softmax), OpKind.softmax),
    ((F.cross_entropy, F.nll_loss, F.mse_loss, F.binary_cross_entropy_with_logits,
      F.l1_loss, F.smooth_l1_loss), OpKind.loss),
    ((F.relu, torch.relu, F.gelu, F.silu, torch.tanh, torch.sigmoid, F.leaky_relu,
      F.hardswish, torch.Tensor.relu, torch.Tensor.tanh, torch.Tensor.sigmoid), OpKind.activation),
    ((F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d),
     OpKind.pool),
    ((F.dropout,), OpKind.dropout),
    ((torch.cat, torch.stack, torch.concat), OpKind.concat),
    ((torch.sum, torch.cumsum, torch.prod, torch.exp, torch.log, torch.pow, torch.Tensor.sum,
      torch.Tensor.exp, torch.Tensor.log, torch.Tensor.pow, torch.Tensor.cumsum), OpKind.reduce),
    ((operator.add, operator.sub, operator.mul, operator.truediv, operator.neg,
      operator.iadd, operator.imul, torch.add, torch.sub, torch.mul, torch.div, torch.where,
      torch.Tensor.add, torch.Tensor.mul, torch.Tensor.div, torch.Tensor.sub,
      torch.Tensor.masked_fill, torch.masked_fill, torch.Tensor.__add__,
      torch.Tensor.__mul__, torch.Tensor.__truediv__, torch.Tensor.__sub__), OpKind.elementwise),
]:
    for _fn in _fns:
        _FUNCTION_KINDS[_fn] = _kind

_METHOD_KINDS: dict[str, OpKind] = {
    "matmul": OpKind.matmul, "bmm": OpKind.matmul, "mm": OpKind.matmul,
    "softmax": OpKind.softmax, "log_softmax": OpKind.softmax,
    "relu": OpKind.activation, "tanh": OpKind.activation, "sigmoid": OpKind.activation,
    "sum": OpKind.reduce, "exp": OpKind.reduce, "log": OpKind.reduce, "pow": OpKind.reduce,
    "cumsum": OpKind.reduce, "prod": OpKind.reduce,
    "add": OpKind.elementwise, "mul": OpKind.elementwise, "div": OpKind.elementwise,
    "sub": OpKind.elementwise, "masked_fill": OpKind.elementwise, "add_": OpKind.elementwise,
    "mul_": OpKind.elementwise,
}
_RESHAPE_METHODS = {
    "view", "reshape", "permute", "transpose", "flatten", "contiguous", "split", "chunk",
    "squeeze", "unsqueeze", "expand", "expand_as", "view_as", "t", "unbind", "narrow",
    "__getitem__", "float", "to", "type_as", "repeat", "clone", "detach",
}
_RESHAPE_FUNCTIONS = {
    operator.getitem, torch.flatten, torch.reshape, torch.permute, torch.transpose,
    torch.split, torch.chunk, torch.squeeze, torch.unsqueeze, torch.unbind, torch.narrow,
}
_CHOOSABLE = {OpKind.linear, OpKind.conv, OpKind.matmul}
_COMPUTING_FOR_DEPTH = _CHOOSABLE | set(PIN_REASONS)


def is_conv1d_like(mod: nn.Module) -> bool:
    """True for a HuggingFace-style ``Conv1D`` (found by duck typing, transformers is never
    imported): a class named ``Conv1D`` with a 2-D ``weight`` of shape (nx, nf) and an int
    ``nf``; it computes ``addmm(bias, x, weight)``, a Linear with a transposed weight."""
    # Read past __getattr__: while torch.fx traces, parameters read as attributes are proxies.
    w = mod._parameters.get("weight") if "_parameters" in mod.__dict__ else None
    nf = mod.__dict__.get("nf")
    return (type(mod).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.dim() == 2
            and isinstance(nf, int) and int(w.shape[1]) == nf)


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def is_leaf_module(mod: nn.Module) -> bool:
    """The modules both tracers (and the runtime dispatcher) treat as one op, never looking
    inside: qsync's MatMul, ``nn.MultiheadAttention`` (expanded into its sub-ops), a
    HuggingFace-style Conv1D, and childless torch.nn modules (or subclasses of the kinds
    qsync knows: Linear, Conv, norms, ...). Custom modules and torch.nn modules with children
    are traced through, so functional GEMMs inside them are seen."""
    if isinstance(mod, (MatMul, nn.MultiheadAttention)) or is_conv1d_like(mod):
        return True
    if isinstance(mod, _CONTAINERS) or next(iter(mod.children()), None) is not None:
        return False
    if any(isinstance(mod, types) for types, _ in _MODULE_KINDS):
        return True
    return type(mod).__module__.startswith(("torch.nn", "torch.ao.nn"))


def _module_kind(mod: nn.Module) -> OpKind:
    if is_conv1d_like(mod):
        return OpKind.linear
    for types, kind in _MODULE_KINDS:
        if isinstance(mod, types):
            return kind
    return OpKind.other


def _function_kind(fn: Any) -> OpKind:
    if fn in _FUNCTION_KINDS:
        return _FUNCTION_KINDS[fn]
    if fn in _RESHAPE_FUNCTIONS:
        return OpKind.reshape
    return OpKind.other


def _method_kind(name: str) -> OpKind:
    if name in _METHOD_KINDS:
        return _METHOD_KINDS[name]
    if name in _RESHAPE_METHODS:
        return OpKind.reshape
    return OpKind.other


#: The functional calls the runtime dispatches per call (and the tracers name alike).
_GEMM_CALL_KINDS = {OpKind.linear: "linear", OpKind.matmul: "matmul"}


def gemm_call_kind(func: Any, method: str | None = None) -> str | None:
    """``"linear"``, ``"matmul"`` or ``"sdpa"`` for a functional GEMM or attention call
    (``func`` a torch function, or ``method`` the name of a Tensor method), else None."""
    if func is F.scaled_dot_product_attention:
        return "sdpa"
    kind = _function_kind(func) if func is not None else OpKind.other
    if kind == OpKind.other:
        name = method if method is not None else getattr(func, "__name__", "")
        kind = _method_kind(name.strip("_") if name in ("__matmul__", "__rmatmul__") else name)
    return _GEMM_CALL_KINDS.get(kind)


class CallNamer:
    """Op names of functional GEMM and attention calls, one rule for both tracers and the
    runtime dispatcher (:mod:`qsync_opt.runtime.dispatch`), so a plan's names always match.

    A call reading a parameter (``F.linear(x, self.qkv_w)``, ``x @ self.w``) is named by that
    parameter's full name (``blocks.0.attn.qkv_w``); other calls by their module scope, the
    call's kind and order: ``blocks.0.attn.matmul``, ``blocks.0.attn.matmul_1``, and
    ``blocks.0.attn.sdpa`` for ``F.scaled_dot_product_attention`` (whose sub-ops are
    ``<that>.qk`` and ``<that>.av``). A repeated name gets ``_1``, ``_2``... in call order;
    :meth:`reset` starts a new forward.
    """

    def __init__(self, param_names: dict[int, str]) -> None:
        self.param_names = param_names
        self.counts: dict[str, int] = {}

    def reset(self) -> None:
        self.counts.clear()

    def name(self, kind: str, scope: str, args: Any = ()) -> str:
        base = None
        if kind != "sdpa":
            flat = _tensors(args)
            # F.linear's weight names the call before its input does.
            order = ([flat[1]] + flat[:1] + flat[2:]) if kind == "linear" and len(flat) > 1 else flat
            base = next((self.param_names[id(t)] for t in order if id(t) in self.param_names),
                        None)
        if base is None:
            base = f"{scope}.{kind}" if scope else kind
        n = self.counts.get(base, 0)
        self.counts[base] = n + 1
        return base if n == 0 else f"{base}_{n}"


def _target_name(fn: Any) -> str:
    name = getattr(fn, "__name__", None) or str(fn)
    mod = getattr(fn, "__module__", None)
    if fn in (operator.getitem,) or mod == "_operator":
        return f"operator.{name}"
    return f"{mod}.{name}" if mod else name


# ----------------------------------------------------------------------------- raw ops


@dataclass
class _RawOp:
    """What a tracer learned about one op before the shared post-processing."""

    name: str
    kind: OpKind
    target: str
    module: nn.Module | None
    inputs: list[tuple[str, torch.Tensor]]  # (producer op, the tensor it gave this op)
    input_tensors: list[torch.Tensor]  # activation inputs (meta)
    outputs: list[torch.Tensor]
    params: list[torch.Tensor]  # parameters the op reads
    saved: list[torch.Tensor] = field(default_factory=list)
    is_loss_part: bool = False
    tie_key: Any = None  # ops with one key share one decision (default: their module)


def _class_name(mod: nn.Module) -> str:
    return type(mod).__module__ + "." + type(mod).__qualname__


def _tensors(value: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten(value)
    return [t for t in flat if isinstance(t, torch.Tensor)]


class _SavedRecorder:
    """saved_tensors_hooks that attribute every saved tensor to the op running now."""

    def __init__(self) -> None:
        self.current: list[torch.Tensor] | None = None
        self.keep: list[torch.Tensor] = []  # keeps storages alive so ids are not reused

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.current is not None:
            self.current.append(t)
            self.keep.append(t)
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _storage_id(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return out.requires_grad_(t.requires_grad) if t.is_floating_point() else out


class _Expansion:
    """The step function (``step(suffix, kind, fn, *args)``) a decomposed attention
    (:func:`qsync_opt.runtime.dispatch.mha_forward` / ``sdpa_forward``) runs under while
    tracing: each step runs under the saved-tensor recorder and becomes a raw op named
    ``<base>.<suffix>``, linked to its producers by tensor identity. The runtime runs the
    very same decomposition, so the graph's FLOPs and memory are those the runtime spends."""

    def __init__(self, base: str, target: str, rec: _SavedRecorder, raw: list[_RawOp],
                 producer: dict[int, str], unique: Callable[[str], str],
                 param_storages: set[int], alive: list[Any], is_loss: bool,
                 tie: Any = None) -> None:
        self.base, self.target, self.rec, self.raw = base, target, rec, raw
        self.producer, self.unique, self.param_storages = producer, unique, param_storages
        self.alive, self.is_loss, self.tie = alive, is_loss, tie
        self.last: str | None = None

    def __call__(self, suffix: str, kind: OpKind, fn: Callable[..., Any], *args: Any,
                 **kwargs: Any) -> Any:
        self.rec.current = []
        try:
            with self.rec.hooks():
                value = fn(*args, **kwargs)
        finally:
            saved, self.rec.current = self.rec.current, None
        outs = _tensors(value)
        if not outs:
            return value
        flat = _tensors((args, kwargs))
        params = [t for t in flat if _storage_id(t) in self.param_storages]
        ins = [t for t in flat if _storage_id(t) not in self.param_storages]
        name = self.unique(f"{self.base}.{suffix}" if self.base else suffix)
        self.raw.append(_RawOp(
            name=name, kind=kind, target=f"{self.target}.{suffix}", module=None,
            inputs=[(self.producer[id(t)], t) for t in ins if id(t) in self.producer],
            input_tensors=ins, outputs=outs, params=params, saved=saved,
            is_loss_part=self.is_loss,
            tie_key=(self.tie, suffix) if self.tie is not None else None,
        ))
        for t in outs:
            self.producer[id(t)] = name
        self.alive.append(value)
        self.last = name
        return value


def _expand_mha(step: _Expansion, mod: nn.Module, args: Any, kwargs: Any) -> Any:
    from .runtime.dispatch import mha_forward

    return mha_forward(step, mod, *args, **kwargs)


def _expand_sdpa(step: _Expansion, args: Any, kwargs: Any) -> Any:
    from .runtime.dispatch import sdpa_forward

    return sdpa_forward(step, *args, **kwargs)


def _meta_param_names(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[int, str]:
    """id(meta copy of a parameter) -> the parameter's name as ``model.named_parameters()``
    gives it (a tied parameter: its first name), as the runtime dispatcher names it."""
    first: dict[int, str] = {}
    for n, p in model.named_parameters():
        first.setdefault(id(p), n)
    out: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if n in state:
            out.setdefault(id(state[n]), first[id(p)])
    return out


def _once(like: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``like`` (meta or real copies of the example inputs) applied once per tensor: one
    tensor given twice stays one tensor (so ``attn(x, x, x)`` with the same input is traced
    as self-attention, as it runs)."""
    memo: dict[int, torch.Tensor] = {}

    def copy(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            memo[id(t)] = like(t)
        return memo[id(t)]

    return copy


def _real_like(t: torch.Tensor) -> torch.Tensor:
    out = t.detach().clone()
    return out.requires_grad_(t.requires_grad) if t.is_floating_point() else out


# ----------------------------------------------------------------------------- fx path


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return is_leaf_module(m)


def _meta_state(root: nn.Module) -> dict[str, torch.Tensor]:
    """Meta copies of every parameter and buffer; tied tensors stay tied."""
    by_id: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    named = list(root.named_parameters(remove_duplicate=False)) + list(
        root.named_buffers(remove_duplicate=False)
    )
    for name, t in named:
        if id(t) not in by_id:
            by_id[id(t)] = _meta_like(t)
        state[name] = by_id[id(t)]
    return state


def _splice_loss(gm: fx.GraphModule, loss_fn: Callable[[Any, Any], Any]) -> None:
    """Append ``loss_fn(output, targets)`` to the traced graph as ops named ``loss.*``."""

    class _Loss(nn.Module):
        def forward(self, output: Any, targets: Any) -> Any:
            return loss_fn(output, targets)

    loss_graph = fx.symbolic_trace(_Loss()).graph
    g = gm.graph
    out_node = next(n for n in g.nodes if n.op == "output")
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    with g.inserting_after(placeholders[-1]):
        target_ph = g.placeholder("targets")
    lph = [n for n in loss_graph.nodes if n.op == "placeholder"]
    val_map: dict[fx.Node, Any] = {lph[0]: out_node.args[0], lph[1]: target_ph}
    before = set(g.nodes)
    with g.inserting_before(out_node):
        loss_val = g.graph_copy(loss_graph, val_map)
    for n in g.nodes:
        if n not in before:
            n.meta["qsync_loss"] = True
    out_node.args = (loss_val,)
    gm.recompile()


def _fx_raw_ops(
    model: nn.Module,
    inputs: Sequence[torch.Tensor],
    targets: torch.Tensor | None,
    loss_fn: Callable[[Any, Any], Any] | None,
    *,
    kwargs: dict[str, torch.Tensor] | None = None,
    sink: list[Any] | None = None,
) -> list[_RawOp]:
    kwargs = kwargs or {}
    concrete: dict[str, Any] | None = None
    if kwargs:
        # Keyword inputs: the forward's other parameters keep their defaults (fx
        # specialises on them), the given ones become placeholders.
        params = list(inspect.signature(model.forward).parameters.values())[len(inputs):]
        unknown = [k for k in kwargs if k not in {p.name for p in params}]
        if unknown and not any(p.kind == p.VAR_KEYWORD for p in params):
            raise TypeError(f"forward() got an unexpected keyword argument {unknown[0]!r}")
        concrete = {p.name: p.default for p in params
                    if p.name not in kwargs and p.default is not p.empty
                    and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    graph = _Tracer().trace(model, concrete_args=concrete)
    gm = fx.GraphModule(model, graph)
    if loss_fn is not None and targets is not None:
        _splice_loss(gm, loss_fn)
    state = _meta_state(gm)
    rec = _SavedRecorder()
    names: dict[fx.Node, str] = {}
    raw: list[_RawOp] = []
    used_names: dict[str, int] = {}
    namer = CallNamer(_meta_param_names(model, state))
    param_storages = {_storage_id(t) for t in state.values()}
    alive: list[Any] = []

    def unique(base: str) -> str:
        used_names[base] = used_names.get(base, 0) + 1
        return base if used_names[base] == 1 else f"{base}_{used_names[base] - 1}"

    def scope_of(n: fx.Node) -> str:
        if n.meta.get("qsync_loss"):
            return "loss"
        stack = n.meta.get("nn_module_stack") or {}
        return next(reversed(stack.values()))[0] if stack else ""

    class _Interp(fx.Interpreter):
        def expand(self, n: fx.Node, base: str, target: str, tie: Any,
                   run: Callable[[_Expansion, Any, Any], Any]) -> Any:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            producer = {id(t): names[a] for a in n.all_input_nodes if a in names
                        for t in _tensors(self.env[a])}
            step = _Expansion(base, target, rec, raw, producer, unique, param_storages, alive,
                              bool(n.meta.get("qsync_loss")), tie)
            value = run(step, args, kwargs)
            outs = _tensors(value)
            if outs and step.last is not None:
                names[n] = producer.get(id(outs[0]), step.last)
            return value

        def run_node(self, n: fx.Node) -> Any:
            if n.op in ("placeholder", "output", "get_attr"):
                return super().run_node(n)
            if n.op == "call_module" and isinstance(self.fetch_attr(n.target),
                                                    nn.MultiheadAttention):
                mod = self.fetch_attr(n.target)
                return self.expand(n, str(n.target), _class_name(mod), id(mod),
                                   lambda st, a, k: _expand_mha(st, mod, a, k))
            if n.op == "call_function" and n.target is F.scaled_dot_product_attention:
                return self.expand(n, namer.name("sdpa", scope_of(n)), _target_name(n.target),
                                   None, _expand_sdpa)
            rec.current = []
            try:
                with rec.hooks():
                    value = super().run_node(n)
            finally:
                saved, rec.current = rec.current, None
            outs = _tensors(value)
            if not outs:
                return value
            in_nodes = [a for a in n.all_input_nodes if a.op != "get_attr"]
            act_inputs = [self.env[a] for a in in_nodes]
            params = [self.env[a] for a in n.all_input_nodes if a.op == "get_attr"]
            if n.op == "call_module":
                mod = self.fetch_attr(n.target)
                kind = _module_kind(mod)
                name = unique(str(n.target))
                target = _class_name(mod)
                params = list(mod.parameters()) + params
            else:
                mod = None
                kind = _function_kind(n.target) if n.op == "call_function" else _method_kind(
                    str(n.target))
                scope = scope_of(n)
                gemm = gemm_call_kind(n.target if n.op == "call_function" else None,
                                      None if n.op == "call_function" else str(n.target))
                if gemm is not None and not n.meta.get("qsync_loss"):
                    call_args, call_kwargs = self.fetch_args_kwargs_from_env(n)
                    name = unique(namer.name(gemm, scope, (call_args, call_kwargs)))
                else:
                    fname = (getattr(n.target, "__name__", None) or str(n.target)).strip("_")
                    name = unique(f"{scope}.{fname}" if scope else fname)
                target = _target_name(n.target) if n.op == "call_function" else f"Tensor.{n.target}"
            names[n] = name
            raw.append(_RawOp(
                name=name, kind=kind, target=target, module=mod,
                inputs=[(names[a], t) for a in in_nodes if a in names
                        for t in _tensors(self.env[a])[:1]],
                input_tensors=[t for v in act_inputs for t in _tensors(v)],
                outputs=outs, params=[p for p in params if isinstance(p, torch.Tensor)],
                saved=saved, is_loss_part=bool(n.meta.get("qsync_loss")),
            ))
            return value

    meta = _once(_meta_like)
    args: list[Any] = [meta(t) for t in inputs]
    if kwargs:
        # placeholders in graph order: the positional inputs, then the rest by name
        rest = [n for n in gm.graph.nodes if n.op == "placeholder"][len(inputs):]
        for n in rest:
            if n.target == "targets" and loss_fn is not None and targets is not None:
                continue
            key = str(n.target).lstrip("*")
            args.append(meta(kwargs[key]) if key in kwargs
                        else (n.args[0] if n.args else None))
    if loss_fn is not None and targets is not None:
        args.append(_meta_like(targets))
    with torch.nn.utils.stateless._reparametrize_module(gm, state), torch.enable_grad():
        value = _Interp(gm, garbage_collect_values=True).run(*args)
    if sink is not None:
        sink.append(value)
    return raw


# ----------------------------------------------------------------------------- fallback


def _function_mode_raw_ops(
    model: nn.Module,
    inputs: Sequence[torch.Tensor],
    targets: torch.Tensor | None,
    loss_fn: Callable[[Any, Any], Any] | None,
    *,
    kwargs: dict[str, torch.Tensor] | None = None,
    sink: list[Any] | None = None,
    real: bool = False,
) -> list[_RawOp]:
    """Run once on meta tensors (``real``: on the model's own parameters and copies of the
    inputs); leaf modules and top-level torch calls become ops."""
    kwargs = kwargs or {}
    state = _meta_state(model) if not real else {
        n: t for n, t in [*model.named_parameters(remove_duplicate=False),
                          *model.named_buffers(remove_duplicate=False)]}
    like = _real_like if real else _meta_like
    rec = _SavedRecorder()
    raw: list[_RawOp] = []
    producer: dict[int, str] = {}  # id(tensor) -> op name
    alive: list[Any] = []  # keep outputs alive so ids stay unique
    used_names: dict[str, int] = {}
    depth = [0]  # >0 while inside a leaf module
    scope: list[str] = []
    mhas = {m: n for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)}
    leaf_names = {m: n for n, m in model.named_modules()
                  if (isinstance(m, MatMul) or (is_leaf_module(m) and n)) and m not in mhas}
    in_loss = [False]
    namer = CallNamer(_meta_param_names(model, state))
    param_storages = {_storage_id(t) for t in state.values()}

    def unique(base: str) -> str:
        used_names[base] = used_names.get(base, 0) + 1
        return base if used_names[base] == 1 else f"{base}_{used_names[base] - 1}"

    def record(name: str, kind: OpKind, target: str, mod: nn.Module | None, args: Any,
               value: Any, saved: list[torch.Tensor], params: list[torch.Tensor]) -> None:
        outs = _tensors(value)
        if not outs:
            return
        ins = [t for t in _tensors(args) if not isinstance(t, nn.Parameter)
               and id(t) not in param_ids]
        raw.append(_RawOp(
            name=name, kind=kind, target=target, module=mod,
            inputs=[(producer[id(t)], t) for t in ins if id(t) in producer],
            input_tensors=ins, outputs=outs, params=params, saved=saved,
            is_loss_part=in_loss[0],
        ))
        for t in outs:
            producer[id(t)] = name
        alive.append(value)

    param_ids = {id(t) for t in state.values()}

    class _Mode(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if depth[0] > 0 or getattr(func, "__name__", "") in ("size", "dim", "__get__"):
                return func(*args, **kwargs)
            prefix = "loss" if in_loss[0] else (scope[-1] if scope else "")
            gemm = gemm_call_kind(func)
            if gemm == "sdpa":
                step = _Expansion(namer.name("sdpa", prefix), _target_name(func), rec, raw,
                                  producer, unique, param_storages, alive, in_loss[0])
                return _expand_sdpa(step, args, kwargs)
            rec.current = []
            try:
                with rec.hooks():
                    value = func(*args, **kwargs)
            finally:
                saved, rec.current = rec.current, None
            fname = (getattr(func, "__name__", None) or "op").strip("_")
            kind = _function_kind(func)
            if kind == OpKind.other:
                kind = _method_kind(getattr(func, "__name__", ""))
            params = [t for t in _tensors((args, kwargs)) if id(t) in param_ids]
            if gemm is not None and not in_loss[0]:
                name = unique(namer.name(gemm, prefix, (args, kwargs)))
            else:
                name = unique(f"{prefix}.{fname}" if prefix else fname)
            record(name, kind, _target_name(func), None, (args, kwargs), value, saved, params)
            return value

    def pre_hook(mod: nn.Module, args: Any) -> None:
        if depth[0] == 0:
            rec.current = []
        depth[0] += 1

    def post_hook(mod: nn.Module, args: Any, value: Any) -> None:
        depth[0] -= 1
        if depth[0] == 0:
            saved, rec.current = rec.current or [], None
            name = unique(leaf_names[mod])
            record(name, _module_kind(mod), type(mod).__module__ + "." + type(mod).__qualname__,
                   mod, args, value, saved, list(mod.parameters()))

    def scope_pre(name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any) -> None:
            scope.append(name)
        return hook

    def scope_post(mod: nn.Module, args: Any, value: Any) -> None:
        scope.pop()

    def mha_forward(mod: nn.Module, name: str) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            step = _Expansion(name, _class_name(mod), rec, raw, producer, unique,
                              param_storages, alive, in_loss[0], id(mod))
            depth[0] += 1  # the decomposition's own calls are its steps, not more ops
            try:
                return _expand_mha(step, mod, args, kwargs)
            finally:
                depth[0] -= 1
        return forward

    with ExitStack() as stack:
        for mod, name in mhas.items():
            own = mod.__dict__.get("forward")  # an instance's own forward, put back after
            mod.forward = mha_forward(mod, name)  # type: ignore[method-assign]
            stack.callback(lambda m=mod, f=own: (m.__dict__.pop("forward", None), f and
                                                 m.__dict__.__setitem__("forward", f)))
        for mod in leaf_names:
            h1 = mod.register_forward_pre_hook(pre_hook)
            h2 = mod.register_forward_hook(post_hook)
            stack.callback(h1.remove)
            stack.callback(h2.remove)
        for name, mod in model.named_modules():
            if name and mod not in leaf_names and mod not in mhas:
                h1 = mod.register_forward_pre_hook(scope_pre(name))
                h2 = mod.register_forward_hook(scope_post)
                stack.callback(h1.remove)
                stack.callback(h2.remove)
        if not real:
            stack.enter_context(torch.nn.utils.stateless._reparametrize_module(model, state))
        stack.enter_context(torch.enable_grad())
        stack.enter_context(rec.hooks())
        once = _once(like)
        args = [once(t) for t in inputs]
        kw = {k: once(t) for k, t in kwargs.items()}
        meta_targets = like(targets) if targets is not None else None
        with _Mode():
            out = model(*args, **kw)
            if loss_fn is not None and meta_targets is not None:
                in_loss[0] = True
                loss_fn(out, meta_targets)
    if sink is not None:
        sink.append(out)
    return raw


# ----------------------------------------------------------------------------- post-processing


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _flops(op: _RawOp) -> tuple[int, int, list[int] | None]:
    """(forward FLOPs, reduction length K for GEMMs, main weight shape)."""
    out_numel = sum(t.numel() for t in op.outputs)
    mod = op.module
    if op.kind == OpKind.linear:
        if mod is not None and is_conv1d_like(mod):  # weight (in, out): report Linear's (out, in)
            nx, nf = (int(s) for s in mod.weight.shape)
            return 2 * out_numel * nx, nx, [nf, nx]
        w = mod.weight if mod is not None else next(
            (p for p in op.params if p.dim() == 2), None)
        k = int(w.shape[1]) if w is not None else int(op.input_tensors[0].shape[-1])
        return 2 * out_numel * k, k, list(w.shape) if w is not None else None
    if op.kind == OpKind.conv:
        w = mod.weight if mod is not None else (op.params[0] if op.params else None)
        if w is None:
            return out_numel, 0, None
        k = _numel(w.shape[1:])  # Cin/groups * kernel volume
        return 2 * out_numel * k, k, list(w.shape)
    if op.kind == OpKind.matmul:
        if op.input_tensors:
            k = int(op.input_tensors[0].shape[-1])
            return 2 * out_numel * k, k, None
        return out_numel, 0, None
    if op.kind in (OpKind.reshape, OpKind.dropout, OpKind.embedding):
        return 0, 0, list(mod.weight.shape) if isinstance(mod, nn.Embedding) else None
    # Elementwise, norms, softmax, losses, pooling: a few FLOPs per element read.
    per = {OpKind.norm: 5, OpKind.softmax: 5, OpKind.loss: 5}.get(op.kind, 1)
    return per * max(out_numel, sum(t.numel() for t in op.input_tensors)), 0, None


def _snake(target: str) -> str:
    """'torch.nn.modules.batchnorm.BatchNorm2d' -> '...batch_norm2d' (for name checks)."""
    return re.sub(r"(?<=[a-z])(?=[A-Z])", "_", target).lower()


def _no_runtime_layer(op: _RawOp) -> str | None:
    """Why a GEMM the runtime cannot run at another precision is pinned fp32, else None:
    a GEMM of the loss (computed outside the model's forward, where nothing dispatches), a
    functional convolution, a Conv3d (no precision-specific layer)."""
    if op.is_loss_part:
        return "loss GEMM: the loss runs outside the model's forward, in fp32"
    if op.kind == OpKind.conv and op.module is None:
        return "functional convolution: the runtime dispatches F.linear/matmul calls, not convs"
    if op.kind == OpKind.conv and not isinstance(op.module, (nn.Conv1d, nn.Conv2d)):
        return f"{type(op.module).__name__}: no precision-specific layer; runs fp32"
    return None


def _role(kind: OpKind, n_float_inputs: int) -> OpRole:
    if kind in _CHOOSABLE:
        return OpRole.choosable
    if kind in PIN_REASONS:
        return OpRole.pinned
    if kind in (OpKind.elementwise, OpKind.concat) and n_float_inputs >= 2:
        return OpRole.promote
    return OpRole.pass_through


def _build_graph(
    raw: list[_RawOp],
    *,
    workload: str,
    batch: int,
    inputs: list[TensorSpec],
    model: nn.Module,
    method: str,
    pin_head: bool,
    unpin: Sequence[str],
    tie: str,
) -> ModelGraph:
    state_storages = set()
    param_ids: set[int] = set()
    for p in model.parameters():
        param_ids.add(id(p))
    for op in raw:
        for p in op.params:
            state_storages.add(_storage_id(p))
    # Buffers and parameters of leaf modules are read inside them; their storages too.
    for op in raw:
        if op.module is not None:
            for t in list(op.module.parameters()) + list(op.module.buffers()):
                state_storages.add(_storage_id(t))

    names = [o.name for o in raw]
    index = {n: i for i, n in enumerate(names)}
    seen_saved: set[int] = set()
    seen_params: set[tuple[int, int, int]] = set()
    nodes: list[dict[str, Any]] = []
    edges: dict[tuple[str, str], Edge] = {}

    for op in raw:
        saved_bytes = shared = 0
        for t in op.saved:
            sid = _storage_id(t)
            if sid in state_storages:
                continue
            nb = _nbytes(t)
            saved_bytes += nb
            if sid in seen_saved:
                shared += nb
            seen_saved.add(sid)
        own_params = 0
        param_bytes = 0
        for p in op.params:
            param_bytes += _nbytes(p)
            # A parameter read whole or by slices (nn.MultiheadAttention's q/k/v rows of
            # in_proj_weight): each distinct slice counts once, a tied one once in all.
            key = (_storage_id(p), p.storage_offset(), p.numel())
            if key not in seen_params:
                own_params += p.numel()
                seen_params.add(key)
        fwd_flops, _, wshape = _flops(op)
        needs_in = any(t.requires_grad for t in op.input_tensors)
        has_wgrad = any(p.requires_grad for p in op.params)
        if op.kind in _CHOOSABLE:
            # One backward GEMM per input that needs a gradient (weights included).
            if op.kind == OpKind.matmul:
                n_grads = sum(t.requires_grad for t in op.input_tensors)
            else:
                n_grads = int(needs_in) + int(has_wgrad)
            bwd_flops = fwd_flops * n_grads
        else:
            bwd_flops = 2 * fwd_flops if (needs_in or has_wgrad) else 0
        in_numel = sum(t.numel() for t in op.input_tensors)
        out_numel = sum(t.numel() for t in op.outputs)
        fwd_bytes = sum(_nbytes(t) for t in op.input_tensors) + sum(
            _nbytes(t) for t in op.outputs) + param_bytes
        role = _role(op.kind, sum(1 for t in op.input_tensors if t.is_floating_point()))
        if op.kind == OpKind.norm and "batch_norm" in _snake(op.target):
            # Autocast lists batch_norm in neither its fp32 nor its 16-bit list: it runs in its
            # input's dtype (cuDNN keeps the statistics in fp32), so it passes dtypes through.
            role = OpRole.pass_through
        no_runtime = _no_runtime_layer(op) if role == OpRole.choosable else None
        if no_runtime:
            role = OpRole.pinned
        allowed: list[Precision]
        if role == OpRole.choosable:
            allowed = list(CONV_PRECISIONS if op.kind == OpKind.conv else ALL_GEMM_PRECISIONS)
        elif role == OpRole.pinned:
            allowed = [Precision.fp32]
        else:
            allowed = []
        nodes.append(dict(
            name=op.name, kind=op.kind, target=op.target, role=role,
            allowed_precisions=allowed,
            pin_reason=(no_runtime or PIN_REASONS.get(op.kind)) if role == OpRole.pinned else None,
            input_shapes=[list(t.shape) for t in op.input_tensors],
            output_shapes=[list(t.shape) for t in op.outputs],
            weight_shape=wshape, param_count=own_params,
            input_numel=in_numel, output_numel=out_numel,
            fwd_flops=int(fwd_flops), bwd_flops=int(bwd_flops), fwd_bytes=int(fwd_bytes),
            saved_bytes=saved_bytes, saved_shared_bytes=shared,
            needs_input_grad=needs_in, depth=0,
        ))
        for src, t in op.inputs:
            if src in index and index[src] < index[op.name]:
                edges.setdefault((src, op.name), Edge(
                    src=src, dst=op.name, shape=list(t.shape), numel=t.numel(), bytes=_nbytes(t),
                    dtype=str(t.dtype).removeprefix("torch.")))

    # Depth: longest path from the input, counting ops that compute (GEMMs and pinned ops).
    preds: dict[str, list[str]] = {n: [] for n in names}
    succs: dict[str, list[str]] = {n: [] for n in names}
    for s, d in edges:
        preds[d].append(s)
        succs[s].append(d)
    depth: dict[str, int] = {}
    for nd in nodes:
        base = max((depth[p] for p in preds[nd["name"]]), default=0)
        depth[nd["name"]] = base + (1 if nd["kind"] in _COMPUTING_FOR_DEPTH else 0)
        nd["depth"] = depth[nd["name"]]

    # Classifier head: a GEMM from which an output is reached without another GEMM.
    unpin_set = set(unpin)
    if pin_head:
        reaches_out: dict[str, bool] = {}
        for nd in reversed(nodes):
            n = nd["name"]
            clear = [s for s in succs[n] if nodes[index[s]]["role"] != OpRole.choosable]
            reaches_out[n] = not succs[n] or any(reaches_out[s] for s in clear)
        for nd in nodes:
            if nd["role"] == OpRole.choosable and reaches_out[nd["name"]] and nd["name"] not in unpin_set:
                nd["role"] = OpRole.pinned
                nd["allowed_precisions"] = [Precision.fp32]
                nd["pin_reason"] = HEAD_REASON
    unknown = unpin_set - set(names)
    if unknown:
        raise QsyncInputError(f"unpin: no op named {', '.join(sorted(unknown))} in the graph")

    _assign_ties(nodes, preds, tie)
    # A module called more than once is one set of weights the runtime swaps once: its calls
    # always share one decision, whatever the tie mode.
    by_module: dict[Any, list[int]] = {}
    for i, op in enumerate(raw):
        key = op.tie_key if op.tie_key is not None else (
            id(op.module) if op.module is not None else None)
        if key is not None and nodes[i]["role"] == OpRole.choosable:
            by_module.setdefault(key, []).append(i)
    for members in by_module.values():
        if len(members) > 1:
            for i in members:
                nodes[i]["tie_group"] = f"module:{raw[members[0]].name}"
    buffers = {id(b): b for b in model.buffers()}
    params = {id(p): p for p in model.parameters()}
    return ModelGraph(
        workload=workload, batch_size=batch, inputs=inputs,
        ops=[OpNode(**nd) for nd in nodes], edges=list(edges.values()),
        max_depth=max(depth.values(), default=0),
        param_count=sum(p.numel() for p in params.values()),
        param_bytes=sum(p.numel() * 4 for p in params.values() if p.is_floating_point()),
        buffer_bytes=sum(_nbytes(b) for b in buffers.values()),
        trace_method=method, tie_mode=tie, torch_version=torch.__version__,
    )


def unseen_ops(graph: ModelGraph, threshold: float = 0.01) -> list[str]:
    """The ops of kind "other" (computations the planner cannot choose a precision for and
    the cost model only guesses) that hold more than ``threshold`` (1%) of the model's
    parameters or forward FLOPs, one line each: name, target, their shares. :func:`trace`
    logs them as a warning; the CLI's ``graph`` command can print them."""
    total_flops = sum(o.fwd_flops for o in graph.ops) or 1
    total_params = graph.param_count or 1
    out = []
    for o in graph.ops:
        if o.kind != OpKind.other:
            continue
        pf, pp = o.fwd_flops / total_flops, o.param_count / total_params
        if pf > threshold or pp > threshold:
            out.append(f"{o.name} ({o.target}): {100 * pp:.1f}% of the parameters, "
                       f"{100 * pf:.1f}% of the forward FLOPs")
    return out


def _warn_unseen(graph: ModelGraph) -> None:
    lines = unseen_ops(graph)
    if lines:
        log.warning("%s: %d op(s) the planner cannot see inside (kind other, over 1%% of the "
                    "parameters or FLOPs): %s", graph.workload, len(lines), "; ".join(lines))


TIE_MODES = ("none", "blocks", "siblings")


def _assign_ties(nodes: list[dict[str, Any]], preds: dict[str, list[str]], tie: str) -> None:
    if tie not in TIE_MODES:
        raise QsyncInputError(f"tie: expected one of {', '.join(TIE_MODES)}, got {tie!r}")
    if tie == "none":
        return
    groups: dict[str, list[dict[str, Any]]] = {}
    for nd in nodes:
        if nd["role"] != OpRole.choosable:
            continue
        if tie == "blocks":
            key = "blocks:" + re.sub(r"\.\d+(?=\.|$)", ".*", nd["name"]) + str(
                (nd["input_shapes"], nd["output_shapes"], nd["weight_shape"]))
        else:
            src = preds[nd["name"]][0] if preds[nd["name"]] else "<input>"
            key = f"siblings:{src}:{nd['kind'].value}"
        groups.setdefault(key, []).append(nd)
    for key, members in groups.items():
        if len(members) < 2:
            continue
        label = key.split("(")[0].split("[")[0] if tie == "blocks" else key.rsplit(":", 1)[0]
        for nd in members:
            nd["tie_group"] = label


# ----------------------------------------------------------------------------- public API


def is_user_model(spec: str) -> bool:
    """True when ``spec`` names a user's Python file (``path/file.py:fn``), which importing
    runs; anything else is a registry name (qsync-opt models), which runs only our code."""
    path_s, sep, fn_name = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
    return bool(sep) and path_s.endswith(".py")


def model_file_sha256(spec: str) -> str:
    """sha256 (hex) of the file a ``path/file.py:fn`` spec names; reading it runs nothing."""
    from .user_model import model_file_sha256 as digest

    return digest(spec)


def load_user_workload(spec: str, *, sha256: str | None = None) -> UserWorkload:
    """``path/file.py:fn`` as a :class:`~qsync_opt.user_model.UserWorkload` (this RUNS the
    file; with ``sha256`` its content must have that hash, checked before it runs)."""
    from .user_model import load_user_workload as load

    return load(spec, sha256)


def load_user_model(spec: str, *, sha256: str | None = None
                    ) -> tuple[nn.Module, tuple[torch.Tensor, ...] | dict[str, torch.Tensor]]:
    """Import ``path/file.py:fn`` (this RUNS the file) and call ``fn()``, which returns
    ``(module, example_inputs)``: the module and its inputs (a tuple of positional tensors,
    or a dict of keyword tensors). With ``sha256``, the file must have that content hash,
    checked before it runs."""
    wl = load_user_workload(spec, sha256=sha256)
    ex = wl.example
    return wl.model, ((ex,) if isinstance(ex, torch.Tensor) else ex)


def resolve_workload(name: str, *, sha256: str | None = None) -> Workload | UserWorkload:
    """A registry name, or ``path.py:fn`` for a user's model (imported: it runs), as a
    workload object (:class:`Workload` or :class:`~qsync_opt.user_model.UserWorkload`)."""
    if is_user_model(name):
        return load_user_workload(name, sha256=sha256)
    try:
        return get_workload(name)
    except (KeyError, ValueError) as exc:
        raise QsyncInputError(f"model: {exc.args[0] if exc.args else exc}") from None


def _input_specs(inputs: Any) -> list[TensorSpec]:
    args, kwargs = split_inputs(inputs)
    named = [(f"input{i}", t) for i, t in enumerate(args)] + list(kwargs.items())
    return [TensorSpec(name=n, shape=list(t.shape), dtype=str(t.dtype).replace("torch.", ""))
            for n, t in named]


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return f"{exc.__class__.__name__}: {text.splitlines()[0] if text else ''}"


def trace(
    workload: str | Workload | UserWorkload | nn.Module,
    batch: int | None = None,
    *,
    example_inputs: Any = None,
    include_loss: bool = True,
    pin_head: bool = True,
    unpin: Sequence[str] = (),
    tie: str = "none",
    name: str | None = None,
    method: str = "auto",
    model_sha256: str | None = None,
) -> ModelGraph:
    """Trace a workload into a :class:`ModelGraph` without allocating real memory.

    ``workload`` is a registry name (``qsync-opt models``), ``path/file.py:fn`` (a user's
    model file, :mod:`qsync_opt.user_model`), a :class:`Workload`, a
    :class:`~qsync_opt.user_model.UserWorkload`, or an ``nn.Module`` with ``example_inputs``
    (a Tensor, a tuple of positional tensors, or a dict of keyword tensors). ``batch``
    overrides the batch (default: a registry workload's default batch, a user file's example
    batch; a user file at another batch is traced on synthetic inputs shaped like its
    example); an ``nn.Module`` is traced at its example inputs' batch. ``method`` is ``auto``
    (fx, then the function-mode fallback), ``fx`` or ``function_mode``. Where tracing on
    meta tensors fails (a model that reads its inputs' values, as HuggingFace BERT does with
    an attention mask) and the model and inputs are real, ``auto`` traces in function mode on
    real tensors of the example's shapes (``trace_method`` ``function_mode_real``). A
    ``path/file.py:fn`` workload is imported, which runs that file; with ``model_sha256`` the
    file must have that content hash, checked before it runs. The graph records the file's
    hash (``workload_sha256``), and so do the plans made from it. Graph input specs name
    keyword inputs by their keys (positional ones ``input0``, ...).
    """
    from .user_model import UserWorkload

    loss_fn: Callable[[Any, Any], Any] | None = None
    targets: torch.Tensor | None = None
    file_sha256: str | None = None
    user: UserWorkload | None = None
    if isinstance(workload, str) and is_user_model(workload):
        workload = load_user_workload(workload, sha256=model_sha256)
    elif isinstance(workload, str):
        label = name or workload
        workload = resolve_workload(workload)
        name = label
    if isinstance(workload, UserWorkload):
        user = workload
        label = name or user.name
        file_sha256 = user.sha256
        model = user.model
        b = batch if batch is not None else user.default_batch
        if b < 1:
            raise QsyncInputError(f"batch: expected a positive integer, got {b}")
        inputs: Any = user.example if b == user.default_batch else user.make_inputs(b, "cpu")
    elif isinstance(workload, Workload):
        wl = workload
        label = name or wl.name
        b = batch if batch is not None else wl.default_batch
        if b < 1:
            raise QsyncInputError(f"batch: expected a positive integer, got {b}")
        with torch.device("meta"):
            model = wl.build()
        meta = torch.device("meta")
        inputs = tuple(wl.make_inputs(b, meta))
        if include_loss:
            targets = wl.make_targets(b, meta)
            from .models import compute_loss

            loss_fn = lambda out, tgt, _wl=wl: compute_loss(_wl, out, tgt)  # noqa: E731
    else:
        model = workload
        label = name or type(workload).__name__
        ex = example_inputs
        if ex is None:
            raise QsyncInputError("example_inputs: required when tracing an nn.Module")
        if isinstance(ex, dict):
            inputs = dict(ex)
        else:
            inputs = (ex,) if isinstance(ex, torch.Tensor) else tuple(ex)
        flat = list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
        if not flat:
            raise QsyncInputError("example_inputs: expected at least one tensor")
        if not all(isinstance(t, torch.Tensor) for t in flat):
            raise QsyncInputError("example_inputs: expected tensors (a Tensor, a tuple or a "
                                  "dict of them)")
        b = next((int(t.shape[0]) for t in flat if t.dim() > 0), 1)
        if batch is not None and batch != b:
            raise QsyncInputError(
                f"batch: an nn.Module is traced at its example inputs' batch ({b}), not {batch}")
    specs = _input_specs(inputs)
    if method not in ("auto", "fx", "function_mode"):
        raise QsyncInputError(f"method: expected auto, fx or function_mode, got {method!r}")
    args, kwargs = split_inputs(inputs)
    was_training = model.training
    model.train()
    errors: list[str] = []
    raw: list[_RawOp] | None = None
    used = method
    outputs: list[Any] = []
    try:
        if method in ("auto", "fx"):
            try:
                raw = _fx_raw_ops(model, args, targets, loss_fn, kwargs=kwargs, sink=outputs)
                used = "fx"
            except Exception as exc:  # any tracer failure falls back, with its reason kept
                errors.append(f"torch.fx: {_first_line(exc)}")
                log.info("fx tracing of %s failed (%s); falling back", label, errors[-1])
                if method == "fx":
                    raise TraceError(f"cannot trace {label}: {errors[-1]}") from None
        if raw is None:
            try:
                raw = _function_mode_raw_ops(model, args, targets, loss_fn, kwargs=kwargs,
                                             sink=outputs)
                used = "function_mode"
            except Exception as exc:
                errors.append(f"function mode: {_first_line(exc)}")
                real = method == "auto" and _all_real(model, args, kwargs)
                if not real:
                    raise TraceError(f"cannot trace {label}: " + "; ".join(errors)) from None
        if raw is None:
            # The model reads its inputs' values (a mask checked with .item(), say): meta
            # tensors have none, so it runs once on real tensors of the example's shapes.
            try:
                raw = _function_mode_raw_ops(model, args, targets, loss_fn, kwargs=kwargs,
                                             sink=outputs, real=True)
                used = "function_mode_real"
                log.info("%s: traced on real tensors (meta tracing failed: %s)", label,
                            errors[-1].removeprefix("function mode: "))
            except Exception as exc:
                errors.append(f"function mode on real tensors: {_first_line(exc)}")
                raise TraceError(f"cannot trace {label}: " + "; ".join(errors)) from None
    finally:
        model.train(was_training)
    if not raw:
        raise TraceError(f"cannot trace {label}: the model ran no operators")
    if user is not None and outputs:
        user.example_outputs = outputs[0]
    graph = _build_graph(raw, workload=label, batch=b, inputs=specs, model=model, method=used,
                         pin_head=pin_head, unpin=unpin, tie=tie)
    _warn_unseen(graph)
    return graph.model_copy(update={"workload_sha256": file_sha256}) if file_sha256 else graph


def _all_real(model: nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Every parameter, buffer and input holds data (none is on the meta device)."""
    tensors = [*model.parameters(), *model.buffers(), *_tensors((list(args), kwargs))]
    return all(t.device.type != "meta" for t in tensors)
