"""How the replicas agree: the gradient-synchronisation seam of the trainer.

The trainer (:mod:`qsync_opt.job.steps`) calls a :class:`GradientSync` at fixed points of every step,
in this order::

    wrap(model)                          once per replica: the module used for forward
    before_backward(step, models)        before the replicas' forward and backward
    after_backward(step, models)         afterwards: by default reduce(models), after which
                                         every replica's .grad is the global-batch mean
    sum_stats(stats)                     the small per-step all-reduce (loss, accuracy, the
                                         non-finite flag)
    after_step(step, models, skipped)    after the optimizer step (or the skip)
    sync_buffers(models)                 the BatchNorm policy: rank 0's buffers everywhere

and, at a checkpoint, ``state_dict(replica)`` (saved in that replica's rank file) and, on a
resume, ``load_state_dict(replica, state)``. A mode whose state is empty (every one here)
writes nothing, so its checkpoints are today's format.

The next systems plug in as subclasses, without touching the trainer:

* Local SGD / QSR: ``wrap`` leaves the model unwrapped, ``reduce`` does nothing, and
  ``after_step`` averages the parameters every H steps (H from the mode's schedule, its
  step counter in ``state_dict``), between ``opt.step()`` and the buffer sync;
* a DDP communication-hook chain (compression, priorities): a :class:`DDPSync` subclass
  registers its hooks in ``wrap``; per-rank hook state (error feedback) goes into
  ``state_dict(replica)``.

Implementations: :class:`DDPSync` (torch DDP's bucketed all-reduce in backward, one comm
hook: :mod:`qsync_opt.sync.hooks`), :class:`EmulatedSync` (one process holding every rank's replica),
:class:`LocalSGDSync` (Local SGD and QSR, both paths) and :class:`LocalSync` (world 1);
:func:`make_sync` picks the one a config asks for.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel as DDP

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.graph import trace
from qsync_opt.netsim.cluster import limit_message
from qsync_opt.netsim.engine import NetsimLimit
from qsync_opt.netsim.traffic import NetConfig
from qsync_opt.runtime.link import LinkClock
from qsync_opt.strategy.droppolicy import ChunkTable, DropRecorder, rescale
from qsync_opt.strategy.modes import round_length
from qsync_opt.sync.hooks import HookState, chain_hook, encode
from qsync_opt.sync.netloss import dlcp_masks

__all__ = ["CommMeter", "DDPSync", "EmulatedSync", "GradientSync", "LocalSGDSync", "LocalSync",
           "ddp_bucket_bytes", "make_sync"]


class GradientSync:
    """How the replicas agree on one gradient per step (module docstring).

    ``models`` are the local replicas (one in a multi-process run, every rank's in
    emulation), in the order of the trainer's ranks; ``replica`` indexes them.
    """

    world: int = 1
    #: True: every replica steps on its own gradient and skips a non-finite step alone
    #: (Local SGD, QSR); False: one gradient for all, and a step skipped by all.
    independent_steps: bool = False
    #: dlcp's :class:`~qsync_opt.strategy.droppolicy.DropRecorder` (None: nothing is dropped)
    drops: Any = None
    #: the emulated link every collective's bytes cross (None: the real one alone)
    link: LinkClock | None = None

    # -- set-up
    def wrap(self, model: nn.Module) -> nn.Module:
        """The module the trainer runs forward with (default: ``model`` itself)."""
        return model

    def attach(self, shares: Sequence[float], optimizers: Sequence[Any]) -> None:
        """Once, before the first step: each local replica's share of the global batch
        (b_r / B) and its optimizer."""

    def loss_weight(self, batch: int, global_batch: int) -> float:
        """What a replica's mean loss is multiplied by before backward: ``b * world / B``,
        so that the average of the ranks' gradients is the global-batch mean gradient."""
        return batch * self.world / global_batch

    # -- accounting of the step just run (the metrics row's sync_round, synced, comm_ms,
    # bytes_sent)
    def step_info(self, step: int) -> dict[str, Any]:
        """``sync_round`` (the round ``step`` belongs to), ``synced`` (whether the replicas
        agreed after it), ``comm_ms`` and ``bytes_sent`` (wall time inside this rank's
        collectives and the payload bytes it handed them during the step), then reset."""
        ms, nbytes = self.meter.take() if hasattr(self, "meter") else (0.0, 0)
        info: dict[str, Any] = {"sync_round": step, "synced": self.world > 1, "comm_ms": ms,
                                "bytes_sent": nbytes}
        if self.drops is not None:  # dlcp: each rank's drop statistics, for its own row
            info["per_rank"] = self.drops.take()
        return info

    # -- one step, in order
    def before_backward(self, step: int, models: Sequence[nn.Module]) -> None:
        """Before the replicas' forward and backward of ``step``."""

    def after_backward(self, step: int, models: Sequence[nn.Module]) -> None:
        """After every local replica's weighted backward of ``step``: :meth:`reduce`."""
        self.reduce(models)

    def reduce(self, models: Sequence[nn.Module]) -> None:
        """Make every replica's ``.grad`` the global-batch mean gradient."""
        raise NotImplementedError

    def sum_stats(self, stats: Tensor) -> Tensor:
        """Sum a small float64 vector over ranks (local replicas already summed)."""
        raise NotImplementedError

    def after_step(self, step: int, models: Sequence[nn.Module], skipped: bool) -> None:
        """After the optimizer step of ``step`` (``skipped``: no replica stepped), before
        :meth:`sync_buffers`."""

    def sync_buffers(self, models: Sequence[nn.Module]) -> None:
        """Every replica's buffers become rank 0's."""
        raise NotImplementedError

    # -- checkpoints
    def state_dict(self, replica: int) -> dict[str, Any]:
        """The mode's state for local replica ``replica``'s checkpoint file (tensors and
        plain values only: it loads with ``weights_only``); empty: nothing is written."""
        return {}

    def load_state_dict(self, replica: int, state: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` gave (empty when the file has none)."""

    # -- accounting
    def bytes_per_step(self, model: nn.Module) -> int:
        """Bytes one rank sends per step (the metrics' ``bytes_allreduced``)."""
        if self.world <= 1:
            return 0
        per = 2 if getattr(self, "comm", "allreduce") == "fp16" else 4
        return sum(p.numel() * per for p in model.parameters() if p.requires_grad)

    def persistent_bytes(self, forward_model: nn.Module) -> int | None:
        """Bytes the mode holds across steps outside every module (counted in a measured
        step's baseline; None: unknown)."""
        return 0

    # -- the trainer's own agreement
    def min_max(self, value: float) -> tuple[float, float]:
        """The least and the greatest of ``value`` over the ranks (one process: itself)."""
        return value, value

    def barrier(self) -> None:
        """Return once every rank got here (one process: at once)."""


class CommMeter:
    """Wall time inside collectives and the payload bytes handed to them, per step.

    Blocking collectives are timed around the call (:meth:`timed`); DDP's bucket
    all-reduces run asynchronously, overlapping backward, so each bucket records the
    interval from its launch to its completion (:meth:`interval`) and a step's time is the
    *union* of those intervals and the blocking ones: the wall time during which at least one
    of this rank's collectives was in flight. ``bytes_sent`` is the size of the tensors
    handed to the collectives (an all-reduce's wire traffic is about twice that on a ring,
    set by the backend's algorithm)."""

    def __init__(self) -> None:
        self._spans: list[tuple[float, float]] = []
        self._bytes = 0
        self._lock = threading.Lock()

    def interval(self, t0: float, t1: float, nbytes: int = 0) -> None:
        with self._lock:
            self._spans.append((t0, t1))
            self._bytes += int(nbytes)

    @contextlib.contextmanager
    def timed(self, nbytes: int) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.interval(t0, time.perf_counter(), nbytes)

    def take(self) -> tuple[float, int]:
        """(ms in collectives, bytes) since the last call, and reset."""
        with self._lock:
            spans, nbytes = sorted(self._spans), self._bytes
            self._spans, self._bytes = [], 0
        total, end = 0.0, float("-inf")
        for a, b in spans:
            if b <= end:
                continue
            total += b - max(a, end)
            end = b
        return round(total * 1000, 3), nbytes


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _over_link(link: LinkClock | None, kind: str, nbytes: int) -> None:
    """After a blocking collective: the emulated link's time for its bytes (if any)."""
    if link is not None:
        link.block(kind, nbytes)


class LocalSync(GradientSync):
    """One process, one rank: nothing to agree on."""

    def step_info(self, step: int) -> dict[str, Any]:
        return {"sync_round": step, "synced": False, "comm_ms": 0.0, "bytes_sent": 0}

    def reduce(self, models: Sequence[nn.Module]) -> None:
        pass

    def sum_stats(self, stats: Tensor) -> Tensor:
        return stats

    def sync_buffers(self, models: Sequence[nn.Module]) -> None:
        pass


def ddp_bucket_bytes(model: nn.Module) -> int | None:
    """Bytes of DDP's flat gradient buckets when they are storage of their own (0 when the
    gradients are views into them, or without DDP; None when DDP does not say)."""
    if not isinstance(model, DDP):
        return 0
    try:
        data = model._get_ddp_logging_data()
        if int(data.get("gradient_as_bucket_view", 0)):
            return 0
        return sum(int(x) for x in re.findall(r"\d+", str(data["bucket_sizes"])))
    except (AttributeError, KeyError, RuntimeError, ValueError):
        return None


def _dist_min_max(value: float, device: torch.device | None) -> tuple[float, float]:
    lo = torch.tensor([value], dtype=torch.float64, device=device)
    hi = lo.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return float(lo), float(hi)


def _dist_barrier(device: torch.device | None) -> None:
    # an all-reduce is a barrier on every backend (NCCL's barrier guesses the device)
    t = torch.zeros(1, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)


class DDPSync(GradientSync):
    """torch DDP: the gradient average happens in backward (bucketed all-reduce).

    One comm hook is registered (DDP has a single slot), built from the transport chain of
    ``comm`` (:mod:`qsync_opt.strategy.modes`): ``allreduce`` divides each FP32 bucket by the world and
    all-reduces it (torch's ``allreduce_hook``), ``fp16`` casts it to fp16 first (torch's
    ``fp16_compress_hook``) and back after. Every bucket's launch-to-completion interval and
    payload go to :attr:`meter`; with an emulated ``link`` every collective also takes the
    link's time for its bytes (:mod:`qsync_opt.runtime.link`)."""

    def __init__(self, world: int, device: torch.device, comm: str = "allreduce",
                 dlcp: Any = None, seed: int = 0, network: Any = None,
                 link: LinkClock | None = None) -> None:
        self.world, self.device, self.comm, self.link = world, device, comm, link
        self.meter = CommMeter()
        self.dlcp, self.seed = dlcp, seed  # dlcp: the parsed --comm dlcp:... (CommMode)
        self.network = network  # dlcp from the network: (the plan's cluster, rank groups)
        self.drops: Any = None
        self.hook_state: Any = None

    def wrap(self, model: nn.Module) -> nn.Module:
        ids = [self.device.index] if self.device.type == "cuda" else None
        # buffers are synchronised after each step by sync_buffers, not before each forward
        sig = inspect.signature(DDP.__init__).parameters
        fwd = "forward_sync_buffers"
        kw: dict[str, Any] = {fwd: False} if fwd in sig else {"broadcast_buffers": False}
        params: list[nn.Parameter] = []
        if self.dlcp is not None:  # DDP's own buckets: the drop bound is per tensor
            self.drops, params = _drop_recorder(model, self.dlcp, self.seed, self.network)
        ddp = DDP(model, device_ids=ids, **kw)
        self.hook_state = HookState(self.world, self.comm, self.meter, self.drops, params,
                                    dist.get_rank(), self.link)
        ddp.register_comm_hook(self.hook_state, chain_hook)
        return ddp

    def before_backward(self, step: int, models: Sequence[nn.Module]) -> None:
        if self.hook_state is not None:
            self.hook_state.step = step

    def reduce(self, models: Sequence[nn.Module]) -> None:
        pass  # DDP's backward hooks already averaged the gradients

    def sum_stats(self, stats: Tensor) -> Tensor:
        t = stats.to(self.device)
        with self.meter.timed(_nbytes(t)):
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            _over_link(self.link, "allreduce", _nbytes(t))
        return t.cpu()

    def persistent_bytes(self, forward_model: nn.Module) -> int | None:
        return ddp_bucket_bytes(forward_model)

    def min_max(self, value: float) -> tuple[float, float]:
        return _dist_min_max(value, self.device)

    def barrier(self) -> None:
        _dist_barrier(self.device)

    def sync_buffers(self, models: Sequence[nn.Module]) -> None:
        # One broadcast per dtype (a ResNet-18 has 60 BN buffers: 60 latency-bound
        # broadcasts a step would cost more than its gradient all-reduce on gloo).
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for buf in models[0].buffers():
            by_dtype.setdefault(buf.dtype, []).append(buf)
        for bufs in by_dtype.values():
            flat = _flatten_dense_tensors([b.data for b in bufs])
            with self.meter.timed(_nbytes(flat)):
                dist.broadcast(flat, src=0)
                _over_link(self.link, "broadcast", _nbytes(flat))
            for b, v in zip(bufs, _unflatten_dense_tensors(flat, bufs), strict=True):
                b.data.copy_(v)


def _drop_recorder(model: nn.Module, mode: Any, seed: int,
                   network: Any = None) -> tuple[Any, list[nn.Parameter]]:
    """dlcp's :class:`~qsync_opt.strategy.droppolicy.DropRecorder` over ``model``'s trainable
    parameters (in the model's order, the order its chunks are numbered in); unless
    ``mode.stress``, with the drops the simulated network of ``network`` (the plan's
    cluster, the run's rank groups) loses (:func:`net_masks`)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    numels = [p.numel() for _, p in named]
    masks = None
    if not mode.stress:
        if network is None:
            raise ValueError("dlcp: the network mode needs the plan's cluster and rank groups")
        masks = net_masks(ChunkTable.build(numels, int(mode.chunk_elems)), mode, seed,
                          *network, names=[n for n, _ in named])
    return (DropRecorder(mode, [n for n, _ in named], numels, seed, masks),
            [p for _, p in named])


def net_masks(table: Any, mode: Any, seed: int, cluster: Any, rank_groups: Sequence[str],
              setup: Any = None, *, names: Sequence[str] | None = None) -> list[list[Tensor]]:
    """``--comm dlcp``'s drops from the network: the packet simulator's lost chunks per
    iteration and rank (:func:`qsync_opt.sync.netloss.dlcp_masks`), ``mode.iterations``
    iterations of ``cluster`` cut to ``rank_groups``, simulated once; the bounded-loss
    transport at ``mode.p`` behind DLCP's priority queues (``priority``) or FIFO ones,
    cells of one chunk. With the run's ``setup`` (its workload and plan) and the
    parameters' ``names``, each DDP bucket leaves at the replayed backward's time for it
    (the workload traced at the plan's batch); without, all at once. A run too large for
    the simulator's event cap is refused in one line."""
    policy = "priority+bounded" if mode.policy == "priority" else "fifo+bounded"
    cfg = NetConfig(policy=policy, p=min(mode.p, 0.999), cell_bytes=table.chunk_elems * 4)
    graph = plan = None
    if setup is not None and names is not None:
        plan = setup.plan
        graph = trace(setup.workload, plan.provenance.get("graph_batch"), warn=False)
    try:
        return dlcp_masks(table, cluster, rank_groups, scenario=mode.scenario, cfg=cfg,
                          iterations=mode.iterations, seed=seed,
                          buffer_bytes=int(mode.buffer_kib * 1024), graph=graph, names=names,
                          plan=plan)
    except NetsimLimit as exc:
        raise QsyncInputError("comm: dlcp's network: "
                              + limit_message(exc, "chunk_kib=", None)) from None


def _grad_bytes(model: nn.Module, comm: str) -> int:
    per = 2 if comm == "fp16" else 4
    return sum(p.numel() * per for p in model.parameters() if p.grad is not None)


def _buffer_bytes(model: nn.Module) -> int:
    return sum(_nbytes(b) for b in model.buffers())


class EmulatedSync(GradientSync):
    """One process holding every rank's replica: sum, average by world, copy to all.

    ``comm="fp16"`` emulates torch's fp16 compression hook: each replica's gradient cast to
    fp16 and divided by the world there, summed in fp16 in rank order, cast back. The meter
    records the in-process reduction's wall time (no network here) and the payload each
    rank would hand its collectives (the bytes of a multi-process run)."""

    def __init__(self, world: int, comm: str = "allreduce", dlcp: Any = None,
                 seed: int = 0, network: Any = None) -> None:
        self.world, self.comm = world, comm
        self.meter = CommMeter()
        self.dlcp, self.seed, self.step = dlcp, seed, 0
        self.network = network  # dlcp from the network: (the plan's cluster, rank groups)
        self.drops: Any = None

    def before_backward(self, step: int, models: Sequence[nn.Module]) -> None:
        self.step = step

    def _reduce_dlcp(self, models: Sequence[nn.Module]) -> None:
        """Each replica zero-fills its dropped chunks (the DDP hook's stage 1), then the sum
        divided by the world, or for ``unbiased`` by each chunk's kept count."""
        t0 = time.perf_counter()
        if self.drops is None:
            self.drops, _ = _drop_recorder(models[0], self.dlcp, self.seed, self.network)
        params = [[p for p in m.parameters() if p.requires_grad] for m in models]
        grads: list[list[Tensor]] = []
        for ps in params:
            gs = [p.grad for p in ps if p.grad is not None]
            if len(gs) != len(ps):
                raise RuntimeError("dlcp: every trainable parameter needs a gradient")
            grads.append(gs)
        drops, counts = self.drops, None
        for r, gs in enumerate(grads):
            k = drops.stage(gs, self.step, r)
            if k is not None:
                counts = k if counts is None else counts + k
        totals = []
        for i in range(len(params[0])):
            total = grads[0][i].clone()
            for gs in grads[1:]:
                total += gs[i]
            if counts is None:
                total /= self.world
            totals.append(total)
        if counts is not None:
            rescale(totals, drops.table, counts)
        for gs in grads:
            for g, t in zip(gs, totals, strict=True):
                g.copy_(t)
        extra = 0 if counts is None else counts.numel() * counts.element_size()
        self.meter.interval(t0, time.perf_counter(), _grad_bytes(models[0], "allreduce") + extra)

    def reduce(self, models: Sequence[nn.Module]) -> None:
        if self.dlcp is not None:
            self._reduce_dlcp(models)
            return
        t0 = time.perf_counter()
        params = [list(m.parameters()) for m in models]
        for i, p0 in enumerate(params[0]):
            if p0.grad is None:
                continue
            if self.comm == "fp16":
                total = encode(p0.grad, self.world, "fp16")
                for ps in params[1:]:
                    g = ps[i].grad
                    assert g is not None  # every replica ran the same backward
                    total += encode(g, self.world, "fp16")
                total = total.to(p0.grad.dtype)
            else:
                total = p0.grad.clone()
                for ps in params[1:]:
                    g = ps[i].grad
                    assert g is not None  # every replica ran the same backward
                    total += g
                total /= self.world
            for ps in params:
                g = ps[i].grad
                assert g is not None
                g.copy_(total)
        self.meter.interval(t0, time.perf_counter(), _grad_bytes(models[0], self.comm))

    def sum_stats(self, stats: Tensor) -> Tensor:
        self.meter.interval(0.0, 0.0, _nbytes(stats))
        return stats

    def sync_buffers(self, models: Sequence[nn.Module]) -> None:
        t0 = time.perf_counter()
        src = list(models[0].buffers())
        for m in models[1:]:
            for b, s in zip(m.buffers(), src, strict=True):
                b.copy_(s)
        self.meter.interval(t0, time.perf_counter(), _buffer_bytes(models[0]))


class LocalSGDSync(GradientSync):
    """Local SGD and QSR (:mod:`qsync_opt.strategy.modes`): every replica steps on its own gradient; after
    the last step of each round the FP32 parameters, the floating BatchNorm statistics and
    (``average_optimizer_state``) the optimizer's floating state are averaged, weighted by
    each rank's share of the global batch, in one flat all-reduce (a weighted average, so
    torch's ``average_parameters``, an equal average, and its ``PeriodicModelAverager``, a
    fixed period, do not fit; the collective is the same flat all-reduce they use). Integer
    buffers (BatchNorm's step count) are averaged and rounded back.

    ``group``: the process group (None: the emulation, every replica in this process, summed
    in rank order). The statistics all-reduce runs once per round, at its end. The round
    state (start, length, index) goes into every replica's checkpoint, so a resumed run
    syncs at the same steps.
    """

    independent_steps = True

    def __init__(self, world: int, mode: Any, schedule: Any, total_steps: int,
                 device: torch.device | None = None, emulated: bool = False,
                 average_optimizer_state: bool = False, link: LinkClock | None = None) -> None:
        self.world, self.mode, self.schedule, self.link = world, mode, schedule, link
        self.total_steps, self.device, self.emulated = int(total_steps), device, emulated
        self.average_optimizer_state = average_optimizer_state
        self.meter = CommMeter()
        self.shares: list[float] = []
        self.optimizers: list[Any] = []
        self.round_index, self.round_start, self.round_len = 0, 0, 0
        self._step = self._round_of_step = self._avg_bytes = 0
        self._synced = False

    def attach(self, shares: Sequence[float], optimizers: Sequence[Any]) -> None:
        self.shares, self.optimizers = [float(x) for x in shares], list(optimizers)

    def loss_weight(self, batch: int, global_batch: int) -> float:
        return 1.0  # each replica descends its own mean loss; the average weighs the shares

    # -- the rounds
    def _enter(self, step: int) -> None:
        if self.round_len == 0 and step == 0:  # the first round of a fresh run
            self.round_start, self.round_len = 0, round_length(self.mode, self.schedule, 0,
                                                               self.total_steps)
        elif step >= self.round_start + self.round_len:  # a new round starts here
            self.round_index += 1
            self.round_start = step
            self.round_len = round_length(self.mode, self.schedule, step, self.total_steps)
        # a resumed run under fewer steps cuts the round at its last step
        self.round_len = max(1, min(self.round_len, self.total_steps - self.round_start))

    def is_sync_step(self, step: int) -> bool:
        return step == self.round_start + self.round_len - 1

    def before_backward(self, step: int, models: Sequence[nn.Module]) -> None:
        self._enter(step)
        self._step, self._round_of_step, self._synced = step, self.round_index, False

    def reduce(self, models: Sequence[nn.Module]) -> None:
        pass  # no gradient all-reduce: each replica steps on its own gradient

    def sum_stats(self, stats: Tensor) -> Tensor:
        """The statistics all-reduce, once per round (at its last step); between syncs each
        process keeps its own replicas' figures."""
        if self.world <= 1 or not self.is_sync_step(self._step):
            return stats
        if self.emulated:  # the bytes a rank would hand the all-reduce
            self.meter.interval(0.0, 0.0, _nbytes(stats))
            return stats
        t = stats.to(self.device)
        with self.meter.timed(_nbytes(t)):
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            _over_link(self.link, "allreduce", _nbytes(t))
        return t.cpu()

    def min_max(self, value: float) -> tuple[float, float]:
        if self.emulated or self.world <= 1:
            return value, value
        return _dist_min_max(value, self.device)

    def barrier(self) -> None:
        if not self.emulated and self.world > 1:
            _dist_barrier(self.device)

    def after_step(self, step: int, models: Sequence[nn.Module], skipped: bool) -> None:
        if self.is_sync_step(step):
            self._average(models)
            self._synced = True

    def sync_buffers(self, models: Sequence[nn.Module]) -> None:
        pass  # averaged with the parameters at each sync

    def _tensors(self, i: int, model: nn.Module) -> list[Tensor]:
        ts = [p.data for p in model.parameters()]
        ts += [b.data for b in model.buffers()]
        if self.average_optimizer_state and self.optimizers:
            opt = self.optimizers[i]
            for p in model.parameters():
                st = opt.state.get(p, {})
                for k in sorted(st):
                    v = st[k]
                    if k != "step" and isinstance(v, Tensor) and v.is_floating_point():
                        ts.append(v)
        return ts

    def _average(self, models: Sequence[nn.Module]) -> None:
        t0 = time.perf_counter()
        groups = [self._tensors(i, m) for i, m in enumerate(models)]
        sizes = [len(g) for g in groups]
        if len(set(sizes)) != 1:
            raise RuntimeError("local SGD: the replicas hold different state to average "
                               f"({sizes} tensors): an optimizer state exists on some only")
        flat: Tensor | None = None
        for i, ts in enumerate(groups):
            w = self.shares[i] if self.shares else 1.0 / self.world
            part = torch.cat([t.reshape(-1).to(torch.float32) for t in ts]) * w
            flat = part if flat is None else flat.add_(part)
        assert flat is not None
        if not self.emulated and self.world > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            _over_link(self.link, "allreduce", _nbytes(flat))
        for ts in groups:
            off = 0
            for t in ts:
                n = t.numel()
                v = flat[off:off + n].view_as(t)
                t.copy_(v.round() if not t.is_floating_point() else v)
                off += n
        nbytes = _nbytes(flat) if (self.world > 1) else 0
        self._avg_bytes = nbytes
        self.meter.interval(t0, time.perf_counter(), nbytes)

    def bytes_per_step(self, model: nn.Module) -> int:
        """The averaging's payload on a sync step, 0 between syncs."""
        return self._avg_bytes if self._synced else 0

    def step_info(self, step: int) -> dict[str, Any]:
        ms, nbytes = self.meter.take()
        return {"sync_round": self._round_of_step, "synced": self._synced, "comm_ms": ms,
                "bytes_sent": nbytes}

    # -- checkpoints
    def state_dict(self, replica: int) -> dict[str, Any]:
        return {"mode": self.mode.describe(), "round_index": self.round_index,
                "round_start": self.round_start, "round_len": self.round_len}

    def load_state_dict(self, replica: int, state: dict[str, Any]) -> None:
        if state:
            self.round_index = int(state["round_index"])
            self.round_start = int(state["round_start"])
            self.round_len = int(state["round_len"])


def make_sync(config: Any, world: int, device: torch.device, emulated: bool,
              cluster: Any = None, setup: Any = None) -> GradientSync:
    """The gradient-sync mode a run's config asks for (``sync``, ``comm``), over ``world``
    ranks, in one process (``emulated``) or one per rank; ``cluster``: the plan's (the
    network ``--comm dlcp`` takes its drops from), ``setup``: the run's (its workload and
    plan time the buckets' backward there). A multi-process run under ``config.link`` gets
    the emulated link (the config refuses it in one process)."""
    mode = config.sync_mode()
    cm = config.comm_mode()
    comm = cm.kind
    dlcp = cm if comm == "dlcp" else None
    link = (LinkClock(config.link, dist.get_rank())
            if config.link is not None and not emulated and world > 1 else None)
    if mode.averages_parameters:
        if world <= 1:
            return LocalSync()
        return LocalSGDSync(world, mode, config.schedule(), config.steps, device=device,
                            emulated=emulated,
                            average_optimizer_state=config.average_optimizer_state, link=link)
    network = None if cluster is None else (cluster, list(config.rank_groups), setup)
    if emulated:
        return EmulatedSync(world, comm, dlcp, config.seed, network)
    return (DDPSync(world, device, comm, dlcp, config.seed, network, link) if world > 1
            else LocalSync())
