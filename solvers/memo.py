"""The memo of solved parts: a part an exact backend solved in this process, to optimality
or to no plan, is answered again without a run when the same program (the same digest of
its coefficients, the same backend options) comes back at a budget it answers."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

from qsync_opt.solvers.base import PartResult
from qsync_opt.solvers.checks import exact_violation

from qsync_opt.problem.groupmodel import GroupModel
from qsync_opt.problem.program import AllocationProblem


def group_digest(g: GroupModel) -> str:
    """A digest of everything a group's program is made of (choices, coefficients, pair
    terms, derived units, Omegas, share and capacity): equal digests, the same program at
    the same budget."""
    doc = (g.name, g.device, g.count, g.batch, g.weight, g.capacity_bytes,
           [tuple(p.value for p in c) for c in g.choices], g.time0, g.time1, g.mem0, g.mem1,
           g.work0, g.work1, g.omega1, [(p.a, p.b, p.time, p.mem) for p in g.pairs],
           g.reference, [(d.index, d.op, d.inputs, tuple(p.value for p in d.choices))
                         for d in g.derived])
    return hashlib.sha256(repr(doc).encode()).hexdigest()


#: Parts an exact backend solved in this process, by (backend's key, the groups' digests):
#: (time budget, PartResult) of each OPTIMAL or INFEASIBLE solve, newest last.
_PART_MEMO: dict[tuple[Any, ...], list[tuple[float, PartResult]]] = {}
#: Programs kept at most (the oldest are dropped first).
PART_MEMO_SIZE = 512


def clear_part_memo() -> None:
    """Forget every solved part (tests start from an empty memo)."""
    _PART_MEMO.clear()


def memo_key(memo: tuple[Any, ...], problem: AllocationProblem,
              gis: Sequence[int]) -> tuple[Any, ...]:
    return (memo, tuple(group_digest(problem.groups[gi]) for gi in gis))


def memo_hit(key: tuple[Any, ...], problem: AllocationProblem, gis: Sequence[int],
              budget: float) -> tuple[float, PartResult] | None:
    """A solved part that answers this one: the same program at this budget; an optimum
    at a budget no smaller whose plan meets this budget (it is feasible here, and no plan
    here is better than the optimum there); no plan at a budget no smaller."""
    for b, res in reversed(_PART_MEMO.get(key, [])):
        if b < budget:
            continue
        a = res.assignment or {}
        if b == budget or res.status == "INFEASIBLE" or all(
                exact_violation(problem.groups[gi], a[problem.groups[gi].name], budget)
                == (0.0, 0.0) for gi in gis):
            return b, dataclasses.replace(res, assignment=(
                {k: list(v) for k, v in a.items()} if res.assignment is not None else None))
    return None


def memo_store(key: tuple[Any, ...], budget: float, res: PartResult) -> None:
    if res.status not in ("OPTIMAL", "INFEASIBLE"):
        return
    if key not in _PART_MEMO and len(_PART_MEMO) >= PART_MEMO_SIZE:
        del _PART_MEMO[next(iter(_PART_MEMO))]
    _PART_MEMO.setdefault(key, []).append((budget, res))

