"""A run's set-up: the config checked against its plan and workload, the model and optimizer.

:func:`prepare` validates a :class:`~qsync_opt.runtime.config.TrainConfig` (its plan file,
its workload or the user's model file the plan was made from, the batches, the slowdowns) and
returns the :class:`Setup` every rank shares: each rank's batch and offset, the global batch,
the initial loss scale (``config.loss_scale``, or 2**16 when any rank's plan has fp16, else
1) and the run's fingerprint. :func:`build_model` builds a rank's replica under its group's
plan, seeded identically on every rank; :func:`make_optimizer` its optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.costs.devices import get_device
from qsync_opt.documents.io import load
from qsync_opt.documents.schemas import Plan
from qsync_opt.graph import is_user_model, load_user_workload
from qsync_opt.models import UnknownWorkloadError, get_workload
from qsync_opt.runtime.apply import apply_plan
from qsync_opt.runtime.config import TrainConfig, check_batches, run_fingerprint

__all__ = ["Setup", "build_model", "card_mismatch", "make_optimizer", "prepare"]


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
    """SGD with momentum (``weight_decay`` as its L2 term), Adam (L2) or AdamW (decoupled
    decay); the learning rate is the schedule's, set before every step by the trainer."""
    wd = config.weight_decay
    if config.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=config.lr, weight_decay=wd)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=wd)
    return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                           weight_decay=wd)
