"""How the replicas agree: the gradient-synchronisation seam of the trainer.

The trainer (:mod:`.trainer`) calls a :class:`GradientSync` at fixed points of every step,
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

Implementations: :class:`DDPSync` (torch DDP's bucketed all-reduce in backward),
:class:`EmulatedSync` (one process holding every rank's replica) and :class:`LocalSync`
(world 1).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["DDPSync", "EmulatedSync", "GradientSync", "LocalSync", "ddp_bucket_bytes"]


class GradientSync:
    """How the replicas agree on one gradient per step (module docstring).

    ``models`` are the local replicas (one in a multi-process run, every rank's in
    emulation), in the order of the trainer's ranks; ``replica`` indexes them.
    """

    world: int = 1

    # -- set-up
    def wrap(self, model: nn.Module) -> nn.Module:
        """The module the trainer runs forward with (default: ``model`` itself)."""
        return model

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
        return sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)

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


class LocalSync(GradientSync):
    """One process, one rank: nothing to agree on."""

    def reduce(self, models: Sequence[nn.Module]) -> None:
        pass

    def sum_stats(self, stats: Tensor) -> Tensor:
        return stats

    def sync_buffers(self, models: Sequence[nn.Module]) -> None:
        pass


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


class DDPSync(GradientSync):
    """torch DDP: the FP32 gradient average happens in backward (bucketed all-reduce)."""

    def __init__(self, world: int, device: torch.device) -> None:
        self.world, self.device = world, device

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.device.index] if self.device.type == "cuda" else None
        # buffers are synchronised after each step by sync_buffers, not before each forward
        fwd = "forward_sync_buffers"
        no_fwd_sync: dict[str, Any] = ({fwd: False}
                                       if fwd in inspect.signature(DDP.__init__).parameters
                                       else {"broadcast_buffers": False})
        return DDP(model, device_ids=ids, **no_fwd_sync)

    def reduce(self, models: Sequence[nn.Module]) -> None:
        pass  # DDP's backward hooks already averaged the gradients

    def sum_stats(self, stats: Tensor) -> Tensor:
        t = stats.to(self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.cpu()

    def persistent_bytes(self, forward_model: nn.Module) -> int | None:
        return ddp_bucket_bytes(forward_model)

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
                g = ps[i].grad
                assert g is not None  # every replica ran the same backward
                total += g
            total /= self.world
            for ps in params:
                g = ps[i].grad
                assert g is not None
                g.copy_(total)

    def sum_stats(self, stats: Tensor) -> Tensor:
        return stats

    def sync_buffers(self, models: Sequence[nn.Module]) -> None:
        src = list(models[0].buffers())
        for m in models[1:]:
            for b, s in zip(m.buffers(), src, strict=True):
                b.copy_(s)
