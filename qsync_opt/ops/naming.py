"""Op names: one rule (:class:`CallNamer`) for both tracers and the runtime dispatcher."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

from qsync_opt.documents.schemas import OpKind
from qsync_opt.ops.kinds import function_kind, method_kind

#: The functional calls the runtime dispatches per call (and the tracers name alike).
_GEMM_CALL_KINDS = {OpKind.linear: "linear", OpKind.matmul: "matmul"}


def gemm_call_kind(func: object, method: str | None = None) -> str | None:
    """``"linear"``, ``"matmul"`` or ``"sdpa"`` for a functional GEMM or attention call
    (``func`` a torch function, or ``method`` the name of a Tensor method), else None."""
    if func is F.scaled_dot_product_attention:
        return "sdpa"
    kind = function_kind(func) if func is not None else OpKind.other
    if kind == OpKind.other:
        name = method if method is not None else getattr(func, "__name__", "")
        kind = method_kind(name.strip("_") if name in ("__matmul__", "__rmatmul__") else name)
    return _GEMM_CALL_KINDS.get(kind)


class UniqueNames:
    """The one rule for a name used again, in both tracers and :class:`CallNamer`: ``base``
    the first time, then ``base_1``, ``base_2``... in order of use."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def __call__(self, base: str) -> str:
        n = self.counts.get(base, 0)
        self.counts[base] = n + 1
        return base if n == 0 else f"{base}_{n}"

    def reset(self) -> None:
        self.counts.clear()


class CallNamer:
    """Op names of functional GEMM and attention calls, one rule for both tracers and the
    runtime dispatcher (:mod:`qsync_opt.ops.dispatch`), so a plan's names always match.

    A call reading a parameter (``F.linear(x, self.qkv_w)``, ``x @ self.w``) is named by that
    parameter's full name (``blocks.0.attn.qkv_w``); other calls by their module scope, the
    call's kind and order: ``blocks.0.attn.matmul``, ``blocks.0.attn.matmul_1``, and
    ``blocks.0.attn.sdpa`` for ``F.scaled_dot_product_attention`` (whose sub-ops are
    ``<that>.qk`` and ``<that>.av``). A repeated name gets ``_1``, ``_2``... in call order;
    :meth:`reset` starts a new forward.
    """

    def __init__(self, param_names: dict[int, str]) -> None:
        self.param_names = param_names
        self.unique = UniqueNames()

    def reset(self) -> None:
        self.unique.reset()

    def name(self, kind: str, scope: str, args: object = ()) -> str:
        base = None
        if kind != "sdpa":
            flat = tensors_of(args)
            # F.linear's weight names the call before its input does.
            order = ([flat[1]] + flat[:1] + flat[2:]) if kind == "linear" and len(flat) > 1 else flat
            base = next((self.param_names[id(t)] for t in order if id(t) in self.param_names),
                        None)
        if base is None:
            base = f"{scope}.{kind}" if scope else kind
        return self.unique(base)


def target_name(fn: object) -> str:
    name = getattr(fn, "__name__", None) or str(fn)
    mod = getattr(fn, "__module__", None)
    if fn in (operator.getitem,) or mod == "_operator":
        return f"operator.{name}"
    return f"{mod}.{name}" if mod else name


def class_name(mod: nn.Module) -> str:
    return type(mod).__module__ + "." + type(mod).__qualname__


def tensors_of(value: object) -> list[torch.Tensor]:
    flat, _ = tree_flatten(value)
    return [t for t in flat if isinstance(t, torch.Tensor)]
