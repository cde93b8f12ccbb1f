"""The layout walk: a standalone model's traced fx graph walked once, every value given a
layout (:mod:`qsync_opt.hfta.layouts`) and every node a step of the fused array
(:mod:`qsync_opt.hfta.convert` describes the walk; :mod:`qsync_opt.hfta.op_tables` what it
knows of each op; :mod:`qsync_opt.hfta.translation` the rules its steps name).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.fx.node import Argument

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.hfta.fused_array import op_key
from qsync_opt.hfta.layouts import LAYOUT_NAMES
from qsync_opt.hfta.linear_ops import FusedEmbedding, FusedMatMul
from qsync_opt.hfta.op_tables import (
    BROADCAST_OPS,
    DIM_ARGS,
    FRESH_OPS,
    FUNCTION_NAMES,
    FUSED_CLASSES,
    FUSED_LAYOUT,
    LIKE_OPS,
    RANDOM_OPS,
    SEQUENCE_OPS,
    SPATIAL_FUNCTIONS,
    SPATIAL_MODULES,
    STATELESS_MODULES,
    TENSOR_ATTRS,
    FusedOp,
)
from qsync_opt.hfta.translation import OpCall, Ref
from qsync_opt.models.layers import MatMul

__all__ = ["LayoutWalk"]

_T = TypeVar("_T")


def _leaves(a: object, cls: type[_T]) -> list[_T]:
    """The ``cls`` instances in ``a``, through tuples, lists, dict values and slices."""
    if isinstance(a, cls):
        return [a]
    if isinstance(a, (tuple, list)):
        return [n for x in a for n in _leaves(x, cls)]
    if isinstance(a, dict):
        return [n for x in a.values() for n in _leaves(x, cls)]
    if isinstance(a, slice):
        return _leaves((a.start, a.stop, a.step), cls)
    return []


def _nodes_in(a: object) -> list[fx.Node]:
    return _leaves(a, fx.Node)


def _fetch(m: nn.Module, target: str) -> Any:
    obj: Any = m
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class LayoutWalk:
    """The state of one walk over the traced graph (:func:`fuse`)."""

    def __init__(self, models: Sequence[nn.Module], input_mode: str) -> None:
        self.models = list(models)
        self.B = len(self.models)
        self.input_mode = input_mode
        self.layout: dict[str, str] = {}  # value name -> "C", "M", "Ms" or "S"
        self.steps: list[tuple[Any, ...]] = []
        self.fused: dict[str, nn.Module] = {}
        self.shared: dict[str, nn.Module] = {}
        self.matmuls: dict[str, nn.Module] = {}
        self.consts: dict[str, tuple[str, Tensor]] = {}
        self.shared_ids: dict[str, bool] = {}
        self.converted: dict[tuple[str, str], str] = {}
        #: id(model 0's parameter) -> the fused parameter holding it (a tie reuses it)
        self.holder: dict[int, tuple[str, nn.Parameter]] = {}
        self.ties: dict[int, tuple[str, tuple[str, ...], str]] = {}
        template = self.models[0]
        self.canonical = {id(p): n for n, p in template.named_parameters()}
        self.aliases: dict[int, list[str]] = {}
        for n, p in template.named_parameters(remove_duplicate=False):
            self.aliases.setdefault(id(p), []).append(n)

    # ------------------------------------------------------------------ layouts

    def need(self, a: fx.Node, want: str, who: str) -> str:
        """``a``'s value name in layout ``want`` (converted once, on first use)."""
        lay = self.layout.get(a.name)
        if lay == want:
            return a.name
        how = {("M", "C"): "fold", ("C", "M"): "unfold", ("S", "M"): "expand",
               ("S", "C"): "repeat"}.get((lay or "", want))
        if how is None:
            raise QsyncInputError(f"hfta: {who} takes the {LAYOUT_NAMES[want]} layout, but its input "
                                  f"{a.name!r} is {LAYOUT_NAMES.get(lay or '', lay)}; this model has "
                                  "no fused form here (use the torch.func route)")
        key = (a.name, want)
        if key not in self.converted:
            self.converted[key] = f"{a.name}__{want}"
            self.steps.append(("convert", self.converted[key], a.name, how, who))
            self.layout[self.converted[key]] = want
        return self.converted[key]

    # ------------------------------------------------------------------ nodes

    def node(self, n: fx.Node) -> None:
        if n.op == "placeholder":
            self.steps.append(("input", n.name))
            self.layout[n.name] = "M" if self.input_mode == "per_model" else "S"
        elif n.op == "get_attr":
            self.const(n)
        elif n.op == "call_module":
            self.module(n)
        elif n.op in ("call_function", "call_method"):
            call: OpCall
            op: str | None
            if n.op == "call_method":
                call = op = str(n.target)
                who = f"method .{call}() ({n.name})"
            else:
                call = n.target
                op = None if isinstance(call, str) else FUNCTION_NAMES.get(call)
                who = f"function {getattr(call, '__name__', call)} ({n.name})"
            self.call(n.name, call, op, tuple(n.args), dict(n.kwargs), who)
        elif n.op == "output":
            res = n.args[0]
            lay = self.layout.get(res.name) if isinstance(res, fx.Node) else None
            if not isinstance(res, fx.Node) or lay not in ("M", "C"):
                raise QsyncInputError("hfta: the model's output must be one tensor computed "
                                      "from the models' parameters (model-major or "
                                      f"channel-folded), got {LAYOUT_NAMES.get(lay or '', res)}")
            self.steps.append(("output", "", self.need(res, "M", "the output")))

    def const(self, n: fx.Node) -> None:
        """A tensor read outside a module: a buffer equal in every model, shared."""
        target = str(n.target)
        vals = [_fetch(m, target) for m in self.models]
        if any(isinstance(v, nn.Parameter) for v in vals):
            raise QsyncInputError(f"hfta: {target!r} is a parameter read outside a module; "
                                  "no fused form (fused: the parameters of Conv2d, "
                                  "BatchNorm2d, Linear, LayerNorm, Embedding)")
        if not all(isinstance(v, Tensor) for v in vals):
            raise QsyncInputError(f"hfta: {target!r} is a {type(vals[0]).__name__} read "
                                  "outside a module; no fused form")
        for b, v in enumerate(vals[1:], 1):
            if (v.shape != vals[0].shape or v.dtype != vals[0].dtype
                    or not torch.equal(v, vals[0])):
                raise QsyncInputError(f"hfta: buffer {target!r} differs between model 0 and "
                                      f"model {b}; only buffers equal in every model are "
                                      "shared (no fused form)")
        k = op_key(target)
        if k not in self.consts:
            self.consts[k] = (target, vals[0].detach().clone())
        self.steps.append(("const", n.name, k))
        self.layout[n.name] = "S"

    def module(self, n: fx.Node) -> None:
        target = str(n.target)
        mods = [m.get_submodule(target) for m in self.models]
        m0 = mods[0]
        label = f"{target} ({type(m0).__name__})"
        if isinstance(m0, MatMul):
            self.matmul(n, mods, label)
            return
        x = n.args[0] if n.args else None
        if not isinstance(x, fx.Node) or len(n.args) != 1 or n.kwargs:
            raise QsyncInputError(f"hfta: module {target!r} is called with "
                                  f"{len(n.args) + len(n.kwargs)} arguments; only "
                                  "single-input modules fuse (and the attention MatMul)")
        fcls: Any = next((f for t, f in FUSED_CLASSES.items() if type(m0) is t), None)
        if fcls is not None:
            k = op_key(target)
            if fcls is FusedEmbedding:
                lay = self.layout.get(x.name)
                src = x.name if lay in ("M", "S") else self.need(x, "M", label)
                self.shared_ids.setdefault(k, self.layout[src] == "S")
            else:
                src = self.need(x, FUSED_LAYOUT[fcls], label)
            if k not in self.fused:  # a module called twice is one fused op
                self.fused[k] = self.build(fcls, mods, target)
            self.steps.append(("fused", n.name, k, src))
            self.layout[n.name] = FUSED_LAYOUT[fcls]
        elif isinstance(m0, nn.Flatten):
            self.call(n.name, "flatten", "flatten", (x, m0.start_dim, m0.end_dim), {}, label)
        elif isinstance(m0, (nn.Softmax, nn.LogSoftmax)):
            op = "softmax" if isinstance(m0, nn.Softmax) else "log_softmax"
            if m0.dim is None:
                raise QsyncInputError(f"hfta: {label} without a dim has no fused form")
            self.call(n.name, op, op, (x, m0.dim), {}, label)
        elif isinstance(m0, nn.Unflatten):
            self.call(n.name, "unflatten", "unflatten",
                      (x, m0.dim, tuple(m0.unflattened_size)), {}, label)
        elif isinstance(m0, STATELESS_MODULES):
            lay = self.layout.get(x.name)
            if isinstance(m0, SPATIAL_MODULES):
                src = self.need(x, "C", label)
            elif isinstance(m0, nn.Dropout) and lay == "S":  # each model its own mask
                src = self.need(x, "M", label)
            elif lay == "Ms":
                raise QsyncInputError(f"hfta: {label} reads a tuple; no fused form")
            else:
                src = x.name
            k = op_key(target)
            self.shared[k] = m0
            self.steps.append(("shared", n.name, k, src))
            self.layout[n.name] = self.layout[src]
        else:
            raise QsyncInputError(f"hfta: module {target!r} ({type(m0).__name__}) has "
                                  "no fused form (fused: Conv2d, BatchNorm2d, Linear, "
                                  "LayerNorm, Embedding, MatMul; shared: activations, "
                                  "pooling, dropout, Flatten, Softmax)")

    def build(self, fcls: type[FusedOp], mods: Sequence[nn.Module], target: str) -> nn.Module:
        """The fused op of ``mods``; a parameter it shares with an op fused before (a tied
        weight) becomes that op's fused Parameter."""
        fmod: nn.Module = fcls.from_modules(mods)
        for name, prm in list(fmod.named_parameters(recurse=False)):
            p0 = getattr(mods[0], name)
            path = f"{target}.{name}"
            if id(p0) not in self.holder:
                self.holder[id(p0)] = (path, prm)
                continue
            first, fprm = self.holder[id(p0)]
            for b, m in enumerate(self.models):  # the same tie in every model
                if m.get_parameter(path) is not m.get_parameter(first):
                    raise QsyncInputError(f"hfta: {path} is {first} in model 0 but not in "
                                          f"model {b}; tied parameters must be tied in every "
                                          "model")
            if fprm.shape != prm.shape:
                raise QsyncInputError(f"hfta: {path} is tied to {first}, but their fused "
                                      f"shapes differ ({tuple(prm.shape)} vs "
                                      f"{tuple(fprm.shape)}); no fused form")
            setattr(fmod, name, fprm)
            self.ties[id(p0)] = (first, tuple(self.aliases[id(p0)]), self.canonical[id(p0)])
        return fmod

    def matmul(self, n: fx.Node, mods: Sequence[nn.Module], label: str) -> None:
        if len(n.args) != 2 or n.kwargs or not all(isinstance(a, fx.Node) for a in n.args):
            raise QsyncInputError(f"hfta: {label} is called with other than two tensors; no "
                                  "fused form")
        nodes = [a for a in n.args if isinstance(a, fx.Node)]
        srcs = [a.name if self.layout.get(a.name) in ("M", "S") else self.need(a, "M", label)
                for a in nodes]
        am, bm = (self.layout[s] == "M" for s in srcs)
        if not (am or bm):  # two shared operands: every model runs it (at its precision)
            srcs[0], am = self.need(nodes[0], "M", label), True
        k = op_key(str(n.target))
        if k not in self.matmuls:
            self.matmuls[k] = FusedMatMul.from_modules(mods)
        self.steps.append(("matmul", n.name, k, srcs[0], am, srcs[1], bm))
        self.layout[n.name] = "M"

    def call(self, name: str, call: OpCall, op: str | None, args: tuple[Argument, ...],
             kwargs: dict[str, Argument], who: str) -> None:
        """A function or method call: its translation rule and the layout of its result
        (module docstring)."""
        nodes = _nodes_in((args, kwargs))
        lays = {a.name: self.layout[a.name] for a in nodes}
        first = args[0] if args else None
        first_lay = lays.get(first.name) if isinstance(first, fx.Node) else None
        if op == "flatten" and first_lay == "C":
            start = kwargs.get("start_dim", args[1] if len(args) > 1 else 0)
            end = kwargs.get("end_dim", args[2] if len(args) > 2 else -1)
            if (start, end) == (1, -1):  # the flatten between a conv trunk and a linear head
                assert isinstance(first, fx.Node)
                self.steps.append(("flatten", name, first.name))
                self.layout[name] = "M"
                return
        if op in SPATIAL_FUNCTIONS:  # pooling: on the channel-folded layout
            if first_lay is None or not isinstance(first, fx.Node):
                raise QsyncInputError(f"hfta: {who} pools a value that is not a tensor of "
                                      "the walk")
            if first_lay == "S":
                self.emit(name, "shared", call, op, args, kwargs, "S")
                return
            self.emit(name, "shared", call, op, args, kwargs, "C",
                      subst={first.name: self.need(first, "C", who)})
            return
        if not any(lay in ("M", "Ms", "C") for lay in lays.values()):
            if op in RANDOM_OPS:
                if op == "dropout" and isinstance(first, fx.Node):  # each model its own mask
                    self.emit(name, "broadcast", call, op, args, kwargs, "M",
                              subst={first.name: self.need(first, "M", who)})
                    return
                raise QsyncInputError(f"hfta: {who} draws random numbers for a value shared "
                                      "by all models (each model would draw the same); no "
                                      "fused form")
            self.emit(name, "shared", call, op, args, kwargs, "S")
            return
        if op is None:
            raise QsyncInputError(f"hfta: {who} has no fused form (no translation for "
                                  "model-major or channel-folded values)")
        only_c = all(lay == "C" for lay in lays.values())
        if (op in BROADCAST_OPS and only_c) or (op in LIKE_OPS and first_lay == "C"):
            self.emit(name, "shared", call, op, args, kwargs, "C")  # per channel: as written
            return
        # any other reader of a channel-folded value sees it model-major
        subst = {a.name: self.need(a, "M", who) for a in nodes if lays[a.name] == "C"}
        lays = {k: ("M" if k in subst else v) for k, v in lays.items()}
        first_lay = "M" if first_lay == "C" else first_lay
        if "Ms" in lays.values() and op not in ("getitem", "cat", "stack"):
            raise QsyncInputError(f"hfta: {who} reads a tuple of model-major values; no "
                                  "fused form")
        rule, out = self.rule(op, first_lay, args, lays, who)
        self.emit(name, rule, call, op, args, kwargs, out, subst=subst)

    def rule(self, op: str, first_lay: str | None, args: tuple[Argument, ...],
             lays: dict[str, str], who: str) -> tuple[str, str]:
        """(the translation rule, the result's layout) of op ``op`` with a model-major
        operand."""
        if op in BROADCAST_OPS:
            return "broadcast", "M"
        if op in LIKE_OPS:
            return "shared", first_lay or "S"
        if op in ("cat", "stack"):
            return "cat", "M"
        if op in ("matmul", "bmm"):
            return "matmul", "M"
        if op == "expand_as":
            return "as", "M"
        if op == "getitem":
            idx_nodes = _nodes_in(args[1:])
            if any(lays[n.name] != "S" for n in idx_nodes):
                raise QsyncInputError(f"hfta: {who} indexes with a model-major value; no "
                                      "fused form")
            if first_lay == "Ms":
                if idx_nodes:
                    raise QsyncInputError(f"hfta: {who} indexes a tuple with a computed "
                                          "index; no fused form")
                return "shared", "Ms" if isinstance(args[1], slice) else "M"
            if first_lay == "M":
                return "getitem", "M"
        if first_lay != "M":
            raise QsyncInputError(f"hfta: {who} reads a model-major value as an argument of "
                                  "a shared one; no fused form")
        if op == "size":
            return "dims", "S"
        if op in DIM_ARGS:
            return "dims", "Ms" if op in SEQUENCE_OPS else "M"
        if op in ("view", "reshape", "view_as", "reshape_as"):
            return ("view" if op in ("view", "reshape") else "as"), "M"
        if op in ("expand", "repeat", "permute"):
            return "expand", "M"
        if op in FRESH_OPS:
            return "shared", "S"
        if op in ("dim", "ndimension", "numel", "nelement"):
            return "attr", "S"
        if op == "getattr":
            attr = args[1] if len(args) > 1 else None
            if attr not in TENSOR_ATTRS:
                raise QsyncInputError(f"hfta: {who} reads attribute {attr!r} of a "
                                      "model-major value; no fused form (read: "
                                      f"{', '.join(sorted(TENSOR_ATTRS))})")
            return "attr", "S"
        raise QsyncInputError(f"hfta: {who} has no fused form for model-major values")

    def emit(self, name: str, rule: str, call: OpCall, op: str | None,
             args: tuple[Argument, ...],
             kwargs: dict[str, Argument], out: str, *, subst: dict[str, str] | None = None) -> None:
        """An ``op`` step: the call's arguments with the walk's values as references (a node
        in ``subst`` by its value in the layout the rule takes)."""
        subst = subst or {}

        def ref(a: object) -> object:
            if isinstance(a, fx.Node):
                return Ref(subst.get(a.name, a.name))
            if isinstance(a, (tuple, list)):
                return type(a)(ref(x) for x in a)
            if isinstance(a, dict):
                return {k: ref(v) for k, v in a.items()}
            if isinstance(a, slice):
                return slice(ref(a.start), ref(a.stop), ref(a.step))
            return a

        r_args = tuple(ref(a) for a in args)
        r_kwargs = {k: ref(v) for k, v in kwargs.items()}
        refs = [str(x) for x in _refs_in((r_args, r_kwargs))]
        majors = frozenset(r for r in refs if self.layout.get(r) in ("M", "Ms"))
        self.steps.append(("op", name, rule, call, op or "", r_args, r_kwargs, majors))
        self.layout[name] = out


def _refs_in(a: object) -> list[Ref]:
    return _leaves(a, Ref)
