"""The one DDP communication hook: the gradient-transport chain of ``--comm``, timed.

DDP has a single comm-hook slot, so every transport is a stage of one chain, registered once
(:meth:`~qsync_opt.runtime.sync.DDPSync.wrap`): ``allreduce`` divides each FP32 bucket by the
world and all-reduces it (torch's ``allreduce_hook``); ``fp16`` casts it to fp16 and divides
there (torch's ``fp16_compress_hook``), all-reduces, and casts back into the bucket; ``dlcp`` first zero-fills the chunks
:mod:`.dlcp`'s policy drops (the whole gradient is one bucket) and, for its ``unbiased``
policy, all-reduces the kept counts and rescales each chunk after the sum. Each
bucket's launch-to-completion interval and payload bytes go to the run's
:class:`~qsync_opt.runtime.sync.CommMeter`.

(This module has no ``from __future__ import annotations``: DDP checks the hook's ``bucket``
annotation against ``dist.GradBucket`` itself, not a string.)
"""

import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["HookState", "chain_hook", "encode"]


def encode(buf: torch.Tensor, world: int, comm: str) -> torch.Tensor:
    """The payload the all-reduce sums: the bucket divided by the world (in place for
    ``allreduce`` and ``dlcp``), or cast to fp16 first and divided there (``fp16``)."""
    if comm == "fp16":
        return buf.to(torch.float16).div_(world)
    return buf.div_(world)


class HookState:
    """What the hook needs: the world size, the transport and the meter; for ``dlcp`` the
    run's :class:`~qsync_opt.runtime.dlcp.DropRecorder` (``drops``), the model's
    parameters in their order (``params``), this rank and the step being run."""

    def __init__(self, world: int, comm: str, meter: Any, drops: Any = None,
                 params: Any = None, rank: int = 0) -> None:
        self.world, self.comm, self.meter = world, comm, meter
        self.drops, self.params, self.rank, self.step = drops, params, rank, 0


def _in_model_order(state: HookState, bucket: dist.GradBucket) -> list[torch.Tensor]:
    """The bucket's gradient views in the model's parameter order (dlcp has one bucket)."""
    views = {id(p): g for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)}
    if len(views) != len(state.params):
        raise RuntimeError(f"dlcp: a DDP bucket holds {len(views)} of the model's "
                           f"{len(state.params)} gradients; the drop bound is over the whole "
                           "gradient, so DDP must keep it in one bucket")
    return [views[id(p)] for p in state.params]


def chain_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    t0 = time.perf_counter()
    buf = bucket.buffer()
    drops = state.drops
    grads: list[torch.Tensor] = []
    counts = None
    if drops is not None:  # stage 1: zero-fill the dropped chunks
        grads = _in_model_order(state, bucket)
        counts = drops.stage(grads, state.step, state.rank)
        if counts is not None:  # unbiased: the kept counts first, the same order everywhere
            dist.all_reduce(counts)
    # stage 2: the payload (unbiased: summed as is, rescaled per chunk afterwards)
    payload = buf if counts is not None else encode(buf, state.world, state.comm)
    nbytes = payload.numel() * payload.element_size() + (
        0 if counts is None else counts.numel() * counts.element_size())
    meter = state.meter

    def done(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out = fut.value()[0]
        if out.dtype != buf.dtype:
            buf.copy_(out)  # decompress into the bucket (torch's hook does the same)
            out = buf
        if counts is not None:
            from .dlcp import rescale

            rescale(grads, drops.table, counts)
        meter.interval(t0, time.perf_counter(), nbytes)
        return out

    fut = dist.all_reduce(payload, async_op=True).get_future()
    return fut.then(done)
