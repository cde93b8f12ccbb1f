"""Train a plan: every rank runs its device group's precisions, all ranks step in lock-step.

Entry points
    ``torchrun --nproc-per-node N -m qsync_opt.runtime.train cfg.json`` runs :func:`run` on
    every rank (``cfg.json`` is a :class:`~qsync_opt.runtime.config.TrainConfig`);
    ``python -m qsync_opt.runtime.train cfg.json`` with ``emulate_dp`` runs :func:`emulate`.
    A bad config or plan prints one line naming the field and exits with code 2.
    On many nodes torchrun does the distributing (``--nnodes``, ``--rdzv-endpoint``); this
    module only reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR.

Data
    Each step draws one deterministic global batch (seeded by ``config.seed`` and the step) of
    B = sum of every rank's ``batch_per_device``; rank r takes its contiguous slice (offset =
    the batches of the ranks before it): an uneven sampler. digits_cnn and tiny_gpt use their
    real data; other workloads a seeded pool of synthetic samples.

Gradient weighting
    Rank r's loss is the mean over its b_r samples; it is multiplied by ``b_r * world / B``
    before backward, so the all-reduce *average* is the true global-batch mean gradient.

BatchNorm policy
    Forward uses per-rank batch statistics (each rank normalises its own micro-batch); the
    running statistics are rank 0's: after every step they are broadcast from rank 0 (the
    effect of DDP's ``broadcast_buffers``, done after the step rather than before the next
    forward so that every rank's whole ``state_dict`` is identical after every step).

Precision
    Master weights, gradients and the all-reduce are FP32 (see :mod:`.layers`). fp16 gets a
    dynamic loss scale (initial ``config.loss_scale``, or 2**16 when any rank's plan has fp16,
    else 1; halved on a skipped step, doubled after ``GROWTH_INTERVAL`` good steps); gradients
    are unscaled before the optimizer step. NaN/inf guard: when any rank sees a non-finite
    loss or gradient (a flag all-reduced with MAX semantics) every rank skips the step and
    restores its buffers; ``config.max_bad_steps`` consecutive skips stop the run.

Checkpoints
    Saved as a *set* per step (layout in :mod:`.config`): every rank writes
    ``out_dir/ckpt/step-N/rank{r}.pt`` atomically (temporary file in the same folder, fsync,
    ``os.replace``); after a barrier rank 0 writes the commit marker ``commit.json`` (also
    atomically, holding the run's fingerprint) and removes every older set. A kill at any
    moment leaves the last committed set whole; a resume takes the newest complete set on
    every rank (the ranks check they agree), after refusing one written under other settings
    (:func:`~qsync_opt.runtime.config.check_resume`), and removes incomplete sets and stale
    ``.tmp`` files first. A rank's file holds only tensors and plain values (model and
    optimizer ``state_dict``, step, loss scale, the torch RNG state, the qsync layers' seed
    counters ``qseed``) so it loads with ``weights_only=True``. ``config.resume`` continues
    from the newest set and reproduces the uninterrupted run bit for bit. Emulation writes
    one file per emulated rank, the same layout; a single-process run (world 1 or emulation)
    also keeps ``out_dir/checkpoint.pt``, a link to the newest set's ``rank0.pt``.

Metrics
    ``out_dir/metrics.rank{r}.jsonl``: one JSON line per step per rank (step, rank, group,
    loss, accuracy for classification, step_ms, bytes all-reduced, skipped). Setting
    ``QSYNC_LOG_STATE_HASH=1`` adds ``state_sha256`` (the whole state_dict after the step).
    ``summary.json`` (and ``summary.rank{r}.json``) hold the final result.

Communication seam
    Gradient synchronisation sits behind :class:`GradientSync`: ``wrap`` (the module used
    for forward), ``reduce`` (after backward: every local replica's gradient becomes the
    global weighted mean), ``sum_stats`` (the small per-step all-reduce of loss, accuracy and
    the non-finite flag), ``sync_buffers`` (the BatchNorm policy) and ``bytes_per_step``.
    :class:`DDPSync` (torch DDP), :class:`EmulatedSync` (one process, one replica per rank)
    and :class:`LocalSync` (world 1) implement it; Local SGD, compressed or priority-ordered
    transfers plug in as further subclasses.

Slowdown emulation
    ``config.slowdown[group] = f`` stretches that group's measured compute time per op by
    sleeping ``(f - 1) * t`` (runtime/emulate.py; only in the multi-process run; emulation reports it in
    ``step_ms``), so a derived "slower card" shows as a straggler on equal CPUs.

Test hooks (environment)
    ``QSYNC_TEST_DIE_AT_STEP="RANK:STEP"`` makes that rank exit abruptly at that step;
    ``QSYNC_TEST_HANG_AT_STEP="RANK:STEP"`` makes it stall (alive, silent) there;
    ``QSYNC_TEST_NAN_AT_STEP="RANK:STEP[,STEP...]"`` makes its loss NaN at those steps;
    ``QSYNC_TEST_DIE_IN_SAVE="RANK:STEP"`` makes it exit abruptly in the save of the
    checkpoint of that step, after writing its own file, before the set is committed.

Dying with the launcher
    Under ``qsync-opt train`` (``QSYNC_LAUNCHER_PID`` set) or torchrun, a watchdog thread
    ends the rank within a second once the launcher or the rank's parent (torchrun) is gone,
    even when they were killed by SIGKILL (:func:`qsync_opt.runtime.launch.watch_parents`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..errors import QsyncInputError
from ..precision import Precision
from ..schemas import Plan
from .apply import apply_plan
from .config import (
    COMMIT_NAME,
    LEGACY_NAME,
    CheckpointSet,
    TrainConfig,
    check_batches,
    check_resume,
    commit_document,
    latest_complete_set,
    rank_file,
    remove_other_sets,
    remove_stale,
    run_fingerprint,
    set_path,
)
from .layers import QMixin

__all__ = [
    "DDPSync",
    "EmulatedSync",
    "GradientSync",
    "LocalSync",
    "TrainingError",
    "emulate",
    "latest_checkpoint",
    "load_checkpoint",
    "main",
    "run",
    "state_hash",
]

GROWTH_INTERVAL = 2000
MAX_SCALE = 2.0 ** 24


class TrainingError(RuntimeError):
    """The run cannot continue (too many non-finite steps, ranks out of step, ...)."""


# ----------------------------------------------------------------------------- setup


@dataclass
class Setup:
    config: TrainConfig
    plan: Plan
    workload: Any
    batches: list[int]          # per rank
    offsets: list[int]          # per rank
    global_batch: int
    init_scale: float
    run: dict[str, Any]         # the run's fingerprint (config.run_fingerprint)


def prepare(config: TrainConfig) -> Setup:
    """Validate the config against its plan and workload; QsyncInputError names the field."""
    from ..graph import is_user_model, load_user_workload
    from ..io import load
    from ..models import UnknownWorkloadError, get_workload

    wl: Any
    if is_user_model(config.workload):
        # A user's model file: run only when it is the file the plan was made from.
        if not Path(config.plan_path).is_file():
            raise QsyncInputError(f"plan_path: {config.plan_path}: file not found")
        plan = load(config.plan_path, Plan)
        sha = config.workload_sha256 or plan.workload_sha256
        if not is_user_model(plan.workload) or sha is None or sha != plan.workload_sha256:
            raise QsyncInputError(
                f"workload: {config.workload} is a model file, but the plan was made for "
                f"{plan.workload} (workload_sha256 {plan.workload_sha256})")
        wl = load_user_workload(config.workload, sha256=sha)
    else:
        try:
            wl = get_workload(config.workload)
        except UnknownWorkloadError as exc:
            raise QsyncInputError(f"workload: {exc}") from None
        if not Path(config.plan_path).is_file():
            raise QsyncInputError(f"plan_path: {config.plan_path}: file not found")
        plan = load(config.plan_path, Plan)
        if plan.workload.replace("-", "_").lower() != wl.name:
            raise QsyncInputError(f"plan_path: the plan was made for {plan.workload}, the "
                                  f"config trains {wl.name}")
    batches = check_batches(plan, config.rank_groups)  # groups known, batches bounded
    for g in config.slowdown:
        if g not in plan.groups:
            raise QsyncInputError(f"slowdown: the plan has no group {g!r}")
    offsets = [sum(batches[:r]) for r in range(len(batches))]
    fp16 = any(Precision(p) == Precision.fp16
               for g in set(config.rank_groups) for p in plan.groups[g].precisions.values())
    init = config.loss_scale if config.loss_scale is not None else (2.0 ** 16 if fp16 else 1.0)
    return Setup(config, plan, wl, batches, offsets, sum(batches), float(init),
                 run_fingerprint(config, plan))


def card_mismatch(setup: Setup, rank: int, card_name: str) -> str | None:
    """A warning when the GPU a rank found is not the card its plan group was made for
    (compared by the catalog's display name, e.g. 'NVIDIA T4 16 GB' against 'Tesla T4')."""
    from ..devices import get_device

    group = setup.config.rank_groups[rank]
    spec = next((g for g in setup.plan.cluster.groups if g.name == group), None)
    if spec is None or spec.device.startswith("cpu"):
        return None
    expected = get_device(spec.device)
    words = [w for w in expected.display_name.lower().replace("nvidia", "").split()
             if w.isalnum() and not w.endswith("gb")]
    found = card_name.lower()
    if words and all(w in found for w in words[:1]):
        return None
    return (f"rank {rank} runs group {group}'s plan (made for {expected.display_name}) on a "
            f"{card_name}: its times and memory were planned for another card")


def build_model(setup: Setup, rank: int, device: torch.device) -> nn.Module:
    """The workload's model, seeded identically on every rank, with rank's group's plan."""
    cfg = setup.config
    torch.manual_seed(cfg.seed)
    model = setup.workload.build().float()
    apply_plan(model, setup.plan, cfg.rank_groups[rank], seed=cfg.seed * 1000 + rank)
    return model.to(device).train()


def make_optimizer(config: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    if config.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=config.lr)
    return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)


# ----------------------------------------------------------------------------- data


class GlobalBatches:
    """Deterministic global batches (seeded by seed and step) and held-out batches.

    A batch is ``(inputs, targets)``: ``inputs`` a tuple of positional tensors or (a user's
    model with keyword inputs) a dict; ``targets`` a Tensor, or None for a user's model,
    whose batch carries its own (:mod:`qsync_opt.user_model`). A user's file with ``data()``
    gives the batches: step ``k`` is the ``k``-th batch of ``data(B, seed)`` (then of
    ``data(B, seed + 1)`` ... when it ends), evaluation the first of ``data(B, seed +
    EVAL_SEED_OFFSET)``.
    """

    def __init__(self, workload: Any, seed: int, global_batch: int) -> None:
        self.wl, self.seed, self.B = workload, seed, global_batch
        self.kind = "synthetic"
        self._stream: tuple[int, Iterator[Any]] | None = None
        if getattr(workload, "user_data", None) is not None:
            self.kind = "user"
        elif workload.name == "digits_cnn":
            from ..models.digits_cnn import load_digits_tensors, train_test_split

            x, y = load_digits_tensors()
            xtr, ytr, xte, yte = train_test_split(x, y, seed=0)
            self.train: Any = ((xtr,), ytr, int(ytr.shape[0]))
            self.test: Any = ((xte,), yte, int(yte.shape[0]))
            self.kind = "digits"
        elif workload.name == "tiny_gpt":
            from ..models.tiny_gpt import encode, stdlib_corpus, train_val_split

            self.train, self.test = train_val_split(encode(stdlib_corpus(max_chars=400_000)))
            self.seq = workload.seq_len or 128
            self.kind = "text"
        else:
            n = max(4 * global_batch, 64)
            self.train = (_as_inputs(workload.make_inputs(n, torch.device("cpu"))),
                          workload.make_targets(n, torch.device("cpu")), n)
            self.test = self.train

    def _gen(self, salt: int, step: int) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed * 1_000_003 + salt * 7_919 + step)
                                             & 0x7FFFFFFFFFFF)

    def _draw(self, pool: Any, gen: torch.Generator, b: int) -> tuple[tuple[Tensor, ...], Tensor]:
        if self.kind == "text":
            from ..models.tiny_gpt import sample_batch

            xb, yb = sample_batch(pool, b, self.seq, gen)
            return (xb,), yb
        inputs, targets, n = pool
        idx = (torch.randperm(n, generator=gen)[:b] if b <= n
               else torch.randint(0, n, (b,), generator=gen))
        return _take(inputs, idx), (targets[idx] if targets is not None else None)

    def batch(self, step: int) -> tuple[Any, Tensor | None]:
        if self.kind == "user":
            if self._stream is None or self._stream[0] > step:
                self._stream = (0, self.wl.batches(self.B, None, self.seed))
            pos, it = self._stream
            for _ in range(step - pos):  # a resume: the batches before it are skipped
                next(it)
            self._stream = (step + 1, it)
            return _as_inputs(next(it)), None
        return self._draw(self.train, self._gen(1, step), self.B)

    def eval_batches(self, n: int) -> Iterator[tuple[Any, Tensor | None]]:
        if self.kind == "user":
            from ..user_model import EVAL_SEED_OFFSET

            for b in self.wl.batches(self.B, n, self.seed + EVAL_SEED_OFFSET):
                yield _as_inputs(b), None
            return
        for i in range(n):
            yield self._draw(self.test, self._gen(2, i), self.B)


def _as_inputs(batch: Any) -> Any:
    """A user's batch as model inputs: a dict stays a dict, a Tensor is one positional
    input, a list a tuple."""
    if isinstance(batch, Tensor):
        return (batch,)
    return batch if isinstance(batch, dict) else tuple(batch)


def _take(inputs: Any, idx: Tensor) -> Any:
    """Samples ``idx`` of every batched tensor (dicts and tuples kept)."""
    from ..user_model import map_tensors

    return map_tensors(lambda t: t[idx] if t.dim() > 0 else t, inputs)


def batch_size_of(inputs: Any) -> int:
    """Samples in a batch's inputs (dim 0 of its first batched tensor)."""
    from ..user_model import named_inputs

    for _, t in named_inputs(inputs):
        if isinstance(t, Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return 1


def to_device(batch: Any, device: torch.device) -> Any:
    from ..user_model import map_tensors

    return map_tensors(lambda t: t.to(device), batch)


def rank_slice(batch: tuple[Any, Tensor | None], offset: int, b: int
               ) -> tuple[Any, Tensor | None]:
    """Rank's contiguous samples ``offset .. offset+b`` of a global batch."""
    from ..user_model import slice_batch

    inputs, targets = batch
    return (slice_batch(inputs, offset, b),
            targets[offset:offset + b] if targets is not None else None)


# ----------------------------------------------------------------------------- the seam


class GradientSync:
    """How the replicas agree on one gradient per step (see the module docstring).

    ``reduce`` receives the local replicas (one in a multi-process run) after their weighted
    backward; afterwards every replica's ``.grad`` is the global-batch mean gradient.
    """

    world: int = 1

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def reduce(self, models: Sequence[nn.Module]) -> None:
        raise NotImplementedError

    def sum_stats(self, stats: Tensor) -> Tensor:
        """Sum a small float64 vector over ranks (local replicas already summed)."""
        raise NotImplementedError

    def sync_buffers(self, models: Sequence[nn.Module]) -> None:
        raise NotImplementedError

    def bytes_per_step(self, model: nn.Module) -> int:
        if self.world <= 1:
            return 0
        return sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)

    def min_max(self, value: float) -> tuple[float, float]:
        """The least and the greatest of ``value`` over the ranks (one process: itself)."""
        return value, value

    def barrier(self) -> None:
        """Return once every rank got here (one process: at once)."""


class LocalSync(GradientSync):
    """One process, one rank: nothing to agree on."""

    def reduce(self, models: Sequence[nn.Module]) -> None:
        pass

    def sum_stats(self, stats: Tensor) -> Tensor:
        return stats

    def sync_buffers(self, models: Sequence[nn.Module]) -> None:
        pass


class DDPSync(GradientSync):
    """torch DDP: the FP32 gradient average happens in backward (bucketed all-reduce)."""

    def __init__(self, world: int, device: torch.device) -> None:
        self.world, self.device = world, device

    def wrap(self, model: nn.Module) -> nn.Module:
        import inspect

        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.device.index] if self.device.type == "cuda" else None
        # buffers are synchronised after each step by sync_buffers, not before each forward
        no_fwd_sync = ({"forward_sync_buffers": False}
                       if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                       else {"broadcast_buffers": False})
        return DDP(model, device_ids=ids, **no_fwd_sync)

    def reduce(self, models: Sequence[nn.Module]) -> None:
        pass  # DDP's backward hooks already averaged the gradients

    def sum_stats(self, stats: Tensor) -> Tensor:
        t = stats.to(self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.cpu()

    def min_max(self, value: float) -> tuple[float, float]:
        lo = torch.tensor([value], dtype=torch.float64, device=self.device)
        hi = lo.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        return float(lo), float(hi)

    def barrier(self) -> None:
        # an all-reduce is a barrier on every backend (NCCL's barrier guesses the device)
        t = torch.zeros(1, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)

    def sync_buffers(self, models: Sequence[nn.Module]) -> None:
        # One broadcast per dtype (a ResNet-18 has 60 BN buffers: 60 latency-bound
        # broadcasts a step would cost more than its gradient all-reduce on gloo).
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for buf in models[0].buffers():
            by_dtype.setdefault(buf.dtype, []).append(buf)
        for bufs in by_dtype.values():
            flat = _flatten_dense_tensors([b.data for b in bufs])
            dist.broadcast(flat, src=0)
            for b, v in zip(bufs, _unflatten_dense_tensors(flat, bufs), strict=True):
                b.data.copy_(v)


class EmulatedSync(GradientSync):
    """One process holding every rank's replica: sum, average by world, copy to all."""

    def __init__(self, world: int) -> None:
        self.world = world

    def reduce(self, models: Sequence[nn.Module]) -> None:
        params = [list(m.parameters()) for m in models]
        for i, p0 in enumerate(params[0]):
            if p0.grad is None:
                continue
            total = p0.grad.clone()
            for ps in params[1:]:
                total += ps[i].grad
            total /= self.world
            for ps in params:
                ps[i].grad.copy_(total)

    def sum_stats(self, stats: Tensor) -> Tensor:
        return stats

    def sync_buffers(self, models: Sequence[nn.Module]) -> None:
        src = list(models[0].buffers())
        for m in models[1:]:
            for b, s in zip(m.buffers(), src, strict=True):
                b.copy_(s)


# ----------------------------------------------------------------------------- helpers


def state_hash(model: nn.Module) -> str:
    """sha256 over the state_dict (names, dtypes, shapes, bytes), in key order."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        t = v.detach().cpu().contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def qseeds(model: nn.Module) -> dict[str, int]:
    return {n: int(m.qseed) for n, m in model.named_modules() if isinstance(m, QMixin)}


def set_qseeds(model: nn.Module, seeds: dict[str, int]) -> None:
    for n, m in model.named_modules():
        if isinstance(m, QMixin) and n in seeds:
            m.qseed = int(seeds[n])


def ddp_bucket_bytes(model: nn.Module) -> int | None:
    """Bytes of DDP's flat gradient buckets when they are storage of their own (0 when the
    gradients are views into them, or without DDP; None when DDP does not say)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not isinstance(model, DDP):
        return 0
    try:
        data = model._get_ddp_logging_data()
        if int(data.get("gradient_as_bucket_view", 0)):
            return 0
        return sum(int(x) for x in re.findall(r"\d+", str(data["bucket_sizes"])))
    except (AttributeError, KeyError, RuntimeError, ValueError):
        return None


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


def _hook(name: str) -> tuple[int, set[int]] | None:
    v = os.environ.get(name)
    if not v:
        return None
    r, _, steps = v.partition(":")
    return int(r), {int(s) for s in steps.split(",") if s}


def weighted_backward(model: nn.Module, workload: Any, inputs: Any, targets: Tensor | None,
                      weight: float, scale: float = 1.0, poison: bool = False
                      ) -> tuple[float, float]:
    """Forward one micro-batch, backward ``loss * weight * scale``; return (loss, #correct).
    The workload's ``forward`` and ``loss_of`` run it (a user's file: keyword inputs, its
    own loss or the default)."""
    from ..models import TASK_CLASSIFICATION

    out = workload.forward(model, inputs)
    loss = workload.loss_of(out, inputs, targets)
    if poison:
        loss = loss * float("nan")
    (loss * (weight * scale)).backward()
    correct = 0.0
    if workload.task == TASK_CLASSIFICATION:
        correct = float((out.detach().argmax(-1) == targets).sum())
    return float(loss.detach()), correct


def atomic_torch_save(obj: Any, path: Path) -> None:
    from ..io import atomic_write

    atomic_write(path, lambda fh: torch.save(obj, fh))


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint; ``weights_only=True``: no file the runtime reads can run code."""
    return torch.load(path, map_location="cpu", weights_only=True)


def latest_checkpoint(out_dir: str | os.PathLike[str], rank: int = 0) -> Path | None:
    """``rank``'s file in ``out_dir``'s newest complete checkpoint set (None: no set)."""
    cs = latest_complete_set(out_dir)
    if cs is None or rank >= cs.world_size:
        return None
    return cs.rank_file(rank)


def _link_latest(out: Path, target: Path) -> None:
    """``out/checkpoint.pt`` -> the newest set's rank0.pt (readers of the old layout)."""
    link = out / LEGACY_NAME
    if link.exists() and not link.is_symlink():
        return  # an old run's checkpoint: left alone
    tmp = out / f".{LEGACY_NAME}.{os.getpid()}.tmp"
    try:
        tmp.unlink(missing_ok=True)
        os.symlink(os.path.relpath(target, out), tmp)
        os.replace(tmp, link)
    except OSError:
        tmp.unlink(missing_ok=True)


def _write_json(path: Path, obj: Any) -> None:
    from ..io import atomic_write_text

    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


class _Metrics:
    """Append-only JSON lines; on resume, lines of steps not covered by the checkpoint go."""

    def __init__(self, path: Path, start_step: int) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            keep = []
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    if json.loads(line).get("step", 0) < start_step:
                        keep.append(line)
                except json.JSONDecodeError:
                    continue
            from ..io import atomic_write_text

            atomic_write_text(path, "".join(k + "\n" for k in keep))  # a kill keeps them
        self.fh = path.open("a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        self.fh.write(json.dumps(row) + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


def _progress(step: int, total: int, loss: float, enabled: bool) -> None:
    if not enabled:
        return
    width = 30
    done = int(width * step / total)
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total} loss {loss:.4f}")
    if step == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


# ----------------------------------------------------------------------------- the loop


class _Trainer:
    """The training loop shared by :func:`run` (one local replica) and :func:`emulate`."""

    def __init__(self, setup: Setup, ranks: list[int], models: list[nn.Module],
                 sync: GradientSync, device: torch.device) -> None:
        self.s, self.cfg = setup, setup.config
        self.ranks, self.models, self.sync = ranks, models, sync
        self.forward_models = [sync.wrap(m) for m in models]
        self.opts = [make_optimizer(self.cfg, m) for m in models]
        self.device = device
        self.resumed: CheckpointSet | None = None
        self.data = GlobalBatches(setup.workload, self.cfg.seed, setup.global_batch)
        self.scale, self.good, self.bad_run, self.skipped, self.step = setup.init_scale, 0, 0, 0, 0
        # every replica has its own torch RNG stream (dropout), as its process would
        self.rngs = []
        for r in ranks:
            torch.manual_seed(self.cfg.seed * 1000 + r + 1)
            self.rngs.append(torch.get_rng_state())
        self.last_loss = float("nan")
        self.out = Path(self.cfg.out_dir)
        self.memory: dict[str, Any] | None = None  # filled by measure_memory()

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
            remove_stale(self.out, cs)
        self.sync.barrier()  # nobody writes before the cleaning is done
        if cs is not None:
            self.restore(cs)
        self.resumed = cs
        return self.step

    def save(self) -> None:
        """Every local rank's file of this step's set, a barrier, rank 0's commit marker."""
        folder = set_path(self.out, self.step)
        die = _hook("QSYNC_TEST_DIE_IN_SAVE")
        for r, rng, m, opt in zip(self.ranks, self.rngs, self.models, self.opts, strict=True):
            atomic_torch_save({
                "format": 2, "step": self.step, "scale": self.scale, "good": self.good,
                "bad_run": self.bad_run, "skipped": self.skipped, "last_loss": self.last_loss,
                "model": m.state_dict(), "optimizer": opt.state_dict(),
                "replicas": [{"rank": r, "rng": rng, "qseeds": qseeds(m)}],
            }, rank_file(folder, r))
            if die is not None and die[0] == r and self.step in die[1]:
                os._exit(17)
        self.sync.barrier()  # every rank's file is on disk
        if 0 in self.ranks:
            from ..io import atomic_write_text

            atomic_write_text(folder / COMMIT_NAME,
                              commit_document(self.step, self.cfg.world_size, self.s.run))
            remove_other_sets(self.out, folder)
            if self.cfg.world_size == 1 or len(self.ranks) == self.cfg.world_size:
                _link_latest(self.out, rank_file(folder, 0))

    def restore(self, cs: CheckpointSet) -> None:
        for i, (r, m, opt) in enumerate(zip(self.ranks, self.models, self.opts, strict=True)):
            path = cs.rank_file(r)
            ck = load_checkpoint(path)
            reps = {int(x["rank"]): x for x in ck["replicas"]}
            if int(ck["step"]) != cs.step or r not in reps:
                raise TrainingError(f"{path}: not rank {r}'s checkpoint of step {cs.step}")
            m.load_state_dict(ck["model"])
            # a copy: load_state_dict keeps the given tensors
            opt.load_state_dict(copy.deepcopy(ck["optimizer"]))
            set_qseeds(m, reps[r]["qseeds"])
            self.rngs[i] = reps[r]["rng"]
            if i == 0:
                self.step, self.scale = int(ck["step"]), float(ck["scale"])
                self.good, self.bad_run = int(ck["good"]), int(ck["bad_run"])
                self.skipped, self.last_loss = int(ck["skipped"]), float(ck["last_loss"])

    # -- one step
    def train_step(self, metrics: list[_Metrics]) -> None:
        cfg, s = self.cfg, self.s
        step = self.step
        inputs, targets = self.data.batch(step)
        inputs = to_device(inputs, self.device)
        targets = targets.to(self.device) if targets is not None else None
        die, nan = _hook("QSYNC_TEST_DIE_AT_STEP"), _hook("QSYNC_TEST_NAN_AT_STEP")
        hang = _hook("QSYNC_TEST_HANG_AT_STEP")
        saved = [[b.detach().clone() for b in m.buffers()] for m in self.models]
        rows = []
        local = torch.zeros(4, dtype=torch.float64)  # nonfinite, sum loss*b, correct, -
        compute_s = []
        for i, (r, fm, opt) in enumerate(zip(self.ranks, self.forward_models, self.opts,
                                             strict=True)):
            if die is not None and die[0] == r and step in die[1]:
                os._exit(17)
            if hang is not None and hang[0] == r and step in hang[1]:
                time.sleep(3600)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            b = s.batches[r]
            xi, yi = rank_slice((inputs, targets), s.offsets[r], b)
            torch.set_rng_state(self.rngs[i])
            loss, correct = weighted_backward(
                fm, s.workload, xi, yi, weight=b * self.sync.world / s.global_batch,
                scale=self.scale, poison=nan is not None and nan[0] == r and step in nan[1])
            self.rngs[i] = torch.get_rng_state()
            compute_s.append(time.perf_counter() - t0)
            rows.append((r, b, loss, correct))
            local[1] += loss * b
            local[2] += correct
        t_sync = time.perf_counter()
        self.sync.reduce(self.models)
        for m in self.models:
            if not grads_finite(m):
                local[0] += 1
        for _, _, loss, _ in rows:
            if not math.isfinite(loss):
                local[0] += 1
        tot = self.sync.sum_stats(local)
        skip = bool(tot[0] > 0)
        if skip:
            for m, bufs in zip(self.models, saved, strict=True):
                for b_, s_ in zip(m.buffers(), bufs, strict=True):
                    b_.copy_(s_)
            for opt in self.opts:
                opt.zero_grad(set_to_none=True)
            if s.init_scale > 1:
                self.scale = max(self.scale / 2, 1.0)
            self.good, self.bad_run, self.skipped = 0, self.bad_run + 1, self.skipped + 1
        else:
            for m, opt in zip(self.models, self.opts, strict=True):
                if self.scale != 1.0:
                    for p in m.parameters():
                        if p.grad is not None:
                            p.grad.div_(self.scale)
                opt.step()
            self.bad_run, self.good = 0, self.good + 1
            if s.init_scale > 1 and self.good % GROWTH_INTERVAL == 0:
                self.scale = min(self.scale * 2, MAX_SCALE)
        self.sync.sync_buffers(self.models)
        sync_s = time.perf_counter() - t_sync
        self.last_loss = float(tot[1]) / s.global_batch
        log_hash = os.environ.get("QSYNC_LOG_STATE_HASH") == "1"
        nbytes = self.sync.bytes_per_step(self.models[0])
        for (r, b, loss, correct), met, m, c_s in zip(rows, metrics, self.models, compute_s,
                                                      strict=True):
            g = cfg.rank_groups[r]
            # One local replica: its slowdown hooks already slept inside c_s. Emulated
            # replicas do not sleep; their step time is reported stretched.
            f = 1.0 if len(self.models) == 1 else cfg.slowdown.get(g, 1.0)
            row: dict[str, Any] = {
                "step": step, "rank": r, "group": g, "loss": loss,
                "step_ms": round((c_s * f + sync_s) * 1000, 3),
                "compute_ms": round(c_s * f * 1000, 3), "sync_ms": round(sync_s * 1000, 3),
                "bytes_allreduced": nbytes,
                "skipped": skip, "loss_scale": self.scale}
            if s.workload.task == "classification":
                row["accuracy"] = correct / b
            if log_hash:
                row["state_sha256"] = state_hash(m)
            met.write(row)
        self.step += 1
        if self.bad_run >= cfg.max_bad_steps:
            raise TrainingError(f"{self.bad_run} consecutive steps had a non-finite loss or "
                                f"gradient (max_bad_steps={cfg.max_bad_steps}); stopping at "
                                f"step {step}")

    def measure_memory(self, metrics: list[_Metrics]) -> None:
        """One training step as any other, with its exact peak live tensor bytes measured
        on this rank (allocator events of the CPU; :mod:`qsync_opt.runtime.memory`).

        The baseline is what lives before the step: parameters, gradients, buffers and
        optimizer state (each storage once). Everything the step allocates counts: the global
        batch drawn and sliced, the saved buffers, activations, gradients, the all-reduce and
        the optimizer step. DDP's flat gradient buckets outlive every step and belong to no
        module, so the allocator events of one step never see them: their size comes from
        DDP's own record (``bucket_sizes``, bytes) and is added to the baseline when they are
        separate storage (``gradient_as_bucket_view`` off, the default).
        """
        from .memory import measure_step_memory

        step = self.step
        if len(self.models) != 1 or self.device.type != "cpu":
            self.memory = {"step": step, "peak_bytes": None,
                           "note": "measured only on CPU ranks with one replica per process"}
            self.train_step(metrics)
            return
        m = measure_step_memory(self.models[0], lambda: self.train_step(metrics),
                                optimizer=self.opts[0], clear_grads=False)
        buckets = ddp_bucket_bytes(self.forward_models[0])
        self.memory = {"step": step, "peak_bytes": m.peak_bytes + (buckets or 0),
                       "baseline_bytes": m.baseline_bytes + (buckets or 0),
                       "ddp_bucket_bytes": buckets, "peak_phase": m.peak_phase,
                       "peak_op": m.peak_op}

    def evaluate(self, model: nn.Module, rng_i: int) -> tuple[float, float | None]:
        from ..models import TASK_CLASSIFICATION

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

    def train(self, progress: bool) -> dict[str, Any]:
        cfg = self.cfg
        t0 = time.perf_counter()
        start = self.begin()
        metrics = [_Metrics(self.out / f"metrics.rank{r}.jsonl", start) for r in self.ranks]
        try:
            while self.step < cfg.steps:
                if cfg.memory_step == self.step:
                    self.measure_memory(metrics)  # the step, with its peak measured
                else:
                    self.train_step(metrics)
                _progress(self.step, cfg.steps, self.last_loss, progress)
                if (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0
                        and self.step < cfg.steps):
                    self.save()
            if self.step > start or self.resumed is None:
                self.save()
        finally:
            for met in metrics:
                met.close()
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
            "loss_scale": self.scale,
            "eval_loss": evals[0]["loss"], "eval_accuracy": evals[0]["accuracy"],
            "eval_per_rank": evals, "state_sha256": sha, "wall_s": round(wall_s, 3),
            **({"memory": self.memory} if self.memory is not None else {}),
        }


def _clean(x: Any) -> Any:
    """NaN/inf as None so the summary is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


# ----------------------------------------------------------------------------- entries


def emulate(config: TrainConfig) -> dict[str, Any]:
    """One process, one replica per rank: synchronous data parallelism, emulated."""
    setup = prepare(config)
    device = torch.device("cpu")
    ranks = list(range(config.world_size))
    models = [build_model(setup, r, device) for r in ranks]
    sync: GradientSync = EmulatedSync(config.world_size)
    out = Path(config.out_dir)
    tr = _Trainer(setup, ranks, models, sync, device)
    res = tr.train(progress=sys.stderr.isatty())
    evals = [res["evals"][r] for r in ranks]
    summary = _clean(tr.summary(res["state_sha256"], evals, res["wall_s"], res["resumed_from"]))
    _write_json(out / "summary.json", summary)
    return summary


def _dist_env() -> tuple[int, int, int]:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    return rank, world, local


def run(config: TrainConfig) -> dict[str, Any]:
    """The per-rank entry (see the module docstring); returns the run's summary."""
    from ..machine import pin_malloc

    pin_malloc()  # step times independent of the process's allocation history
    if config.emulate_dp:
        return emulate(config)
    rank, world, local = _dist_env()
    if world != config.world_size:
        raise QsyncInputError(f"rank_groups: names {config.world_size} ranks, but WORLD_SIZE "
                              f"is {world}")
    setup = prepare(config)
    # Load (and on first use, compile) the C++ kernels before any collective, so a build can
    # never hold up a rendezvous or an all-reduce past its timeout.
    from ..ops import load_cpu

    load_cpu()
    backend = config.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        warn = card_mismatch(setup, rank, torch.cuda.get_device_name(device))
        if warn:
            sys.stderr.write(f"qsync-opt: warning: {warn}\n")
    out = Path(config.out_dir)
    initialised = False
    if world > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=timedelta(seconds=config.timeout_s))
        initialised = True
    try:
        model = build_model(setup, rank, device)
        # A derived device (cpu/F): every op's measured forward and backward time is
        # stretched by F where it runs, so the bucketed all-reduce waits as it would for a
        # slower card (emulation: equal CPUs stand in for different cards).
        from .emulate import add_slowdown

        hooks = add_slowdown(model, config.slowdown.get(config.rank_groups[rank], 1.0))
        sync: GradientSync = DDPSync(world, device) if world > 1 else LocalSync()
        tr = _Trainer(setup, [rank], [model], sync, device)
        tr.slowdown = hooks  # type: ignore[attr-defined]  # kept for the run's life
        res = tr.train(progress=rank == 0 and sys.stderr.isatty())
        ev = res["evals"][rank]
        evals = [ev]
        if world > 1:
            vec = torch.zeros(world, 2, dtype=torch.float64)
            vec[rank, 0] = ev["loss"]
            vec[rank, 1] = ev["accuracy"] if ev["accuracy"] is not None else float("nan")
            vec = vec.to(device)
            dist.all_reduce(vec, op=dist.ReduceOp.SUM)
            vec = vec.cpu()
            acc = setup.workload.task == "classification"
            evals = [{"rank": r, "group": config.rank_groups[r], "loss": float(vec[r, 0]),
                      "accuracy": float(vec[r, 1]) if acc else None} for r in range(world)]
        summary = _clean(tr.summary(res["state_sha256"], evals, res["wall_s"],
                                    res["resumed_from"]))
        summary["rank"] = rank
        _write_json(out / f"summary.rank{rank}.json", summary)
        if rank == 0:
            _write_json(out / "summary.json", summary)
        if world > 1:
            dist.barrier()
        return summary
    finally:
        if initialised:
            dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m qsync_opt.runtime.train CONFIG.json``; 2 and one line on bad input."""
    from ..io import load

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m qsync_opt.runtime.train CONFIG.json", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    from .launch import watch_parents

    watch_parents(rank)  # die with the launcher and torchrun, even when they are SIGKILLed
    try:
        config = load(args[0], TrainConfig)
        run(config)
    except QsyncInputError as exc:
        print(f"qsync-opt train: {exc}", file=sys.stderr)
        return _failed(2)
    except Exception as exc:  # one line per failing rank; torchrun reports the exit code
        msg = " ".join(str(exc).split())
        print(f"qsync-opt train: rank {rank}: {type(exc).__name__}: {msg}", file=sys.stderr)
        return _failed(1)
    return 0


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
