"""The fused operators of HFTA: ``B`` independent variants of one layer run as one layer.

Each operator holds the parameters of all ``B`` models stacked on a leading model axis
(``[B, ...]``, model ``b``'s standalone parameter is the ``b``-th slice) and runs all ``B``
models with one kernel call, on one of the two layouts of :mod:`qsync_opt.hfta`:

* :class:`FusedConv2d` (channel-folded ``[N, B*C_in, H, W]`` -> ``[N, B*C_out, H', W']``):
  one ``F.conv2d`` with ``groups = B * groups`` on the weight viewed as
  ``[B*C_out, C_in/groups, kh, kw]``. Group ``b*groups + g`` of the grouped convolution reads
  exactly model ``b``'s input group ``g`` and writes model ``b``'s output group ``g``, so no
  model sees another's channels.
* :class:`FusedBatchNorm2d` (channel-folded ``[N, B*C, H, W]``): one ``F.batch_norm`` over
  ``B*C`` channels; per-channel statistics are per model already. The ``[B, C]`` running
  buffers are handed to it as ``.view(-1)`` views, so the kernel updates them in place.
* :class:`FusedLinear` (model-major ``[B, N, ..., in]`` -> ``[B, N, ..., out]``): the middle
  dims flattened to ``[B, M, in]``, then one ``torch.baddbmm(bias[:, None], x, W^T)`` (one
  ``torch.bmm`` without a bias): a batched GEMM, batch index = model.
* :class:`FusedLayerNorm` (model-major ``[B, N, ..., *shape]``): one ``F.layer_norm`` without
  affine parameters (normalisation is per row, hence per model), then one broadcast
  multiply-add with ``weight`` / ``bias`` viewed as ``[B, 1, ..., 1, *shape]``.
* :class:`FusedEmbedding` (ids ``[B, N, ...]``, one stream per model, or ``[N, ...]``,
  shared by every model (a replicated batch, or position ids) -> ``[B, N, ..., D]``): one
  ``F.embedding`` on the table viewed as ``[B*V, D]`` with model ``b``'s ids offset by
  ``b*V``. A ``padding_idx`` is honoured per model (its rows get no gradient).
* :class:`FusedMatMul` (an attention matmul, :class:`~qsync_opt.models.layers.MatMul`: no
  parameters, both operands model-major ``[B, ..., n, k]`` and ``[B, ..., k, m]``): one
  batched ``torch.matmul``, batch index = model (and the model's own batch dims).
* Pooling and elementwise layers (``nn.MaxPool2d``, ``nn.AvgPool2d``,
  ``nn.AdaptiveAvgPool2d``, ``nn.ReLU``, ``nn.Dropout``...) act per channel or per element,
  so they run unchanged on the channel-folded layout (and elementwise ones on model-major).
  :func:`fold`, :func:`unfold` and :func:`conv_to_linear` move between the layouts.

Precisions (:class:`FusedLinear`, :class:`FusedConv2d` and :class:`FusedMatMul`, attribute
``precision``, as the runtime's precision layers, :mod:`qsync_opt.ops.layers`): ``fp32`` / ``tf32`` run the one
fused call; ``fp16`` / ``bf16`` cast operands to 16 bit for that one call and the result back
to the input dtype. ``int8``, ``int8_full``, ``int4`` and ``fp8`` quantize each tensor with a
per-tensor (activation) scale, which must be each model's own, so they run ``B`` calls, one
per model, of exactly the runtime's kernels (:func:`qsync_opt.ops.gemm.run_linear`;
``ops.int8_conv2d`` / ``ops.int4_conv2d`` as ``QConv2d`` runs them; the matmul's operands
fake-quantized by :func:`~qsync_opt.ops.gemm.run_gemm` as ``QMatMul`` does), each with a
fresh seed from the layer's counter (:class:`~qsync_opt.ops.gemm.QMixin`): the fused layer then equals
``B`` standalone layers given the same seeds, bit for bit. There is no batched integer GEMM
in :mod:`qsync_opt.ops`, so ``int8_mode`` has the one value ``"loop"``.

Every operator has ``from_modules(mods)`` (fuse ``B`` standalone torch modules of the matching
type: parameters and buffers copied, hyper-parameters checked equal, a
:class:`~qsync_opt.core.errors.QsyncInputError` naming what differs) and ``export(b)`` (model
``b``'s standalone torch module, with copies of its parameters and buffers).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qsync_opt import ops
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.models.layers import MatMul
from qsync_opt.ops.gemm import HALF_DTYPES, QMixin, run_gemm, run_linear

__all__ = ["FusedBatchNorm2d", "FusedConv2d", "FusedEmbedding", "FusedLayerNorm",
           "FusedLinear", "FusedMatMul", "INT8_MODES", "conv_to_linear", "fold", "unfold"]

#: The ways a fused Linear runs an integer (or fp8) precision: ``loop``, one standalone call
#: per model (the only one; no batched int8 GEMM exists that equals it).
INT8_MODES = ("loop",)

#: Precisions run as the one fused call (16 bit: with cast operands).
_ONE_CALL = (Precision.fp32, Precision.tf32, *HALF_DTYPES)

# ----------------------------------------------------------------------------- helpers


def _check_b(b: Any) -> int:
    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
        raise QsyncInputError(f"B: expected a positive number of models, got {b!r}")
    return b


def _pair(v: int | Sequence[int], name: str) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    t = tuple(int(x) for x in v)
    if len(t) != 2:
        raise QsyncInputError(f"{name}: expected an int or a pair, got {v!r}")
    return (t[0], t[1])


def _as_precision(value: Precision | str, where: str) -> Precision:
    try:
        return Precision(value)
    except ValueError:
        known = ", ".join(p.value for p in Precision)
        raise QsyncInputError(f"{where}: unknown precision {value!r}; expected one of: "
                              f"{known}") from None


def _modules(mods: Sequence[nn.Module], cls: type[nn.Module], who: str) -> list[Any]:
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


def _same(who: str, mods: Sequence[nn.Module], fields: dict[str, Callable[[Any], Any]]) -> None:
    """Raise QsyncInputError naming the first field whose value differs between ``mods``."""
    for name, get in fields.items():
        vals = [get(m) for m in mods]
        if any(v != vals[0] for v in vals[1:]):
            shown = ", ".join(f"module {i}: {v!r}" for i, v in enumerate(vals))
            raise QsyncInputError(f"{who}.from_modules: {name} differs across the "
                                  f"{len(vals)} modules ({shown})")


def _tensor_fields(*names: str) -> dict[str, Callable[[Any], Any]]:
    """dtype, device, requires_grad of each named (optional) tensor attribute."""
    out: dict[str, Callable[[Any], Any]] = {}
    for n in names:
        def get(m: Any, n: str = n) -> Any:
            t = getattr(m, n)
            return None if t is None else (t.dtype, t.device)
        out[f"{n} dtype/device"] = get

        def grad(m: Any, n: str = n) -> Any:
            t = getattr(m, n)
            return None if t is None else t.requires_grad
        out[f"{n}.requires_grad"] = grad
    return out


def _stack_into(dst: Tensor, srcs: Sequence[Tensor]) -> None:
    with torch.no_grad():
        dst.copy_(torch.stack([s.detach() for s in srcs]))
    if isinstance(dst, nn.Parameter):
        dst.requires_grad_(srcs[0].requires_grad)


def _export_into(m: nn.Module, fused: nn.Module, b: int, names: Sequence[str]) -> None:
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


def _common_precision(who: str, mods: Sequence[nn.Module]) -> Precision:
    """The precision of runtime precision layers (QLinear, QConv2d...): all the same, or fp32
    for plain torch modules."""
    _same(who, mods, {"precision": lambda m: Precision(getattr(m, "precision", "fp32"))})
    return Precision(getattr(mods[0], "precision", "fp32"))


def _filled(fused: Any, got: Sequence[Any], precision: Precision) -> Any:
    """``fused`` with the ``B`` modules' weights and biases stacked in, their precision and
    the first one's train/eval mode (a GEMM layer's ``from_modules``)."""
    _stack_into(fused.weight, [m.weight for m in got])
    if fused.bias is not None:
        _stack_into(fused.bias, [m.bias for m in got])
    fused.precision = precision
    fused.train(got[0].training)
    return fused


def _init_like_torch(weight: Tensor, bias: Tensor | None) -> None:
    """Each model's slice initialised as torch's Linear / Conv2d ``reset_parameters`` does."""
    with torch.no_grad():
        for b in range(weight.shape[0]):
            nn.init.kaiming_uniform_(weight[b], a=math.sqrt(5))
            if bias is not None:
                fan_in = weight[b][0].numel()
                bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
                nn.init.uniform_(bias[b], -bound, bound)


def fold(x: Tensor) -> Tensor:
    """Model-major ``[B, N, C, *spatial]`` -> channel-folded ``[N, B*C, *spatial]`` (model
    ``b``'s channels at ``b*C .. b*C + C - 1``); a copy."""
    if x.dim() < 3:
        raise QsyncInputError(f"fold: expected [B, N, C, *spatial], got shape {tuple(x.shape)}")
    b, n, c = x.shape[:3]
    return x.transpose(0, 1).reshape(n, b * c, *x.shape[3:])


def unfold(x: Tensor, B: int) -> Tensor:
    """Channel-folded ``[N, B*C, *spatial]`` -> model-major ``[B, N, C, *spatial]`` (a view,
    not contiguous)."""
    _check_b(B)
    if x.dim() < 2 or x.shape[1] % B:
        raise QsyncInputError(f"unfold: expected [N, B*C, *spatial] with B={B}, got shape "
                              f"{tuple(x.shape)}")
    n, bc = x.shape[:2]
    return x.reshape(n, B, bc // B, *x.shape[2:]).transpose(0, 1)


def conv_to_linear(x: Tensor, B: int) -> Tensor:
    """Channel-folded ``[N, B*C, H, W]`` -> model-major ``[B, N, C*H*W]``: the flatten between
    a conv trunk and a linear head, model ``b``'s features in the order of
    ``torch.flatten(x_b, 1)`` (any number of spatial dims)."""
    _check_b(B)
    if x.dim() < 2 or x.shape[1] % B:
        raise QsyncInputError(f"conv_to_linear: expected [N, B*C, ...] with B={B}, got shape "
                              f"{tuple(x.shape)}")
    return x.reshape(x.shape[0], B, -1).transpose(0, 1)


# ----------------------------------------------------------------------------- Linear


class FusedLinear(nn.Module, QMixin):
    """``B`` nn.Linear layers as one batched GEMM. ``weight`` ``[B, out, in]``, ``bias``
    ``[B, out]``; input model-major ``[B, N, ..., in]``, output ``[B, N, ..., out]``.

    ``precision`` (default fp32) and the seed counter ``qseed`` as the runtime's QLinear;
    integer and fp8 precisions run one :func:`run_linear` per model (``int8_mode="loop"``).
    """

    def __init__(self, B: int, in_features: int, out_features: int, bias: bool = True, *,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.B = _check_b(B)
        self.in_features, self.out_features = int(in_features), int(out_features)
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(B, out_features, in_features, **kw))
        self.bias: nn.Parameter | None = (nn.Parameter(torch.empty(B, out_features, **kw))
                                          if bias else None)
        _init_like_torch(self.weight, self.bias)
        self.precision: Precision = Precision.fp32
        self.qseed = 0
        self.qname = ""
        self.int8_mode = "loop"

    def extra_repr(self) -> str:
        return (f"B={self.B}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"precision={Precision(self.precision).value}")

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() < 2 or x.shape[0] != self.B or x.shape[-1] != self.in_features:
            raise QsyncInputError(
                f"FusedLinear: expected input [B={self.B}, N, ..., {self.in_features}], "
                f"got shape {tuple(x.shape)}")
        p = _as_precision(self.precision, "FusedLinear.precision")
        self._count()
        w: Tensor = self.weight
        bias: Tensor | None = self.bias
        if p in _ONE_CALL:
            x3 = x.reshape(self.B, -1, self.in_features)
            dtype = x.dtype
            if p in HALF_DTYPES:
                d = HALF_DTYPES[p]
                x3, w = x3.to(d), w.to(d)
                bias = None if bias is None else bias.to(d)
            wt = w.transpose(1, 2)
            y = (torch.bmm(x3, wt) if bias is None
                 else torch.baddbmm(bias.unsqueeze(1), x3, wt))
            return y.to(dtype).reshape(*x.shape[:-1], self.out_features)
        if self.int8_mode not in INT8_MODES:
            raise QsyncInputError(f"FusedLinear.int8_mode: {self.int8_mode!r}; expected one "
                                  f"of {', '.join(INT8_MODES)}")
        outs = [run_linear(x[b], w[b], None if bias is None else bias[b], p, self._next_seed)
                for b in range(self.B)]
        return torch.stack(outs)

    @classmethod
    def from_modules(cls, mods: Sequence[nn.Module]) -> FusedLinear:
        """Fuse ``B`` nn.Linear modules (a runtime QLinear's precision is kept: all equal)."""
        got = _modules(mods, nn.Linear, "FusedLinear")
        _same("FusedLinear", got, {
            "in_features": lambda m: m.in_features, "out_features": lambda m: m.out_features,
            "bias": lambda m: m.bias is not None, **_tensor_fields("weight", "bias")})
        precision = _common_precision("FusedLinear", got)
        first = got[0]
        fused = cls(len(got), first.in_features, first.out_features, first.bias is not None,
                    device=first.weight.device, dtype=first.weight.dtype)
        return _filled(fused, got, precision)

    def export(self, b: int) -> nn.Linear:
        """Model ``b``'s standalone nn.Linear (copies of its weights)."""
        _check_index(b, self.B, "FusedLinear")
        m = nn.Linear(self.in_features, self.out_features, self.bias is not None,
                      device=self.weight.device, dtype=self.weight.dtype)
        _export_into(m, self, b, ("weight", "bias"))
        m.train(self.training)
        return m


def _check_index(b: Any, count: int, who: str) -> None:
    if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < count:
        raise QsyncInputError(f"{who}.export: model index {b!r} outside 0..{count - 1}")


# ----------------------------------------------------------------------------- Conv2d


class FusedConv2d(nn.Module, QMixin):
    """``B`` nn.Conv2d layers as one grouped convolution. ``weight``
    ``[B, out, in/groups, kh, kw]``, ``bias`` ``[B, out]`` or None; input channel-folded
    ``[N, B*in, H, W]``, output ``[N, B*out, H', W']``. Zero padding only (``padding_mode``
    ``zeros``); ``padding`` may be ``"same"`` / ``"valid"`` as in torch.

    ``precision`` as the runtime's QConv2d: fp32 / tf32 / fp16 / bf16 one call; int8,
    int8_full, int4 and fp8 one ``QConv2d`` computation per model, seeds from ``qseed``.
    """

    def __init__(self, B: int, in_channels: int, out_channels: int,
                 kernel_size: int | Sequence[int], stride: int | Sequence[int] = 1,
                 padding: int | Sequence[int] | str = 0, dilation: int | Sequence[int] = 1,
                 groups: int = 1, bias: bool = True, *,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.B = _check_b(B)
        self.in_channels, self.out_channels, self.groups = (int(in_channels),
                                                            int(out_channels), int(groups))
        if self.groups < 1 or in_channels % groups or out_channels % groups:
            raise QsyncInputError(f"FusedConv2d: in_channels {in_channels} and out_channels "
                                  f"{out_channels} must be divisible by groups {groups}")
        self.kernel_size = _pair(kernel_size, "kernel_size")
        self.stride = _pair(stride, "stride")
        self.dilation = _pair(dilation, "dilation")
        self.padding: tuple[int, int] | str
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise QsyncInputError(f"FusedConv2d: padding {padding!r}; expected an int, a "
                                      "pair, 'same' or 'valid'")
            if padding == "same" and self.stride != (1, 1):
                raise QsyncInputError("FusedConv2d: padding 'same' needs stride 1 (as torch)")
            self.padding = padding
        else:
            self.padding = _pair(padding, "padding")
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(B, out_channels, in_channels // groups,
                                               *self.kernel_size, **kw))
        self.bias: nn.Parameter | None = (nn.Parameter(torch.empty(B, out_channels, **kw))
                                          if bias else None)
        _init_like_torch(self.weight, self.bias)
        self.precision: Precision = Precision.fp32
        self.qseed = 0
        self.qname = ""

    def extra_repr(self) -> str:
        return (f"B={self.B}, {self.in_channels}, {self.out_channels}, "
                f"kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, groups={self.groups}, "
                f"bias={self.bias is not None}, precision={Precision(self.precision).value}")

    def _explicit_padding(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """(input, integer padding) for the per-model kernels: 'same' padded first, as
        torch pads it (the odd element at the end)."""
        if self.padding == "valid":
            return x, (0, 0)
        if self.padding == "same":
            th, tw = (d * (k - 1) for d, k in zip(self.dilation, self.kernel_size, strict=True))
            return F.pad(x, (tw // 2, tw - tw // 2, th // 2, th - th // 2)), (0, 0)
        assert not isinstance(self.padding, str)
        return x, self.padding

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or x.shape[1] != self.B * self.in_channels:
            raise QsyncInputError(
                f"FusedConv2d: expected input [N, B*in={self.B * self.in_channels}, H, W], "
                f"got shape {tuple(x.shape)}")
        p = _as_precision(self.precision, "FusedConv2d.precision")
        self._count()
        w: Tensor = self.weight
        bias: Tensor | None = self.bias
        if p in _ONE_CALL:
            dtype = x.dtype
            if p in HALF_DTYPES:
                d = HALF_DTYPES[p]
                x, w = x.to(d), w.to(d)
                bias = None if bias is None else bias.to(d)
            y = F.conv2d(x, w.reshape(self.B * self.out_channels, *w.shape[2:]),
                         None if bias is None else bias.reshape(-1), self.stride,
                         self.padding, self.dilation, self.B * self.groups)
            return y.to(dtype)
        x, padding = self._explicit_padding(x)
        c = self.in_channels
        outs = []
        for b in range(self.B):
            xb, wb, bb = x[:, b * c:(b + 1) * c], w[b], None if bias is None else bias[b]
            if p in (Precision.int8, Precision.int8_full):
                y = ops.int8_conv2d(xb, wb, bb, self.stride, padding, self.dilation,
                                    self.groups, int8_backward=p == Precision.int8_full,
                                    seed=self._next_seed())
            elif p == Precision.int4:
                y = ops.int4_conv2d(xb, wb, bb, self.stride, padding, self.dilation,
                                    self.groups, seed=self._next_seed())
            else:  # fp8: both operands fake-quantized per tensor (QConv2d's emulation)
                y = F.conv2d(ops.fake_quant_float(xb, "fp8_e4m3"),
                             ops.fake_quant_float(wb, "fp8_e4m3"), bb, self.stride, padding,
                             self.dilation, self.groups)
            outs.append(y)
        return torch.cat(outs, dim=1)

    @classmethod
    def from_modules(cls, mods: Sequence[nn.Module]) -> FusedConv2d:
        """Fuse ``B`` nn.Conv2d modules (zero padding; a QConv2d's precision is kept)."""
        got = _modules(mods, nn.Conv2d, "FusedConv2d")
        _same("FusedConv2d", got, {
            "in_channels": lambda m: m.in_channels, "out_channels": lambda m: m.out_channels,
            "kernel_size": lambda m: tuple(m.kernel_size), "stride": lambda m: tuple(m.stride),
            "padding": lambda m: m.padding if isinstance(m.padding, str) else tuple(m.padding),
            "dilation": lambda m: tuple(m.dilation), "groups": lambda m: m.groups,
            "padding_mode": lambda m: m.padding_mode, "bias": lambda m: m.bias is not None,
            **_tensor_fields("weight", "bias")})
        first = got[0]
        if first.padding_mode != "zeros":
            raise QsyncInputError(f"FusedConv2d.from_modules: padding_mode "
                                  f"{first.padding_mode!r} is not supported (zeros only)")
        precision = _common_precision("FusedConv2d", got)
        fused = cls(len(got), first.in_channels, first.out_channels, first.kernel_size,
                    first.stride, first.padding, first.dilation, first.groups,
                    first.bias is not None, device=first.weight.device,
                    dtype=first.weight.dtype)
        return _filled(fused, got, precision)

    def export(self, b: int) -> nn.Conv2d:
        """Model ``b``'s standalone nn.Conv2d (copies of its weights)."""
        _check_index(b, self.B, "FusedConv2d")
        m = nn.Conv2d(self.in_channels, self.out_channels, self.kernel_size, self.stride,
                      self.padding, self.dilation, self.groups, self.bias is not None,
                      device=self.weight.device, dtype=self.weight.dtype)
        _export_into(m, self, b, ("weight", "bias"))
        m.train(self.training)
        return m


# ----------------------------------------------------------------------------- BatchNorm2d


class FusedBatchNorm2d(nn.Module):
    """``B`` nn.BatchNorm2d layers as one over ``B*C`` channels. ``weight`` / ``bias``
    ``[B, C]`` parameters, ``running_mean`` / ``running_var`` ``[B, C]`` buffers (updated in
    place through ``.view(-1)``), ``num_batches_tracked`` one scalar (all models step
    together); input channel-folded ``[N, B*C, H, W]``. ``momentum=None`` is the cumulative
    average, as in torch."""

    running_mean: Tensor | None
    running_var: Tensor | None
    num_batches_tracked: Tensor | None

    def __init__(self, B: int, num_features: int, eps: float = 1e-5,
                 momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, *,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.B = _check_b(B)
        self.num_features, self.eps, self.momentum = int(num_features), float(eps), momentum
        self.affine, self.track_running_stats = bool(affine), bool(track_running_stats)
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.weight: nn.Parameter | None = None
        self.bias: nn.Parameter | None = None
        if affine:
            self.weight = nn.Parameter(torch.ones(B, num_features, **kw))
            self.bias = nn.Parameter(torch.zeros(B, num_features, **kw))
        if track_running_stats:
            self.register_buffer("running_mean", torch.zeros(B, num_features, **kw))
            self.register_buffer("running_var", torch.ones(B, num_features, **kw))
            self.register_buffer("num_batches_tracked",
                                 torch.tensor(0, dtype=torch.long, device=device))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)

    def extra_repr(self) -> str:
        return (f"B={self.B}, {self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, track_running_stats={self.track_running_stats}")

    def step_statistics(self) -> tuple[float, bool, bool]:
        """One forward's (momentum factor, normalise by batch statistics?, use the running
        buffers?), as torch's BatchNorm decides them; counts the batch in training."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                      else self.momentum)
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        keep = not self.training or self.track_running_stats
        return factor, use_batch, keep

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or x.shape[1] != self.B * self.num_features:
            raise QsyncInputError(
                f"FusedBatchNorm2d: expected input [N, B*C={self.B * self.num_features}, H, "
                f"W], got shape {tuple(x.shape)}")
        factor, use_batch, keep = self.step_statistics()
        rm = self.running_mean.view(-1) if keep and self.running_mean is not None else None
        rv = self.running_var.view(-1) if keep and self.running_var is not None else None
        return F.batch_norm(x, rm, rv,
                            None if self.weight is None else self.weight.view(-1),
                            None if self.bias is None else self.bias.view(-1),
                            use_batch, factor, self.eps)

    @classmethod
    def from_modules(cls, mods: Sequence[nn.Module]) -> FusedBatchNorm2d:
        """Fuse ``B`` nn.BatchNorm2d modules: parameters, running statistics and the batch
        count (which must be equal: the fused layer has one)."""
        got = _modules(mods, nn.BatchNorm2d, "FusedBatchNorm2d")
        _same("FusedBatchNorm2d", got, {
            "num_features": lambda m: m.num_features, "eps": lambda m: m.eps,
            "momentum": lambda m: m.momentum, "affine": lambda m: m.affine,
            "track_running_stats": lambda m: m.track_running_stats,
            "running stats presence": lambda m: m.running_mean is not None,
            **_tensor_fields("weight", "bias", "running_mean")})
        _same("FusedBatchNorm2d", got, {
            "num_batches_tracked": lambda m: (None if m.num_batches_tracked is None
                                              else int(m.num_batches_tracked))})
        first = got[0]
        ref = first.weight if first.weight is not None else first.running_mean
        fused = cls(len(got), first.num_features, first.eps, first.momentum, first.affine,
                    first.running_mean is not None,
                    device=None if ref is None else ref.device,
                    dtype=None if ref is None else ref.dtype)
        for name in ("weight", "bias", "running_mean", "running_var"):
            dst = getattr(fused, name)
            if dst is not None:
                _stack_into(dst, [getattr(m, name) for m in got])
        if fused.num_batches_tracked is not None and first.num_batches_tracked is not None:
            fused.num_batches_tracked.copy_(first.num_batches_tracked)
        fused.train(first.training)
        return fused

    def export(self, b: int) -> nn.BatchNorm2d:
        """Model ``b``'s standalone nn.BatchNorm2d (copies of its parameters and buffers)."""
        _check_index(b, self.B, "FusedBatchNorm2d")
        ref = self.weight if self.weight is not None else self.running_mean
        m = nn.BatchNorm2d(self.num_features, self.eps, self.momentum, self.affine,
                           self.track_running_stats,
                           device=None if ref is None else ref.device,
                           dtype=None if ref is None else ref.dtype)
        _export_into(m, self, b, ("weight", "bias", "running_mean", "running_var"))
        if self.num_batches_tracked is not None and m.num_batches_tracked is not None:
            m.num_batches_tracked.copy_(self.num_batches_tracked)
        m.train(self.training)
        return m


# ----------------------------------------------------------------------------- LayerNorm


class FusedLayerNorm(nn.Module):
    """``B`` nn.LayerNorm layers: one ``F.layer_norm`` (no affine) and one broadcast
    multiply-add. ``weight`` / ``bias`` ``[B, *normalized_shape]``; input model-major
    ``[B, N, ..., *normalized_shape]``."""

    def __init__(self, B: int, normalized_shape: int | Sequence[int], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, *,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.B = _check_b(B)
        shape = ((int(normalized_shape),) if isinstance(normalized_shape, int)
                 else tuple(int(s) for s in normalized_shape))
        self.normalized_shape: tuple[int, ...] = shape
        self.eps, self.elementwise_affine = float(eps), bool(elementwise_affine)
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.weight: nn.Parameter | None = None
        self.bias: nn.Parameter | None = None
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(B, *shape, **kw))
            if bias:
                self.bias = nn.Parameter(torch.zeros(B, *shape, **kw))

    def extra_repr(self) -> str:
        return (f"B={self.B}, {self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, bias={self.bias is not None}")

    def forward(self, x: Tensor) -> Tensor:
        k = len(self.normalized_shape)
        if (x.dim() < k + 1 or x.shape[0] != self.B
                or tuple(x.shape[x.dim() - k:]) != self.normalized_shape):
            raise QsyncInputError(
                f"FusedLayerNorm: expected input [B={self.B}, N, ..., "
                f"{', '.join(map(str, self.normalized_shape))}], got shape {tuple(x.shape)}")
        y = F.layer_norm(x, self.normalized_shape, None, None, self.eps)
        if self.weight is None:
            return y
        view = (self.B, *([1] * (x.dim() - 1 - k)), *self.normalized_shape)
        if self.bias is None:
            return y * self.weight.view(view)
        return torch.addcmul(self.bias.view(view), y, self.weight.view(view))

    @classmethod
    def from_modules(cls, mods: Sequence[nn.Module]) -> FusedLayerNorm:
        """Fuse ``B`` nn.LayerNorm modules."""
        got = _modules(mods, nn.LayerNorm, "FusedLayerNorm")
        _same("FusedLayerNorm", got, {
            "normalized_shape": lambda m: tuple(m.normalized_shape), "eps": lambda m: m.eps,
            "elementwise_affine": lambda m: m.elementwise_affine,
            "bias": lambda m: m.bias is not None, **_tensor_fields("weight", "bias")})
        first = got[0]
        fused = cls(len(got), first.normalized_shape, first.eps, first.elementwise_affine,
                    first.bias is not None,
                    device=None if first.weight is None else first.weight.device,
                    dtype=None if first.weight is None else first.weight.dtype)
        for name in ("weight", "bias"):
            dst = getattr(fused, name)
            if dst is not None:
                _stack_into(dst, [getattr(m, name) for m in got])
        fused.train(first.training)
        return fused

    def export(self, b: int) -> nn.LayerNorm:
        """Model ``b``'s standalone nn.LayerNorm (copies of its parameters)."""
        _check_index(b, self.B, "FusedLayerNorm")
        m = nn.LayerNorm(self.normalized_shape, self.eps, self.elementwise_affine,
                         bias=self.bias is not None,
                         device=None if self.weight is None else self.weight.device,
                         dtype=None if self.weight is None else self.weight.dtype)
        _export_into(m, self, b, ("weight", "bias"))
        m.train(self.training)
        return m


# ----------------------------------------------------------------------------- Embedding


class FusedEmbedding(nn.Module):
    """``B`` nn.Embedding tables as one lookup. ``weight`` ``[B, V, D]``; ids ``[B, N, ...]``
    (one stream per model) or ``[N, ...]`` (the same ids for every model), output
    ``[B, N, ..., D]``: one ``F.embedding`` on ``weight.view(B*V, D)`` with model ``b``'s ids
    offset by ``b*V``.

    Which input mode: ``forward(ids, replicated=...)``; left None, ids with at least two dims
    and ``B`` rows are per model, anything else replicated (pass it explicitly where an
    ``[N, ...]`` batch could have ``N == B``; given ``replicated=False``, any ids ``[B, ...]``
    are per model). Any number of dims: shared ids ``[*S]`` (position ids ``[1, T]``) give
    ``[B, *S, D]``, per-model ids ``[B, *S]`` give ``[B, *S, D]``. ``padding_idx``: those positions' outputs pass
    no gradient, so each model's padding row gets none; ``max_norm`` renormalises looked-up
    rows in place as torch does; sparse gradients are not supported.
    """

    def __init__(self, B: int, num_embeddings: int, embedding_dim: int,
                 padding_idx: int | None = None, max_norm: float | None = None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, *,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.B = _check_b(B)
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise QsyncInputError(f"FusedEmbedding: padding_idx {padding_idx} outside the "
                                      f"table of {num_embeddings} rows")
            padding_idx = padding_idx % num_embeddings
        self.padding_idx = padding_idx
        self.max_norm, self.norm_type = max_norm, float(norm_type)
        self.scale_grad_by_freq = bool(scale_grad_by_freq)
        self.weight = nn.Parameter(torch.empty(B, num_embeddings, embedding_dim,
                                               device=device, dtype=dtype))
        with torch.no_grad():
            nn.init.normal_(self.weight)
            if padding_idx is not None:
                self.weight[:, padding_idx].zero_()

    def extra_repr(self) -> str:
        return (f"B={self.B}, {self.num_embeddings}, {self.embedding_dim}, "
                f"padding_idx={self.padding_idx}")

    def forward(self, ids: Tensor, replicated: bool | None = None) -> Tensor:
        if ids.dtype not in (torch.long, torch.int32):
            raise QsyncInputError(f"FusedEmbedding: ids must be int64 or int32, got {ids.dtype}")
        if replicated is None:
            replicated = not (ids.dim() >= 2 and ids.shape[0] == self.B)
        if not replicated and (ids.dim() < 1 or ids.shape[0] != self.B):
            raise QsyncInputError(f"FusedEmbedding: per-model ids must be [B={self.B}, N, ...],"
                                  f" got shape {tuple(ids.shape)}")
        v = self.num_embeddings
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= v):
            raise QsyncInputError(f"FusedEmbedding: ids outside 0..{v - 1} (min "
                                  f"{int(ids.min())}, max {int(ids.max())})")
        per = ids.unsqueeze(0) if replicated else ids  # [B or 1, N, ...]
        if self.B * v > 2**31 - 1:
            per = per.long()
        offsets = torch.arange(self.B, device=ids.device, dtype=per.dtype) * v
        flat = per + offsets.view(self.B, *([1] * (per.dim() - 1)))
        out = F.embedding(flat, self.weight.view(self.B * v, self.embedding_dim), None,
                          self.max_norm, self.norm_type, self.scale_grad_by_freq, False)
        if self.padding_idx is not None and torch.is_grad_enabled() and out.requires_grad:
            pad = (per == self.padding_idx).expand(flat.shape).unsqueeze(-1)
            out = torch.where(pad, out.detach(), out)
        return out

    @classmethod
    def from_modules(cls, mods: Sequence[nn.Module]) -> FusedEmbedding:
        """Fuse ``B`` nn.Embedding modules (dense gradients only)."""
        got = _modules(mods, nn.Embedding, "FusedEmbedding")
        _same("FusedEmbedding", got, {
            "num_embeddings": lambda m: m.num_embeddings,
            "embedding_dim": lambda m: m.embedding_dim, "padding_idx": lambda m: m.padding_idx,
            "max_norm": lambda m: m.max_norm, "norm_type": lambda m: m.norm_type,
            "scale_grad_by_freq": lambda m: m.scale_grad_by_freq,
            "sparse": lambda m: m.sparse, **_tensor_fields("weight")})
        first = got[0]
        if first.sparse:
            raise QsyncInputError("FusedEmbedding.from_modules: sparse=True is not supported "
                                  "(dense gradients only)")
        fused = cls(len(got), first.num_embeddings, first.embedding_dim, first.padding_idx,
                    first.max_norm, first.norm_type, first.scale_grad_by_freq,
                    device=first.weight.device, dtype=first.weight.dtype)
        _stack_into(fused.weight, [m.weight for m in got])
        fused.train(first.training)
        return fused

    def export(self, b: int) -> nn.Embedding:
        """Model ``b``'s standalone nn.Embedding (a copy of its table)."""
        _check_index(b, self.B, "FusedEmbedding")
        m = nn.Embedding(self.num_embeddings, self.embedding_dim, self.padding_idx,
                         self.max_norm, self.norm_type, self.scale_grad_by_freq,
                         _weight=self.weight[b].detach().clone())
        m.weight.requires_grad_(self.weight.requires_grad)
        m.train(self.training)
        return m


# ----------------------------------------------------------------------------- MatMul


class FusedMatMul(nn.Module, QMixin):
    """``B`` attention matmuls (:class:`~qsync_opt.models.layers.MatMul`: ``Q @ K^T``,
    ``P @ V``; no parameters) as one batched ``torch.matmul``. Both operands model-major and of
    the same rank, at least 3: ``[B, ..., n, k] @ [B, ..., k, m] -> [B, ..., n, m]`` (the
    converter lines the operands up: :func:`~qsync_opt.hfta.convert.batched_matmul`).

    ``precision`` (default fp32) and the seed counter ``qseed`` as the runtime's QMatMul:
    fp32 / tf32 one call, fp16 / bf16 one call on 16-bit operands (the result back in the
    first operand's dtype); int8, int8_full, int4 and fp8 fake-quantize each operand with a
    per-tensor scale, which must be each model's own, so they run ``B`` calls, one per model,
    of :func:`~qsync_opt.ops.gemm.run_gemm` (what QMatMul computes), each with a fresh seed.
    """

    def __init__(self, B: int) -> None:
        super().__init__()
        self.B = _check_b(B)
        self.precision: Precision = Precision.fp32
        self.qseed = 0
        self.qname = ""

    def extra_repr(self) -> str:
        return f"B={self.B}, precision={Precision(self.precision).value}"

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        if (a.dim() < 3 or a.dim() != b.dim() or a.shape[0] != self.B
                or b.shape[0] != self.B):
            raise QsyncInputError(
                f"FusedMatMul: expected two model-major operands [B={self.B}, ..., n, k] and "
                f"[B={self.B}, ..., k, m] of one rank (at least 3), got shapes "
                f"{tuple(a.shape)} and {tuple(b.shape)}")
        p = _as_precision(self.precision, "FusedMatMul.precision")
        self._count()
        if p in _ONE_CALL:
            out: Tensor = run_gemm("matmul", torch.matmul, (a, b), {}, p, self._next_seed)
            return out
        return torch.stack([run_gemm("matmul", torch.matmul, (a[i], b[i]), {}, p,
                                     self._next_seed) for i in range(self.B)])

    @classmethod
    def from_modules(cls, mods: Sequence[nn.Module]) -> FusedMatMul:
        """Fuse ``B`` MatMul modules (a runtime QMatMul's precision is kept: all equal)."""
        got = _modules(mods, MatMul, "FusedMatMul")
        fused = cls(len(got))
        fused.precision = _common_precision("FusedMatMul", got)
        fused.train(got[0].training)
        return fused

    def export(self, b: int) -> MatMul:
        """Model ``b``'s standalone MatMul (it holds nothing: a fresh fp32 module)."""
        _check_index(b, self.B, "FusedMatMul")
        m = MatMul()
        m.train(self.training)
        return m
