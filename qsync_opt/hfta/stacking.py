"""Building a fused operator from ``B`` standalone torch modules and giving model ``b``'s
module back: the checks (the number of models, a model index, the modules' types and the
hyper-parameters that must be equal), the ``[B, ...]`` tensors stacked from the modules' own
and sliced back out, the precision the modules share, torch's own initialisation per model.

Every fused operator (:mod:`qsync_opt.hfta.conv_ops`, :mod:`qsync_opt.hfta.linear_ops`) has
``from_modules(mods)`` (fuse ``B`` standalone torch modules of the matching type: parameters
and buffers copied, hyper-parameters checked equal, a
:class:`~qsync_opt.core.errors.QsyncInputError` naming what differs) and ``export(b)`` (model
``b``'s standalone torch module, with copies of its parameters and buffers).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor, nn

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.ops.gemm import HALF_DTYPES

__all__ = ["GemmLayer", "ONE_CALL_PRECISIONS", "as_precision", "check_model_count",
           "check_model_index", "check_same", "common_precision", "export_into", "filled_gemm_layer",
           "init_like_torch", "modules_of_type", "stack_into", "tensor_fields"]

#: Precisions run as the one fused call (16 bit: with cast operands).
ONE_CALL_PRECISIONS = (Precision.fp32, Precision.tf32, *HALF_DTYPES)


def check_model_count(b: object) -> int:
    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
        raise QsyncInputError(f"B: expected a positive number of models, got {b!r}")
    return b



def as_precision(value: Precision | str, where: str) -> Precision:
    try:
        return Precision(value)
    except ValueError:
        known = ", ".join(p.value for p in Precision)
        raise QsyncInputError(f"{where}: unknown precision {value!r}; expected one of: "
                              f"{known}") from None


def modules_of_type(mods: Sequence[nn.Module], cls: type[nn.Module], who: str) -> list[Any]:
    """``mods`` as a list, each an instance of ``cls`` (else QsyncInputError)."""
    got = list(mods)
    if not got:
        raise QsyncInputError(f"{who}.from_modules: no modules given")
    prefix = "nn." if cls.__module__.startswith("torch.nn") else ""
    for i, m in enumerate(got):
        if not isinstance(m, cls):
            raise QsyncInputError(f"{who}.from_modules: module {i} is a {type(m).__name__}, "
                                  f"expected an {prefix}{cls.__name__}")
    return got


def check_same(who: str, mods: Sequence[nn.Module],
               fields: dict[str, Callable[[Any], Any]]) -> None:
    """Raise QsyncInputError naming the first field whose value differs between ``mods``."""
    for name, get in fields.items():
        vals = [get(m) for m in mods]
        if any(v != vals[0] for v in vals[1:]):
            shown = ", ".join(f"module {i}: {v!r}" for i, v in enumerate(vals))
            raise QsyncInputError(f"{who}.from_modules: {name} differs across the "
                                  f"{len(vals)} modules ({shown})")


def tensor_fields(*names: str) -> dict[str, Callable[[Any], Any]]:
    """dtype, device, requires_grad of each named (optional) tensor attribute."""
    out: dict[str, Callable[[Any], Any]] = {}
    for n in names:
        def get(m: nn.Module, n: str = n) -> object:
            t = getattr(m, n)
            return None if t is None else (t.dtype, t.device)
        out[f"{n} dtype/device"] = get

        def grad(m: nn.Module, n: str = n) -> object:
            t = getattr(m, n)
            return None if t is None else t.requires_grad
        out[f"{n}.requires_grad"] = grad
    return out


def stack_into(dst: Tensor, srcs: Sequence[Tensor]) -> None:
    with torch.no_grad():
        dst.copy_(torch.stack([s.detach() for s in srcs]))
    if isinstance(dst, nn.Parameter):
        dst.requires_grad_(srcs[0].requires_grad)


def export_into(m: nn.Module, fused: nn.Module, b: int, names: Sequence[str]) -> None:
    """Copy model ``b``'s slice of each named fused parameter / buffer into ``m`` (parameters
    keep the fused one's ``requires_grad``)."""
    for name in names:
        src, dst = getattr(fused, name), getattr(m, name)
        if src is None or dst is None:
            continue
        with torch.no_grad():
            dst.copy_(src[b].detach())
        if isinstance(src, nn.Parameter):
            dst.requires_grad_(src.requires_grad)


def common_precision(who: str, mods: Sequence[nn.Module]) -> Precision:
    """The precision of runtime precision layers (QLinear, QConv2d...): all the same, or fp32
    for plain torch modules."""
    check_same(who, mods, {"precision": lambda m: Precision(getattr(m, "precision", "fp32"))})
    return Precision(getattr(mods[0], "precision", "fp32"))


class GemmLayer(Protocol):
    """A fused GEMM layer (FusedLinear, FusedConv2d): ``[B, ...]`` weight and bias, a
    precision."""

    precision: Precision

    @property
    def weight(self) -> Tensor: ...

    @property
    def bias(self) -> Tensor | None: ...

    def train(self, mode: bool = True) -> Any: ...


_Layer = TypeVar("_Layer", bound=GemmLayer)


def filled_gemm_layer(fused: _Layer, got: Sequence[nn.Linear | nn.Conv2d],
                      precision: Precision) -> _Layer:
    """``fused`` with the ``B`` modules' weights and biases stacked in, their precision and
    the first one's train/eval mode (a GEMM layer's ``from_modules``)."""
    stack_into(fused.weight, [m.weight for m in got])
    if fused.bias is not None:
        stack_into(fused.bias, [m.bias for m in got if m.bias is not None])
    fused.precision = precision
    fused.train(got[0].training)
    return fused


def init_like_torch(weight: Tensor, bias: Tensor | None) -> None:
    """Each model's slice initialised as torch's Linear / Conv2d ``reset_parameters`` does."""
    with torch.no_grad():
        for b in range(weight.shape[0]):
            nn.init.kaiming_uniform_(weight[b], a=math.sqrt(5))
            if bias is not None:
                fan_in = weight[b][0].numel()
                bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
                nn.init.uniform_(bias[b], -bound, bound)


def check_model_index(b: object, count: int, who: str) -> None:
    if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < count:
        raise QsyncInputError(f"{who}.export: model index {b!r} outside 0..{count - 1}")

