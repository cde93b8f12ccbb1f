"""One-step gradient noise of the integer precisions, per rounding and scale choice.

For each model every GEMM module (Linear, Conv, MatMul, HF Conv1D) runs at one precision
(``apply_precisions``), one forward and backward on one fixed batch, and the whole parameter
gradient is compared with the fp32 gradient of the same weights and batch: the cosine (1 is
exact) and the relative error ``||g - g32|| / ||g32||``, each the mean over ``--seeds``
stochastic-rounding seeds. Models are in eval mode (no dropout; ResNet-50's BatchNorm uses
its running statistics), at small inputs so it runs on a CPU in minutes:

* resnet50: torchvision layout, batch 2 at 64x64;
* vit: ViT-B/16's layer (d=768, 12 heads, MLP 3072), ``--layers`` of them (default 4 of 12),
  at 64x64 (16 patches + the class token), batch 2;
* bert: BERT-base QA's layer, ``--layers`` of them, at sequence 64, batch 2;
* gpt2: GPT-2 small's layer, ``--layers`` of them, at sequence 64, batch 2;
* tiny_gpt: its registry model (4 layers, d=128) at sequence 128, batch 4.

Choices (``qsync_opt.ops.numerics``): the forward rounding of int4 and int8 (``sr``
stochastic, ``rtn`` round to nearest), and for int8_full the output gradient's rounding and
scales (``tensor``: one scale; ``row``: per row (token / output position) for the input
gradient, one for the weight gradient; ``rowcol``: per row for the input gradient, per output
channel for the weight gradient). A star marks the defaults (``ops.NUMERICS``).

Then ``--repeats R``: the bias of each rounding per tensor role. The gradient averaged over
``R`` stochastic-rounding seeds (the same batch, the same weights) keeps only the rounding's
systematic part plus ``1/R`` of its variance: for unbiased (stochastic) rounding its error
against fp32 falls as ``1/sqrt(R)``; round to nearest draws no random numbers, so its error
is its bias and does not fall. The table gives, per role, the one-step cosine, the cosine
and relative error of the mean over ``R`` seeds, and the error ratio one-step / mean
(``sqrt(R)`` for an unbiased rounding whose noise dominates, 1 for a pure bias). Over many
SGD steps the update averages gradients, so the mean's error is the one that accumulates.

Then ``--train STEPS``: the decision over a training run rather than one gradient. tiny_gpt
from its seeded init trained ``STEPS`` steps of Adam (lr 1e-3, as benchmarks/bench_accuracy.py
trains it; batch 16 of 128 characters of the stdlib's source) with every GEMM module at the role's precision and
rounding, then scored at fp32 on 8 held-out batches (mean token cross-entropy, nats), for
``--seeds`` seeds (init, batches and rounding seeded): the mean and the paired difference
against round to nearest per role. Deterministic at fixed seeds.

Then ``--outliers``: ViT's patch embedding (Conv2d 3->768, 16x16, stride 16) at batch 2,
224x224, with an output gradient whose 1% of elements (or 1% of rows: whole output positions)
are multiplied by 100: the weight- and input-gradient relative errors of int8_full per scale
choice.

Cosines and errors are deterministic at fixed seeds (no timing), so any machine gives the
same table (up to the float summation order of its GEMMs)::

    .venv/bin/python benchmarks/bench_grad_noise.py [--models resnet50 vit bert gpt2 tiny_gpt]
        [--seeds 2] [--repeats 8] [--train 150] [--outliers]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from qsync_opt.models import compute_loss, get_workload
from torch import nn

import qsync_opt.ops as ops
from qsync_opt.ops.gemm import swappable_kind
from qsync_opt.ops.layers import apply_precisions

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


def _tokens(batch: int, seq: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=gen)


def build(name: str, layers: int = 4) -> tuple[str, nn.Module, Batch]:
    """(workload name, model in eval mode, (inputs, targets)) at the small sizes above."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "resnet50":
        model = get_workload("resnet50").build()
        x = torch.randn(2, 3, 64, 64, generator=gen)
        return "resnet50", model.eval(), ((x,), torch.randint(0, 1000, (2,), generator=gen))
    if name == "vit":
        from qsync_opt.models.vit import VisionTransformer, ViTConfig

        model = VisionTransformer(ViTConfig(image_size=64, num_layers=layers))
        x = torch.randn(2, 3, 64, 64, generator=gen)
        return "vit_b16", model.eval(), ((x,), torch.randint(0, 1000, (2,), generator=gen))
    if name == "bert":
        from qsync_opt.models.bert import BertConfig, BertForQuestionAnswering

        model = BertForQuestionAnswering(BertConfig(num_hidden_layers=layers))
        ids = _tokens(2, 64, 30522, gen)
        types = (torch.arange(64) >= 32).long().expand(2, 64).contiguous()
        return "bert_base", model.eval(), ((ids, types), torch.randint(0, 64, (2, 2),
                                                                        generator=gen))
    if name == "gpt2":
        from qsync_opt.models.gpt2 import GPT, GPTConfig

        model = GPT(GPTConfig(n_layer=layers))
        ids = _tokens(2, 65, 50257, gen)
        return "gpt2_small", model.eval(), ((ids[:, :-1].contiguous(),), ids[:, 1:].contiguous())
    if name == "tiny_gpt":
        wl = get_workload("tiny_gpt")
        model = wl.build()
        ids = wl.make_inputs(5, torch.device("cpu"))[0]
        return "tiny_gpt", model.eval(), ((ids[:4],), wl.make_targets(5, torch.device("cpu"))[:4])
    raise SystemExit(f"unknown model {name!r}")


def gemm_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if n and swappable_kind(m) is not None]


def gradient(workload: str, model: nn.Module, batch: Batch) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    inputs, targets = batch
    loss = compute_loss(workload, model(*inputs), targets)
    loss.backward()
    return torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                      for p in model.parameters()])


def at_precision(model: nn.Module, precision: str, seed: int) -> nn.Module:
    m = copy.deepcopy(model)
    apply_precisions(m, {n: precision for n in gemm_names(m)}, seed=seed)
    return m


#: (label, precision, ops.numerics changes) for each measured choice.
CHOICES: list[tuple[str, str, dict[str, Any]]] = [
    ("int4 fwd sr", "int4", {"int4_forward_stochastic": True}),
    ("int4 fwd rtn", "int4", {"int4_forward_stochastic": False}),
    ("int8 fwd sr", "int8", {"int8_forward_stochastic": True}),
    ("int8 fwd rtn", "int8", {"int8_forward_stochastic": False}),
] + [(f"int8_full grad {r} {s}", "int8_full", {"grad_stochastic": r == "sr", "grad_scale": s})
     for r in ("sr", "rtn") for s in ("tensor", "row", "rowcol")]


def is_default(changes: dict[str, Any]) -> bool:
    return all(getattr(ops.NUMERICS, k) == v for k, v in changes.items())


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def measure(name: str, seeds: int, fwd: dict[str, Any], layers: int
            ) -> list[tuple[str, float, float]]:
    """[(choice, mean cosine, mean relative error)] of one model; ``fwd``: the forward
    rounding the int8_full rows run with (the default's)."""
    workload, model, batch = build(name, layers)
    ref = gradient(workload, model, batch)
    rows = []
    for label, precision, changes in CHOICES:
        cs, es = [], []
        for s in range(seeds):
            m = at_precision(model, precision, seed=s + 1)
            ctx = {**fwd, **changes} if precision == "int8_full" else changes
            with ops.numerics(**ctx), ops.float_exact_gemm():
                g = gradient(workload, m, batch)
            del m
            cs.append(cosine(g, ref))
            es.append(rel(g, ref))
        rows.append((label + (" *" if is_default(changes) else ""), sum(cs) / seeds,
                     sum(es) / seeds))
    return rows


#: (role, label, precision, ops.numerics changes) for the bias over repeats: each role's
#: rounding varied, the other roles at their defaults.
ROLES: list[tuple[str, str, str, dict[str, Any]]] = [
    ("int4 forward", "sr", "int4", {"int4_forward_stochastic": True}),
    ("int4 forward", "rtn", "int4", {"int4_forward_stochastic": False}),
    ("int8 forward", "sr", "int8", {"int8_forward_stochastic": True}),
    ("int8 forward", "rtn", "int8", {"int8_forward_stochastic": False}),
    ("int8_full forward", "sr", "int8_full", {"int8_forward_stochastic": True}),
    ("int8_full forward", "rtn", "int8_full", {"int8_forward_stochastic": False}),
    ("int8_full output gradient", "sr", "int8_full", {"grad_stochastic": True}),
    ("int8_full output gradient", "rtn", "int8_full", {"grad_stochastic": False}),
]


def bias(name: str, repeats: int, layers: int
         ) -> list[tuple[str, str, float, float, float, float]]:
    """[(role, rounding, one-step cosine, cosine of the mean over ``repeats`` seeds, one-step
    relative error, relative error of the mean)] of one model."""
    workload, model, batch = build(name, layers)
    ref = gradient(workload, model, batch)
    rows = []
    for role, label, precision, changes in ROLES:
        total = torch.zeros_like(ref, dtype=torch.float64)
        cs, es = [], []
        for s in range(repeats):
            m = at_precision(model, precision, seed=s + 1)
            with ops.numerics(**changes), ops.float_exact_gemm():
                g = gradient(workload, m, batch)
            del m
            total += g.double()
            cs.append(cosine(g, ref))
            es.append(rel(g, ref))
        mean = total / repeats
        star = " *" if is_default(changes) else ""
        rows.append((role, label + star, sum(cs) / repeats, cosine(mean, ref),
                     sum(es) / repeats, rel(mean, ref)))
    return rows


#: (role, label, precision, ops.numerics changes) of the training comparison.
TRAIN_ROLES: list[tuple[str, str, str, dict[str, Any]]] = [
    ("fp32", "", "fp32", {}),
    ("int4 forward", "sr", "int4", {"int4_forward_stochastic": True}),
    ("int4 forward", "rtn", "int4", {"int4_forward_stochastic": False}),
    ("int8 forward", "sr", "int8", {"int8_forward_stochastic": True}),
    ("int8 forward", "rtn", "int8", {"int8_forward_stochastic": False}),
    ("int8_full output gradient", "sr", "int8_full", {"grad_stochastic": True}),
    ("int8_full output gradient", "rtn", "int8_full", {"grad_stochastic": False}),
]


@functools.lru_cache(maxsize=1)
def _corpus() -> tuple[torch.Tensor, torch.Tensor]:
    from qsync_opt.models.tiny_gpt import encode, stdlib_corpus, train_val_split

    return train_val_split(encode(stdlib_corpus(max_chars=400_000)))


def train_loss(precision: str, changes: dict[str, Any], steps: int, seed: int) -> float:
    """Held-out fp32 loss of tiny_gpt after ``steps`` SGD steps at ``precision``."""
    from qsync_opt.models.tiny_gpt import sample_batch

    wl = get_workload("tiny_gpt")
    train, val = _corpus()
    torch.manual_seed(seed)
    model = wl.build()
    fp32_model = model
    if precision != "fp32":
        model = at_precision(model, precision, seed=1000 * seed + 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    with ops.numerics(**changes), ops.float_exact_gemm():
        for _ in range(steps):
            x, y = sample_batch(train, 16, 128, gen)
            opt.zero_grad(set_to_none=True)
            compute_loss("tiny_gpt", model(x), y).backward()
            opt.step()
    fp32_model.load_state_dict(model.state_dict())
    fp32_model.eval()
    held = torch.Generator().manual_seed(10_000 + seed)
    with torch.no_grad():
        losses = [float(compute_loss("tiny_gpt", fp32_model(x), y))
                  for x, y in (sample_batch(val, 16, 128, held) for _ in range(8))]
    return sum(losses) / len(losses)


def training(steps: int, seeds: int, precisions: list[str]
             ) -> list[tuple[str, str, list[float]]]:
    """[(role, rounding, held-out loss per seed)] of :data:`TRAIN_ROLES` at ``precisions``."""
    out = []
    for role, label, precision, changes in TRAIN_ROLES:
        if precision not in precisions:
            continue
        star = " *" if changes and is_default(changes) else ""
        out.append((role, label + star, [train_loss(precision, changes, steps, s + 1)
                                         for s in range(seeds)]))
        print(f"  {role} {label}{star}: {out[-1][2]}", flush=True)
    return out


@contextlib.contextmanager
def _timer(label: str) -> Iterator[None]:
    t0 = time.perf_counter()
    yield
    print(f"  ({label}: {time.perf_counter() - t0:.0f} s)", flush=True)


def outliers(seeds: int) -> list[tuple[str, str, float, float]]:
    """[(gradient kind, scale choice, weight-grad error, input-grad error)] of ViT's patch
    embedding under int8_full."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 224, 224, generator=gen)
    conv = nn.Conv2d(3, 768, 16, 16)
    go = torch.randn(2, 768, 14, 14, generator=gen)
    kinds: dict[str, Callable[[], torch.Tensor]] = {
        "plain": lambda: go,
        "1% elements x100": lambda: torch.where(
            torch.rand(go.shape, generator=gen) < 0.01, go * 100, go),
        "1% rows x100": lambda: go * torch.where(
            torch.rand(2, 1, 14, 14, generator=gen) < 0.01, 100.0, 1.0),
    }
    xr = x.clone().requires_grad_()
    out = []
    for kind, make in kinds.items():
        g = make()
        xr.grad = None
        conv.zero_grad()
        nn.functional.conv2d(xr, conv.weight, conv.bias, 16).backward(g)
        gw32, gx32 = conv.weight.grad.clone(), xr.grad.clone()
        for scale in ops.GRAD_SCALES:
            ew = ex = 0.0
            for s in range(seeds):
                xi = x.clone().requires_grad_()
                w = conv.weight.detach().clone().requires_grad_()
                y = ops.int8_conv2d(xi, w, None, 16, int8_backward=True, seed=s + 1,
                                    grad_scale=scale, bwd_dtype=torch.float32)
                y.backward(g)
                ew += rel(w.grad, gw32) / seeds
                ex += rel(xi.grad, gx32) / seeds
            out.append((kind, scale, ew, ex))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["resnet50", "vit", "bert", "gpt2",
                                                     "tiny_gpt"])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4,
                    help="transformer layers of vit, bert and gpt2 (default 4)")
    ap.add_argument("--outliers", action="store_true")
    ap.add_argument("--repeats", type=int, default=0,
                    help="also the bias per tensor role: the gradient averaged over this many "
                         "seeds (0: skip)")
    ap.add_argument("--train", type=int, default=0, metavar="STEPS",
                    help="also train tiny_gpt this many steps per role and rounding (0: skip)")
    ap.add_argument("--train-precisions", nargs="+", default=["int4", "int8", "int8_full"],
                    choices=["fp32", "int4", "int8", "int8_full"],
                    help="the precisions --train compares (default int4 int8 int8_full)")
    ap.add_argument("--skip-choices", action="store_true",
                    help="skip the one-step table of every choice (with --repeats/--outliers)")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    fwd = {"int8_forward_stochastic": ops.NUMERICS.int8_forward_stochastic}
    print(f"defaults: {ops.NUMERICS}")
    results: dict[str, list[tuple[str, float, float]]] = {}
    for name in [] if args.skip_choices else args.models:
        with _timer(name):
            results[name] = measure(name, args.seeds, fwd, args.layers)
        for label, c, e in results[name]:
            print(f"  {name} | {label} | {c:.4f} | {e:.3f}", flush=True)
    if results:
        names = list(results)
        print("\none-step gradient cosine against fp32 (relative error in brackets), mean over "
              f"{args.seeds} seed(s); * the default")
        print(f"| choice | {' | '.join(names)} |")
        print(f"|---|{'---|' * len(names)}")
        for i, (label, _, _) in enumerate(results[names[0]]):
            cells = [f"{results[n][i][1]:.4f} ({results[n][i][2]:.3f})" for n in names]
            print(f"| {label} | {' | '.join(cells)} |")
    if args.repeats > 0:
        print(f"\nbias per tensor role: the gradient averaged over {args.repeats} seeds against "
              "fp32; ratio = one-step error / error of the mean (sqrt(R) = "
              f"{args.repeats ** 0.5:.2f} for pure noise, 1 for pure bias); * the default")
        print("| model | role | rounding | cosine, one step | cosine, mean | error, one step "
              "| error, mean | ratio |")
        print("|---|---|---|---|---|---|---|---|")
        for name in args.models:
            with _timer(f"{name} bias"):
                got = bias(name, args.repeats, args.layers)
            for role, label, c1, cm, e1, em in got:
                print(f"| {name} | {role} | {label} | {c1:.4f} | {cm:.4f} | {e1:.4f} | "
                      f"{em:.4f} | {e1 / em if em > 0 else float('inf'):.2f} |", flush=True)
    if args.train > 0:
        with _timer("training"):
            got = training(args.train, args.seeds, args.train_precisions)
        base = dict(((r, lab.rstrip(" *")), v) for r, lab, v in got)
        print(f"\ntiny_gpt trained {args.train} steps, held-out fp32 loss (nats), "
              f"{args.seeds} seed(s); difference against round to nearest, paired")
        print("| role | rounding | loss per seed | mean | minus rtn |")
        print("|---|---|---|---|---|")
        for role, label, v in got:
            rtn = base.get((role, "rtn"))
            diff = (f"{sum(a - b for a, b in zip(v, rtn, strict=True)) / len(v):+.4f}"
                    if rtn is not None and label.startswith("sr") else "")
            print(f"| {role} | {label} | {', '.join(f'{x:.4f}' for x in v)} | "
                  f"{sum(v) / len(v):.4f} | {diff} |")
    if args.outliers:
        print("\nViT patch embedding, int8_full, relative error against fp32 "
              f"(mean over {args.seeds} seed(s))")
        print("| output gradient | scales | weight grad | input grad |")
        print("|---|---|---|---|")
        for kind, scale, ew, ex in outliers(args.seeds):
            print(f"| {kind} | {scale} | {ew:.4f} | {ex:.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
