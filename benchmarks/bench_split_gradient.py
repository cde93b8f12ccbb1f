"""Whether an uneven batch split changes the data-parallel gradient: the demo's part 1 trains
digits_cnn on a 43/21 split (the dynamic-batching plan) where the fp32 run has 32/32.

For each split of one global batch of 64, the ranks' gradients are weighted as the runtime
weights them (each rank's mean-loss gradient times ``b_r * world / B``, then averaged:
``runtime.sync.EmulatedSync``) and compared with one process's gradient of the whole batch,
in float64, with the model in eval mode (BatchNorm from its running statistics: every
sample on its own) and in train mode (BatchNorm normalises each rank's slice by that
slice's own statistics, as every data-parallel run does without SyncBatchNorm). Then, per
split, the held-out accuracy after ``--steps`` steps at fp32 over ``--seeds`` (one process,
``train --emulate-dp``: the same arithmetic as the two gloo ranks).

    python benchmarks/bench_split_gradient.py [--steps 80] [--seeds 0-7]

Deterministic (fixed seeds, float64 gradients; the accuracies are those of the fixed-seed
runs), so the figures do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from qsync_opt import parse_shorthand, trace
from qsync_opt.job.rank import (
    EmulatedSync,
    GlobalBatches,
    build_model,
    emulate,
    prepare,
    rank_slice,
)
from qsync_opt.job.steps import weighted_backward
from qsync_opt.problem.plan import make_plan
from qsync_opt.runtime.config import TrainConfig

SPLITS = ((32, 32), (43, 21), (21, 43))


def _setup(split: tuple[int, int], folder: Path, steps: int, seed: int) -> TrainConfig:
    cluster = parse_shorthand(f"cpux1@{split[0]}+cpu/2x1@{split[1]}")
    plan_path = folder / f"fp32-{split[0]}-{split[1]}.json"
    if not plan_path.exists():
        make_plan(trace("digits_cnn"), cluster, {}).save(plan_path)
    return TrainConfig(workload="digits_cnn", plan_path=str(plan_path),
                       rank_groups=["cpu", "cpu_2"], steps=steps, seed=seed,
                       out_dir=str(folder / f"run-{split[0]}-{split[1]}-{seed}"),
                       emulate_dp=True, eval_batches=4)


def gradient_error(config: TrainConfig, train_mode: bool) -> tuple[float, float]:
    """(largest relative error over the parameters, cosine) of the split's weighted gradient
    against the whole batch's, step 0, float64."""
    setup = prepare(config)
    model = build_model(setup, 0, torch.device("cpu")).double()
    model.train(train_mode)
    replicas = [copy.deepcopy(model) for _ in setup.batches]
    (x,), y = GlobalBatches(setup.workload, config.seed, setup.global_batch).batch(0)
    x = x.double()
    weighted_backward(model, setup.workload, (x,), y, weight=1.0)
    for r, rep in enumerate(replicas):
        (xr,), yr = rank_slice(((x,), y), setup.offsets[r], setup.batches[r])
        weighted_backward(rep, setup.workload, (xr,), yr,
                          weight=setup.batches[r] * len(replicas) / setup.global_batch)
    EmulatedSync(len(replicas)).reduce(replicas)
    full = torch.cat([p.grad.flatten() for p in model.parameters()])
    split = torch.cat([p.grad.flatten() for p in replicas[0].parameters()])
    rel = max(float((a.grad - b.grad).abs().max() / b.grad.abs().max().clamp_min(1e-300))
              for a, b in zip(replicas[0].parameters(), model.parameters(), strict=True))
    return rel, float(torch.nn.functional.cosine_similarity(full, split, dim=0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--seeds", default="0-7", help="A-B")
    args = ap.parse_args(argv)
    lo, _, hi = args.seeds.partition("-")
    seeds = list(range(int(lo), int(hi or lo) + 1))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        print("split  mode   max rel. error  cosine   (weighted gradient vs whole batch, step 0)")
        for split in SPLITS:
            for mode in (False, True):
                rel, cos = gradient_error(_setup(split, folder, args.steps, 0), mode)
                print(f"{split[0]}/{split[1]}  {'train' if mode else 'eval '}  {rel:14.3g}  "
                      f"{cos:.6f}")
        print(f"\nheld-out accuracy after {args.steps} steps at fp32, seeds {args.seeds}:")
        for split in SPLITS:
            accs = [emulate(_setup(split, folder, args.steps, s))["eval_accuracy"]
                    for s in seeds]
            print(f"{split[0]}/{split[1]}  " + " ".join(f"{a:.4f}" for a in accs)
                  + f"  mean {statistics.mean(accs):.4f}  min {min(accs):.4f}")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
