"""A workload's model as a B-array: ``B`` standalone models fused into one module.

:func:`fuse` traces the first model with ``torch.fx`` (torch.nn leaf modules) and walks its
graph once, giving every value a layout (:mod:`qsync_opt.hfta`): the input, then
channel-folded ``[N, B*C, H, W]`` through a conv trunk and model-major ``[B, N, F]`` after
the flatten into a linear head. Each op with parameters becomes its fused operator built from
the ``B`` models' own modules (:mod:`.ops`); stateless modules (ReLU, pooling, dropout,
identity) and elementwise functions run unchanged on either layout; ``torch.flatten(x, 1)``
(or ``nn.Flatten``) of a channel-folded tensor becomes :func:`~.ops.conv_to_linear`. An op
the walk cannot place (a reshape other than that flatten, a size read, an unknown module)
is refused, naming it: the converter covers CNN and MLP workloads (``digits_cnn``,
``digits_resnet``, ``resnet18_32``, ``resnet18``); the torch.func route
(:mod:`.functional`) runs any model.

Inputs: ``per_model`` (each model its own stream: ``[B, N, ...]``) or ``replicated`` (one
``[N, ...]`` batch for all ``B``, copied into each model's channels: the models then differ
only in weights and hyper-parameters, not in data, so they are not separate runs of a
seed sweep); the output is ``[B, N, ...]``.

Every op with parameters can run ``fused`` (one kernel call for all ``B``) or ``serial``
(``B`` calls on the slices of the same fused parameters, the input split per model before
and the outputs joined after, in the layout the op lives in): :meth:`FusedArray.set_mode`.
Partial fusion (a fused trunk with unfused heads) is ``serial`` on the head's ops; the
measured per-op choice (:mod:`.choice`) sets the modes. :meth:`FusedArray.export` gives model
``b`` back as a standalone model of the original class.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import QsyncInputError
from . import ops as H

__all__ = ["FusedArray", "INPUT_MODES", "fuse", "serial_forward"]

INPUT_MODES = ("per_model", "replicated")

#: Modules that hold no parameters and act per element or per channel: shared by all B.
_STATELESS = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.LeakyReLU,
              nn.Dropout, nn.Identity, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d,
              nn.Hardswish, nn.Hardsigmoid)
_SPATIAL = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d)
_ELEMENTWISE_FNS = {operator.add, operator.mul, operator.sub, operator.truediv, torch.add,
                    torch.mul, torch.relu, F.relu, F.gelu, F.silu, torch.sigmoid, torch.tanh,
                    F.dropout, torch.sub, operator.iadd}
_SPATIAL_FNS = {F.adaptive_avg_pool2d, F.max_pool2d, F.avg_pool2d}
_FUSED = {nn.Conv2d: H.FusedConv2d, nn.BatchNorm2d: H.FusedBatchNorm2d,
          nn.Linear: H.FusedLinear, nn.LayerNorm: H.FusedLayerNorm,
          nn.Embedding: H.FusedEmbedding}
#: The layout each fused op takes (and gives).
_LAYOUT = {H.FusedConv2d: "C", H.FusedBatchNorm2d: "C", H.FusedLinear: "M",
           H.FusedLayerNorm: "M", H.FusedEmbedding: "M"}


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return (type(m).__module__.startswith("torch.nn")
                and not isinstance(m, (nn.Sequential, nn.ModuleList, nn.ModuleDict)))


def _key(target: str) -> str:
    return target.replace(".", "__")


class FusedArray(nn.Module):
    """``B`` models as one: the fused ops in ``fused`` (by the original op name, dots as
    ``__``), the walk in ``steps`` (module docstring)."""

    def __init__(self, B: int, template: nn.Module, steps: list[tuple[Any, ...]],
                 fused: dict[str, nn.Module], shared: dict[str, nn.Module],
                 input_mode: str) -> None:
        super().__init__()
        self.B = B
        self.steps = steps
        self.fused = nn.ModuleDict(fused)
        self.shared = nn.ModuleDict(shared)
        self.input_mode = input_mode
        self.modes: dict[str, str] = {name: "fused" for name in fused}
        #: the whole model run once per model on its slices (no layouts, no fused kernels)
        self.separate = False
        self._template = [template]  # a list: not a submodule, not in state_dict
        self._meta = [copy.deepcopy(template).to("meta")]

    # ------------------------------------------------------------------ modes

    @property
    def op_names(self) -> list[str]:
        """The ops with parameters, in forward order (their names in the original model)."""
        return [k.replace("__", ".") for k in self.fused]

    def set_mode(self, op: str, mode: str) -> None:
        if mode not in ("fused", "serial"):
            raise QsyncInputError(f"mode: expected fused or serial, got {mode!r}")
        k = _key(op)
        if k not in self.fused:
            raise QsyncInputError(f"op: {op!r} is not an op of the array; its ops: "
                                  f"{', '.join(self.op_names[:6])}, ...")
        self.modes[k] = mode

    def set_modes(self, modes: dict[str, str]) -> None:
        for op, m in modes.items():
            self.set_mode(op, m)

    def mode_of(self, op: str) -> str:
        return self.modes[_key(op)]

    # ------------------------------------------------------------------ forward

    def _input(self, x: Tensor, consumer: str) -> Tensor:
        B = self.B
        if self.input_mode == "per_model":
            if x.shape[0] != B:
                raise QsyncInputError(f"inputs: per-model inputs have the model axis first "
                                      f"({B}), got shape {tuple(x.shape)}")
            return H.fold(x) if consumer == "C" else x
        if consumer == "C":
            return x.repeat(1, B, *([1] * (x.dim() - 2)))
        if consumer == "ids":
            return x
        return x.unsqueeze(0).expand(B, *x.shape)

    def forward(self, *inputs: Tensor) -> Tensor:
        if self.separate:
            return self._forward_separate(inputs)
        env: dict[str, Any] = {}
        it = iter(inputs)
        out: Any = None
        for step in self.steps:
            kind, name = step[0], step[1]
            if kind == "input":
                env[name] = next(it)
            elif kind == "enter":  # the input, in the layout its first consumer takes
                env[name] = self._input(env[step[2]], step[3])
            elif kind == "fused":
                k, arg = step[2], step[3]
                mod = self.fused[k]
                x = env[arg]
                if self.modes[k] == "serial":
                    env[name] = serial_forward(mod, x, self.B, self.input_mode == "replicated")
                elif isinstance(mod, H.FusedEmbedding):
                    env[name] = mod(x, replicated=self.input_mode == "replicated"
                                    and step[3].endswith("__ids"))
                else:
                    env[name] = mod(x)
            elif kind == "shared":
                env[name] = self.shared[step[2]](*[env[a] if isinstance(a, str) and a in env
                                                   else a for a in step[3]])
            elif kind == "fn":
                fn, args, kwargs = step[2], step[3], step[4]
                env[name] = fn(*[_get(env, a) for a in args],
                               **{kk: _get(env, v) for kk, v in kwargs.items()})
            elif kind == "flatten":
                env[name] = H.conv_to_linear(env[step[2]], self.B)
            elif kind == "output":
                out = env[step[2]]
        return out

    def _forward_separate(self, inputs: Sequence[Tensor]) -> Tensor:
        """Model ``b``'s own code on model ``b``'s slices of the fused parameters, ``B``
        times: the measured fallback when fusing loses (every op's result is the standalone
        model's; gradients flow into the fused parameters)."""
        from torch.func import functional_call

        base = self._meta[0]
        base.train(self.training)
        counters = []
        outs = []
        for b in range(self.B):
            state: dict[str, Tensor] = {}
            for k, mod in self.fused.items():
                target = k.replace("__", ".")
                for n, prm in mod.named_parameters(recurse=False):
                    state[f"{target}.{n}"] = prm[b]
                for n, buf in mod.named_buffers(recurse=False):
                    if buf.dim() == 0:  # a count shared by the B models: stepped once below
                        if b == 0:
                            counters.append(buf)
                        state[f"{target}.{n}"] = buf.clone()
                    else:
                        state[f"{target}.{n}"] = buf[b]
            xs = tuple(x if self.input_mode == "replicated" else x[b] for x in inputs)
            outs.append(functional_call(base, state, xs))
        if self.training:
            for t in counters:
                t.add_(1)
        return torch.stack(outs)

    # ------------------------------------------------------------------ export

    def named_model_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(the parameter's name in the standalone model, its fused ``[B, ...]`` tensor)."""
        out = []
        for k, mod in self.fused.items():
            target = k.replace("__", ".")
            out += [(f"{target}.{n}", prm) for n, prm in mod.named_parameters(recurse=False)]
        return out

    def export(self, b: int) -> nn.Module:
        """Model ``b`` as a standalone model of the original class (its weights copied)."""
        if not 0 <= b < self.B:
            raise QsyncInputError(f"model: expected 0 to {self.B - 1}, got {b}")
        model = copy.deepcopy(self._template[0])
        for k, fmod in self.fused.items():
            mod: Any = fmod
            target = k.replace("__", ".")
            parent, _, leaf = target.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, leaf, mod.export(b))
        return model

    def load_models(self, models: Sequence[nn.Module]) -> None:
        """Copy ``B`` standalone models' weights and buffers into the array."""
        if len(models) != self.B:
            raise QsyncInputError(f"models: the array holds {self.B}, got {len(models)}")
        for k, mod in self.fused.items():
            target = k.replace("__", ".")
            subs = [m.get_submodule(target) for m in models]
            cls: Any = type(mod)
            cls.from_modules([copy.deepcopy(subs[0])] * self.B)  # the same kind and shape
            with torch.no_grad():
                for n, t in [*mod.named_parameters(recurse=False),
                             *mod.named_buffers(recurse=False)]:
                    if t.dim() == 0:  # a count shared by the B models: the largest
                        t.fill_(max(int(getattr(sm, n)) for sm in subs))
                        continue
                    for b, sm in enumerate(subs):
                        src = getattr(sm, n)
                        t[b].copy_(src.reshape(t[b].shape))


class _Ref(str):
    """A reference to a value of the walk (a node name), as opposed to a string constant."""


def _get(env: dict[str, Any], a: Any) -> Any:
    if isinstance(a, _Ref):
        return env[a]
    if isinstance(a, (tuple, list)):
        return type(a)(_get(env, x) for x in a)
    return a


def serial_forward(mod: nn.Module, x: Tensor, B: int, replicated: bool) -> Tensor:
    """``mod``'s op as ``B`` calls on its parameters' slices: the input split per model, the
    outputs joined, in the op's layout. Integer and fp8 precisions already run one call per
    model (each model's own quantization scale), so they run as they are."""
    from ..precision import Precision

    p = Precision(getattr(mod, "precision", Precision.fp32))
    if p not in (Precision.fp32, Precision.tf32):
        return mod(x)
    if isinstance(mod, H.FusedConv2d):
        xs = x.view(x.shape[0], B, -1, *x.shape[2:]).unbind(1)
        w, bias = mod.weight, mod.bias
        outs = [F.conv2d(xs[b], w[b], None if bias is None else bias[b], mod.stride,
                         mod.padding, mod.dilation, mod.groups) for b in range(B)]
        return torch.cat(outs, 1)
    if isinstance(mod, H.FusedBatchNorm2d):
        factor, use_batch, keep = mod.step_statistics()
        xs = x.view(x.shape[0], B, -1, *x.shape[2:]).unbind(1)
        outs = []
        for b in range(B):
            rm = mod.running_mean[b] if keep and mod.running_mean is not None else None
            rv = mod.running_var[b] if keep and mod.running_var is not None else None
            outs.append(F.batch_norm(xs[b], rm, rv,
                                     None if mod.weight is None else mod.weight[b],
                                     None if mod.bias is None else mod.bias[b],
                                     use_batch, factor, mod.eps))
        return torch.cat(outs, 1)
    if isinstance(mod, H.FusedLinear):
        return torch.stack([F.linear(x[b], mod.weight[b],
                                     None if mod.bias is None else mod.bias[b])
                            for b in range(B)])
    if isinstance(mod, H.FusedLayerNorm):
        return torch.stack([F.layer_norm(x[b], mod.normalized_shape,
                                         None if mod.weight is None else mod.weight[b],
                                         None if mod.bias is None else mod.bias[b], mod.eps)
                            for b in range(B)])
    if isinstance(mod, H.FusedEmbedding):
        return torch.stack([F.embedding(x if replicated else x[b], mod.weight[b],
                                        mod.padding_idx, mod.max_norm, mod.norm_type,
                                        mod.scale_grad_by_freq) for b in range(B)])
    raise QsyncInputError(f"hfta: no serial form of {type(mod).__name__}")


def fuse(models: Sequence[nn.Module], *, input_mode: str = "per_model") -> FusedArray:
    """Fuse ``B`` standalone models of one architecture into a :class:`FusedArray`."""
    if input_mode not in INPUT_MODES:
        raise QsyncInputError(f"input mode: expected per_model or replicated, got "
                              f"{input_mode!r}")
    if not models:
        raise QsyncInputError("models: expected at least one")
    B = len(models)
    classes = {type(m) for m in models}
    if len(classes) != 1:
        raise QsyncInputError(f"models: one architecture, got {sorted(c.__name__ for c in classes)}")
    template = models[0]
    graph = _Tracer().trace(template)
    layout: dict[str, str] = {}  # node -> "in", "C", "M", or "other" (a Python value)
    steps: list[tuple[Any, ...]] = []
    fused: dict[str, nn.Module] = {}
    shared: dict[str, nn.Module] = {}
    entered: dict[tuple[str, str], str] = {}

    def need(a: fx.Node, want: str, who: str) -> str:
        """``a``'s value name in layout ``want`` (the input enters it on first use)."""
        lay = layout.get(a.name)
        if lay == "in":
            key = (a.name, want)
            if key not in entered:
                entered[key] = f"{a.name}__{want}"
                steps.append(("enter", entered[key], a.name, want))
                layout[entered[key]] = "M" if want == "ids" else want
            return entered[key]
        if lay == want or (want == "ids" and lay == "M"):
            return a.name
        raise QsyncInputError(f"hfta: {who} takes the {_NAMES[want]} layout, but its input "
                              f"{a.name!r} is {_NAMES.get(lay or '', lay)}; this model has no "
                              "fused form here (use the torch.func route)")

    for n in graph.nodes:
        if n.op == "placeholder":
            steps.append(("input", n.name))
            layout[n.name] = "in"
        elif n.op == "call_module":
            mods = [m.get_submodule(str(n.target)) for m in models]
            m0 = mods[0]
            x = n.args[0] if n.args else None
            if not isinstance(x, fx.Node) or len(n.args) != 1 or n.kwargs:
                raise QsyncInputError(f"hfta: module {n.target!r} is called with "
                                      f"{len(n.args)} arguments; only single-input modules fuse")
            fcls: Any = next((f for t, f in _FUSED.items() if type(m0) is t), None)
            if fcls is not None:
                want = _LAYOUT[fcls]
                if fcls is H.FusedEmbedding:
                    want = "ids"
                src = need(x, want, f"{n.target} ({type(m0).__name__})")
                k = _key(str(n.target))
                fused[k] = fcls.from_modules(mods)
                steps.append(("fused", n.name, k, src))
                layout[n.name] = _LAYOUT[fcls]
            elif isinstance(m0, nn.Flatten):
                if (m0.start_dim, m0.end_dim) != (1, -1):
                    raise QsyncInputError(f"hfta: {n.target}: only Flatten(1, -1) fuses")
                steps.append(("flatten", n.name, need(x, "C", str(n.target))))
                layout[n.name] = "M"
            elif isinstance(m0, _STATELESS):
                lay = layout.get(x.name)
                if isinstance(m0, _SPATIAL):
                    src = need(x, "C", f"{n.target} ({type(m0).__name__})")
                elif lay == "in":
                    raise QsyncInputError(f"hfta: {n.target} reads the input directly; "
                                          "no fused form")
                else:
                    src = x.name
                k = _key(str(n.target))
                shared[k] = m0
                steps.append(("shared", n.name, k, (src,)))
                layout[n.name] = layout[src]
            else:
                raise QsyncInputError(f"hfta: module {n.target!r} ({type(m0).__name__}) has "
                                      "no fused form (fused: Conv2d, BatchNorm2d, Linear, "
                                      "LayerNorm, Embedding; shared: activations, pooling, "
                                      "dropout)")
        elif n.op in ("call_function", "call_method"):
            fn = n.target
            if n.op == "call_method":
                if fn == "flatten":
                    fn = torch.flatten
                elif fn in ("relu", "sigmoid", "tanh"):
                    fn = getattr(torch, str(fn))
                else:
                    raise QsyncInputError(f"hfta: method .{fn}() of {n.args[0]} has no fused "
                                          "form")
            if fn is torch.flatten:
                args = list(n.args) + [None] * 3
                start = n.kwargs.get("start_dim", args[1] if args[1] is not None else 0)
                end = n.kwargs.get("end_dim", args[2] if args[2] is not None else -1)
                x = n.args[0]
                if (start, end) != (1, -1) or not isinstance(x, fx.Node):
                    raise QsyncInputError(f"hfta: {n.name}: only flatten(x, 1) fuses")
                steps.append(("flatten", n.name, need(x, "C", n.name)))
                layout[n.name] = "M"
                continue
            nodes = [a for a in n.all_input_nodes]
            lays = {layout.get(a.name) for a in nodes}
            if fn in _SPATIAL_FNS:
                if lays != {"C"}:
                    raise QsyncInputError(f"hfta: {n.name} pools a tensor that is not "
                                          "channel-folded")
            elif fn not in _ELEMENTWISE_FNS:
                raise QsyncInputError(f"hfta: function {getattr(fn, '__name__', fn)} "
                                      f"({n.name}) has no fused form")
            if len(lays) != 1 or lays & {"in", None}:
                raise QsyncInputError(f"hfta: {n.name} combines values of different layouts "
                                      f"({', '.join(sorted(map(str, lays)))}); no fused form")

            def ref(a: Any) -> Any:
                if isinstance(a, fx.Node):
                    return _Ref(a.name)
                if isinstance(a, (tuple, list)):
                    return type(a)(ref(x) for x in a)
                return a

            steps.append(("fn", n.name, fn, tuple(ref(a) for a in n.args),
                          {k: ref(v) for k, v in n.kwargs.items()}))
            layout[n.name] = str(lays.pop())
        elif n.op == "get_attr":
            raise QsyncInputError(f"hfta: {n.target!r} is a tensor read outside a module; no "
                                  "fused form")
        elif n.op == "output":
            res = n.args[0]
            if not isinstance(res, fx.Node) or layout.get(res.name) != "M":
                raise QsyncInputError("hfta: the model's output must be one tensor out of a "
                                      "linear head (model-major)")
            steps.append(("output", "", res.name))
    return FusedArray(B, template, steps, fused, shared, input_mode)


_NAMES = {"C": "channel-folded", "M": "model-major", "ids": "token-id", "in": "raw input"}
