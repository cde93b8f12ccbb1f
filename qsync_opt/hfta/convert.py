"""A workload's model as a B-array: ``B`` standalone models fused into one module.

:func:`fuse` traces the first model with ``torch.fx`` (torch.nn leaf modules, and the
attention :class:`~qsync_opt.models.layers.MatMul`) and walks its graph once, giving every
value a layout (:mod:`qsync_opt.hfta`):

* ``C``, channel-folded ``[N, B*C, H, W]``: through a conv trunk (Conv2d, BatchNorm2d,
  pooling and elementwise ops run on it unchanged);
* ``M``, model-major ``[B, *per_model_shape]`` of any rank: the model axis first, model
  ``b``'s value at index ``b`` (the linear head ``[B, N, F]``, a transformer's
  ``[B, N, T, D]`` hidden states, its ``[B, N, H, T, T]`` attention scores, the tuple of
  model-major chunks ``split`` gives);
* ``S``, shared by all models, no model axis: buffers read outside a module (a causal mask,
  position ids: equal in every model, else refused), what is computed from them alone
  (``narrow``, ``arange``, ``logical_not``), sizes, the replicated input.

Each op with parameters becomes its fused operator built from the ``B`` models' own modules
(:mod:`.ops`): Conv2d, BatchNorm2d (``C``), Linear, LayerNorm (``M``, any rank), Embedding
(ids ``M`` ``[B, *S]`` or shared ``[*S]``, both giving ``[B, *S, D]``); an attention
``MatMul`` becomes :class:`~.ops.FusedMatMul` (no parameters; it carries a plan's precision).
A tensor parameter two modules share (GPT's ``lm_head.weight`` is ``transformer.wte.weight``)
is one fused ``[B, ...]`` Parameter of both fused ops, so both uses' gradients add as in the
standalone model, and :meth:`FusedArray.export` ties it again. Stateless modules (ReLU,
GELU, pooling, dropout, identity) run unchanged on either layout; ``torch.flatten(x, 1)`` (or
``nn.Flatten``) of a channel-folded tensor becomes :func:`~.ops.conv_to_linear`.

Shape-aware ops on a model-major value are translated: dims given as non-negative ints
shift by one past the model axis (transpose, permute, split / chunk / unbind, flatten,
unflatten, narrow, select, squeeze / unsqueeze, softmax / log_softmax, cumsum, movedim,
sum / mean, cat / stack), negative dims stay; ``x.size(d)`` / ``x.shape`` / ``x.dim()`` read
the per-model sizes; ``view`` / ``reshape`` / ``expand`` / ``repeat`` get the model axis
prepended; indexing keeps it. Elementwise ops, ``masked_fill``, ``torch.where`` and
``scaled_dot_product_attention`` broadcast as the standalone model does: a shared tensor
right-aligned against the per-model shape, and a model-major value of lower per-model rank
than the others (or than a shared operand) gets singleton dims after its model axis.
``torch.matmul`` / ``@`` / ``bmm`` / MatMul of model-major values is a batched matmul. A
channel-folded value read by any other op is viewed model-major first
(:func:`~.ops.unfold`). An op the walk cannot place (an unknown module, a function it has
no translation for, a parameter read outside a module, a buffer that differs between the
models, indexing by a per-model tensor, random numbers drawn for a shared value) is
refused, naming it; the torch.func route (:mod:`.functional`) runs any model.

Inputs: ``per_model`` (each model its own stream: ``[B, N, ...]``, model-major) or
``replicated`` (one ``[N, ...]`` batch for all ``B``, a shared value: copied into each
model's channels for a conv, broadcast for a Linear, looked up by every model's table for an
Embedding; the models then differ only in weights and hyper-parameters, not in data, so
they are not separate runs of a seed sweep); the output is ``[B, N, ...]``.

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
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.hfta import ops as H
from qsync_opt.models.layers import MatMul

__all__ = ["FusedArray", "INPUT_MODES", "batched_matmul", "fuse", "serial_forward"]

INPUT_MODES = ("per_model", "replicated")

#: Modules that hold no parameters and act per element or per channel: shared by all B.
_STATELESS = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.LeakyReLU,
              nn.Dropout, nn.Identity, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d,
              nn.Hardswish, nn.Hardsigmoid)
_SPATIAL = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d)
_SPATIAL_FN_NAMES = {"adaptive_avg_pool2d", "max_pool2d", "avg_pool2d"}
_FUSED = {nn.Conv2d: H.FusedConv2d, nn.BatchNorm2d: H.FusedBatchNorm2d,
          nn.Linear: H.FusedLinear, nn.LayerNorm: H.FusedLayerNorm,
          nn.Embedding: H.FusedEmbedding}
#: The layout each fused op takes (and gives); the Embedding takes ids M or S, gives M.
_LAYOUT = {H.FusedConv2d: "C", H.FusedBatchNorm2d: "C", H.FusedLinear: "M",
           H.FusedLayerNorm: "M", H.FusedEmbedding: "M"}

#: Functions the walk knows, by the name the translation tables below use (methods go by
#: their own name).
_FN_NAMES: dict[Any, str] = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
    operator.floordiv: "floordiv", operator.pow: "pow", operator.neg: "neg",
    operator.iadd: "add_", operator.isub: "sub_", operator.imul: "mul_",
    operator.itruediv: "div_", operator.matmul: "matmul", operator.getitem: "getitem",
    operator.eq: "eq", operator.ne: "ne", operator.lt: "lt", operator.le: "le",
    operator.gt: "gt", operator.ge: "ge", operator.and_: "logical_and",
    operator.or_: "logical_or", operator.invert: "logical_not",
    getattr: "getattr",
    torch.add: "add", torch.sub: "sub", torch.mul: "mul", torch.div: "div",
    torch.pow: "pow", torch.neg: "neg", torch.exp: "exp", torch.log: "log",
    torch.sqrt: "sqrt", torch.rsqrt: "rsqrt", torch.abs: "abs", torch.tanh: "tanh",
    torch.sigmoid: "sigmoid", torch.relu: "relu", torch.erf: "erf", torch.where: "where",
    torch.maximum: "maximum", torch.minimum: "minimum", torch.clamp: "clamp",
    torch.masked_fill: "masked_fill", torch.logical_not: "logical_not",
    torch.logical_and: "logical_and", torch.logical_or: "logical_or", torch.eq: "eq",
    torch.ne: "ne", torch.lt: "lt", torch.le: "le", torch.gt: "gt", torch.ge: "ge",
    F.relu: "relu", F.gelu: "gelu", F.silu: "silu", F.sigmoid: "sigmoid", F.tanh: "tanh",
    F.leaky_relu: "leaky_relu", F.softplus: "softplus", F.hardswish: "hardswish",
    F.hardsigmoid: "hardsigmoid", F.relu6: "relu6", F.elu: "elu", F.mish: "mish",
    F.dropout: "dropout", torch.dropout: "dropout",
    F.scaled_dot_product_attention: "scaled_dot_product_attention",
    torch.softmax: "softmax", F.softmax: "softmax", torch.log_softmax: "log_softmax",
    F.log_softmax: "log_softmax", torch.transpose: "transpose", torch.swapaxes: "swapaxes",
    torch.swapdims: "swapdims", torch.permute: "permute", torch.flatten: "flatten",
    torch.unflatten: "unflatten", torch.narrow: "narrow", torch.select: "select",
    torch.split: "split", torch.chunk: "chunk", torch.unbind: "unbind",
    torch.squeeze: "squeeze", torch.unsqueeze: "unsqueeze", torch.cumsum: "cumsum",
    torch.movedim: "movedim", torch.sum: "sum", torch.mean: "mean", torch.cat: "cat",
    torch.concat: "cat", torch.stack: "stack", torch.reshape: "reshape",
    torch.matmul: "matmul", torch.bmm: "matmul",
    torch.zeros_like: "zeros_like", torch.ones_like: "ones_like",
    torch.full_like: "full_like", torch.empty_like: "empty_like",
    torch.rand_like: "rand_like", torch.randn_like: "randn_like",
    torch.rand: "rand", torch.randn: "randn", torch.randint: "randint",
    torch.randperm: "randperm", torch.normal: "normal", torch.bernoulli: "bernoulli",
    torch.multinomial: "multinomial",
    F.adaptive_avg_pool2d: "adaptive_avg_pool2d", F.max_pool2d: "max_pool2d",
    F.avg_pool2d: "avg_pool2d",
}
#: Ops that act per element (or broadcast their operands' leading dims, as attention does).
_BROADCAST = {"add", "sub", "mul", "div", "truediv", "floordiv", "pow", "neg", "add_", "sub_",
              "mul_", "div_", "exp", "log", "sqrt", "rsqrt", "abs", "tanh", "sigmoid", "relu",
              "relu_", "erf", "where", "maximum", "minimum", "clamp", "clamp_", "masked_fill",
              "masked_fill_", "logical_not", "logical_and", "logical_or", "eq", "ne", "lt",
              "le", "gt", "ge", "gelu", "silu", "leaky_relu", "softplus", "hardswish",
              "hardsigmoid", "relu6", "elu", "mish", "dropout", "reciprocal", "square",
              "sin", "cos", "scaled_dot_product_attention"}
#: Of those, the ops whose result has the first operand's shape (a shared first operand is
#: broadcast to the models first).
_SELF_SHAPED = {"masked_fill", "masked_fill_", "add_", "sub_", "mul_", "div_", "clamp_",
                "relu_"}
#: Ops whose result has the layout of their first operand (dtype, device, copies, likes).
_LIKE = {"contiguous", "float", "double", "half", "bfloat16", "to", "type_as", "type",
         "clone", "detach", "cpu", "cuda", "requires_grad_", "zeros_like", "ones_like",
         "full_like", "empty_like", "rand_like", "randn_like"}
#: Methods that make a new tensor of a given size (no model axis: shared).
_FRESH = {"new_zeros", "new_ones", "new_full", "new_empty", "new_tensor"}
#: Ops that draw random numbers: on a shared value every model would draw the same.
_RANDOM = {"rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial",
           "rand_like", "randn_like", "bernoulli_", "normal_", "uniform_", "random_",
           "exponential_", "dropout"}
#: The attributes of a tensor the walk reads (``shape`` and ``ndim`` per model).
_ATTRS = {"shape", "ndim", "dtype", "device", "is_cuda", "requires_grad", "layout"}

_REQUIRED, _EVERY = "required", "every"
#: The dim arguments of shape ops: op -> ((position in the call's arguments, the tensor
#: first; keyword; default), ...). A default int is shifted as given ones are; _REQUIRED: the
#: call must give it; _EVERY: absent means every dim (each op's own reading of that).
_DIM_ARGS: dict[str, tuple[tuple[int, str, Any], ...]] = {
    "softmax": ((1, "dim", _REQUIRED),), "log_softmax": ((1, "dim", _REQUIRED),),
    "narrow": ((1, "dim", _REQUIRED),), "unflatten": ((1, "dim", _REQUIRED),),
    "select": ((1, "dim", _REQUIRED),), "cumsum": ((1, "dim", _REQUIRED),),
    "unsqueeze": ((1, "dim", _REQUIRED),),
    "transpose": ((1, "dim0", _REQUIRED), (2, "dim1", _REQUIRED)),
    "swapaxes": ((1, "axis0", _REQUIRED), (2, "axis1", _REQUIRED)),
    "swapdims": ((1, "dim0", _REQUIRED), (2, "dim1", _REQUIRED)),
    "movedim": ((1, "source", _REQUIRED), (2, "destination", _REQUIRED)),
    "flatten": ((1, "start_dim", 0), (2, "end_dim", -1)),
    "split": ((2, "dim", 0),), "chunk": ((2, "dim", 0),), "unbind": ((1, "dim", 0),),
    "squeeze": ((1, "dim", _EVERY),), "sum": ((1, "dim", _EVERY),),
    "mean": ((1, "dim", _EVERY),), "size": ((1, "dim", _EVERY),),
    "cat": ((1, "dim", 0),), "stack": ((1, "dim", 0),),
}
#: Ops that give a tuple of model-major values.
_SEQUENCES = {"split", "chunk", "unbind"}

_NAMES = {"C": "channel-folded", "M": "model-major", "S": "shared (no model axis)",
          "Ms": "a tuple of model-major values"}


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, MatMul):  # a named attention matmul: a plan gives it a precision
            return True
        return (type(m).__module__.startswith("torch.nn")
                and not isinstance(m, (nn.Sequential, nn.ModuleList, nn.ModuleDict)))


def _key(target: str) -> str:
    return target.replace(".", "__")


class FusedArray(nn.Module):
    """``B`` models as one: the fused ops in ``fused`` (by the original op name, dots as
    ``__``), the attention matmuls in ``matmuls``, the buffers read outside a module in
    ``consts``, the walk in ``steps`` (module docstring)."""

    def __init__(self, B: int, template: nn.Module, steps: list[tuple[Any, ...]],
                 fused: dict[str, nn.Module], shared: dict[str, nn.Module],
                 input_mode: str, *, matmuls: dict[str, nn.Module] | None = None,
                 consts: dict[str, tuple[str, Tensor]] | None = None,
                 shared_ids: dict[str, bool] | None = None,
                 ties: Sequence[tuple[str, tuple[str, ...], str]] = ()) -> None:
        super().__init__()
        self.B = B
        self.steps = steps
        self.fused = nn.ModuleDict(fused)
        self.shared = nn.ModuleDict(shared)
        self.matmuls = nn.ModuleDict(matmuls or {})
        self.consts = nn.Module()
        #: const key -> the buffer's name in the standalone model
        self.const_targets: dict[str, str] = {}
        for k, (target, t) in (consts or {}).items():
            self.consts.register_buffer(k, t, persistent=False)
            self.const_targets[k] = target
        self.input_mode = input_mode
        self.modes: dict[str, str] = {name: "fused" for name in fused}
        #: embedding key -> its ids are shared by the models (position ids, replicated ids)
        self.shared_ids: dict[str, bool] = dict(shared_ids or {})
        #: tied parameters: (the fused op's parameter path that holds the tensor, every name
        #: of it in the standalone model, the name the standalone's ``named_parameters`` gives)
        self.ties: list[tuple[str, tuple[str, ...], str]] = list(ties)
        #: the whole model run once per model on its slices (no layouts, no fused kernels)
        self.separate = False
        self._template = [template]  # a list: not a submodule, not in state_dict
        self._meta = [copy.deepcopy(template).to("meta")]

    # ------------------------------------------------------------------ modes

    @property
    def op_names(self) -> list[str]:
        """The ops with parameters, in forward order (their names in the original model)."""
        return [k.replace("__", ".") for k in self.fused]

    @property
    def matmul_names(self) -> list[str]:
        """The attention matmuls (no parameters, one batched call; a plan's precision)."""
        return [k.replace("__", ".") for k in self.matmuls]

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

    def call_op(self, op: str, x: Tensor, mode: str | None = None) -> Tensor:
        """Op ``op`` (with parameters) on its input ``x`` in its layout, ``mode`` fused or
        serial (default: the op's mode); an Embedding reads its ids as the walk found them
        (shared or per model)."""
        k = _key(op)
        mod = self.fused[k]
        shared = self.shared_ids.get(k, False)
        if (mode or self.modes[k]) == "serial":
            return serial_forward(mod, x, self.B, shared)
        if isinstance(mod, H.FusedEmbedding):
            out: Tensor = mod(x, replicated=shared)
            return out
        out = mod(x)
        return out

    def forward(self, *inputs: Tensor) -> Tensor:
        if self.separate:
            return self._forward_separate(inputs)
        env: dict[str, Any] = {}
        it = iter(inputs)
        out: Any = None
        B = self.B
        for step in self.steps:
            kind, name = step[0], step[1]
            if kind == "input":
                x = next(it)
                if (self.input_mode == "per_model" and isinstance(x, Tensor)
                        and (x.dim() == 0 or x.shape[0] != B)):
                    raise QsyncInputError(f"inputs: per-model inputs have the model axis "
                                          f"first ({B}), got shape {tuple(x.shape)}")
                env[name] = x
            elif kind == "convert":
                env[name] = _convert(env[step[2]], step[3], B, step[4])
            elif kind == "const":
                env[name] = self.consts.get_buffer(step[2])
            elif kind == "fused":
                env[name] = self.call_op(step[2], env[step[3]])
            elif kind == "matmul":
                _, _, k, a, am, b, bm = step
                env[name] = batched_matmul(env[a], am, env[b], bm, B, self.matmuls[k])
            elif kind == "shared":
                env[name] = self.shared[step[2]](env[step[3]])
            elif kind == "op":
                _, _, rule, call, op, args, kwargs, majors = step
                env[name] = _RULES[rule](B, call, op, _get(env, args, majors),
                                         _get(env, kwargs, majors))
            elif kind == "flatten":
                env[name] = H.conv_to_linear(env[step[2]], B)
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
        buffers = dict(base.named_buffers())
        counters = []
        outs = []
        for b in range(self.B):
            state: dict[str, Tensor] = {}
            slices: dict[int, Tensor] = {}  # a tied tensor: one slice object for its names
            for k, mod in self.fused.items():
                target = k.replace("__", ".")
                for n, prm in mod.named_parameters(recurse=False):
                    if id(prm) not in slices:
                        slices[id(prm)] = prm[b]
                    state[f"{target}.{n}"] = slices[id(prm)]
                for n, buf in mod.named_buffers(recurse=False):
                    if buf.dim() == 0:  # a count shared by the B models: stepped once below
                        if b == 0:
                            counters.append(buf)
                        state[f"{target}.{n}"] = buf.clone()
                    else:
                        state[f"{target}.{n}"] = buf[b]
            for k, target in self.const_targets.items():
                if target in buffers:  # a registered buffer (meta in the copy): the real one
                    state[target] = self.consts.get_buffer(k)
            xs = tuple(x if self.input_mode == "replicated" else x[b] for x in inputs)
            outs.append(functional_call(base, state, xs))
        if self.training:
            for t in counters:
                t.add_(1)
        return torch.stack(outs)

    # ------------------------------------------------------------------ export

    def named_model_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(the parameter's name in the standalone model, its fused ``[B, ...]`` tensor), each
        fused tensor once: a tied one under the name the standalone model's
        ``named_parameters()`` gives it."""
        canonical = {path: name for path, _, name in self.ties}
        out = []
        seen: set[int] = set()
        for k, mod in self.fused.items():
            target = k.replace("__", ".")
            for n, prm in mod.named_parameters(recurse=False):
                if id(prm) in seen:
                    continue
                seen.add(id(prm))
                path = f"{target}.{n}"
                out.append((canonical.get(path, path), prm))
        return out

    def export(self, b: int) -> nn.Module:
        """Model ``b`` as a standalone model of the original class (its weights copied; a
        tied parameter tied again), on the array's device."""
        if not 0 <= b < self.B:
            raise QsyncInputError(f"model: expected 0 to {self.B - 1}, got {b}")
        model = copy.deepcopy(self._template[0])
        for k, fmod in self.fused.items():
            mod: Any = fmod
            target = k.replace("__", ".")
            parent, _, leaf = target.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, leaf, mod.export(b))
        for path, names, _ in self.ties:
            prm = model.get_parameter(path)
            for alias in names:
                if alias != path:
                    parent, _, leaf = alias.rpartition(".")
                    setattr(model.get_submodule(parent) if parent else model, leaf, prm)
        held = next(iter([*self.parameters(), *self.buffers()]), None)
        if held is not None:  # the template's own tensors (buffers read outside the fused
            model.to(held.device)  # ops) follow the array to its device
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


# ----------------------------------------------------------------------------- runtime


class _Ref(str):
    """A reference to a value of the walk (a node name), as opposed to a string constant."""


class _Major:
    """A model-major tensor handed to a translation rule (the rules see which operands have
    the model axis)."""

    __slots__ = ("t",)

    def __init__(self, t: Tensor) -> None:
        self.t = t


def _get(env: dict[str, Any], a: Any, majors: frozenset[str] = frozenset()) -> Any:
    """``a`` with its references resolved; the model-major ones wrapped in :class:`_Major`."""
    if isinstance(a, _Ref):
        v = env[a]
        if a in majors:
            return (type(v)(_Major(t) for t in v) if isinstance(v, (tuple, list))
                    else _Major(v))
        return v
    if isinstance(a, (tuple, list)):
        return type(a)(_get(env, x, majors) for x in a)
    if isinstance(a, dict):
        return {k: _get(env, v, majors) for k, v in a.items()}
    if isinstance(a, slice):
        return slice(_get(env, a.start, majors), _get(env, a.stop, majors),
                     _get(env, a.step, majors))
    return a


def _unwrap(a: Any) -> Any:
    if isinstance(a, _Major):
        return a.t
    if isinstance(a, (tuple, list)):
        return type(a)(_unwrap(x) for x in a)
    if isinstance(a, dict):
        return {k: _unwrap(v) for k, v in a.items()}
    if isinstance(a, slice):
        return slice(_unwrap(a.start), _unwrap(a.stop), _unwrap(a.step))
    return a


def _invoke(call: Callable[..., Any] | str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    if isinstance(call, str):
        return getattr(args[0], call)(*args[1:], **kwargs)
    return call(*args, **kwargs)


def _with_singletons(t: Tensor, k: int) -> Tensor:
    """Model-major ``t`` with ``k`` singleton dims after its model axis (a view)."""
    return t[(slice(None),) + (None,) * k] if k > 0 else t


def _expand_shared(t: Any, B: int, who: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise QsyncInputError(f"hfta: {who}: expected a tensor to give every model, got "
                              f"{type(t).__name__}")
    return t.unsqueeze(0).expand(B, *t.shape)


def _convert(x: Any, how: str, B: int, who: str) -> Any:
    """A value moved between layouts (module docstring): fold / unfold between model-major
    and channel-folded, a shared tensor expanded to every model or repeated into each
    model's channels."""
    if how == "fold":
        return H.fold(x)
    if how == "unfold":
        return H.unfold(x, B)
    if how == "expand":
        return _expand_shared(x, B, who)
    if not isinstance(x, Tensor) or x.dim() < 2:
        raise QsyncInputError(f"hfta: {who}: expected a shared [N, C, ...] tensor to copy "
                              f"into each model's channels, got {x!r:.60}")
    return x.repeat(1, B, *([1] * (x.dim() - 2)))


def _shift(d: Any, op: str) -> Any:
    """A dim of the per-model value as a dim of the model-major one."""
    if isinstance(d, bool) or d is None:
        return d
    if isinstance(d, int):
        return d + 1 if d >= 0 else d
    if isinstance(d, (tuple, list)):
        return type(d)(_shift(x, op) for x in d)
    raise QsyncInputError(f"hfta: {op}: dim {d!r}: expected an int or a tuple of ints")


def _rule_shared(B: int, call: Any, op: str, args: Any, kwargs: Any) -> Any:
    """The call as written (no operand has the model axis, or the result keeps the layout
    of the first operand)."""
    return _invoke(call, _unwrap(args), _unwrap(kwargs))


def _rule_broadcast(B: int, call: Any, op: str, args: Any, kwargs: Any) -> Any:
    leaves: list[Any] = []

    def collect(v: Any) -> None:
        if isinstance(v, (tuple, list)):
            for x in v:
                collect(x)
        elif isinstance(v, (_Major, Tensor)):
            leaves.append(v)

    collect(args)
    collect(kwargs)
    rank = max([v.t.dim() - 1 if isinstance(v, _Major) else v.dim() for v in leaves],
               default=0)

    def align(v: Any) -> Any:
        if isinstance(v, _Major):
            return _with_singletons(v.t, rank - (v.t.dim() - 1))
        if isinstance(v, (tuple, list)):
            return type(v)(align(x) for x in v)
        return v

    new_args = [align(a) for a in args]
    if op in _SELF_SHAPED and args and isinstance(args[0], Tensor):  # a shared first operand
        new_args[0] = _expand_shared(args[0], B, op)
    return _invoke(call, new_args, {k: align(v) for k, v in kwargs.items()})


def _rule_dims(B: int, call: Any, op: str, args: Any, kwargs: Any) -> Any:
    x = args[0].t
    args = list(args)
    kwargs = dict(kwargs)
    for pos, kw, default in _DIM_ARGS[op]:
        given = kwargs.get(kw, args[pos] if pos < len(args) else None)
        if given is None:
            if default is _REQUIRED:
                raise QsyncInputError(f"hfta: {op} of a model-major value needs its {kw} "
                                      "argument")
            if default is _EVERY:
                return _every_dim(x, op, args, kwargs)
            given = default
        if kw in kwargs or pos >= len(args):
            kwargs[kw] = _shift(given, op)
        else:
            args[pos] = _shift(given, op)
    return _invoke(call, _unwrap(args), _unwrap(kwargs))


def _every_dim(x: Tensor, op: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """``size()``, ``squeeze()``, ``sum()`` / ``mean()`` without a dim: over the per-model
    dims only."""
    dims = tuple(range(1, x.dim()))
    kwargs.pop("dim", None)
    if op == "size":
        return torch.Size(x.shape[1:])
    if op == "squeeze":
        ones = tuple(d for d in dims if x.shape[d] == 1)
        return x.squeeze(ones) if ones else x
    extra = {k: _unwrap(v) for k, v in kwargs.items()}
    if not dims:  # a per-model scalar: nothing to reduce (torch reads dim=() as "all")
        dtype = extra.get("dtype")
        return x.clone() if dtype is None else x.to(dtype)
    out: Tensor = getattr(x, op)(dim=dims, **extra)
    return out


def _sizes(rest: Sequence[Any], kwargs: dict[str, Any], *names: str) -> tuple[Any, ...]:
    for n in names:
        if n in kwargs:
            return tuple(kwargs[n])
    if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        return tuple(rest[0])
    return tuple(rest)


def _rule_view(B: int, call: Any, op: str, args: Any, kwargs: Any) -> Any:
    x, rest = args[0].t, _unwrap(args[1:])
    sizes = _sizes(rest, _unwrap(kwargs), "shape", "size")
    if len(sizes) == 1 and isinstance(sizes[0], torch.dtype):
        return x.view(sizes[0])
    return x.reshape(x.shape[0], *sizes)


def _rule_expand(B: int, call: Any, op: str, args: Any, kwargs: Any) -> Any:
    x, rest = args[0].t, _unwrap(args[1:])
    sizes = _sizes(rest, _unwrap(kwargs), "size", "sizes", "repeats", "dims")
    if op == "permute":
        return x.permute(0, *_shift(tuple(sizes), op))
    x = _with_singletons(x, len(sizes) - (x.dim() - 1))  # new leading per-model dims
    if op == "repeat":
        return x.repeat(1, *sizes)
    return x.expand(x.shape[0], *sizes)


def _rule_as(B: int, call: Any, op: str, args: Any, kwargs: Any) -> Any:
    x, other = args[0], args[1]
    shape = other.t.shape[1:] if isinstance(other, _Major) else other.shape
    if op == "expand_as":
        if isinstance(x, _Major):
            t = _with_singletons(x.t, len(shape) - (x.t.dim() - 1))
            return t.expand(t.shape[0], *shape)
        return x.expand(B, *shape)
    return x.t.reshape(x.t.shape[0], *shape)


def _rule_getitem(B: int, call: Any, op: str, args: Any, kwargs: Any) -> Any:
    base, idx = args[0].t, _unwrap(args[1])
    parts = idx if isinstance(idx, tuple) else (idx,)
    if sum(isinstance(p, (Tensor, list)) for p in parts) > 1:
        raise QsyncInputError("hfta: indexing a model-major value with more than one tensor "
                              "index has no fused form")
    return base[(slice(None), *parts)]


def _rule_attr(B: int, call: Any, op: str, args: Any, kwargs: Any) -> Any:
    x = args[0].t
    what = args[1] if op == "getattr" else op
    if what == "shape":
        return torch.Size(x.shape[1:])
    if what in ("ndim", "dim", "ndimension"):
        return x.dim() - 1
    if what in ("numel", "nelement"):
        return x[0].numel() if x.shape[0] else 0
    return getattr(x, what)


def _rule_cat(B: int, call: Any, op: str, args: Any, kwargs: Any) -> Any:
    seq = [v.t if isinstance(v, _Major) else _expand_shared(v, B, op) for v in args[0]]
    rest = list(args[1:])
    kwargs = dict(kwargs)
    if "dim" in kwargs:
        kwargs["dim"] = _shift(kwargs["dim"], op)
    elif rest:
        rest[0] = _shift(rest[0], op)
    else:
        kwargs["dim"] = 1
    return _invoke(call, [seq, *_unwrap(rest)], _unwrap(kwargs))


def _rule_matmul(B: int, call: Any, op: str, args: Any, kwargs: Any) -> Any:
    a = args[0]
    b = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2"))
    return batched_matmul(_unwrap(a), isinstance(a, _Major), _unwrap(b),
                          isinstance(b, _Major), B, torch.matmul)


def batched_matmul(a: Tensor, a_major: bool, b: Tensor, b_major: bool, B: int,
                   mm: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """``torch.matmul`` of the per-model operands, for all ``B`` models with one ``mm`` of
    two model-major operands of one rank (at least 3): a shared operand is given to every
    model (a view), a 1-D one gets the matrix dim torch's matmul would give it (removed from
    the result after), the lower-rank operand gets singleton batch dims after the model
    axis (torch broadcasts batch dims right-aligned)."""
    ra, rb = a.dim() - a_major, b.dim() - b_major
    if ra < 1 or rb < 1:
        raise QsyncInputError("hfta: matmul: both operands need at least one dim per model")
    if not a_major:
        a = _expand_shared(a, B, "matmul")
    if not b_major:
        b = _expand_shared(b, B, "matmul")
    if ra == 1:
        a = a.unsqueeze(-2)
    if rb == 1:
        b = b.unsqueeze(-1)
    rank = max(a.dim(), b.dim())
    out = mm(_with_singletons(a, rank - a.dim()), _with_singletons(b, rank - b.dim()))
    if ra == 1:
        out = out.squeeze(-2)
    if rb == 1:
        out = out.squeeze(-1)
    return out


_RULES: dict[str, Callable[[int, Any, str, Any, Any], Any]] = {
    "shared": _rule_shared, "broadcast": _rule_broadcast, "dims": _rule_dims,
    "view": _rule_view, "expand": _rule_expand, "as": _rule_as, "getitem": _rule_getitem,
    "attr": _rule_attr, "cat": _rule_cat, "matmul": _rule_matmul}


def serial_forward(mod: nn.Module, x: Tensor, B: int, replicated: bool) -> Tensor:
    """``mod``'s op as ``B`` calls on its parameters' slices: the input split per model, the
    outputs joined, in the op's layout (``replicated``: an Embedding's ids are shared by the
    models). Integer and fp8 precisions already run one call per model (each model's own
    quantization scale), so they run as they are."""
    from qsync_opt.core.precision import Precision

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


# ----------------------------------------------------------------------------- the walk


def _leaves(a: Any, cls: type) -> list[Any]:
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


def _nodes_in(a: Any) -> list[fx.Node]:
    return _leaves(a, fx.Node)


def _fetch(m: nn.Module, target: str) -> Any:
    obj: Any = m
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class _Walk:
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
            raise QsyncInputError(f"hfta: {who} takes the {_NAMES[want]} layout, but its input "
                                  f"{a.name!r} is {_NAMES.get(lay or '', lay)}; this model has "
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
            if n.op == "call_method":
                call: Any = str(n.target)
                op: str | None = call
                who = f"method .{call}() ({n.name})"
            else:
                call = n.target
                op = _FN_NAMES.get(call)
                who = f"function {getattr(call, '__name__', call)} ({n.name})"
            self.call(n.name, call, op, tuple(n.args), dict(n.kwargs), who)
        elif n.op == "output":
            res = n.args[0]
            lay = self.layout.get(res.name) if isinstance(res, fx.Node) else None
            if not isinstance(res, fx.Node) or lay not in ("M", "C"):
                raise QsyncInputError("hfta: the model's output must be one tensor computed "
                                      "from the models' parameters (model-major or "
                                      f"channel-folded), got {_NAMES.get(lay or '', res)}")
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
        k = _key(target)
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
        fcls: Any = next((f for t, f in _FUSED.items() if type(m0) is t), None)
        if fcls is not None:
            k = _key(target)
            if fcls is H.FusedEmbedding:
                lay = self.layout.get(x.name)
                src = x.name if lay in ("M", "S") else self.need(x, "M", label)
                self.shared_ids.setdefault(k, self.layout[src] == "S")
            else:
                src = self.need(x, _LAYOUT[fcls], label)
            if k not in self.fused:  # a module called twice is one fused op
                self.fused[k] = self.build(fcls, mods, target)
            self.steps.append(("fused", n.name, k, src))
            self.layout[n.name] = _LAYOUT[fcls]
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
        elif isinstance(m0, _STATELESS):
            lay = self.layout.get(x.name)
            if isinstance(m0, _SPATIAL):
                src = self.need(x, "C", label)
            elif isinstance(m0, nn.Dropout) and lay == "S":  # each model its own mask
                src = self.need(x, "M", label)
            elif lay == "Ms":
                raise QsyncInputError(f"hfta: {label} reads a tuple; no fused form")
            else:
                src = x.name
            k = _key(target)
            self.shared[k] = m0
            self.steps.append(("shared", n.name, k, src))
            self.layout[n.name] = self.layout[src]
        else:
            raise QsyncInputError(f"hfta: module {target!r} ({type(m0).__name__}) has "
                                  "no fused form (fused: Conv2d, BatchNorm2d, Linear, "
                                  "LayerNorm, Embedding, MatMul; shared: activations, "
                                  "pooling, dropout, Flatten, Softmax)")

    def build(self, fcls: Any, mods: Sequence[nn.Module], target: str) -> nn.Module:
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
        k = _key(str(n.target))
        if k not in self.matmuls:
            self.matmuls[k] = H.FusedMatMul.from_modules(mods)
        self.steps.append(("matmul", n.name, k, srcs[0], am, srcs[1], bm))
        self.layout[n.name] = "M"

    def call(self, name: str, call: Any, op: str | None, args: tuple[Any, ...],
             kwargs: dict[str, Any], who: str) -> None:
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
        if op in _SPATIAL_FN_NAMES:  # pooling: on the channel-folded layout
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
            if op in _RANDOM:
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
        if (op in _BROADCAST and only_c) or (op in _LIKE and first_lay == "C"):
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

    def rule(self, op: str, first_lay: str | None, args: tuple[Any, ...],
             lays: dict[str, str], who: str) -> tuple[str, str]:
        """(the translation rule, the result's layout) of op ``op`` with a model-major
        operand."""
        if op in _BROADCAST:
            return "broadcast", "M"
        if op in _LIKE:
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
        if op in _DIM_ARGS:
            return "dims", "Ms" if op in _SEQUENCES else "M"
        if op in ("view", "reshape", "view_as", "reshape_as"):
            return ("view" if op in ("view", "reshape") else "as"), "M"
        if op in ("expand", "repeat", "permute"):
            return "expand", "M"
        if op in _FRESH:
            return "shared", "S"
        if op in ("dim", "ndimension", "numel", "nelement"):
            return "attr", "S"
        if op == "getattr":
            attr = args[1] if len(args) > 1 else None
            if attr not in _ATTRS:
                raise QsyncInputError(f"hfta: {who} reads attribute {attr!r} of a "
                                      "model-major value; no fused form (read: "
                                      f"{', '.join(sorted(_ATTRS))})")
            return "attr", "S"
        raise QsyncInputError(f"hfta: {who} has no fused form for model-major values")

    def emit(self, name: str, rule: str, call: Any, op: str | None, args: tuple[Any, ...],
             kwargs: dict[str, Any], out: str, *, subst: dict[str, str] | None = None) -> None:
        """An ``op`` step: the call's arguments with the walk's values as references (a node
        in ``subst`` by its value in the layout the rule takes)."""
        subst = subst or {}

        def ref(a: Any) -> Any:
            if isinstance(a, fx.Node):
                return _Ref(subst.get(a.name, a.name))
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


def _refs_in(a: Any) -> list[_Ref]:
    return _leaves(a, _Ref)


def fuse(models: Sequence[nn.Module], *, input_mode: str = "per_model") -> FusedArray:
    """Fuse ``B`` standalone models of one architecture into a :class:`FusedArray`."""
    if input_mode not in INPUT_MODES:
        raise QsyncInputError(f"input mode: expected per_model or replicated, got "
                              f"{input_mode!r}")
    if not models:
        raise QsyncInputError("models: expected at least one")
    classes = {type(m) for m in models}
    if len(classes) != 1:
        raise QsyncInputError(f"models: one architecture, got {sorted(c.__name__ for c in classes)}")
    template = models[0]
    graph = _Tracer().trace(template)
    walk = _Walk(models, input_mode)
    for n in graph.nodes:
        walk.node(n)
    return FusedArray(walk.B, template, walk.steps, walk.fused, walk.shared, input_mode,
                      matmuls=walk.matmuls, consts=walk.consts, shared_ids=walk.shared_ids,
                      ties=list(walk.ties.values()))
