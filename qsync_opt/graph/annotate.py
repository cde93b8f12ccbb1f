"""Raw ops -> :class:`ModelGraph`: kinds, roles and pins, FLOPs, bytes, saved
activations, depths, the classifier head pin, tie groups (the vocabulary and the unseen
ops: :mod:`.roles`)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.documents.schemas import Edge, ModelGraph, OpKind, OpNode, OpRole, TensorSpec
from qsync_opt.graph.recording import RawOp, storage_id
from qsync_opt.graph.roles import (
    ALL_GEMM_PRECISIONS,
    CONV_PRECISIONS,
    HEAD_REASON,
    PIN_REASONS,
    TIE_MODES,
)
from qsync_opt.ops.kinds import is_conv1d_like

log = logging.getLogger("qsync_opt.graph")  # one logger for the whole package




_CHOOSABLE = {OpKind.linear, OpKind.conv, OpKind.matmul}


_COMPUTING_FOR_DEPTH = _CHOOSABLE | set(PIN_REASONS)


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _weight(mod: nn.Module) -> torch.Tensor:
    """A GEMM module's ``weight`` (nn.Module's ``__getattr__`` types it Tensor | Module)."""
    w = mod.weight
    assert isinstance(w, torch.Tensor), f"{type(mod).__name__}.weight is not a tensor"
    return w


def _flops(op: RawOp) -> tuple[int, int, list[int] | None]:
    """(forward FLOPs, reduction length K for GEMMs, main weight shape)."""
    out_numel = sum(t.numel() for t in op.outputs)
    mod = op.module
    if op.kind == OpKind.linear:
        if mod is not None and is_conv1d_like(mod):  # weight (in, out): report Linear's (out, in)
            nx, nf = (int(s) for s in _weight(mod).shape)
            return 2 * out_numel * nx, nx, [nf, nx]
        w: torch.Tensor | None = _weight(mod) if mod is not None else next(
            (p for p in op.params if p.dim() == 2), None)
        k = int(w.shape[1]) if w is not None else int(op.input_tensors[0].shape[-1])
        return 2 * out_numel * k, k, list(w.shape) if w is not None else None
    if op.kind == OpKind.conv:
        w = _weight(mod) if mod is not None else (op.params[0] if op.params else None)
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


def _no_runtime_layer(op: RawOp) -> str | None:
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


def _state_storages(raw: list[RawOp]) -> set[int]:
    """Storages of parameters and buffers: the parameters each op reads, and those of leaf
    modules (read inside them)."""
    state_storages = set()
    for op in raw:
        for p in op.params:
            state_storages.add(storage_id(p))
    for op in raw:
        if op.module is not None:
            for t in list(op.module.parameters()) + list(op.module.buffers()):
                state_storages.add(storage_id(t))
    return state_storages


def _saved_bytes(op: RawOp, state_storages: set[int], seen_saved: set[int]) -> tuple[int, int]:
    """The activation bytes ``op`` saves for backward, and the part of them an earlier op
    already saved (``seen_saved``, updated)."""
    saved_bytes = shared = 0
    for t in op.saved:
        sid = storage_id(t)
        if sid in state_storages:
            continue
        nb = _nbytes(t)
        saved_bytes += nb
        if sid in seen_saved:
            shared += nb
        seen_saved.add(sid)
    return saved_bytes, shared


def _own_params(op: RawOp, seen_params: set[tuple[int, int, int]]) -> tuple[int, int]:
    """The parameters ``op`` owns (not counted by an earlier op; ``seen_params`` updated) and
    the bytes of all the parameters it reads."""
    own_params = 0
    param_bytes = 0
    for p in op.params:
        param_bytes += _nbytes(p)
        # A parameter read whole or by slices (nn.MultiheadAttention's q/k/v rows of
        # in_proj_weight): each distinct slice counts once, a tied one once in all.
        piece = (storage_id(p), int(p.storage_offset()), p.numel())
        if piece not in seen_params:
            own_params += p.numel()
            seen_params.add(piece)
    return own_params, param_bytes


def _bwd_flops(op: RawOp, fwd_flops: int, needs_in: bool) -> int:
    """Backward FLOPs: one GEMM per input that needs a gradient (weights included) for a
    choosable kind, else twice the forward where anything needs a gradient."""
    has_wgrad = any(p.requires_grad for p in op.params)
    if op.kind in _CHOOSABLE:
        if op.kind == OpKind.matmul:
            n_grads = sum(t.requires_grad for t in op.input_tensors)
        else:
            n_grads = int(needs_in) + int(has_wgrad)
        return fwd_flops * n_grads
    return 2 * fwd_flops if (needs_in or has_wgrad) else 0


def _role_menu(op: RawOp) -> tuple[OpRole, list[Precision], str | None]:
    """The op's role, its allowed precisions and, pinned, why."""
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
    pin_reason = (no_runtime or PIN_REASONS.get(op.kind)) if role == OpRole.pinned else None
    return role, allowed, pin_reason


def _node(op: RawOp, state_storages: set[int], seen_saved: set[int],
          seen_params: set[tuple[int, int, int]]) -> dict[str, Any]:
    """The fields of ``op``'s :class:`OpNode` (depth 0: set once the edges are known)."""
    saved_bytes, shared = _saved_bytes(op, state_storages, seen_saved)
    own_params, param_bytes = _own_params(op, seen_params)
    fwd_flops, _, wshape = _flops(op)
    fwd_flops = max(fwd_flops, op.hidden_flops)  # an opaque function: what it really does
    needs_in = any(t.requires_grad for t in op.input_tensors)
    bwd_flops = _bwd_flops(op, fwd_flops, needs_in)
    in_numel = sum(t.numel() for t in op.input_tensors)
    out_numel = sum(t.numel() for t in op.outputs)
    fwd_bytes = sum(_nbytes(t) for t in op.input_tensors) + sum(
        _nbytes(t) for t in op.outputs) + param_bytes
    role, allowed, pin_reason = _role_menu(op)
    return dict(
        name=op.name, kind=op.kind, target=op.target, role=role,
        allowed_precisions=allowed,
        pin_reason=pin_reason,
        input_shapes=[list(t.shape) for t in op.input_tensors],
        output_shapes=[list(t.shape) for t in op.outputs],
        weight_shape=wshape, param_count=own_params,
        input_numel=in_numel, output_numel=out_numel,
        fwd_flops=int(fwd_flops), bwd_flops=int(bwd_flops), fwd_bytes=int(fwd_bytes),
        saved_bytes=saved_bytes, saved_shared_bytes=shared,
        needs_input_grad=needs_in, depth=0, hidden_gemms=op.hidden_gemms,
    )


def _add_edges(op: RawOp, index: dict[str, int], edges: dict[tuple[str, str], Edge]) -> None:
    """The edges into ``op`` from earlier ops, first one per pair kept."""
    for src, t in op.inputs:
        if src in index and index[src] < index[op.name]:
            edges.setdefault((src, op.name), Edge(
                src=src, dst=op.name, shape=list(t.shape), numel=t.numel(), bytes=_nbytes(t),
                dtype=str(t.dtype).removeprefix("torch.")))


def _set_depths(names: list[str], nodes: list[dict[str, Any]],
                edges: dict[tuple[str, str], Edge]
                ) -> tuple[dict[str, list[str]], dict[str, list[str]], dict[str, int]]:
    """Each node's depth: the longest path from the input, counting ops that compute (GEMMs
    and pinned ops). Returns the predecessors, the successors and the depths."""
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
    return preds, succs, depth


def _pin_head(raw: list[RawOp], nodes: list[dict[str, Any]], succs: dict[str, list[str]],
              index: dict[str, int], pin_head: bool, unpin: Sequence[str]) -> None:
    """Pin the classifier head fp32 (``pin_head``), but for the ops ``unpin`` names; an
    unpin naming no op is refused."""
    unpin_set = set(unpin)
    if pin_head:
        for n in head_ops(raw, nodes, succs):
            if n not in unpin_set:
                nd = nodes[index[n]]
                nd["role"] = OpRole.pinned
                nd["allowed_precisions"] = [Precision.fp32]
                nd["pin_reason"] = HEAD_REASON
    unknown = unpin_set - set(index)
    if unknown:
        raise QsyncInputError(f"unpin: no op named {', '.join(sorted(unknown))} in the graph")


def _tie_module_calls(raw: list[RawOp], nodes: list[dict[str, Any]]) -> None:
    """A module called more than once is one set of weights the runtime swaps once: its calls
    always share one decision, whatever the tie mode."""
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


def build_graph(
    raw: list[RawOp],
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
    state_storages = _state_storages(raw)
    names = [o.name for o in raw]
    index = {n: i for i, n in enumerate(names)}
    seen_saved: set[int] = set()
    seen_params: set[tuple[int, int, int]] = set()
    nodes: list[dict[str, Any]] = []
    edges: dict[tuple[str, str], Edge] = {}
    for op in raw:
        nodes.append(_node(op, state_storages, seen_saved, seen_params))
        _add_edges(op, index, edges)
    preds, succs, depth = _set_depths(names, nodes, edges)
    _pin_head(raw, nodes, succs, index, pin_head, unpin)
    _assign_ties(nodes, preds, tie)
    _tie_module_calls(raw, nodes)
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


def head_ops(raw: list[RawOp], nodes: list[dict[str, Any]],
             succs: dict[str, list[str]]) -> list[str]:
    """The classifier head: the choosable GEMMs after the last merge of the residual stream,
    that is, those from which an output (an op nothing reads) is reached through neither
    another GEMM nor a merge. A merge, for a GEMM ``g``, is an op with a gradient-carrying
    input that does not come from ``g`` through GEMM-free paths: a residual add joining the
    skip path (``x + f(x)`` after ``g`` = the last GEMM of ``f``), a gate. Inputs without a
    gradient (targets, masks) and inputs computed from ``g`` alone (``h * sigmoid(h)``) are
    no merge. A model ending in its residual stream (a backbone, a feature extractor) has
    no head; a classifier or LM head after the last norm is one."""
    index = {nd["name"]: i for i, nd in enumerate(nodes)}
    gemm = {nd["name"] for nd in nodes if nd["role"] == OpRole.choosable}
    heads = []
    for nd in nodes:
        g = nd["name"]
        if g not in gemm:
            continue
        # GEMM-free descendants of g (g included): what g alone computes.
        mine, todo = {g}, [g]
        while todo:
            for s in succs[todo.pop()]:
                if s not in mine and s not in gemm:
                    mine.add(s)
                    todo.append(s)

        def merges(n: str, _mine: set[str] = mine) -> bool:
            op = raw[index[n]]
            from_ops = {id(t): src for src, t in op.inputs}
            return any(t.requires_grad and from_ops.get(id(t)) not in _mine
                       for t in op.input_tensors)

        seen, todo, head = {g}, [g], False
        while todo and not head:
            n = todo.pop()
            if not succs[n]:
                head = True
            for s in succs[n]:
                if s not in seen and s not in gemm and not merges(s):
                    seen.add(s)
                    todo.append(s)
        if head:
            heads.append(g)
    return heads




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
