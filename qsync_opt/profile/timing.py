"""Timing on the local device: the clock (synchronising CUDA), forward and backward
times of a callable, the dispatch floor, casts, the all-reduce and optimizer steps."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from qsync_opt.core.precision import DType
from qsync_opt.costs.devices import get_device
from qsync_opt.costs.roofline import cast_pairs
from qsync_opt.costs.tables import fit_cast
from qsync_opt.documents.schemas import CastCost, CommModel
from qsync_opt.ops import quantize_int8
from qsync_opt.profile.settings import (
    ALLREDUCE_SIZES,
    CAST_SIZES,
)

_TORCH_DTYPE = {DType.fp32: torch.float32, DType.bf16: torch.bfloat16, DType.fp16: torch.float16}


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def time_fwd_bwd(run: Callable[[], Any], timer: Timer, repeats: int, warmup: int
                  ) -> tuple[list[float], list[float]]:
    """Forward and backward wall times (ms) of ``run`` (returns the output), each call fresh."""
    fwd: list[float] = []
    bwd: list[float] = []
    for i in range(warmup + repeats):
        t0 = timer.now()
        out = run()
        t1 = timer.now()
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(o, torch.Tensor) and o.grad_fn is not None]
        if outs:
            grads = [torch.randn_like(o) for o in outs]
            t1 = timer.now()
            torch.autograd.backward(outs, grads)
        t2 = timer.now()
        if i >= warmup:
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3 if outs else 0.0)
    return fwd, bwd


def measure_dispatch_us(device: torch.device | str = "cpu", repeats: int = 200) -> float:
    """Median forward+backward time of a 1-element add, microseconds (the per-op floor)."""
    dev = torch.device(device)
    timer = Timer(dev)
    x = torch.ones(1, device=dev, requires_grad=True)
    y = torch.ones(1, device=dev)
    g = torch.ones(1, device=dev)
    samples = []
    for i in range(repeats + 20):
        t0 = timer.now()
        out = x + y
        out.backward(g)
        t1 = timer.now()
        if i >= 20:
            samples.append((t1 - t0) * 1e6)
        x.grad = None
    return statistics.median(samples)


def measure_casts(dev_name: str, device: torch.device, repeats: int, warmup: int
                   ) -> tuple[list[CastCost], list[str]]:
    timer = Timer(device)
    casts: list[CastCost] = []
    notes: list[str] = []
    for src, dst in cast_pairs(get_device(dev_name)):
        if src not in _TORCH_DTYPE or (dst not in _TORCH_DTYPE and dst != DType.int8):
            continue
        times = []
        for n in CAST_SIZES:
            x = torch.randn(n).to(device, _TORCH_DTYPE[src])
            if dst == DType.int8:
                def run(x: torch.Tensor = x, d: torch.dtype = torch.int8) -> Any:
                    return quantize_int8(x)
            else:
                def run(x: torch.Tensor = x, d: torch.dtype = _TORCH_DTYPE[dst]) -> Any:
                    return x.to(d)
            samples = []
            for i in range(warmup + repeats):
                t0 = timer.now()
                run()
                t1 = timer.now()
                if i >= warmup:
                    samples.append((t1 - t0) * 1e3)
            times.append(statistics.median(samples))
        a, b = fit_cast(CAST_SIZES, times)
        casts.append(CastCost(device=dev_name, src=src, dst=dst, a_ms_per_element=max(a, 0.0),
                              b_ms=max(b, 0.0), source="measured"))
        notes.append(f"{dev_name}: cast {src.value}->{dst.value}: {a * 1e9:.3g} ps/element + "
                     f"{b * 1e3:.3g} us (fit over {len(CAST_SIZES)} sizes "
                     f"{CAST_SIZES[0]}..{CAST_SIZES[-1]})")
    return casts, notes


def measure_allreduce(device: torch.device, repeats: int, warmup: int) -> CommModel | None:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    n = dist.get_world_size()
    timer = Timer(device)
    times = []
    for nbytes in ALLREDUCE_SIZES:
        t = torch.zeros(nbytes // 4, device=device)
        samples = []
        for i in range(warmup + repeats):
            dist.barrier()
            t0 = timer.now()
            dist.all_reduce(t)
            t1 = timer.now()
            if i >= warmup:
                samples.append((t1 - t0) * 1e3)
        times.append(statistics.median(samples))
    a, b = fit_cast(ALLREDUCE_SIZES, times)  # ms per byte, ms
    steps = 2 * (n - 1)
    a = max(a, 1e-15)
    bw = (steps / n) * 1e3 / (a * 1e9)
    return CommModel(world_size=n, bandwidth_gb_per_s=bw, latency_us=max(b, 0.0) / steps * 1e3,
                     bottleneck=f"measured all_reduce on the {dist.get_backend()} process group "
                                f"({n} ranks)", source="measured")


def measure_optimizer(model: nn.Module, device: torch.device, repeats: int, warmup: int
                       ) -> dict[str, float]:
    timer = Timer(device)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    out: dict[str, float] = {}
    makers: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "sgd": lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
        "adam": lambda: torch.optim.Adam(params, lr=1e-3),
    }
    for kind, make in makers.items():
        opt = make()
        samples = []
        with torch.no_grad():
            for i in range(warmup + repeats):
                t0 = timer.now()
                opt.step()
                t1 = timer.now()
                if i >= warmup:
                    samples.append((t1 - t0) * 1e3)
        out[kind] = statistics.median(samples)
    return out
