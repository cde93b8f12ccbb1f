"""The layouts of a fused array's values and the moves between them (:mod:`qsync_opt.hfta`):

* ``C``, channel-folded ``[N, B*C, *spatial]``: the conv family, model ``b``'s channels at
  ``b*C .. b*C + C - 1``;
* ``M``, model-major ``[B, *per_model_shape]`` of any rank: the linear family and
  transformers, model ``b``'s value at index ``b``;
* ``S``, shared, no model axis: what every model computes alike (buffers, masks, position
  ids, sizes, a replicated input).

:func:`fold` and :func:`unfold` move between model-major and channel-folded,
:func:`conv_to_linear` is the flatten between a conv trunk and a linear head,
:func:`expand_shared` gives a shared tensor to every model, :func:`convert_layout` is the
move a fused array's ``convert`` step names.
"""

from __future__ import annotations

from torch import Tensor

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.hfta.stacking import check_model_count

__all__ = ["LAYOUT_NAMES", "conv_to_linear", "convert_layout", "expand_shared", "fold",
           "unfold", "with_singletons"]

#: Each layout in words (the walk's messages); ``Ms`` is a tuple of model-major values.
LAYOUT_NAMES = {"C": "channel-folded", "M": "model-major", "S": "shared (no model axis)",
                "Ms": "a tuple of model-major values"}

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
    check_model_count(B)
    if x.dim() < 2 or x.shape[1] % B:
        raise QsyncInputError(f"unfold: expected [N, B*C, *spatial] with B={B}, got shape "
                              f"{tuple(x.shape)}")
    n, bc = x.shape[:2]
    return x.reshape(n, B, bc // B, *x.shape[2:]).transpose(0, 1)


def conv_to_linear(x: Tensor, B: int) -> Tensor:
    """Channel-folded ``[N, B*C, H, W]`` -> model-major ``[B, N, C*H*W]``: the flatten between
    a conv trunk and a linear head, model ``b``'s features in the order of
    ``torch.flatten(x_b, 1)`` (any number of spatial dims)."""
    check_model_count(B)
    if x.dim() < 2 or x.shape[1] % B:
        raise QsyncInputError(f"conv_to_linear: expected [N, B*C, ...] with B={B}, got shape "
                              f"{tuple(x.shape)}")
    return x.reshape(x.shape[0], B, -1).transpose(0, 1)


def with_singletons(t: Tensor, k: int) -> Tensor:
    """Model-major ``t`` with ``k`` singleton dims after its model axis (a view)."""
    return t[(slice(None),) + (None,) * k] if k > 0 else t


def expand_shared(t: object, B: int, who: str) -> Tensor:
    """Shared ``t`` given to every model: ``[B, *t.shape]``, a view."""
    if not isinstance(t, Tensor):
        raise QsyncInputError(f"hfta: {who}: expected a tensor to give every model, got "
                              f"{type(t).__name__}")
    return t.unsqueeze(0).expand(B, *t.shape)


def convert_layout(x: object, how: str, B: int, who: str) -> Tensor:
    """A value moved between layouts (module docstring): fold / unfold between model-major
    and channel-folded, a shared tensor expanded to every model or repeated into each
    model's channels."""
    if how == "expand":
        return expand_shared(x, B, who)
    if how in ("fold", "unfold"):
        if not isinstance(x, Tensor):
            raise QsyncInputError(f"hfta: {who}: expected a tensor to {how}, got "
                                  f"{type(x).__name__}")
        return fold(x) if how == "fold" else unfold(x, B)
    if not isinstance(x, Tensor) or x.dim() < 2:
        raise QsyncInputError(f"hfta: {who}: expected a shared [N, C, ...] tensor to copy "
                              f"into each model's channels, got {x!r:.60}")
    return x.repeat(1, B, *([1] * (x.dim() - 2)))
