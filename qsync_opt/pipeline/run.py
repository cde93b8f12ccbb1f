"""Pipeline-parallel training under a plan: ``qsync-opt train --pipeline-stages N``.

Rank ``k`` runs stage ``k`` of the model cut at ``config.pipeline.cuts``
(:func:`~qsync_opt.pipeline.stages.split_stages`), with the precisions its rank group's plan
gives the ops of that stage: every rank builds the whole model from the same seed, applies
its own group's plan (:func:`~qsync_opt.runtime.apply.apply_plan`: the swapped layers are
leaves of the trace, so the cut is the same on every rank), splits it, and keeps its stage.
Boundaries travel as payloads of their compressors between the ranks
(:class:`~qsync_opt.pipeline.dist.DistStage`, GPipe, ``micro_batches`` per step); each
rank steps its own optimizer over its own stage's parameters at the schedule's lr; the
tied head/embedding gradient is all-reduced between its holders.

fp16 on a rank: the last rank scales its loss by the run's loss scale, gradients cross the
boundaries scaled, every rank unscales its stage and the ranks agree (an all-reduce of the
non-finite count) to skip a step together, halving the scale; a skipped step's feedback
state (EF, EF21, AQ-SGD) is kept as it was updated (the compressed tensors of that step
were sent).

Data: the workload's training split with sample indices
(:class:`~qsync_opt.runtime.data.IndexedBatches`: the digits, tiny_gpt's fixed windows;
AQ-SGD needs them), or :class:`~qsync_opt.runtime.data.GlobalBatches` for the synthetic
workloads (no AQ-SGD there). Every rank draws the same batch of ``pipeline.batch`` samples
at every step.

Checkpoints are sets as in data-parallel runs (:mod:`qsync_opt.runtime.config`): rank ``k``'s file holds its
stage's parameters and buffers, its optimizer, the codec state of every boundary (feedback
buffers, quantizer RNGs, byte counters), the RNG and the loss scale; rank 0 commits the set
once every rank has written its file. A resume continues bit for bit.

Written to ``out_dir``: ``metrics.rank{k}.jsonl`` (a row per step: the loss on the last rank,
the bytes this rank sent each way, the step's wall time), ``summary.json`` (rank 0, from
every rank's share: the held-out loss with and without compressed activations, bytes per
step measured and predicted from the compressors' wire formula, the cuts, each stage's group
and precision mix) and ``summary.rank{k}.json``.

:func:`emulate_pipeline` runs the same pipeline in one process
(:meth:`~qsync_opt.pipeline.stages.Pipeline.train_step`), each stage built under its own
group's plan the same way, for ``--emulate-dp``.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.graph import is_user_model
from qsync_opt.models import TASK_CLASSIFICATION, UnknownWorkloadError, get_workload
from qsync_opt.ops.gemm import QMixin
from qsync_opt.pipeline.dist import DistStage
from qsync_opt.pipeline.scale import pipeline_run_fields, start_pipeline_scale
from qsync_opt.pipeline.stages import Pipeline, micro_sizes, split_stages
from qsync_opt.runtime.apply import apply_plan
from qsync_opt.runtime.checkpoint import (
    FORMAT,
    commit_set,
    load_checkpoint,
    qseeds,
    set_qseeds,
    write_rank_file,
)
from qsync_opt.runtime.config import TrainConfig, latest_complete_set, remove_stale, set_path
from qsync_opt.runtime.data import GlobalBatches, IndexedBatches
from qsync_opt.runtime.gather import all_gather_json
from qsync_opt.runtime.link import LinkClock, link_fields
from qsync_opt.runtime.metrics import MetricsWriter, StepProgress, clean, write_json
from qsync_opt.runtime.prepare import make_optimizer
from qsync_opt.runtime.scaler import LossScaler
from qsync_opt.strategy.codecs import AQSGD, aqsgd_bytes, parse_compressor

__all__ = ["NoOptimizer", "PipelineBatches", "build_pipeline", "emulate_pipeline",
           "predicted_bytes", "run_pipeline"]


class PipelineBatches:
    """Batches with indices where the workload has real data, else without."""

    def __init__(self, wl: Any, seed: int, batch: int, feedback: str) -> None:
        try:
            self.src: Any = IndexedBatches(wl, seed, batch)
            self.indexed = True
            self.n_samples: int | None = self.src.n_samples
        except QsyncInputError:
            if feedback == "aqsgd":
                raise QsyncInputError(
                    f"--feedback aqsgd: keys its buffers by sample index, which needs a "
                    f"workload with a real training set (digits_cnn, digits_resnet, "
                    f"tiny_gpt), not {wl.name!r}") from None
            self.src = GlobalBatches(wl, seed, batch)
            self.indexed = False
            self.n_samples = None

    def batch(self, step: int) -> tuple[tuple[Tensor, ...], Tensor, Tensor | None]:
        if self.indexed:
            x, y, idx = self.src.batch(step)
            return tuple(x), y, idx
        x, y = self.src.batch(step)
        return tuple(x), y, None

    def eval_batches(self, n: int) -> Iterator[tuple[tuple[Tensor, ...], Tensor]]:
        for x, y in self.src.eval_batches(n):
            yield tuple(x), y


def _workload(config: TrainConfig) -> Any:
    if is_user_model(config.workload):
        raise QsyncInputError("--pipeline-stages: pipelines run the registry workloads "
                              "(qsync-opt models), not a model file")
    try:
        return get_workload(config.workload)
    except UnknownWorkloadError as exc:
        raise QsyncInputError(f"workload: {exc}") from None


def _stage_model(config: TrainConfig, setup: Any, rank: int) -> nn.Module:
    """The whole model, seeded as on every rank, under ``rank``'s group's plan."""
    torch.manual_seed(config.seed)
    model = setup.workload.build().float()
    apply_plan(model, setup.plan, config.rank_groups[rank], seed=config.seed * 1000 + rank)
    return model.train()


def build_pipeline(config: TrainConfig, setup: Any, ranks: list[int], n_samples: int | None
                   ) -> Pipeline:
    """The pipeline with stage ``k`` built under rank ``k``'s plan for every ``k`` in
    ``ranks`` (the other stages: under the first one's; a rank runs only its own)."""
    spec = config.pipeline
    assert spec is not None
    seed = config.seed
    pipes = {}
    for r in ranks:
        split = split_stages(_stage_model(config, setup, r), cuts=list(spec.cuts))
        pipes[r] = Pipeline(split,
                            act=functools.partial(parse_compressor, spec.compress_act, seed=seed),
                            grad=functools.partial(parse_compressor, spec.compress_grad,
                                                   seed=seed),
                            feedback=spec.feedback, n_samples=n_samples)
    pipe = pipes[ranks[0]]
    for r in ranks[1:]:
        pipe.stages[r] = pipes[r].stages[r]
    pipe.set_compress_at_eval(spec.compress_at_eval)
    return pipe


def predicted_bytes(pipe: Pipeline, micro_sizes: list[int],
                    step_indices: list[Tensor | None]) -> dict[str, tuple[int, int]]:
    """Per boundary, the activation and gradient bytes the steps with these sample indices
    send, by the compressors' wire formula (:meth:`Compressor.wire_bytes`), from the shapes
    that last crossed and the micro-batch sizes. Under AQ-SGD a sample's first visit sends
    it whole (4 bytes a value) and later visits the compressed change, so the formula
    follows which samples each step has seen before."""
    out = {}
    for name, b in pipe.boundaries.items():
        if b.last_shape is None:
            continue
        per = math.prod(b.last_shape[1:])
        aq = isinstance(b.act_send, AQSGD)
        seen: set[int] = set()
        a = g = 0
        for idx in step_indices:
            parts = (torch.tensor_split(idx, len(micro_sizes)) if idx is not None
                     else [None] * len(micro_sizes))
            for m, part in zip(micro_sizes, parts, strict=True):
                g += b.grad_send.comp.wire_bytes(per * m, 4)
                if aq and part is not None:
                    ids = [int(i) for i in part]
                    new = sum(1 for i in ids if i not in seen)
                    seen.update(ids)
                    a += new * per * 4 + b.act_send.comp.wire_bytes((m - new) * per, 4)
                else:
                    a += b.act_send.comp.wire_bytes(per * m, 4)
        out[name] = (a, g)
    return out


def _aqsgd_line(pipe: Pipeline, n_samples: int | None) -> str | None:
    if n_samples is None or not any(isinstance(b.act_send, AQSGD)
                                    for b in pipe.boundaries.values()):
        return None
    shapes = pipe.boundary_sample_shapes()
    total = sum(2 * aqsgd_bytes(n_samples, math.prod(s)) for s in shapes.values())
    return f"AQ-SGD buffers: {n_samples} samples x {len(shapes)} boundaries: " \
           f"{total / 2**20:.1f} MiB (both sides)"


def _precision_mix(stage: nn.Module) -> dict[str, int]:
    mix: dict[str, int] = {}
    for m in stage.modules():
        if isinstance(m, QMixin):
            p = str(getattr(getattr(m, "precision", None), "value", getattr(m, "precision", "fp32")))
            mix[p] = mix.get(p, 0) + 1
    return mix


def _scaled_loss(wl: Any, scale: float, out: Any, inputs: Any, targets: Tensor) -> Tensor:
    """The workload's loss times the loss scale (fp16 stages: gradients cross scaled)."""
    return wl.loss_of(out, inputs, targets) * scale


class NoOptimizer:
    """A stage with no parameters (a lone activation, a pooling) has nothing to step, and
    torch refuses an optimizer over no parameters: this one does nothing. Its state is an
    optimizer's state_dict over no groups (the shape a checkpoint's reader checks), which no
    torch optimizer has."""

    STATE: dict[str, Any] = {"state": {}, "param_groups": []}

    def __init__(self) -> None:
        self.param_groups: list[dict[str, Any]] = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def step(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return dict(self.STATE)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state != self.STATE:
            raise QsyncInputError("checkpoint: it holds an optimizer for a stage that has no "
                                  "parameters in this run")


def _optimizer(config: TrainConfig, stage: nn.Module) -> Any:
    """The stage's optimizer, or a :class:`NoOptimizer` for a stage without parameters."""
    if not any(p.requires_grad for p in stage.parameters()):
        return NoOptimizer()
    return make_optimizer(config, stage)


def _rank_doc(step: int, stage: nn.Module, opt: Any, pipe: Pipeline,
              rank: int, scaler: Any, skipped: int, last_loss: float) -> dict[str, Any]:
    codecs = {n: b.state_dict() for n, b in pipe.boundaries.items() if rank in (b.src, b.dst)}
    return {"format": FORMAT, "kind": "pipeline", "step": step, "stage": rank,
            "model": stage.state_dict(), "optimizer": opt.state_dict(), "codecs": codecs,
            "rng": torch.get_rng_state(), "scale": scaler.scale, "good": scaler.good,
            "skipped": skipped, "last_loss": last_loss, "qseeds": qseeds(stage)}


def _load_rank_doc(doc: dict[str, Any], stage: nn.Module, opt: Any,
                   pipe: Pipeline, rank: int, scaler: Any) -> tuple[int, int, float]:
    if doc.get("kind") != "pipeline" or doc.get("stage") != rank:
        raise QsyncInputError(f"checkpoint: rank {rank}'s file is not stage {rank} of a "
                              "pipeline run")
    stage.load_state_dict(doc["model"])
    opt.load_state_dict(doc["optimizer"])
    for name, s in doc["codecs"].items():
        if name not in pipe.boundaries:
            raise QsyncInputError("checkpoint: its boundaries are not this pipeline's")
        pipe.boundaries[name].load_state_dict(s)
    torch.set_rng_state(doc["rng"])
    scaler.load_state_dict({"scale": doc["scale"], "good": doc["good"]})
    set_qseeds(stage, doc["qseeds"])
    return int(doc["step"]), int(doc["skipped"]), float(doc["last_loss"])


def _summary(config: TrainConfig, setup: Any, pipe: Pipeline, shares: list[dict[str, Any]],
             data: PipelineBatches, *, steps: int, start: int, skipped: int, final_loss: float, evals: dict[str, Any],
             wall_s: float, n_samples: int | None, emulated: bool) -> dict[str, Any]:
    spec = config.pipeline
    assert spec is not None
    ran = max(steps - start, 0)
    by_rank = {sh["rank"]: sh["boundaries"] for sh in shares}
    pred = predicted_bytes(pipe, micro_sizes(spec.batch, spec.micro_batches),
                           [data.batch(s)[2] for s in range(steps)])
    boundaries = []
    for name, b in pipe.boundaries.items():
        if name not in by_rank.get(b.src, {}) or name not in by_rank.get(b.dst, {}):
            continue
        a, _, ar, _ = by_rank[b.src][name]  # counted where they were sent
        _, g, _, gr = by_rank[b.dst][name]
        pa, pg = pred.get(name, (None, None))
        boundaries.append({
            "name": name, "src": b.src, "dst": b.dst,
            "act_bytes": a, "grad_bytes": g, "act_raw_bytes": ar, "grad_raw_bytes": gr,
            "act_bytes_predicted": pa, "grad_bytes_predicted": pg,
            "act_bytes_per_step": a / steps if steps else None,
            "grad_bytes_per_step": g / steps if steps else None})
    return {
        "mode": "pipeline", "workload": setup.workload.name, "plan_path": config.plan_path,
        "rank_groups": config.rank_groups, "world_size": config.world_size,
        "global_batch": spec.batch, "micro_batches": spec.micro_batches,
        "micro_batch_sizes": micro_sizes(spec.batch, spec.micro_batches),
        "emulated": emulated, "steps": steps, "resumed_from_step": start,
        "skipped_steps": skipped, "final_loss": final_loss, "lr_schedule":
            config.schedule().describe(), "pipeline": spec.model_dump(mode="json"),
        "stages": [{"stage": sh["rank"], "group": config.rank_groups[sh["rank"]],
                    "precisions": sh["mix"], "params": sh["params"]} for sh in shares],
        "boundaries": boundaries,
        "header_bytes_per_step": (sum(sh["header_bytes"] for sh in shares) / ran
                                  if ran and not emulated else None),
        "aqsgd_buffers": _aqsgd_line(pipe, n_samples),
        **({"link": config.link.describe()} if config.link is not None else {}),
        **evals, "wall_s": round(wall_s, 3),
    }


def _eval_fields(losses: list[float], correct: list[float], n: int, classification: bool,
                 compressed: list[float] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"eval_loss": sum(losses) / n if n else None,
                           "eval_accuracy": (sum(correct) / n if classification and n
                                             else None)}
    if compressed is not None:
        out["eval_loss_compressed"] = sum(compressed) / n if n else None
    return out


# ----------------------------------------------------------------------------- one process


def emulate_pipeline(config: TrainConfig, setup: Any) -> dict[str, Any]:
    """The whole pipeline in this process (``--emulate-dp`` with ``--pipeline-stages``)."""
    spec = config.pipeline
    assert spec is not None
    wl = setup.workload
    data = PipelineBatches(wl, config.seed, spec.batch, spec.feedback)
    S = spec.stages
    pipe = build_pipeline(config, setup, list(range(S)), data.n_samples)
    opts = [_optimizer(config, pipe.stages[k]) for k in range(S)]
    scaler = LossScaler(setup.init_scale)
    out = Path(config.out_dir)
    start, skipped, last = _resume(config, pipe, opts, scaler, list(range(S)))
    x0, y0, i0 = data.batch(0)
    probe = start_pipeline_scale(
        scaler, fresh=start == 0, loss_scale=config.loss_scale, pipe=pipe,
        stages=list(pipe.stages), step_at=lambda sc: pipe.train_step(
            functools.partial(_scaled_loss, wl, sc), x0, y0,
            micro_batches=spec.micro_batches, idx=i0) / sc)
    first: float | None = None
    sched = config.schedule()
    t0 = time.perf_counter()
    mw = MetricsWriter(out / "metrics.rank0.jsonl", start)
    bar = StepProgress(config.steps, config.progress_every_s, start=start)
    step = start
    try:
        while step < config.steps:
            x, y, idx = data.batch(step)
            for o in opts:
                o.zero_grad(set_to_none=True)
                for g in o.param_groups:
                    g["lr"] = sched.lr_at(step)
            a0, g0 = pipe.wire_bytes()
            t = time.perf_counter()
            scale = scaler.scale
            loss = pipe.train_step(functools.partial(_scaled_loss, wl, scale), x, y,
                                   micro_batches=spec.micro_batches, idx=idx) / scale
            for k in range(S):
                scaler.unscale_(pipe.stages[k])
            bad = scaler.nonfinite(list(pipe.stages), [loss])
            if not bad:
                for o in opts:
                    o.step()
            else:
                skipped += 1
            scaler.update(bool(bad))
            step += 1
            last = loss
            first = loss if first is None else first
            a1, g1 = pipe.wire_bytes()
            mw.write({"step": step - 1, "rank": 0, "loss": loss, "lr": sched.lr_at(step - 1),
                      "step_ms": round((time.perf_counter() - t) * 1000, 3),
                      "act_bytes": a1 - a0, "grad_bytes": g1 - g0, "skipped": bool(bad),
                      "loss_scale": scale})
            bar.update(step, loss)
            if (config.checkpoint_every and step % config.checkpoint_every == 0
                    and step < config.steps):
                _save_local(config, setup, pipe, opts, scaler, step, skipped, last)
        if step > start or start == 0:
            _save_local(config, setup, pipe, opts, scaler, step, skipped, last)
    finally:
        mw.close()
    evals = _eval_local(config, pipe, data, wl)
    shares = [{"rank": k, "mix": _precision_mix(pipe.stages[k]),
               "params": sum(p.numel() for p in pipe.stages[k].parameters()),
               "header_bytes": 0,
               "boundaries": {n: (b.act_bytes, b.grad_bytes, b.act_raw, b.grad_raw)
                              for n, b in pipe.boundaries.items() if k in (b.src, b.dst)}}
              for k in range(S)]
    summary = clean(_summary(config, setup, pipe, shares, data, steps=step, start=start,
                             skipped=skipped, final_loss=last, evals=evals,
                             wall_s=time.perf_counter() - t0, n_samples=data.n_samples,
                             emulated=True) | pipeline_run_fields(
        scaler, probe, steps=step, skipped=skipped, first_loss=first, final_loss=last,
        eval_loss=evals.get("eval_loss")))
    write_json(out / "summary.json", summary)
    return summary


def _eval_local(config: TrainConfig, pipe: Pipeline, data: PipelineBatches, wl: Any) -> dict[str, Any]:
    spec = config.pipeline
    assert spec is not None
    cls = wl.task == TASK_CLASSIFICATION
    plain: list[float] = []
    comp: list[float] = []
    correct: list[float] = []
    n = 0
    pipe.eval()
    try:
        with torch.no_grad():
            for x, y in data.eval_batches(config.eval_batches):
                k = int(y.shape[0])
                for on, acc in ((False, plain), (True, comp)):
                    pipe.set_compress_at_eval(on)
                    outp = pipe.run(x)
                    acc.append(float(wl.loss_of(outp, x, y)) * k)
                    if cls and not on:
                        correct.append(float((outp.argmax(-1) == y).sum()))
                n += k
    finally:
        pipe.set_compress_at_eval(spec.compress_at_eval)
        pipe.train()
    return _eval_fields(plain, correct, n, cls, comp)


def _resume(config: TrainConfig, pipe: Pipeline, opts: list[Any],
            scaler: Any, ranks: list[int]) -> tuple[int, int, float]:
    cs = latest_complete_set(config.out_dir) if config.resume else None
    if ranks[0] == 0:
        remove_stale(config.out_dir, cs, config.world_size)
    if cs is None:
        return 0, 0, float("nan")
    if cs.world_size != config.world_size:
        raise QsyncInputError(f"checkpoint: written by {cs.world_size} ranks, this run has "
                              f"{config.world_size}")
    got = [_load_rank_doc(load_checkpoint(cs.rank_file(r), "pipeline", follow=False),
                          pipe.stages[r], opts[i], pipe, r, scaler) for i, r in enumerate(ranks)]
    return got[-1][0], got[-1][1], got[-1][2]


def _save_local(config: TrainConfig, setup: Any, pipe: Pipeline,
                opts: list[Any], scaler: Any, step: int, skipped: int,
                last: float) -> None:
    folder = set_path(config.out_dir, step)
    for k in range(config.world_size):
        write_rank_file(folder, k, _rank_doc(step, pipe.stages[k], opts[k], pipe, k, scaler,
                                             skipped, last))
    commit_set(Path(config.out_dir), folder, step, config.world_size, setup.run, link=False)


# ----------------------------------------------------------------------------- one rank each


@dataclass
class _RankRun:
    """One rank's part of a distributed pipeline run, as its steps leave it."""

    config: TrainConfig
    setup: Any
    rank: int
    data: PipelineBatches
    pipe: Pipeline
    ds: DistStage
    opt: Any
    scaler: LossScaler
    start: int = 0
    skipped: int = 0
    last: float = float("nan")
    first: float | None = None
    step: int = 0
    probe: Any = None

    @property
    def last_rank(self) -> int:
        spec = self.config.pipeline
        assert spec is not None
        return spec.stages - 1


def run_pipeline(config: TrainConfig, setup: Any, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s part of the run (the process group is up, one rank per stage)."""
    run = _start_rank(config, setup, rank)
    t0 = time.perf_counter()
    _train_rank(run)
    share = _rank_share(run)
    return _finish_rank(run, share, t0)


def _start_rank(config: TrainConfig, setup: Any, rank: int) -> _RankRun:
    """The rank's stage, optimizer and loss scale, resumed from the agreed set, and the
    starting loss scale probed."""
    spec = config.pipeline
    assert spec is not None
    wl = setup.workload
    data = PipelineBatches(wl, config.seed, spec.batch, spec.feedback)
    pipe = build_pipeline(config, setup, [rank], data.n_samples)
    link = LinkClock(config.link, rank) if config.link is not None else None
    ds = DistStage(pipe, rank, link)
    run = _RankRun(config, setup, rank, data, pipe, ds, _optimizer(config, ds.stage),
                   LossScaler(setup.init_scale))
    cs = latest_complete_set(config.out_dir) if config.resume else None
    dist.barrier()  # every rank has seen the sets before rank 0 removes the stale ones
    run.start, run.skipped, run.last = _resume(config, pipe, [run.opt], run.scaler, [rank])
    if cs is None and run.start:
        raise QsyncInputError("checkpoint: the ranks disagree on the set to resume")
    x0, y0, i0 = data.batch(0)
    run.probe = start_pipeline_scale(
        run.scaler, fresh=run.start == 0, loss_scale=config.loss_scale, pipe=pipe,
        stages=[ds.stage],
        step_at=lambda sc: ds.train_step(functools.partial(_scaled_loss, wl, sc), x0, y0,
                                         micro_batches=spec.micro_batches, idx=i0) / sc,
        loss_here=rank == run.last_rank, total_bad=_all_sum, counters=ds)
    run.step = run.start
    return run


def _save_rank(run: _RankRun, step: int) -> None:
    """Every rank writes its file of the set; rank 0 commits it once all have."""
    config = run.config
    folder = set_path(config.out_dir, step)  # made by write_rank_file, never followed
    write_rank_file(folder, run.rank, _rank_doc(step, run.ds.stage, run.opt, run.pipe,
                                                run.rank, run.scaler, run.skipped, run.last))
    dist.barrier()
    if run.rank == 0:
        commit_set(Path(config.out_dir), folder, step, config.world_size, run.setup.run,
                   link=False)
    dist.barrier()


def _train_rank(run: _RankRun) -> None:
    """The steps from the resumed one to ``config.steps``, a metrics row each, checkpoints
    on the way and at the end."""
    config = run.config
    mw = MetricsWriter(Path(config.out_dir) / f"metrics.rank{run.rank}.jsonl", run.start)
    bar = StepProgress(config.steps, config.progress_every_s, start=run.start,
                       report=run.rank == 0)
    try:
        while run.step < config.steps:
            mw.write(_rank_step(run))
            bar.update(run.step, run.last)
            if (config.checkpoint_every and run.step % config.checkpoint_every == 0
                    and run.step < config.steps):
                _save_rank(run, run.step)
        if run.step > run.start or run.start == 0:
            _save_rank(run, run.step)
    finally:
        mw.close()


def _rank_step(run: _RankRun) -> dict[str, Any]:
    """One training step on this rank: the ranks agree on skipping it (a non-finite count
    all-reduced) and every rank learns the loss. Returns the step's metrics row."""
    config, rank, ds, opt, scaler = run.config, run.rank, run.ds, run.opt, run.scaler
    spec = config.pipeline
    assert spec is not None
    sched = config.schedule()
    step = run.step
    x, y, idx = run.data.batch(step)
    opt.zero_grad(set_to_none=True)
    for g in opt.param_groups:
        g["lr"] = sched.lr_at(step)
    sent0 = _sent(run.pipe, rank)
    if ds.link is not None:
        ds.link.take_ms()  # the row counts this step's messages only
    t = time.perf_counter()
    scale = scaler.scale
    loss = ds.train_step(functools.partial(_scaled_loss, run.setup.workload, scale), x, y,
                         micro_batches=spec.micro_batches, idx=idx) / scale
    scaler.unscale_(ds.stage)
    last_rank = rank == run.last_rank
    bad = torch.tensor([scaler.nonfinite([ds.stage], [loss] if last_rank else [])],
                       dtype=torch.int64)
    lv = torch.tensor([loss if last_rank else 0.0], dtype=torch.float64)
    dist.all_reduce(bad)
    dist.all_reduce(lv)  # every rank learns the loss (for its checkpoint and rows)
    if ds.link is not None:
        for agreed in (bad, lv):
            ds.link.block("allreduce", agreed.numel() * agreed.element_size())
    loss = float(lv)
    if int(bad) == 0:
        opt.step()
    else:
        run.skipped += 1
    scaler.update(bool(int(bad)))
    run.step = step + 1
    run.last = loss
    run.first = loss if run.first is None else run.first
    sent1 = _sent(run.pipe, rank)
    return {"step": step, "rank": rank, "stage": rank,
            "group": config.rank_groups[rank], "loss": loss,
            "lr": sched.lr_at(step),
            "step_ms": round((time.perf_counter() - t) * 1000, 3),
            "act_bytes_sent": sent1[0] - sent0[0],
            "grad_bytes_sent": sent1[1] - sent0[1],
            "skipped": bool(int(bad)), "loss_scale": scale, **link_fields(ds.link)}


def _rank_share(run: _RankRun) -> dict[str, Any]:
    """This rank's share of the summary: its stage, its boundaries' byte counters and
    shapes, and the held-out losses, plain and with compressed activations."""
    wl, ds, pipe, rank = run.setup.workload, run.ds, run.pipe, run.rank
    cls = wl.task == TASK_CLASSIFICATION
    plain: list[float] = []
    comp: list[float] = []
    correct: list[float] = []
    n = 0
    for xb, yb in run.data.eval_batches(run.config.eval_batches):
        k = int(yb.shape[0])
        lp, outp = ds.evaluate(wl.loss_of, xb, yb, compress=False)
        lc, _ = ds.evaluate(wl.loss_of, xb, yb, compress=True)
        plain.append(lp * k)
        comp.append(lc * k)
        if cls and outp is not None:
            correct.append(float((outp.argmax(-1) == yb).sum()))
        n += k
    return {"rank": rank, "mix": _precision_mix(ds.stage),
            "params": sum(p.numel() for p in ds.stage.parameters()),
            "header_bytes": ds.header_bytes,
            "boundaries": {nm: (b.act_bytes, b.grad_bytes, b.act_raw, b.grad_raw)
                           for nm, b in pipe.boundaries.items() if rank in (b.src, b.dst)},
            "shapes": {nm: b.last_shape for nm, b in pipe.boundaries.items()
                       if b.last_shape is not None and rank in (b.src, b.dst)},
            "evals": (plain, comp, correct, n)}


def _finish_rank(run: _RankRun, mine: dict[str, Any], t0: float) -> dict[str, Any]:
    """Every rank's share gathered; the summary written (``summary.rank{k}.json``, and
    ``summary.json`` by rank 0) and returned."""
    config, rank, pipe = run.config, run.rank, run.pipe
    shares = all_gather_json(mine)  # JSON: the tuples come back as lists
    for sh in shares:  # every rank learns every boundary's shape (for the formula)
        for nm, shape in sh["shapes"].items():
            pipe.boundaries[nm].last_shape = tuple(shape)
    plain, comp, correct, n = shares[run.last_rank]["evals"]
    cls = run.setup.workload.task == TASK_CLASSIFICATION
    evals = _eval_fields(plain, correct, n, cls, comp)
    summary = clean(_summary(config, run.setup, pipe, shares, run.data, steps=run.step,
                             start=run.start, skipped=run.skipped, final_loss=run.last,
                             evals=evals, wall_s=time.perf_counter() - t0,
                             n_samples=run.data.n_samples, emulated=False)
                    | pipeline_run_fields(run.scaler, run.probe, steps=run.step,
                                          skipped=run.skipped, first_loss=run.first,
                                          final_loss=run.last,
                                          eval_loss=evals.get("eval_loss")))
    summary["rank"] = rank
    out = Path(config.out_dir)
    write_json(out / f"summary.rank{rank}.json", summary)
    if rank == 0:
        write_json(out / "summary.json", summary)
    dist.barrier()
    return summary


def _all_sum(n: int) -> int:
    """``n`` summed over the ranks (every rank calls it)."""
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t)


def _sent(pipe: Pipeline, rank: int) -> tuple[int, int]:
    """Activation bytes this rank sent forward and gradient bytes it sent backward."""
    a = sum(b.act_bytes for b in pipe.boundaries.values() if b.src == rank)
    g = sum(b.grad_bytes for b in pipe.boundaries.values() if b.dst == rank)
    return a, g
