"""A pipeline of stages with point-to-point boundary transfers: the step time of GPipe.

Stages ``0 .. S-1`` run on their own devices, one compute stream each; stage ``s`` sends
each micro-batch's boundary activation to stage ``s + 1`` over its own link (full duplex:
forward activations and backward gradients do not share a direction), at ``gbps`` with a
one-way ``latency_us``, one transfer at a time per direction. A transfer takes
``bytes / bandwidth`` plus the latency; ``bytes`` is the compressed size
(:meth:`qsync_opt.strategy.codecs.Compressor.wire_bytes`), so a compressed pipeline's step
time follows from bytes and bandwidth alone.

GPipe, as :meth:`qsync_opt.pipeline.stages.Pipeline.train_step` runs it: every
micro-batch's forward, stage by stage (a stage starts micro-batch ``m`` once it has it and
has finished ``m - 1``), then the backwards in reverse micro-batch order, starting at the
last stage once its last forward is done. The step ends when stage 0 finishes its last
backward (optimizer steps and the tied-weight all-reduce are not modelled: they are small
beside the stages' compute in the workloads here, and the same with or without
compression).

With no transfer time and ``S`` equal stages of ``f + b`` per micro-batch the step is
``(M + S - 1) (f + b)``: the GPipe bubble (tested).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qsync_opt.core.errors import QsyncInputError

__all__ = ["PipelineStep", "pipeline_step"]


@dataclass(frozen=True)
class PipelineStep:
    step_ms: float
    compute_ms: list[float]  # per stage, its busy time
    transfer_ms: float  # summed over every boundary transfer, both directions
    bubble_frac: float  # 1 - (the busiest stage's compute) / step


def _xfer_ms(nbytes: float, gbps: float, latency_us: float) -> float:
    return nbytes * 8 / (gbps * 1e9) * 1e3 + latency_us * 1e-3


def pipeline_step(fwd_ms: Sequence[float], bwd_ms: Sequence[float],
                  act_bytes: Sequence[float], grad_bytes: Sequence[float], *,
                  micro_batches: int, gbps: float, latency_us: float = 0.0) -> PipelineStep:
    """``fwd_ms[s]``/``bwd_ms[s]``: stage s on one micro-batch; ``act_bytes[s]`` /
    ``grad_bytes[s]``: what crosses boundary s (stage s -> s + 1) per micro-batch."""
    S = len(fwd_ms)
    if S < 1 or len(bwd_ms) != S:
        raise QsyncInputError(f"stages: expected as many backward as forward times, got "
                              f"{len(fwd_ms)} and {len(bwd_ms)}")
    if len(act_bytes) != S - 1 or len(grad_bytes) != S - 1:
        raise QsyncInputError(f"boundaries: expected {S - 1} activation and gradient sizes, "
                              f"got {len(act_bytes)} and {len(grad_bytes)}")
    if micro_batches < 1:
        raise QsyncInputError(f"micro-batches: expected >= 1, got {micro_batches}")
    if not gbps > 0:
        raise QsyncInputError(f"gbps: expected > 0, got {gbps}")
    if min([*fwd_ms, *bwd_ms, *act_bytes, *grad_bytes, latency_us], default=0.0) < 0:
        raise QsyncInputError("pipeline: times and sizes must be >= 0")
    M = micro_batches
    free = [0.0] * S
    busy = [0.0] * S
    link_f = [0.0] * max(0, S - 1)
    link_b = [0.0] * max(0, S - 1)
    transfer = 0.0
    arrive = [[0.0] * M for _ in range(S)]
    for m in range(M):
        for s in range(S):
            start = max(arrive[s][m], free[s])
            free[s] = start + fwd_ms[s]
            busy[s] += fwd_ms[s]
            if s < S - 1:
                t = _xfer_ms(act_bytes[s], gbps, latency_us)
                send = max(free[s], link_f[s])
                link_f[s] = send + t - latency_us * 1e-3  # the wire is free once serialised
                arrive[s + 1][m] = send + t
                transfer += t
    back = [[0.0] * M for _ in range(S)]
    for m in reversed(range(M)):
        for s in reversed(range(S)):
            start = max(back[s][m], free[s])
            free[s] = start + bwd_ms[s]
            busy[s] += bwd_ms[s]
            if s > 0:
                t = _xfer_ms(grad_bytes[s - 1], gbps, latency_us)
                send = max(free[s], link_b[s - 1])
                link_b[s - 1] = send + t - latency_us * 1e-3
                back[s - 1][m] = send + t
                transfer += t
    step = max(free)
    return PipelineStep(step, busy, transfer, 1 - max(busy) / step if step > 0 else 0.0)
