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


def _put_back_forward(mod: nn.Module, own: Any) -> None:
    """Drop the patched ``forward`` of ``mod``; put back the instance's own one, if it had one."""
    mod.__dict__.pop("forward", None)
    if own:
        mod.__dict__["forward"] = own


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
    rec = SavedRecorder()
    raw: list[RawOp] = []
    producer: dict[int, str] = {}  # id(tensor) -> op name
    alive: list[Any] = []  # keep outputs alive so ids stay unique
    unique = UniqueNames()
    depth = [0]  # >0 while inside a leaf module
    scope: list[str] = []
    mhas = {m: n for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)}
    leaf_names = {m: n for n, m in model.named_modules()
                  if (isinstance(m, MatMul) or (is_leaf_module(m) and n)) and m not in mhas}
    in_loss = [False]
    namer = CallNamer(meta_param_names(model, state))
    param_storages = {storage_id(t) for t in state.values()}

    def record(name: str, kind: OpKind, target: str, mod: nn.Module | None, args: Any,
               value: Any, saved: list[torch.Tensor], params: list[torch.Tensor]) -> None:
        outs = tensors_of(value)
        if not outs:
            return
        ins = [t for t in tensors_of(args) if not isinstance(t, nn.Parameter)
               and id(t) not in param_ids]
        raw.append(RawOp(
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
                step = Expansion(namer.name("sdpa", prefix), target_name(func), rec, raw,
                                  producer, unique, param_storages, alive, in_loss[0])
                return expand_sdpa(step, args, kwargs)
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
            params = [t for t in tensors_of((args, kwargs)) if id(t) in param_ids]
            if gemm is not None and not in_loss[0]:
                name = unique(namer.name(gemm, prefix, (args, kwargs)))
            else:
                name = unique(f"{prefix}.{fname}" if prefix else fname)
            record(name, kind, target_name(func), None, (args, kwargs), value, saved, params)
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
            record(name, module_kind(mod), type(mod).__module__ + "." + type(mod).__qualname__,
                   mod, args, value, saved, list(mod.parameters()))

    def scope_pre(name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any) -> None:
            scope.append(name)
        return hook

    def scope_post(mod: nn.Module, args: Any, value: Any) -> None:
        scope.pop()

    def mha_forward(mod: nn.MultiheadAttention, name: str) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            step = Expansion(name, class_name(mod), rec, raw, producer, unique,
                              param_storages, alive, in_loss[0], id(mod))
            depth[0] += 1  # the decomposition's own calls are its steps, not more ops
            try:
                return expand_mha(step, mod, args, kwargs)
            finally:
                depth[0] -= 1
        return forward

    with ExitStack() as stack:
        for mod, name in mhas.items():
            own = mod.__dict__.get("forward")  # an instance's own forward, put back after
            mod.__dict__["forward"] = mha_forward(mod, name)
            stack.callback(_put_back_forward, mod, own)
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
        once = once_per_tensor(like)
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


def all_real(model: nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Every parameter, buffer and input holds data (none is on the meta device)."""
    tensors = [*model.parameters(), *model.buffers(), *tensors_of((list(args), kwargs))]
    return all(t.device.type != "meta" for t in tensors)
