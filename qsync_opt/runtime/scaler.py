"""Dynamic loss scaling, and the check for non-finite losses and gradients.

fp16 gets a dynamic loss scale: the loss is multiplied by :attr:`LossScaler.scale` before
backward, the gradients divided by it before the optimizer step (:meth:`LossScaler.unscale_`);
a step with a non-finite loss or gradient on any rank is skipped and halves the scale (not
below 1), ``growth_interval`` good steps in a row double it (not above ``max_scale``). A
scaler whose initial scale is 1 (no fp16 anywhere) never changes it. Its state
(:meth:`LossScaler.state_dict`: ``scale`` and ``good``) goes into every checkpoint.

**Where the scale starts.** Halving from 2**16 on each overflow wastes the first steps of a
model whose fp16 gradients overflow far below it (ResNet-50 and ConvNeXt skipped every step
of a 3-step run). So a fresh run with fp16 and no ``--loss-scale`` first probes: one forward
and backward of step 0's batch at each of :data:`PROBE_SCALES` (2**16, 2**12, 2**8, 2**4, 1),
largest first, until every rank's loss and gradients are finite (:func:`probe_scale`); the
scale starts there, the probe leaves no trace (gradients cleared; buffers, RNG state and
stochastic-rounding seeds restored) and step 0 trains at that scale. A model finite at 2**16
costs one extra forward and backward and starts where it always did; one that overflows
everywhere down to 1 starts at 1 and its steps are skipped as before. A resumed run keeps its
checkpoint's scale; a config's ``loss_scale`` sets the start and turns the probe off.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["GROWTH_INTERVAL", "MAX_SCALE", "PROBE_SCALES", "LossScaler", "grads_finite",
           "probe_scale"]

#: Good steps in a row after which the scale doubles.
GROWTH_INTERVAL = 2000
#: The greatest scale.
MAX_SCALE = 2.0 ** 24
#: The initial scales a fresh fp16 run probes, largest first (module docstring).
PROBE_SCALES = (2.0 ** 16, 2.0 ** 12, 2.0 ** 8, 2.0 ** 4, 1.0)


def probe_scale(finite_at: Callable[[float], bool],
                scales: Sequence[float] = PROBE_SCALES) -> tuple[float, list[float]]:
    """The first of ``scales`` at which ``finite_at(scale)`` holds (the last when none does),
    and the scales tried. ``finite_at`` runs one probe and says whether every rank's loss
    and gradients were finite (the same answer on every rank)."""
    tried: list[float] = []
    for s in scales:
        tried.append(float(s))
        if finite_at(float(s)):
            return float(s), tried
    return float(scales[-1]), tried


def grads_finite(model: nn.Module) -> bool:
    """Every gradient finite. Through reductions only: ``isfinite`` materialises a float
    and a bool copy of each gradient (at a small batch that check set the rank's peak
    memory); max and min propagate NaN and show an infinity, and allocate one number each."""
    for p in model.parameters():
        g = p.grad
        if g is None or g.numel() == 0:
            continue
        hi, lo = torch.aminmax(g)
        if not (math.isfinite(float(hi)) and math.isfinite(float(lo))):
            return False
    return True


class LossScaler:
    """The loss scale of one run (module docstring); the same on every rank and replica."""

    def __init__(self, init_scale: float, growth_interval: int = GROWTH_INTERVAL,
                 max_scale: float = MAX_SCALE) -> None:
        self.init_scale = float(init_scale)
        self.scale = float(init_scale)
        self.good = 0  # good steps since the last skipped one
        self.growth_interval, self.max_scale = growth_interval, max_scale

    @property
    def dynamic(self) -> bool:
        """Whether the scale moves (an initial scale above 1)."""
        return self.init_scale > 1

    def nonfinite(self, models: Iterable[nn.Module], losses: Iterable[float]) -> int:
        """How many of the local replicas' gradients and losses are not finite (0: all
        finite); the trainer sums it over the ranks before it decides."""
        bad = sum(1 for m in models if not grads_finite(m))
        return bad + sum(1 for loss in losses if not math.isfinite(loss))

    def unscale_(self, model: nn.Module) -> None:
        """Divide ``model``'s gradients by the scale, in place (nothing at scale 1)."""
        if self.scale == 1.0:
            return
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(self.scale)

    def update(self, skipped: bool) -> None:
        """After a step: a skipped one halves a dynamic scale and restarts the count, a good
        one counts and doubles it every ``growth_interval`` good steps."""
        if skipped:
            if self.dynamic:
                self.scale = max(self.scale / 2, 1.0)
            self.good = 0
            return
        self.good += 1
        if self.dynamic and self.good % self.growth_interval == 0:
            self.scale = min(self.scale * 2, self.max_scale)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good": self.good}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.good = float(state["scale"]), int(state["good"])
