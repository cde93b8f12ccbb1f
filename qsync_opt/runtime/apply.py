"""Put a plan into a model: swap each planned op's module for its precision-specific layer.

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

from ..errors import QsyncInputError
from ..precision import Precision
from ..schemas import ModelGraph, Plan
from .layers import _SWAPS, apply_precisions


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
        extra = (f"; {len(self.not_covered)} Linear/Conv2d/MatMul modules not in the plan run "
                 "as they are" if self.not_covered else "")
        return f"group {self.group}: {mix}{extra}"


def apply_plan(model: nn.Module, plan: Plan, group: str, *, graph: ModelGraph | None = None,
               seed: int = 0) -> ApplyReport:
    """Swap ``model``'s modules to ``plan``'s precisions for device group ``group``.

    Refused, with one line naming what differs: a group the plan lacks, a plan made for
    another graph (when ``graph`` is given: :func:`qsync_opt.plan.check_plan`; always: every
    planned op must be a Linear/Conv2d/MatMul module of ``model``). Reported: swappable
    modules the plan does not cover (they keep running as they are). ``seed`` seeds the
    layers' stochastic rounding (give each rank its own).
    """
    if group not in plan.groups:
        raise QsyncInputError(f"group: the plan has no group {group!r}; its groups: "
                              f"{', '.join(plan.groups)}")
    if graph is not None:  # the one plan check of every reader (hash, ops, pins, menus)
        from ..plan import check_plan

        check_plan(plan, graph)
    modules = dict(model.named_modules())
    wanted = plan.groups[group].precisions
    missing = [n for n in wanted if n not in modules]
    if missing:
        few = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise QsyncInputError(f"plan: made for {plan.workload}; this model lacks the planned "
                              f"ops {few}")
    swappable = {n for n, m in modules.items()
                 if any(isinstance(m, base) for _, base in _SWAPS)}
    applied = apply_precisions(model, wanted, seed=seed)
    return ApplyReport(group=group, applied={k: Precision(v) for k, v in applied.items()},
                       not_covered=sorted(swappable - set(wanted)))
