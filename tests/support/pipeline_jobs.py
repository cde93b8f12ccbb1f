"""One rank of a pipeline training across gloo processes, and its result read back: what
tests/pipeline/test_pipeline_dist.py runs through :func:`qsync_opt.profile.gloo.spawn_local` to compare
the multi-process pipeline (:class:`~qsync_opt.pipeline.dist.DistStage`) with the
one-process one. A test harness, so not part of the package: each spawned process imports
this module as ``support.pipeline_jobs`` (tests/ is on the path pytest hands it)."""

from __future__ import annotations

import functools
import io
from typing import Any

import torch
import torch.distributed as dist
from qsync_opt.models import get_workload

from qsync_opt.pipeline.dist import DistStage
from qsync_opt.pipeline.stages import Pipeline, split_stages
from qsync_opt.runtime.data import IndexedBatches
from qsync_opt.strategy.codecs import parse_compressor

__all__ = ["job_result", "run_stage_job"]


def run_stage_job(rank: int, spec: dict[str, Any]) -> dict[str, Any] | None:
    """One rank of a pipeline training (for :func:`qsync_opt.profile.gloo.spawn_local`, which
    imports it by this module's name in each process it spawns):
    ``spec`` has model, cuts, act, grad, feedback, seed, batch, micro_batches, steps, lr.
    Returns, on rank 0, every rank's stage state, bytes and the losses."""
    wl = get_workload(spec["model"])
    data = IndexedBatches(wl, spec["seed"], spec["batch"])
    torch.manual_seed(spec["seed"])
    model = wl.build()
    pipe = Pipeline(split_stages(model, cuts=spec["cuts"]),
                    act=functools.partial(parse_compressor, spec["act"], seed=spec["seed"]),
                    grad=functools.partial(parse_compressor, spec["grad"], seed=spec["seed"]),
                    feedback=spec["feedback"], n_samples=data.n_samples)
    stage = DistStage(pipe, rank)
    params = list(stage.stage.parameters())  # none: a stage with nothing to step
    opt = torch.optim.SGD(params, lr=spec["lr"], momentum=0.9) if params else None
    losses = []
    for s in range(spec["steps"]):
        x, y, idx = data.batch(s % 3)
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        losses.append(stage.train_step(wl.loss_of, x, y, micro_batches=spec["micro_batches"],
                                       idx=idx))
        if opt is not None:
            opt.step()
    mine = {"rank": rank, "state": {k: v.clone() for k, v in stage.stage.state_dict().items()},
            "losses": losses, "header_bytes": stage.header_bytes,
            "bytes": {n: (b.act_bytes, b.grad_bytes) for n, b in pipe.boundaries.items()
                      if rank in (b.src, b.dst)}}
    out: list[Any] = [None] * dist.get_world_size() if rank == 0 else []
    dist.gather_object(mine, out if rank == 0 else None, dst=0)
    if rank != 0:
        return None
    # as bytes: a tensor handed through the result queue would be shared by a file
    # descriptor that dies with this process
    buf = io.BytesIO()
    torch.save({"ranks": out}, buf)
    return {"saved": buf.getvalue()}


def job_result(result: dict[str, Any]) -> dict[str, Any]:
    """:func:`run_stage_job`'s rank-0 result, its tensors loaded back."""
    return dict(torch.load(io.BytesIO(result["saved"]), weights_only=True))
