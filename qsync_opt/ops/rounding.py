"""Rounding and scale granularity per tensor role: the defaults every integer op takes
when its caller passes none (:data:`NUMERICS`), and :func:`numerics` to change them for a
block."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

__all__ = ["GRAD_SCALES", "NUMERICS", "Numerics", "grad_scale_code", "numerics", "pick"]


@dataclasses.dataclass(frozen=True)
class Numerics:
    """Rounding and scale granularity per tensor role, the defaults every integer op takes
    when its caller passes none (the precision layers, the dispatcher and hfta pass none).

    Chosen by one-step gradient cosine against fp32 (``benchmarks/bench_grad_noise.py``,
    docs/BENCHMARKS.md): ``int8_forward_stochastic`` (int8 / int8_full activations and
    weights), ``int4_forward_stochastic`` (int4: round to nearest, see COSTS.md),
    ``grad_stochastic`` (what int8_full's backward quantizes: the output gradient and the
    weight re-quantized per input column) and ``grad_scale``, the output gradient's scales:
    ``"tensor"`` (one), ``"row"`` (one per row, i.e. per token / output position, for the
    input-gradient GEMM; one per tensor for the weight-gradient GEMM) or ``"rowcol"`` (per
    row for the input gradient, per output channel for the weight gradient). Each is exact
    in the integer GEMM: a row scale of ``go`` is a row scale of ``go @ W``, a column scale
    of ``go`` a row scale of ``go^T @ x``.
    """

    int8_forward_stochastic: bool = True
    int4_forward_stochastic: bool = False
    grad_stochastic: bool = True
    grad_scale: str = "rowcol"


GRAD_SCALES = ("tensor", "row", "rowcol")
NUMERICS = Numerics()


@contextlib.contextmanager
def numerics(**changes: Any) -> Iterator[Numerics]:
    """Within the block, :data:`NUMERICS` with ``changes`` (for measurements and tests)."""
    global NUMERICS
    before = NUMERICS
    NUMERICS = dataclasses.replace(before, **changes)
    if NUMERICS.grad_scale not in GRAD_SCALES:
        NUMERICS = before
        raise ValueError(f"grad_scale: expected one of {', '.join(GRAD_SCALES)}, got "
                         f"{changes.get('grad_scale')!r}")
    try:
        yield NUMERICS
    finally:
        NUMERICS = before


def grad_scale_code(grad_scale: str | None) -> int:
    name = NUMERICS.grad_scale if grad_scale is None else grad_scale
    if name not in GRAD_SCALES:
        raise ValueError(f"grad_scale: expected one of {', '.join(GRAD_SCALES)}, got {name!r}")
    return GRAD_SCALES.index(name)


def pick(value: bool | None, default: bool) -> bool:
    return default if value is None else bool(value)
