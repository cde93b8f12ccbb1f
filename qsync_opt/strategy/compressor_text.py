"""The text of a boundary compressor, parsed and checked without torch: ``none`` (or
``identity``), ``topk:F`` (F a fraction, or a percentage ending in %) and
``quant:B[,stochastic]`` (B bits from 1 to 8). The command line and the run's config check
a flag's text with :func:`parse_compressor_text` when they read it;
:func:`qsync_opt.strategy.codecs.parse_compressor` builds the compressor from the same
:class:`CompressorText`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.limits import parse_float, parse_int

__all__ = ["CompressorText", "check_quant_bits", "check_topk_fraction",
           "parse_compressor_text"]


@dataclass(frozen=True)
class CompressorText:
    """What a compressor's text says: ``kind`` ``identity``, ``topk`` (keeping ``frac``)
    or ``quant`` (``bits`` bits, rounding ``stochastic`` or to nearest)."""

    kind: str
    frac: float = 1.0
    bits: int = 0
    stochastic: bool = False


def check_topk_fraction(frac: float) -> float:
    """``topk``'s fraction: finite, in (0, 1]."""
    if not (0.0 < frac <= 1.0) or not math.isfinite(frac):
        raise QsyncInputError(f"topk: expected a fraction in (0, 1], got {frac!r}")
    return float(frac)


def check_quant_bits(bits: int) -> int:
    """``quant``'s bits: an integer from 1 to 8."""
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise QsyncInputError(f"quant: expected bits from 1 to 8, got {bits!r}")
    return bits


def parse_compressor_text(text: str) -> CompressorText:
    """``none`` / ``identity``, ``topk:F`` (F a fraction, or a percentage ending in %),
    ``quant:B[,stochastic]``; anything else refused in one line."""
    t = text.strip().lower()
    if t in ("none", "identity"):
        return CompressorText("identity")
    kind, _, rest = t.partition(":")
    if kind == "topk" and rest:  # numbers in ASCII digits only (never '٣' or '²')
        pct = rest.endswith("%")
        got = parse_float(rest[:-1] if pct else rest)
        frac = float("nan") if got is None else got / 100 if pct else got
        return CompressorText("topk", frac=check_topk_fraction(frac))
    if kind == "quant" and rest:
        bits_s, _, opt = rest.partition(",")
        bits = parse_int(bits_s)
        if opt not in ("", "stochastic") or bits is None:
            raise QsyncInputError(f"compressor: expected quant:B[,stochastic] with B an "
                                  f"integer from 1 to 8, got {text!r}")
        return CompressorText("quant", bits=check_quant_bits(bits),
                              stochastic=opt == "stochastic")
    raise QsyncInputError(f"compressor: expected none, topk:F or quant:B[,stochastic], "
                          f"got {text!r}")
