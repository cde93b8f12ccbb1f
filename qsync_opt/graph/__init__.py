"""Graph extraction: a workload (registry name, user file, or nn.Module) -> ModelGraph.

How it works:

1. The model is traced with ``torch.fx`` (torch.nn modules and qsync's ``MatMul`` are leaves,
   so op names are the module names users see in ``named_modules()``). For a registry
   workload the loss is spliced into the graph, so it appears as a pinned op.
2. The traced graph is run node by node on the ``meta`` device: parameters are swapped for
   meta tensors (no real allocation, whatever device the user's model lives on), inputs are
   meta tensors, autograd records as usual. Each node's output shapes come from that run,
   and each node's activations saved for backward are *measured* with
   ``torch.autograd.graph.saved_tensors_hooks`` (parameters and buffers excluded; a storage
   saved by an earlier op is recorded as shared, so memory is not counted twice).
3. Where symbolic tracing fails (data-dependent Python control flow, say), a fallback runs the
   model once on meta tensors under a ``TorchFunctionMode`` with module hooks: leaf modules
   and top-level torch functions become ops, edges follow tensor identity. If both fail,
   :class:`TraceError` says why in one line.
4. Post-processing is shared: kinds, roles (choosable / pinned with a reason / pass-through /
   promote), FLOPs (a multiply-add is 2 FLOPs), bytes, depths, the classifier head pin,
   optional tie groups.

The package, by job: :mod:`.tracing` (the entry point :func:`trace`, which looks the cache up
before importing torch), :mod:`.tracer` (the tracing itself), :mod:`.capture` (the
torch.fx tracer), :mod:`.fallback` (the function-mode tracer), :mod:`.recording` (what both
tracers share), :mod:`.annotate` (raw ops -> ModelGraph), :mod:`.roles` (the annotation's vocabulary and the
unseen ops), :mod:`qsync_opt.ops.kinds` (op kinds, leaf modules), :mod:`qsync_opt.ops.naming`
(:class:`CallNamer`) and :mod:`.cache` (traced graphs of built-in workloads kept on disk).
Workloads named by a string are resolved by :mod:`qsync_opt.models.resolve`, re-exported
here. Importing the package imports no torch: :func:`trace` finds a cached graph first, and
the names re-exported from modules that need torch are imported when first read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qsync_opt.core.lazy import lazy_getattr
from qsync_opt.core.modelspec import is_user_model, model_file_sha256
from qsync_opt.graph.roles import (
    ALL_GEMM_PRECISIONS,
    CONV_PRECISIONS,
    HEAD_REASON,
    PIN_REASONS,
    TIE_MODES,
    unseen_ops,
)
from qsync_opt.graph.tracing import trace

if TYPE_CHECKING:
    from qsync_opt.models.resolve import (
        load_user_model,
        load_user_workload,
        resolve_workload,
    )
    from qsync_opt.ops.kinds import is_conv1d_like, is_leaf_module
    from qsync_opt.ops.naming import CallNamer, gemm_call_kind

#: Names re-exported from modules that import torch -> their module, imported when first
#: read, so that importing the package (the command line does) and reading a cached graph
#: need no torch.
_LAZY = {
    "load_user_model": "qsync_opt.models.resolve", "load_user_workload": "qsync_opt.models.resolve",
    "resolve_workload": "qsync_opt.models.resolve",
    "is_conv1d_like": "qsync_opt.ops.kinds", "is_leaf_module": "qsync_opt.ops.kinds",
    "CallNamer": "qsync_opt.ops.naming", "gemm_call_kind": "qsync_opt.ops.naming",
}

__all__ = [
    "ALL_GEMM_PRECISIONS", "CONV_PRECISIONS", "HEAD_REASON", "PIN_REASONS", "TIE_MODES",
    "CallNamer", "gemm_call_kind", "is_conv1d_like", "is_leaf_module", "is_user_model",
    "load_user_model", "load_user_workload", "model_file_sha256", "resolve_workload", "trace",
    "unseen_ops",
]


#: the names above whose modules import torch, imported when first read
__getattr__ = lazy_getattr(__name__, globals(), _LAZY)
