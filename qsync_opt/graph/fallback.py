"""The fallback tracer: the model run once under a ``TorchFunctionMode`` with module
hooks (meta tensors, or real ones for a model that reads its inputs' values)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from qsync_opt.documents.schemas import OpKind
from qsync_opt.graph.recording import (
    Expansion,
    RawOp,
    SavedRecorder,
    expand_mha,
    expand_sdpa,
    meta_like,
    meta_param_names,
    meta_state,
    once_per_tensor,
    real_like,
    storage_id,
)
from qsync_opt.models.layers import MatMul
from qsync_opt.ops.kinds import function_kind, is_leaf_module, method_kind, module_kind
from qsync_opt.ops.naming import (
    CallNamer,
    UniqueNames,
    class_name,
    gemm_call_kind,
    target_name,
    tensors_of,
)


def _put_back_forward(mod: nn.Module, own: Callable[..., Any] | None) -> None:
    """Drop the patched ``forward`` of ``mod``; put back the instance's own one, if it had one."""
    mod.__dict__.pop("forward", None)
    if own:
        mod.__dict__["forward"] = own


class _FunctionModeTrace:
    """The state of one fallback trace: the raw ops recorded so far, which op made each
    tensor, and the module nesting (leaf depth, scope names) the hooks keep."""

    def __init__(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        self.rec = SavedRecorder()
        self.raw: list[RawOp] = []
        self.producer: dict[int, str] = {}  # id(tensor) -> op name
        self.alive: list[object] = []  # keep outputs alive so ids stay unique
        self.unique = UniqueNames()
        self.depth = 0  # >0 while inside a leaf module
        self.scope: list[str] = []
        self.mhas = {m: n for n, m in model.named_modules()
                     if isinstance(m, nn.MultiheadAttention)}
        self.leaf_names = {m: n for n, m in model.named_modules()
                           if (isinstance(m, MatMul) or (is_leaf_module(m) and n))
                           and m not in self.mhas}
        self.in_loss = False
        self.namer = CallNamer(meta_param_names(model, state))
        self.param_storages = {storage_id(t) for t in state.values()}
        self.param_ids = {id(t) for t in state.values()}

    def record(self, name: str, kind: OpKind, target: str, mod: nn.Module | None,
               args: object, value: object, saved: list[torch.Tensor],
               params: list[torch.Tensor]) -> None:
        outs = tensors_of(value)
        if not outs:
            return
        ins = [t for t in tensors_of(args) if not isinstance(t, nn.Parameter)
               and id(t) not in self.param_ids]
        self.raw.append(RawOp(
            name=name, kind=kind, target=target, module=mod,
            inputs=[(self.producer[id(t)], t) for t in ins if id(t) in self.producer],
            input_tensors=ins, outputs=outs, params=params, saved=saved,
            is_loss_part=self.in_loss,
        ))
        for t in outs:
            self.producer[id(t)] = name
        self.alive.append(value)

    def expansion(self, name: str, target: str, owner: int | None = None) -> Expansion:
        """The step function of a decomposed attention named ``name``."""
        return Expansion(name, target, self.rec, self.raw, self.producer, self.unique,
                         self.param_storages, self.alive, self.in_loss, tie=owner)

    def torch_call(self, func: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
        """A top-level torch call: run it, recording what it saves, as one op."""
        if self.depth > 0 or getattr(func, "__name__", "") in ("size", "dim", "__get__"):
            return func(*args, **kwargs)
        prefix = "loss" if self.in_loss else (self.scope[-1] if self.scope else "")
        gemm = gemm_call_kind(func)
        if gemm == "sdpa":
            step = self.expansion(self.namer.name("sdpa", prefix), target_name(func))
            return expand_sdpa(step, args, kwargs)
        rec = self.rec
        rec.current = []
        try:
            with rec.hooks():
                value = func(*args, **kwargs)
        finally:
            saved, rec.current = rec.current, None
        fname = (getattr(func, "__name__", None) or "op").strip("_")
        kind = function_kind(func)
        if kind == OpKind.other:
            kind = method_kind(getattr(func, "__name__", ""))
        params = [t for t in tensors_of((args, kwargs)) if id(t) in self.param_ids]
        if gemm is not None and not self.in_loss:
            name = self.unique(self.namer.name(gemm, prefix, (args, kwargs)))
        else:
            name = self.unique(f"{prefix}.{fname}" if prefix else fname)
        self.record(name, kind, target_name(func), None, (args, kwargs), value, saved, params)
        return value

    def mode(self) -> TorchFunctionMode:
        """The function mode that sends every torch call to :meth:`torch_call`."""
        trace = self

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func: Callable[..., Any], types: object,
                                   args: tuple[Any, ...] = (),
                                   kwargs: dict[str, Any] | None = None) -> Any:
                return trace.torch_call(func, args, kwargs or {})

        return _Mode()

    def pre_hook(self, mod: nn.Module, args: tuple[Any, ...]) -> None:
        if self.depth == 0:
            self.rec.current = []
        self.depth += 1

    def post_hook(self, mod: nn.Module, args: tuple[Any, ...], value: object) -> None:
        self.depth -= 1
        if self.depth == 0:
            saved, self.rec.current = self.rec.current or [], None
            name = self.unique(self.leaf_names[mod])
            self.record(name, module_kind(mod),
                        type(mod).__module__ + "." + type(mod).__qualname__,
                        mod, args, value, saved, list(mod.parameters()))

    def scope_pre(self, name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(mod: nn.Module, args: tuple[Any, ...]) -> None:
            self.scope.append(name)
        return hook

    def scope_post(self, mod: nn.Module, args: tuple[Any, ...], value: object) -> None:
        self.scope.pop()

    def mha_forward(self, mod: nn.MultiheadAttention, name: str) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            step = self.expansion(name, class_name(mod), id(mod))
            self.depth += 1  # the decomposition's own calls are its steps, not more ops
            try:
                return expand_mha(step, mod, args, kwargs)
            finally:
                self.depth -= 1
        return forward

    def install(self, model: nn.Module, stack: ExitStack) -> None:
        """Patch the attention modules' forward and hook every module, undone by ``stack``."""
        for mod, name in self.mhas.items():
            own = mod.__dict__.get("forward")  # an instance's own forward, put back after
            mod.__dict__["forward"] = self.mha_forward(mod, name)
            stack.callback(_put_back_forward, mod, own)
        for mod in self.leaf_names:
            h1 = mod.register_forward_pre_hook(self.pre_hook)
            h2 = mod.register_forward_hook(self.post_hook)
            stack.callback(h1.remove)
            stack.callback(h2.remove)
        for name, mod in model.named_modules():
            if name and mod not in self.leaf_names and mod not in self.mhas:
                h1 = mod.register_forward_pre_hook(self.scope_pre(name))
                h2 = mod.register_forward_hook(self.scope_post)
                stack.callback(h1.remove)
                stack.callback(h2.remove)


def function_mode_raw_ops(
    model: nn.Module,
    inputs: Sequence[torch.Tensor],
    targets: torch.Tensor | None,
    loss_fn: Callable[[Any, Any], Any] | None,
    *,
    kwargs: dict[str, torch.Tensor] | None = None,
    sink: list[Any] | None = None,
    real: bool = False,
) -> list[RawOp]:
    """Run once on meta tensors (``real``: on the model's own parameters and copies of the
    inputs); leaf modules and top-level torch calls become ops."""
    kwargs = kwargs or {}
    state = meta_state(model) if not real else {
        n: t for n, t in [*model.named_parameters(remove_duplicate=False),
                          *model.named_buffers(remove_duplicate=False)]}
    like = real_like if real else meta_like
    trace = _FunctionModeTrace(model, state)
    with ExitStack() as stack:
        trace.install(model, stack)
        if not real:
            stack.enter_context(torch.nn.utils.stateless._reparametrize_module(model, state))
        stack.enter_context(torch.enable_grad())
        stack.enter_context(trace.rec.hooks())
        once = once_per_tensor(like)
        args = [once(t) for t in inputs]
        kw = {k: once(t) for k, t in kwargs.items()}
        meta_targets = like(targets) if targets is not None else None
        with trace.mode():
            out = model(*args, **kw)
            if loss_fn is not None and meta_targets is not None:
                trace.in_loss = True
                loss_fn(out, meta_targets)
    if sink is not None:
        sink.append(out)
    return trace.raw


def all_real(model: nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Every parameter, buffer and input holds data (none is on the meta device)."""
    tensors = [*model.parameters(), *model.buffers(), *tensors_of((list(args), kwargs))]
    return all(t.device.type != "meta" for t in tensors)
