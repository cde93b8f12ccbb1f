"""Low-precision op speed on this CPU, side by side in one run.

Linear layers of square size S (batch of S rows, S inputs, S outputs): forward and
forward+backward for fp32 nn.Linear, bf16 nn.Linear (weights and input in bf16, the autocast
way), and qsync's int8_linear (stochastic rounding; 16-bit bf16 backward; and int8_full).
Then the quantize / rescale kernels: the compiled C++ kernels against their Python
references. Medians over repeats after warm-up; ratios are fp32 time over the other's time
(>1 means faster than fp32).

    .venv/bin/python benchmarks/bench_ops.py [--sizes 512 1024 2048 4096] [--repeats 7]
"""

from __future__ import annotations

import argparse

import torch
from _timing import timed  # benchmarks/ is on sys.path when a script here runs
from torch import nn

import qsync_opt.ops as ops
from qsync_opt.ops import reference as ref


def _median_ms(fn, repeats: int) -> float:
    return timed(fn, repeats, warmup=True)[0] * 1e3


def bench_linear(size: int, repeats: int) -> list[tuple[str, float, float]]:
    torch.manual_seed(0)
    x = torch.randn(size, size)
    lin = nn.Linear(size, size)
    lin_bf = nn.Linear(size, size).to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    w, b = lin.weight, lin.bias

    def fwd_bwd(f, inp):
        def run():
            xi = inp.detach().requires_grad_()
            f(xi).sum().backward()
        return run

    rows = []
    with torch.no_grad():
        f32 = _median_ms(lambda: lin(x), repeats)
        bf = _median_ms(lambda: lin_bf(xb), repeats)
        i8 = _median_ms(lambda: ops.int8_linear(x, w, b), repeats)
    rows.append(("forward", f32, bf, i8))
    f32 = _median_ms(fwd_bwd(lin, x), repeats)
    bf = _median_ms(fwd_bwd(lin_bf, xb), repeats)
    i8 = _median_ms(fwd_bwd(lambda t: ops.int8_linear(t, w, b), x), repeats)
    i8f = _median_ms(fwd_bwd(lambda t: ops.int8_linear(t, w, b, int8_backward=True), x), repeats)
    rows.append(("fwd+bwd", f32, bf, i8, i8f))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"implementations: {ops.available()}")
    print("\nlinear S x S (ms, median); x = fp32 time / this time")
    print(f"{'S':>5} {'pass':>8} {'fp32':>9} {'bf16':>9} {'int8':>9} {'int8_full':>10}"
          f" {'bf16 x':>7} {'int8 x':>7} {'full x':>7}")
    for size in args.sizes:
        reps = args.repeats if size <= 2048 else max(3, args.repeats // 2)
        for row in bench_linear(size, reps):
            name, f32, bf, i8 = row[:4]
            full = row[4] if len(row) > 4 else None
            print(f"{size:>5} {name:>8} {f32:>9.2f} {bf:>9.2f} {i8:>9.2f} "
                  f"{(f'{full:.2f}' if full else '-'):>10} {f32 / bf:>7.2f} {f32 / i8:>7.2f} "
                  f"{(f'{f32 / full:.2f}' if full else '-'):>7}")
    print("\nkernels on 4M elements (ms, median): compiled C++ vs Python reference")
    x = torch.randn(2048, 2048)
    inv = 127.0 / ref.channel_amax(x, False)
    acc = torch.randint(-2**20, 2**20, (2048, 2048), dtype=torch.int32)
    sw = torch.rand(2048)
    bias = torch.randn(2048)
    sx = torch.tensor(0.01)
    cases = [
        ("quantize SR fp32", lambda: torch.ops.qsync_cpu.quantize_int8(x, inv, True, 1),
         lambda: ref.quantize_int8(x, inv, True, 1)),
        ("quantize RTN fp32", lambda: torch.ops.qsync_cpu.quantize_int8(x, inv, False, 1),
         lambda: ref.quantize_int8(x, inv, False, 1)),
        ("rescale+bias fp32", lambda: torch.ops.qsync_cpu.rescale_int32(acc, sx, sw, bias,
                                                                        torch.float32),
         lambda: ref.rescale_int32(acc, sx, sw, bias, torch.float32)),
        ("rescale+bias bf16", lambda: torch.ops.qsync_cpu.rescale_int32(acc, sx, sw, bias,
                                                                        torch.bfloat16),
         lambda: ref.rescale_int32(acc, sx, sw, bias, torch.bfloat16)),
    ]
    if not ops.load_cpu()[0]:
        print("C++ kernels unavailable:", ops.load_cpu()[1])
        return
    print(f"{'kernel':>20} {'C++':>8} {'reference':>10} {'speed-up':>9}")
    for name, fast, slow in cases:
        a = _median_ms(fast, args.repeats)
        b = _median_ms(slow, args.repeats)
        print(f"{name:>20} {a:>8.2f} {b:>10.2f} {b / a:>8.1f}x")


if __name__ == "__main__":
    main()
