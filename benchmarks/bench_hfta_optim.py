"""The fused optimizers' step against B torch optimizers, on a model's real parameter shapes.

For every (model, optimizer, B) the optimizer step alone is timed, on the shapes of the
model's parameters (B copies; gradients random, fixed), in four ways:

* ``torch``: B standalone torch optimizers (``torch.optim.SGD`` / ``AdamW``, torch's default
  implementation on this CPU, the foreach one), stepped one after another -- what B jobs run;
* ``torch1``: one torch optimizer over all B models' parameters at once (a single foreach
  call over B x the tensors; only possible when every model has the same hyper-parameters,
  shown as the bound a per-model-hyper-parameter optimizer cannot beat by construction);
* ``fused``: the fused optimizer (:mod:`qsync_opt.hfta.optim`) over the ``[B, ...]``
  parameters, with per-model learning rates (its fast path: no mask, no AMSGrad);
* ``general``: the fused optimizer forced onto its general path (masks, AMSGrad, models at
  different step counts), which the fast path repeats op for op.

Each round times ``--steps`` steps of every way in a shuffled order (seeded per cell);
``--reps`` rounds; the figure is microseconds per step, the median over rounds with the
spread (min-max); ratios are torch over the other (above 1: faster than B torch optimizers).
One torch thread (``--threads``). The ratios are of this CPU: a GPU launches one kernel per
op, where the fused optimizer's saving (B times fewer launches) is larger.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_hfta_optim.py
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WAYS = ("torch", "torch1", "fused", "general")


def shapes_of(name: str) -> list[tuple[int, ...]]:
    from qsync_opt.models import get_workload

    torch.manual_seed(0)
    net = get_workload(name).build()
    return [tuple(p.shape) for p in net.parameters()]


def cell(shapes: list[tuple[int, ...]], optimizer: str, B: int, steps: int, reps: int,
         seed: int) -> dict[str, list[float]]:
    from qsync_opt.hfta.optim import FusedAdamW, FusedSGD

    g = torch.Generator().manual_seed(seed)
    lrs = [0.01 * (1 + b) for b in range(B)]
    fused_p = [torch.randn((B, *s), generator=g) for s in shapes]
    for p in fused_p:
        p.requires_grad_(True)
        p.grad = torch.randn(p.shape, generator=g)
    general_p = [p.detach().clone().requires_grad_(True) for p in fused_p]
    for p, q in zip(general_p, fused_p, strict=True):
        p.grad = q.grad.clone()  # type: ignore[union-attr]
    models = [[p.detach()[b].clone().requires_grad_(True) for p in fused_p] for b in range(B)]
    for b, ps in enumerate(models):
        for p, q in zip(ps, fused_p, strict=True):
            p.grad = q.grad[b].clone()  # type: ignore[index]
    one = [p for ps in models for p in ps]
    one_p = [p.detach().clone().requires_grad_(True) for p in one]
    for p, q in zip(one_p, one, strict=True):
        p.grad = q.grad.clone()  # type: ignore[union-attr]

    if optimizer == "adamw":
        fused: Any = FusedAdamW(fused_p, B, lr=lrs, weight_decay=0.01)
        general: Any = FusedAdamW(general_p, B, lr=lrs, weight_decay=0.01)
        torch_opts = [torch.optim.AdamW(ps, lr=lrs[b], weight_decay=0.01)
                      for b, ps in enumerate(models)]
        torch1: Any = torch.optim.AdamW(one_p, lr=0.01, weight_decay=0.01)
    else:
        fused = FusedSGD(fused_p, B, lr=lrs, momentum=0.9)
        general = FusedSGD(general_p, B, lr=lrs, momentum=0.9)
        torch_opts = [torch.optim.SGD(ps, lr=lrs[b], momentum=0.9)
                      for b, ps in enumerate(models)]
        torch1 = torch.optim.SGD(one_p, lr=0.01, momentum=0.9)
    general.fast_path = False

    def run_torch() -> None:
        for o in torch_opts:
            o.step()

    fns = {"torch": run_torch, "torch1": torch1.step, "fused": fused.step,
           "general": general.step}
    for f in fns.values():  # state created, warm-up
        f()
        f()
    rng = random.Random(seed)
    out: dict[str, list[float]] = {w: [] for w in WAYS}
    for _ in range(reps):
        order = list(WAYS)
        rng.shuffle(order)
        for w in order:
            t0 = time.perf_counter()
            for _ in range(steps):
                fns[w]()
            out[w].append((time.perf_counter() - t0) / steps * 1e6)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="digits_cnn,resnet18_32")
    ap.add_argument("--optimizers", default="sgd,adamw")
    ap.add_argument("--B", default="1,2,4,8,16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        Bs = [int(x) for x in args.B.split(",")]
    except ValueError:
        raise SystemExit(f"--B: expected integers separated by commas, got {args.B!r}") from None
    if any(b < 1 for b in Bs):
        raise SystemExit(f"--B: expected integers >= 1, got {args.B!r}")
    opts = [o.strip() for o in args.optimizers.split(",")]
    bad = [o for o in opts if o not in ("sgd", "adamw")]
    if bad:
        raise SystemExit(f"--optimizers: expected sgd and/or adamw, got {bad[0]!r}")
    load = os.getloadavg()[0]
    from qsync_opt.core.machine import cpu_model

    print(f"# {cpu_model()}; torch {torch.__version__}; {args.threads} thread(s); load average "
          f"{load:.2f}; {args.reps} rounds of {args.steps} steps, ways shuffled per round")
    print(f"{'model':>12} {'opt':>6} {'B':>3} {'params':>10}  "
          + "  ".join(f"{w + ' us':>19}" for w in WAYS)
          + "  torch/fused  torch/general  torch1/fused")
    for name in args.models.split(","):
        shapes = shapes_of(name.strip())
        n = sum(int(torch.Size(s).numel()) for s in shapes)
        for opt in opts:
            for i, B in enumerate(Bs):
                r = cell(shapes, opt, B, args.steps, args.reps, seed=1000 * i + B)
                med = {w: statistics.median(v) for w, v in r.items()}
                cells = "  ".join(f"{med[w]:.0f} ({min(r[w]):.0f}-{max(r[w]):.0f})".rjust(19)
                                  for w in WAYS)
                print(f"{name:>12} {opt:>6} {B:>3} {n * B:>10}  {cells}  "
                      f"{med['torch'] / med['fused']:11.2f}x {med['torch'] / med['general']:13.2f}x"
                      f" {med['torch1'] / med['fused']:12.2f}x", flush=True)
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
