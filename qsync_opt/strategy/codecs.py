"""Compressors for the tensors a pipeline stage boundary sends, and their feedback wrappers.

A :class:`Compressor` turns a tensor into a :class:`Payload` -- exactly the tensors that go
on the wire -- and back. The tensor's shape and dtype are agreed per boundary and not sent;
``Payload.nbytes`` is the wire size, and ``Compressor.wire_bytes(n, itemsize)`` predicts it
from the element count alone (the formula the replayer uses; tests check they agree).

- :class:`Identity`: the tensor itself; decompression returns it unchanged (bit for bit).
- :class:`TopK`: the ``ceil(frac * n)`` largest magnitudes: their values (in the tensor's
  dtype) and either their indices (the narrowest unsigned width that holds ``n - 1``:
  1, 2, 4 or 8 bytes) or a bitmap of ``ceil(n / 8)`` bytes, whichever is smaller.
- :class:`Quant`: ``b``-bit uniform quantization (1 <= b <= 8) between the tensor's min and
  max (two fp32 numbers), levels packed ``b`` bits each into ``ceil(n b / 8)`` bytes;
  round to nearest (error at most half a step) or stochastic rounding (unbiased).

A :class:`Codec` is one direction of one boundary: the sender's ``encode(x, idx, slot)``
and the receiver's ``decode(payload, idx, slot)``, each with its own state, so the two
halves can live in two processes. ``slot`` is the micro-batch's position in the step (error
buffers are per slot); ``idx`` the batch's sample indices (AQ-SGD's buffers are per sample).

- :class:`Plain`: the compressor alone.
- :class:`EF` (error feedback): send ``C(x + e)``, keep ``e <- x + e - C(x + e)`` (sender
  state only), so the sum of what was sent is the sum of the inputs minus the last error.
- :class:`EF21`: both sides keep ``g``; send ``c = C(x - g)``, both set ``g <- g + c``; the
  receiver outputs ``g``.
- :class:`AQSGD`: both sides keep one buffer per training sample; a sample's first visit
  sends it whole, later visits the compressed change since the last one; the receiver
  outputs the buffer. Its memory (``aqsgd_bytes``) is two copies -- sender and receiver --
  of one activation per training sample; :func:`make_codec` needs the count to say it.

Every codec's state goes into ``state_dict`` (checkpoints) and comes back with
``load_state_dict``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.strategy.compressor_text import (
    check_quant_bits,
    check_topk_fraction,
    parse_compressor_text,
)

__all__ = ["AQSGD", "EF", "EF21", "FEEDBACKS", "Codec", "Compressor", "Identity", "Payload",
           "Plain", "Quant", "TopK", "aqsgd_bytes", "make_codec", "parse_compressor"]

FEEDBACKS = ("none", "ef", "ef21", "aqsgd")


@dataclass
class Payload:
    """What goes on the wire for one tensor (``shape``/``dtype`` are agreed, not sent)."""

    tensors: tuple[Tensor, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    form: str = ""  # "indices" / "bitmap" for TopK; "" otherwise

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class Compressor:
    """``compress -> Payload``, ``decompress``, and the exact wire size."""

    name = "compressor"

    def compress(self, x: Tensor) -> Payload:
        raise NotImplementedError

    def decompress(self, p: Payload) -> Tensor:
        raise NotImplementedError

    def wire_bytes(self, n: int, itemsize: int) -> int:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        return self.name


class Identity(Compressor):
    name = "identity"

    def compress(self, x: Tensor) -> Payload:
        return Payload((x,), tuple(x.shape), x.dtype)

    def decompress(self, p: Payload) -> Tensor:
        return p.tensors[0]

    def wire_bytes(self, n: int, itemsize: int) -> int:
        return n * itemsize


def _index_width(n: int) -> int:
    """Bytes of the narrowest unsigned integer that holds every index below ``n``."""
    for w in (1, 2, 4):
        if n <= 1 << (8 * w):
            return w
    return 8


_UNSIGNED_AS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _pack_bits(levels: Tensor, bits: int) -> Tensor:
    """Non-negative integers below 2**bits, ``bits`` bits each, little-endian in bytes."""
    n = levels.numel()
    shifts = torch.arange(bits, dtype=torch.int64)
    flat = ((levels.reshape(-1, 1).to(torch.int64) >> shifts) & 1).reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = (1 << torch.arange(8, dtype=torch.int64))
    out = (flat.reshape(-1, 8) * weights).sum(1).to(torch.uint8)
    assert out.numel() == math.ceil(n * bits / 8)
    return out


def _unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    flat = ((packed.to(torch.int64).reshape(-1, 1) >> torch.arange(8)) & 1).reshape(-1)
    flat = flat[: n * bits].reshape(n, bits)
    return (flat << torch.arange(bits, dtype=torch.int64)).sum(1)


class TopK(Compressor):
    """Keep the ``ceil(frac * n)`` largest magnitudes (ties: torch.topk's choice)."""

    def __init__(self, frac: float) -> None:
        self.frac = check_topk_fraction(frac)
        self.name = f"topk:{frac:g}"

    def k_of(self, n: int) -> int:
        return max(1, min(n, math.ceil(self.frac * n - 1e-9))) if n else 0

    def _forms(self, n: int, itemsize: int) -> tuple[int, int]:
        k = self.k_of(n)
        return k * itemsize + k * _index_width(n), k * itemsize + math.ceil(n / 8)

    def wire_bytes(self, n: int, itemsize: int) -> int:
        return min(self._forms(n, itemsize))

    def compress(self, x: Tensor) -> Payload:
        flat = x.detach().reshape(-1)
        n = flat.numel()
        k = self.k_of(n)
        idx = torch.topk(flat.abs(), k, sorted=False).indices.sort().values if k else \
            flat.new_zeros(0, dtype=torch.int64)
        vals = flat[idx]
        by_index, by_bitmap = self._forms(n, x.element_size())
        if by_bitmap < by_index:
            mask = torch.zeros(n, dtype=torch.int64)
            mask[idx] = 1
            return Payload((vals, _pack_bits(mask, 1)), tuple(x.shape), x.dtype, "bitmap")
        w = _index_width(n)
        return Payload((vals, idx.to(_UNSIGNED_AS[w])), tuple(x.shape), x.dtype, "indices")

    def decompress(self, p: Payload) -> Tensor:
        n = math.prod(p.shape)
        vals, meta = p.tensors
        if p.form == "bitmap":
            idx = _unpack_bits(meta, 1, n).nonzero().reshape(-1)
        else:
            w = meta.element_size()
            idx = meta.to(torch.int64) & ((1 << (8 * w)) - 1) if w < 8 else meta
        out = torch.zeros(n, dtype=p.dtype, device=vals.device)
        out[idx] = vals
        return out.reshape(p.shape)


class Quant(Compressor):
    """``bits``-bit uniform quantization between the tensor's min and max."""

    def __init__(self, bits: int, stochastic: bool = False, seed: int = 0) -> None:
        self.bits, self.stochastic = check_quant_bits(bits), bool(stochastic)
        self.gen = torch.Generator().manual_seed(seed)
        self.name = f"quant:{bits}" + (",stochastic" if stochastic else "")

    def wire_bytes(self, n: int, itemsize: int) -> int:
        return math.ceil(n * self.bits / 8) + 8

    def compress(self, x: Tensor) -> Payload:
        xf = x.detach().reshape(-1).to(torch.float32)
        top = (1 << self.bits) - 1
        if xf.numel() == 0:
            lo, hi = 0.0, 0.0
        else:
            lo, hi = float(xf.min()), float(xf.max())
        step = (hi - lo) / top if hi > lo else 0.0
        if step > 0:
            v = (xf - lo) / step
            if self.stochastic:
                v = torch.floor(v + torch.rand(v.shape, generator=self.gen))
            else:
                v = torch.round(v)
            q = v.clamp(0, top).to(torch.int64)
        else:
            q = torch.zeros(xf.numel(), dtype=torch.int64)
        header = torch.tensor([lo, step], dtype=torch.float32)
        return Payload((_pack_bits(q, self.bits), header), tuple(x.shape), x.dtype)

    def decompress(self, p: Payload) -> Tensor:
        packed, header = p.tensors
        n = math.prod(p.shape)
        q = _unpack_bits(packed, self.bits, n).to(torch.float32)
        return (header[0] + q * header[1]).to(p.dtype).reshape(p.shape)

    def state_dict(self) -> dict[str, Any]:
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.gen.set_state(state["gen"])


def parse_compressor(text: str, *, seed: int = 0) -> Compressor:
    """The compressor of ``text`` (:func:`~qsync_opt.strategy.compressor_text.
    parse_compressor_text`: ``none`` / ``identity``, ``topk:F``, ``quant:B[,stochastic]``);
    ``seed`` seeds stochastic rounding."""
    spec = parse_compressor_text(text)
    if spec.kind == "topk":
        return TopK(spec.frac)
    if spec.kind == "quant":
        return Quant(spec.bits, stochastic=spec.stochastic, seed=seed)
    return Identity()


class Codec:
    """One direction of one boundary: ``encode`` on the sender, ``decode`` on the receiver."""

    def __init__(self, comp: Compressor) -> None:
        self.comp = comp

    def encode(self, x: Tensor, idx: Tensor | None = None, slot: int = 0) -> Payload:
        raise NotImplementedError

    def decode(self, p: Payload, idx: Tensor | None = None, slot: int = 0) -> Tensor:
        raise NotImplementedError

    def wire_bytes(self, n: int, itemsize: int) -> int:
        """Bytes of one message of ``n`` elements (AQ-SGD: a later visit's)."""
        return self.comp.wire_bytes(n, itemsize)

    def state_dict(self) -> dict[str, Any]:
        return {"comp": self.comp.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.comp.load_state_dict(state["comp"])


class Plain(Codec):
    def encode(self, x: Tensor, idx: Tensor | None = None, slot: int = 0) -> Payload:
        return self.comp.compress(x)

    def decode(self, p: Payload, idx: Tensor | None = None, slot: int = 0) -> Tensor:
        return self.comp.decompress(p)


def _key(slot: int, x_shape: tuple[int, ...]) -> str:
    return f"{slot}:{'x'.join(map(str, x_shape))}"


class EF(Codec):
    """Error feedback: the sender adds back what compression left out last time."""

    def __init__(self, comp: Compressor) -> None:
        super().__init__(comp)
        self.error: dict[str, Tensor] = {}

    def encode(self, x: Tensor, idx: Tensor | None = None, slot: int = 0) -> Payload:
        k = _key(slot, tuple(x.shape))
        y = x.detach() + self.error[k] if k in self.error else x.detach().clone()
        p = self.comp.compress(y)
        self.error[k] = y - self.comp.decompress(p)
        return p

    def decode(self, p: Payload, idx: Tensor | None = None, slot: int = 0) -> Tensor:
        return self.comp.decompress(p)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "error": {k: v.clone() for k, v in self.error.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.error = {k: v.clone() for k, v in state["error"].items()}


class EF21(Codec):
    """EF21: both sides keep the estimate ``g`` and move it by the compressed difference."""

    def __init__(self, comp: Compressor) -> None:
        super().__init__(comp)
        self.g: dict[str, Tensor] = {}

    def encode(self, x: Tensor, idx: Tensor | None = None, slot: int = 0) -> Payload:
        k = _key(slot, tuple(x.shape))
        g = self.g.get(k)
        p = self.comp.compress(x.detach() - g if g is not None else x.detach())
        c = self.comp.decompress(p)
        self.g[k] = g + c if g is not None else c.clone()
        return p

    def decode(self, p: Payload, idx: Tensor | None = None, slot: int = 0) -> Tensor:
        k = _key(slot, p.shape)
        c = self.comp.decompress(p)
        g = self.g.get(k)
        self.g[k] = g + c if g is not None else c.clone()
        return self.g[k].clone()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "g": {k: v.clone() for k, v in self.g.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.g = {k: v.clone() for k, v in state["g"].items()}


def aqsgd_bytes(n_samples: int, sample_numel: int, itemsize: int = 4) -> int:
    """AQ-SGD's buffer memory for one boundary direction: one copy each side."""
    return 2 * n_samples * sample_numel * itemsize


class AQSGD(Codec):
    """AQ-SGD: per-sample buffers; the first visit sends a sample whole, later visits the
    compressed change since its last one. The batch's first dimension is its samples."""

    def __init__(self, comp: Compressor, n_samples: int) -> None:
        super().__init__(comp)
        if n_samples < 1:
            raise QsyncInputError(f"aqsgd: expected the number of training samples >= 1, "
                                  f"got {n_samples}")
        self.n = n_samples
        self.buf: Tensor | None = None  # (n_samples, *sample_shape), allocated on first use
        self.seen: Tensor = torch.zeros(n_samples, dtype=torch.bool)

    def _check(self, x_shape: tuple[int, ...], dtype: torch.dtype, idx: Tensor | None) -> Tensor:
        if idx is None:
            raise QsyncInputError("aqsgd: needs each sample's index (the batches carry none)")
        idx = idx.reshape(-1).to(torch.int64)
        if idx.numel() != x_shape[0]:
            raise QsyncInputError(f"aqsgd: {idx.numel()} indices for a batch of {x_shape[0]}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.n):
            raise QsyncInputError(f"aqsgd: sample index outside 0..{self.n - 1}")
        if torch.unique(idx).numel() != idx.numel():
            raise QsyncInputError("aqsgd: a sample appears twice in one batch")
        if self.buf is None:
            self.buf = torch.zeros((self.n, *x_shape[1:]), dtype=torch.float32)
        elif tuple(self.buf.shape[1:]) != tuple(x_shape[1:]):
            raise QsyncInputError(f"aqsgd: sample shape {tuple(x_shape[1:])}, the buffer's "
                                  f"is {tuple(self.buf.shape[1:])}")
        return idx

    def _split(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        seen = self.seen[idx]
        return seen.nonzero().reshape(-1), (~seen).nonzero().reshape(-1)

    def encode(self, x: Tensor, idx: Tensor | None = None, slot: int = 0) -> Payload:
        idx = self._check(tuple(x.shape), x.dtype, idx)
        old, new = self._split(idx)
        assert self.buf is not None
        xd = x.detach()
        full = xd[new]
        delta = xd[old].to(torch.float32) - self.buf[idx[old]]
        p = self.comp.compress(delta)
        self.buf[idx[new]] = full.to(torch.float32)
        self.buf[idx[old]] += self.comp.decompress(p).to(torch.float32)
        self.seen[idx] = True
        return Payload((full, *p.tensors), tuple(x.shape), x.dtype, p.form)

    def decode(self, p: Payload, idx: Tensor | None = None, slot: int = 0) -> Tensor:
        idx = self._check(p.shape, p.dtype, idx)
        old, new = self._split(idx)
        assert self.buf is not None
        full, *rest = p.tensors
        inner = Payload(tuple(rest), (len(old), *p.shape[1:]), torch.float32, p.form)
        self.buf[idx[new]] = full.to(torch.float32)
        self.buf[idx[old]] += self.comp.decompress(inner)
        self.seen[idx] = True
        return self.buf[idx].to(p.dtype)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "seen": self.seen.clone(),
                "buf": None if self.buf is None else self.buf.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.seen = state["seen"].clone()
        self.buf = None if state["buf"] is None else state["buf"].clone()


def make_codec(comp: Compressor, feedback: str, *, n_samples: int | None = None) -> Codec:
    """The codec for one side of one boundary direction (make one for each side)."""
    if feedback not in FEEDBACKS:
        raise QsyncInputError(f"feedback: expected one of {', '.join(FEEDBACKS)}, "
                              f"got {feedback!r}")
    if feedback == "ef":
        return EF(comp)
    if feedback == "ef21":
        return EF21(comp)
    if feedback == "aqsgd":
        if n_samples is None:
            raise QsyncInputError("aqsgd: needs the number of training samples")
        return AQSGD(comp, n_samples)
    return Plain(comp)
