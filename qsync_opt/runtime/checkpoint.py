"""Checkpoint files: what a rank's file holds, written atomically, read safely.

Saved as a *set* per step (layout in :mod:`.config`): every rank writes
``out_dir/ckpt/step-N/rank{r}.pt`` atomically (temporary file in the same folder, fsync,
``os.replace``: :func:`write_rank_file`); after a barrier rank 0 writes the commit marker
``commit.json`` (also atomically, holding the run's fingerprint) and removes every older set
(:func:`commit_set`). A kill at any moment leaves the last committed set whole.

A rank's file (:func:`rank_document`, format :data:`FORMAT`) holds only tensors and plain
values, so it loads with ``weights_only=True`` (:func:`load_checkpoint`): the step, the loss
scaler's state (``scale``, ``good``), the non-finite counters (``bad_run``, ``skipped``),
``last_loss``, the model and optimizer ``state_dict``, and per replica its rank, torch RNG
state, the qsync layers' seed counters (``qseeds``) and, when the gradient-sync mode has
state, ``sync``. A file without ``sync`` (every file so far) loads as an empty state.

A single-process run (world 1 or emulation) also keeps ``out_dir/checkpoint.pt``, a link to
the newest set's ``rank0.pt`` (:func:`link_latest`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import (
    COMMIT_NAME,
    LEGACY_NAME,
    commit_document,
    latest_complete_set,
    rank_file,
    remove_other_sets,
)
from .gemm import QMixin

__all__ = ["FORMAT", "atomic_torch_save", "commit_set", "latest_checkpoint", "link_latest",
           "load_checkpoint", "qseeds", "rank_document", "replica_entry", "set_qseeds",
           "write_rank_file"]

#: The rank file's format (2: one file per rank of a set).
FORMAT = 2


def qseeds(model: nn.Module) -> dict[str, int]:
    """The seed counter of every qsync layer of ``model``, by module name."""
    return {n: int(m.qseed) for n, m in model.named_modules() if isinstance(m, QMixin)}


def set_qseeds(model: nn.Module, seeds: dict[str, int]) -> None:
    for n, m in model.named_modules():
        if isinstance(m, QMixin) and n in seeds:
            m.qseed = int(seeds[n])


def rank_document(*, step: int, scaler: dict[str, Any], bad_run: int, skipped: int,
                  last_loss: float, model: nn.Module, optimizer: torch.optim.Optimizer,
                  rank: int, rng: torch.Tensor, sync: dict[str, Any]) -> dict[str, Any]:
    """What rank ``rank``'s file of a set holds (module docstring)."""
    replica: dict[str, Any] = {"rank": rank, "rng": rng, "qseeds": qseeds(model)}
    if sync:
        replica["sync"] = sync
    return {"format": FORMAT, "step": step, "scale": scaler["scale"], "good": scaler["good"],
            "bad_run": bad_run, "skipped": skipped, "last_loss": last_loss,
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "replicas": [replica]}


def replica_entry(doc: dict[str, Any], rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s replica entry of a rank file (None: the file has none)."""
    reps = {int(x["rank"]): x for x in doc["replicas"]}
    return reps.get(rank)


def atomic_torch_save(obj: Any, path: Path) -> None:
    from ..io import atomic_write

    atomic_write(path, lambda fh: torch.save(obj, fh))


def write_rank_file(folder: Path, rank: int, doc: dict[str, Any]) -> Path:
    """Write rank ``rank``'s file of the set in ``folder`` atomically; its path."""
    path = rank_file(folder, rank)
    atomic_torch_save(doc, path)
    return path


def commit_set(out: Path, folder: Path, step: int, world_size: int, run: dict[str, Any],
               link: bool) -> None:
    """Rank 0, once every rank's file is on disk: the commit marker, then every older set
    goes; ``link``: ``out/checkpoint.pt`` points at the set's ``rank0.pt``."""
    from ..io import atomic_write_text

    atomic_write_text(folder / COMMIT_NAME, commit_document(step, world_size, run))
    remove_other_sets(out, folder)
    if link:
        link_latest(out, rank_file(folder, 0))


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint; ``weights_only=True``: no file the runtime reads can run code."""
    doc: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return doc


def latest_checkpoint(out_dir: str | os.PathLike[str], rank: int = 0) -> Path | None:
    """``rank``'s file in ``out_dir``'s newest complete checkpoint set (None: no set)."""
    cs = latest_complete_set(Path(out_dir))
    if cs is None or rank >= cs.world_size:
        return None
    return cs.rank_file(rank)


def link_latest(out: Path, target: Path) -> None:
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
