"""What a training run is told: one JSON document shared by the launcher and every rank.

Also the checkpoint layout (torch-free, so the launcher can check a resume before it writes
anything): a run's checkpoints are *sets*, one folder per step,
``OUT/ckpt/step-00000010/rank{r}.pt`` (every rank's file, written atomically) and
``commit.json`` (written atomically by rank 0 after every rank has written its file). A set
is complete when its marker and all ``world_size`` rank files are there; a resume uses the
newest complete set, on every rank. The last complete set is kept until the next one is
committed; then every older set goes (a newer one may be in the writing: under Local SGD a
rank runs ahead of rank 0 between syncs). The marker records the run's
:func:`run_fingerprint`, which a resume compares with the new config (:func:`check_resume`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.limits import MAX_EVAL_BATCHES, MAX_STEPS
from qsync_opt.core.progress import LOG_EVERY_S
from qsync_opt.costs.link import LINK_FLAG, LinkSpec
from qsync_opt.documents.outfolder import (
    check_folder,
    check_names,
    ensure_folder,
    list_names,
    read_bytes,
    remove,
)
from qsync_opt.documents.schemas import MAX_BATCH, Document, Int, Real
from qsync_opt.runtime.online import OnlineSpec
from qsync_opt.strategy.compressor_text import parse_compressor_text
from qsync_opt.strategy.modes import check_combination, parse_comm, parse_sync
from qsync_opt.strategy.schedule import SCHEDULE_SYNTAX, parse_schedule

if TYPE_CHECKING:
    from qsync_opt.documents.schemas import Plan

#: Sane limits: beyond them a value is a typo or an attack, not a run (named when refused).
MAX_BATCH_PER_DEVICE = MAX_BATCH  # the schemas' one limit
MAX_TIMEOUT_S = 7 * 86400.0
MAX_SLOWDOWN = 1000.0
#: train's learning rate without --lr: the built-in workloads' (their tests and benchmarks
#: are tuned at it) and a model file's. 0.05 with SGD momentum 0.9 diverged torchvision's
#: ResNet-50 and ConvNeXt and timm's ViT from random weights; a model file gets
#: the smaller default (docs/MODELS.md) and every run warns when its loss explodes.
DEFAULT_LR = 0.05
USER_MODEL_LR = 0.005
MAX_ABS_SEED = 1 << 48  # seed * 1000 + rank seeds torch's generators (64-bit)
MAX_PROGRESS_EVERY_S = 86400.0

#: The ``qsync-opt train`` flag that sets a field, named in messages next to the field.
FLAGS: dict[str, str] = {
    "steps": "--steps", "lr": "--lr", "momentum": "--momentum", "seed": "--seed",
    "checkpoint_every": "--checkpoint-every", "timeout_s": "--timeout",
    "memory_step": "--measure-memory", "optimizer": "--optimizer", "workload": "--model",
    "rank_groups": "--rank-groups", "weight_decay": "--weight-decay", "sync": "--sync",
    "comm": "--comm", "lr_schedule": "--lr-schedule", "pipeline": "--pipeline-stages",
    "progress_every_s": "--progress-every", "link": LINK_FLAG,
}

#: ``--average-optimizer-state`` without parameter averaging (ddp, a pipeline): refused.
AVERAGE_STATE_REFUSAL = ("--average-optimizer-state: only with --sync local:H or qsr:... "
                         "(under ddp every replica steps on the same gradient, so their "
                         "optimizer states are equal and there is nothing to average)")

#: ``--pipeline-stages`` with a data-parallel sync mode or transport: refused.
PIPELINE_SYNC_REFUSAL = ("--pipeline-stages: a pipeline has one replica of each stage, so "
                         "--sync and --comm (data-parallel modes) do not apply; leave them at "
                         "ddp / allreduce")

#: field -> (integer?, low, low included?, high or None, high included?)
_RANGES: dict[str, tuple[bool, float, bool, float | None, bool]] = {
    "steps": (True, 1, True, MAX_STEPS, True),
    "lr": (False, 0, False, None, False),
    "momentum": (False, 0, True, 1, False),
    "weight_decay": (False, 0, True, None, False),
    "seed": (True, -MAX_ABS_SEED, True, MAX_ABS_SEED, True),
    "checkpoint_every": (True, 0, True, MAX_STEPS, True),
    "loss_scale": (False, 0, False, None, False),
    "max_bad_steps": (True, 1, True, MAX_STEPS, True),
    "timeout_s": (False, 0, False, MAX_TIMEOUT_S, True),
    "eval_batches": (True, 0, True, MAX_EVAL_BATCHES, True),
    "memory_step": (True, 0, True, MAX_STEPS, True),
    "progress_every_s": (False, 0, True, MAX_PROGRESS_EVERY_S, True),
}


def _show(v: object) -> str:
    """A value as the user most likely wrote it (-1, not -1.0), on one line."""
    if isinstance(v, float) and math.isfinite(v) and v.is_integer() and abs(v) < 1e16:
        return str(int(v))
    text = str(v) if isinstance(v, (int, float)) else repr(v)
    return text if text.isprintable() else ascii(text)


def _range_text(integer: bool, lo: float, lo_in: bool, hi: float | None, hi_in: bool) -> str:
    kind = "an integer" if integer else "a finite number"
    lo_s = f"{'>=' if lo_in else '>'} {_show(lo)}"
    if hi is None:
        return f"{kind} {lo_s}"
    return f"{kind} {lo_s} and {'<=' if hi_in else '<'} {_show(hi)}"


class PipelineSpec(BaseModel):
    """A pipeline-parallel run (``qsync-opt train --pipeline-stages N``): rank ``k`` runs
    stage ``k`` of the model cut at ``cuts`` (qsync_opt.pipeline.stages), at the plan's
    precisions for its rank group, every boundary's activation and gradient through its
    compressor (qsync_opt.strategy.codecs) with the feedback wrapper."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stages: Int = Field(ge=2, le=64, description="Pipeline stages, one rank each.")
    cuts: list[str] = Field(description="Where each stage after the first begins: a scope "
                            "name of the traced model (resolved by the launcher when balanced).")
    micro_batches: Int = Field(default=1, ge=1, le=MAX_BATCH,
                               description="GPipe micro-batches per step.")
    batch: Int = Field(ge=1, le=MAX_BATCH, description="Samples per step, through every stage.")
    compress_act: str = Field(default="none", description="Activation compressor: none, "
                              "topk:F (or N%), quant:B[,stochastic].")
    compress_grad: str = Field(default="none", description="Gradient compressor, the same "
                               "forms.")
    feedback: Literal["none", "ef", "ef21", "aqsgd"] = Field(
        default="none", description="Feedback wrapper of the compressors (aqsgd: on the "
        "activations, keyed by sample index).")
    compress_at_eval: bool = Field(default=False, description="Compress the activations "
                                   "when scoring the held-out batches too.")

    @model_validator(mode="after")
    def _check(self) -> PipelineSpec:
        if len(self.cuts) != self.stages - 1:
            raise ValueError(f"--cuts: {self.stages} stages need {self.stages - 1} cuts, got "
                             f"{len(self.cuts)}")
        if self.micro_batches > self.batch:
            raise ValueError(f"--micro-batches must be at most the batch ({self.batch}), "
                             f"got {self.micro_batches}")
        for flag, text in (("--compress-act", self.compress_act),
                           ("--compress-grad", self.compress_grad)):
            try:
                parse_compressor_text(text)
            except QsyncInputError as exc:
                raise ValueError(f"{flag}: {str(exc).partition(': ')[2]}") from None
        return self

    def describe(self) -> str:
        return (f"{self.stages} stages at {', '.join(self.cuts)}; {self.micro_batches} "
                f"micro-batch(es) of a batch of {self.batch}; act {self.compress_act}, grad "
                f"{self.compress_grad}, feedback {self.feedback}")


class TrainConfig(Document):
    """A training run of a plan. Written by ``qsync-opt train``, read by every rank."""

    SCHEMA_NAME: ClassVar[str] = "TrainConfig"
    schema_name: Literal["TrainConfig"] = Field(default="TrainConfig",
                                                description="Kind of document.")
    schema_version: Literal[1] = Field(default=1, description="Layout version this file uses.")

    workload: str = Field(description="Registry name of the model (qsync-opt models), or "
                          "a user's model file as /absolute/path.py:FUNCTION.")
    workload_sha256: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{64}$",
        description="sha256 of the user's model file (None for a registry workload): every "
                    "rank checks the file has it before running it.")
    plan_path: str = Field(description="Plan JSON; its groups and batches drive the ranks.")
    rank_groups: list[str] = Field(
        description="Group name of each rank, in rank order (world size = its length).")
    steps: Int = Field(ge=1, description="Optimizer steps to run (in total, across resumes).")
    lr: Real = Field(default=DEFAULT_LR, gt=0, allow_inf_nan=False,
                     description="The base learning rate (the schedule's peak); train's "
                                 f"default {DEFAULT_LR}, {USER_MODEL_LR} for a model file.")
    lr_schedule: str = Field(
        default="constant",
        description=f"{SCHEDULE_SYNTAX} (qsync_opt.strategy.schedule): every step's lr, in "
                    "its metrics row.")
    optimizer: Literal["sgd", "adam", "adamw"] = "sgd"
    momentum: Real = Field(default=0.9, ge=0, lt=1)
    weight_decay: Real = Field(default=0.0, ge=0,
                               description="SGD's L2 term / AdamW's decoupled decay.")
    sync: str = Field(
        default="ddp",
        description="How the replicas agree (qsync_opt.strategy.modes): ddp (gradients "
                    "all-reduced every step), local:H (parameters averaged every H steps), "
                    "qsr:alpha=A,h_base=H0[,power=P] (the quadratic synchronisation rule).")
    comm: str = Field(
        default="allreduce",
        description="Gradient transport of the ddp mode's all-reduce: allreduce (FP32), "
                    "fp16 (torch's fp16 compression hook) or dlcp[:...] (bounded-loss: the "
                    "simulated network's losses, or dlcp:p=P,stress; "
                    "qsync_opt.strategy.modes).")
    overrides: list[str] = Field(
        default_factory=list, max_length=16,
        description="train --override: each flag that ran instead of the version-2 plan's "
                    "strategy, with the plan's value (empty: the run is the plan's).")
    average_optimizer_state: bool = Field(
        default=False,
        description="Local SGD / QSR: also average the optimizer's state (momentum, Adam's "
                    "moments) at every sync, weighted like the parameters.")
    seed: Int = Field(default=0, ge=-MAX_ABS_SEED, le=MAX_ABS_SEED)
    out_dir: str = Field(description="Checkpoints, metrics.jsonl and the final summary go here.")
    checkpoint_every: Int = Field(default=0, ge=0,
                                  description="Steps between checkpoints (0: at the end only); every "
                                              "run also writes one at its end.")
    resume: bool = Field(default=True,
                         description="Continue from out_dir's checkpoint when present.")
    resume_anyway: bool = Field(
        default=False,
        description="Resume out_dir's checkpoint even when it was written under other "
                    "settings (seed, lr, plan, batch split; never another model, "
                    "optimizer or world size). Off: such a resume is refused.")
    emulate_dp: bool = Field(default=False,
                             description="One process computes every rank's micro-batch.")
    elastic: bool = Field(default=False,
                          description="An elastic run (train --elastic): groups leave and "
                                      "return; a resume may change the world's groups.")
    slowdown: dict[str, Real] = Field(
        default_factory=dict,
        description="Group -> factor by which that group's measured compute time is stretched "
                    "(emulation of a slower card on equal CPUs; from devices like 'cpu/2').")
    loss_scale: Real | None = Field(
        default=None,
        description="Initial dynamic loss scale for fp16 (None: 2**16 when any rank runs "
                    "fp16, else 1).")
    max_bad_steps: Int = Field(
        default=10, ge=1,
        description="Consecutive non-finite steps (skipped on every rank) before the "
                    "run stops with an error.")
    timeout_s: Real = Field(default=120.0, gt=0, le=MAX_TIMEOUT_S,
                            description="Collective timeout: a dead rank makes the "
                                        "others fail within it, never hang.")
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    eval_batches: Int = Field(default=4, ge=0, description="Held-out batches scored at the end.")
    pipeline: PipelineSpec | None = Field(
        default=None,
        description="Pipeline parallelism: one rank per stage (None: data parallel).")
    progress_every_s: Real = Field(
        default=LOG_EVERY_S, ge=0, le=MAX_PROGRESS_EVERY_S,
        description="Where the output is not a terminal: seconds between progress lines "
                    "(steps done, loss, steps per second, time left) from rank 0; 0: none. "
                    "A terminal shows a bar instead.")
    link: LinkSpec | None = Field(
        default=None,
        description="The emulated network link between the ranks (--emulate-link; "
                    "qsync_opt.costs.link): every collective and point-to-point payload "
                    "also takes its figures' time for its bytes. None: the real link alone.")
    memory_step: Int | None = Field(
        default=None, ge=0,
        description="Measure this step's exact peak live tensor bytes inside each "
        "rank (CPU ranks, one replica per process; qsync_opt.runtime.memory): the summary's "
        "'memory' field. None: not measured.")
    online: OnlineSpec | None = Field(
        default=None, description="Online re-planning and injected slowdowns "
        "(qsync_opt.runtime.online); None: neither.")

    @field_validator(*_RANGES, mode="before")
    @classmethod
    def _in_range(cls, v: Any, info: ValidationInfo) -> Any:
        """Every number finite and in its range, refused with the flag that sets it named
        (``--lr inf`` reached the ranks and failed there with exit 1)."""
        name = info.field_name or ""
        flag = FLAGS.get(name)
        who = f"{flag} must be" if flag else "expected"
        if isinstance(v, bool):
            raise ValueError(f"{who} a number, got {_show(v).lower()}")
        if v is None or not isinstance(v, (int, float)):
            return v  # None where allowed, and the type errors: pydantic's own message
        integer, lo, lo_in, hi, hi_in = _RANGES[name]
        ok = math.isfinite(v) and (v >= lo if lo_in else v > lo)
        if ok and hi is not None:
            ok = v <= hi if hi_in else v < hi
        if not ok:
            raise ValueError(f"{who} {_range_text(integer, lo, lo_in, hi, hi_in)}, "
                             f"got {_show(v)}")
        return v

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if not self.rank_groups:
            raise ValueError("rank_groups must name at least one rank's group")
        for name, fn in (("sync", parse_sync), ("comm", parse_comm)):
            try:
                fn(getattr(self, name))
            except QsyncInputError as exc:
                raise ValueError(f"{FLAGS[name]}: {str(exc).partition(': ')[2]}") from None
        try:
            parse_schedule(self.lr_schedule, self.lr, self.steps)
            check_combination(parse_sync(self.sync), parse_comm(self.comm))
        except QsyncInputError as exc:
            raise ValueError(str(exc)) from None
        self._check_unused()
        if self.pipeline is not None:
            if self.pipeline.stages != self.world_size:
                raise ValueError(f"--pipeline-stages: {self.pipeline.stages} stages need as "
                                 f"many ranks, rank_groups names {self.world_size}")
            if self.sync != "ddp" or self.comm != "allreduce":
                raise ValueError(PIPELINE_SYNC_REFUSAL)
            if self.memory_step is not None:
                raise ValueError("--measure-memory: not measured in a pipeline run")
        if self.average_optimizer_state and not self.sync_mode().averages_parameters:
            raise ValueError(AVERAGE_STATE_REFUSAL)
        if self.link is not None:
            self._check_link(self.link)
        if self.online is not None:
            self.online.check_groups(self.rank_groups)
        for g, f in self.slowdown.items():
            if not (math.isfinite(f) and 1 <= f <= MAX_SLOWDOWN):
                raise ValueError(f"slowdown[{_show(g)}] must be a finite number >= 1 and <= "
                                 f"{_show(MAX_SLOWDOWN)}, got {_show(f)}")
        return self

    def _check_unused(self) -> None:
        """A setting that would do nothing is refused, never ignored."""
        if self.average_optimizer_state and self.sync == "ddp":
            raise ValueError("--average-optimizer-state: only with --sync local:H or qsr:... "
                             "(under ddp every replica steps on the same averaged gradient, "
                             "so the optimizer states never differ)")
        if self.elastic and (self.pipeline is not None or self.emulate_dp
                             or self.sync_mode().kind != "ddp"):
            raise ValueError("--elastic: only a data-parallel run of ranks of their own under "
                             "--sync ddp (every replica's state equal, so a checkpoint maps "
                             "onto any world); not with a pipeline, --emulate-dp or --sync "
                             f"{self.sync}")
        if self.resume_anyway and not self.resume:
            raise ValueError("--resume-anyway with --no-resume: one resumes, the other starts "
                             "afresh; give one")
        if self.memory_step is not None and self.memory_step >= self.steps:
            raise ValueError(f"--measure-memory: step {self.memory_step} is not a step of the "
                             f"run (0 to {self.steps - 1})")
        p = self.pipeline
        if p is not None and p.compress_act == "none" and p.compress_grad == "none":
            for flag, on in (("--feedback", p.feedback != "none"),
                             ("--compress-at-eval", p.compress_at_eval)):
                if on:
                    raise ValueError(f"{flag}: only with --compress-act or --compress-grad "
                                     "(nothing is compressed)")

    @model_serializer(mode="wrap")
    def _without_an_absent_link(self, handler: SerializerFunctionWrapHandler) -> Any:
        """No ``link`` key when there is none: a run without ``--emulate-link`` writes the
        config it wrote before the link existed."""
        out = handler(self)
        if self.link is None and isinstance(out, dict):
            out.pop("link", None)
        if not self.elastic and isinstance(out, dict):
            out.pop("elastic", None)
        return out

    def _check_link(self, link: LinkSpec) -> None:
        if self.emulate_dp:
            raise ValueError(f"{LINK_FLAG}: only with ranks of their own (torchrun); "
                             "--emulate-dp runs every rank in one process, with no link "
                             "between them")
        if self.world_size < 2:
            raise ValueError(f"{LINK_FLAG}: a run of one rank sends nothing over a link")
        if link.rank_groups != self.rank_groups:
            raise ValueError(f"{LINK_FLAG}: the link's ranks {link.rank_groups} are not the "
                             f"run's {self.rank_groups}")

    @property
    def world_size(self) -> int:
        return len(self.rank_groups)

    def schedule(self) -> Any:
        """The run's :class:`~qsync_opt.strategy.schedule.LRSchedule`."""
        return parse_schedule(self.lr_schedule, self.lr, self.steps)

    def sync_mode(self) -> Any:
        """The run's :class:`~qsync_opt.strategy.modes.SyncMode`."""
        return parse_sync(self.sync)

    def comm_mode(self) -> Any:
        """The run's :class:`~qsync_opt.strategy.modes.CommMode`."""
        return parse_comm(self.comm)


# ----------------------------------------------------------------------------- plan limits


def check_batches(plan: Plan, rank_groups: list[str]) -> list[int]:
    """Each rank's batch from the plan, refused beyond :data:`MAX_BATCH_PER_DEVICE` (a batch
    of 10**12 made the ranks try to allocate it); QsyncInputError names the group."""
    out = []
    for r, g in enumerate(rank_groups):
        if g not in plan.groups:
            raise QsyncInputError(f"rank_groups[{r}]: the plan has no group {_show(g)}; its "
                                  f"groups: {', '.join(map(_show, plan.groups))}")
        b = plan.groups[g].batch_per_device
        if b > MAX_BATCH_PER_DEVICE:
            raise QsyncInputError(
                f"plan: groups.{g}.batch_per_device is {b}, above the runtime's limit of "
                f"{MAX_BATCH_PER_DEVICE} samples per device")
        out.append(b)
    return out


# ----------------------------------------------------------------------------- fingerprint


#: How a fingerprint field is named in a refusal.
_LABELS = {"workload": "--model", "world_size": "world size", "rank_groups": "--rank-groups",
           "batches": "batch split", "plan_sha256": "plan (hash of the ranks' groups)",
           "seed": "--seed", "optimizer": "--optimizer", "lr": "--lr",
           "momentum": "--momentum", "loss_scale": "loss_scale",
           "lr_schedule": "--lr-schedule", "weight_decay": "--weight-decay", "sync": "--sync",
           "comm": "--comm", "average_optimizer_state": "--average-optimizer-state",
           "pipeline": "pipeline (--pipeline-stages, --cuts, --micro-batches, compression)",
           "elastic": "--elastic"}
#: What a fingerprint written before a field existed means by its absence (the defaults then).
_ABSENT = {"lr_schedule": "constant", "weight_decay": 0.0, "sync": "ddp", "comm": "allreduce",
           "average_optimizer_state": False, "pipeline": None, "elastic": None}
#: Differences no resume can bridge, not even with --resume-anyway.
_FATAL = ("workload", "world_size", "optimizer", "pipeline")
#: What an elastic run's world change changes: a resume across it may differ in these.
ELASTIC_WORLD = ("world_size", "rank_groups", "batches", "plan_sha256")


def run_fingerprint(config: TrainConfig, plan: Plan) -> dict[str, Any]:
    """What must be equal for a checkpoint to continue the run it was written by."""
    groups = list(config.rank_groups)
    used = {g: plan.groups[g].model_dump(mode="json") for g in sorted(set(groups))
            if g in plan.groups}
    payload = json.dumps({"graph_hash": plan.graph_hash, "groups": used}, sort_keys=True,
                         separators=(",", ":"))
    return {
        # a model file is its content (it may be run from another path), a registry name
        # its spelling
        "workload": (f"sha256:{config.workload_sha256}" if config.workload_sha256
                     else config.workload.replace("-", "_").lower()),
        "world_size": config.world_size, "rank_groups": groups,
        "batches": [plan.groups[g].batch_per_device if g in plan.groups else None
                    for g in groups],
        "plan_sha256": hashlib.sha256(payload.encode()).hexdigest()[:16],
        "seed": config.seed, "optimizer": config.optimizer, "lr": config.lr,
        "momentum": config.momentum if config.optimizer == "sgd" else None,
        "loss_scale": config.loss_scale,
        # a schedule that decays depends on the run's length: a resume under more steps
        # changes every later lr, so the length is part of it
        "lr_schedule": (config.schedule().describe()
                        + ("" if config.schedule().kind == "constant" else f"@{config.steps}")),
        "weight_decay": config.weight_decay,
        "sync": config.sync_mode().describe(), "comm": config.comm_mode().describe(),
        "average_optimizer_state": config.average_optimizer_state,
        "pipeline": (config.pipeline.model_dump(mode="json", exclude={"compress_at_eval"})
                     if config.pipeline is not None else None),
        # only when set: the fingerprints of the runs before it stay as they were
        **({"elastic": True} if config.elastic else {}),
    }


def _value(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return _show(v)


def _differing(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The fields :func:`fingerprint_differences` names, in its order."""
    return [k for k in _LABELS if saved.get(k, _ABSENT.get(k)) != now.get(k)]


def fingerprint_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``field old -> new`` for every field that differs (a field missing counts)."""
    out = []
    for k in _LABELS:
        old = saved.get(k, _ABSENT.get(k))
        if old != now.get(k):
            out.append(f"{_LABELS[k]} {_value(old)} -> {_value(now.get(k))}")
    return out


# ----------------------------------------------------------------------------- layout

CKPT_DIR = "ckpt"
COMMIT_NAME = "commit.json"
LEGACY_NAME = "checkpoint.pt"  # a link to the newest set's rank0.pt in single-process runs
_STEP_DIR = re.compile(r"step-(\d{1,18})")
_LEGACY_RANK = re.compile(r"checkpoint\.rank.*\.pt")
#: What a run writes at the top of its out folder (all refused when a link: qsync_opt.documents.outfolder).
RUN_FILES = re.compile(r"(train_config|fp32\.plan|summary(\.rank\d+)?)\.json|"
                       r"metrics\.rank\d+\.jsonl")


def set_path(out_dir: str | Path, step: int) -> Path:
    return Path(out_dir) / CKPT_DIR / f"step-{step:08d}"


def rank_file(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.pt"


@dataclass(frozen=True)
class CheckpointSet:
    """A committed set: every rank's file of one step, and rank 0's marker."""

    step: int
    path: Path
    world_size: int
    run: dict[str, Any]

    def rank_file(self, rank: int) -> Path:
        return rank_file(self.path, rank)


def step_folders(out_dir: str | Path) -> list[tuple[int, Path]]:
    """Every ``step-N`` folder under ``OUT/ckpt``, complete or not, by step. Read without
    following a link: a linked ``ckpt`` (or a link where a file or folder should be) is
    refused (qsync_opt.documents.outfolder); a linked ``step-N`` is not a set."""
    found = []
    for name, st in list_names(out_dir, CKPT_DIR):
        m = _STEP_DIR.fullmatch(name)
        if m and stat.S_ISDIR(st.st_mode):
            found.append((int(m[1]), Path(out_dir) / CKPT_DIR / name))
    return sorted(found)


def read_commit(folder: Path, step: int) -> CheckpointSet | None:
    """The set in ``folder`` (``OUT/ckpt/step-N``) when it is complete (marker valid, every
    rank's file there, a regular file; links are never followed)."""
    out = folder.parent.parent
    rel = Path(CKPT_DIR, folder.name)
    try:
        data = read_bytes(out, rel / COMMIT_NAME)
        doc = json.loads(data.decode("utf-8")) if data is not None else None
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    world, run = doc.get("world_size"), doc.get("run")
    if (doc.get("step") != step or not isinstance(world, int) or isinstance(world, bool)
            or world < 1 or not isinstance(run, dict)):
        return None
    files = {n for n, st in list_names(out, rel) if stat.S_ISREG(st.st_mode)}
    if not all(rank_file(folder, r).name in files for r in range(world)):
        return None
    return CheckpointSet(step, folder, world, run)


def latest_complete_set(out_dir: str | Path) -> CheckpointSet | None:
    """The newest complete checkpoint set in ``out_dir`` (None: there is none)."""
    for step, folder in reversed(step_folders(out_dir)):
        cs = read_commit(folder, step)
        if cs is not None:
            return cs
    return None


def commit_document(step: int, world_size: int, run: dict[str, Any]) -> str:
    return json.dumps({"step": step, "world_size": world_size, "run": run}, indent=2,
                      sort_keys=True) + "\n"


def legacy_checkpoints(out_dir: str | Path) -> list[Path]:
    """Checkpoints of the one-file-per-rank layout of earlier versions (not resumable)."""
    out = Path(out_dir)
    names = {n for n, st in list_names(out) if stat.S_ISREG(st.st_mode)}
    found = [out / n for n in [LEGACY_NAME, *sorted(n for n in names if
                                                    _LEGACY_RANK.fullmatch(n))]
             if n in names]
    return found


def _where(out_dir: str | Path) -> str:
    return f"--out {_show(str(out_dir))}"


def check_resume(config: TrainConfig, plan: Plan) -> CheckpointSet | None:
    """The set a resume of ``config`` continues (None: it starts afresh).

    Refuses (QsyncInputError, one line) a checkpoint written under other settings, listing
    each difference as ``field old -> new``, unless ``config.resume_anyway`` (never another
    model, optimizer or world size); a checkpoint already past ``config.steps``; and a
    checkpoint of the old layout.
    """
    if not config.resume:
        return None
    out = config.out_dir
    cs = latest_complete_set(out)
    if cs is None:
        old = legacy_checkpoints(out)
        if old:
            raise QsyncInputError(
                f"{_where(out)} holds {old[0].name}, a checkpoint of an earlier qsync-opt's "
                "layout, which this one does not resume: pass --no-resume to start afresh "
                "(it is left in place), or use another --out")
        return None
    now = run_fingerprint(config, plan)
    diffs = fingerprint_differences(cs.run, now)
    fatal: tuple[str, ...] = _FATAL
    if config.elastic and cs.run.get("elastic"):  # the world may change, nothing else
        fatal = tuple(k for k in _FATAL if k not in ELASTIC_WORLD)
        diffs = [d for d, k in zip(diffs, _differing(cs.run, now), strict=True)
                 if k not in ELASTIC_WORLD]
    fatal_diffs = [f"{_LABELS[k]} {_value(cs.run.get(k))} -> {_value(now.get(k))}"
                   for k in fatal if cs.run.get(k) != now.get(k)]
    if fatal_diffs:
        raise QsyncInputError(
            f"{_where(out)} holds the checkpoint (step {cs.step}) of another run: "
            f"{', '.join(diffs)}; no checkpoint resumes under another model, optimizer, "
            "world size or pipeline: pass --no-resume to start afresh, or use another --out")
    if diffs and not config.resume_anyway:
        raise QsyncInputError(
            f"{_where(out)} holds the checkpoint (step {cs.step}) of another run: "
            f"{', '.join(diffs)}; pass --resume-anyway to continue it with the new settings, "
            "--no-resume to start afresh, or use another --out")
    if cs.step > config.steps:
        raise QsyncInputError(
            f"--steps {config.steps}: the checkpoint in {_where(out)} is already at step "
            f"{cs.step}; pass --steps {cs.step} or more to continue it, or --no-resume")
    return cs


def check_out_folder(out_dir: str | Path, create: bool = False) -> Path:
    """Before ``train`` writes anything: ``out_dir`` must be a writable folder, or one that
    can be made (``create``: it is; a link given as ``--out`` is followed); what a run
    writes, reads or deletes in it (its files, ``ckpt`` and everything below) must hold no
    link and nothing but regular files and folders. Refused in one line naming the path
    (qsync_opt.documents.outfolder)."""
    out = (ensure_folder if create else check_folder)(out_dir, "--out")
    check_names(out, files=[n for n, _ in list_names(out) if RUN_FILES.fullmatch(n)],
                folders=[CKPT_DIR])
    return out


def remove_stale(out_dir: str | Path, keep: CheckpointSet | None,
                 world_size: int | None = None) -> None:
    """At the start of a run: every checkpoint set but ``keep`` (incomplete sets a kill left,
    or the sets of a run that starts afresh) and every ``.tmp`` file an interrupted atomic
    write left in ``out_dir`` and its checkpoints. A run that starts afresh (``keep`` None)
    also removes an older run's summaries (``summary*.json``) and, given its
    ``world_size``, the metrics of ranks it does not have (its own ranks truncate theirs),
    so nothing of the older run is read as this one's, and its ``checkpoint.pt`` link.
    Nothing is followed: a link where a folder or file is deleted is refused
    (qsync_opt.documents.outfolder)."""
    out = Path(out_dir)
    for _, folder in step_folders(out):
        if keep is None or folder != keep.path:
            try:
                remove(out, Path(CKPT_DIR, folder.name))
            except OSError:  # as rmtree(ignore_errors=True) did; a link is still refused
                pass
    for rel in (None, CKPT_DIR, *([Path(CKPT_DIR, keep.path.name)] if keep else [])):
        for name, st in list_names(out, rel):
            stale = name.startswith(".") and name.endswith(".tmp")
            # the older run's own checkpoint.pt link: removed with its sets, not followed
            ours = name == LEGACY_NAME and rel is None and stat.S_ISLNK(st.st_mode)
            if stale or (keep is None and rel is None and (ours or
                                                           _older_output(name, world_size))):
                try:
                    remove(out, Path(rel or ".", name), links=stale or ours)
                except OSError:
                    pass


def _older_output(name: str, world_size: int | None) -> bool:
    """Whether ``name`` (top of the out folder) is an older run's summary, or the metrics
    of a rank a run of ``world_size`` ranks does not have."""
    if name == "summary.json" or re.fullmatch(r"summary\.rank\d+\.json", name):
        return True
    m = re.fullmatch(r"metrics\.rank(\d+)\.jsonl", name)
    return m is not None and world_size is not None and int(m[1]) >= world_size


def remove_other_sets(out_dir: str | Path, keep: Path) -> None:
    """After a commit: every *older* set than the one just committed. A newer folder is left
    alone: a rank that is not in lock-step with rank 0 (Local SGD runs no collective between
    syncs) may already be writing its file of the next set while rank 0 commits this one."""
    m = _STEP_DIR.fullmatch(keep.name)
    keep_step = int(m[1]) if m else None
    for step, folder in step_folders(out_dir):
        if folder != keep and (keep_step is None or step < keep_step):
            try:
                remove(out_dir, Path(CKPT_DIR, folder.name))
            except OSError:  # as rmtree(ignore_errors=True) did; a link is still refused
                pass


def rank_groups_example(groups: list[str], n: int) -> str:
    """A ``--rank-groups`` value for ``n`` ranks over ``groups`` (group names in the plan's
    order; the last repeats), for error messages: ``0:v100,1:t4``."""
    return ",".join(f"{i}:{groups[min(i, len(groups) - 1)]}" for i in range(n))
