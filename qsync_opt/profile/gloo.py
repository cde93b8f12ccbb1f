"""The local gloo harness: functions run in spawned processes joined in one gloo
group, and the all-reduce model of such a group."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.machine import pin_malloc
from qsync_opt.documents.schemas import CommModel
from qsync_opt.profile.settings import DEFAULT_REPEATS, DEFAULT_WARMUP
from qsync_opt.profile.timing import measure_allreduce


def _gloo_rank(rank: int, world: int, init: str, q: Any, fn: Callable[..., Any],
               args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    pin_malloc()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        out = fn(rank, *args)
        if rank == 0:
            q.put(out)
    finally:
        dist.destroy_process_group()


def spawn_local(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 900) -> Any:
    """Run ``fn(rank, *args)`` in ``world`` spawned processes joined in one gloo group (one
    thread each, malloc pinned); return rank 0's result (picklable; ``fn`` importable)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/store"
        procs = [ctx.Process(target=_gloo_rank, args=(r, world, init, q, fn, args))
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            return q.get(timeout=timeout_s)
        finally:
            for p in procs:
                p.join(timeout=60)


def _comm_json(rank: int, repeats: int, warmup: int) -> str:
    comm = measure_allreduce(torch.device("cpu"), repeats, warmup)
    return comm.model_dump_json() if comm is not None else ""


def measure_comm_local(world: int = 2, repeats: int = DEFAULT_REPEATS,
                       warmup: int = DEFAULT_WARMUP) -> CommModel:
    """All-reduce alpha-beta of ``world`` gloo processes on this machine (spawned here).

    What ``qsync-opt train --nproc N`` runs on: use it to predict a local multi-process run
    when the profile was taken in one process (whose comm model is the estimator's).
    """
    if world < 2:
        raise QsyncInputError(f"world: expected at least 2 processes, got {world}")
    return CommModel.model_validate_json(
        spawn_local(_comm_json, world, repeats, warmup, timeout_s=300))
