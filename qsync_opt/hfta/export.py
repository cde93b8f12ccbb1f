"""A sweep's model written as a standalone run: ``OUT/model{b}``, a checkpoint set of
``qsync-opt train``'s layout.

An export (``sweep --export``) writes each model as a standalone run, ``OUT/model{b}``: a
checkpoint set of ``qsync-opt train``'s layout that ``train --model M --seed S --lr L
--weight-decay W --out OUT/model{b}`` resumes (every op at fp32 on one rank, the run's
settings in its fingerprint). An export replaces an earlier one in ``OUT/model{b}`` whole
(written beside it, then swapped in), and refuses, before training, a ``model{b}`` holding
more (a ``train`` run continued there).
:func:`check_out` checks ``--out`` before any work (a writable folder, no link inside where
the sweep writes: :mod:`qsync_opt.documents.outfolder`).
"""

from __future__ import annotations

import re
import secrets
import stat
from pathlib import Path
from typing import Any

import torch

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.costs.cluster import load_cluster
from qsync_opt.documents.io import to_json
from qsync_opt.documents.outfolder import (
    check_folder,
    check_names,
    list_names,
    make_folder,
    remove,
    swap_folder,
    write_text,
)
from qsync_opt.graph import trace
from qsync_opt.hfta.trainer import ArrayTrainer
from qsync_opt.problem.plan import make_plan
from qsync_opt.runtime.checkpoint import commit_set, rank_document, write_rank_file
from qsync_opt.runtime.config import TrainConfig, run_fingerprint, set_path
from qsync_opt.runtime.prepare import make_optimizer
from qsync_opt.runtime.scaler import LossScaler

__all__ = ["EXPORT_NAMES", "check_out", "export_run"]


#: What an export writes into ``OUT/model{b}``; a folder holding anything else (a ``train``
#: run continued there) is not replaced (:func:`check_out`).
EXPORT_NAMES = frozenset({"fp32.plan.json", "ckpt", "checkpoint.pt"})


def check_out(out: Path, n_models: int, export: bool) -> None:
    """Before any training: ``--out`` is a folder this process can write into, holding no
    link where the sweep writes (``sweep.json``; with ``export``, each ``model{b}`` and
    everything in it but the export's own ``checkpoint.pt`` link), and each ``model{b}``
    that exists holds an earlier export only (which the new one replaces whole). Refused in
    one line naming the path (qsync_opt.documents.outfolder)."""

    check_folder(out, "--out")
    check_names(out, files=["sweep.json"])
    if not export:
        return
    top = dict(list_names(out))
    for b in range(n_models):
        name = f"model{b}"
        if name not in top:
            continue
        if not stat.S_ISDIR(top[name].st_mode):
            check_names(out, folders=[name])  # refuses the link or file, naming it
        foreign = [n for n, _ in list_names(out, name) if n not in EXPORT_NAMES
                   and not (n.startswith(".") and n.endswith(".tmp"))]
        if foreign:
            raise QsyncInputError(
                f"--out {out}: {out / name} holds more than an earlier export "
                f"({', '.join(sorted(foreign)[:4])}): a train run continued there? An export "
                "replaces only an earlier export: move it away, or use another --out")
        # the export's own checkpoint.pt link goes with the folder, never followed
        check_names(out, files=[f"{name}/fp32.plan.json"], folders=[f"{name}/ckpt"])


def export_run(trainer: ArrayTrainer, b: int, out: Path) -> Path:
    """Model ``b`` as the checkpoint set of the run ``train --seed S --nproc 1`` would have
    written after as many steps (module docstring); returns the run's folder. Written into
    a new folder beside it, then swapped in: ``OUT/model{b}`` is replaced whole (an earlier
    export's sets and all) or, on a failure, left as it was."""

    folder = out / f"model{b}"
    for name, _st in list_names(out):  # what a killed export of this model left
        if re.fullmatch(rf"\.model{b}\.[0-9a-f]{{8}}(\.old)?\.tmp", name):
            remove(out, name, links=True)
    tmp = make_folder(out, f".model{b}.{secrets.token_hex(4)}.tmp")
    try:
        _export_into(trainer, b, tmp, folder)
        swap_folder(out, tmp.name, folder.name)
    except BaseException:
        try:
            remove(out, tmp.name)
        except OSError:
            pass
        raise
    return folder


def _export_into(trainer: ArrayTrainer, b: int, folder: Path, final: Path) -> None:
    """Write model ``b``'s run into ``folder`` (its final place: ``final``)."""

    spec, v = trainer.spec, trainer.spec.variants[b]
    plan = make_plan(trace(spec.workload, trainer.batch), load_cluster("cpux1"), {},
                     provenance={"solver": "none (train without --plan: fp32 everywhere)"})
    write_text(folder, "fp32.plan.json", to_json(plan))
    plan_path = final / "fp32.plan.json"
    config = TrainConfig(workload=trainer.wl.name, plan_path=str(plan_path.absolute()),
                         rank_groups=["cpu"], steps=max(trainer.step, 1), lr=v.lr,
                         optimizer=spec.optimizer, momentum=spec.momentum,
                         lr_schedule=spec.lr_schedule, weight_decay=v.weight_decay,
                         seed=v.seed, out_dir=str(final.absolute()))
    model = trainer.export(b)
    opt = make_optimizer(config, model)
    if trainer.standalone is not None:  # the standalone model's own optimizer state
        own = trainer.standalone_opts[b].state_dict()
        opt.load_state_dict({"state": own["state"], "param_groups": opt.state_dict()[
            "param_groups"]})
    fused_state = {} if trainer.standalone is not None else trainer.opt.state
    by_name = dict(trainer.array.named_model_parameters())
    for name, p in model.named_parameters():
        p_fused = by_name[name]
        st = fused_state.get(p_fused, {})
        mine: dict[str, Any] = {}
        if spec.optimizer == "sgd" and "momentum_buffer" in st:
            started = st.get("momentum_started")
            if started is None or bool(started[b]):
                mine["momentum_buffer"] = st["momentum_buffer"][b].detach().cpu().clone()
        elif spec.optimizer == "adamw" and "exp_avg" in st:
            mine = {"step": torch.tensor(float(st["step"][b])),
                    "exp_avg": st["exp_avg"][b].detach().cpu().clone(),
                    "exp_avg_sq": st["exp_avg_sq"][b].detach().cpu().clone()}
        if mine:
            opt.state[p] = mine
    scaler = LossScaler(1.0)
    scaler.good = trainer.step - trainer.skipped[b]
    step = trainer.step
    ck = set_path(folder, step)
    write_rank_file(ck, 0, rank_document(
        step=step, scaler=scaler.state_dict(), bad_run=0, skipped=trainer.skipped[b],
        last_loss=trainer.last_loss[b], model=model, optimizer=opt, rank=0,
        rng=torch.get_rng_state(), sync={}))
    commit_set(folder, ck, step, 1, run_fingerprint(config, plan), link=True)
