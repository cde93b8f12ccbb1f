"""The tracer behind :func:`qsync_opt.graph.tracing.trace`: a workload -> ModelGraph, fx then the
fallbacks (this module imports torch; the entry point does only on a cache miss)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from qsync_opt.core.errors import QsyncInputError, TraceError
from qsync_opt.documents.schemas import ModelGraph, TensorSpec
from qsync_opt.graph import cache as graph_cache
from qsync_opt.graph.annotate import build_graph
from qsync_opt.graph.capture import fx_raw_ops
from qsync_opt.graph.fallback import all_real, function_mode_raw_ops
from qsync_opt.graph.recording import RawOp
from qsync_opt.models import TraceInputs, Workload
from qsync_opt.models.resolve import is_user_model, load_user_workload, resolve_workload
from qsync_opt.models.user import split_inputs

log = logging.getLogger("qsync_opt.graph")  # one logger for the whole package


def _input_specs(inputs: Any) -> list[TensorSpec]:
    args, kwargs = split_inputs(inputs)
    named = [(f"input{i}", t) for i, t in enumerate(args)] + list(kwargs.items())
    return [TensorSpec(name=n, shape=list(t.shape), dtype=str(t.dtype).replace("torch.", ""))
            for n, t in named]


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return f"{exc.__class__.__name__}: {text.splitlines()[0] if text else ''}"


def _through_opaque(raw: list[RawOp], label: str,
                    function_mode: Callable[[], list[RawOp]]) -> tuple[list[RawOp], str]:
    """fx's ops, or, where fx kept a Python function that runs GEMMs or reads parameters as
    one opaque op (a ``torch.fx.wrap``-ed function, as torchvision's Swin attention), the
    function-mode tracer's, which sees inside it. If that tracer fails, fx's ops stay (the
    unseen-ops warning then names what is hidden)."""
    hiding = [o for o in raw if o.opaque and (o.hidden_gemms or o.params)]
    if not hiding:
        return raw, "fx"
    try:
        seen = function_mode()
    except Exception as exc:  # keep fx's graph; the warning names the opaque ops
        log.info("%s: fx keeps %d function call(s) opaque and function mode failed (%s)",
                 label, len(hiding), _first_line(exc))
        return raw, "fx"
    log.info("%s: fx keeps %d call(s) of %s as opaque ops running %d GEMM call(s); traced in "
             "function mode instead", label, len(hiding),
             ", ".join(sorted({o.target for o in hiding})), sum(o.hidden_gemms for o in hiding))
    return seen, "function_mode"


def trace_any(workload: str | Workload | nn.Module, batch: int | None, *, example_inputs: Any,
              include_loss: bool, pin_head: bool, unpin: Sequence[str], tie: str, name: str | None, method: str,
              model_sha256: str | None, cache: bool) -> ModelGraph:
    """:func:`qsync_opt.graph.tracing.trace` past its cache lookup: the workload resolved,
    traced (or its graph read from the cache where ``cache``), not yet warned about."""
    if isinstance(workload, str) and is_user_model(workload):
        workload = load_user_workload(workload, sha256=model_sha256)
    elif isinstance(workload, str):
        name = name or workload
        workload = resolve_workload(workload)
    if not isinstance(workload, Workload):
        setup, label, b = _module_setup(workload, batch, example_inputs, name)
        return _graph_of(setup, label, b, method, pin_head, unpin, tie)[0]
    return _workload_graph(workload, batch, name, include_loss, pin_head, unpin, tie,
                           method, cache)


def _workload_graph(wl: Workload, batch: int | None, name: str | None, include_loss: bool,
                    pin_head: bool, unpin: Sequence[str], tie: str, method: str,
                    cache: bool) -> ModelGraph:
    """The graph of a workload (from the cache where ``cache`` and its code is known)."""
    label = name or wl.name
    b = batch if batch is not None else wl.default_batch
    if b < 1:
        raise QsyncInputError(f"batch: expected a positive integer, got {b}")

    def run() -> ModelGraph:
        graph, outputs = _graph_of(wl.trace_inputs(b, include_loss), label, b, method,
                                   pin_head, unpin, tie)
        if outputs:
            wl.saw_outputs(outputs[0])
        sha = wl.sha256
        return graph.model_copy(update={"workload_sha256": sha}) if sha else graph

    digest = wl.code_digest if cache else None
    if digest is None:
        return run()
    if batch is None:  # so that a lookup without the registry finds the default batch
        graph_cache.store_default_batch(wl.cache_name, digest, b)
    settings: dict[str, object] = {"include_loss": include_loss, "pin_head": pin_head,
                                   "unpin": list(unpin), "tie": tie, "method": method,
                                   "name": label}
    return graph_cache.cached(graph_cache.cache_key(wl.cache_name, digest, b, settings), run)


def _module_setup(model: Any, batch: int | None, example_inputs: Any, name: str | None
                  ) -> tuple[TraceInputs, str, int]:
    """An ``nn.Module`` with its example inputs: what the tracer runs, its label and batch."""
    label = name or type(model).__name__
    ex = example_inputs
    if ex is None:
        raise QsyncInputError("example_inputs: required when tracing an nn.Module")
    inputs: Any
    if isinstance(ex, dict):
        inputs = dict(ex)
    else:
        inputs = (ex,) if isinstance(ex, torch.Tensor) else tuple(ex)
    flat = list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
    if not flat:
        raise QsyncInputError("example_inputs: expected at least one tensor")
    if not all(isinstance(t, torch.Tensor) for t in flat):
        raise QsyncInputError("example_inputs: expected tensors (a Tensor, a tuple or a "
                              "dict of them)")
    b = next((int(t.shape[0]) for t in flat if t.dim() > 0), 1)
    if batch is not None and batch != b:
        raise QsyncInputError(
            f"batch: an nn.Module is traced at its example inputs' batch ({b}), not {batch}")
    return TraceInputs(model, inputs), label, b


def _graph_of(setup: TraceInputs, label: str, b: int, method: str, pin_head: bool,
              unpin: Sequence[str], tie: str) -> tuple[ModelGraph, list[Any]]:
    """The graph of ``setup`` (the model in training mode, put back after), and the outputs
    the tracer saw."""
    model = setup.model
    was_training = model.training
    model.train()
    outputs: list[Any] = []
    try:
        raw, used = _raw_ops(setup, label, method, outputs)
    finally:
        model.train(was_training)
    if not raw:
        raise TraceError(f"cannot trace {label}: the model ran no operators")
    graph = build_graph(raw, workload=label, batch=b, inputs=_input_specs(setup.inputs),
                        model=model, method=used, pin_head=pin_head, unpin=unpin, tie=tie)
    return graph, outputs


def _raw_ops(setup: TraceInputs, label: str, method: str, outputs: list[Any]
             ) -> tuple[list[RawOp], str]:
    """The raw ops and the tracer that recorded them: fx, then function mode (on meta
    tensors, then on real ones where the model and inputs are real)."""
    model, targets, loss_fn = setup.model, setup.targets, setup.loss_fn
    args, kwargs = split_inputs(setup.inputs)
    errors: list[str] = []
    raw: list[RawOp] | None = None
    used = method
    if method in ("auto", "fx"):
        try:
            raw = fx_raw_ops(model, args, targets, loss_fn, kwargs=kwargs, sink=outputs)
            used = "fx"
        except Exception as exc:  # any tracer failure falls back, with its reason kept
            errors.append(f"torch.fx: {_first_line(exc)}")
            log.info("fx tracing of %s failed (%s); falling back", label, errors[-1])
            if method == "fx":
                raise TraceError(f"cannot trace {label}: {errors[-1]}") from None
        if raw is not None and method == "auto":
            raw, used = _through_opaque(raw, label, lambda: function_mode_raw_ops(
                model, args, targets, loss_fn, kwargs=kwargs, sink=outputs))
    if raw is not None:
        return raw, used
    try:
        return function_mode_raw_ops(model, args, targets, loss_fn, kwargs=kwargs,
                                     sink=outputs), "function_mode"
    except Exception as exc:
        errors.append(f"function mode: {_first_line(exc)}")
        if not (method == "auto" and all_real(model, args, kwargs)):
            raise TraceError(f"cannot trace {label}: " + "; ".join(errors)) from None
    # The model reads its inputs' values (a mask checked with .item(), say): meta
    # tensors have none, so it runs once on real tensors of the example's shapes.
    try:
        raw = function_mode_raw_ops(model, args, targets, loss_fn, kwargs=kwargs,
                                    sink=outputs, real=True)
    except Exception as exc:
        errors.append(f"function mode on real tensors: {_first_line(exc)}")
        raise TraceError(f"cannot trace {label}: " + "; ".join(errors)) from None
    log.info("%s: traced on real tensors (meta tracing failed: %s)", label,
             errors[-1].removeprefix("function mode: "))
    return raw, "function_mode_real"
