"""The profiler run: trace, the estimator's table as the template of keys, every
op timed (in context or in isolation), casts, optimizer, comm; notes."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.machine import pin_malloc
from qsync_opt.core.precision import Precision
from qsync_opt.core.version import __version__
from qsync_opt.costs.cluster import parse_shorthand
from qsync_opt.costs.devices import get_device, known_device_names
from qsync_opt.costs.roofline import estimate, gradient_buckets, op_precisions
from qsync_opt.costs.tables import median_iqr
from qsync_opt.documents.schemas import (
    CommModel,
    CostTable,
    DeviceSpec,
    ModelGraph,
    OpCost,
    OpRole,
)
from qsync_opt.graph import trace
from qsync_opt.models import BuiltinWorkload, get_workload
from qsync_opt.profile.builders import OpBuilder, check_shapes
from qsync_opt.profile.incontext import (
    HEAD,
    TAIL,
    UniformRun,
    model_builder,
    run_uniform,
    stepper,
)
from qsync_opt.profile.settings import DEFAULT_REPEATS, DEFAULT_WARMUP
from qsync_opt.profile.timing import (
    Timer,
    measure_allreduce,
    measure_casts,
    measure_dispatch_us,
    measure_optimizer,
    time_fwd_bwd,
)


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
    choosable ops timed inside whole steps of uniform plans, :mod:`qsync_opt.profile.incontext`;
    the table's ``activation_flow`` is ``"fp32"``, as the runtime runs) or ``"isolated"``
    (every op alone; ``activation_flow="native"``).
    """
    if method not in ("context", "isolated"):
        raise QsyncInputError(f"method: expected 'context' or 'isolated', got {method!r}")
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


@dataclass
class _IsolatedTimes:
    """What timing every op alone gave: (op, precision) -> (fwd, bwd) ms medians, their
    spread, why an op was not measured, and how many entries identical ops shared."""

    measured: dict[tuple[str, Precision], tuple[float, float]] = field(default_factory=dict)
    spread: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    shared: int = 0


def _time_isolated(graph: ModelGraph, builder: OpBuilder, timer: Timer, spec: DeviceSpec,
                   wanted: set[Precision] | None, context: bool, repeats: int,
                   warmup: int) -> _IsolatedTimes:
    """Time every op alone on random inputs of its traced shapes (``context``: only the ops
    that are not choosable, at their first precision; the choosable ones are timed in
    context); identical ops (one signature) are timed once."""
    out = _IsolatedTimes()
    cache: dict[str, tuple[float, float, float, float]] = {}
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
                out.reasons[op.name] = sig
                continue
            if sig in cache:
                out.shared += 1
            else:
                try:
                    with torch.no_grad():
                        probe = run()
                    if not check_shapes(probe, op):
                        out.reasons[op.name] = "rebuilt op's output shape differs from the trace"
                        continue
                    fwd, bwd = time_fwd_bwd(run, timer, repeats, warmup)
                except Exception as exc:
                    out.reasons[op.name] = (f"{type(exc).__name__}: "
                                            f"{str(exc).splitlines()[0][:80]}")
                    continue
                fm, fs = median_iqr(fwd)
                bm, bs = median_iqr(bwd)
                cache[sig] = (fm, bm, fs, bs)
            fm, bm, fs, bs = cache[sig]
            out.measured[(op.name, p)] = (fm, bm)
            out.spread[(op.name, p.value)] = (fs, bs)
    return out


def _merge_entries(template: CostTable, measured: dict[tuple[str, Precision],
                                                       tuple[float, float]]
                   ) -> tuple[list[OpCost], int]:
    """The template's entries with the measured ones put in; and how many stay estimated."""
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
    return entries, n_est


def _measurement_notes(dev_name: str, dev: torch.device, workload: str, batch: int,
                       context: bool, repeats: int, warmup: int, n_entries: int, n_est: int,
                       times: _IsolatedTimes, ctx_notes: list[str],
                       dispatch_us: float) -> list[str]:
    """The table's notes on how its op entries were measured, their spread, and the ops
    left estimated."""
    how = ("choosable ops in context (whole steps of each uniform precision, module hooks; "
           "see qsync_opt.profile.incontext), the other ops' in-context fp32 time split by their "
           "isolated timings on random inputs of their traced shapes" if context else
           "each op in isolation on random inputs of its traced shapes")
    notes = [environment_note(dev_name, dev),
             f"{dev_name}: profiled {workload} at batch {batch}: {how}, {warmup} warm-up calls, "
             f"median of {repeats}; "
             f"{n_entries - n_est} entries measured ({times.shared} shared by identical ops), "
             f"{n_est} kept from the estimator (source=estimated)",
             *ctx_notes,
             f"{dev_name}: dispatch overhead (1-element add, forward+backward): "
             f"{dispatch_us:.1f} us, measured (recorded as efficiencies.launch_overhead_us)"]
    if times.spread:
        vals = sorted(max(v) for v in times.spread.values())
        notes.append(f"{dev_name}: spread (IQR/median) over {len(vals)} measured entries: "
                     f"median {statistics.median(vals):.1%}, worst {vals[-1]:.1%}")
    for name, why in sorted(times.reasons.items()):
        notes.append(f"{dev_name}: {name}: estimated ({why})")
    return notes


def _comm_with_note(comm: CommModel | None, template: CostTable,
                    dev_name: str) -> tuple[CommModel, str]:
    """The measured all-reduce model (the estimator's where none was measured) and its note."""
    if comm is None:
        return template.comm, (f"{dev_name}: torch.distributed not initialised with world > 1: "
                               "comm model and buckets are the estimator's (source=estimated)")
    return comm, (f"{dev_name}: all-reduce fitted on the process group: "
                  f"{comm.bandwidth_gb_per_s:.3g} GB/s, {comm.latency_us:.3g} us per hop")


def _profile(workload: str, batch: int | None, *, device: str, device_name: str | None,
             repeats: int, warmup: int, precisions: Iterable[Precision | str] | None,
             graph: ModelGraph | None, method: str = "context") -> Profile:
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
    wanted = None if precisions is None else {Precision(p) for p in precisions}
    template = estimate(graph, parse_shorthand(f"{dev_name}x1"))

    torch.manual_seed(0)
    wl = get_workload(workload)
    with torch.device(dev):
        model = wl.build()
    model.to(dev).train()
    builder = OpBuilder(model, graph, dev)
    timer = Timer(dev)
    dispatch_us = measure_dispatch_us(dev)
    spec = get_device(dev_name)
    context = method == "context"
    times = _time_isolated(graph, builder, timer, spec, wanted, context, repeats, warmup)

    ctx_notes: list[str] = []
    runs: dict[Precision, UniformRun] = {}
    if context:
        ctx_measured, ctx_spread, ctx_notes, runs = _in_context(
            model, wl, graph, dev, dev_name, spec, wanted, repeats, warmup, times.measured,
            {(e.op, e.precision): (e.fwd_ms, e.bwd_ms) for e in template.entries})
        times.measured.update(ctx_measured)
        times.spread.update(ctx_spread)
    entries, n_est = _merge_entries(template, times.measured)

    casts, cast_notes = measure_casts(dev_name, dev, repeats, warmup)
    measured_pairs = {(c.src, c.dst) for c in casts}
    casts += [c for c in template.casts if (c.src, c.dst) not in measured_pairs]
    opt_ms = measure_optimizer(model, dev, repeats, warmup)
    if runs:
        # In context: the SGD step timed right after each uniform step (caches as in
        # training), the median over the precisions (it does not depend on them).
        opt_ms["sgd"] = statistics.median(r.optimizer_ms for r in runs.values())
    optimizer = [o.model_copy(update={"ms": opt_ms[o.optimizer]}) for o in template.optimizer]
    comm, comm_note = _comm_with_note(measure_allreduce(dev, repeats, warmup), template,
                                      dev_name)
    notes = _measurement_notes(dev_name, dev, workload, graph.batch_size, context, repeats,
                               warmup, len(entries), n_est, times, ctx_notes, dispatch_us)
    notes += cast_notes
    notes.append(f"{dev_name}: optimizer step over {graph.param_count} parameters: SGD "
                 f"{opt_ms['sgd']:.3f} ms{' (in context)' if runs else ''}, Adam "
                 f"{opt_ms['adam']:.3f} ms (measured)")
    notes.append(comm_note)
    buckets = gradient_buckets(graph, comm, template.bucket_cap_bytes)
    eff = template.efficiencies.model_copy(update={"launch_overhead_us": dispatch_us})
    table = CostTable(workload=graph.workload, graph_hash=graph.structure_hash(), entries=entries,
                      casts=casts, comm=comm, buckets=buckets,
                      bucket_cap_bytes=template.bucket_cap_bytes, optimizer=optimizer,
                      efficiencies=eff, notes=notes,
                      activation_flow="fp32" if context else "native",
                      environment={dev_name: environment(dev, method)})
    return Profile(table=table, spread=times.spread, dispatch_us=dispatch_us,
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


def _in_context(model: nn.Module, wl: BuiltinWorkload, graph: ModelGraph, dev: torch.device,
                dev_name: str, spec: DeviceSpec, wanted: set[Precision] | None, repeats: int,
                warmup: int, isolated: dict[tuple[str, Precision], tuple[float, float]],
                estimated: dict[tuple[str, Precision], tuple[float, float]],
                ) -> tuple[dict[tuple[str, Precision], tuple[float, float]],
                           dict[tuple[str, str], tuple[float, float]], list[str],
                           dict[Precision, UniformRun]]:
    """Entries from in-context uniform runs (see :mod:`qsync_opt.profile.incontext`)."""
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
                       repeats, warmup, clock=Timer(dev).now)
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
