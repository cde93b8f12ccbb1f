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
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qsync_opt.core.errors import QsyncInputError, one_line
from qsync_opt.documents.io import atomic_write
from qsync_opt.documents.outfolder import replace_link, write, write_text
from qsync_opt.ops.gemm import QMixin
from qsync_opt.runtime.config import (
    CKPT_DIR,
    COMMIT_NAME,
    LEGACY_NAME,
    CheckpointSet,
    commit_document,
    latest_complete_set,
    rank_file,
    remove_other_sets,
)

__all__ = ["FORMAT", "CheckpointError", "atomic_torch_save", "check_set_files", "commit_set",
           "latest_checkpoint", "link_latest", "load_checkpoint", "qseeds", "rank_document",
           "replica_entry", "set_qseeds", "write_rank_file"]

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
    atomic_write(path, lambda fh: torch.save(obj, fh))


def _out_of(folder: Path) -> Path:
    """The run folder of a set's folder ``OUT/ckpt/step-N``."""
    return folder.parent.parent


def write_rank_file(folder: Path, rank: int, doc: dict[str, Any]) -> Path:
    """Write rank ``rank``'s file of the set in ``folder`` (``OUT/ckpt/step-N``, created)
    atomically, never through a link inside ``OUT`` (qsync_opt.documents.outfolder); its path."""
    path = rank_file(folder, rank)
    out = _out_of(folder)
    write(out, Path(CKPT_DIR, folder.name, path.name), lambda fh: torch.save(doc, fh))
    return path


def commit_set(out: Path, folder: Path, step: int, world_size: int, run: dict[str, Any],
               link: bool) -> None:
    """Rank 0, once every rank's file is on disk: the commit marker, then every older set
    goes; ``link``: ``out/checkpoint.pt`` points at the set's ``rank0.pt``."""
    write_text(out, Path(CKPT_DIR, folder.name, COMMIT_NAME),
               commit_document(step, world_size, run))
    remove_other_sets(out, folder)
    if link:
        link_latest(out, rank_file(folder, 0))


class CheckpointError(QsyncInputError):
    """A checkpoint file that is not one this runtime wrote: one line naming it."""


#: The keys of a rank file and what each must be (module docstring); a pipeline's file has
#: its own (qsync_opt.pipeline.run).
_NUM = (int, float)
_TRAIN_KEYS: dict[str, tuple[type, ...]] = {
    "step": (int,), "scale": _NUM, "good": (int,), "bad_run": (int,), "skipped": (int,),
    "last_loss": _NUM, "model": (dict,), "optimizer": (dict,), "replicas": (list,)}
_PIPELINE_KEYS: dict[str, tuple[type, ...]] = {
    "step": (int,), "stage": (int,), "scale": _NUM, "good": (int,), "skipped": (int,),
    "last_loss": _NUM, "model": (dict,), "optimizer": (dict,), "codecs": (dict,),
    "rng": (torch.Tensor,), "qseeds": (dict,)}


def _layout_problem(doc: Any, kind: str) -> str | None:
    """What is wrong with a loaded rank file's layout (None: nothing)."""
    if not isinstance(doc, dict):
        return f"holds a {type(doc).__name__}, not a checkpoint's dictionary"
    if doc.get("format") != FORMAT:
        return f"format {doc.get('format')!r}, expected {FORMAT}"
    if kind == "pipeline" and doc.get("kind") != "pipeline":
        return "not a pipeline run's checkpoint"
    keys = _PIPELINE_KEYS if kind == "pipeline" else _TRAIN_KEYS
    for key, types in keys.items():
        v = doc.get(key)
        if not isinstance(v, types) or isinstance(v, bool):
            return (f"{key!r} is {type(v).__name__ if key in doc else 'missing'}, expected "
                    + " or ".join(t.__name__ for t in types))
    bad = next((k for k, v in doc["model"].items() if not isinstance(v, torch.Tensor)), None)
    if bad is not None:
        return f"model entry {bad!r} is not a tensor"
    opt = doc["optimizer"]
    if not isinstance(opt.get("state"), dict) or not isinstance(opt.get("param_groups"), list):
        return "'optimizer' is not an optimizer's state_dict (state, param_groups)"
    if kind == "train":
        for rep in doc["replicas"]:
            if (not isinstance(rep, dict) or not isinstance(rep.get("rank"), int)
                    or not isinstance(rep.get("rng"), torch.Tensor)
                    or not isinstance(rep.get("qseeds"), dict)
                    or not isinstance(rep.get("sync", {}), dict)):
                return "a 'replicas' entry is not {rank, rng, qseeds[, sync]}"
    return None


def load_checkpoint(path: str | os.PathLike[str], kind: str | None = None,
                    follow: bool = True) -> dict[str, Any]:
    """Read a checkpoint with ``weights_only=True`` (no file the runtime reads can run
    code; it is never loaded otherwise). ``kind`` ("train" or "pipeline"): its layout is
    checked too. ``follow=False``: a link at ``path`` is refused. Anything else than a rank
    file this runtime wrote (a pickle of other objects, a truncated, empty or foreign file,
    other contents) raises :class:`CheckpointError`, one line naming the file and what was
    wrong."""
    def refuse(why: str) -> CheckpointError:
        return CheckpointError(one_line(f"checkpoint {os.fspath(path)}: {why}; not a "
                                        "checkpoint qsync-opt wrote (--no-resume starts "
                                        "afresh)"))

    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | (0 if follow else os.O_NOFOLLOW)
    try:
        fh = os.fdopen(os.open(path, flags), "rb")
    except OSError as exc:
        raise refuse(f"cannot read ({exc.strerror or exc.__class__.__name__})") from None
    with fh:
        head = fh.read(4)
        if not head:
            raise refuse("empty file")
        if head != b"PK\x03\x04":
            raise refuse("not a torch zip archive")
        fh.seek(0)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                doc = torch.load(fh, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            m = re.search(r"(?:unsupported|Unsupported global:) GLOBAL ([\w.]+)", str(exc))
            what = f" ({m[1]})" if m else ""
            raise refuse(f"holds objects other than tensors and plain values{what}, refused "
                         "unloaded") from None
        except Exception as exc:  # truncated or corrupt archives: torch's errors vary
            reason = str(exc).split(".")[0][:120] or exc.__class__.__name__
            raise refuse(f"truncated or corrupt ({reason})") from None
    if kind is not None:
        problem = _layout_problem(doc, kind)
        if problem is not None:
            raise refuse(problem)
    return doc


def check_set_files(cs: CheckpointSet, kind: str) -> None:
    """Every rank file of the set a resume continues, loaded (``weights_only``) and its
    layout checked before any rank starts: a corrupt, truncated, empty or foreign file is
    one line naming it (qsync_opt.runtime.checkpoint.CheckpointError)."""
    for r in range(cs.world_size):
        path = cs.rank_file(r)
        doc = load_checkpoint(path, kind, follow=False)
        if doc["step"] != cs.step:
            raise CheckpointError(f"checkpoint {path}: holds step {doc['step']}, its set's "
                                  f"marker says {cs.step}")


def latest_checkpoint(out_dir: str | os.PathLike[str], rank: int = 0) -> Path | None:
    """``rank``'s file in ``out_dir``'s newest complete checkpoint set (None: no set)."""
    cs = latest_complete_set(Path(out_dir))
    if cs is None or rank >= cs.world_size:
        return None
    return cs.rank_file(rank)


def link_latest(out: Path, target: Path) -> None:
    """``out/checkpoint.pt`` -> the newest set's rank0.pt (readers of the old layout): the
    one link the runtime makes in ``out``; a link there is replaced (never followed), a
    regular file (an old run's checkpoint) left alone."""
    try:
        replace_link(out, LEGACY_NAME, os.path.relpath(target, out))
    except OSError:
        pass
