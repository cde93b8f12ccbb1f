"""The one DDP communication hook: the gradient-transport chain of ``--comm``, timed.

DDP has a single comm-hook slot, so every transport is a stage of one chain, registered once
(:meth:`~qsync_opt.sync.replicas.DDPSync.wrap`): ``allreduce`` divides each FP32 bucket by the
world and all-reduces it (torch's ``allreduce_hook``); ``fp16`` casts it to fp16 and divides
there (torch's ``fp16_compress_hook``), all-reduces, and casts back into the bucket; ``dlcp`` first zero-fills the chunks
:mod:`qsync_opt.strategy.droppolicy` drops from the bucket's tensors (the simulated network's losses, or the
stress mode's policy) (DDP keeps its buckets, so
communication still overlaps backward; the bound is per tensor, so per bucket too) and,
for its ``unbiased`` policy, all-reduces the bucket's kept counts and rescales each chunk
after the sum. Each
bucket's launch-to-completion interval and payload bytes go to the run's
:class:`~qsync_opt.sync.replicas.CommMeter`. With an emulated link
(:class:`~qsync_opt.runtime.link.LinkClock`) a bucket completes only once the link has
carried its payload's real bytes (fp16: half of fp32's), on the link's thread, so backward
goes on meanwhile; the interval includes it.

(This module has no ``from __future__ import annotations``: DDP checks the hook's ``bucket``
annotation against ``dist.GradBucket`` itself, not a string.)
"""

import time
from typing import Any

import torch
import torch.distributed as dist

from qsync_opt.runtime.link import LinkClock
from qsync_opt.strategy.droppolicy import chunk_index, rescale

__all__ = ["HookState", "chain_hook", "encode"]


def encode(buf: torch.Tensor, world: int, comm: str) -> torch.Tensor:
    """The payload the all-reduce sums: the bucket divided by the world (in place for
    ``allreduce`` and ``dlcp``), or cast to fp16 first and divided there (``fp16``)."""
    if comm == "fp16":
        return buf.to(torch.float16).div_(world)
    return buf.div_(world)


class HookState:
    """What the hook needs: the world size, the transport and the meter; for ``dlcp`` the
    run's :class:`~qsync_opt.strategy.droppolicy.DropRecorder` (``drops``), the model's
    parameters in their order (``params``), this rank and the step being run; ``link``: the
    emulated link (None: none)."""

    def __init__(self, world: int, comm: str, meter: Any, drops: Any = None,
                 params: Any = None, rank: int = 0, link: LinkClock | None = None) -> None:
        self.world, self.comm, self.meter = world, comm, meter
        self.drops, self.params, self.rank, self.step = drops, params, rank, 0
        self.link = link
        self.index: dict[int, int] | None = None  # id(parameter) -> its index in the model


def _in_model_order(state: HookState, bucket: dist.GradBucket
                    ) -> tuple[list[int], list[torch.Tensor]]:
    """The bucket's parameters' indices in the model's order and their gradient views."""
    if state.index is None:
        state.index = {id(p): i for i, p in enumerate(state.params)}
    pairs = sorted((state.index[id(p)], g) for p, g in
                   zip(bucket.parameters(), bucket.gradients(), strict=True))
    return [i for i, _ in pairs], [g for _, g in pairs]


def chain_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    t0 = time.perf_counter()
    buf = bucket.buffer()
    drops = state.drops
    grads: list[torch.Tensor] = []
    indices: list[int] = []
    counts = sel = None
    if drops is not None:  # stage 1: zero-fill the dropped chunks of this bucket's tensors
        indices, grads = _in_model_order(state, bucket)
        counts = drops.stage(grads, state.step, state.rank, indices)
        if counts is not None:  # unbiased: the bucket's kept counts, the same order everywhere
            sel = chunk_index(drops.table, indices)
            mine = counts[sel]
            dist.all_reduce(mine)
            if state.link is not None:
                state.link.block("allreduce", mine.numel() * mine.element_size())
            counts[sel] = mine
    # stage 2: the payload (unbiased: summed as is, rescaled per chunk afterwards)
    payload = buf if counts is not None else encode(buf, state.world, state.comm)
    nbytes = payload.numel() * payload.element_size() + (
        0 if sel is None else sel.numel() * 4)
    meter = state.meter

    def done(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out = fut.value()[0]
        if out.dtype != buf.dtype:
            buf.copy_(out)  # decompress into the bucket (torch's hook does the same)
            out = buf
        if counts is not None:
            rescale(grads, drops.table, counts, indices)
        meter.interval(t0, time.perf_counter(), nbytes)
        return out

    fut = dist.all_reduce(payload, async_op=True).get_future()
    if state.link is not None:  # the payload's real bytes over the link, off this thread
        fut = state.link.after(fut, "allreduce", payload.numel() * payload.element_size())
    return fut.then(done)
