"""GPU timings of the qsync CUDA kernels against the torch ops they replace.

Per size (square [size, size] tensors): int8 quantization (round-to-nearest and stochastic)
against the equivalent chain of torch ops, the int32 GEMM rescale + bias + cast against
``acc.float() * (SX * sw) + bias``, and ``torch._int_mm`` against fp16 ``torch.mm``. Each
time is the median of ``--repeats`` calls timed with CUDA events after a warm-up.

    python benchmarks/bench_cuda.py [--sizes 2048 4096] [--repeats 50]

Needs a CUDA torch and the kernels (built on first use, or ``QSYNC_CUDA_LIB``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch
from qsync_opt.cuda.kernels import load, load_error

SX = 0.01  # the activation scale of the rescale rows


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _report_equal(what: str, size: int, ours: torch.Tensor, ref: torch.Tensor) -> None:
    if torch.equal(ours, ref):
        print(f"{what} at {size}: identical to the torch ops")
    else:
        n = int((ours != ref).sum())
        print(f"WARNING {what} at {size}: {n} elements differ from the torch ops")


def run(sizes: list[int], repeats: int) -> list[tuple[str, int, float, float]]:
    k = load()
    if k is None:
        raise SystemExit(f"qsync CUDA kernels unavailable: {load_error()}")
    rows: list[tuple[str, int, float, float]] = []
    dev = torch.device("cuda")
    for size in sizes:
        g = torch.Generator(device=dev).manual_seed(size)
        x = torch.randn(size, size, device=dev, dtype=torch.float16, generator=g)
        amax = x.float().abs().amax().reshape(1)
        inv = (127.0 / amax).to(torch.float32)
        n = x.numel()

        def torch_rtn(x=x, inv=inv):
            return torch.clamp(torch.round(x * inv), -127, 127).to(torch.int8)

        def torch_sr(x=x, inv=inv):
            y = x * inv
            return torch.clamp(torch.floor(y + torch.rand_like(y)), -127, 127).to(torch.int8)

        ours_q = k.quantize_int8(x, inv, n, False, 0)
        _report_equal("quantize RTN", size, ours_q, torch_rtn())
        rows.append((
            "quantize int8 RTN (fp16 in)", size,
            median_ms(lambda x=x, inv=inv, n=n: k.quantize_int8(x, inv, n, False, 0), repeats),
            median_ms(torch_rtn, repeats),
        ))
        rows.append((
            "quantize int8 SR (fp16 in)", size,
            median_ms(lambda x=x, inv=inv, n=n: k.quantize_int8(x, inv, n, True, 7), repeats),
            median_ms(torch_sr, repeats),
        ))

        acc = torch.randint(-(2**24), 2**24, (size, size), device=dev, dtype=torch.int32)
        sw = torch.rand(size, device=dev) * 1e-3
        bias = torch.randn(size, device=dev)
        def torch_rescale(acc=acc, sw=sw, bias=bias):
            return acc.float() * (SX * sw) + bias

        ours_r = k.rescale_int32(acc, SX, sw, bias, torch.float32)
        _report_equal("rescale fp32", size, ours_r, torch_rescale())
        rows.append((
            "rescale int32->fp32 (+bias)", size,
            median_ms(lambda a=acc, s=sw, b=bias: k.rescale_int32(a, SX, s, b, torch.float32),
                      repeats),
            median_ms(torch_rescale, repeats),
        ))
        rows.append((
            "rescale int32->fp16 (+bias)", size,
            median_ms(lambda a=acc, s=sw, b=bias: k.rescale_int32(a, SX, s, b, torch.float16),
                      repeats),
            median_ms(lambda f=torch_rescale: f().half(), repeats),
        ))

        a8 = torch.randint(-127, 128, (size, size), device=dev, dtype=torch.int8)
        b8 = torch.randint(-127, 128, (size, size), device=dev, dtype=torch.int8)
        a16 = torch.randn(size, size, device=dev, dtype=torch.float16)
        b16 = torch.randn(size, size, device=dev, dtype=torch.float16)
        rows.append((
            "GEMM: torch._int_mm vs fp16 mm", size,
            median_ms(lambda a=a8, b=b8: torch._int_mm(a, b), repeats),
            median_ms(lambda a=a16, b=b16: torch.mm(a, b), repeats),
        ))
        del x, acc, a8, b8, a16, b16
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cuda: torch has no CUDA device", file=sys.stderr)
        return 1
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__} "
          f"(CUDA {torch.version.cuda}); median of {args.repeats} after warm-up")
    rows = run(args.sizes, args.repeats)
    head = f"{'operation':<32} {'size':>5} {'ours ms':>9} {'torch ms':>9} {'torch/ours':>10}"
    print(head)
    print("-" * len(head))
    for name, size, ours, ref in rows:
        print(f"{name:<32} {size:>5} {ours:>9.4f} {ref:>9.4f} {ref / ours:>9.2f}x")
    print("(GEMM row: 'ours' is torch._int_mm, 'torch' is fp16 torch.mm)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
