"""The boundary compressors' texts (``none``, ``topk:F``, ``topk:N%``, ``quant:B[,stochastic]``)
parsed without torch: what a plan's pipeline names is checked by the planner and
``check_plan`` without importing the codecs (:mod:`qsync_opt.strategy.codecs` builds the
compressor from the same :class:`CompressorSpec`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.limits import parse_float, parse_int

__all__ = ["CompressorSpec", "parse_compressor_spec"]


@dataclass(frozen=True)
class CompressorSpec:
    """``kind`` none, topk (``frac`` of the elements kept) or quant (``bits`` per element)."""

    kind: str = "none"
    frac: float = 1.0
    bits: int = 32
    stochastic: bool = False


def parse_compressor_spec(text: str) -> CompressorSpec:
    """``none`` / ``identity``, ``topk:F`` (F a fraction in (0, 1], or a percentage ending
    in %), ``quant:B[,stochastic]`` (B from 1 to 8); numbers in ASCII digits only."""
    t = text.strip().lower()
    if t in ("none", "identity"):
        return CompressorSpec()
    kind, _, rest = t.partition(":")
    if kind == "topk" and rest:
        pct = rest.endswith("%")
        got = parse_float(rest[:-1] if pct else rest)
        frac = float("nan") if got is None else got / 100 if pct else got
        if not (0.0 < frac <= 1.0) or not math.isfinite(frac):
            raise QsyncInputError(f"topk: expected a fraction in (0, 1], got {frac!r}")
        return CompressorSpec("topk", frac=float(frac))
    if kind == "quant" and rest:
        bits_s, _, opt = rest.partition(",")
        bits = parse_int(bits_s)
        if opt not in ("", "stochastic") or bits is None:
            raise QsyncInputError(f"compressor: expected quant:B[,stochastic] with B an "
                                  f"integer from 1 to 8, got {text!r}")
        if not 1 <= bits <= 8:
            raise QsyncInputError(f"quant: expected bits from 1 to 8, got {bits!r}")
        return CompressorSpec("quant", bits=bits, stochastic=opt == "stochastic")
    raise QsyncInputError(f"compressor: expected none, topk:F or quant:B[,stochastic], "
                          f"got {text!r}")
