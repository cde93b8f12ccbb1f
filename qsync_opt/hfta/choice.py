"""Fuse or not, per operator, from measurement on this machine at start-up.

On a CPU a grouped convolution can be slower than ``B`` plain ones (a probe found 8 fused
digits_cnn 1.66x faster than serial at batch 4, 0.74x at batch 64, one thread), and the ratio
moves with threads and load. So :func:`measure_choice` times, for every op with parameters,
its forward and backward in the array's context (the op's real input, captured in one
forward of a real batch, in the op's layout) both ways: ``fused`` (one kernel for all
``B``) and ``serial`` (the input split per model, ``B`` calls on the slices, the outputs
joined: the splitting and joining are inside the timing). Runs interleave (fused, serial,
fused, ...), the median of ``reps`` each is kept, and the faster mode is set. (The
attention matmuls hold no parameters: they always run as one batched call.)

Then the array's whole step under those modes (forward, backward, the fused optimizer) is
timed against the standalone models' (each model exported to its own module with its own
torch optimizer, stepped one after another: what running the jobs one by one costs), and
``Choice.separate`` says whether the standalone models won; the trainer then trains them
as standalone models, so a sweep is never slower than the jobs one by one by more than the
timing's noise. The two are timed in pairs, the order alternating (array first, then
standalone first, ...), and the array is taken only when the median of the pairs'
standalone/array ratios (``Choice.gain``) is at least ``1 + ARRAY_MARGIN``: the standalone
models are the one-by-one code itself, so taking them wrongly loses at most the margin,
while taking a losing array wrongly loses all its deficit (a 3-pair measurement once took a
ResNet-18 array 4.6% ahead at start-up that then ran 0.78x the models one by one; this
machine's speed moved 15-25% between rounds that day). (Standalone models run fp32: under a
plan with lower precisions they are not a candidate.)

The choice is recorded (:class:`Choice`: every op's two medians and the mode taken, the
array's and separate's step medians) and goes into the sweep's JSON.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .convert import FusedArray

__all__ = ["ARRAY_MARGIN", "Choice", "measure_choice", "sync", "time_pairs", "time_step"]

ARRAY_MARGIN = 0.05  # the array must beat the standalone models by this much to be taken


@dataclass
class Choice:
    ops: dict[str, dict[str, Any]] = field(default_factory=dict)
    array_ms: float = float("nan")
    separate_ms: float = float("nan")
    separate: bool = False
    threads: int = 1
    gain: float = float("nan")  # median of the pairs' standalone/array step-time ratios

    def summary(self) -> str:
        fused = sum(1 for v in self.ops.values() if v["mode"] == "fused")
        if self.separate:
            return (f"standalone: the models one by one ({self.separate_ms:.2f} ms a step) "
                    f"against the array ({self.array_ms:.2f} ms, {fused} of {len(self.ops)} ops "
                    f"fused; gain x{self.gain:.3f}, under the {ARRAY_MARGIN:.0%} margin)")
        return (f"array: {fused} of {len(self.ops)} ops fused, {self.array_ms:.2f} ms a step "
                f"(standalone {self.separate_ms:.2f} ms; gain x{self.gain:.3f})")

    def to_json(self) -> dict[str, Any]:
        return {"ops": self.ops, "array_ms": self.array_ms, "separate_ms": self.separate_ms,
                "separate": self.separate, "threads": self.threads, "gain": self.gain,
                "margin": ARRAY_MARGIN}


def sync(device: torch.device | None) -> None:
    """Wait for the work queued on ``device``: a CUDA kernel runs after its launch returns,
    so a wall-clock timing that does not wait measures the launches, not the work."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn: Callable[[], Any], reps: int, device: torch.device | None = None
               ) -> list[float]:
    out = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        out.append((time.perf_counter() - t) * 1000)
    return out


def time_pairs(step: Callable[[], Any], other: Callable[[], Any], reps: int,
               device: torch.device | None = None) -> tuple[list[float], list[float]]:
    """``reps`` pairs of timings (ms) of ``step`` and ``other`` (one warm-up of each first),
    the order alternating from pair to pair (``step`` first in the even ones) so neither
    always runs in the state the other leaves. On a CUDA ``device`` each timing waits for
    the device's queue before it starts and before it stops."""
    step()
    other()
    a: list[float] = []
    b: list[float] = []
    for i in range(reps):
        if i % 2 == 0:
            a += _median_ms(step, 1, device)
            b += _median_ms(other, 1, device)
        else:
            b += _median_ms(other, 1, device)
            a += _median_ms(step, 1, device)
    return a, b


def time_step(step: Callable[[], Any], other: Callable[[], Any], reps: int,
              device: torch.device | None = None) -> tuple[float, float]:
    """Medians (ms) of ``step`` and ``other`` over :func:`time_pairs`."""
    a, b = time_pairs(step, other, reps, device)
    return statistics.median(a), statistics.median(b)


def _capture(array: FusedArray, inputs: Sequence[Tensor]) -> dict[str, Tensor]:
    """Every fused op's input in one forward of ``inputs`` (every op fused for it: a serial
    op does not call its module)."""
    seen: dict[str, Tensor] = {}
    hooks = []
    modes = dict(array.modes)
    for k, mod in array.fused.items():
        def pre(m: Any, args: Any, k: str = k) -> None:
            seen.setdefault(k, args[0].detach())
        hooks.append(mod.register_forward_pre_hook(pre))
        array.modes[k] = "fused"
    try:
        with torch.no_grad():
            array(*inputs)
    finally:
        for h in hooks:
            h.remove()
        array.modes.update(modes)
    return seen


def measure_choice(array: Any, inputs: Sequence[Tensor],
                   loss: Callable[[Tensor], Tensor],
                   loss_one: Callable[[Tensor, int], Tensor] | None = None, *,
                   reps: int = 5, optimizer: str = "sgd") -> Choice:
    """Set every op's mode from measurement, then time the array's whole step against the
    standalone models' (module docstring) and record which is faster in
    ``Choice.standalone``. ``loss``: the array's loss of its ``[B, N, ...]`` output;
    ``loss_one(out, b)``: model ``b``'s loss of its own output (None: no standalone
    candidate, e.g. under lower precisions). The array's parameters, buffers and gradients
    are as they were after; the timing steps run throwaway optimizers (``optimizer``: sgd or
    adamw, fused for the array, torch's for the standalone models)."""
    from .optim import FusedAdamW, FusedSGD

    state = {k: v.detach().clone() for k, v in array.state_dict().items()}
    device = next((x.device for x in inputs if isinstance(x, Tensor)), None)
    choice = Choice(threads=torch.get_num_threads())
    replicated = array.input_mode == "replicated"
    per_op = isinstance(array, FusedArray)  # the torch.func route has no per-op modes
    if per_op:
        array.separate = False
    seen = _capture(array, inputs) if per_op else {}
    for k in (list(array.fused) if per_op else []):
        x0 = seen[k]

        def run(serial: bool, k: str = k, x0: Tensor = x0) -> None:
            x = x0.clone().requires_grad_(x0.is_floating_point())
            array.call_op(k, x, "serial" if serial else "fused").sum().backward()

        f, s = time_step(lambda: run(False), lambda: run(True), reps, device)
        mode = "fused" if f <= s else "serial"
        array.modes[k] = mode
        choice.ops[k.replace("__", ".")] = {"fused_ms": round(f, 4), "serial_ms": round(s, 4),
                                            "mode": mode}
    params = list(array.parameters())
    fopt: Any = (FusedAdamW(params, array.B, lr=1e-3) if optimizer == "adamw"
                 else FusedSGD(params, array.B, lr=0.01, momentum=0.9))

    def array_step() -> None:
        fopt.zero_grad(set_to_none=True)
        loss(array(*inputs)).backward()
        fopt.step()

    if loss_one is not None:
        models = [array.export(b).train() for b in range(array.B)]
        opts: list[Any] = [torch.optim.AdamW(m.parameters(), lr=1e-3) if optimizer == "adamw"
                           else torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
                           for m in models]

        def standalone_step() -> None:
            for b, (m, o) in enumerate(zip(models, opts, strict=True)):
                o.zero_grad(set_to_none=True)
                xs = tuple(x if replicated else x[b] for x in inputs)
                loss_one(m(*xs), b).backward()
                o.step()

        a, sep = time_pairs(array_step, standalone_step, reps, device)
        choice.array_ms, choice.separate_ms = statistics.median(a), statistics.median(sep)
        choice.gain = statistics.median(s / t for s, t in zip(sep, a, strict=True))
        choice.separate = choice.gain < 1 + ARRAY_MARGIN
    else:
        choice.array_ms = statistics.median(_median_ms(array_step, reps, device))
    array.load_state_dict(state)
    for p in array.parameters():
        p.grad = None
    return choice
