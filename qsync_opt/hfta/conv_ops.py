"""The channel-folded family of HFTA's fused operators (:mod:`qsync_opt.hfta`): ``B``
independent variants of a conv layer run as one layer on ``[N, B*C, H, W]``.

* :class:`FusedConv2d` (``[N, B*C_in, H, W]`` -> ``[N, B*C_out, H', W']``): one
  ``F.conv2d`` with ``groups = B * groups`` on the weight viewed as
  ``[B*C_out, C_in/groups, kh, kw]``. Group ``b*groups + g`` of the grouped convolution reads
  exactly model ``b``'s input group ``g`` and writes model ``b``'s output group ``g``, so no
  model sees another's channels.
* :class:`FusedBatchNorm2d` (``[N, B*C, H, W]``): one ``F.batch_norm`` over ``B*C``
  channels; per-channel statistics are per model already. The ``[B, C]`` running buffers
  are handed to it as ``.view(-1)`` views, so the kernel updates them in place.
* Pooling and elementwise layers (``nn.MaxPool2d``, ``nn.AvgPool2d``,
  ``nn.AdaptiveAvgPool2d``, ``nn.ReLU``, ``nn.Dropout``...) act per channel or per element,
  so they run unchanged on the channel-folded layout (:mod:`qsync_opt.hfta.layouts` moves
  between the layouts).

:class:`FusedConv2d`'s precisions (attribute ``precision``, as the runtime's ``QConv2d``)
follow :mod:`qsync_opt.hfta.linear_ops`' rule: one fused call at fp32, tf32, fp16 and bf16;
one call per model, with each model's own scale and a fresh seed, at int8, int8_full, int4
and fp8 (``ops.int8_conv2d`` / ``ops.int4_conv2d`` as ``QConv2d`` runs them), so the fused
layer equals ``B`` standalone layers given the same seeds, bit for bit. Building and
exporting: :mod:`qsync_opt.hfta.stacking`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qsync_opt import ops
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.hfta import stacking
from qsync_opt.ops.gemm import HALF_DTYPES, QMixin

__all__ = ["FusedBatchNorm2d", "FusedConv2d"]


def _pair(v: int | Sequence[int], name: str) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    t = tuple(int(x) for x in v)
    if len(t) != 2:
        raise QsyncInputError(f"{name}: expected an int or a pair, got {v!r}")
    return (t[0], t[1])


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
        self.B = stacking.check_model_count(B)
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
        stacking.init_like_torch(self.weight, self.bias)
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
        p = stacking.as_precision(self.precision, "FusedConv2d.precision")
        self._count()
        w: Tensor = self.weight
        bias: Tensor | None = self.bias
        if p in stacking.ONE_CALL_PRECISIONS:
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
        got = stacking.modules_of_type(mods, nn.Conv2d, "FusedConv2d")
        stacking.check_same("FusedConv2d", got, {
            "in_channels": lambda m: m.in_channels, "out_channels": lambda m: m.out_channels,
            "kernel_size": lambda m: tuple(m.kernel_size), "stride": lambda m: tuple(m.stride),
            "padding": lambda m: m.padding if isinstance(m.padding, str) else tuple(m.padding),
            "dilation": lambda m: tuple(m.dilation), "groups": lambda m: m.groups,
            "padding_mode": lambda m: m.padding_mode, "bias": lambda m: m.bias is not None,
            **stacking.tensor_fields("weight", "bias")})
        first = got[0]
        if first.padding_mode != "zeros":
            raise QsyncInputError(f"FusedConv2d.from_modules: padding_mode "
                                  f"{first.padding_mode!r} is not supported (zeros only)")
        precision = stacking.common_precision("FusedConv2d", got)
        fused = cls(len(got), first.in_channels, first.out_channels, first.kernel_size,
                    first.stride, first.padding, first.dilation, first.groups,
                    first.bias is not None, device=first.weight.device,
                    dtype=first.weight.dtype)
        return stacking.filled_gemm_layer(fused, got, precision)

    def export(self, b: int) -> nn.Conv2d:
        """Model ``b``'s standalone nn.Conv2d (copies of its weights)."""
        stacking.check_model_index(b, self.B, "FusedConv2d")
        m = nn.Conv2d(self.in_channels, self.out_channels, self.kernel_size, self.stride,
                      self.padding, self.dilation, self.groups, self.bias is not None,
                      device=self.weight.device, dtype=self.weight.dtype)
        stacking.export_into(m, self, b, ("weight", "bias"))
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
        self.B = stacking.check_model_count(B)
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
        got = stacking.modules_of_type(mods, nn.BatchNorm2d, "FusedBatchNorm2d")
        stacking.check_same("FusedBatchNorm2d", got, {
            "num_features": lambda m: m.num_features, "eps": lambda m: m.eps,
            "momentum": lambda m: m.momentum, "affine": lambda m: m.affine,
            "track_running_stats": lambda m: m.track_running_stats,
            "running stats presence": lambda m: m.running_mean is not None,
            **stacking.tensor_fields("weight", "bias", "running_mean")})
        stacking.check_same("FusedBatchNorm2d", got, {
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
                stacking.stack_into(dst, [getattr(m, name) for m in got])
        if fused.num_batches_tracked is not None and first.num_batches_tracked is not None:
            fused.num_batches_tracked.copy_(first.num_batches_tracked)
        fused.train(first.training)
        return fused

    def export(self, b: int) -> nn.BatchNorm2d:
        """Model ``b``'s standalone nn.BatchNorm2d (copies of its parameters and buffers)."""
        stacking.check_model_index(b, self.B, "FusedBatchNorm2d")
        ref = self.weight if self.weight is not None else self.running_mean
        m = nn.BatchNorm2d(self.num_features, self.eps, self.momentum, self.affine,
                           self.track_running_stats,
                           device=None if ref is None else ref.device,
                           dtype=None if ref is None else ref.dtype)
        stacking.export_into(m, self, b, ("weight", "bias", "running_mean", "running_var"))
        if self.num_batches_tracked is not None and m.num_batches_tracked is not None:
            m.num_batches_tracked.copy_(self.num_batches_tracked)
        m.train(self.training)
        return m


