"""Checks against the exact floating-point model: the input a backend refuses (numbers
that are not finite, costs the makespan cannot resolve, bad hints), how far an assignment
exceeds a group's budget and capacity (``FEAS_REL``), and the cheap proofs of no plan
from each group's least possible time and memory."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.problem.groupmodel import GroupModel, check_finite
from qsync_opt.problem.program import AllocationProblem

#: What the exact backends call feasible: time <= budget * (1 + FEAS_REL) and memory <=
#: capacity * (1 + FEAS_REL) in the floating-point model (100x inside the evaluator's
#: EVAL_TOL; it absorbs the last-ulp differences of ``target - tail`` against a sum of terms).
FEAS_REL = 1e-9


def check_hints(problem: AllocationProblem, hints: Mapping[str, Sequence[int]] | None) -> None:
    if hints is None:
        return
    for g in problem.groups:
        a = hints.get(g.name)
        if a is None or len(a) != len(g.choices) or any(
                not 0 <= k < len(c) for k, c in zip(a, g.choices, strict=True)):
            raise QsyncInputError(f"hints: group {g.name} needs one valid choice index per unit")



def time_lower_bound(g: GroupModel) -> float:
    """A cheap lower bound on the group's time (each term at its minimum)."""
    return (g.time0 + sum(min(r) for r in g.time1)
            + sum(min(min(row) for row in p.time) for p in g.pairs))


def memory_lower_bound(g: GroupModel) -> float:
    """A cheap lower bound on the group's memory (each term at its minimum)."""
    return (g.mem0 + sum(min(r) for r in g.mem1 if r)
            + sum(min(min(row) for row in p.mem) for p in g.pairs)
            + max([g.work0] + [min(r) for r in g.work1 if r]))


#: A cheap proof of no plan must exceed the budget or capacity by this relative margin
#: (far above every backend's feasibility tolerance, ``FEAS_REL``).
PROOF_REL = 1e-6


def cheap_infeasibility(problem: AllocationProblem, gis: Sequence[int] | None = None
                        ) -> list[str]:
    """Why no plan exists, from the groups' least possible time and memory alone (each term
    at its minimum, beyond the budget or capacity by :data:`PROOF_REL`); [] when that
    proves nothing. A proof for every backend: no assignment goes below these bounds, so
    no backend may call such a problem anything but infeasible (and none needs to scale
    costs far above a tiny budget to find out)."""
    budget = problem.group_budget_ms()
    out = []
    for gi in range(len(problem.groups)) if gis is None else gis:
        g = problem.groups[gi]
        lb = time_lower_bound(g)
        if lb > budget + PROOF_REL * max(abs(budget), abs(lb)):
            out.append(f"group {g.name}: infeasible, even its fastest choices take at least "
                       f"{lb:.6g} ms > budget {budget:.6g} ms")
        mb = memory_lower_bound(g)
        if mb > g.capacity_bytes + PROOF_REL * max(abs(g.capacity_bytes), abs(mb)):
            out.append(f"group {g.name}: infeasible, even its least-memory choices need at "
                       f"least {mb:.6g} B > capacity {g.capacity_bytes:.6g} B")
    return out


def infeasible_messages(problem: AllocationProblem, gis: Sequence[int], budget: float) -> list[str]:
    """For groups whose cheapest choices alone exceed the time budget, say so."""
    out = []
    for gi in gis:
        g = problem.groups[gi]
        lb = time_lower_bound(g)
        if lb > budget:
            out.append(f"group {g.name}: infeasible, even its fastest choices take at least "
                       f"{lb:.4f} ms > budget {budget:.4f} ms")
    return out


def check_numbers(problem: AllocationProblem) -> None:
    """Refuse, in one line naming the quantity, a problem whose coefficients or budget are
    not finite (they reach the solvers' scaling otherwise)."""
    check_finite(problem.groups, [u.ops[0] for u in problem.units])
    budget = problem.group_budget_ms()
    if not math.isfinite(budget):
        raise QsyncInputError(f"target_ms: expected a finite number, got {problem.target_ms!r} "
                              f"(group budget {budget!r} ms)")
    check_resolution(problem)


def check_resolution(problem: AllocationProblem) -> None:
    """Refuse, in one line, costs so extreme that the makespan cannot resolve the compute:
    every makespan is a group's compute plus the tail (last bucket's all-reduce and the
    optimizer), and the budget is the target less the tail; once one unit in the last place
    of the tail exceeds ``FEAS_REL`` of the groups' compute, the compute is lost in that sum
    (a 1e300 ms bucket makes every target's budget 0 while every makespan equals the
    target), and no backend can decide the problem. Finite is not enough."""
    tail = abs(problem.tail_ms)
    compute = max((time_lower_bound(g) for g in problem.groups), default=0.0)
    if compute > 0 and math.ulp(tail) > FEAS_REL * compute:
        raise QsyncInputError(
            f"costs: the makespan's tail (last bucket's all-reduce {problem.bucket_tail_ms:.6g} "
            f"ms plus the optimizer {problem.optimizer_ms:.6g} ms) is too large beside the "
            f"groups' compute (at least {compute:.6g} ms): one unit in the last place of it is "
            f"{math.ulp(tail):.3g} ms, more than {FEAS_REL:g} of the compute, so no makespan "
            "can resolve the compute; expected bucket and optimizer times of the size of the "
            "compute (check the costs file)")


def exact_violation(g: GroupModel, a: Sequence[int], budget: float, rel: float = FEAS_REL
                    ) -> tuple[float, float]:
    """How far ``a`` exceeds the group's time budget (ms) and capacity (bytes), beyond the
    relative tolerance ``rel``; 0 if not."""
    return (max(0.0, g.time_ms(a) - budget - rel * abs(budget)),
            max(0.0, g.memory_bytes(a) - g.capacity_bytes * (1 + rel)))

