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
standalone/array ratios (``Choice.gain``) is at least ``1 + ARRAY_MARGIN`` and the array
lost at most a quarter of the pairs (the lower quartile of the ratios at least 1): the
standalone models are the one-by-one code itself, so taking them wrongly loses at most the
margin, while taking a losing array wrongly loses all its deficit (a 3-pair measurement once
took a ResNet-18 array 4.6% ahead at start-up that then ran 0.78x the models one by one; this
machine's speed moved 15-25% between rounds that day). Where the first ``reps`` pairs do not
all fall on one side of the margin (some above ``1 + ARRAY_MARGIN``, some under it), more
pairs are timed, up to ``MAX_PAIRS_FACTOR * reps``, before the rule is read: a near tie is
where a few noisy pairs decide wrongly (a 3-pair x1.138 once took a one-model ResNet-18
array that then ran 0.96x). A one-model array is never measured: with ``B = 1`` there is
nothing to fuse, and the array runs the same kernels as the model (at best as fast), so the
model runs standalone. (Standalone models run fp32: under a plan with lower precisions they
are not a candidate, and the array runs at every ``B``.)

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
from torch import Tensor, nn

from qsync_opt.hfta.functional import FuncArray
from qsync_opt.hfta.fused_array import FusedArray
from qsync_opt.hfta.optim import FusedAdamW, FusedSGD

__all__ = ["ARRAY_MARGIN", "MAX_PAIRS_FACTOR", "Choice", "decide", "measure_choice", "near_tie",
           "sync", "time_pairs", "time_step"]

ARRAY_MARGIN = 0.05  # the array must beat the standalone models by this much to be taken
MAX_PAIRS_FACTOR = 3  # a near tie is timed again, up to this many times the first pairs


@dataclass
class Choice:
    ops: dict[str, dict[str, Any]] = field(default_factory=dict)
    array_ms: float = float("nan")
    separate_ms: float = float("nan")
    separate: bool = False
    threads: int = 1
    gain: float = float("nan")  # median of the pairs' standalone/array step-time ratios
    ratios: list[float] = field(default_factory=list)  # every pair's standalone/array ratio
    reason: str = ""  # why the standalone models were taken without timing (B = 1)

    def summary(self) -> str:
        fused = sum(1 for v in self.ops.values() if v["mode"] == "fused")
        if self.reason:
            return f"standalone: {self.reason}"
        if self.separate:
            return (f"standalone: the models one by one ({self.separate_ms:.2f} ms a step) "
                    f"against the array ({self.array_ms:.2f} ms, {fused} of {len(self.ops)} ops "
                    f"fused; gain x{self.gain:.3f} over {len(self.ratios)} pairs, lower quartile "
                    f"x{_quartile(self.ratios):.3f}: under the {ARRAY_MARGIN:.0%} margin or "
                    f"the array lost more than a quarter of the pairs)")
        return (f"array: {fused} of {len(self.ops)} ops fused, {self.array_ms:.2f} ms a step "
                f"(standalone {self.separate_ms:.2f} ms; gain x{self.gain:.3f} over "
                f"{len(self.ratios)} pairs)")

    def to_json(self) -> dict[str, Any]:
        return {"ops": self.ops, "array_ms": self.array_ms, "separate_ms": self.separate_ms,
                "separate": self.separate, "threads": self.threads, "gain": self.gain,
                "ratios": [round(r, 4) for r in self.ratios], "reason": self.reason,
                "margin": ARRAY_MARGIN}


def _quartile(xs: Sequence[float]) -> float:
    """The lower quartile of ``xs`` (nan for none)."""
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=4, method="inclusive")[0]


def decide(ratios: Sequence[float]) -> bool:
    """Whether the array is taken on these pairs' standalone/array step-time ratios: their
    median at least ``1 + ARRAY_MARGIN`` and their lower quartile at least 1."""
    return (bool(ratios) and statistics.median(ratios) >= 1 + ARRAY_MARGIN
            and _quartile(ratios) >= 1.0)


def near_tie(ratios: Sequence[float]) -> bool:
    """Whether the pairs fall on both sides of ``1 + ARRAY_MARGIN`` (more pairs are timed)."""
    return min(ratios) < 1 + ARRAY_MARGIN <= max(ratios)


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
               device: torch.device | None = None, first: int = 0
               ) -> tuple[list[float], list[float]]:
    """``reps`` pairs of timings (ms) of ``step`` and ``other`` (one warm-up of each first,
    where ``first``, the number of pairs already timed, is 0), the order alternating from
    pair to pair (``step`` first in the even ones, counted from ``first``) so neither always
    runs in the state the other leaves. On a CUDA ``device`` each timing waits for the
    device's queue before it starts and before it stops."""
    if first == 0:
        step()
        other()
    a: list[float] = []
    b: list[float] = []
    for i in range(reps):
        if (first + i) % 2 == 0:
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
        def pre(m: nn.Module, args: tuple[Tensor, ...], k: str = k) -> None:
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


def _time_op(array: FusedArray, k: str, x0: Tensor, reps: int,
             device: torch.device | None) -> tuple[float, float]:
    """Medians (ms) of op ``k``'s forward and backward on ``x0``, fused and serial (its
    own function, so nothing of ``x0`` outlives the timing)."""
    def run(serial: bool) -> None:
        x = x0.clone().requires_grad_(x0.is_floating_point())
        array.call_op(k, x, "serial" if serial else "fused").sum().backward()

    return time_step(lambda: run(False), lambda: run(True), reps, device)


def measure_choice(array: FusedArray | FuncArray, inputs: Sequence[Tensor],
                   loss: Callable[[Tensor], Tensor],
                   loss_one: Callable[[Tensor, int], Tensor] | None = None, *,
                   reps: int = 5, optimizer: str = "sgd") -> Choice:
    """Set every op's mode from measurement, then time the array's whole step against the
    standalone models' (module docstring) and record in ``Choice.separate`` whether the
    standalone models are taken (always, without timing, for a one-model array). ``loss``:
    the array's loss of its ``[B, N, ...]`` output; ``loss_one(out, b)``: model ``b``'s loss of its own output (None: no standalone
    candidate, e.g. under lower precisions). The array's parameters, buffers and gradients
    are as they were after; the timing steps run throwaway optimizers (``optimizer``: sgd or
    adamw, fused for the array, torch's for the standalone models)."""
    choice = Choice(threads=torch.get_num_threads())
    # the torch.func route has no per-op modes
    fused_array = array if isinstance(array, FusedArray) else None
    if loss_one is not None and array.B == 1:
        choice.separate = True
        choice.reason = ("one model, nothing to fuse: a one-model array runs the model's own "
                         "kernels, at best as fast (not timed)")
        return choice
    state = {k: v.detach().clone() for k, v in array.state_dict().items()}
    device = next((x.device for x in inputs if isinstance(x, Tensor)), None)
    replicated = array.input_mode == "replicated"
    if fused_array is not None:
        fused_array.separate = False
    # Every op's input, from one forward: about the activations of a step, so each is let go
    # once its op is timed, and none is held while the whole steps run (holding them all
    # through the whole-step timing had a B=8 batch-256 ResNet-18 measurement killed for
    # memory at 24 GB, about twice what the array's step needs).
    if fused_array is not None:
        seen = _capture(fused_array, inputs)
        for k in list(fused_array.fused):
            f, s = _time_op(fused_array, k, seen.pop(k), reps, device)
            mode = "fused" if f <= s else "serial"
            fused_array.modes[k] = mode
            choice.ops[k.replace("__", ".")] = {"fused_ms": round(f, 4),
                                                "serial_ms": round(s, 4), "mode": mode}
        del seen
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
        while near_tie(ratios := [s / t for s, t in zip(sep, a, strict=True)]) \
                and len(a) < MAX_PAIRS_FACTOR * reps:
            a2, sep2 = time_pairs(array_step, standalone_step, reps, device, first=len(a))
            a, sep = a + a2, sep + sep2
        choice.array_ms, choice.separate_ms = statistics.median(a), statistics.median(sep)
        choice.ratios = ratios
        choice.gain = statistics.median(ratios)
        choice.separate = not decide(ratios)
    else:
        choice.array_ms = statistics.median(_median_ms(array_step, reps, device))
    array.load_state_dict(state)
    for p in array.parameters():
        p.grad = None
    return choice
