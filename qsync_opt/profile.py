"""The profiler: a CostTable measured on the local device, in the estimator's exact shape.

``qsync-opt profile --model M --device cpu|cuda --out costs.json`` traces the workload at the
batch, builds the estimator's table for one local device (``DEVICEx1``) as the template of
keys, and replaces what it can measure:

* **Ops**, each *in isolation*: the op's module (or function, rebuilt from the op's kind and
  target) on random inputs of its traced shapes, a random output gradient pushed back with
  ``torch.autograd.backward``; choosable ops swapped to each precision the device runs with
  :func:`~qsync_opt.runtime.layers.apply_precisions`; pass-through and promoting ops fed
  inputs of each activation dtype. Warm-up calls, then the median of ``repeats``; the spread
  (interquartile range over median) goes to :attr:`Profile.spread` and a summary to the
  table's notes. Ops with identical signatures (module type and settings, shapes, precision:
  the repeated blocks of a transformer) are measured once and shared (noted). An op that
  cannot be rebuilt keeps the estimator's value with ``source="estimated"``.
* **Dispatch overhead**: a 1-element add forward and backward, measured and recorded in the
  notes and as ``efficiencies.launch_overhead_us`` (not assumed).
* **Casts**: ``x.to(dtype)`` (and :func:`qsync_opt.ops.quantize_int8` for int8) at several
  sizes, ``a * numel + b`` fitted by least squares (:func:`fit_cast`).
* **All-reduce**: alpha-beta fitted on the process group when ``torch.distributed`` is
  initialised with more than one rank; otherwise the estimator's comm model is kept (noted).
* **Optimizer**: one SGD and one Adam step over the model's parameters, measured.

:func:`merge` joins profiles of several machines (one per device type) into one table.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import operator
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import __version__
from .cluster import parse_shorthand
from .costs import cast_pairs, estimate, gradient_buckets, op_precisions
from .devices import get_device, known_device_names
from .errors import QsyncInputError
from .precision import DType, Precision
from .schemas import CastCost, CommModel, CostTable, ModelGraph, OpCost, OpKind, OpNode, OpRole

log = logging.getLogger(__name__)

DEFAULT_REPEATS = 10
DEFAULT_WARMUP = 3
CAST_SIZES = (1 << 10, 1 << 13, 1 << 16, 1 << 18, 1 << 20)
ALLREDUCE_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 21)

_VIEWS = {"view", "reshape", "flatten", "unflatten", "transpose", "permute", "getitem", "narrow",
          "split", "chunk", "squeeze", "unsqueeze", "expand", "t"}
_TORCH_DTYPE = {DType.fp32: torch.float32, DType.bf16: torch.bfloat16, DType.fp16: torch.float16}
_PASS_DTYPE = {Precision.fp32: torch.float32, Precision.tf32: torch.float32,
               Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}


@dataclass
class Profile:
    """A measured table and what does not fit its schema: the spread of every entry."""

    table: CostTable
    #: (op, precision) -> (fwd IQR/median, bwd IQR/median) of the measured entries.
    spread: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)
    dispatch_us: float = 0.0
    seconds: float = 0.0
    #: In-context method: precision -> (forward, backward) ms of the uniform step, median
    #: without hooks (what the table reproduces for that uniform plan).
    uniform_ms: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: In-context method: every module -> precision assignment that was run (all uniform).
    assignments_run: list[dict[str, str]] = field(default_factory=list)


# ----------------------------------------------------------------------------- fitting


def fit_cast(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``times ~ a * sizes + b``; returns ``(a, b)`` (units of ``times``).

    Neither coefficient is clamped here (the caller clamps to the schema's >= 0).
    """
    n = len(sizes)
    if n != len(times) or n < 2:
        raise QsyncInputError("fit_cast: need at least two (size, time) pairs of equal length")
    mx = sum(sizes) / n
    my = sum(times) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    if sxx == 0:
        raise QsyncInputError("fit_cast: sizes must not all be equal")
    sxy = sum((x - mx) * (y - my) for x, y in zip(sizes, times, strict=True))
    a = sxy / sxx
    return a, my - a * mx


def _median_iqr(samples: Sequence[float]) -> tuple[float, float]:
    """(median, interquartile range / median) of ``samples``."""
    med = statistics.median(samples)
    if len(samples) >= 4:
        q = statistics.quantiles(samples, n=4)
        iqr = q[2] - q[0]
    else:
        iqr = max(samples) - min(samples)
    return med, (iqr / med if med > 0 else 0.0)


# ----------------------------------------------------------------------------- timing


class _Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def _time_fwd_bwd(run: Callable[[], Any], timer: _Timer, repeats: int, warmup: int
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
    timer = _Timer(dev)
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


# ----------------------------------------------------------------------------- ops


def _resolve_function(target: str) -> Callable[..., Any] | None:
    head, _, name = target.rpartition(".")
    roots: dict[str, Any] = {"operator": operator, "torch": torch, "torch.nn.functional": F,
                             "Tensor": torch.Tensor, "torch.Tensor": torch.Tensor}
    root = roots.get(head)
    fn = getattr(root, name, None) if root is not None else None
    return fn if callable(fn) else None


def _edge_dtypes(graph: ModelGraph) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for e in graph.edges:
        out.setdefault(e.dst, []).append(e.dtype)
    return out


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 1


class _OpBuilder:
    """Rebuilds one op as ``(callable, input factory)``, or says why it cannot."""

    def __init__(self, model: nn.Module, graph: ModelGraph, device: torch.device) -> None:
        self.modules = dict(model.named_modules())
        self.edge_dtypes = _edge_dtypes(graph)
        self.device = device
        self.gen = torch.Generator(device="cpu").manual_seed(0)

    def _float(self, shape: Sequence[int], dtype: torch.dtype, grad: bool) -> torch.Tensor:
        t = torch.randn(list(shape), generator=self.gen).to(self.device, dtype)
        return t.requires_grad_(grad)

    def _index(self, shape: Sequence[int], high: int) -> torch.Tensor:
        return torch.randint(0, max(high, 1), list(shape), generator=self.gen).to(self.device)

    def build(self, op: OpNode, p: Precision
              ) -> tuple[Callable[[], Any], str] | tuple[None, str]:
        """``(run, signature)`` or ``(None, reason)``."""
        dtype = _PASS_DTYPE.get(p, torch.float32) if op.role != OpRole.choosable else torch.float32
        grad = op.needs_input_grad
        mod = self.modules.get(op.name)
        if mod is not None and not isinstance(mod, (nn.Sequential, nn.ModuleList)) and \
                op.name != "":
            return self._module(op, p, mod, dtype, grad)
        return self._function(op, dtype, grad)

    def _module(self, op: OpNode, p: Precision, mod: nn.Module, dtype: torch.dtype, grad: bool
                ) -> tuple[Callable[[], Any], str] | tuple[None, str]:
        m = copy.deepcopy(mod).to(self.device).train()
        if op.role == OpRole.choosable:
            from .runtime.layers import apply_precisions

            holder = nn.Module()
            holder.add_module("m", m)
            apply_precisions(holder, {"m": p})
            m = holder.m
        if isinstance(m, nn.Embedding):
            inputs = [self._index(s, m.num_embeddings) for s in op.input_shapes]
        elif isinstance(m, (nn.CrossEntropyLoss, nn.NLLLoss)) and len(op.input_shapes) == 2:
            logits = self._float(op.input_shapes[0], dtype, grad)
            classes = op.input_shapes[0][1] if len(op.input_shapes[0]) > 1 else 2
            inputs = [logits, self._index(op.input_shapes[1], classes)]
        else:
            inputs = [self._float(s, dtype, grad) for s in op.input_shapes]
        sig = f"{m!r}|{type(m).__name__}|{op.input_shapes}|{op.needs_input_grad}|{p.value}"
        return (lambda: m(*inputs)), sig

    def _function(self, op: OpNode, dtype: torch.dtype, grad: bool
                  ) -> tuple[Callable[[], Any], str] | tuple[None, str]:
        shapes = op.input_shapes
        sig = f"{op.kind.value}|{op.target}|{shapes}|{op.output_shapes}|{grad}|{dtype}"
        name = op.target.rpartition(".")[2]
        outs = op.output_shapes
        if (op.kind == OpKind.reshape or name in _VIEWS) and outs:
            # A view of the first input (a buffer when the op has none) with the traced
            # output shapes: reshapes, splits, getitem, narrow, transpose and unflatten all
            # cost a dispatch and a view here (a copy a later op forces is not seen).
            n_outs = [_numel(o) for o in outs]
            x = self._float(shapes[0] if shapes else [sum(n_outs)], dtype, grad and bool(shapes))
            if _numel(x.shape) >= sum(n_outs) and len(outs) > 1:
                return (lambda: tuple(t.view(o) for t, o in zip(
                    x.reshape(-1)[:sum(n_outs)].split(n_outs), outs, strict=True))), sig
            if _numel(x.shape) >= n_outs[0] and len(outs) == 1:
                return (lambda: x.reshape(-1)[:n_outs[0]].view(outs[0])), sig
        fn = _resolve_function(op.target)
        if fn is None or not shapes:
            return None, f"cannot rebuild {op.target} with inputs {shapes}"
        dtypes = self.edge_dtypes.get(op.name, [])
        if op.kind == OpKind.loss and "cross_entropy" in name and len(shapes) == 2:
            logits = self._float(shapes[0], dtype, grad)
            classes = shapes[0][1] if len(shapes[0]) > 1 else 2
            tgt = self._index(shapes[1], classes)
            return (lambda: fn(logits, tgt)), sig
        if name == "masked_fill" and len(shapes) == 2:
            x = self._float(shapes[0], dtype, grad)
            mask = torch.rand(shapes[1], generator=self.gen).to(self.device) > 0.5
            return (lambda: fn(x, mask, -1e4)), sig
        if dtypes and all(d == "bool" for d in dtypes) and len(dtypes) == len(shapes):
            bs = [torch.rand(sh, generator=self.gen).to(self.device) > 0.5 for sh in shapes]
            return (lambda: fn(*bs)), sig
        if any(d not in ("float32", "float16", "bfloat16", "float64") for d in dtypes):
            return None, f"{op.target} takes non-float inputs"
        xs = [self._float(s, dtype, grad) for s in shapes]
        if name in ("softmax", "log_softmax"):
            return (lambda: fn(xs[0], -1)), sig
        if len(xs) == 1 and name in ("add", "mul", "sub", "truediv", "div", "iadd", "imul"):
            return (lambda: fn(xs[0], 0.5)), sig
        return (lambda: fn(*xs)), sig


def _check_shapes(out: Any, op: OpNode) -> bool:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    shapes = [list(o.shape) for o in outs if isinstance(o, torch.Tensor)]
    return shapes == op.output_shapes


# ----------------------------------------------------------------------------- casts, etc.


def _measure_casts(dev_name: str, device: torch.device, repeats: int, warmup: int
                   ) -> tuple[list[CastCost], list[str]]:
    from .ops import quantize_int8

    timer = _Timer(device)
    casts: list[CastCost] = []
    notes: list[str] = []
    for src, dst in cast_pairs(get_device(dev_name)):
        if src not in _TORCH_DTYPE or (dst not in _TORCH_DTYPE and dst != DType.int8):
            continue
        times = []
        for n in CAST_SIZES:
            x = torch.randn(n).to(device, _TORCH_DTYPE[src])
            if dst == DType.int8:
                def run(x: torch.Tensor = x) -> Any:
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


def _measure_allreduce(device: torch.device, repeats: int, warmup: int) -> CommModel | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    n = dist.get_world_size()
    timer = _Timer(device)
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


def _gloo_rank(rank: int, world: int, init: str, q: Any, fn: Callable[..., Any],
               args: tuple[Any, ...]) -> None:
    import torch.distributed as dist

    from .machine import pin_malloc

    torch.set_num_threads(1)
    pin_malloc()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        out = fn(rank, *args)
        if rank == 0:
            q.put(out)
    finally:
        dist.destroy_process_group()


def spawn_local(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 900) -> Any:
    """Run ``fn(rank, *args)`` in ``world`` spawned processes joined in one gloo group (one
    thread each, malloc pinned); return rank 0's result (picklable; ``fn`` importable)."""
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/store"
        procs = [ctx.Process(target=_gloo_rank, args=(r, world, init, q, fn, args))
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            return q.get(timeout=timeout_s)
        finally:
            for p in procs:
                p.join(timeout=60)


def _comm_json(rank: int, repeats: int, warmup: int) -> str:
    comm = _measure_allreduce(torch.device("cpu"), repeats, warmup)
    return comm.model_dump_json() if comm is not None else ""


def measure_comm_local(world: int = 2, repeats: int = DEFAULT_REPEATS,
                       warmup: int = DEFAULT_WARMUP) -> CommModel:
    """All-reduce alpha-beta of ``world`` gloo processes on this machine (spawned here).

    What ``qsync-opt train --nproc N`` runs on: use it to predict a local multi-process run
    when the profile was taken in one process (whose comm model is the estimator's).
    """
    if world < 2:
        raise QsyncInputError(f"world: expected at least 2 processes, got {world}")
    return CommModel.model_validate_json(
        spawn_local(_comm_json, world, repeats, warmup, timeout_s=300))


def with_comm(table: CostTable, graph: ModelGraph, comm: CommModel) -> CostTable:
    """``table`` with ``comm`` and the gradient buckets recomputed for it."""
    return table.model_copy(update={
        "comm": comm, "buckets": gradient_buckets(graph, comm, table.bucket_cap_bytes),
        "notes": [*table.notes, f"comm: {comm.bottleneck}: {comm.bandwidth_gb_per_s:.3g} GB/s, "
                                f"{comm.latency_us:.3g} us per hop ({comm.source})"]})


def _measure_optimizer(model: nn.Module, device: torch.device, repeats: int, warmup: int
                       ) -> dict[str, float]:
    timer = _Timer(device)
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


def _device_name(device: torch.device, name: str | None) -> str:
    if name:
        get_device(name)
        return name
    if device.type == "cpu":
        return "cpu"
    gpu = torch.cuda.get_device_name(device).lower()
    best, score = None, 0
    for key in known_device_names():
        parts = key.split("_")
        if parts[0] not in gpu:
            continue
        s = 1 + sum(1 for x in parts[1:] if x.replace("gb", "") in gpu)
        if s > score:
            best, score = key, s
    if best is None:
        raise QsyncInputError(f"--device-name: cannot match GPU {gpu!r} to the catalog; give "
                              "its catalog key (qsync-opt devices)")
    return best


def environment(device: torch.device, method: str) -> dict[str, str]:
    """Where and how a profile was measured: the CostTable's ``environment`` of its device."""
    return {"hardware": (torch.cuda.get_device_name(device) if device.type == "cuda"
                         else (platform.processor() or platform.machine())),
            "torch": torch.__version__,
            "cuda": (torch.version.cuda or "") if device.type == "cuda" else "cpu",
            "threads": str(torch.get_num_threads()), "qsync_opt": __version__,
            "method": method}


def environment_note(dev_name: str, device: torch.device) -> str:
    cuda = torch.version.cuda if device.type == "cuda" else "cpu"
    hw = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        platform.processor() or platform.machine())
    return (f"{dev_name}: measured on {hw} with torch {torch.__version__}, CUDA {cuda}, "
            f"{torch.get_num_threads()} threads, qsync-opt {__version__}")


# ----------------------------------------------------------------------------- profile


def profile_detailed(
    workload: str,
    batch: int | None = None,
    *,
    device: str = "cpu",
    device_name: str | None = None,
    repeats: int = DEFAULT_REPEATS,
    warmup: int = DEFAULT_WARMUP,
    precisions: Iterable[Precision | str] | None = None,
    graph: ModelGraph | None = None,
    threads: int | None = None,
    method: str = "context",
) -> Profile:
    """Measure ``workload`` at ``batch`` on ``device``; see the module docstring.

    ``precisions`` restricts what is measured (others keep the estimator's value, tagged
    ``estimated``); ``graph`` reuses a trace made at the same batch; ``threads`` sets torch's
    intra-op threads for the measurement (restored after; default: as set). Profile with the
    thread count training will use: on a shared 2-core machine a 2-thread op waits for the
    other core (ms-long stalls), a 1-thread op does not. ``method`` is ``"context"`` (default:
    choosable ops timed inside whole steps of uniform plans, :mod:`qsync_opt.profile_context`;
    the table's ``activation_flow`` is ``"fp32"``, as the runtime runs) or ``"isolated"``
    (every op alone; ``activation_flow="native"``).
    """
    if method not in ("context", "isolated"):
        raise QsyncInputError(f"method: expected 'context' or 'isolated', got {method!r}")
    from .machine import pin_malloc

    pin_malloc()  # as the training ranks do: large buffers cost the same in every process
    if threads is None:
        return _profile(workload, batch, device=device, device_name=device_name,
                        repeats=repeats, warmup=warmup, precisions=precisions, graph=graph,
                        method=method)
    if threads < 1:
        raise QsyncInputError(f"threads: expected a positive integer, got {threads}")
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _profile(workload, batch, device=device, device_name=device_name,
                        repeats=repeats, warmup=warmup, precisions=precisions, graph=graph,
                        method=method)
    finally:
        torch.set_num_threads(old)


def _profile(workload: str, batch: int | None, *, device: str, device_name: str | None,
             repeats: int, warmup: int, precisions: Iterable[Precision | str] | None,
             graph: ModelGraph | None, method: str = "context") -> Profile:
    from .graph import trace
    from .models import get_workload

    start = time.perf_counter()
    if repeats < 1 or warmup < 0:
        raise QsyncInputError("repeats must be >= 1 and warmup >= 0")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise QsyncInputError("--device cuda: no CUDA device is available here")
    dev_name = _device_name(dev, device_name)
    if graph is None:
        graph = trace(workload, batch)
    elif batch is not None and graph.batch_size != batch:
        raise QsyncInputError(f"graph was traced at batch {graph.batch_size}, not {batch}")
    b = graph.batch_size
    wanted = None if precisions is None else {Precision(p) for p in precisions}
    template = estimate(graph, parse_shorthand(f"{dev_name}x1"))

    torch.manual_seed(0)
    wl = get_workload(workload)
    with torch.device(dev):
        model = wl.build()
    model.to(dev).train()
    builder = _OpBuilder(model, graph, dev)
    timer = _Timer(dev)
    dispatch_us = measure_dispatch_us(dev)

    measured: dict[tuple[str, Precision], tuple[float, float]] = {}
    spread: dict[tuple[str, str], tuple[float, float]] = {}
    cache: dict[str, tuple[float, float, float, float]] = {}
    reasons: dict[str, str] = {}
    shared = 0
    spec = get_device(dev_name)
    context = method == "context"
    for op in graph.ops:
        if context and op.role == OpRole.choosable:
            continue  # timed in context below
        for p in op_precisions(op, spec):
            if wanted is not None and p not in wanted:
                continue
            if context and p != op_precisions(op, spec)[0]:
                continue  # the runtime runs every other op at fp32 (activations stay fp32)
            try:
                run, sig = builder.build(op, p)
            except Exception as exc:  # a module that cannot be copied or swapped
                run, sig = None, f"{type(exc).__name__}: {exc}"
            if run is None:
                reasons[op.name] = sig
                continue
            if sig in cache:
                shared += 1
            else:
                try:
                    with torch.no_grad():
                        probe = run()
                    if not _check_shapes(probe, op):
                        reasons[op.name] = "rebuilt op's output shape differs from the trace"
                        continue
                    fwd, bwd = _time_fwd_bwd(run, timer, repeats, warmup)
                except Exception as exc:
                    reasons[op.name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
                    continue
                fm, fs = _median_iqr(fwd)
                bm, bs = _median_iqr(bwd)
                cache[sig] = (fm, bm, fs, bs)
            fm, bm, fs, bs = cache[sig]
            measured[(op.name, p)] = (fm, bm)
            spread[(op.name, p.value)] = (fs, bs)

    ctx_notes: list[str] = []
    runs: dict[Precision, Any] = {}
    if context:
        ctx_measured, ctx_spread, ctx_notes, runs = _in_context(
            model, wl, graph, dev, dev_name, spec, wanted, repeats, warmup, measured,
            {(e.op, e.precision): (e.fwd_ms, e.bwd_ms) for e in template.entries})
        measured.update(ctx_measured)
        spread.update(ctx_spread)
    entries: list[OpCost] = []
    n_est = 0
    for e in template.entries:
        m = measured.get((e.op, e.precision))
        if m is None:
            n_est += 1
            entries.append(e)
        else:
            entries.append(e.model_copy(update={"fwd_ms": m[0], "bwd_ms": m[1],
                                                "source": "measured"}))

    casts, cast_notes = _measure_casts(dev_name, dev, repeats, warmup)
    measured_pairs = {(c.src, c.dst) for c in casts}
    casts += [c for c in template.casts if (c.src, c.dst) not in measured_pairs]
    opt_ms = _measure_optimizer(model, dev, repeats, warmup)
    if runs:
        # In context: the SGD step timed right after each uniform step (caches as in
        # training), the median over the precisions (it does not depend on them).
        opt_ms["sgd"] = statistics.median(r.optimizer_ms for r in runs.values())
    optimizer = [o.model_copy(update={"ms": opt_ms[o.optimizer]}) for o in template.optimizer]
    comm = _measure_allreduce(dev, repeats, warmup)
    how = ("choosable ops in context (whole steps of each uniform precision, module hooks; "
           "see qsync_opt.profile_context), the other ops' in-context fp32 time split by their "
           "isolated timings on random inputs of their traced shapes" if context else
           "each op in isolation on random inputs of its traced shapes")
    notes = [environment_note(dev_name, dev),
             f"{dev_name}: profiled {workload} at batch {b}: {how}, {warmup} warm-up calls, "
             f"median of {repeats}; "
             f"{len(entries) - n_est} entries measured ({shared} shared by identical ops), "
             f"{n_est} kept from the estimator (source=estimated)",
             *ctx_notes,
             f"{dev_name}: dispatch overhead (1-element add, forward+backward): "
             f"{dispatch_us:.1f} us, measured (recorded as efficiencies.launch_overhead_us)"]
    if spread:
        vals = sorted(max(v) for v in spread.values())
        notes.append(f"{dev_name}: spread (IQR/median) over {len(vals)} measured entries: "
                     f"median {statistics.median(vals):.1%}, worst {vals[-1]:.1%}")
    for name, why in sorted(reasons.items()):
        notes.append(f"{dev_name}: {name}: estimated ({why})")
    notes += cast_notes
    notes.append(f"{dev_name}: optimizer step over {graph.param_count} parameters: SGD "
                 f"{opt_ms['sgd']:.3f} ms{' (in context)' if runs else ''}, Adam "
                 f"{opt_ms['adam']:.3f} ms (measured)")
    if comm is None:
        comm = template.comm
        notes.append(f"{dev_name}: torch.distributed not initialised with world > 1: comm "
                     "model and buckets are the estimator's (source=estimated)")
    else:
        notes.append(f"{dev_name}: all-reduce fitted on the process group: "
                     f"{comm.bandwidth_gb_per_s:.3g} GB/s, {comm.latency_us:.3g} us per hop")
    buckets = gradient_buckets(graph, comm, template.bucket_cap_bytes)
    eff = template.efficiencies.model_copy(update={"launch_overhead_us": dispatch_us})
    table = CostTable(workload=graph.workload, graph_hash=graph.structure_hash(), entries=entries,
                      casts=casts, comm=comm, buckets=buckets,
                      bucket_cap_bytes=template.bucket_cap_bytes, optimizer=optimizer,
                      efficiencies=eff, notes=notes,
                      activation_flow="fp32" if context else "native",
                      environment={dev_name: environment(dev, method)})
    return Profile(table=table, spread=spread, dispatch_us=dispatch_us,
                   seconds=time.perf_counter() - start,
                   uniform_ms={p.value: (r.step_fwd_ms, r.step_bwd_ms) for p, r in runs.items()},
                   assignments_run=[{k: v.value for k, v in r.assignment.items()}
                                    for r in runs.values()])


def profile(workload: str, batch: int | None = None, *, device: str = "cpu",
            repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP,
            precisions: Iterable[Precision | str] | None = None, **kw: Any) -> CostTable:
    """The measured :class:`CostTable` of :func:`profile_detailed` (spread in its notes)."""
    return profile_detailed(workload, batch, device=device, repeats=repeats, warmup=warmup,
                            precisions=precisions, **kw).table


def _in_context(model: nn.Module, wl: Any, graph: ModelGraph, dev: torch.device, dev_name: str,
                spec: Any, wanted: set[Precision] | None, repeats: int, warmup: int,
                isolated: dict[tuple[str, Precision], tuple[float, float]],
                estimated: dict[tuple[str, Precision], tuple[float, float]],
                ) -> tuple[dict[tuple[str, Precision], tuple[float, float]],
                           dict[tuple[str, str], tuple[float, float]], list[str], dict[Any, Any]]:
    """Entries from in-context uniform runs (see :mod:`qsync_opt.profile_context`)."""
    from .profile_context import HEAD, TAIL, model_builder, run_uniform, stepper

    choosable = [o for o in graph.ops if o.role == OpRole.choosable]
    menu: list[Precision] = []
    for o in choosable:
        for p in op_precisions(o, spec):
            if p not in menu and (wanted is None or p in wanted or p == Precision.fp32):
                menu.append(p)
    if Precision.fp32 not in menu:
        menu.insert(0, Precision.fp32)
    menu.sort(key=lambda p: p != Precision.fp32)
    runs = run_uniform(model_builder(model), stepper(wl, graph.batch_size, dev), graph, menu,
                       repeats, warmup, clock=_Timer(dev).now)
    ref = runs[Precision.fp32]
    out: dict[tuple[str, Precision], tuple[float, float]] = {}
    spread: dict[tuple[str, str], tuple[float, float]] = {}
    clamped = 0
    for p, run in runs.items():
        if wanted is not None and p not in wanted:
            continue
        for o in choosable:
            ran = run.assignment.get(o.module_name, Precision.fp32)
            if p not in op_precisions(o, spec) or (p != Precision.fp32 and ran != p):
                continue  # not run at p in the uniform run (the op does not allow it)
            f = run.op_fwd.get(o.name, 0.0) + run.seg_fwd.get(o.name, 0.0) - ref.seg_fwd.get(
                o.name, 0.0)
            b = run.op_bwd.get(o.name, 0.0) + run.seg_bwd.get(o.name, 0.0) - ref.seg_bwd.get(
                o.name, 0.0)
            if f < 0 or b < 0:
                clamped += 1
            out[(o.name, p)] = (max(f, 0.0), max(b, 0.0))
            if o.name in run.spread:
                spread[(o.name, p.value)] = run.spread[o.name]
    # Everything that is not a choosable op: the fp32 run's head, segments and tail, split in
    # proportion to the isolated timings (the estimate where an op could not be rebuilt).
    rest_f = sum(ref.seg_fwd.values())
    rest_b = sum(ref.seg_bwd.values())
    others = [o for o in graph.ops if o.role != OpRole.choosable]
    weights: dict[str, tuple[float, float]] = {}
    for o in others:
        p0 = op_precisions(o, spec)[0]
        weights[o.name] = isolated.get((o.name, p0)) or estimated.get((o.name, p0), (0.0, 0.0))
    wf = sum(w[0] for w in weights.values())
    wb = sum(w[1] for w in weights.values())
    for o in others:
        f = rest_f * weights[o.name][0] / wf if wf > 0 else 0.0
        b = rest_b * weights[o.name][1] / wb if wb > 0 else 0.0
        for p in op_precisions(o, spec):
            if wanted is None or p in wanted:
                out[(o.name, p)] = (f, b)
    notes = []
    for p, run in runs.items():
        notes.append(
            f"{dev_name}: in context, uniform {p.value}: step {run.step_fwd_ms:.3f} ms forward"
            f" + {run.step_bwd_ms:.3f} ms backward (median of {run.samples} without hooks); "
            f"hook correction "
            f"x{run.hook_scale[0]:.3f} / x{run.hook_scale[1]:.3f}; choosable ops "
            f"{sum(run.op_fwd.values()) + sum(run.op_bwd.values()):.3f} ms, the rest "
            f"{sum(run.seg_fwd.values()) + sum(run.seg_bwd.values()):.3f} ms")
    notes.append(f"{dev_name}: the ops that are not choosable share the fp32 run's "
                 f"{rest_f:.3f} ms forward / {rest_b:.3f} ms backward outside choosable ops "
                 f"(head {ref.seg_fwd.get(HEAD, 0.0):.3f} ms, loss-to-backward "
                 f"{ref.seg_bwd.get(TAIL, 0.0):.3f} ms); the runtime runs them at fp32, so "
                 "their entry is the same at every activation dtype")
    if clamped:
        notes.append(f"{dev_name}: {clamped} choosable entries were negative after the "
                     "segment change and were clamped to 0")
    return out, spread, notes, runs


# ----------------------------------------------------------------------------- derive


def derive(table: CostTable, devices: Iterable[str]) -> CostTable:
    """The table plus entries for derived CPUs (``cpu/F``), built from its ``cpu`` entries.

    A derived CPU's rank runs on this CPU with every op's measured compute stretched ``F``x
    (:mod:`qsync_opt.runtime.emulate`): its entries and casts are the ``cpu`` ones times
    ``F``, restricted to its precision menu; the optimizer step is not stretched and keeps
    the ``cpu`` time. Devices already in the table are left as they are.
    """
    from .devices import canonical_name, is_derived

    have = {e.device for e in table.entries}
    entries, casts, opt = list(table.entries), list(table.casts), list(table.optimizer)
    notes = list(table.notes)
    for name in devices:
        key = canonical_name(name)
        if key in have or not is_derived(key):
            continue
        if "cpu" not in have:
            raise QsyncInputError(f"derive: {key} is built from cpu, and the table has no cpu "
                                  "entries (profile this CPU first)")
        spec = get_device(key)
        f = float(spec.slowdown or 1.0)
        menu = set(spec.precisions)
        entries += [e.model_copy(update={"device": key, "fwd_ms": e.fwd_ms * f,
                                         "bwd_ms": e.bwd_ms * f})
                    for e in table.entries if e.device == "cpu"
                    and (e.precision in menu or e.precision == Precision.fp32)]
        casts += [c.model_copy(update={"device": key, "a_ms_per_element": c.a_ms_per_element * f,
                                       "b_ms": c.b_ms * f})
                  for c in table.casts if c.device == "cpu"]
        opt += [o.model_copy(update={"device": key}) for o in table.optimizer
                if o.device == "cpu"]
        notes.append(f"{key}: derived from the cpu entries, every op and cast x{f:g} (the "
                     "runtime stretches that rank's measured compute); optimizer step as cpu")
        if "cpu" in table.environment:
            env = {**table.environment, key: {**table.environment["cpu"],
                                              "derived": f"cpu x{f:g}"}}
            table = table.model_copy(update={"environment": env})
        have.add(key)
    return table.model_copy(update={"entries": entries, "casts": casts, "optimizer": opt,
                                    "notes": notes})


# ----------------------------------------------------------------------------- merge


def merge(tables: Sequence[CostTable]) -> CostTable:
    """One table from profiles of several machines (one per device type).

    Entries, casts and optimizer costs keep their device and source; notes are concatenated
    (each profile's notes already name its device; untagged ones get ``[tableN]``). The comm
    model and buckets are taken from the first table whose comm was measured, else the first.
    Tables for different graphs, or two tables for the same device, are refused.
    """
    if not tables:
        raise QsyncInputError("merge: no cost tables given")
    first = tables[0]
    for i, t in enumerate(tables[1:], 1):
        if t.graph_hash != first.graph_hash:
            raise QsyncInputError(
                f"merge: table {i} is for graph {t.graph_hash} ({t.workload}), table 0 for "
                f"{first.graph_hash} ({first.workload}); profile the same traced graph")
    flows = {t.activation_flow for t in tables}
    if len(flows) > 1:
        raise QsyncInputError(
            "merge: the tables describe different activation flows "
            f"({', '.join(f'table {i}: {t.activation_flow}' for i, t in enumerate(tables))}); "
            "profile every device with the same --method (context gives 'fp32'), or use "
            "estimates ('native') for all of them")
    seen: dict[str, int] = {}
    for i, t in enumerate(tables):
        for dev in sorted({e.device for e in t.entries}):
            if dev in seen:
                raise QsyncInputError(f"merge: device {dev} appears in tables {seen[dev]} and {i}")
            seen[dev] = i
    base = next((t for t in tables if t.comm.source == "measured"), first)
    notes: list[str] = []
    for t in tables:
        devs = sorted({e.device for e in t.entries})
        for n in t.notes:
            notes.append(n if any(n.startswith(f"{d}:") for d in devs)
                         else f"[{','.join(devs)}] {n}")
    notes.append(f"merged from {len(tables)} tables; comm and buckets from the table of "
                 f"{', '.join(sorted({e.device for e in base.entries}))}")
    return CostTable(
        workload=first.workload, graph_hash=first.graph_hash,
        entries=[e for t in tables for e in t.entries],
        casts=[c for t in tables for c in t.casts],
        comm=base.comm, buckets=base.buckets, bucket_cap_bytes=base.bucket_cap_bytes,
        optimizer=[o for t in tables for o in t.optimizer],
        efficiencies=base.efficiencies, notes=notes, activation_flow=first.activation_flow,
        environment={k: v for t in tables for k, v in t.environment.items()})


# ----------------------------------------------------------------------------- CLI


def add_profile_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``profile`` to a subparsers object; its default ``fn`` is :func:`cmd_profile`."""
    p = sub.add_parser("profile", help="measure a CostTable on this machine",
                       description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--model", required=True, help="workload (qsync-opt models)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--device-name", default=None,
                   help="catalog key of this device (default: cpu, or matched from the GPU name)")
    p.add_argument("--batch", type=int, default=None, help="per-device batch (default: the "
                   "workload's)")
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP)
    p.add_argument("--method", choices=["context", "isolated"], default="context",
                   help="context (default): choosable ops timed inside whole steps of uniform "
                        "plans; isolated: every op alone on random inputs")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads while measuring (default: torch's; use the "
                        "count training will run with)")
    p.add_argument("--out", required=True, help="CostTable JSON to write")
    p.add_argument("--merge", nargs="*", default=[], metavar="COSTS",
                   help="profiles of other machines to merge into --out")
    p.add_argument("--json", action="store_true", help="print the table on stdout")
    p.set_defaults(fn=cmd_profile)
    return p


def cmd_profile(args: argparse.Namespace) -> int:
    from .io import save, to_json

    prof = profile_detailed(args.model, args.batch, device=args.device,
                            device_name=args.device_name, repeats=args.repeats,
                            warmup=args.warmup, threads=args.threads,
                            method=getattr(args, "method", "context"))
    table = prof.table
    if args.merge:
        table = merge([table] + [CostTable.load(x) for x in args.merge])
    save(table, args.out)
    if getattr(args, "json", False):
        import sys

        sys.stdout.write(to_json(table))
        return 0
    n_meas = sum(e.source == "measured" for e in table.entries)
    print(f"profiled {args.model} in {prof.seconds:.1f} s: {n_meas}/{len(table.entries)} "
          f"entries measured, dispatch {prof.dispatch_us:.1f} us")
    for n in table.notes[:4]:
        print(f"  {n}")
    print(f"wrote {args.out}")
    return 0
