"""This CPU measured with torch: matmul throughput per dtype and copy bandwidth
(:func:`measure_figures`), and what the figures depend on (:func:`torch_key`). The device
catalog (:mod:`qsync_opt.costs.devices`, which needs no torch) caches the figures on disk and
makes the ``cpu`` device of them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

__all__ = ["measure_figures", "torch_key", "torch_version"]

MiB = 1024**2


def torch_version() -> str:
    return str(torch.__version__)


def torch_key() -> str:
    """What the figures depend on besides the CPU: torch's version and its thread count."""
    return f"{torch.__version__}|{torch.get_num_threads()}"


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_figures(size: int = 1024, repeats: int = 5) -> dict[str, float]:
    """Matmul throughput per dtype and copy bandwidth, timed with torch on this CPU."""
    gen = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}
    a32 = torch.randn(size, size, generator=gen)
    b32 = torch.randn(size, size, generator=gen)
    for key, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        # fp16 GEMMs have no fast CPU kernel here (hundreds of times slower than bf16):
        # time them on a 256^3 product so the measurement stays short.
        n = size if dtype != torch.float16 else 256
        a, b = a32[:n, :n].to(dtype), b32[:n, :n].to(dtype)
        torch.mm(a, b)  # warm-up (oneDNN primitive creation)
        secs = _median_seconds(partial(torch.mm, a, b), repeats)
        out[key] = 2.0 * n**3 / secs / 1e12
    ai = torch.randint(-127, 128, (size, size), dtype=torch.int8, generator=gen)
    bi = torch.randint(-127, 128, (size, size), dtype=torch.int8, generator=gen)
    torch._int_mm(ai, bi)
    out["int8"] = 2.0 * size**3 / _median_seconds(lambda: torch._int_mm(ai, bi), repeats) / 1e12
    big = torch.empty(64 * MiB // 4)
    dst = torch.empty_like(big)
    dst.copy_(big)
    secs = _median_seconds(lambda: dst.copy_(big), repeats)
    out["copy_gb_per_s"] = 2 * big.numel() * 4 / secs / 1e9  # read + write
    out["threads"] = float(torch.get_num_threads())
    return out
