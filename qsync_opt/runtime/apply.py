"""Put a plan into a model: each planned op runs at its precision (swapped layers, per-call
dispatch for functional GEMMs).

Three lines in an existing training script::

    plan = qsync_opt.Plan.load("plan.json")
    report = qsync_opt.runtime.apply_plan(model, plan, group="t4")
    model = torch.nn.parallel.DistributedDataParallel(model)   # as before

Parameters, buffers and ``state_dict`` keys are unchanged (FP32 master weights, FP32
gradients), so checkpoints and tools keep working and ranks with different plans stay in
lock-step under one all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.documents.schemas import ModelGraph, Plan
from qsync_opt.ops.layers import apply_precisions, classify_ops, swappable_kind
from qsync_opt.problem.plan import check_plan


@dataclass
class ApplyReport:
    group: str
    applied: dict[str, Precision]
    not_covered: list[str] = field(default_factory=list)  # swappable modules the plan omits

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for p in self.applied.values():
            counts[p.value] = counts.get(p.value, 0) + 1
        mix = ", ".join(f"{n} {p}" for p, n in sorted(counts.items(), key=lambda x: -x[1]))
        extra = (f"; {len(self.not_covered)} GEMM modules not in the plan run as they are"
                 if self.not_covered else "")
        return f"group {self.group}: {mix}{extra}"


def apply_plan(model: nn.Module, plan: Plan, group: str, *, graph: ModelGraph | None = None,
               seed: int = 0) -> ApplyReport:
    """Make ``model`` run ``plan``'s precisions for device group ``group``.

    Each planned op runs at its precision the way the tracer saw it: GEMM modules swapped for
    their precision-specific layers (Linear, Conv1d/2d, MatMul, HF-style Conv1D), the sub-ops
    of nn.MultiheadAttention in :class:`~qsync_opt.ops.layers.QMultiheadAttention`, and
    functional GEMMs and ``F.scaled_dot_product_attention`` per call
    (:class:`~qsync_opt.ops.dispatch.FunctionalDispatch`).

    Refused, with one line naming what differs: a group the plan lacks, a plan made for
    another graph (when ``graph`` is given: :func:`qsync_opt.problem.plan.check_plan`; always: every
    planned op must be an op of ``model``). Reported: GEMM modules the plan does not cover
    (they keep running as they are). ``seed`` seeds the layers' stochastic rounding (give
    each rank its own).
    """
    if group not in plan.groups:
        raise QsyncInputError(f"group: the plan has no group {group!r}; its groups: "
                              f"{', '.join(plan.groups)}")
    if graph is not None:  # the one plan check of every reader (hash, ops, pins, menus)
        check_plan(plan, graph)
    wanted = plan.groups[group].precisions
    how = classify_ops(model, wanted)
    missing = [n for n, h in how.items() if h in ("missing", "not_gemm")]
    if missing:
        few = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise QsyncInputError(f"plan: made for {plan.workload}; this model lacks the planned "
                              f"ops {few}")
    modules = dict(model.named_modules())
    mhas = {n for n, m in modules.items() if isinstance(m, nn.MultiheadAttention)}
    swappable = {n for n, m in modules.items() if swappable_kind(m) is not None
                 and n.rpartition(".")[0] not in mhas}
    applied = apply_precisions(model, wanted, seed=seed)
    return ApplyReport(group=group, applied={k: Precision(v) for k, v in applied.items()},
                       not_covered=sorted(swappable - set(wanted)))
