"""Precision-specific Linear, Conv1d/2d, attention MatMul, HuggingFace-style Conv1D and
nn.MultiheadAttention on the qsync ops library (functional GEMMs and SDPA calls are
dispatched per call: :mod:`qsync_opt.ops.dispatch`).

Each layer is a subclass of the torch module it replaces and keeps its parameters, so a swap
(:func:`apply_precisions`) changes no ``state_dict`` key and keeps FP32 master weights and
FP32 gradients. Per precision:

* ``fp32`` and ``tf32``: the module's own computation (tf32 only differs on an Ampere+ GPU,
  where torch's ``allow_tf32`` flags decide; on a CPU it is fp32).
* ``fp16`` / ``bf16``: input and weight cast to 16 bit, the op in 16 bit, the result cast
  back to the input dtype (the 16-bit output's rounding is kept).
* ``int8`` / ``int8_full``: ``qsync::int8_linear`` / ``qsync::int8_conv2d`` (a real integer
  GEMM, stochastic rounding, a fresh seed each call from the layer's counter; int8_full's
  backward quantizes the output gradient per row for the input gradient and per output
  channel for the weight gradient: ``qsync_opt.ops.NUMERICS``); attention
  matmuls fake-quantize both operands to int8 and multiply in the input dtype (there is no
  batched int8 GEMM op yet); at ``int8_full`` their backward quantizes the output gradient
  the same way, per row for the left operand's gradient and per last-axis channel for the
  right one's (:func:`~qsync_opt.ops.gemm.int8_full_gemm`).
* ``int4`` (opt-in): ``qsync::int4_linear`` / ``qsync::int4_conv2d``: values in [-7, 7]
  (scale abs-max/7; weights per output channel, activations per tensor; rounded to nearest,
  which kept 0.85 of the gradient's direction where stochastic rounding kept 0.77:
  docs/BENCHMARKS.md) in int8 storage
  through the same integer GEMM (int32 accumulation; exact, no faster than int8 on this
  CPU), a 16-bit backward on the saved int4 operands; attention matmuls fake-quantize both
  operands to int4.
* ``fp8`` (emulated): both operands fake-quantized to e4m3 (scaled per tensor), the GEMM in
  the input dtype (FP32), the gradient passed straight through in FP32 (no FP8 GEMM, no e5m2
  gradients), on a CPU and on CUDA alike. The cost model still charges FP8 peaks.

Convolutions with a ``padding_mode`` other than zeros are padded first, as torch does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qsync_opt import ops
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.models.layers import MatMul
from qsync_opt.ops.attention import MHA_GEMMS, base_name, mha_forward, mha_gemms
from qsync_opt.ops.dispatch import FunctionalDispatch, functional_op_exists
from qsync_opt.ops.gemm import (
    COUNTERS,
    HALF_DTYPES,
    QMixin,
    RuntimeStep,
    int8_full_gemm,
    record_call,
    run_gemm,
    run_linear,
    swappable_kind,
)

__all__ = ["COUNTERS", "QConv1d", "QConv2d", "QLinear", "QMatMul", "QMixin",
           "QMultiheadAttention", "apply_precisions", "classify_ops", "record_call", "run_gemm",
           "run_linear", "swappable_kind", "switch_precisions"]

_HALF = HALF_DTYPES

# The two mixins below join a class only known at run time (HF's Conv1D, a user's subclass of
# nn.MultiheadAttention; see _q_class): to the type checker they derive from the base they join.
if TYPE_CHECKING:
    _Conv1DBase = nn.Module
    _MHABase = nn.MultiheadAttention
else:
    _Conv1DBase = _MHABase = object

class QLinear(nn.Linear, QMixin):
    def forward(self, x: Tensor) -> Tensor:
        self._count()
        p = self.precision
        if p in _HALF:
            d = _HALF[p]
            b = None if self.bias is None else self.bias.to(d)
            return F.linear(x.to(d), self.weight.to(d), b).to(x.dtype)
        if p in (Precision.int8, Precision.int8_full):
            return ops.int8_linear(x, self.weight, self.bias,
                                   int8_backward=p == Precision.int8_full,
                                   seed=self._next_seed())
        if p == Precision.fp8:
            return F.linear(ops.fake_quant_float(x, "fp8_e4m3"),
                            ops.fake_quant_float(self.weight, "fp8_e4m3"), self.bias)
        if p == Precision.int4:
            return ops.int4_linear(x, self.weight, self.bias, seed=self._next_seed())
        return F.linear(x, self.weight, self.bias)


class QConv2d(nn.Conv2d, QMixin):
    def forward(self, x: Tensor) -> Tensor:
        self._count()
        p = self.precision
        if isinstance(self.padding, str):
            raise QsyncInputError(f"QConv2d: string padding {self.padding!r} is not supported")
        if p not in (*_HALF, Precision.int8, Precision.int8_full, Precision.fp8, Precision.int4):
            return super().forward(x)
        padding: Any = self.padding
        if self.padding_mode != "zeros":  # reflect / replicate / circular: pad first, as torch
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = (0, 0)
        if p in _HALF:
            d = _HALF[p]
            b = None if self.bias is None else self.bias.to(d)
            return F.conv2d(x.to(d), self.weight.to(d), b, self.stride, padding,
                            self.dilation, self.groups).to(x.dtype)
        if p in (Precision.int8, Precision.int8_full):
            return ops.int8_conv2d(x, self.weight, self.bias, self.stride, padding,
                                   self.dilation, self.groups,
                                   int8_backward=p == Precision.int8_full,
                                   seed=self._next_seed())
        if p == Precision.int4:
            return ops.int4_conv2d(x, self.weight, self.bias, self.stride, padding,
                                   self.dilation, self.groups, seed=self._next_seed())
        return F.conv2d(ops.fake_quant_float(x, "fp8_e4m3"),
                        ops.fake_quant_float(self.weight, "fp8_e4m3"), self.bias,
                        self.stride, padding, self.dilation, self.groups)


class QMatMul(MatMul, QMixin):
    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        self._count()
        p = self.precision
        if p in _HALF:
            d = _HALF[p]
            return torch.matmul(a.to(d), b.to(d)).to(a.dtype)
        if p == Precision.int8_full:
            return int8_full_gemm(torch.matmul, (a, b), {}, self._next_seed())
        if p == Precision.int8:
            s = self._next_seed()
            return torch.matmul(ops.fake_quant_int8(a, seed=2 * s),
                                ops.fake_quant_int8(b, seed=2 * s + 1))
        if p == Precision.fp8:
            return torch.matmul(ops.fake_quant_float(a, "fp8_e4m3"),
                                ops.fake_quant_float(b, "fp8_e4m3"))
        if p == Precision.int4:
            s = self._next_seed()
            return torch.matmul(ops.fake_quant_int4(a, seed=2 * s),
                                ops.fake_quant_int4(b, seed=2 * s + 1))
        return torch.matmul(a, b)


class QConv1d(nn.Conv1d, QMixin):
    """nn.Conv1d at a precision: 16 bit and fp8 as :class:`QConv2d`; int8 through
    ``qsync::int8_conv2d`` on a height-1 image (the same integer GEMM)."""

    def forward(self, x: Tensor) -> Tensor:
        self._count()
        p = self.precision
        if p not in (*_HALF, Precision.int8, Precision.int8_full, Precision.fp8, Precision.int4):
            return super().forward(x)
        padding: Any = self.padding
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = (0,)
        if p in _HALF:
            d = _HALF[p]
            b = None if self.bias is None else self.bias.to(d)
            return F.conv1d(x.to(d), self.weight.to(d), b, self.stride, padding, self.dilation,
                            self.groups).to(x.dtype)
        if p == Precision.fp8:
            return F.conv1d(ops.fake_quant_float(x, "fp8_e4m3"),
                            ops.fake_quant_float(self.weight, "fp8_e4m3"), self.bias,
                            self.stride, padding, self.dilation, self.groups)
        if padding == "valid":
            padding = (0,)
        elif padding == "same":  # stride 1 (torch's rule): pad (left, right) first
            total = self.dilation[0] * (self.kernel_size[0] - 1)
            x = F.pad(x, (total // 2, total - total // 2))
            padding = (0,)
        if p == Precision.int4:
            y = ops.int4_conv2d(x.unsqueeze(-2), self.weight.unsqueeze(-2), self.bias,
                                (1, self.stride[0]), (0, padding[0]), (1, self.dilation[0]),
                                self.groups, seed=self._next_seed())
            return y.squeeze(-2)
        y = ops.int8_conv2d(x.unsqueeze(-2), self.weight.unsqueeze(-2), self.bias,
                            (1, self.stride[0]), (0, padding[0]), (1, self.dilation[0]),
                            self.groups, int8_backward=p == Precision.int8_full,
                            seed=self._next_seed())
        return y.squeeze(-2)


class _QConv1DMixin(QMixin, _Conv1DBase):
    """A HuggingFace-style Conv1D (``out = addmm(bias, x, weight)``, weight (in, out)) at a
    precision: its transposed weight through :func:`run_linear` (int8: ``ops.int8_linear``;
    16 bit and fp8 as :class:`QLinear`)."""

    weight: Tensor
    bias: Tensor | None

    def forward(self, x: Tensor) -> Tensor:
        self._count()
        p = self.precision
        if p in (Precision.fp32, Precision.tf32):
            return super().forward(x)
        return run_linear(x, self.weight.t(), self.bias, p, self._next_seed)


class _QMHAMixin(QMixin, _MHABase):
    """nn.MultiheadAttention with a precision per sub-op (``precisions``: in_proj or
    q_proj/k_proj/v_proj/kv_proj, qk, av, out_proj): the decomposed attention
    (:func:`~qsync_opt.ops.attention.mha_forward`, the computation the planner traced),
    or torch's own forward when every sub-op is fp32/tf32."""

    precisions: dict[str, Precision]

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Tensor | None = None, need_weights: bool = True,
                attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        subs = mha_gemms(self, query, key, value)
        prefix = f"{self.qname}." if self.qname else ""
        if all(self.precisions.get(s, Precision.fp32) in (Precision.fp32, Precision.tf32)
               for s in subs):
            for s in subs:
                record_call(prefix + s, self.precisions.get(s, Precision.fp32))
            return super().forward(query, key, value, key_padding_mask,
                                   need_weights, attn_mask, average_attn_weights, is_causal)
        return mha_forward(RuntimeStep(self.qname, self.precisions, self._next_seed),
                           self, query, key, value, key_padding_mask,
                           need_weights, attn_mask, average_attn_weights, is_causal)


class QMultiheadAttention(_QMHAMixin, nn.MultiheadAttention):
    pass


_DYNAMIC: dict[tuple[type, type], type] = {(nn.MultiheadAttention, _QMHAMixin): QMultiheadAttention}


def _q_class(base: type[nn.Module], mixin: type) -> type[nn.Module]:
    """The precision-specific subclass of ``base`` (made once per class: HF's Conv1D, a
    user's subclass of nn.MultiheadAttention)."""
    key = (base, mixin)
    if key not in _DYNAMIC:
        _DYNAMIC[key] = type(f"Q{base.__name__}", (mixin, base), {"__module__": __name__})
    return _DYNAMIC[key]


_SWAPS: list[tuple[type[nn.Module], type[nn.Module]]] = [
    (QLinear, nn.Linear), (QConv2d, nn.Conv2d), (QConv1d, nn.Conv1d), (QMatMul, MatMul)]


def _mha_of(modules: Mapping[str, nn.Module], name: str) -> tuple[str, str] | None:
    """(mha name, sub-op) when ``name`` is ``<an nn.MultiheadAttention>.<sub-op>[_N]``."""
    parent, _, last = name.rpartition(".")
    if isinstance(modules.get(parent), nn.MultiheadAttention) and base_name(last) in MHA_GEMMS:
        return parent, base_name(last)
    return None


def classify_ops(model: nn.Module, names: Iterable[str]) -> dict[str, str]:
    """How the runtime runs each op name of a plan on ``model``: ``module`` (a GEMM module
    swapped for its precision-specific layer), ``mha`` (a sub-op of an
    nn.MultiheadAttention), ``repeat`` (``<module>_N``: a GEMM module's N-th extra call, which
    runs at the module's precision), ``functional`` (a call dispatched per call), ``missing``
    (no such op in this model) or ``not_gemm`` (a module with no precision-specific layer)."""
    modules = dict(model.named_modules())
    out: dict[str, str] = {}
    for name in names:
        mod = modules.get(name)
        again = modules.get(base_name(name)) if mod is None else None
        if _mha_of(modules, name) is not None:
            out[name] = "mha"
        elif mod is not None:
            out[name] = "module" if swappable_kind(mod) is not None else "not_gemm"
        elif again is not None and swappable_kind(again) is not None:
            out[name] = "repeat"  # a module's second, third... call: its own weights, tied
        elif functional_op_exists(model, name):
            out[name] = "functional"
        else:
            out[name] = "missing"
    return out


def _parse_precisions(precisions: Mapping[str, Precision | str]) -> dict[str, Precision]:
    parsed: dict[str, Precision] = {}
    for name, value in sorted(precisions.items()):
        try:
            parsed[name] = Precision(value)
        except ValueError:
            raise QsyncInputError(f"precisions: {name}: unknown precision {value!r}") from None
    return parsed


def _check_classified(how: dict[str, str], modules: Mapping[str, nn.Module]) -> None:
    """Refuse a name that is no op of the model and a module with no precision-specific
    layer."""
    for name, h in how.items():
        if h == "missing":
            raise QsyncInputError(f"precisions: no module named {name!r} in the model")
        if h == "not_gemm":
            raise QsyncInputError(
                f"precisions: {name} is a {type(modules[name]).__name__}; only Linear, "
                "Conv1d/Conv2d, MatMul, Conv1D, nn.MultiheadAttention sub-ops and functional "
                "GEMMs have precision-specific layers")


def _tie_repeats(how: dict[str, str], parsed: dict[str, Precision]) -> None:
    """A module's repeated calls share its one layer: each gives the module its precision
    (``parsed`` and ``how`` updated), two different ones are refused."""
    for name, h in how.items():
        if h == "repeat":
            base = base_name(name)
            if parsed.setdefault(base, parsed[name]) != parsed[name]:
                raise QsyncInputError(
                    f"precisions: {name}: a repeated call of module {base}, which is one set of "
                    f"weights; it cannot run at both {parsed[base].value} and "
                    f"{parsed[name].value}")
            how.setdefault(base, "module")


def _swap_module(mod: nn.Module, name: str, p: Precision, seed: int) -> None:
    """Make the GEMM module ``mod`` its precision-specific layer, running at ``p``."""
    if swappable_kind(mod) == "conv1d_hf":
        mod.__class__ = _q_class(type(mod), _QConv1DMixin)
    else:
        for qcls, plain in _SWAPS:
            if isinstance(mod, plain):
                mod.__class__ = qcls
                break
    q = cast(QMixin, mod)
    q.precision = p
    q.qseed = seed
    q.qname = name


def _swap_attention(modules: Mapping[str, nn.Module], mha: dict[str, dict[str, Precision]],
                    seed: int) -> None:
    """Make each nn.MultiheadAttention of ``mha`` a :class:`QMultiheadAttention` running its
    sub-ops at the precisions given."""
    for i, (parent, subs) in enumerate(sorted(mha.items())):
        mod = modules[parent]
        if not isinstance(mod, _QMHAMixin):
            mod.__class__ = _q_class(type(mod), _QMHAMixin)
        q = cast(_QMHAMixin, mod)
        q.precisions = subs
        q.precision = Precision.fp32
        q.qseed = (seed * 1_000_003 + 104729 * (i + 1)) & 0x7FFFFFFF
        q.qname = parent


def _install_dispatch(model: nn.Module, functional: dict[str, Precision], seed: int) -> None:
    """Replace ``model``'s functional dispatch by one for ``functional`` (none if empty)."""
    old = model.__dict__.pop("_qsync_dispatch", None)
    if old is not None:
        old.remove()
    if functional:
        model.__dict__["_qsync_dispatch"] = FunctionalDispatch(model, functional,
                                                               seed=seed * 1_000_003 + 17)


def apply_precisions(model: nn.Module, precisions: Mapping[str, Precision | str],
                     seed: int = 0) -> dict[str, Any]:
    """Make the named ops of ``model`` run at the given precisions, in place.

    GEMM modules (Linear, Conv1d/2d, MatMul, HF-style Conv1D) are swapped for their
    precision-specific layers; sub-ops of an nn.MultiheadAttention (``<mha>.in_proj``,
    ``.qk``, ``.av``, ``.out_proj``...) make it a :class:`QMultiheadAttention`; other names
    (functional GEMMs and SDPA sub-ops, named as the tracers name them) go to a
    :class:`~qsync_opt.ops.dispatch.FunctionalDispatch` installed on ``model`` (one per
    model: a new call replaces it). Returns ``{name: precision}`` as applied. Refused, with
    the name in the message: a name that is no op of ``model``, a module with no
    precision-specific layer, an unknown precision, two precisions for one
    nn.MultiheadAttention sub-op.
    """
    modules = dict(model.named_modules())
    parsed = _parse_precisions(precisions)
    how = classify_ops(model, parsed)
    _check_classified(how, modules)
    _tie_repeats(how, parsed)
    applied: dict[str, Any] = {}
    mha: dict[str, dict[str, Precision]] = {}
    functional: dict[str, Precision] = {}
    for i, (name, p) in enumerate(sorted(parsed.items())):
        if how[name] == "repeat":
            applied[name] = p
            continue
        if how[name] == "mha":
            found = _mha_of(modules, name)
            assert found is not None  # how[name] is "mha" only where _mha_of found one
            parent, sub = found
            subs = mha.setdefault(parent, {})
            if subs.get(sub, p) != p:
                raise QsyncInputError(f"precisions: {name}: {parent}.{sub} is one set of "
                                      f"weights; it cannot run at both {subs[sub].value} and "
                                      f"{p.value}")
            subs[sub] = p
        elif how[name] == "functional":
            functional[name] = p
        else:
            _swap_module(modules[name], name, p, (seed * 1_000_003 + i * 7919) & 0x7FFFFFFF)
        applied[name] = p
    _swap_attention(modules, mha, seed)
    _install_dispatch(model, functional, seed)
    return applied


def switch_precisions(model: nn.Module, precisions: Mapping[str, Precision | str]) -> list[str]:
    """Change, in place, the precision of the named ops of a ``model`` that
    :func:`apply_precisions` made (a re-plan at a step boundary). Only the ops whose
    precision changes are touched: nothing is re-swapped, the modules, their parameters
    (so an optimizer's state and DDP's buckets) and every stochastic-rounding seed counter
    stay as they are, so an op whose precision is kept runs exactly as before. Returns the
    names changed. Refused, naming it: an op :func:`apply_precisions` did not set up."""
    modules = dict(model.named_modules())
    parsed = _parse_precisions(precisions)
    how = classify_ops(model, parsed)
    dispatch = model.__dict__.get("_qsync_dispatch")
    changed: list[str] = []
    for name, p in sorted(parsed.items()):
        kind = how[name]
        if kind == "repeat":
            continue  # runs at its module's precision
        if kind == "module" and isinstance(modules[name], QMixin):
            q = cast(QMixin, modules[name])
            if q.precision != p:
                q.precision = p
                changed.append(name)
        elif kind == "mha" and isinstance(modules[name.rpartition(".")[0]], _QMHAMixin):
            found = _mha_of(modules, name)
            assert found is not None
            mha = cast(_QMHAMixin, modules[found[0]])
            if mha.precisions.get(found[1]) != p:
                mha.precisions = {**mha.precisions, found[1]: p}
                changed.append(name)
        elif kind == "functional" and dispatch is not None and name in dispatch.precisions:
            if dispatch.precisions[name] != p:
                dispatch.precisions[name] = p
                changed.append(name)
        else:
            raise QsyncInputError(f"precisions: {name}: not an op the plan set up on this "
                                  f"model ({kind})")
    return changed
