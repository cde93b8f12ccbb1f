"""A graph's annotation vocabulary, which needs no torch: the precision menus of GEMMs and
convolutions, why an op is pinned (:data:`PIN_REASONS`, :data:`HEAD_REASON`), the tie
modes, and the ops the planner cannot see inside (:func:`unseen_ops`)."""

from __future__ import annotations

import logging

from qsync_opt.core.precision import Precision
from qsync_opt.documents.schemas import ModelGraph, OpKind

log = logging.getLogger("qsync_opt.graph")  # one logger for the whole package

__all__ = ["ALL_GEMM_PRECISIONS", "CONV_PRECISIONS", "HEAD_REASON", "PIN_REASONS",
           "TIE_MODES", "unseen_ops", "warn_unseen"]


ALL_GEMM_PRECISIONS = [
    Precision.fp32, Precision.tf32, Precision.bf16, Precision.fp16,
    Precision.int8, Precision.int8_full, Precision.fp8, Precision.int4,
]


#: FP8 training kernels (Transformer Engine) cover GEMMs, not convolutions.
CONV_PRECISIONS = [p for p in ALL_GEMM_PRECISIONS if p != Precision.fp8]


PIN_REASONS = {
    OpKind.norm: "norm: fp32, as autocast runs layer_norm/group_norm (QSync let norms drop to "
    "16 bit; qsync-opt keeps autocast's choice; batch_norm runs in its input's dtype)",
    OpKind.softmax: "softmax: fp32, as autocast runs softmax/log_softmax",
    OpKind.loss: "loss: fp32, as autocast runs cross_entropy/nll_loss/mse_loss",
    OpKind.embedding: "embedding: a gather with no arithmetic to lower; runs in its weight dtype",
    OpKind.reduce: "reduction: fp32, as autocast runs sum/prod/cumsum/exp/log/pow",
}


HEAD_REASON = "classifier head: kept fp32 as QSync does (trace(..., pin_head=False) unpins it)"


#: ``trace(..., tie=)``'s values: no tie groups, or ops tied by block or by sibling.
TIE_MODES = ("none", "blocks", "siblings")


def unseen_ops(graph: ModelGraph, threshold: float = 0.01) -> list[str]:
    """The ops of kind "other" (computations the planner cannot choose a precision for and
    the cost model only guesses) that run GEMMs inside (every one: a ``torch.fx.wrap``-ed
    function, as torchvision's Swin attention, given its module's weights) or hold more than
    ``threshold`` (1%) of the model's parameters or forward FLOPs, one line each: name,
    target, GEMM calls inside, their shares (an opaque function's FLOPs are those it does
    inside).
    :func:`trace` logs them as a warning; the CLI's ``graph`` command can print them."""
    total_flops = sum(o.fwd_flops for o in graph.ops) or 1
    total_params = graph.param_count or 1
    out = []
    for o in graph.ops:
        if o.kind != OpKind.other:
            continue
        pf, pp = o.fwd_flops / total_flops, o.param_count / total_params
        if o.hidden_gemms > 0 or pf > threshold or pp > threshold:
            inside = f"{o.hidden_gemms} GEMM call(s) inside, " if o.hidden_gemms else ""
            out.append(f"{o.name} ({o.target}): {inside}{100 * pp:.1f}% of the parameters, "
                       f"{100 * pf:.1f}% of the forward FLOPs")
    return out


def warn_unseen(graph: ModelGraph) -> None:
    lines = unseen_ops(graph)
    if lines:
        log.warning("%s: %d op(s) the planner cannot see inside (kind other, running GEMMs "
                    "or over 1%% of the parameters or FLOPs): %s", graph.workload,
                    len(lines), "; ".join(lines))
