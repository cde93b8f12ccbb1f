"""Op builders: one traced op rebuilt as a callable on random inputs of its traced
shapes (its module, swapped to a precision, or its function), or why it cannot be."""

from __future__ import annotations

import copy
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qsync_opt.core.precision import Precision
from qsync_opt.documents.schemas import ModelGraph, OpKind, OpNode, OpRole
from qsync_opt.ops.layers import apply_precisions

_VIEWS = {"view", "reshape", "flatten", "unflatten", "transpose", "permute", "getitem", "narrow",
          "split", "chunk", "squeeze", "unsqueeze", "expand", "t"}


_PASS_DTYPE = {Precision.fp32: torch.float32, Precision.tf32: torch.float32,
               Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}


def _resolve_function(target: str) -> Callable[..., Any] | None:
    head, _, name = target.rpartition(".")
    roots: dict[str, Any] = {"operator": operator, "torch": torch, "torch.nn.functional": F,
                             "Tensor": torch.Tensor, "torch.Tensor": torch.Tensor}
    root = roots.get(head)
    fn = getattr(root, name, None) if root is not None else None
    return fn if callable(fn) else None


def _edge_dtypes(graph: ModelGraph) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for e in graph.edges:
        out.setdefault(e.dst, []).append(e.dtype)
    return out


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 1


class OpBuilder:
    """Rebuilds one op as ``(callable, input factory)``, or says why it cannot."""

    def __init__(self, model: nn.Module, graph: ModelGraph, device: torch.device) -> None:
        self.modules = dict(model.named_modules())
        self.edge_dtypes = _edge_dtypes(graph)
        self.device = device
        self.gen = torch.Generator(device="cpu").manual_seed(0)

    def _float(self, shape: Sequence[int], dtype: torch.dtype, grad: bool) -> torch.Tensor:
        t = torch.randn(list(shape), generator=self.gen).to(self.device, dtype)
        return t.requires_grad_(grad)

    def _index(self, shape: Sequence[int], high: int) -> torch.Tensor:
        return torch.randint(0, max(high, 1), list(shape), generator=self.gen).to(self.device)

    def build(self, op: OpNode, p: Precision
              ) -> tuple[Callable[[], Any], str] | tuple[None, str]:
        """``(run, signature)`` or ``(None, reason)``."""
        dtype = _PASS_DTYPE.get(p, torch.float32) if op.role != OpRole.choosable else torch.float32
        grad = op.needs_input_grad
        mod = self.modules.get(op.name)
        if mod is not None and not isinstance(mod, (nn.Sequential, nn.ModuleList)) and \
                op.name != "":
            return self._module(op, p, mod, dtype, grad)
        return self._function(op, dtype, grad)

    def _module(self, op: OpNode, p: Precision, mod: nn.Module, dtype: torch.dtype, grad: bool
                ) -> tuple[Callable[[], Any], str] | tuple[None, str]:
        m = copy.deepcopy(mod).to(self.device).train()
        if op.role == OpRole.choosable:
            holder = nn.Module()
            holder.add_module("m", m)
            apply_precisions(holder, {"m": p})
            m = holder.get_submodule("m")
        if isinstance(m, nn.Embedding):
            inputs = [self._index(s, m.num_embeddings) for s in op.input_shapes]
        elif isinstance(m, (nn.CrossEntropyLoss, nn.NLLLoss)) and len(op.input_shapes) == 2:
            logits = self._float(op.input_shapes[0], dtype, grad)
            classes = op.input_shapes[0][1] if len(op.input_shapes[0]) > 1 else 2
            inputs = [logits, self._index(op.input_shapes[1], classes)]
        else:
            inputs = [self._float(s, dtype, grad) for s in op.input_shapes]
        sig = f"{m!r}|{type(m).__name__}|{op.input_shapes}|{op.needs_input_grad}|{p.value}"
        return (lambda: m(*inputs)), sig

    def _function(self, op: OpNode, dtype: torch.dtype, grad: bool
                  ) -> tuple[Callable[[], Any], str] | tuple[None, str]:
        shapes = op.input_shapes
        sig = f"{op.kind.value}|{op.target}|{shapes}|{op.output_shapes}|{grad}|{dtype}"
        name = op.target.rpartition(".")[2]
        outs = op.output_shapes
        if (op.kind == OpKind.reshape or name in _VIEWS) and outs:
            # A view of the first input (a buffer when the op has none) with the traced
            # output shapes: reshapes, splits, getitem, narrow, transpose and unflatten all
            # cost a dispatch and a view here (a copy a later op forces is not seen).
            n_outs = [_numel(o) for o in outs]
            x = self._float(shapes[0] if shapes else [sum(n_outs)], dtype, grad and bool(shapes))
            if _numel(x.shape) >= sum(n_outs) and len(outs) > 1:
                return (lambda: tuple(t.view(o) for t, o in zip(
                    x.reshape(-1)[:sum(n_outs)].split(n_outs), outs, strict=True))), sig
            if _numel(x.shape) >= n_outs[0] and len(outs) == 1:
                return (lambda: x.reshape(-1)[:n_outs[0]].view(outs[0])), sig
        fn = _resolve_function(op.target)
        if fn is None or not shapes:
            return None, f"cannot rebuild {op.target} with inputs {shapes}"
        dtypes = self.edge_dtypes.get(op.name, [])
        if op.kind == OpKind.loss and "cross_entropy" in name and len(shapes) == 2:
            logits = self._float(shapes[0], dtype, grad)
            classes = shapes[0][1] if len(shapes[0]) > 1 else 2
            tgt = self._index(shapes[1], classes)
            return (lambda: fn(logits, tgt)), sig
        if name == "masked_fill" and len(shapes) == 2:
            x = self._float(shapes[0], dtype, grad)
            mask = torch.rand(shapes[1], generator=self.gen).to(self.device) > 0.5
            return (lambda: fn(x, mask, -1e4)), sig
        if dtypes and all(d == "bool" for d in dtypes) and len(dtypes) == len(shapes):
            bs = [torch.rand(sh, generator=self.gen).to(self.device) > 0.5 for sh in shapes]
            return (lambda: fn(*bs)), sig
        if any(d not in ("float32", "float16", "bfloat16", "float64") for d in dtypes):
            return None, f"{op.target} takes non-float inputs"
        xs = [self._float(s, dtype, grad) for s in shapes]
        if name in ("softmax", "log_softmax"):
            return (lambda: fn(xs[0], -1)), sig
        if len(xs) == 1 and name in ("add", "mul", "sub", "truediv", "div", "iadd", "imul"):
            return (lambda: fn(xs[0], 0.5)), sig
        return (lambda: fn(*xs)), sig


def check_shapes(out: object, op: OpNode) -> bool:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    shapes = [list(o.shape) for o in outs if isinstance(o, torch.Tensor)]
    return shapes == op.output_shapes
