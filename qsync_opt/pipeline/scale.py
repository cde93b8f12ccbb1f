"""The pipeline's loss-scale start and run warnings: the data-parallel rule, reused.

A pipeline run (:mod:`qsync_opt.pipeline.run`, in one process or one process per stage) starts its fp16
loss scale where a data-parallel run does (:mod:`qsync_opt.runtime.scaler`): a fresh run with fp16 and no
``--loss-scale`` runs step 0's batch forward and backward through the whole pipeline at each
of :data:`~qsync_opt.runtime.scaler.PROBE_SCALES`, largest first (:func:`~qsync_opt.runtime.scaler.probe_scale`), and starts at
the first where the loss and every stage's gradients are finite; across processes each stage
checks its own gradients (the last stage the loss too) and the ranks all-reduce the count, so
they agree on the scale. The probe leaves no trace (:func:`untouched`). The summary gets the
same ``warnings`` as a data-parallel run's (:func:`~qsync_opt.runtime.metrics.run_warnings`), printed first on
its line, with ``loss_scale``, ``first_loss`` and ``scale_probe``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from qsync_opt.pipeline.stages import Pipeline
from qsync_opt.runtime.checkpoint import qseeds, set_qseeds
from qsync_opt.runtime.metrics import run_warnings
from qsync_opt.runtime.scaler import LossScaler, probe_scale

__all__ = ["pipeline_run_fields", "start_pipeline_scale", "untouched"]


@contextlib.contextmanager
def untouched(pipe: Pipeline, stages: Sequence[nn.Module], counters: Any = None
              ) -> Iterator[None]:
    """Everything a probe step through ``pipe`` changes, put back after it: the gradients
    of ``stages`` (cleared before and after), their buffers, stochastic-rounding seeds and
    functional-dispatch seeds, the torch RNG, every boundary's codec state (feedback buffers,
    RNGs, byte counters) and last shape, and ``counters.header_bytes`` when given."""
    rng = torch.get_rng_state()
    codecs = copy.deepcopy(pipe.codec_state())
    shapes = {n: b.last_shape for n, b in pipe.boundaries.items()}
    header = getattr(counters, "header_bytes", None)
    saved = []
    for m in stages:
        disp = m.__dict__.get("_qsync_dispatch")
        saved.append(([b.detach().clone() for b in m.buffers()], qseeds(m), disp,
                      getattr(disp, "seed", None)))
        m.zero_grad(set_to_none=True)
    try:
        yield
    finally:
        for m, (bufs, seeds, disp, disp_seed) in zip(stages, saved, strict=True):
            m.zero_grad(set_to_none=True)
            with torch.no_grad():
                for b, old in zip(m.buffers(), bufs, strict=True):
                    b.copy_(old)
            set_qseeds(m, seeds)
            if disp is not None:
                disp.seed = disp_seed
        pipe.load_codec_state(codecs)
        for n, shape in shapes.items():
            pipe.boundaries[n].last_shape = shape
        if header is not None:
            counters.header_bytes = header
        torch.set_rng_state(rng)


def start_pipeline_scale(scaler: LossScaler, *, fresh: bool, loss_scale: float | None,
                         pipe: Pipeline, stages: Sequence[nn.Module],
                         step_at: Callable[[float], float], loss_here: bool = True,
                         total_bad: Callable[[int], int] = int, counters: Any = None
                         ) -> dict[str, Any] | None:
    """Set ``scaler``'s start by the probe (module docstring) and return ``{"tried",
    "scale"}``, or None where no probe runs (no fp16, a resumed run, a ``loss_scale`` given).
    ``step_at(scale)`` runs step 0's batch forward and backward through this process's
    ``stages`` at ``scale`` and returns the unscaled loss; ``loss_here``: this process
    holds the loss (the last stage); ``total_bad`` sums a count over the ranks (identity in
    one process)."""
    if not (scaler.dynamic and loss_scale is None and fresh):
        return None

    def finite_at(scale: float) -> bool:
        with untouched(pipe, stages, counters):
            loss = step_at(scale)
            bad = scaler.nonfinite(stages, [loss] if loss_here else [])
        return total_bad(bad) == 0

    chosen, tried = probe_scale(finite_at)
    scaler.scale = chosen
    return {"tried": tried, "scale": chosen}


def pipeline_run_fields(scaler: LossScaler, probe: dict[str, Any] | None, *, steps: int,
                        skipped: int, first_loss: float | None, final_loss: float,
                        eval_loss: float | None) -> dict[str, Any]:
    """What a pipeline summary adds to say how its run went, as a data-parallel one's."""
    return {"loss_scale": scaler.scale, "first_loss": first_loss,
            **({"scale_probe": probe} if probe is not None else {}),
            "warnings": run_warnings(steps, skipped, first_loss, final_loss, eval_loss)}
