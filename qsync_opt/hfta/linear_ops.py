"""The model-major family of HFTA's fused operators (:mod:`qsync_opt.hfta`): ``B``
independent variants of a layer run as one layer on ``[B, *per_model_shape]``.

* :class:`FusedLinear` (``[B, N, ..., in]`` -> ``[B, N, ..., out]``): the middle dims
  flattened to ``[B, M, in]``, then one ``torch.baddbmm(bias[:, None], x, W^T)`` (one
  ``torch.bmm`` without a bias): a batched GEMM, batch index = model.
* :class:`FusedLayerNorm` (``[B, N, ..., *shape]``): one ``F.layer_norm`` without affine
  parameters (normalisation is per row, hence per model), then one broadcast multiply-add
  with ``weight`` / ``bias`` viewed as ``[B, 1, ..., 1, *shape]``.
* :class:`FusedEmbedding` (ids ``[B, N, ...]``, one stream per model, or ``[N, ...]``, shared
  by every model (a replicated batch, or position ids) -> ``[B, N, ..., D]``): one
  ``F.embedding`` on the table viewed as ``[B*V, D]`` with model ``b``'s ids offset by
  ``b*V``. A ``padding_idx`` is honoured per model (its rows get no gradient).
* :class:`FusedMatMul` (an attention matmul, :class:`~qsync_opt.models.layers.MatMul`: no
  parameters, both operands model-major ``[B, ..., n, k]`` and ``[B, ..., k, m]``): one
  batched ``torch.matmul``, batch index = model (and the model's own batch dims).

Precisions (:class:`FusedLinear` and :class:`FusedMatMul`, attribute ``precision``, as the
runtime's precision layers, :mod:`qsync_opt.ops.layers`): ``fp32`` / ``tf32`` run the one
fused call; ``fp16`` / ``bf16`` cast operands to 16 bit for that one call and the result back
to the input dtype. ``int8``, ``int8_full``, ``int4`` and ``fp8`` quantize each tensor with a
per-tensor (activation) scale, which must be each model's own, so they run ``B`` calls, one
per model, of exactly the runtime's kernels (:func:`qsync_opt.ops.gemm.run_linear`; the
matmul's operands fake-quantized by :func:`~qsync_opt.ops.gemm.run_gemm` as ``QMatMul``
does), each with a fresh seed from the layer's counter (:class:`~qsync_opt.ops.gemm.QMixin`):
the fused layer then equals ``B`` standalone layers given the same seeds, bit for bit. There
is no batched integer GEMM in :mod:`qsync_opt.ops`, so ``int8_mode`` has the one value
``"loop"``. Building and exporting: :mod:`qsync_opt.hfta.stacking`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.hfta import stacking
from qsync_opt.models.layers import MatMul
from qsync_opt.ops.gemm import HALF_DTYPES, QMixin, run_gemm, run_linear

__all__ = ["FusedEmbedding", "FusedLayerNorm", "FusedLinear", "FusedMatMul", "INT8_MODES"]

#: The ways a fused Linear runs an integer (or fp8) precision: ``loop``, one standalone call
#: per model (the only one; no batched int8 GEMM exists that equals it).
INT8_MODES = ("loop",)


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
        self.B = stacking.check_model_count(B)
        self.in_features, self.out_features = int(in_features), int(out_features)
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(B, out_features, in_features, **kw))
        self.bias: nn.Parameter | None = (nn.Parameter(torch.empty(B, out_features, **kw))
                                          if bias else None)
        stacking.init_like_torch(self.weight, self.bias)
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
        p = stacking.as_precision(self.precision, "FusedLinear.precision")
        self._count()
        w: Tensor = self.weight
        bias: Tensor | None = self.bias
        if p in stacking.ONE_CALL_PRECISIONS:
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
        got = stacking.modules_of_type(mods, nn.Linear, "FusedLinear")
        stacking.check_same("FusedLinear", got, {
            "in_features": lambda m: m.in_features, "out_features": lambda m: m.out_features,
            "bias": lambda m: m.bias is not None, **stacking.tensor_fields("weight", "bias")})
        precision = stacking.common_precision("FusedLinear", got)
        first = got[0]
        fused = cls(len(got), first.in_features, first.out_features, first.bias is not None,
                    device=first.weight.device, dtype=first.weight.dtype)
        return stacking.filled_gemm_layer(fused, got, precision)

    def export(self, b: int) -> nn.Linear:
        """Model ``b``'s standalone nn.Linear (copies of its weights)."""
        stacking.check_model_index(b, self.B, "FusedLinear")
        m = nn.Linear(self.in_features, self.out_features, self.bias is not None,
                      device=self.weight.device, dtype=self.weight.dtype)
        stacking.export_into(m, self, b, ("weight", "bias"))
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
        self.B = stacking.check_model_count(B)
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
        got = stacking.modules_of_type(mods, nn.LayerNorm, "FusedLayerNorm")
        stacking.check_same("FusedLayerNorm", got, {
            "normalized_shape": lambda m: tuple(m.normalized_shape), "eps": lambda m: m.eps,
            "elementwise_affine": lambda m: m.elementwise_affine,
            "bias": lambda m: m.bias is not None, **stacking.tensor_fields("weight", "bias")})
        first = got[0]
        fused = cls(len(got), first.normalized_shape, first.eps, first.elementwise_affine,
                    first.bias is not None,
                    device=None if first.weight is None else first.weight.device,
                    dtype=None if first.weight is None else first.weight.dtype)
        for name in ("weight", "bias"):
            dst = getattr(fused, name)
            if dst is not None:
                stacking.stack_into(dst, [getattr(m, name) for m in got])
        fused.train(first.training)
        return fused

    def export(self, b: int) -> nn.LayerNorm:
        """Model ``b``'s standalone nn.LayerNorm (copies of its parameters)."""
        stacking.check_model_index(b, self.B, "FusedLayerNorm")
        m = nn.LayerNorm(self.normalized_shape, self.eps, self.elementwise_affine,
                         bias=self.bias is not None,
                         device=None if self.weight is None else self.weight.device,
                         dtype=None if self.weight is None else self.weight.dtype)
        stacking.export_into(m, self, b, ("weight", "bias"))
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
        self.B = stacking.check_model_count(B)
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
        got = stacking.modules_of_type(mods, nn.Embedding, "FusedEmbedding")
        stacking.check_same("FusedEmbedding", got, {
            "num_embeddings": lambda m: m.num_embeddings,
            "embedding_dim": lambda m: m.embedding_dim, "padding_idx": lambda m: m.padding_idx,
            "max_norm": lambda m: m.max_norm, "norm_type": lambda m: m.norm_type,
            "scale_grad_by_freq": lambda m: m.scale_grad_by_freq,
            "sparse": lambda m: m.sparse, **stacking.tensor_fields("weight")})
        first = got[0]
        if first.sparse:
            raise QsyncInputError("FusedEmbedding.from_modules: sparse=True is not supported "
                                  "(dense gradients only)")
        fused = cls(len(got), first.num_embeddings, first.embedding_dim, first.padding_idx,
                    first.max_norm, first.norm_type, first.scale_grad_by_freq,
                    device=first.weight.device, dtype=first.weight.dtype)
        stacking.stack_into(fused.weight, [m.weight for m in got])
        fused.train(first.training)
        return fused

    def export(self, b: int) -> nn.Embedding:
        """Model ``b``'s standalone nn.Embedding (a copy of its table)."""
        stacking.check_model_index(b, self.B, "FusedEmbedding")
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
    converter lines the operands up: :func:`~qsync_opt.hfta.translation.batched_matmul`).

    ``precision`` (default fp32) and the seed counter ``qseed`` as the runtime's QMatMul:
    fp32 / tf32 one call, fp16 / bf16 one call on 16-bit operands (the result back in the
    first operand's dtype); int8, int8_full, int4 and fp8 fake-quantize each operand with a
    per-tensor scale, which must be each model's own, so they run ``B`` calls, one per model,
    of :func:`~qsync_opt.ops.gemm.run_gemm` (what QMatMul computes), each with a fresh seed.
    """

    def __init__(self, B: int) -> None:
        super().__init__()
        self.B = stacking.check_model_count(B)
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
        p = stacking.as_precision(self.precision, "FusedMatMul.precision")
        self._count()
        if p in stacking.ONE_CALL_PRECISIONS:
            out: Tensor = run_gemm("matmul", torch.matmul, (a, b), {}, p, self._next_seed)
            return out
        return torch.stack([run_gemm("matmul", torch.matmul, (a[i], b[i]), {}, p,
                                     self._next_seed) for i in range(self.B)])

    @classmethod
    def from_modules(cls, mods: Sequence[nn.Module]) -> FusedMatMul:
        """Fuse ``B`` MatMul modules (a runtime QMatMul's precision is kept: all equal)."""
        got = stacking.modules_of_type(mods, MatMul, "FusedMatMul")
        fused = cls(len(got))
        fused.precision = stacking.common_precision("FusedMatMul", got)
        fused.train(got[0].training)
        return fused

    def export(self, b: int) -> MatMul:
        """Model ``b``'s standalone MatMul (it holds nothing: a fresh fp32 module)."""
        stacking.check_model_index(b, self.B, "FusedMatMul")
        m = MatMul()
        m.train(self.training)
        return m
