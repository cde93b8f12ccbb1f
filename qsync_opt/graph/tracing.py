"""The public entry point :func:`trace`: a workload -> ModelGraph. A built-in's graph is
looked up in the graph cache first, before torch or the tracer is imported (:mod:`.tracer`,
imported on a miss, traces: fx, then the fallbacks)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.modelspec import is_user_model, package_code_digest
from qsync_opt.documents.schemas import ModelGraph
from qsync_opt.graph import cache as graph_cache
from qsync_opt.graph.roles import warn_unseen

if TYPE_CHECKING:  # annotations only: a cached graph is found without torch
    from torch import nn

    from qsync_opt.models import Workload

log = logging.getLogger("qsync_opt.graph")  # one logger for the whole package

def trace(
    workload: str | Workload | nn.Module,
    batch: int | None = None,
    *,
    example_inputs: Any = None,
    include_loss: bool = True,
    pin_head: bool = True,
    unpin: Sequence[str] = (),
    tie: str = "none",
    name: str | None = None,
    method: str = "auto",
    model_sha256: str | None = None,
    warn: bool = True,
    cache: bool = False,
) -> ModelGraph:
    """Trace a workload into a :class:`ModelGraph` without allocating real memory.

    ``workload`` is a registry name (``qsync-opt models``), ``path/file.py:fn`` (a user's
    model file, :mod:`qsync_opt.models.user`), a :class:`~qsync_opt.models.Workload` (a
    built-in, or a user's file loaded), or an ``nn.Module`` with ``example_inputs``
    (a Tensor, a tuple of positional tensors, or a dict of keyword tensors). ``batch``
    overrides the batch (default: a registry workload's default batch, a user file's example
    batch; a user file at another batch is traced on synthetic inputs shaped like its
    example); an ``nn.Module`` is traced at its example inputs' batch. ``method`` is ``auto``
    (fx, then the function-mode fallback: where fx fails, and where fx keeps a Python
    function that runs GEMMs or reads parameters as one opaque op, a ``torch.fx.wrap``-ed
    one as torchvision's Swin attention), ``fx`` or ``function_mode``. ``warn``: log the
    ops the planner cannot see inside (:func:`~qsync_opt.graph.unseen_ops`). Where tracing on
    meta tensors fails (a model that reads its inputs' values, as HuggingFace BERT does with
    an attention mask) and the model and inputs are real, ``auto`` traces in function mode on
    real tensors of the example's shapes (``trace_method`` ``function_mode_real``). A
    ``path/file.py:fn`` workload is imported, which runs that file; with ``model_sha256`` the
    file must have that content hash, checked before it runs. The graph records the file's
    hash (``workload_sha256``), and so do the plans made from it. Graph input specs name
    keyword inputs by their keys (positional ones ``input0``, ...). ``cache``: a workload
    whose code is known in full (a built-in) is traced once per key, then read from the
    cache folder (:mod:`qsync_opt.graph.cache` says what the key holds).
    """
    if method not in ("auto", "fx", "function_mode"):
        raise QsyncInputError(f"method: expected auto, fx or function_mode, got {method!r}")
    graph = None
    if cache and isinstance(workload, str) and not is_user_model(workload):
        settings: dict[str, object] = {"include_loss": include_loss, "pin_head": pin_head,
                                       "unpin": list(unpin), "tie": tie, "method": method,
                                       "name": name or workload}
        graph = cached_builtin(workload, batch, settings)
    if graph is None:
        from qsync_opt.graph.tracer import trace_any  # lazy: the tracer imports torch

        graph = trace_any(workload, batch, example_inputs=example_inputs,
                          include_loss=include_loss, pin_head=pin_head, unpin=unpin, tie=tie,
                          name=name, method=method, model_sha256=model_sha256, cache=cache)
    if warn:
        warn_unseen(graph)
    return graph


def cached_builtin(workload: str, batch: int | None, settings: dict[str, object]
                   ) -> ModelGraph | None:
    """The cached graph of the built-in named ``workload`` (as the registry spells it) at
    ``batch`` (None: its default batch, as the cache last recorded it), found without
    importing the registry; None when there is none (the caller traces, which resolves the
    name and says what is wrong with it)."""
    if batch is not None and batch < 1:
        return None
    digest = package_code_digest()
    b = batch if batch is not None else graph_cache.load_default_batch(workload, digest)
    if b is None:
        return None
    key = graph_cache.cache_key(workload, digest, b, settings)
    graph = graph_cache.load_cached(key, quiet=True)
    if graph is not None:
        log.info("graph cache: reusing %s", graph_cache.cache_file(key))
    return graph
