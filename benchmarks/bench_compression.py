"""Compressed activations and gradients between pipeline stages: what training loses, and
how many bytes cross (the single-process study).

Each configuration trains the model cut into ``--stages`` stages (the cuts of
:data:`STUDY_CUTS` where it has the model and count: the ones the recorded studies ran
with, chosen by the older balancing over the fewest-crossing points, pinned so those figures
reproduce; otherwise balanced from the traced FLOPs, runtime.pipeline.split_stages) in one
process, GPipe with ``--micro-batches`` micro-batches, every op at fp32, for each seed
(same seed: same initial weights, same batches in every configuration). The batches carry
their sample indices (runtime.data.IndexedBatches; tiny_gpt in fixed windows), which AQ-SGD
needs. A configuration is a compressor (``topk:F``, ``quant:B``), where it applies
(activations, gradients, or both; the other direction uncompressed) and a feedback
(``none``, ``ef``, ``ef21``, ``aqsgd``; AQ-SGD wraps the activations only).

Per configuration and seed: the held-out loss after training, evaluated twice -- without
compression at inference and with it (``compress_at_eval``: the activation compressor
alone) -- and the bytes that crossed the boundaries per training step (activations and
gradients, every micro-batch, exact wire bytes; AQ-SGD's first visits send samples whole).
Against the uncompressed run (identity boundaries), paired per seed: mean difference and
its 95% Student t interval; "within noise" when the interval holds 0. Quality is
load-independent (fixed seeds, one torch thread); the wall time printed is not a result.

Predicted step time (``replayer.pipeline.pipeline_step``, GPipe): each stage on one catalog
``--device`` (default t4) at fp32, its forward and backward per micro-batch the catalog's
estimate summed over the stage's ops (``runtime.pipeline.stage_costs``), each boundary's
bytes per micro-batch as measured in the run (AQ-SGD's mean over first and later visits),
on a 1 Gb/s and a 10 Gb/s link with 50 us latency. A prediction from the catalog, not a
measurement on a GPU.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_compression.py --models digits_cnn --stages 2,3 --seeds 3
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qsync_opt.models import get_workload  # noqa: E402

from qsync_opt.pipeline.stages import Pipeline, split_stages  # noqa: E402
from qsync_opt.runtime.data import IndexedBatches  # noqa: E402
from qsync_opt.strategy.codecs import Identity, aqsgd_bytes, parse_compressor  # noqa: E402

#: The cuts the studies in docs/BENCHMARKS.md ran with (an older balancing chose
#: them from the traced FLOPs over the points where one tensor crosses); pinned, so the
#: recorded figures reproduce whatever the balancing chooses now.
STUDY_CUTS: dict[tuple[str, int], list[str]] = {
    ("digits_cnn", 2): ["bn2"], ("digits_cnn", 3): ["conv2", "bn2"],
    ("tiny_gpt", 2): ["transformer.h.2"],
    ("tiny_gpt", 3): ["transformer.h.1.ln_2", "transformer.h.3"],
}


def study_split(model: Any, model_name: str, stages: int, x: Any) -> Any:
    """The study's cut of ``model`` into ``stages`` (:data:`STUDY_CUTS`, else balanced)."""
    cuts = STUDY_CUTS.get((model_name, stages))
    if cuts is not None:
        return split_stages(model, cuts=cuts, example_inputs=x)
    return split_stages(model, n_stages=stages, example_inputs=x)


RECIPES = {  # steps, batch, optimizer, lr, held-out batches
    "digits_cnn": (150, 32, "sgd", 0.05, 6),
    "digits_resnet": (150, 32, "sgd", 0.02, 6),
    "tiny_gpt": (120, 16, "adam", 1e-3, 8),
}


@dataclass(frozen=True)
class Config:
    comp: str  # compressor text, "none" for the uncompressed run
    where: str  # act, grad, both
    feedback: str

    @property
    def label(self) -> str:
        if self.comp == "none":
            return "uncompressed"
        return f"{self.comp} {self.where} {self.feedback}"


def configs(full: bool) -> list[Config]:
    out = [Config("none", "both", "none")]
    comps = ["topk:0.3", "topk:0.1", "topk:0.05", "topk:0.01", "quant:8", "quant:4", "quant:2"]
    for c in comps:
        out.append(Config(c, "both", "none"))
    for c in ("topk:0.1", "quant:2") if not full else comps:
        out += [Config(c, "act", "none"), Config(c, "grad", "none")]
    for c in ("topk:0.3", "topk:0.1", "topk:0.01", "quant:2") if not full else comps:
        for fb in ("ef", "ef21"):
            out.append(Config(c, "both", fb))
        out.append(Config(c, "act", "aqsgd"))
    return out


@functools.cache
def _stage_ms(model_name: str, cuts: tuple[str, ...], micro_batch: int, device: str
              ) -> tuple[list[float], list[float]]:
    from qsync_opt import estimate, parse_shorthand, trace
    from qsync_opt.pipeline.stages import op_costs_from_table, stage_costs

    table = estimate(trace(model_name, micro_batch), parse_shorthand(f"{device}x1"))
    torch.manual_seed(0)
    split = split_stages(get_workload(model_name).build(), cuts=list(cuts))
    return (stage_costs(split, op_costs_from_table(table, device, part="fwd")),
            stage_costs(split, op_costs_from_table(table, device, part="bwd")))


def predicted_step_ms(model_name: str, cuts: list[str], micro_batch: int, micro: int,
                      act: list[float], grad: list[float], gbps: float,
                      device: str = "t4") -> float:
    from qsync_opt.pipeline.gpipe import pipeline_step

    f, b = _stage_ms(model_name, tuple(cuts), micro_batch, device)
    return pipeline_step(f, b, act, grad, micro_batches=micro, gbps=gbps,
                         latency_us=50.0).step_ms


def train_one(model_name: str, stages: int, cfg: Config, seed: int, *, micro: int,
              steps: int | None = None) -> dict[str, Any]:
    wl = get_workload(model_name)
    r_steps, batch, opt_name, lr, n_eval = RECIPES[model_name]
    steps = steps or r_steps
    data = IndexedBatches(wl, seed, batch)
    torch.manual_seed(seed)
    model = wl.build()
    x0, _, _ = data.batch(0)
    split = study_split(model, model_name, stages, x0)
    comp = functools.partial(parse_compressor, cfg.comp, seed=seed)
    act = comp if cfg.where in ("act", "both") else Identity
    grad = comp if cfg.where in ("grad", "both") else Identity
    pipe = Pipeline(split, act=act, grad=grad, feedback=cfg.feedback,
                    n_samples=data.n_samples)
    params = list(pipe.parameters())
    opt: torch.optim.Optimizer = (torch.optim.SGD(params, lr=lr, momentum=0.9)
                                  if opt_name == "sgd" else torch.optim.Adam(params, lr=lr))
    t0 = time.perf_counter()
    losses = []
    for s in range(steps):
        x, y, idx = data.batch(s)
        opt.zero_grad(set_to_none=True)
        losses.append(pipe.train_step(wl.loss_of, x, y, micro_batches=micro, idx=idx))
        opt.step()
    train_s = time.perf_counter() - t0
    a_bytes, g_bytes = pipe.wire_bytes()
    raw = sum(b.act_raw + b.grad_raw for b in pipe.boundaries.values())
    pipe.eval()
    evals = {}
    for on in (False, True):
        pipe.set_compress_at_eval(on)
        tot, cnt = 0.0, 0
        with torch.no_grad():
            for xe, ye in data.eval_batches(n_eval):
                tot += float(wl.loss_of(pipe(*xe), xe, ye)) * int(ye.shape[0])
                cnt += int(ye.shape[0])
        evals["eval_compressed" if on else "eval_plain"] = tot / cnt
    aq = 0
    if cfg.feedback == "aqsgd":
        aq = sum(aqsgd_bytes(data.n_samples, math.prod(b.act_send.buf.shape[1:]))
                 for b in pipe.boundaries.values()
                 if getattr(b.act_send, "buf", None) is not None)
    per_mb = steps * micro
    by_src = sorted(pipe.boundaries.values(), key=lambda b: b.src)
    act_mb = [b.act_bytes / per_mb for b in by_src]
    grad_mb = [b.grad_bytes / per_mb for b in by_src]
    return {"model": model_name, "stages": stages, "config": cfg.label, "seed": seed,
            "act_bytes_per_microbatch": act_mb, "grad_bytes_per_microbatch": grad_mb,
            "batch": batch,
            "steps": steps, "micro_batches": micro,
            "cuts": split.cuts, "final_train_loss": losses[-1], **evals,
            "act_bytes_per_step": a_bytes / steps, "grad_bytes_per_step": g_bytes / steps,
            "raw_bytes_per_step": raw / steps, "aqsgd_buffer_bytes": aq, "train_s": train_s}


def ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the 95% Student t half-width (nan when a value is not finite or n < 2)."""
    from scipy.stats import t as student_t

    if not all(math.isfinite(x) for x in xs):
        return math.inf, math.nan
    m = math.fsum(xs) / len(xs)
    if len(xs) < 2:
        return m, math.nan
    sd = math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    return m, float(student_t.ppf(0.975, len(xs) - 1)) * sd / math.sqrt(len(xs))


def fmt(m: float, h: float) -> str:
    if not math.isfinite(m):
        return "not finite"
    return f"{m:.4f} +- {h:.4f}" if abs(m) < 1e3 else f"{m:.3g} +- {h:.2g}"


def paired(xs: list[float], ref: list[float]) -> str:
    m, h = ci([a - b for a, b in zip(xs, ref, strict=True)])
    if not math.isfinite(m):
        return "not finite"
    verdict = "within noise" if abs(m) <= h else ("worse" if m > 0 else "better")
    return ("+" if m >= 0 else "") + fmt(m, h) + " " + verdict


def aqsgd_report(model_name: str, stages: int) -> str:
    """AQ-SGD's buffers for this workload and cut, said before any is allocated."""
    wl = get_workload(model_name)
    data = IndexedBatches(wl, 0, 2)
    torch.manual_seed(0)
    model = wl.build()
    x, _, _ = data.batch(0)
    pipe = Pipeline(study_split(model, model_name, stages, x))
    pipe.eval()
    with torch.no_grad():
        pipe(*x)
    shapes = pipe.boundary_sample_shapes()
    total = sum(aqsgd_bytes(data.n_samples, math.prod(s)) for s in shapes.values())
    per = ", ".join(f"{k} {tuple(s)}" for k, s in shapes.items())
    return (f"AQ-SGD buffers for {model_name} in {stages} stages: {data.n_samples} training "
            f"samples x ({per}) x 4 bytes x 2 sides = {total / 2**20:.1f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="digits_cnn,tiny_gpt")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="default: per model")
    ap.add_argument("--full", action="store_true",
                    help="every compressor in every direction and feedback (many runs)")
    ap.add_argument("--dump", default=None, help="every run's result as JSON lines")
    args = ap.parse_args()
    torch.set_num_threads(1)
    done: dict[tuple[Any, ...], dict[str, Any]] = {}
    if args.dump and Path(args.dump).exists():  # a study resumes: finished runs are read back
        for line in Path(args.dump).read_text().splitlines():
            r = json.loads(line)
            done[(r["model"], r["stages"], r["config"], r["seed"], r.get("steps"),
                  r.get("micro_batches"))] = r
    dump = Path(args.dump).open("a") if args.dump else None
    for model_name in args.models.split(","):
        for stages in (int(s) for s in args.stages.split(",")):
            print(aqsgd_report(model_name, stages), flush=True)
            rows: dict[str, list[dict[str, Any]]] = {}
            t0 = time.perf_counter()
            for cfg in configs(args.full):
                for seed in range(args.seeds):
                    steps_n = args.steps or RECIPES[model_name][0]
                    key = (model_name, stages, cfg.label, seed, steps_n, args.micro_batches)
                    if key in done:
                        rows.setdefault(cfg.label, []).append(done[key])
                        continue
                    r = train_one(model_name, stages, cfg, seed, micro=args.micro_batches,
                                  steps=args.steps)
                    rows.setdefault(cfg.label, []).append(r)
                    if dump:
                        dump.write(json.dumps(r) + "\n")
                        dump.flush()
            ref = rows["uncompressed"]
            r0 = ref[0]
            steps, batch, _, _, _ = RECIPES[model_name]
            print(f"\n{model_name}, {stages} stages (cuts {', '.join(r0['cuts'])}), "
                  f"{args.steps or steps} steps of {batch} in {args.micro_batches} micro-batches, "
                  f"{args.seeds} seeds; held-out loss, and paired against uncompressed "
                  f"[{time.perf_counter() - t0:.0f} s]")
            print(f"  {'configuration':24s} {'eval, plain':>17s} {'eval, compressed':>17s}  "
                  f"{'plain - uncompressed':>30s}  {'compressed - uncompressed':>30s} "
                  f"{'MiB/step':>8s} {'of raw':>6s} {'t4 step ms @1 / 10 Gb/s':>24s}")
            base = [r["eval_plain"] for r in ref]
            mbatch = batch // args.micro_batches
            predicted: dict[str, str] = {}
            for label, rs in rows.items():
                r = rs[0]
                if "act_bytes_per_microbatch" not in r:  # a row from before the field
                    if stages != 2:
                        predicted[label] = ""
                        continue
                    for x in rs:  # one boundary: the step's bytes over its micro-batches
                        x["act_bytes_per_microbatch"] = [x["act_bytes_per_step"]
                                                         / args.micro_batches]
                        x["grad_bytes_per_microbatch"] = [x["grad_bytes_per_step"]
                                                          / args.micro_batches]
                act = [statistics.fmean(x["act_bytes_per_microbatch"][i] for x in rs)
                       for i in range(stages - 1)]
                grad = [statistics.fmean(x["grad_bytes_per_microbatch"][i] for x in rs)
                        for i in range(stages - 1)]
                predicted[label] = " ".join(
                    f"{predicted_step_ms(model_name, r['cuts'], mbatch, args.micro_batches, act, grad, g):8.2f}"
                    for g in (1.0, 10.0))
            for label, rs in rows.items():
                p = [r["eval_plain"] for r in rs]
                c = [r["eval_compressed"] for r in rs]
                mp, hp = ci(p)
                mc, hc = ci(c)
                mib = statistics.fmean(r["act_bytes_per_step"] + r["grad_bytes_per_step"]
                                       for r in rs) / 2**20
                frac = statistics.fmean((r["act_bytes_per_step"] + r["grad_bytes_per_step"])
                                        / r["raw_bytes_per_step"] for r in rs)
                print(f"  {label:24s} {fmt(mp, hp):>17s} {fmt(mc, hc):>17s}  "
                      f"{paired(p, base) if rs is not ref else '':>30s}  "
                      f"{paired(c, base) if rs is not ref else '':>30s} {mib:8.3f} {frac:6.3f} "
                      f"{predicted[label]:>24s}",
                      flush=True)
    if dump:
        dump.close()


if __name__ == "__main__":
    main()
