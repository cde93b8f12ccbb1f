"""A fused array: ``B`` models of one architecture as one module (:mod:`qsync_opt.hfta.convert`
builds it): the fused operators, the shared stateless modules, the buffers read outside a
module and the walk's steps, run in :meth:`FusedArray.forward`.

Every op with parameters can run ``fused`` (one kernel call for all ``B``) or ``serial``
(``B`` calls on the slices of the same fused parameters, the input split per model before
and the outputs joined after, in the layout the op lives in: :func:`serial_forward`):
:meth:`FusedArray.set_mode`. Partial fusion (a fused trunk with unfused heads) is ``serial``
on the head's ops; the measured per-op choice (:mod:`qsync_opt.hfta.choice`) sets the modes.
``separate`` runs each model's own code on its slices of the fused parameters (through
``torch.func.functional_call``). :meth:`FusedArray.export` gives model ``b`` back as a
standalone model of the original class.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.hfta.conv_ops import FusedBatchNorm2d, FusedConv2d
from qsync_opt.hfta.layouts import conv_to_linear, convert_layout
from qsync_opt.hfta.linear_ops import FusedEmbedding, FusedLayerNorm, FusedLinear
from qsync_opt.hfta.translation import RULES, batched_matmul, resolve_call

__all__ = ["FusedArray", "op_key", "serial_forward"]


def op_key(target: str) -> str:
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
        k = op_key(op)
        if k not in self.fused:
            raise QsyncInputError(f"op: {op!r} is not an op of the array; its ops: "
                                  f"{', '.join(self.op_names[:6])}, ...")
        self.modes[k] = mode

    def set_modes(self, modes: dict[str, str]) -> None:
        for op, m in modes.items():
            self.set_mode(op, m)

    def mode_of(self, op: str) -> str:
        return self.modes[op_key(op)]

    # ------------------------------------------------------------------ forward

    def call_op(self, op: str, x: Tensor, mode: str | None = None) -> Tensor:
        """Op ``op`` (with parameters) on its input ``x`` in its layout, ``mode`` fused or
        serial (default: the op's mode); an Embedding reads its ids as the walk found them
        (shared or per model)."""
        k = op_key(op)
        mod = self.fused[k]
        shared = self.shared_ids.get(k, False)
        if (mode or self.modes[k]) == "serial":
            return serial_forward(mod, x, self.B, shared)
        if isinstance(mod, FusedEmbedding):
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
                env[name] = convert_layout(env[step[2]], step[3], B, step[4])
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
                r_args, r_kwargs = resolve_call(env, args, kwargs, majors)
                env[name] = RULES[rule](B, call, op, r_args, r_kwargs)
            elif kind == "flatten":
                env[name] = conv_to_linear(env[step[2]], B)
            elif kind == "output":
                out = env[step[2]]
        return out

    def _forward_separate(self, inputs: Sequence[Tensor]) -> Tensor:
        """Model ``b``'s own code on model ``b``'s slices of the fused parameters, ``B``
        times: the measured fallback when fusing loses (every op's result is the standalone
        model's; gradients flow into the fused parameters)."""
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



def serial_forward(mod: nn.Module, x: Tensor, B: int, replicated: bool) -> Tensor:
    """``mod``'s op as ``B`` calls on its parameters' slices: the input split per model, the
    outputs joined, in the op's layout (``replicated``: an Embedding's ids are shared by the
    models). Integer and fp8 precisions already run one call per model (each model's own
    quantization scale), so they run as they are."""
    p = Precision(getattr(mod, "precision", Precision.fp32))
    if p not in (Precision.fp32, Precision.tf32):
        return mod(x)
    if isinstance(mod, FusedConv2d):
        xs = x.view(x.shape[0], B, -1, *x.shape[2:]).unbind(1)
        w, bias = mod.weight, mod.bias
        outs = [F.conv2d(xs[b], w[b], None if bias is None else bias[b], mod.stride,
                         mod.padding, mod.dilation, mod.groups) for b in range(B)]
        return torch.cat(outs, 1)
    if isinstance(mod, FusedBatchNorm2d):
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
    if isinstance(mod, FusedLinear):
        return torch.stack([F.linear(x[b], mod.weight[b],
                                     None if mod.bias is None else mod.bias[b])
                            for b in range(B)])
    if isinstance(mod, FusedLayerNorm):
        return torch.stack([F.layer_norm(x[b], mod.normalized_shape,
                                         None if mod.weight is None else mod.weight[b],
                                         None if mod.bias is None else mod.bias[b], mod.eps)
                            for b in range(B)])
    if isinstance(mod, FusedEmbedding):
        return torch.stack([F.embedding(x if replicated else x[b], mod.weight[b],
                                        mod.padding_idx, mod.max_norm, mod.norm_type,
                                        mod.scale_grad_by_freq) for b in range(B)])
    raise QsyncInputError(f"hfta: no serial form of {type(mod).__name__}")
