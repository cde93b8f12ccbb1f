"""Figures drawn with matplotlib, an optional dependency imported only where a figure is
drawn: a figure made outside pyplot (:func:`new_figure`: no GUI backend to choose, nothing to
close) and its PNG bytes (:func:`png_bytes`), which the caller writes with the package's one
writer."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["new_figure", "png_bytes"]

#: The resolution of every PNG the package draws.
DPI = 110


def new_figure(figsize: tuple[float, float],
               layout: Literal["constrained", "tight"] | None = None) -> Figure:
    """A matplotlib figure of ``figsize`` inches (``layout``: matplotlib's, e.g.
    ``"constrained"``), drawn by the Agg renderer when saved."""
    from matplotlib.figure import Figure  # optional dependency: only where a figure is drawn

    return Figure(figsize=figsize, layout=layout)


def png_bytes(fig: Figure, *, tight: bool = False) -> bytes:
    """``fig`` as a PNG at :data:`DPI` (``tight``: cropped to what is drawn)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight" if tight else None)
    return buf.getvalue()
