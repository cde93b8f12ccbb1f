"""The step time of a pipeline before it runs: ``qsync-opt replay --pipeline-stages N``.

:func:`predict_pipeline` cuts the model as :func:`~qsync_opt.pipeline.spec.pipeline_spec`
would (the cuts given, or balanced on each stage's estimated ms with the boundaries weighed
by their bytes), costs each stage at its group's plan and each boundary at its compressors'
wire bytes, and hands them to :func:`qsync_opt.pipeline.gpipe.pipeline_step`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.costs.roofline import estimate
from qsync_opt.graph import trace
from qsync_opt.models import UnknownWorkloadError, get_workload
from qsync_opt.pipeline.gpipe import pipeline_step
from qsync_opt.pipeline.stages import (
    Pipeline,
    StageSplit,
    micro_sizes,
    plan_op_costs,
    split_stages,
    stage_costs,
)
from qsync_opt.strategy.codecs import Compressor, Identity, parse_compressor

__all__ = ["predict_pipeline"]


def predict_pipeline(workload: str, plan: Any, ranks: list[str], *,
                     cuts: list[str] | None, batch: int, micro_batches: int,
                     compress_act: str, compress_grad: str, gbps: list[float],
                     latency_us: float = 50.0) -> dict[str, Any]:
    """The replayer's step time of a pipeline (``qsync-opt replay --pipeline-stages N``).

    Stage ``k`` runs on rank ``k``'s group's card at that group's plan: its forward and
    backward ms per micro-batch are the roofline estimates of its ops at the micro-batch
    (:func:`~qsync_opt.pipeline.stages.plan_op_costs`); each boundary's bytes per
    micro-batch are the compressors' wire formula on the tensor that crosses (found by one
    forward at the micro-batch); a tensor that skips stages is charged to the link into its
    receiver. :func:`qsync_opt.pipeline.gpipe.pipeline_step` gives the GPipe step, at
    each link bandwidth, uncompressed and compressed. Under AQ-SGD a sample's first visit is
    sent whole; the prediction is the steady state, every sample seen."""
    S = len(ranks)
    if S < 2:
        raise QsyncInputError(f"--pipeline-stages: expected at least 2, got {S}")
    if not 1 <= micro_batches <= batch:
        raise QsyncInputError(f"--micro-batches: expected 1 to the batch ({batch}), got "
                              f"{micro_batches}")
    try:
        wl = get_workload(workload)
    except UnknownWorkloadError as exc:
        raise QsyncInputError(f"--model: {exc}") from None
    act_c = parse_compressor(compress_act)
    grad_c = parse_compressor(compress_grad)
    mb = micro_sizes(batch, micro_batches)[0]
    graph = trace(workload, mb)
    groups = [g.model_copy(update={"batch_per_device": mb}) for g in plan.cluster.groups]
    table = estimate(graph, plan.cluster.model_copy(update={"groups": groups}))
    fwd_c = [plan_op_costs(table, plan, g, part="fwd") for g in ranks]
    bwd_c = [plan_op_costs(table, plan, g, part="bwd") for g in ranks]
    torch.manual_seed(0)
    model = wl.build().float()
    example = wl.make_inputs(mb, torch.device("cpu"))
    split = _split(model, example, cuts, [plan_op_costs(table, plan, g) for g in ranks]
                   if not cuts else None, S)
    f = [stage_costs(split, fwd_c[k])[k] for k in range(S)]
    b = [stage_costs(split, bwd_c[k])[k] for k in range(S)]
    raw, act, grad, rows = _boundary_bytes(split, example, act_c, grad_c)
    steps = [_step_at(f, b, raw, act, grad, micro_batches=micro_batches, gbps=bw,
                      latency_us=latency_us) for bw in gbps]
    devices = {g.name: g.device for g in plan.cluster.groups}
    return {"workload": workload, "batch": batch, "micro_batches": micro_batches,
            "micro_batch": mb, "cuts": list(split.cuts), "compress_act": compress_act,
            "compress_grad": compress_grad, "latency_us": latency_us,
            "stages": [{"stage": k, "group": ranks[k], "device": devices[ranks[k]],
                        "fwd_ms": f[k], "bwd_ms": b[k]} for k in range(S)],
            "boundaries": rows, "steps": steps}


def _split(model: torch.nn.Module, example: Sequence[object], cuts: list[str] | None,
           costs: list[dict[str, float]] | None, S: int) -> StageSplit:
    """The model cut at ``cuts``, else balanced on each stage's ``costs``."""
    if cuts:
        if len(cuts) != S - 1:
            raise QsyncInputError(f"--cuts: {S} stages need {S - 1} cuts, got {len(cuts)}")
        try:
            return split_stages(model, cuts=cuts, example_inputs=example)
        except QsyncInputError as exc:
            raise QsyncInputError(f"--cuts: {str(exc).partition(': ')[2]}") from None
    return split_stages(model, n_stages=S, costs=costs, example_inputs=example)


def _boundary_bytes(split: StageSplit, example: Sequence[object], act_c: Compressor, grad_c: Compressor
                    ) -> tuple[list[float], list[float], list[float], list[dict[str, Any]]]:
    """Per link, the bytes a micro-batch sends raw, as compressed activations and as
    compressed gradients (found by one forward), and a row per boundary."""
    S = split.n_stages
    pipe = Pipeline(split)
    pipe.eval()
    with torch.no_grad():
        pipe.run(tuple(example))
    raw = [0.0] * (S - 1)
    act = [0.0] * (S - 1)
    grad = [0.0] * (S - 1)
    rows = []
    for name, bd in pipe.boundaries.items():
        if bd.last_shape is None:
            continue
        n = math.prod(bd.last_shape)
        link = bd.dst - 1
        raw[link] += Identity().wire_bytes(n, 4)
        act[link] += act_c.wire_bytes(n, 4)
        grad[link] += grad_c.wire_bytes(n, 4)
        rows.append({"name": name, "src": bd.src, "dst": bd.dst, "shape": list(bd.last_shape),
                     "raw_bytes": n * 4, "act_bytes": act_c.wire_bytes(n, 4),
                     "grad_bytes": grad_c.wire_bytes(n, 4)})
    return raw, act, grad, rows


def _step_at(f: list[float], b: list[float], raw: list[float], act: list[float],
             grad: list[float], *, micro_batches: int, gbps: float, latency_us: float
             ) -> dict[str, Any]:
    """The GPipe step at one link bandwidth, uncompressed and compressed."""
    plain = pipeline_step(f, b, raw, raw, micro_batches=micro_batches, gbps=gbps,
                          latency_us=latency_us)
    comp = pipeline_step(f, b, act, grad, micro_batches=micro_batches, gbps=gbps,
                         latency_us=latency_us)
    return {"gbps": gbps, "uncompressed_ms": plain.step_ms,
            "compressed_ms": comp.step_ms, "bubble_frac": comp.bubble_frac,
            "transfer_ms": comp.transfer_ms}
