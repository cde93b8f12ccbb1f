"""``qsync-opt sweep``: a seed / learning-rate / weight-decay sweep trained as one fused array.

::

    qsync-opt sweep --model digits_cnn --seeds 0-7 --lr 0.02,0.05 --steps 200 --out sweep

Every combination of ``--seeds``, ``--lr`` and ``--wd`` is one model of the array (seeds
first). Before anything is built the memory of ``B`` models (weights, gradients, optimizer
state and the traced graph's saved activations at ``--batch``, each times ``B``) is checked
against the device: ``--plan``'s group's card, else the free memory of ``--device cuda``'s
card, else this machine's available memory. ``--device`` (cpu, cuda, cuda:N) is where the
array trains: the models are built on the CPU (the same initial weights as ``train --seed
s``), then moved; exports are CPU checkpoints whatever the device. The
fuse-or-not choice (``--fuse measure``, the default: :mod:`.choice`) is made on the first
batch and printed; ``fused`` (every op fused), ``serial`` (every op as B calls inside the
array) or ``separate`` (standalone models one by one) force one. A progress bar runs on a
terminal; the result is a table (and ``OUT/sweep.json``, or ``--json``: every model's final
and held-out loss, accuracy, skipped steps, and the choice). ``--export`` writes each model as
a standalone run, ``OUT/model{b}``: a checkpoint set of ``qsync-opt train``'s layout that
``train --model M --seed S --lr L --weight-decay W --out OUT/model{b}`` resumes (every op at
fp32 on one rank, the run's settings in its fingerprint). An export replaces an earlier one
in ``OUT/model{b}`` whole (written beside it, then swapped in), and refuses, before
training, a ``model{b}`` holding more (a ``train`` run continued there). ``--out`` is checked
before any work (a writable folder, no link inside where the sweep writes:
:mod:`qsync_opt.documents.outfolder`).

The array runs on the fused operators for every model the converter places (CNNs, MLPs and
GPT-style transformers: ``digits_cnn``, ``resnet18``, ``tiny_gpt``...); any other model
runs on the torch.func route (printed with the converter's reason; fp32 only, no per-op
modes). ``--plan F --group G`` sets the group's precisions on the array's fused Linear and
Conv2d ops and its attention matmuls; a line says how many took them and lists the plan's
ops the array has no op for (they stay at fp32).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.costs.devices import get_device
from qsync_opt.documents.outfolder import write_text
from qsync_opt.documents.schemas import Plan
from qsync_opt.graph import trace
from qsync_opt.hfta.choice import measure_choice, sync
from qsync_opt.hfta.export import check_out, export_run
from qsync_opt.hfta.request import (
    MAX_MODELS,
    SweepRequest,
    check_request,
    parse_seeds,
    parse_values,
)
from qsync_opt.hfta.trainer import (
    ArrayTrainer,
    SweepSpec,
    Variant,
    per_model_losses,
    resolve_device,
)
from qsync_opt.models import UnknownWorkloadError, get_workload
from qsync_opt.problem.plan import graph_for_plan
from qsync_opt.runtime.metrics import clean

__all__ = ["MAX_MODELS", "SweepRequest", "array_memory_bytes", "check_request",
           "memory_capacity", "parse_seeds", "parse_values", "run_sweep"]


def array_memory_bytes(workload: str, batch: int, B: int, optimizer: str) -> int:
    """What ``B`` models need: weights, gradients and optimizer state (SGD momentum: 1
    copy, AdamW: 2), and the traced graph's saved activations at ``batch``, each x ``B``."""
    g = trace(workload, batch)
    params = int(g.param_bytes)
    saved = sum(op.saved_bytes - op.saved_shared_bytes for op in g.ops)
    copies = 2 + (2 if optimizer == "adamw" else 1)
    return int(B * (params * copies + saved))


def memory_capacity(plan: Plan | None, group: str | None,
                    device: torch.device | None = None) -> tuple[int, str]:
    """The memory the array may use and where it is: the plan's group's card, else the CUDA
    ``device``'s free memory, else this machine's available memory."""
    if plan is not None and group is not None:
        spec = next(g for g in plan.cluster.groups if g.name == group)
        dev = get_device(spec.device)
        return int(dev.usable_memory_bytes), f"{group} ({spec.device})"
    if device is not None and device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free), f"{device} ({torch.cuda.get_device_name(device)}) free"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "this machine's available memory"
    except OSError:
        pass

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "this machine"





def _plan_line(trainer: ArrayTrainer, group: str) -> str:
    """Where the plan's precisions went: the array's ops that took them (the attention
    matmuls among them), those below fp32, and the plan's ops the array has no op for."""
    if trainer.route != "fused":  # the trainer refused anything but fp32 there
        return f"plan: group {group}'s precisions are all fp32; the torch.func route runs them"
    applied = trainer.plan_applied
    matmuls = set(trainer.array.matmul_names)
    lower = [f"{op} {p}" for op, p in applied.items() if p != "fp32"]
    line = (f"plan: group {group}'s precisions on {len(applied)} ops of the array "
            f"({sum(op in matmuls for op in applied)} attention matmuls among them)")
    if lower:
        line += f"; below fp32: {', '.join(lower[:6])}" + (", ..." if len(lower) > 6 else "")
    if trainer.plan_unplaced:
        un = trainer.plan_unplaced
        line += (f"; {len(un)} not ops of the array, left at fp32: {', '.join(un[:6])}"
                 + (", ..." if len(un) > 6 else ""))
    return line


def _plan_precisions(req: SweepRequest) -> tuple[Plan | None, dict[str, str]]:
    """The plan (``--plan``, checked against the model) and its group's precisions."""
    if (req.plan is None) != (req.group is None):
        raise QsyncInputError("--plan and --group: give both (the group whose precisions the "
                              "array runs) or neither")
    if req.plan is None:
        return None, {}
    plan = Plan.load(req.plan)
    graph_for_plan(plan, req.model)
    if req.group not in plan.groups:
        raise QsyncInputError(f"--group: the plan has no group {req.group!r}; its groups: "
                              f"{', '.join(plan.groups)}")
    return plan, {op: Precision(p).value for op, p in plan.groups[req.group].precisions.items()}


def _choose_fuse(tr: ArrayTrainer, req: SweepRequest, precisions: dict[str, str], n_models: int,
                 batch: int, say: Callable[[str], None]) -> dict[str, Any]:
    """Apply ``--fuse`` to the array (``measure``: the measured choice, said); its JSON."""
    if req.fuse == "measure":
        x, y = tr.batch_at(0)
        fp32 = all(p == "fp32" for p in precisions.values())
        reps = 5 if n_models * batch <= 1024 else 3
        choice = measure_choice(
            tr.array, x, lambda out: per_model_losses(tr.wl, out, x, y).sum(),
            (lambda out, b: tr.wl.loss_of(out, (), y[b])) if fp32 else None,
            reps=reps, optimizer=req.optimizer)
        if choice.separate:
            tr.use_standalone()
        say(f"fuse: {choice.summary()}")
        return {"mode": "measure", **choice.to_json()}
    if req.fuse == "serial":
        for op in tr.array.op_names:
            tr.array.set_mode(op, "serial")
    elif req.fuse == "separate":
        tr.use_standalone()
    return {"mode": req.fuse}


def run_sweep(req: SweepRequest, say: Callable[[str], None]) -> dict[str, Any]:
    """Train the sweep ``req`` as one array and return its result document (every model's
    final and held-out loss, accuracy, skipped steps; the fuse choice; the route; the
    timing); ``say`` gets the lines about what runs. Before anything is built: ``--out``
    (:func:`check_out`), the plan and the memory of the whole array; with ``req.out`` the
    document goes to ``OUT/sweep.json`` and, with ``req.export``, every model is exported
    (:func:`export_run`)."""
    check_request(req)
    variants = [Variant(s, lr, wd) for s, lr, wd in itertools.product(req.seeds, req.lrs,
                                                                      req.wds)]
    if req.out:  # before any work: a folder to write into, nothing planted in it
        check_out(Path(req.out), len(variants), req.export)
    plan, precisions = _plan_precisions(req)
    try:
        wl = get_workload(req.model)
    except UnknownWorkloadError as exc:
        raise QsyncInputError(f"--model: {exc}") from None
    device = resolve_device(req.device)
    batch = req.batch or wl.default_batch
    need = array_memory_bytes(wl.name, batch, len(variants), req.optimizer)
    cap, where = memory_capacity(plan, req.group, device)
    if need > cap:
        raise QsyncInputError(f"memory: {len(variants)} models at batch {batch} need about "
                              f"{need / 2**30:.2f} GiB, {where} has {cap / 2**30:.2f} GiB: "
                              "fewer seeds or values, or a smaller --batch")
    tr = ArrayTrainer(SweepSpec(wl.name, variants, steps=req.steps, batch=batch,
                                optimizer=req.optimizer,
                                momentum=0.9 if req.momentum is None else req.momentum,
                                lr_schedule=req.lr_schedule, input_mode=req.inputs,
                                fuse=req.fuse, precisions=precisions,
                                eval_batches=req.eval_batches, device=str(device)))
    if tr.route != "fused":
        say(f"route: torch.func (stack_module_state + vmap), because {tr.route_reason}")
        if req.fuse == "serial":
            raise QsyncInputError("--fuse serial: per-op modes need the fused operators; "
                                  "this model runs on the torch.func route")
    if plan is not None:
        say(_plan_line(tr, str(req.group)))
    say(f"sweep: {len(variants)} models of {wl.name} ({len(req.seeds)} seeds x {len(req.lrs)} "
        f"lr x {len(req.wds)} wd), batch {batch}, {req.steps} steps, inputs {req.inputs}"
        + (" (one stream: not separate runs)" if req.inputs == "replicated" else "")
        + f"; memory about {need / 2**30:.2f} GiB of {cap / 2**30:.2f} ({where}); on {device}")
    choice_doc = _choose_fuse(tr, req, precisions, len(variants), batch, say)
    t0 = time.perf_counter()
    tr.train(progress=sys.stderr.isatty())
    sync(device)
    wall = time.perf_counter() - t0
    doc = {"workload": wl.name, "models": tr.evaluate(), "steps": tr.step, "batch": batch,
           "route": tr.route, "device": str(device),
           "input_mode": req.inputs, "optimizer": req.optimizer,
           "lr_schedule": req.lr_schedule, "plan": req.plan, "group": req.group,
           "plan_ops": ({"applied": tr.plan_applied, "unplaced": tr.plan_unplaced}
                        if plan is not None else None),
           "fuse": choice_doc, "wall_s": round(wall, 3),
           "samples_per_s": round(len(variants) * batch * req.steps / wall, 1),
           "threads": torch.get_num_threads()}
    if req.out:
        out = Path(req.out)
        if req.export:
            doc["exported"] = [str(export_run(tr, b, out)) for b in range(len(variants))]
        write_text(out, "sweep.json", json.dumps(clean(doc), indent=2) + "\n", what="--out")
    return doc

