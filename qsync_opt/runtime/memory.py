"""Peak tensor memory of one training step on the CPU, measured exactly.

A CPU has no ``torch.cuda.max_memory_allocated``. What it has is the profiler's memory
reporting: with ``profile_memory=True`` every allocation and free that goes through c10's CPU
allocator (every tensor storage, and every ATen/oneDNN temporary that goes through it) is
recorded as a ``[memory]`` event with its signed byte count, in the order it happened, on
the profiler's clock. Summing those deltas in time order gives the live tensor bytes at
every instant, so the maximum is the exact peak, temporaries inside kernels included (the
int32 accumulator of an int8 GEMM, im2col columns, a matmul's packed operands).

**Counted.** ``peak_bytes = baseline_bytes + max(running sum of the step's deltas)``, where

* ``baseline_bytes`` are the tensors live before the step, counted directly (the profiler
  cannot see blocks allocated before it started): parameters, gradients that exist,
  optimizer state, buffers, and any ``extra`` tensors (inputs, targets), deduplicated by
  storage (``untyped_storage().nbytes()``, keyed by its data pointer);
* the deltas are the requested sizes of every storage allocated or freed during the step:
  activations saved for backward, low-precision copies of weights and inputs, outputs,
  gradients, optimizer temporaries, kernel workspaces from the c10 allocator.

**Not counted.** Allocator overhead (``malloc`` headers and rounding; c10 aligns CPU
blocks to 64 bytes but reports the requested size), memory a kernel obtains outside the
c10 allocator (``std::vector`` scratch in custom kernels, oneDNN's library-managed
scratchpads, BLAS packing buffers), Python objects, and the process's code and heap. There
is no caching allocator on the CPU, so "allocated" is also "reserved": what is counted is
what a GPU's ``max_memory_allocated`` would count for the same tensors.

**Replayed by pointer.** Each event carries the block's address. An allocation adds its
bytes; a free subtracts them only if the block was allocated inside the region, or is a
baseline storage. Frees of older blocks are otherwise unreliable: c10 reports them only if
the block was allocated under an earlier profiling session (and then with that session's
size), not at all if it predates every session. So :func:`measure_step_memory` clears
gradients to ``None`` before it starts when given the optimizer, and puts a weak-reference
finalizer on every baseline storage that drops a marker into the profile when the storage
is freed: a baseline tensor the step frees (an old gradient dropped by
``zero_grad(set_to_none=True)``, a loss kept from the previous step) is subtracted at that
moment (``preexisting_freed_bytes``). Storages alive before the step that the caller did
not name are neither counted nor subtracted (``ignored_free_bytes`` reports their frees).

The measurement is deterministic for a fixed model, batch and plan: sizes depend on shapes
only, the autograd engine runs CPU backward on the calling thread, and the cyclic garbage
collector is paused during the step so that no collection frees tensors at a data-dependent
moment. Two runs give the same ``peak_bytes`` to the byte (checked with one and two
intra-op threads: the same bytes).

Usage::

    from qsync_opt.runtime.memory import measure_step_memory, mark

    def step():
        loss = compute_loss(wl, model(*inputs), targets)
        mark("forward")
        loss.backward()
        mark("backward")
        opt.step()

    step()                                   # warm-up: optimizer state exists
    m = measure_step_memory(model, step, optimizer=opt, extra=(*inputs, targets))
    m.peak_bytes, m.baseline, m.marks["forward"], m.peak_phase, m.peak_op
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch._C._profiler import _EventType

from qsync_opt.models import compute_loss, get_workload
from qsync_opt.runtime.apply import apply_plan

__all__ = ["MemoryTrace", "StepMemory", "count_tensor_bytes", "mark", "measure_plan_memory",
           "measure_step_memory", "track_memory"]

_MARK = "qsync_mem::mark::"
_FREE = "qsync_mem::free::"


def mark(label: str) -> None:
    """Record the live bytes at this point of a measured step under ``label``.

    A zero-length profiler range; outside a measurement it costs a function call.
    """
    with torch.autograd.profiler.record_function(_MARK + label):
        pass


def _storages(tensors: Iterable[Any]) -> dict[int, int]:
    """{storage data pointer: storage bytes} of the tensors (None and non-tensors skipped)."""
    out: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, Tensor) or t.device.type != "cpu":
            continue
        st = t.untyped_storage()
        if st.nbytes():
            out.setdefault(st.data_ptr(), st.nbytes())
    return out


def count_tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct CPU storages behind ``tensors`` (views and aliases once)."""
    return sum(_storages(tensors).values())


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    out: list[Tensor] = []
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, Tensor):
                out.append(v)
    return out


@dataclass
class MemoryTrace:
    """Live-byte deltas of a tracked region, in time order (see :func:`track_memory`).

    ``deltas`` are (time ns, signed bytes) of every allocation and free counted;
    ``peak_delta_bytes`` is the highest running sum (0 if nothing was allocated),
    ``end_delta_bytes`` the sum at the end, ``marks`` the running sum at each :func:`mark`;
    ``peak_phase`` the last mark before the peak (``"start"``: none yet); ``peak_op`` the ops
    running at the peak, outermost first (``"autograd::engine::evaluate_function:
    AddmmBackward0 > AddmmBackward0 > aten::mm"``); ``peak_op_start_delta_bytes`` the running
    sum when the outermost of them began, so ``peak - that`` is that op's own working set.
    ``preexisting_freed_bytes``: watched (baseline) storages freed in the region, subtracted;
    ``ignored_free_bytes``: frees of other storages older than the region, not counted (they
    were not in the baseline either).
    """

    deltas: list[tuple[int, int]] = field(default_factory=list)
    peak_delta_bytes: int = 0
    end_delta_bytes: int = 0
    peak_op: str | None = None
    peak_op_start_delta_bytes: int = 0
    peak_phase: str | None = None
    marks: dict[str, int] = field(default_factory=dict)
    preexisting_freed_bytes: int = 0
    ignored_free_bytes: int = 0
    n_allocations: int = 0


class track_memory:  # noqa: N801 - used as a context manager, like torch's own
    """Context manager: the live CPU tensor bytes, relative to its start, at every instant.

    Runs the region under ``torch.autograd.profiler.profile(profile_memory=True)`` and
    replays the allocator's events by pointer: an allocation adds its bytes, a free of a
    block allocated in the region subtracts them. A free of an older block subtracts only if
    the block is ``watch``ed (``{storage data pointer: bytes}``, e.g. the baseline of
    :func:`measure_step_memory`); the allocator reports frees of blocks from before any
    profiling not at all, so each watched storage of ``watch_tensors`` also gets a finalizer
    that drops a marker into the profile when it is freed. The cyclic garbage collector is
    paused inside (after a collection) so frees happen at deterministic points. After the
    block, :attr:`trace` holds the :class:`MemoryTrace`.
    """

    def __init__(self, watch: dict[int, int] | None = None,
                 watch_tensors: Iterable[Tensor] = ()) -> None:
        self._watch_tensors = [t for t in watch_tensors if isinstance(t, Tensor)]
        self._watch = dict(watch or {})
        self._finalizers: list[weakref.finalize] = []
        self._prof: Any = None
        self._gc_was_enabled = False
        self.trace = MemoryTrace()

    def __enter__(self) -> track_memory:
        seen: set[int] = set()
        for t in self._watch_tensors:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr in seen or ptr not in self._watch:
                continue
            seen.add(ptr)
            self._finalizers.append(weakref.finalize(st, _free_marker, ptr))
        self._watch_tensors = []  # hold no references during the region
        gc.collect()
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._prof = torch.autograd.profiler.profile(use_cpu=True, profile_memory=True,
                                                         record_shapes=False, with_stack=False)
            with _quiet_stderr():
                self._prof.__enter__()
        except BaseException:
            self._release()
            raise
        return self

    def _release(self) -> None:
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()
        if self._gc_was_enabled:
            gc.enable()

    def __exit__(self, *exc: Any) -> None:
        try:
            with _quiet_stderr():
                self._prof.__exit__(*exc)
        finally:
            self._release()
        if exc[0] is None:
            self.trace = _replay(self._prof.kineto_results, self._watch)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (kineto prints a line at every profiler start and stop)."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def _free_marker(ptr: int) -> None:
    with torch.autograd.profiler.record_function(f"{_FREE}{ptr}"):
        pass


def _flatten(roots: Iterable[Any]) -> list[Any]:
    out: list[Any] = []
    stack = list(reversed(list(roots)))
    while stack:
        e = stack.pop()
        out.append(e)
        stack.extend(reversed(e.children))
    return out


def _replay(results: Any, watch: dict[int, int]) -> MemoryTrace:
    """Running sum of the profile's CPU allocations and frees in time order, by pointer."""
    if results is None:
        raise RuntimeError("the profiler returned no results (was another profiler active?)")
    events = _flatten(results.experimental_event_tree())
    order = sorted(range(len(events)), key=lambda k: (events[k].start_time_ns, k))
    tr = MemoryTrace()
    live: dict[int, int] = {}  # blocks allocated in the region: ptr -> bytes
    watched = dict(watch)  # baseline blocks not yet freed
    gone: set[int] = set()  # baseline blocks freed (marker and allocator report both come)
    run = peak = 0
    peak_event: Any = None
    phase = "start"
    for k in order:
        e = events[k]
        t = e.start_time_ns
        if e.tag == _EventType.Allocation:
            f = e.extra_fields
            if f.device.type != "cpu":
                continue
            ptr, nb = int(f.ptr), int(f.alloc_size)
            if nb > 0:
                live[ptr] = nb
                tr.n_allocations += 1
                delta = nb
            elif ptr in live:
                delta = -live.pop(ptr)
            elif ptr in watched:
                delta = -watched.pop(ptr)
                gone.add(ptr)
                tr.preexisting_freed_bytes -= delta
            else:
                if ptr not in gone:
                    tr.ignored_free_bytes -= nb
                continue
        else:
            name = e.name
            if name.startswith(_MARK):
                tr.marks[name[len(_MARK):]] = run
                phase = name[len(_MARK):]
                continue
            if not name.startswith(_FREE):
                continue
            ptr = int(name[len(_FREE):])
            if ptr not in watched:
                continue
            delta = -watched.pop(ptr)
            gone.add(ptr)
            tr.preexisting_freed_bytes -= delta
        run += delta
        tr.deltas.append((t, delta))
        if run > peak:
            peak, peak_event = run, e
            tr.peak_phase = phase
    tr.peak_delta_bytes = peak
    tr.end_delta_bytes = run
    if peak_event is not None:
        chain = []
        p = peak_event.parent
        while p is not None:
            chain.append(p)
            p = p.parent
        if chain:
            tr.peak_op = " > ".join(c.name for c in reversed(chain))
            # The running sum just before the outermost enclosing op began.
            t0 = chain[-1].start_time_ns
            before = 0
            for t, d in tr.deltas:
                if t >= t0:
                    break
                before += d
            tr.peak_op_start_delta_bytes = before
    return tr


@dataclass(frozen=True)
class StepMemory:
    """Live tensor bytes of one measured step (CPU storages through c10's allocator).

    ``peak_bytes``: the most bytes live at any instant of the step, what was live before it
    included. ``baseline_bytes``: live before the step, by ``baseline`` component
    (``parameters``, ``gradients``, ``optimizer_state``, ``buffers``, ``extra``).
    ``end_bytes``: live after it. ``marks``: live bytes at each :func:`mark` label.
    ``peak_phase``: the last mark before the peak (``"start"``: none yet); ``peak_op``: the
    ops running at the peak, outermost first; ``peak_op_start_bytes``: live bytes when the
    outermost of them began (``peak_bytes`` minus it is that op's working set).
    ``preexisting_freed_bytes``: baseline storages the step freed (subtracted when freed);
    ``ignored_free_bytes``: frees of older storages outside the baseline (not counted: a
    caller that keeps such tensors alive across steps should pass them in ``extra``).
    """

    peak_bytes: int
    baseline_bytes: int
    end_bytes: int
    baseline: dict[str, int]
    marks: dict[str, int]
    peak_phase: str | None
    peak_op: str | None
    peak_op_start_bytes: int
    preexisting_freed_bytes: int
    ignored_free_bytes: int
    n_allocations: int

    @property
    def step_peak_bytes(self) -> int:
        """Peak above the baseline: what the step itself allocated at its high point."""
        return self.peak_bytes - self.baseline_bytes


def _prepare(model: nn.Module, optimizer: torch.optim.Optimizer | None,
             extra: Iterable[Any]) -> tuple[dict[str, int], track_memory]:
    """Baseline bytes per component, and a tracker watching those storages' frees.

    A function of its own so that no local of the caller keeps a baseline tensor alive.
    """
    params = list(model.parameters())
    comps: list[tuple[str, list[Any]]] = [
        ("parameters", params),
        ("gradients", [p.grad for p in params if p.grad is not None]),
        ("optimizer_state", _optimizer_tensors(optimizer) if optimizer is not None else []),
        ("buffers", list(model.buffers())),
        ("extra", list(extra)),
    ]
    watch: dict[int, int] = {}
    baseline: dict[str, int] = {}
    tensors: list[Tensor] = []
    for name, ts in comps:
        n = 0
        for ptr, nb in _storages(ts).items():
            if ptr not in watch:
                watch[ptr] = nb
                n += nb
        baseline[name] = n
        tensors.extend(t for t in ts if isinstance(t, Tensor))
    return baseline, track_memory(watch, tensors)


def measure_step_memory(model: nn.Module, step_fn: Callable[[], Any], *,
                        optimizer: torch.optim.Optimizer | None = None,
                        extra: Iterable[Any] = (), clear_grads: bool = True) -> StepMemory:
    """Run ``step_fn()`` once and measure its peak live tensor bytes on the CPU.

    The baseline is counted from ``model`` (parameters, existing gradients, buffers),
    ``optimizer`` (its state tensors) and ``extra`` (inputs, targets, anything else alive
    before the step that the step reads); each storage once, in that order of components.
    With ``optimizer`` and ``clear_grads``, gradients are set to ``None`` first (as
    ``zero_grad(set_to_none=True)`` at the top of the step would), so the step's gradients
    are counted when backward allocates them. Run a warm-up step first so that optimizer
    state exists, as it does in steady-state training.
    """
    if optimizer is not None and clear_grads:
        optimizer.zero_grad(set_to_none=True)
    baseline, tracker = _prepare(model, optimizer, extra)
    base = sum(baseline.values())
    with tracker:
        step_fn()
    tr = tracker.trace
    return StepMemory(
        peak_bytes=base + tr.peak_delta_bytes, baseline_bytes=base,
        end_bytes=base + tr.end_delta_bytes, baseline=baseline,
        marks={k: base + v for k, v in tr.marks.items()}, peak_phase=tr.peak_phase,
        peak_op=tr.peak_op, peak_op_start_bytes=base + tr.peak_op_start_delta_bytes,
        preexisting_freed_bytes=tr.preexisting_freed_bytes,
        ignored_free_bytes=tr.ignored_free_bytes, n_allocations=tr.n_allocations)


def measure_plan_memory(workload: str, plan: Any, batch: int, *, group: str = "cpu",
                        seed: int = 0, warmup: int = 1) -> StepMemory:
    """Peak of one training step of ``workload`` with ``plan`` applied for ``group``.

    The step of ``benchmarks/bench_prediction.py``: the model built in FP32 and in train
    mode, the plan applied (:func:`~qsync_opt.runtime.apply_plan`), SGD with momentum,
    ``zero_grad(set_to_none=True)``, loss, backward, step. ``warmup`` steps run first so
    that the momentum buffers exist. Marks: ``forward`` (loss computed), ``backward``,
    ``optimizer``. Inputs and targets are counted in ``baseline["extra"]``.
    ``plan=None`` runs the model as built.
    """
    wl = get_workload(workload)
    torch.manual_seed(seed)
    model = wl.build().float().train()
    if plan is not None:
        apply_plan(model, plan, group)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    inputs = wl.make_inputs(batch, torch.device("cpu"))
    targets = wl.make_targets(batch, torch.device("cpu"))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = compute_loss(wl, model(*inputs), targets)
        mark("forward")
        loss.backward()
        mark("backward")
        opt.step()
        mark("optimizer")

    for _ in range(warmup):
        step()
    return measure_step_memory(model, step, optimizer=opt, extra=(*inputs, targets))
