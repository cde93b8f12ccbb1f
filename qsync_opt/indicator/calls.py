"""Every choosable GEMM call of one forward, named as the tracers name it, for the indicator.

The indicator measures each op on the operands it really sees. A GEMM module's call is
caught by a forward hook; the k-th call of one module in a forward is the op ``name`` for
k = 0, ``name_k`` after (the tracers' :class:`~qsync_opt.ops.naming.UniqueNames` rule). A
functional call (``F.linear``, ``matmul``/``bmm``/``mm``/``@``, ``einsum``, ``baddbmm``)
outside the leaf modules is caught by a ``TorchFunctionMode`` and named by
:class:`~qsync_opt.graph.CallNamer` in its module scope, as the runtime dispatcher names it;
``F.scaled_dot_product_attention`` runs decomposed (:func:`qsync_opt.ops.attention.sdpa_forward`)
so its ``<call>.qk`` and ``<call>.av`` are caught, and ``nn.MultiheadAttention`` likewise
(:func:`qsync_opt.ops.attention.mha_forward`: ``<module>.in_proj``, ``.qk``, ``.av``,
``.out_proj``, ...). The decomposed attention computes what the fused one does (tests hold
it), and it is what the runtime runs when a plan lowers those ops.

Each call is kept as a :class:`Call`: its bilinear form ``f(a, b)`` (so the error model
applies unchanged), the live operands and output, and, when ``grads``, the output gradient
from a tensor hook.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from qsync_opt.documents.schemas import OpKind
from qsync_opt.graph import CallNamer, gemm_call_kind, is_conv1d_like, is_leaf_module
from qsync_opt.models.layers import MatMul
from qsync_opt.ops.attention import mha_forward, sdpa_forward
from qsync_opt.ops.naming import UniqueNames


@dataclass
class Bilinear:
    """An op's bilinear form ``y = f(a, b)``; ``b_is_weight``: ``b`` is a weight (scaled per
    output channel, not sliced by sample)."""

    f: Callable[[Tensor, Tensor], Tensor]
    b_is_weight: bool
    channel_dim: int = -1  # the output's channel axis (1 for convolutions)
    groups: int = 1  # a convolution's groups (its weight's input columns are per group)

    def grad_a(self, a_shape: Sequence[int], b: Tensor, cot: Tensor) -> Tensor:
        a0 = torch.zeros(a_shape, dtype=cot.dtype, requires_grad=True)
        with torch.enable_grad():
            return torch.autograd.grad(self.f(a0, b), a0, cot)[0]

    def grad_b(self, a: Tensor, b_shape: Sequence[int], cot: Tensor) -> Tensor:
        b0 = torch.zeros(b_shape, dtype=cot.dtype, requires_grad=True)
        with torch.enable_grad():
            return torch.autograd.grad(self.f(a, b0), b0, cot)[0]


def _linear(a: Tensor, b: Tensor) -> Tensor:
    return F.linear(a, b)


def module_bilinear(mod: nn.Module) -> Bilinear | None:
    """The bilinear form of a GEMM module's call (None: not a GEMM module the runtime
    lowers). A HuggingFace Conv1D (``x @ W``, W (in, out)) is taken as the Linear it is,
    on ``W^T``."""
    if isinstance(mod, nn.Linear) or is_conv1d_like(mod):
        return Bilinear(_linear, True)
    if isinstance(mod, nn.Conv2d):
        st, pad, dil, grp = mod.stride, mod.padding, mod.dilation, mod.groups
        return Bilinear(lambda a, b: F.conv2d(a, b, None, st, pad, dil, grp), True, 1, grp)
    if isinstance(mod, nn.Conv1d):
        st1, pad1, dil1, grp1 = mod.stride, mod.padding, mod.dilation, mod.groups
        return Bilinear(lambda a, b: F.conv1d(a, b, None, st1, pad1, dil1, grp1), True, 1, grp1)
    if isinstance(mod, MatMul):
        return Bilinear(torch.matmul, False)
    return None


@dataclass
class Call:
    """One call of one op: its form, live operands ``a``, ``b`` and output ``y``, the
    parameter ``b`` reads (``weight``, None for two activations), and the output gradient
    ``g`` (detached, float) once backward has run."""

    name: str
    bl: Bilinear
    a: Tensor
    b: Tensor
    y: Tensor
    weight: Tensor | None
    g: Tensor | None = None


def _float_tensor(t: object) -> bool:
    return isinstance(t, Tensor) and t.is_floating_point()


def functional_form(kind: str, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
                    ) -> tuple[Tensor, Tensor, Bilinear] | None:
    """(a, b, form) of a functional GEMM call, or None when it has no two float operands."""
    if kind == "linear":
        vals = list(args) + [kwargs.get(k) for k in ("input", "weight")[len(args):]]
        x, w = (vals + [None, None])[:2]
        if not (_float_tensor(x) and _float_tensor(w)):
            return None
        return x, w, Bilinear(_linear, True)
    name = getattr(func, "__name__", "")
    ops: list[Any]
    if name == "einsum":
        eq, rest_args = args[0], list(args[1:])
        ops = list(rest_args[0]) if len(rest_args) == 1 and isinstance(
            rest_args[0], (list, tuple)) else rest_args
        if len(ops) < 2 or not (_float_tensor(ops[0]) and _float_tensor(ops[1])):
            return None
        more = ops[2:]
        return ops[0], ops[1], Bilinear(lambda a, b: torch.einsum(eq, a, b, *more), False)
    if name == "baddbmm":
        vals = list(args) + [kwargs.get(k) for k in ("input", "batch1", "batch2")[len(args):]]
        alpha = kwargs.get("alpha", 1)
        a, b = vals[1], vals[2]
        if not (_float_tensor(a) and _float_tensor(b)):
            return None
        return a, b, Bilinear(lambda x, y: torch.bmm(x, y) * alpha, False)
    ts = [t for t in list(args) + list(kwargs.values()) if isinstance(t, Tensor)]
    if len(ts) < 2 or not (_float_tensor(ts[0]) and _float_tensor(ts[1])):
        return None
    if name == "__rmatmul__":  # self.__rmatmul__(other) computes other @ self
        return ts[1], ts[0], Bilinear(torch.matmul, False)
    fn = {"bmm": torch.bmm, "mm": torch.mm}.get(name, torch.matmul)
    return ts[0], ts[1], Bilinear(fn, False)


class CallCapture:
    """Within the block, every GEMM call of ``model``'s forward whose op name is in
    ``names`` is kept in :attr:`calls` (name -> calls in order); ``grads``: their output
    gradients too (tensor hooks, so after the block's backward)."""

    def __init__(self, model: nn.Module, names: Collection[str], *, grads: bool = True) -> None:
        self.model, self.names, self.grads = model, set(names), grads
        self.calls: dict[str, list[Call]] = {}
        self.params = {id(p) for p in model.parameters()}
        self.namer = CallNamer({id(p): n for n, p in model.named_parameters()})
        self.module_calls = UniqueNames()
        self.step_names = UniqueNames()
        self.scope: list[str] = []
        self.depth = 0
        self.stack = ExitStack()

    # -- recording ------------------------------------------------------------------------

    def keep(self, name: str, bl: Bilinear, a: Tensor, b: Tensor, y: object,
             weight: Tensor | None) -> None:
        if name not in self.names or not isinstance(y, Tensor):
            return
        call = Call(name, bl, a, b, y, weight)
        if self.grads and y.requires_grad:
            def hook(g: Tensor, _c: Call = call) -> None:
                _c.g = g.detach().float()
            y.register_hook(hook)
        self.calls.setdefault(name, []).append(call)

    def step(self, base: str) -> Callable[..., Any]:
        """A decomposed attention's ``step``: its GEMM steps are kept as ``<base>.<suffix>``."""
        def run(suffix: str, kind: OpKind, fn: Callable[..., Any], *args: Any,
                **kwargs: Any) -> Any:
            value = fn(*args, **kwargs)
            if kind in (OpKind.linear, OpKind.matmul):
                name = self.step_names(f"{base}.{suffix}" if base else suffix)
                form = functional_form("linear" if kind == OpKind.linear else "matmul", fn,
                                       args, kwargs)
                if form is not None:
                    a, b, bl = form
                    self.keep(name, bl, a, b, value, self._param_of(b))
            return value
        return run

    def _param_of(self, t: Tensor) -> Tensor | None:
        """``t`` if it is a parameter (or a slice of one: MHA's q/k/v rows), else None."""
        if id(t) in self.params:
            return t
        base = t._base
        return t if base is not None and id(base) in self.params else None

    # -- hooks ----------------------------------------------------------------------------

    def _module_hook(self, name: str, mod: nn.Module, bl: Bilinear) -> Callable[..., None]:
        def hook(m: nn.Module, inputs: tuple[Any, ...], out: Any) -> None:
            call_name = self.module_calls(name)
            if not inputs or not isinstance(inputs[0], Tensor):
                return
            if isinstance(m, MatMul):
                self.keep(call_name, bl, inputs[0], inputs[1], out, None)
                return
            w = m.weight
            assert isinstance(w, Tensor)
            b = w.t() if is_conv1d_like(m) else w
            self.keep(call_name, bl, inputs[0], b, out, w)
        return hook

    def _mha(self, name: str, mod: nn.MultiheadAttention) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            self.depth += 1
            try:
                return mha_forward(self.step(name), mod, *args, **kwargs)
            finally:
                self.depth -= 1
        return forward

    def __enter__(self) -> CallCapture:
        st = self.stack
        owner = self

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func: Callable[..., Any], types: object,
                                   args: tuple[Any, ...] = (),
                                   kwargs: dict[str, Any] | None = None) -> Any:
                return owner._on_call(func, args, kwargs or {})

        def root_pre(m: nn.Module, args: tuple[Any, ...]) -> None:
            self.namer.reset()
            self.module_calls.reset()
            self.step_names.reset()
            self.scope.clear()
            self.depth = 0

        st.callback(self.model.register_forward_pre_hook(root_pre).remove)
        for name, mod in self.model.named_modules():
            if not name:
                continue
            if isinstance(mod, nn.MultiheadAttention):
                own = mod.__dict__.get("forward")
                mod.__dict__["forward"] = self._mha(name, mod)
                st.callback(_restore_forward, mod, own)
            elif is_leaf_module(mod):
                bl = module_bilinear(mod)
                if bl is not None:
                    st.callback(mod.register_forward_hook(self._module_hook(name, mod, bl)).remove)
                st.callback(mod.register_forward_pre_hook(self._leaf_pre).remove)
                st.callback(mod.register_forward_hook(self._leaf_post, always_call=True).remove)
            else:
                st.callback(mod.register_forward_pre_hook(_Push(self, name)).remove)
                st.callback(mod.register_forward_hook(self._pop, always_call=True).remove)
        st.enter_context(_Mode())
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def _leaf_pre(self, mod: nn.Module, args: tuple[Any, ...]) -> None:
        self.depth += 1

    def _leaf_post(self, mod: nn.Module, args: tuple[Any, ...], out: object) -> None:
        self.depth -= 1

    def _pop(self, mod: nn.Module, args: tuple[Any, ...], out: object) -> None:
        if self.scope:
            self.scope.pop()

    def _on_call(self, func: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        kind = gemm_call_kind(func) if self.depth == 0 else None
        if kind is None:
            return func(*args, **kwargs)
        scope = self.scope[-1] if self.scope else ""
        name = self.namer.name(kind, scope, (args, kwargs))
        if kind == "sdpa":
            return sdpa_forward(self.step(name), *args, **kwargs)
        value = func(*args, **kwargs)
        form = functional_form(kind, func, args, kwargs)
        if form is not None:
            a, b, bl = form
            self.keep(name, bl, a, b, value, self._param_of(b))
        return value


class _Push:
    def __init__(self, owner: CallCapture, name: str) -> None:
        self.owner, self.name = owner, name

    def __call__(self, mod: nn.Module, args: tuple[Any, ...]) -> None:
        self.owner.scope.append(self.name)


def _restore_forward(mod: nn.Module, own: Callable[..., Any] | None) -> None:
    mod.__dict__.pop("forward", None)
    if own:
        mod.__dict__["forward"] = own
