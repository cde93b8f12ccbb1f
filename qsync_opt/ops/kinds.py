"""What kind of op a module, a function or a Tensor method is, and which modules are leaves."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qsync_opt.documents.schemas import OpKind
from qsync_opt.models.layers import MatMul

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


def module_kind(mod: nn.Module) -> OpKind:
    if is_conv1d_like(mod):
        return OpKind.linear
    for types, kind in _MODULE_KINDS:
        if isinstance(mod, types):
            return kind
    return OpKind.other


def function_kind(fn: object) -> OpKind:
    if fn in _FUNCTION_KINDS:
        return _FUNCTION_KINDS[fn]
    if fn in _RESHAPE_FUNCTIONS:
        return OpKind.reshape
    return OpKind.other


def method_kind(name: str) -> OpKind:
    if name in _METHOD_KINDS:
        return _METHOD_KINDS[name]
    if name in _RESHAPE_METHODS:
        return OpKind.reshape
    return OpKind.other
