"""The one DDP communication hook: the gradient-transport chain of ``--comm``, timed.

DDP has a single comm-hook slot, so every transport is a stage of one chain, registered once
(:meth:`~qsync_opt.runtime.sync.DDPSync.wrap`): ``allreduce`` divides each FP32 bucket by the
world and all-reduces it (torch's ``allreduce_hook``); ``fp16`` casts it to fp16 and divides
there (torch's ``fp16_compress_hook``), all-reduces, and casts back into the bucket. Each
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
    ``allreduce``), or cast to fp16 first and divided there (``fp16``)."""
    if comm == "fp16":
        return buf.to(torch.float16).div_(world)
    return buf.div_(world)


class HookState:
    """What the hook needs: the world size, the transport and the meter."""

    def __init__(self, world: int, comm: str, meter: Any) -> None:
        self.world, self.comm, self.meter = world, comm, meter


def chain_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    t0 = time.perf_counter()
    buf = bucket.buffer()
    payload = encode(buf, state.world, state.comm)
    nbytes = payload.numel() * payload.element_size()
    meter = state.meter

    def done(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out = fut.value()[0]
        if out.dtype != buf.dtype:
            buf.copy_(out)  # decompress into the bucket (torch's hook does the same)
            out = buf
        meter.interval(t0, time.perf_counter(), nbytes)
        return out

    fut = dist.all_reduce(payload, async_op=True).get_future()
    return fut.then(done)
