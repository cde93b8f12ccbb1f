"""The fused-array trainer: ``B`` variants of a workload (seeds, learning rates, weight
decays) trained as one job (``qsync-opt sweep``).

Variant ``b`` is the run ``qsync-opt train --seed s --nproc 1`` would make: its model built
after ``torch.manual_seed(s)``, its batches those of
:class:`~qsync_opt.runtime.data.GlobalBatches` seeded by ``s`` (``per_model`` inputs: each
model its own stream), the same optimizer semantics (:mod:`.optim`: one fused update, the
hyper-parameters per model), the same learning-rate schedule. With ``replicated`` inputs
every model sees the first seed's batches: the variants then differ in weights and
hyper-parameters only, so a seed sweep under them is not ``B`` separate runs (the summary
says which mode ran).

The loss of the array is the sum of the models' own mean losses, so each model's gradient
is exactly its own (no 1/B). A model whose loss is not finite is masked out of the step: its
loss does not enter the sum (its gradient is zero), its parameters, optimizer state and
BatchNorm running statistics stay as they were, and it counts a skipped step; the others
step as if it were not there.

Where the measured choice (:mod:`.choice`) finds the standalone models faster than the
array, :meth:`ArrayTrainer.use_standalone` trains them so, one after another, with torch's
optimizers and the same per-model learning rates; the results and exports are the same.

A plan: the array runs the precisions one group of a plan gives (the same for its ``B``
models): each fused op takes its op's precision (fused Linear has the int8 path), and so do
the attention matmuls (:class:`~.linear_ops.FusedMatMul`, a transformer's ``qk_matmul`` /
``av_matmul``); the plan's ops the array has no op for are listed in ``plan_unplaced``.

Routes: the converter (:func:`~.convert.fuse`) places CNNs, MLPs and GPT-style transformers
(``tiny_gpt``: embeddings, LayerNorm, attention with its reshapes and causal mask, the tied
``lm_head``), so they train on the fused operators; a model it refuses trains on the
torch.func route (:mod:`.functional`), fp32 only, and ``route_reason`` says why.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.core.progress import Progress
from qsync_opt.hfta.convert import fuse
from qsync_opt.hfta.functional import FuncArray
from qsync_opt.hfta.lr_schedules import fused_schedule
from qsync_opt.hfta.optim import FusedAdamW, FusedSGD
from qsync_opt.models import (
    TASK_CAUSAL_LM,
    TASK_CLASSIFICATION,
    UnknownWorkloadError,
    Workload,
    get_workload,
)
from qsync_opt.runtime.data import GlobalBatches

__all__ = ["ArrayTrainer", "SweepSpec", "Variant", "build_variant_model", "per_model_losses",
           "resolve_device"]


@dataclass(frozen=True)
class Variant:
    seed: int
    lr: float
    weight_decay: float

    def label(self) -> str:
        return f"seed {self.seed}, lr {self.lr:g}, wd {self.weight_decay:g}"


@dataclass
class SweepSpec:
    workload: str
    variants: list[Variant]
    steps: int = 100
    batch: int | None = None
    optimizer: str = "sgd"
    momentum: float = 0.9
    betas: tuple[float, float] = (0.9, 0.999)
    lr_schedule: str = "constant"
    input_mode: str = "per_model"
    fuse: str = "measure"  # measure, fused, serial, separate
    precisions: dict[str, str] = field(default_factory=dict)  # op -> precision (a plan group)
    eval_batches: int = 4
    device: str = "cpu"  # where the array trains: cpu, cuda or cuda:N


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N`` -> a device this process can use (a clear error
    naming ``--device`` otherwise)."""
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise QsyncInputError(f"--device: expected cpu, cuda or cuda:N, got {name!r}") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise QsyncInputError(f"--device: expected cpu, cuda or cuda:N, got {name!r}")
    if not torch.cuda.is_available():
        raise QsyncInputError(f"--device {name}: no CUDA device is available here (this torch "
                              f"is {torch.__version__})")
    index = 0 if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise QsyncInputError(f"--device {name}: this machine has {torch.cuda.device_count()} "
                              "CUDA device(s)")
    return torch.device("cuda", index)


def build_variant_model(workload: Workload, seed: int) -> nn.Module:
    """Model ``seed``'s initial weights, as ``train --seed seed`` builds them."""
    torch.manual_seed(seed)
    return workload.build().float().train()


def per_model_losses(workload: Workload, out: Tensor, inputs: Sequence[Any],
                     targets: Tensor) -> Tensor:
    """``[B]``: each model's mean loss on its own batch (``out`` model-major ``[B, N, ...]``;
    ``targets`` ``[B, N, ...]``). Classification and causal LM: one cross-entropy call for
    all ``B``; other tasks: the workload's loss per model."""
    B = out.shape[0]
    if workload.task in (TASK_CLASSIFICATION, TASK_CAUSAL_LM) and getattr(
            workload, "loss", None) == "cross_entropy":
        k = out.shape[-1]
        per = F.cross_entropy(out.reshape(-1, k), targets.reshape(-1), reduction="none")
        return per.view(B, -1).mean(1)
    return torch.stack([workload.loss_of(out[b], [x[b] for x in inputs], targets[b])
                        for b in range(B)])


class ArrayTrainer:
    """Train ``spec``'s variants as one fused array (module docstring)."""

    def __init__(self, spec: SweepSpec) -> None:
        if not spec.variants:
            raise QsyncInputError("variants: expected at least one model")
        try:
            self.wl = get_workload(spec.workload)
        except UnknownWorkloadError as exc:
            raise QsyncInputError(f"--model: {exc}") from None
        self.spec = spec
        self.device = resolve_device(spec.device)
        self.B = B = len(spec.variants)
        self.batch = spec.batch or self.wl.default_batch
        self.models = [build_variant_model(self.wl, v.seed) for v in spec.variants]
        #: "fused" (the converter's fused operators) or "torch.func" (stack_module_state +
        #: vmap, for a model the converter cannot place; ``route_reason`` says why)
        self.route, self.route_reason = "fused", ""
        self.array: Any
        try:
            self.array = fuse(self.models, input_mode=spec.input_mode)
        except QsyncInputError as exc:
            if any(p != "fp32" for p in spec.precisions.values()):
                raise QsyncInputError(
                    f"{exc}; a plan's precisions need the fused operators, and this model "
                    "runs only on the torch.func route") from None
            self.array = FuncArray(self.models, input_mode=spec.input_mode)
            self.route, self.route_reason = "torch.func", str(exc)
        # the models are built on the CPU (the same initial weights as `train --seed s`
        # draws there), then the array moves to the device
        self.array.to(self.device)
        #: the plan's ops set on the array (op -> precision), and those it has no op for
        self.plan_applied: dict[str, str] = {}
        self.plan_unplaced: list[str] = []
        for op, p in spec.precisions.items():
            k = op.replace(".", "__")
            op_mod: Any = None
            if self.route == "fused":
                op_mod = self.array.fused[k] if k in self.array.fused else (
                    self.array.matmuls[k] if k in self.array.matmuls else None)
            if op_mod is None or not hasattr(op_mod, "precision"):  # no op of the array
                self.plan_unplaced.append(op)
                continue
            op_mod.precision = Precision(p)
            self.plan_applied[op] = Precision(p).value
        lrs = [v.lr for v in spec.variants]
        wds = [v.weight_decay for v in spec.variants]
        params = list(self.array.parameters())
        if spec.optimizer == "sgd":
            self.opt: Any = FusedSGD(params, B, lr=lrs, momentum=spec.momentum,
                                     weight_decay=wds)
        elif spec.optimizer == "adamw":
            self.opt = FusedAdamW(params, B, lr=lrs, betas=spec.betas, weight_decay=wds)
        else:
            raise QsyncInputError(f"--optimizer: expected sgd or adamw, got {spec.optimizer!r}")
        self.schedule = fused_schedule([spec.lr_schedule] * B, lrs, spec.steps)
        seeds = [v.seed for v in spec.variants]
        streams = seeds if spec.input_mode == "per_model" else seeds[:1]
        self.data = [GlobalBatches(self.wl, s, self.batch) for s in streams]
        self.step = 0
        self.skipped = [0] * B
        self.last_loss = [float("nan")] * B
        self.choice: dict[str, Any] = {}
        #: set by :meth:`use_standalone`: the variants as standalone models, one by one
        self.standalone: list[nn.Module] | None = None
        self.standalone_opts: list[torch.optim.Optimizer] = []

    def use_standalone(self) -> None:
        """Train the variants as ``B`` standalone models with torch's optimizers, one after
        another (the measured choice's answer where fusing loses); :meth:`evaluate` and
        :meth:`export` read them. Only at fp32 (a plan's precisions live in the array)."""
        if any(p != "fp32" for p in self.spec.precisions.values()):
            raise QsyncInputError("fuse: standalone models run fp32 only; this sweep runs a "
                                  "plan's precisions in the array")
        spec = self.spec
        self.standalone = [self.array.export(b).to(self.device).train()
                           for b in range(self.B)]
        self.standalone_opts = []
        for m, v in zip(self.standalone, spec.variants, strict=True):
            if spec.optimizer == "adamw":
                self.standalone_opts.append(torch.optim.AdamW(
                    m.parameters(), lr=v.lr, betas=spec.betas, weight_decay=v.weight_decay))
            else:
                self.standalone_opts.append(torch.optim.SGD(
                    m.parameters(), lr=v.lr, momentum=spec.momentum,
                    weight_decay=v.weight_decay))

    def _standalone_step(self, x: tuple[Tensor, ...], y: Tensor,
                         poison: Sequence[int]) -> Tensor:
        assert self.standalone is not None
        lrs = self.schedule.lr_at(self.step)
        out_losses = torch.empty(self.B)
        replicated = self.spec.input_mode == "replicated"
        for b, (m, opt) in enumerate(zip(self.standalone, self.standalone_opts, strict=True)):
            for g in opt.param_groups:
                g["lr"] = float(lrs[b])
            opt.zero_grad(set_to_none=True)
            xs = tuple(t if replicated else t[b] for t in x)
            saved = [buf.detach().clone() for buf in m.buffers()]
            loss = self.wl.loss_of(m(*xs), xs, y[b])
            if b in poison:
                loss = loss * float("nan")
            out_losses[b] = float(loss.detach())
            if torch.isfinite(loss.detach()):
                loss.backward()
                opt.step()
                self.last_loss[b] = float(loss.detach())
            else:  # this model alone skips the step, its running statistics restored
                for buf, old in zip(m.buffers(), saved, strict=True):
                    buf.copy_(old)
                self.skipped[b] += 1
                self.last_loss[b] = float("nan")
        self.step += 1
        return out_losses

    # ------------------------------------------------------------------ data

    def batch_at(self, step: int) -> tuple[tuple[Tensor, ...], Tensor]:
        """The array's inputs and targets of ``step`` (per-model: stacked on a new axis 0)."""
        got: list[Any] = [d.batch(step) for d in self.data]
        return self._stack(got)

    def _stack(self, got: list[Any]) -> tuple[tuple[Tensor, ...], Tensor]:
        """The streams' ``(inputs, targets)`` as the array's, on its device."""
        dev = self.device
        if self.spec.input_mode == "replicated":
            (x, y), = got
            return (tuple(t.to(dev) for t in x),
                    y.to(dev).unsqueeze(0).expand(self.B, *y.shape))
        xs = tuple(torch.stack([g[0][i] for g in got]).to(dev) for i in range(len(got[0][0])))
        return xs, torch.stack([g[1] for g in got]).to(dev)

    # ------------------------------------------------------------------ steps

    def train_step(self, poison: Sequence[int] = ()) -> Tensor:
        """One step of every model; ``poison``: models whose loss is made NaN (tests).
        Returns the per-model losses."""
        x, y = self.batch_at(self.step)
        if self.standalone is not None:
            return self._standalone_step(x, y, poison)
        self.schedule.apply(self.opt, self.step)
        self.opt.zero_grad(set_to_none=True)
        saved = {n: b.detach().clone() for n, b in self.array.named_buffers()}
        out = self.array(*x)
        losses = per_model_losses(self.wl, out, x, y)
        if poison:
            bad = torch.zeros(self.B, dtype=torch.bool, device=losses.device)
            bad[list(poison)] = True
            losses = torch.where(bad, torch.full_like(losses, float("nan")), losses)
        finite = torch.isfinite(losses.detach())
        torch.where(finite, losses, torch.zeros_like(losses)).sum().backward()
        if not bool(finite.all()):
            self._restore_buffers(saved, ~finite)
        self.opt.step(mask=finite)
        for b in range(self.B):
            if bool(finite[b]):
                self.last_loss[b] = float(losses[b].detach())
            else:
                self.skipped[b] += 1
                self.last_loss[b] = float("nan")
        self.step += 1
        return losses.detach()

    def _restore_buffers(self, saved: dict[str, Tensor], bad: Tensor) -> None:
        """The masked models' BatchNorm running statistics back to before the step."""
        for n, buf in self.array.named_buffers():
            if buf.dim() >= 1 and buf.shape[0] == self.B:
                buf.data[bad] = saved[n][bad]

    def train(self, steps: int | None = None, progress: bool = False) -> None:
        total = self.spec.steps if steps is None else steps
        with Progress(f"sweep of {self.B}", total=total, enabled=progress) as bar:
            while self.step < total:
                losses = self.train_step()
                bar.update(self.step, f"loss {float(torch.nanmean(losses)):.4f} "
                                      f"(mean of {self.B})")

    # ------------------------------------------------------------------ results

    def evaluate(self) -> list[dict[str, Any]]:
        if self.standalone is not None:
            self.array.load_models(self.standalone)
        n_eval = self.spec.eval_batches
        tot = torch.zeros(self.B, dtype=torch.float64)
        correct = torch.zeros(self.B, dtype=torch.float64)
        count = 0
        self.array.eval()
        try:
            with torch.no_grad():
                streams = [list(d.eval_batches(n_eval)) for d in self.data]
                for i in range(n_eval):
                    x, y = self._stack([s[i] for s in streams])
                    out = self.array(*x)
                    k = int(y.shape[1])
                    tot += per_model_losses(self.wl, out, x, y).double().cpu() * k
                    if self.wl.task == TASK_CLASSIFICATION:
                        correct += (out.argmax(-1) == y).double().sum(1).cpu()
                    count += k
        finally:
            self.array.train()
        cls = self.wl.task == TASK_CLASSIFICATION
        rows = []
        for b, v in enumerate(self.spec.variants):
            rows.append({"model": b, "seed": v.seed, "lr": v.lr, "weight_decay": v.weight_decay,
                         "final_loss": self.last_loss[b],
                         "eval_loss": float(tot[b] / count) if count else None,
                         "eval_accuracy": float(correct[b] / count) if cls and count else None,
                         "skipped_steps": self.skipped[b]})
        return rows

    def export(self, b: int) -> nn.Module:
        """Model ``b`` as a standalone model (a copy, on the CPU: the checkpoints of
        ``train`` hold CPU tensors, whatever device the array trained on)."""
        if self.standalone is not None:
            return copy.deepcopy(self.standalone[b]).cpu()
        return self.array.export(b).cpu()
