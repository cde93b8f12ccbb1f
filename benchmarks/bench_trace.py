"""Trace and estimate times on this machine (meta tensors: no real allocation).

Prints, per workload at its default batch: ops, choosable ops, measured saved-activation
bytes, and the median wall time of `trace` (fx path), of the function-mode fallback, and of
`estimate` on v100x16+t4x16, over repeated runs in one process.

    .venv/bin/python benchmarks/bench_trace.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import platform
import re

import torch
from _timing import timed  # benchmarks/ is on sys.path when a script here runs

from qsync_opt import estimate, load_cluster, trace

WORKLOADS = ["resnet50", "vgg16_bn", "bert_base", "vit_b16", "gpt2_small", "gpt2_xl"]


def _median(fn, repeats: int) -> tuple[float, object]:
    return timed(fn, repeats)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cluster = load_cluster("v100x16+t4x16")
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}; median of {args.repeats} runs")
    header = ("model", "batch", "ops", "choosable", "saved GiB", "fx s", "fallback s",
              "ratio", "estimate s")
    print("  ".join(f"{h:>10}" for h in header))
    trace("digits_cnn")  # warm imports
    for name in WORKLOADS:
        t_fx, g = _median(lambda n=name: trace(n, method="fx"), args.repeats)
        t_fm, _ = _median(lambda n=name: trace(n, method="function_mode"), args.repeats)
        t_est, _ = _median(lambda g=g: estimate(g, cluster), args.repeats)
        row = (name, g.batch_size, len(g.ops), len(g.choosable_ops()),
               f"{g.saved_activation_bytes / 2**30:.2f}", f"{t_fx:.3f}", f"{t_fm:.3f}",
               f"{t_fm / t_fx:.2f}", f"{t_est:.3f}")
        print("  ".join(f"{c:>10}" for c in row))
    # This process's own peak (VmHWM); ru_maxrss would include the resident size of the
    # process that started it (it survives fork and exec).
    with open("/proc/self/status") as fh:
        rss = int(re.search(r"^VmHWM:\s+(\d+) kB$", fh.read(), re.M)[1]) / 2**20
    print(f"peak RSS of this process: {rss:.2f} GiB (gpt2_xl alone has 6.2 GB of FP32 weights)")


if __name__ == "__main__":
    main()
