"""The step loop shared by the multi-process run (one local replica) and the emulation.

One step: draw the global batch (:mod:`qsync_opt.runtime.data`), every local replica runs forward and a
weighted backward of its slice, the gradient-sync mode agrees on one gradient
(:mod:`qsync_opt.sync.replicas`), the ranks agree whether every loss and gradient is finite, and then either
every replica steps (gradients unscaled first: :mod:`qsync_opt.runtime.scaler`) or every replica skips the
step and restores its buffers; the buffers are synchronised and a metrics row written per
replica (:mod:`qsync_opt.runtime.metrics`). Checkpoints are saved and resumed here (:mod:`qsync_opt.runtime.checkpoint`);
faults come from the :class:`~qsync_opt.runtime.faults.FaultPlan` the trainer is given.

Gradient weighting
    Rank r's loss is the mean over its b_r samples; it is multiplied by ``b_r * world / B``
    before backward, so the all-reduce *average* is the true global-batch mean gradient.

BatchNorm policy
    Forward uses per-rank batch statistics (each rank normalises its own micro-batch); the
    running statistics are rank 0's: after every step they are broadcast from rank 0 (the
    effect of DDP's ``broadcast_buffers``, done after the step rather than before the next
    forward so that every rank's whole ``state_dict`` is identical after every step).

Precision
    Master weights, gradients and the all-reduce are FP32 (see :mod:`qsync_opt.ops.layers`). NaN/inf
    guard: when any rank sees a non-finite loss or gradient (a count all-reduced with the
    step's statistics) every rank skips the step and restores its buffers;
    ``config.max_bad_steps`` consecutive skips stop the run (:class:`TrainingError`).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qsync_opt.core.errors import one_line
from qsync_opt.models import TASK_CLASSIFICATION
from qsync_opt.runtime.checkpoint import (
    CheckpointError,
    commit_set,
    load_checkpoint,
    qseeds,
    rank_document,
    replica_entry,
    set_qseeds,
    write_rank_file,
)
from qsync_opt.runtime.config import CheckpointSet, check_resume, remove_stale, set_path
from qsync_opt.runtime.data import GlobalBatches, batch_size_of, rank_slice, to_device
from qsync_opt.runtime.faults import NO_FAULTS, FaultPlan
from qsync_opt.runtime.link import link_fields
from qsync_opt.runtime.memory import measure_step_memory
from qsync_opt.runtime.metrics import (
    MetricsWriter,
    StepProgress,
    run_warnings,
    state_hash,
    step_row,
    sync_totals,
)
from qsync_opt.runtime.prepare import Setup, make_optimizer
from qsync_opt.runtime.scaler import LossScaler, probe_scale
from qsync_opt.sync.replicas import GradientSync

__all__ = ["Trainer", "TrainingError", "weighted_backward"]


class TrainingError(RuntimeError):
    """The run cannot continue (too many non-finite steps, ranks out of step, ...)."""


def weighted_backward(model: nn.Module, workload: Any, inputs: Any, targets: Tensor | None,
                      weight: float, scale: float = 1.0, poison: bool = False
                      ) -> tuple[float, float]:
    """Forward one micro-batch, backward ``loss * weight * scale``; return (loss, #correct).
    The workload's ``forward`` and ``loss_of`` run it (a user's file: keyword inputs, its
    own loss or the default)."""
    out = workload.forward(model, inputs)
    loss = workload.loss_of(out, inputs, targets)
    if poison:
        loss = loss * float("nan")
    (loss * (weight * scale)).backward()
    correct = 0.0
    if workload.task == TASK_CLASSIFICATION:
        correct = float((out.detach().argmax(-1) == targets).sum())
    return float(loss.detach()), correct


class Trainer:
    """The training loop of ``ranks`` (their replicas ``models``, one per rank, in this
    process) under the gradient-sync mode ``sync``, with ``faults`` injected;
    ``log_state_hash`` adds each replica's ``state_sha256`` to its metrics rows."""

    def __init__(self, setup: Setup, ranks: list[int], models: list[nn.Module],
                 sync: GradientSync, device: torch.device, faults: FaultPlan = NO_FAULTS,
                 log_state_hash: bool = False) -> None:
        self.s, self.cfg = setup, setup.config
        self.ranks, self.models, self.sync = ranks, models, sync
        self.faults, self.log_state_hash = faults, log_state_hash
        self.forward_models = [sync.wrap(m) for m in models]
        self.opts = [make_optimizer(self.cfg, m) for m in models]
        self.schedule = self.cfg.schedule()
        sync.attach([setup.batches[r] / setup.global_batch for r in ranks], self.opts)
        self.device = device
        self.resumed: CheckpointSet | None = None
        self.data = GlobalBatches(setup.workload, self.cfg.seed, setup.global_batch)
        # one loss scale per replica: equal under ddp (every step agreed), each its own
        # under Local SGD (a replica skips a non-finite step alone)
        self.scalers = [LossScaler(setup.init_scale) for _ in ranks]
        self.bad_run, self.skipped, self.step = 0, 0, 0
        # every replica has its own torch RNG stream (dropout), as its process would
        self.rngs: list[Tensor] = []
        for r in ranks:
            torch.manual_seed(self.cfg.seed * 1000 + r + 1)
            self.rngs.append(torch.get_rng_state())
        self.last_loss = float("nan")
        self.first_loss: float | None = None  # the first step this process ran (global mean)
        self.scale_probe: dict[str, Any] | None = None  # filled by start_scale()
        self.out = Path(self.cfg.out_dir)
        self.memory: dict[str, Any] | None = None  # filled by measure_memory()
        #: the run's rounds, bytes and ms in collectives (metrics.sync_totals), after train()
        self.communication: dict[str, Any] | None = None
        #: steps between checkpoints (an elastic run chooses it once it has measured a step)
        self.checkpoint_every = self.cfg.checkpoint_every
        #: the step of the last set this process saved or resumed (None: none yet)
        self.saved_step: int | None = None
        #: set by :meth:`at_boundary` when the run leaves its world there (elastic)
        self.left = False
        #: each group's compute stretch now (the device's, then injected slowdowns'): what
        #: emulated replicas report (a replica alone in its process sleeps it instead)
        self.stretch: dict[str, float] = dict(self.cfg.slowdown)
        #: the last step's compute ms per local rank, as its metrics row says
        self.last_compute_ms: dict[int, float] = {}
        #: re-planning and injected slowdowns at the step boundaries (job/online.py)
        self.online: Any = None

    @property
    def scaler(self) -> LossScaler:
        """The first local replica's loss scaler."""
        return self.scalers[0]

    @property
    def scale(self) -> float:
        """The loss scale now (the first local replica's)."""
        return self.scaler.scale

    # -- checkpoints
    def begin(self) -> int:
        """Where this run starts: the newest complete checkpoint set when resuming (checked
        against the config, the same on every rank), else 0; rank 0 then removes every other
        set and the stale ``.tmp`` files."""
        cfg = self.cfg
        cs = check_resume(cfg, self.s.plan)
        lo, hi = self.sync.min_max(float(cs.step) if cs is not None else -1.0)
        if lo != hi:
            raise TrainingError(
                f"the ranks found different newest checkpoint sets in {self.out} (steps "
                f"{int(lo)}..{int(hi)}; -1: none): is out_dir the same folder on every node?")
        if 0 in self.ranks:
            remove_stale(self.out, cs, self.cfg.world_size)
        self.sync.barrier()  # nobody writes before the cleaning is done
        if cs is not None:
            self.restore(cs)
            self.saved_step = cs.step
        self.resumed = cs
        return self.step

    def save(self) -> None:
        """Every local rank's file of this step's set, a barrier, rank 0's commit marker."""
        folder = set_path(self.out, self.step)
        for i, (r, rng, m, opt) in enumerate(zip(self.ranks, self.rngs, self.models, self.opts,
                                                 strict=True)):
            write_rank_file(folder, r, rank_document(
                step=self.step, scaler=self.scalers[i].state_dict(), bad_run=self.bad_run,
                skipped=self.skipped, last_loss=self.last_loss, model=m, optimizer=opt,
                rank=r, rng=rng, sync=self.sync.state_dict(i)))
            self.faults.in_save(r, self.step)
        self.sync.barrier()  # every rank's file is on disk
        if 0 in self.ranks:
            commit_set(self.out, folder, self.step, self.cfg.world_size, self.s.run,
                       link=self.cfg.world_size == 1 or len(self.ranks) == self.cfg.world_size)
        self.saved_step = self.step
        self.committed(folder)

    def committed(self, folder: Path) -> None:
        """After a set was committed (every rank): nothing here; an elastic run logs it."""

    def at_boundary(self) -> bool:
        """Before each step: True leaves the world here (an elastic run's membership
        change); the step's checkpoint is then saved and :meth:`train` returns without
        evaluating. Here: never."""
        return False

    def restore(self, cs: CheckpointSet) -> None:
        for i, (r, m, opt) in enumerate(zip(self.ranks, self.models, self.opts, strict=True)):
            path = cs.rank_file(r)
            ck = load_checkpoint(path, "train", follow=False)
            rep = replica_entry(ck, r)
            if int(ck["step"]) != cs.step or rep is None:
                raise TrainingError(f"{path}: not rank {r}'s checkpoint of step {cs.step}")
            try:
                m.load_state_dict(ck["model"])
                # a copy: load_state_dict keeps the given tensors
                opt.load_state_dict(copy.deepcopy(ck["optimizer"]))
            except (RuntimeError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(one_line(
                    f"checkpoint {path}: its model or optimizer state does not fit this "
                    f"run's ({str(exc).splitlines()[0][:160] if str(exc) else exc})")) from None
            set_qseeds(m, rep["qseeds"])
            self.rngs[i] = rep["rng"]
            self.sync.load_state_dict(i, rep.get("sync", {}))
            self.scalers[i].load_state_dict(ck)
            if i == 0:
                self.step = int(ck["step"])
                self.bad_run, self.skipped = int(ck["bad_run"]), int(ck["skipped"])
                self.last_loss = float(ck["last_loss"])

    # -- the loss scale's start
    def start_scale(self) -> None:
        """A fresh run with fp16 and no ``--loss-scale``: the initial scale is the largest of
        :data:`~qsync_opt.runtime.scaler.PROBE_SCALES` at which step 0's batch gives a finite loss and
        gradients on every rank (:mod:`qsync_opt.runtime.scaler`); nothing else of the run changes."""
        if not (self.scaler.dynamic and self.cfg.loss_scale is None and self.step == 0):
            return
        chosen, tried = probe_scale(self._finite_at)
        for sc in self.scalers:
            sc.scale = chosen
        self.scale_probe = {"tried": tried, "scale": chosen}

    def _finite_at(self, scale: float) -> bool:
        """One probe: forward and backward of step 0's batch at ``scale`` on every local
        replica (the plain model: no gradient sync), then everything it touched restored."""
        s = self.s
        inputs, targets = self.data.batch(0)
        inputs = to_device(inputs, self.device)
        targets = targets.to(self.device) if targets is not None else None
        bad = 0
        for i, (r, m) in enumerate(zip(self.ranks, self.models, strict=True)):
            bufs = [b.detach().clone() for b in m.buffers()]
            seeds = qseeds(m)
            disp = m.__dict__.get("_qsync_dispatch")
            disp_seed = getattr(disp, "seed", None)
            torch.set_rng_state(self.rngs[i])
            xi, yi = rank_slice((inputs, targets), s.offsets[r], s.batches[r])
            m.zero_grad(set_to_none=True)
            loss, _ = weighted_backward(m, s.workload, xi, yi,
                                        weight=self.sync.loss_weight(s.batches[r],
                                                                     s.global_batch),
                                        scale=scale)
            bad += self.scalers[i].nonfinite([m], [loss])
            m.zero_grad(set_to_none=True)
            for b_, saved in zip(m.buffers(), bufs, strict=True):
                b_.copy_(saved)
            set_qseeds(m, seeds)
            if disp is not None:
                disp.seed = disp_seed
        _, worst = self.sync.min_max(float(bad))
        return worst == 0

    # -- one step
    def train_step(self, metrics: list[MetricsWriter]) -> None:
        """One step: every local replica's forward and backward, the sync, the optimizer
        steps (or the skips the ranks agree on), a metrics row per replica."""
        cfg = self.cfg
        step = self.step
        lr = self.schedule.lr_at(step)
        for opt in self.opts:
            for group in opt.param_groups:
                group["lr"] = lr
        inputs, targets = self.data.batch(step)
        inputs = to_device(inputs, self.device)
        targets = targets.to(self.device) if targets is not None else None
        saved = [[b.detach().clone() for b in m.buffers()] for m in self.models]
        local = torch.zeros(4, dtype=torch.float64)  # nonfinite, sum loss*b, correct, sum b
        self.sync.before_backward(step, self.models)
        rows, compute_s = self._backward_replicas(step, inputs, targets, local)
        t_sync = time.perf_counter()
        self.sync.after_backward(step, self.models)
        bad = [self.scalers[i].nonfinite([m], [rows[i][2]]) for i, m in enumerate(self.models)]
        local[0] += sum(bad)
        tot = self.sync.sum_stats(local)
        if self.sync.independent_steps:  # each replica its own step (Local SGD)
            skips = [n > 0 for n in bad]
        else:  # one gradient: every replica steps, or none
            skips = [bool(tot[0] > 0)] * len(self.models)
        self._step_replicas(saved, skips)
        self.sync.after_step(step, self.models, all(skips))
        self.sync.sync_buffers(self.models)
        sync_s = time.perf_counter() - t_sync
        self.last_loss = float(tot[1]) / float(tot[3])
        if self.first_loss is None:
            self.first_loss = self.last_loss
        self._write_rows(metrics, rows, compute_s, skips, sync_s=sync_s, lr=lr)
        self.step += 1
        if self.bad_run >= cfg.max_bad_steps:
            raise TrainingError(f"{self.bad_run} consecutive steps had a non-finite loss or "
                                f"gradient (max_bad_steps={cfg.max_bad_steps}); stopping at "
                                f"step {step}")

    def _backward_replicas(self, step: int, inputs: Any, targets: Tensor | None,
                           local: Tensor
                           ) -> tuple[list[tuple[int, int, float, float]], list[float]]:
        """Every local replica's forward and backward of its slice of the step's batch;
        ``local`` accumulates the loss and the correct count. Returns a row per replica
        (rank, batch, loss, correct) and each one's compute seconds."""
        s = self.s
        rows = []
        compute_s = []
        for i, (r, fm, opt) in enumerate(zip(self.ranks, self.forward_models, self.opts,
                                             strict=True)):
            self.faults.at_step(r, step)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            b = s.batches[r]
            xi, yi = rank_slice((inputs, targets), s.offsets[r], b)
            torch.set_rng_state(self.rngs[i])
            loss, correct = weighted_backward(
                fm, s.workload, xi, yi, weight=self.sync.loss_weight(b, s.global_batch),
                scale=self.scalers[i].scale, poison=self.faults.nan_loss(r, step))
            self.rngs[i] = torch.get_rng_state()
            compute_s.append(time.perf_counter() - t0)
            rows.append((r, b, loss, correct))
            local[1] += loss * b
            local[2] += correct
            local[3] += b
        return rows, compute_s

    def _step_replicas(self, saved: list[list[Tensor]], skips: list[bool]) -> None:
        """Each replica's optimizer step, or its skip (buffers restored, gradients
        dropped); the loss scales updated and the run of bad steps counted."""
        for m, opt, bufs, sc, skip in zip(self.models, self.opts, saved, self.scalers, skips,
                                          strict=True):
            if skip:
                for b_, s_ in zip(m.buffers(), bufs, strict=True):
                    b_.copy_(s_)
                opt.zero_grad(set_to_none=True)
            else:
                sc.unscale_(m)
                opt.step()
            sc.update(skipped=skip)
        if any(skips):
            self.bad_run, self.skipped = self.bad_run + 1, self.skipped + 1
        else:
            self.bad_run = 0

    def _write_rows(self, metrics: list[MetricsWriter],
                    rows: list[tuple[int, int, float, float]], compute_s: list[float],
                    skips: list[bool], *, sync_s: float, lr: float) -> None:
        """The step's metrics row of every local replica."""
        cfg, s, step = self.cfg, self.s, self.step
        nbytes = self.sync.bytes_per_step(self.models[0])
        info = self.sync.step_info(step)
        per_rank = info.pop("per_rank", {})  # a mode's own per-rank fields (dlcp's drops)
        link = link_fields(self.sync.link)  # the emulated link's figures and time, if any
        classification = s.workload.task == "classification"
        for (r, b, loss, correct), met, m, c_s, sc, skip in zip(
                rows, metrics, self.models, compute_s, self.scalers, skips, strict=True):
            g = cfg.rank_groups[r]
            # One local replica: its slowdown hooks already slept inside c_s. Emulated
            # replicas do not sleep; their step time is reported stretched.
            f = 1.0 if len(self.models) == 1 else self.stretch.get(g, 1.0)
            self.last_compute_ms[r] = c_s * f * 1e3
            met.write(step_row(
                step=step, rank=r, group=g, loss=loss, compute_s=c_s * f, sync_s=sync_s,
                nbytes=nbytes, skipped=skip, loss_scale=sc.scale, lr=lr, **info,
                extra={**link, **(per_rank.get(r) or {}),
                       # a run that may re-plan says each step's batch (it may move)
                       **({"batch": b} if self.online is not None else {})},
                accuracy=correct / b if classification else None,
                state_sha256=state_hash(m) if self.log_state_hash else None))

    def measure_memory(self, metrics: list[MetricsWriter]) -> None:
        """One training step as any other, with its exact peak live tensor bytes measured
        on this rank (allocator events of the CPU; :mod:`qsync_opt.runtime.memory`).

        The baseline is what lives before the step: parameters, gradients, buffers and
        optimizer state (each storage once). Everything the step allocates counts: the global
        batch drawn and sliced, the saved buffers, activations, gradients, the all-reduce and
        the optimizer step. What the gradient-sync mode holds across steps outside every
        module (DDP's flat gradient buckets, which outlive every step, so the allocator
        events of one step never see them) comes from the mode
        (:meth:`~qsync_opt.sync.replicas.GradientSync.persistent_bytes`; DDP's own record,
        ``bucket_sizes``, when they are separate storage: ``gradient_as_bucket_view`` off,
        the default) and is added to the baseline.
        """
        step = self.step
        if len(self.models) != 1 or self.device.type != "cpu":
            self.memory = {"step": step, "peak_bytes": None,
                           "note": "measured only on CPU ranks with one replica per process"}
            self.train_step(metrics)
            return
        m = measure_step_memory(self.models[0], lambda: self.train_step(metrics),
                                optimizer=self.opts[0], clear_grads=False)
        buckets = self.sync.persistent_bytes(self.forward_models[0])
        self.memory = {"step": step, "peak_bytes": m.peak_bytes + (buckets or 0),
                       "baseline_bytes": m.baseline_bytes + (buckets or 0),
                       "ddp_bucket_bytes": buckets, "peak_phase": m.peak_phase,
                       "peak_op": m.peak_op}

    def evaluate(self, model: nn.Module, rng_i: int) -> tuple[float, float | None]:
        if self.cfg.eval_batches == 0:
            return float("nan"), None
        model.eval()
        tot_loss, tot_correct, n = 0.0, 0.0, 0
        torch.set_rng_state(self.rngs[rng_i])
        with torch.no_grad():
            for inputs, targets in self.data.eval_batches(self.cfg.eval_batches):
                inputs = to_device(inputs, self.device)
                targets = targets.to(self.device) if targets is not None else None
                out = self.s.workload.forward(model, inputs)
                k = batch_size_of(inputs)
                tot_loss += float(self.s.workload.loss_of(out, inputs, targets)) * k
                if self.s.workload.task == TASK_CLASSIFICATION:
                    tot_correct += float((out.argmax(-1) == targets).sum())
                n += k
        model.train()
        acc = tot_correct / n if self.s.workload.task == TASK_CLASSIFICATION else None
        return tot_loss / n, acc

    def train(self, show_progress: bool) -> dict[str, Any]:
        """The run from where :meth:`begin` starts it; ``show_progress``: this process
        reports the progress (a bar on a terminal, else a line every
        ``config.progress_every_s`` seconds)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        start = self.begin()
        if self.online is not None:
            self.online.resume(start)
        self.start_scale()
        metrics = [MetricsWriter(self.out / f"metrics.rank{r}.jsonl", start)
                   for r in self.ranks]
        bar = StepProgress(cfg.steps, cfg.progress_every_s, start=start, report=show_progress)
        try:
            while self.step < cfg.steps:
                if self.at_boundary():
                    self.left = True
                    break
                if self.online is not None:
                    self.online.before_step(self.step)
                if cfg.memory_step == self.step:
                    self.measure_memory(metrics)  # the step, with its peak measured
                else:
                    self.train_step(metrics)
                bar.update(self.step, self.last_loss)
                if self.online is not None:
                    self.online.after_step(self.step - 1)
                if (self.checkpoint_every and self.step % self.checkpoint_every == 0
                        and self.step < cfg.steps):
                    self.save()
            if (self.step > start or self.resumed is None) and self.saved_step != self.step:
                self.save()
        finally:
            for met in metrics:
                met.close()
            if self.online is not None:
                self.online.close()
        if self.left:
            return {"left_at": self.step, "wall_s": time.perf_counter() - t0,
                    "resumed_from": start}
        self.communication = sync_totals(self.out / f"metrics.rank{self.ranks[0]}.jsonl")
        sha = state_hash(self.models[0])
        evals = {}
        for i, (r, m) in enumerate(zip(self.ranks, self.models, strict=True)):
            loss, acc = self.evaluate(m, i)
            evals[r] = {"rank": r, "group": cfg.rank_groups[r], "loss": loss, "accuracy": acc}
        return {"state_sha256": sha, "evals": evals, "wall_s": time.perf_counter() - t0,
                "resumed_from": start}

    def summary(self, sha: str, evals: list[dict[str, Any]], wall_s: float, start: int
                ) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "workload": self.s.workload.name, "plan_path": cfg.plan_path,
            "rank_groups": cfg.rank_groups, "world_size": cfg.world_size,
            "batches": self.s.batches, "global_batch": self.s.global_batch,
            "emulated": cfg.emulate_dp, "steps": self.step, "resumed_from_step": start,
            "skipped_steps": self.skipped, "final_loss": self.last_loss,
            "loss_scale": self.scaler.scale, "sync": cfg.sync_mode().describe(),
            "comm": cfg.comm_mode().describe(), "overrides": list(cfg.overrides),
            "lr_schedule": self.schedule.describe(),
            "communication": self.communication,
            **({"link": cfg.link.describe()} if cfg.link is not None else {}),
            "eval_loss": evals[0]["loss"], "eval_accuracy": evals[0]["accuracy"],
            "eval_per_rank": evals, "state_sha256": sha, "wall_s": round(wall_s, 3),
            **({"memory": self.memory} if self.memory is not None else {}),
            **({"scale_probe": self.scale_probe} if self.scale_probe is not None else {}),
            "first_loss": self.first_loss,
            **({"online": {"replans": self.online.replans, "slowdown": self.online.factors}}
               if self.online is not None else {}),
            "warnings": run_warnings(self.step, self.skipped, self.first_loss,
                                     self.last_loss, evals[0]["loss"]),
        }
