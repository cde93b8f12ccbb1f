"""``indicate``: Omega[op][precision] for every choosable op, measured from batches (its disk
cache: :mod:`.cache`)."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.core.progress import LOG_EVERY_S, duration
from qsync_opt.documents.io import save
from qsync_opt.documents.schemas import IndicatorTable, ModelGraph, OpRole
from qsync_opt.graph import trace
from qsync_opt.indicator.cache import (
    IndicatorSettings,
    cache_path,
    cached_table,
    check_settings,
)
from qsync_opt.indicator.calls import Bilinear, CallCapture
from qsync_opt.indicator.curv import CURV_LR, curv_batch
from qsync_opt.indicator.errormodel import NOMINAL
from qsync_opt.indicator.memory import (
    available_memory_bytes,
    check_indicator_memory,
    gib,
    indicator_memory,
)
from qsync_opt.indicator.tables import (
    UNMEASURED_GRAD,
    UNMEASURED_RAN,
    enforce_monotone,
    mean_of,
    table_summary,
)
from qsync_opt.indicator.terms import (
    OpCapture,
    OpStats,
    captures_of,
    fisher_terms,
    hessian_terms,
    hutchinson_traces,
    qsync_terms,
    wvar_terms,
)
from qsync_opt.models import Workload
from qsync_opt.models.resolve import resolve_workload

log = logging.getLogger("qsync_opt.indicator")

#: Off a terminal, the indicator's progress is a line at most this often (seconds): the
#: interval every progress line of the tool keeps (qsync_opt.core.progress).
PROGRESS_EVERY_S = LOG_EVERY_S


class IndicatorProgress:
    """Batches done: redrawn in place on a terminal; off one (a log, nohup, a batch
    scheduler), a plain line every :data:`PROGRESS_EVERY_S` seconds with the time left."""

    def __init__(self, enabled: bool, method: str, n: int) -> None:
        self.enabled, self.method, self.n = enabled, method, n
        self.tty = sys.stderr.isatty()
        self.t0 = self.last = time.perf_counter()

    def __call__(self, i: int) -> None:
        if not self.enabled:
            return
        if self.tty:
            sys.stderr.write(f"\rindicator {self.method}: batch {i}/{self.n}")
            if i == self.n:
                sys.stderr.write("\n")
        else:
            now = time.perf_counter()
            if now - self.last < PROGRESS_EVERY_S or i == self.n:
                return
            self.last = now
            left = (now - self.t0) / i * (self.n - i)
            sys.stderr.write(f"indicator {self.method}: batch {i}/{self.n}, "
                             f"{duration(now - self.t0)}, about {duration(left)} left\n")
        sys.stderr.flush()


@dataclasses.dataclass
class Measurements:
    """What the batches gave: per-op accumulators, the ops a call of which was captured in
    any batch, the batches measured, a user file's loss and data lines, the curvatures
    ``curv`` used."""

    stats: dict[str, OpStats]
    ran: set[str] = dataclasses.field(default_factory=set)
    seen: int = 0
    user_lines: list[str] = dataclasses.field(default_factory=list)
    curvatures: set[str] = dataclasses.field(default_factory=set)


AnyWorkload = Workload  # the one protocol: a built-in or a user's file


def checked_workload(workload: str | Workload, batch: int | None, s: IndicatorSettings
                     ) -> tuple[AnyWorkload, int]:
    """The workload and batch ``indicate`` measures, its arguments checked (one-line
    :class:`QsyncInputError` naming the argument)."""
    check_settings(s)
    wl = resolve_workload(workload) if isinstance(workload, str) else workload
    if not isinstance(wl, Workload):
        raise QsyncInputError("model: indicate() takes a registry name, a PATH.py:FUNCTION "
                              f"file or a workload object, not {type(wl).__name__}")
    b = batch if batch is not None else wl.default_batch
    if b < 1:
        raise QsyncInputError(f"batch: expected a positive integer, got {b}")
    return wl, b


def prepared_model(wl: AnyWorkload, graph: ModelGraph, method: str, model: nn.Module | None,
                   memory_check: bool, progress: bool) -> nn.Module:
    """The model to measure (``model``, else the workload's, built under the seed already
    set), in fp32 and train mode, after the memory check (:func:`indicator_memory`)."""
    need = indicator_memory(graph, method)
    if model is not None:  # its weights are already in memory
        need = dataclasses.replace(need, weights=0)
    if memory_check:
        check_indicator_memory(need, wl.name)
    if progress and sys.stderr.isatty():  # off a terminal: the summary line says it
        have = available_memory_bytes()
        sys.stderr.write(f"indicator {method}: {wl.name} ({graph.param_count / 1e6:.1f} M "
                         f"parameters) on this CPU, about {need.describe()}"
                         + (f" of {gib(have)} GiB available" if have is not None else "")
                         + "\n")
    if model is None:
        model = wl.build()
    return model.float().train()


def batch_stream(wl: AnyWorkload, data: Iterable[tuple[tuple[Tensor, ...], Tensor]] | None,
                 s: IndicatorSettings) -> tuple[Iterable[tuple[Any, Any]], str]:
    """(inputs, targets) batches and what they are (given, real or synthetic): a registry
    model's tensors; a user's file's batches are whatever its data() yields (its loss reads
    the targets from them), paired with None."""
    if data is not None:
        return data, "given"
    return (wl.sample_batches(s.batch, s.batches, s.seed),
            "real" if wl.real_data else "synthetic")


def measure(model: nn.Module, wl: AnyWorkload, ops: Sequence[Any],
            stream: Iterable[tuple[Any, Any]], s: IndicatorSettings, gen: torch.Generator,
            into: Measurements, tick: Callable[[int], None]) -> None:
    """Measure up to ``s.batches`` batches of ``stream`` into ``into``, a progress tick after
    each; the model's gradients are cleared at the end."""
    for i, (inputs, targets) in enumerate(stream):
        if i >= s.batches:
            break
        if s.method == "curv":
            measure_curv_batch(model, wl, ops, inputs, targets, i == 0, s, gen, into)
        else:
            measure_captured_batch(model, wl, ops, inputs, targets, i == 0, s, gen, into)
        into.seen += 1
        tick(into.seen)
    model.zero_grad(set_to_none=True)


def measure_curv_batch(model: nn.Module, wl: AnyWorkload, ops: Sequence[Any], inputs: Any,
                       targets: Any, first: bool, s: IndicatorSettings, gen: torch.Generator,
                       into: Measurements) -> None:
    """One batch of the ``curv`` method: its forward and backward nats per op and
    precision (:func:`~qsync_opt.indicator.curv.curv_batch`)."""
    def run() -> tuple[Any, Tensor]:
        out = wl.forward(model, inputs)
        loss = wl.loss_of(out, inputs, targets)
        if first:
            into.user_lines[:] = wl.usage_lines(out, inputs)
        return out, loss

    model.zero_grad(set_to_none=True)
    allowed: dict[str, Sequence[Precision]] = {o.name: list(o.allowed_precisions) for o in ops}
    got, used = curv_batch(model, [o.name for o in ops], run, allowed,
                           samples=s.hutchinson_samples, gen=gen, stochastic=s.stochastic,
                           lr=s.lr, ran=into.ran)
    into.curvatures.add(used)
    for n, terms_c in got.items():
        for p, (vf, vb) in terms_c.items():
            into.stats[n].fwd.setdefault(p, []).append(vf)
            into.stats[n].bwd.setdefault(p, []).append(vb)


def measure_captured_batch(model: nn.Module, wl: AnyWorkload, ops: Sequence[Any],
                           inputs: Any, targets: Any, first: bool, s: IndicatorSettings,
                           gen: torch.Generator, into: Measurements) -> None:
    """One batch of the qsync, fisher, wvar or hessian method: every op's calls captured in
    the forward (operands, output, output gradient), each call's terms added to its op."""
    names = [o.name for o in ops]
    model.zero_grad(set_to_none=True)
    with CallCapture(model, names) as capture:
        out = wl.forward(model, inputs)
        loss = wl.loss_of(out, inputs, targets)
    if first:
        into.user_lines[:] = wl.usage_lines(out, inputs)
    traces: dict[str, tuple[float, float]] = {}
    if s.method == "hessian":
        traces = hutchinson_traces(loss, capture.calls, s.hutchinson_samples, gen)
    else:
        loss.backward()
    caps = captures_of(capture.calls)
    into.ran.update(caps)
    for op in ops:
        precisions = list(op.allowed_precisions)
        for bl, cap in caps.get(op.name, []):
            add_call_terms(into.stats[op.name], bl, cap, precisions, s,
                           traces.get(op.name, (0.0, 0.0)))


def add_call_terms(stats: OpStats, bl: Bilinear, cap: OpCapture,
                   precisions: Sequence[Precision], s: IndicatorSettings,
                   trace_pair: tuple[float, float]) -> None:
    """One captured call's terms, by the method, appended to its op's accumulators
    (``trace_pair``: the hessian method's per-element traces of the op's weight and input)."""
    if s.method == "qsync":
        dtype = s.term_dtype if s.term_dtype is not None else torch.float32
        for p, (vf, vb) in qsync_terms(bl, cap, precisions, s.stochastic, dtype,
                                       s.term_rows).items():
            stats.fwd.setdefault(p, []).append(vf)
            stats.bwd.setdefault(p, []).append(vb)
        return
    if s.method == "fisher":
        got = fisher_terms(bl, cap, precisions, s.stochastic)
    elif s.method == "wvar":
        got = wvar_terms(bl, cap, precisions, s.stochastic)
    else:
        got = hessian_terms(bl, cap, precisions, s.stochastic, trace_pair)
    for p, v in got.items():
        stats.value.setdefault(p, []).append(v)


def op_row(op: Any, st: OpStats, s: IndicatorSettings, depth_of_graph: int,
           rng_value: float) -> tuple[dict[Precision, float], dict[Precision, list[float]], int]:
    """(Omega per precision, the [forward, backward] terms of qsync and curv, the count of
    negative curv estimates clamped to 0) of one measured op."""
    row: dict[Precision, float] = {}
    terms: dict[Precision, list[float]] = {}
    clamped = 0
    for p in op.allowed_precisions:
        if s.method == "random":
            row[p] = 0.0 if p == Precision.fp32 else rng_value * NOMINAL[p]
        elif s.method in ("qsync", "curv"):
            vf = mean_of(st.fwd.get(p, []))
            vb = mean_of(st.bwd.get(p, []))
            terms[p] = [vf, vb]
            if s.method == "qsync":
                row[p] = s.gamma * (depth_of_graph - op.depth) * vf + op.depth * vb
            else:
                if vf + vb < 0:  # Hutchinson noise, or a loss concave along this op
                    clamped += 1
                row[p] = max(0.0, vf + vb)
        else:
            row[p] = mean_of(st.value.get(p, []))
    return row, terms, clamped


def measured_table(wl: AnyWorkload, graph: ModelGraph, ops: Sequence[Any],
                   s: IndicatorSettings, m: Measurements, data_kind: str,
                   rng_values: dict[str, float]) -> IndicatorTable:
    """The table of the measurements: each op's row (an unmeasured op: fp32 only, with its
    reason), monotone within each ladder, and the notes."""
    values: dict[str, dict[Precision, float]] = {}
    terms: dict[str, dict[Precision, list[float]]] = {}
    clamped = 0
    unmeasured = {} if s.method == "random" else {
        o.name: (UNMEASURED_GRAD if o.name in m.ran else UNMEASURED_RAN) for o in ops
        if not (m.stats[o.name].fwd or m.stats[o.name].value)}
    for op in ops:
        if op.name in unmeasured:  # fp32 only (0 by definition), never a default at another
            values[op.name] = {Precision.fp32: 0.0}  # precision: the caller pins it fp32
            continue
        values[op.name], op_terms, c = op_row(op, m.stats[op.name], s, graph.max_depth,
                                             rng_values[op.name])
        clamped += c
        if op_terms:
            terms[op.name] = op_terms
    fixes = enforce_monotone(values)
    return IndicatorTable(
        workload=wl.name, graph_hash=graph.structure_hash(), method=s.method,
        batch_size=s.batch, batches=max(1, m.seen) if s.method != "random" else s.batches,
        seed=s.seed, gamma=s.gamma if s.method == "qsync" else None, data=data_kind,
        values=values, stochastic=s.stochastic,
        notes=table_notes(wl, s, m, data_kind, fixes, clamped, unmeasured),
        monotone_fixes=fixes, terms=terms if s.method in ("qsync", "curv") else None,
        unmeasured=unmeasured)


def saved_and_reported(table: IndicatorTable, path: Path | None,
                       report: Callable[[str], None] | None, seconds: float) -> IndicatorTable:
    """``table``, saved to ``path`` (None: not cached) and reported in one line."""
    if path is not None:
        save(table, path)
    if report is not None:
        report(f"indicator {table.method}: computed on this CPU in {seconds:.1f} s "
               f"({table_summary(table)}); "
               + (f"cached in {path}" if path is not None else "not cached"))
    return table


def table_notes(wl: AnyWorkload, s: IndicatorSettings, m: Measurements, data_kind: str,
                fixes: int, clamped: int, unmeasured: dict[str, str]) -> list[str]:
    """The table's notes: the data and model, the monotone fixes, curv's units and clamps,
    a user file's loss and data lines, the unmeasured ops."""
    init = wl.init_doc
    notes = [f"{data_kind} data, {m.seen if s.method != 'random' else 0} batches of {s.batch}; "
             f"model: {'given' if data_kind == 'given' else init + ', seed ' + str(s.seed)}",
             f"monotonicity: {fixes} value(s) raised to their higher-precision neighbour"]
    if s.method == "curv":
        curv = " and ".join(sorted(m.curvatures)) or "gn"
        notes.insert(0, "values: the expected increase of the batch-mean loss in one training "
                     "step, in nats, to second order: 1/2 E[dy^T H dy] for the op's output "
                     "error dy under the error model (forward), plus 1/2 lr^2 E[dG^T H_W dG] "
                     f"for its weight-gradient error dG under SGD lr {s.lr:g} (backward); H: "
                     f"{'Gauss-Newton' if curv == 'gn' else curv} curvature, "
                     f"{s.hutchinson_samples} Hutchinson probe(s) per batch and precision "
                     "pattern; terms: [forward, backward] nats, before clamping")
        notes.append(f"negative estimates clamped to 0: {clamped} value(s)")
    notes += m.user_lines
    if unmeasured:
        notes.append(f"{len(unmeasured)} choosable op(s) not measured (no value; pin them "
                     f"fp32): {', '.join(sorted(unmeasured)[:5])}"
                     + (" ..." if len(unmeasured) > 5 else ""))
    return notes


def indicate(
    workload: str | Workload,
    batches: int = 10,
    method: str = "qsync",
    *,
    batch: int | None = None,
    seed: int = 0,
    gamma: float = 4.0,
    stochastic: bool = True,
    model: nn.Module | None = None,
    data: Iterable[tuple[tuple[Tensor, ...], Tensor]] | None = None,
    graph: ModelGraph | None = None,
    cache: bool = True,
    cache_dir: str | Path | None = None,
    progress: bool = False,
    hutchinson_samples: int = 2,
    term_dtype: torch.dtype = torch.float32,
    term_rows: int | None = None,
    memory_check: bool = True,
    needs: Collection[Precision] | None = None,
    lr: float = CURV_LR,
    report: Callable[[str], None] | None = None,
) -> IndicatorTable:
    """Omega[op][precision] for every choosable op of ``workload``, from ``batches`` batches.

    ``workload``: a registry name or workload, or a user's model (``PATH.py:FUNCTION``,
    which is run, or a :class:`~qsync_opt.models.user.UserWorkload`): its ``build()`` under
    the seed, its ``loss()`` or the default loss, its ``data()`` or synthetic batches shaped
    like its example inputs, at any ``batch`` (the notes say which loss and data were used).
    The model is the workload's (seeded init) unless ``model`` is given (e.g. a trained
    one); data are the workload's real data where it has them (digits_cnn, digits_resnet,
    tiny_gpt, a file's ``data()``), else synthetic, unless ``data`` yields ``(inputs, targets)``.
    Results are cached on disk when neither ``model`` nor ``data`` is given, keyed by the
    workload (a user's file: its content's sha256 and function, never its path), the graph's
    structure, batch, batches, method, seed, gamma, rounding and the method's settings. A cached
    table is reused when it has a value for every op at every precision in ``needs`` that
    the op allows (``None``: every precision the op allows; e.g. a table made before int4
    joined the menus serves every cluster without int4).

    Before it builds and runs a model, it estimates the memory that takes
    (:func:`indicator_memory`) and refuses with one line when this machine has less
    (``memory_check=False`` skips that); ``random`` runs no model.

    ``report``: called with one line saying where the table came from (the cache, or
    computed, in how many seconds) and what it holds. ``progress``: a line per batch on a
    terminal, else one every :data:`PROGRESS_EVERY_S` seconds.

    ``curv``: the expected loss increase per step in nats, from ``hutchinson_samples``
    Hessian probes per batch; ``lr`` is the SGD rate of its backward (update) term (0 drops
    it; in the cache key).
    """
    settings = IndicatorSettings(method, batches, 0, seed, gamma, stochastic,
                                 hutchinson_samples, term_dtype, term_rows, lr)
    wl, b = checked_workload(workload, batch, settings)
    settings = dataclasses.replace(settings, batch=b)
    graph = graph or trace(wl, b, warn=False, cache=True)  # the caller's trace warned
    t_start = time.perf_counter()
    # a user's file is cached by its content hash (and function), never by its path
    path = None
    if cache and model is None and data is None:
        path = cache_path(wl.cache_name, graph, settings, cache_dir)
        table = cached_table(path, wl.name, graph, needs, method, report)
        if table is not None:
            return table
    torch.manual_seed(seed)
    ops = [o for o in graph.ops if o.role == OpRole.choosable]
    if method != "random":
        model = prepared_model(wl, graph, method, model, memory_check, progress)
    stream, data_kind = batch_stream(wl, data, settings)
    gen = torch.Generator().manual_seed(seed)
    rng_values = {o.name: torch.rand((), generator=gen).item() for o in ops}
    measured = Measurements({o.name: OpStats() for o in ops})
    if method != "random":
        assert model is not None
        measure(model, wl, ops, stream, settings, gen, measured,
                IndicatorProgress(progress, method, batches))
    table = measured_table(wl, graph, ops, settings, measured, data_kind, rng_values)
    return saved_and_reported(table, path, report, time.perf_counter() - t_start)
