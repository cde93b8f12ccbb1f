"""The main tracer: ``torch.fx`` symbolic tracing, then the traced graph run node by
node on meta tensors (the loss spliced in for a registry workload)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

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
    storage_id,
)
from qsync_opt.ops.kinds import function_kind, is_leaf_module, method_kind, module_kind
from qsync_opt.ops.naming import (
    CallNamer,
    UniqueNames,
    class_name,
    gemm_call_kind,
    target_name,
    tensors_of,
)


def is_python_function(fn: object) -> bool:
    """A plain Python function (not torch's, not a builtin): fx keeps one as a single op
    only when it is ``torch.fx.wrap``-ed (torchvision's Swin attention), else it traces it."""
    mod = getattr(fn, "__module__", None) or ""
    return inspect.isfunction(fn) and not mod.startswith(("torch", "_operator", "operator",
                                                          "builtins", "math"))


class _HiddenWork(TorchFunctionMode):
    """Counts the GEMM calls an opaque function runs (and, by :class:`FlopCounterMode`,
    the FLOPs it does), so the graph can say what it hides and fall back."""

    def __init__(self) -> None:
        super().__init__()
        self.gemms = 0
        self.flops = FlopCounterMode(display=False)

    def __torch_function__(self, func: Callable[..., Any], types: object,
                           args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if gemm_call_kind(func) is not None:
            self.gemms += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> _HiddenWork:
        self.flops.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.flops.__exit__(*exc)


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return is_leaf_module(m)


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


def _concrete_args(model: nn.Module, inputs: Sequence[torch.Tensor],
                   kwargs: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """Keyword inputs: the forward's other parameters keep their defaults (fx specialises on
    them), the given ones become placeholders. None without keyword inputs."""
    if not kwargs:
        return None
    params = list(inspect.signature(model.forward).parameters.values())[len(inputs):]
    unknown = [k for k in kwargs if k not in {p.name for p in params}]
    if unknown and not any(p.kind == p.VAR_KEYWORD for p in params):
        raise TypeError(f"forward() got an unexpected keyword argument {unknown[0]!r}")
    return {p.name: p.default for p in params
            if p.name not in kwargs and p.default is not p.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _scope_of(n: fx.Node) -> str:
    if n.meta.get("qsync_loss"):
        return "loss"
    stack = n.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


class _Interp(fx.Interpreter):
    """Runs the traced graph node by node on meta tensors, recording each computing node as
    a raw op (an attention module or call as its decomposition's steps)."""

    def __init__(self, gm: fx.GraphModule, model: nn.Module,
                 state: dict[str, torch.Tensor]) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.rec = SavedRecorder()
        self.names: dict[fx.Node, str] = {}
        self.raw: list[RawOp] = []
        self.unique = UniqueNames()
        self.namer = CallNamer(meta_param_names(model, state))
        self.param_storages = {storage_id(t) for t in state.values()}
        self.alive: list[Any] = []

    def expand(self, n: fx.Node, base: str, target: str, tie: int | None,
               run: Callable[[Expansion, Any, Any], Any]) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        producer = {id(t): self.names[a] for a in n.all_input_nodes if a in self.names
                    for t in tensors_of(self.env[a])}
        step = Expansion(base, target, self.rec, self.raw, producer, self.unique,
                         self.param_storages, self.alive, bool(n.meta.get("qsync_loss")), tie)
        value = run(step, args, kwargs)
        outs = tensors_of(value)
        if outs and step.last is not None:
            self.names[n] = producer.get(id(outs[0]), step.last)
        return value

    def _run_recorded(self, n: fx.Node) -> tuple[Any, list[torch.Tensor], _HiddenWork | None]:
        """Run ``n`` under the saved-tensor recorder (an opaque Python function also under
        :class:`_HiddenWork`): its value, the tensors it saved, the hidden work."""
        rec = self.rec
        rec.current = []
        opaque = n.op == "call_function" and is_python_function(n.target)
        hidden = _HiddenWork() if opaque else None
        try:
            with rec.hooks():
                if hidden is not None:
                    with hidden:
                        value = super().run_node(n)
                else:
                    value = super().run_node(n)
        finally:
            saved, rec.current = rec.current, None
        return value, saved, hidden

    def _function_name(self, n: fx.Node) -> str:
        """The op name of a function or method call: a GEMM's by :class:`CallNamer`, else
        ``<scope>.<function>``."""
        scope = _scope_of(n)
        gemm = gemm_call_kind(n.target if n.op == "call_function" else None,
                              None if n.op == "call_function" else str(n.target))
        if gemm is not None and not n.meta.get("qsync_loss"):
            call_args, call_kwargs = self.fetch_args_kwargs_from_env(n)
            return self.unique(self.namer.name(gemm, scope, (call_args, call_kwargs)))
        fname = (getattr(n.target, "__name__", None) or str(n.target)).strip("_")
        return self.unique(f"{scope}.{fname}" if scope else fname)

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "output", "get_attr"):
            return super().run_node(n)
        if n.op == "call_module" and isinstance(self.fetch_attr(str(n.target)),
                                                nn.MultiheadAttention):
            mha = self.fetch_attr(str(n.target))
            return self.expand(n, str(n.target), class_name(mha), id(mha),
                               lambda st, a, k: expand_mha(st, mha, a, k))
        if n.op == "call_function" and n.target is F.scaled_dot_product_attention:
            return self.expand(n, self.namer.name("sdpa", _scope_of(n)), target_name(n.target),
                               None, expand_sdpa)
        value, saved, hidden = self._run_recorded(n)
        outs = tensors_of(value)
        if not outs:
            return value
        in_nodes = [a for a in n.all_input_nodes if a.op != "get_attr"]
        params = [self.env[a] for a in n.all_input_nodes if a.op == "get_attr"]
        mod: nn.Module | None = None
        if n.op == "call_module":
            mod = self.fetch_attr(str(n.target))
            kind = module_kind(mod)
            name = self.unique(str(n.target))
            target = class_name(mod)
            params = list(mod.parameters()) + params
        else:
            kind = function_kind(n.target) if n.op == "call_function" else method_kind(
                str(n.target))
            name = self._function_name(n)
            target = target_name(n.target) if n.op == "call_function" else f"Tensor.{n.target}"
        self.names[n] = name
        self.raw.append(RawOp(
            name=name, kind=kind, target=target, module=mod,
            inputs=[(self.names[a], t) for a in in_nodes if a in self.names
                    for t in tensors_of(self.env[a])[:1]],
            input_tensors=[t for a in in_nodes for t in tensors_of(self.env[a])],
            outputs=outs, params=[p for p in params if isinstance(p, torch.Tensor)],
            saved=saved, is_loss_part=bool(n.meta.get("qsync_loss")),
            opaque=hidden is not None,
            hidden_gemms=hidden.gemms if hidden else 0,
            hidden_flops=int(hidden.flops.get_total_flops()) if hidden else 0,
        ))
        return value


def _meta_args(gm: fx.GraphModule, inputs: Sequence[torch.Tensor],
               kwargs: dict[str, torch.Tensor], targets: torch.Tensor | None,
               with_loss: bool) -> list[Any]:
    """The traced graph's placeholders as meta tensors: the positional inputs, then the rest
    by name (a keyword input, else the placeholder's default), then the targets."""
    meta = once_per_tensor(meta_like)
    args: list[Any] = [meta(t) for t in inputs]
    if kwargs:
        rest = [n for n in gm.graph.nodes if n.op == "placeholder"][len(inputs):]
        for n in rest:
            if n.target == "targets" and with_loss:
                continue
            key = str(n.target).lstrip("*")
            args.append(meta(kwargs[key]) if key in kwargs
                        else (n.args[0] if n.args else None))
    if with_loss and targets is not None:
        args.append(meta_like(targets))
    return args


def fx_raw_ops(
    model: nn.Module,
    inputs: Sequence[torch.Tensor],
    targets: torch.Tensor | None,
    loss_fn: Callable[[Any, Any], Any] | None,
    *,
    kwargs: dict[str, torch.Tensor] | None = None,
    sink: list[Any] | None = None,
) -> list[RawOp]:
    kwargs = kwargs or {}
    graph = _Tracer().trace(model, concrete_args=_concrete_args(model, inputs, kwargs))
    gm = fx.GraphModule(model, graph)
    with_loss = loss_fn is not None and targets is not None
    if with_loss and loss_fn is not None:
        _splice_loss(gm, loss_fn)
    state = meta_state(gm)
    args = _meta_args(gm, inputs, kwargs, targets, with_loss)
    with torch.nn.utils.stateless._reparametrize_module(gm, state), torch.enable_grad():
        interp = _Interp(gm, model, state)
        value = interp.run(*args)
    if sink is not None:
        sink.append(value)
    return interp.raw
