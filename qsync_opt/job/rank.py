"""Train a plan: every rank runs its device group's precisions, all ranks step in lock-step.

Entry points
    ``torchrun --nproc-per-node N -m qsync_opt.job.rank cfg.json`` runs :func:`run` on
    every rank (``cfg.json`` is a :class:`~qsync_opt.runtime.config.TrainConfig`);
    ``python -m qsync_opt.job.rank cfg.json`` with ``emulate_dp`` runs :func:`emulate`.
    A bad config or plan prints one line naming the field and exits with code 2.
    On many nodes torchrun does the distributing (``--nnodes``, ``--rdzv-endpoint``); this
    module only reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR.

The runtime in parts: this module only starts a run. The parts:

* :mod:`qsync_opt.runtime.prepare`: the config checked against its plan and workload, the model, the optimizer;
* :mod:`qsync_opt.runtime.data`: the deterministic global batches and each rank's slice (an uneven sampler);
* :mod:`qsync_opt.job.steps`: the step loop (gradient weighting, BatchNorm policy, NaN/inf guard);
* :mod:`qsync_opt.sync.replicas`: the gradient-sync seam (:class:`GradientSync`, its hooks before and after
  backward, after the optimizer step and at checkpoint save and load; :class:`DDPSync`,
  :class:`EmulatedSync`, :class:`LocalSync`);
* :mod:`qsync_opt.runtime.scaler`: the dynamic loss scale (:class:`~qsync_opt.runtime.scaler.LossScaler`);
* :mod:`qsync_opt.runtime.checkpoint`: the rank files of a checkpoint set, written atomically;
* :mod:`qsync_opt.pipeline.run`: a pipeline-parallel run (``config.pipeline``: one rank per stage);
* :mod:`qsync_opt.runtime.metrics`: the per-step rows, the progress bar, the summary;
* :mod:`qsync_opt.runtime.faults`: the faults a test injects (:class:`~qsync_opt.runtime.faults.FaultPlan`);
* :mod:`qsync_opt.runtime.watchdog`: a rank dies with its launcher.

Checkpoints
    Saved as a *set* per step (layout in :mod:`qsync_opt.runtime.config`, files in :mod:`qsync_opt.runtime.checkpoint`); a
    resume takes the newest complete set on every rank (the ranks check they agree), after
    refusing one written under other settings
    (:func:`~qsync_opt.runtime.config.check_resume`), and removes incomplete sets and stale
    ``.tmp`` files first. ``config.resume`` continues from the newest set and reproduces the
    uninterrupted run bit for bit. Emulation writes one file per emulated rank, the same
    layout.

Metrics
    ``out_dir/metrics.rank{r}.jsonl``: one JSON line per step per rank (:mod:`qsync_opt.runtime.metrics`).
    Setting ``QSYNC_LOG_STATE_HASH=1`` adds ``state_sha256`` (the whole state_dict after the
    step). ``summary.json`` (and ``summary.rank{r}.json``) hold the final result.

Slowdown emulation
    ``config.slowdown[group] = f`` stretches that group's measured compute time per op by
    sleeping ``(f - 1) * t`` (runtime/emulate.py; only in the multi-process run; emulation
    reports it in ``step_ms``), so a derived "slower card" shows as a straggler on equal CPUs.

Test hooks (environment)
    Read once, here, at the entry (:meth:`~qsync_opt.runtime.faults.FaultPlan.from_env`),
    and handed to the trainer; :func:`run` and :func:`emulate` also take a ``FaultPlan``.
    ``QSYNC_TEST_DIE_AT_STEP="RANK:STEP"`` makes that rank exit abruptly at that step;
    ``QSYNC_TEST_HANG_AT_STEP="RANK:STEP"`` makes it stall (alive, silent) there;
    ``QSYNC_TEST_NAN_AT_STEP="RANK:STEP[,STEP...]"`` makes its loss NaN at those steps;
    ``QSYNC_TEST_DIE_IN_SAVE="RANK:STEP"`` makes it exit abruptly in the save of the
    checkpoint of that step, after writing its own file, before the set is committed.

Dying with the launcher
    Under ``qsync-opt train`` (``QSYNC_LAUNCHER_PID`` set) or torchrun, a watchdog thread
    ends the rank within a second once the launcher or the rank's parent (torchrun) is gone,
    even when they were killed by SIGKILL (:func:`qsync_opt.runtime.watchdog.watch_parents`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from qsync_opt.core.errors import QsyncInputError, one_line
from qsync_opt.core.machine import pin_malloc
from qsync_opt.documents.io import load
from qsync_opt.job.online import OnlineControl, ReplannerFactory
from qsync_opt.job.steps import Trainer, TrainingError, weighted_backward
from qsync_opt.ops import load_cpu
from qsync_opt.pipeline.run import emulate_pipeline, run_pipeline
from qsync_opt.runtime.checkpoint import atomic_torch_save, latest_checkpoint, load_checkpoint
from qsync_opt.runtime.config import TrainConfig
from qsync_opt.runtime.data import GlobalBatches, batch_size_of, rank_slice, to_device
from qsync_opt.runtime.emulate import SlowdownHooks, add_slowdown
from qsync_opt.runtime.faults import FaultPlan
from qsync_opt.runtime.metrics import clean, state_hash, write_json
from qsync_opt.runtime.prepare import Setup, build_model, card_mismatch, make_optimizer, prepare
from qsync_opt.runtime.scaler import GROWTH_INTERVAL, MAX_SCALE, LossScaler, grads_finite
from qsync_opt.runtime.watchdog import watch_parents
from qsync_opt.sync.replicas import (
    DDPSync,
    EmulatedSync,
    GradientSync,
    LocalSync,
    ddp_bucket_bytes,
    make_sync,
)

__all__ = [
    # the entry points
    "backend_and_device", "emulate", "main", "rank_entry", "run",
    # re-exported from the parts, where callers import them from this module
    "DDPSync", "EmulatedSync", "GROWTH_INTERVAL", "GlobalBatches", "GradientSync",
    "LocalSync", "LossScaler", "MAX_SCALE", "Setup", "Trainer", "TrainingError",
    "atomic_torch_save", "batch_size_of", "build_model", "card_mismatch", "ddp_bucket_bytes",
    "grads_finite", "latest_checkpoint", "load_checkpoint", "make_optimizer", "prepare",
    "rank_slice", "state_hash", "to_device", "weighted_backward",
]

#: The environment variable that adds ``state_sha256`` to every metrics row.
LOG_STATE_HASH_ENV = "QSYNC_LOG_STATE_HASH"


def _log_state_hash() -> bool:
    return os.environ.get(LOG_STATE_HASH_ENV) == "1"


# ----------------------------------------------------------------------------- entries


def emulate(config: TrainConfig, faults: FaultPlan | None = None,
            sync: GradientSync | None = None, replanner: ReplannerFactory | None = None
            ) -> dict[str, Any]:
    """One process, one replica per rank: synchronous data parallelism, emulated.
    ``faults``: the faults to inject (None: those the environment asks for); ``sync``: the
    gradient-sync mode over the replicas (None: the config's ``sync``/``comm``, emulated:
    :class:`EmulatedSync`, the all-reduce, or :class:`LocalSGDSync`); ``replanner``: what
    builds the planner's side of ``--replan auto`` (:mod:`qsync_opt.job.online`)."""
    faults = FaultPlan.from_env() if faults is None else faults
    setup = prepare(config)
    if config.pipeline is not None:
        return emulate_pipeline(config, setup)
    device = torch.device("cpu")
    ranks = list(range(config.world_size))
    models = [build_model(setup, r, device) for r in ranks]
    sync = (make_sync(config, config.world_size, device, emulated=True,
                      cluster=setup.plan.cluster, setup=setup) if sync is None else sync)
    out = Path(config.out_dir)
    tr = Trainer(setup, ranks, models, sync, device, faults=faults,
                 log_state_hash=_log_state_hash())
    if config.online is not None:
        tr.online = OnlineControl(tr, [None] * len(ranks), replanner)
    res = tr.train(show_progress=True)
    evals = [res["evals"][r] for r in ranks]
    summary = clean(tr.summary(res["state_sha256"], evals, res["wall_s"], res["resumed_from"]))
    write_json(out / "summary.json", summary)
    return summary


def _dist_env() -> tuple[int, int, int]:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    return rank, world, local


def run(config: TrainConfig, faults: FaultPlan | None = None,
        replanner: ReplannerFactory | None = None) -> dict[str, Any]:
    """The per-rank entry (see the module docstring); returns the run's summary.
    ``faults``: the faults to inject (None: those the environment asks for); ``replanner``:
    the planner's side of ``--replan auto`` (:mod:`qsync_opt.job.online`)."""
    pin_malloc()  # step times independent of the process's allocation history
    faults = FaultPlan.from_env() if faults is None else faults
    if config.emulate_dp:
        return emulate(config, faults, replanner=replanner)
    rank, world, local = _dist_env()
    if world != config.world_size:
        raise QsyncInputError(f"rank_groups: names {config.world_size} ranks, but WORLD_SIZE "
                              f"is {world}")
    setup = prepare(config)
    # Load (and on first use, compile) the C++ kernels before any collective, so a build can
    # never hold up a rendezvous or an all-reduce past its timeout.
    load_cpu()
    backend, device = backend_and_device(config, setup, rank, local)
    initialised = False
    if world > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=timedelta(seconds=config.timeout_s))
        initialised = True
    try:
        if config.pipeline is not None:
            return run_pipeline(config, setup, rank)
        return _run_replica(config, setup, rank, world, device, faults, replanner)
    finally:
        if initialised:
            dist.destroy_process_group()


def backend_and_device(config: TrainConfig, setup: Setup, rank: int, local: int
                        ) -> tuple[str, torch.device]:
    """The process group's backend (``auto``: NCCL where CUDA is, else gloo; gloo for a
    pipeline) and this rank's device, warning when its card is not the plan's."""
    backend = config.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if config.pipeline is not None:
        backend = "gloo"  # the stages' payloads are CPU tensors sent point to point
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        warn = card_mismatch(setup, rank, torch.cuda.get_device_name(device))
        if warn:
            sys.stderr.write(f"qsync-opt: warning: {warn}\n")
    return backend, device


def _run_replica(config: TrainConfig, setup: Setup, rank: int, world: int,
                 device: torch.device, faults: FaultPlan,
                 replanner: ReplannerFactory | None = None) -> dict[str, Any]:
    """This rank's replica of a data-parallel run, trained; the summary written."""
    model = build_model(setup, rank, device)
    # A derived device (cpu/F): every op's measured forward and backward time is
    # stretched by F where it runs, so the bucketed all-reduce waits as it would for a
    # slower card (emulation: equal CPUs stand in for different cards). The hooks live
    # as long as this frame, the whole run.
    group = config.rank_groups[rank]
    slowdown = add_slowdown(model, config.slowdown.get(group, 1.0))
    if slowdown is None and config.online is not None and (config.online.replan == "auto" or any(
            i.group == group for i in config.online.inject_slowdown)):
        # an injected slowdown will stretch it; the re-plan reads its own compute there
        slowdown = SlowdownHooks(model, 1.0)
    sync = make_sync(config, world, device, emulated=False, cluster=setup.plan.cluster,
                     setup=setup)
    tr = Trainer(setup, [rank], [model], sync, device, faults=faults,
                 log_state_hash=_log_state_hash())
    if config.online is not None:
        tr.online = OnlineControl(tr, [slowdown], replanner)
    res = tr.train(show_progress=rank == 0)
    evals = _all_evals(config, setup, res["evals"][rank], rank, world, device)
    summary = clean(tr.summary(res["state_sha256"], evals, res["wall_s"],
                               res["resumed_from"]))
    summary["rank"] = rank
    out = Path(config.out_dir)
    write_json(out / f"summary.rank{rank}.json", summary)
    if rank == 0:
        write_json(out / "summary.json", summary)
    if world > 1:
        dist.barrier()
    del slowdown
    return summary


def _all_evals(config: TrainConfig, setup: Setup, ev: dict[str, Any], rank: int, world: int,
               device: torch.device) -> list[dict[str, Any]]:
    """Every rank's held-out loss and accuracy (an all-reduce of each rank's own)."""
    if world <= 1:
        return [ev]
    vec = torch.zeros(world, 2, dtype=torch.float64)
    vec[rank, 0] = ev["loss"]
    vec[rank, 1] = ev["accuracy"] if ev["accuracy"] is not None else float("nan")
    vec = vec.to(device)
    dist.all_reduce(vec, op=dist.ReduceOp.SUM)
    vec = vec.cpu()
    acc = setup.workload.task == "classification"
    return [{"rank": r, "group": config.rank_groups[r], "loss": float(vec[r, 0]),
             "accuracy": float(vec[r, 1]) if acc else None} for r in range(world)]


def main(argv: Sequence[str] | None = None, replanner: ReplannerFactory | None = None) -> int:
    """``python -m qsync_opt.job.rank CONFIG.json``; 2 and one line on bad input.
    ``replanner``: the planner's side of ``--replan auto`` (the entry that has one:
    :mod:`qsync_opt.cli.replanning`)."""
    def body(config: TrainConfig, faults: FaultPlan) -> int:
        run(config, faults, replanner)
        return 0

    return rank_entry(argv, "qsync_opt.job.rank", body)


def rank_entry(argv: Sequence[str] | None, module: str,
               body: Callable[[TrainConfig, FaultPlan], int], cut: int | None = None) -> int:
    """A rank's ``python -m MODULE CONFIG.json``: the config loaded, the test faults read
    once, ``body`` run; its code (0: done) is the exit's. Bad input: 2 and one line; any other
    failure: 1 and one line per failing rank (its message cut to ``cut`` characters), torchrun
    reporting the code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print(f"usage: python -m {module} CONFIG.json", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    watch_parents(rank)  # die with the launcher and torchrun, even when they are SIGKILLed
    try:
        faults = FaultPlan.from_env()  # the test hooks, read once
        code = body(load(args[0], TrainConfig), faults)
    except QsyncInputError as exc:
        _say(f"qsync-opt train: {one_line(str(exc))}")
        return _failed(2)
    except Exception as exc:  # the world broke or a peer died
        msg = " ".join(str(exc).split())[:cut]
        _say(f"qsync-opt train: rank {rank}: {type(exc).__name__}: {msg}")
        return _failed(1)
    return _failed(code) if code else 0


def _say(line: str) -> None:
    """``line`` on stderr in one write: the ranks share torchrun's stderr, and two ranks
    refusing at once must not interleave their lines (a pipe keeps a write of up to 4 KiB
    whole)."""
    sys.stderr.flush()
    head = line.encode("utf-8", errors="replace")[:4000].decode("utf-8", errors="ignore")
    data = (head + "\n").encode("utf-8")
    try:
        os.write(sys.stderr.fileno(), data)
    except (OSError, ValueError, AttributeError):  # no descriptor (a test's stream)
        sys.stderr.write(line + "\n")


def _failed(code: int) -> int:
    """Leave a failed distributed rank with ``code``, skipping C++ teardown.

    After a peer dies, gloo's process group can still own a joinable worker thread when the
    interpreter shuts down; its destructor then calls ``std::terminate`` and the rank dies by
    SIGABRT (exit -6) instead of the code it chose. Everything this process writes is written
    atomically before this point, so the streams are flushed and the process leaves at once.
    A single-process run returns normally.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)




if __name__ == "__main__":
    sys.exit(main())
