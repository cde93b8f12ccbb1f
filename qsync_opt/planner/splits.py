"""Batch splits for the joint precision-and-split search, and the bounds that prune it.

:func:`batch_splits` lists the candidate per-group batches (global batch kept).
:class:`SplitBounds` lets the search skip candidates without solving them, exactly:

* **Monotone groups.** With a fixed target the groups do not interact, so a split's least
  degradation is the sum over groups of each group's own least (batch-weighted)
  degradation at its batch. When a group's coefficients (time, memory, working set, pair
  terms) do not decrease as its batch grows, its Omega rows are equal and non-negative and
  its share of the global batch grows with its batch, every plan feasible at a larger batch
  is feasible at a smaller one and costs no less there: its least degradation does not
  decrease with its batch, and if it has no plan at some batch it has none at any larger
  one. :class:`SplitBounds` checks this on the coefficients of every candidate, step by
  step between consecutive batches (nothing is assumed): a fact propagates from one batch
  to a larger one only across steps that pass (:meth:`SplitBounds.rises`), so a group
  monotone over part of its batches is bounded within that part (at the given split a
  strong group may be held at its reference precision, a menu of its own).
* **Lower bounds.** A candidate's objective is at least the sum over groups of the largest
  part that group had in a solved split at a batch no larger than this one (monotone
  groups), else the group's trivial floor. Solved parts count only from the exact PuLP
  backends and are discounted by twice their optimality gap (``rel_gap``); CP-SAT solves a
  rounded model and the heuristics none, so their objectives bound nothing (the floors do).
* **Relaxations.** Before a candidate is solved, each group's LP relaxation (HiGHS, every
  binary continuous) bounds its part from below, and proves the group has no plan when the
  relaxation has no point. These bounds hold for every backend's plan (each is an
  assignment of the exact model) and, on monotone groups, at every larger batch; a
  candidate whose relaxation already exceeds the best objective is never solved. On
  ResNet-50 the relaxation is within about 1% of the optimum near the best split.
* **Groups solved alone.** A candidate's group solved alone to optimality (exact PuLP
  backends) bounds its part exactly, discounted as solved parts are, and on a monotone
  group at every larger batch; a group solved alone to no plan leaves the candidate none
  (nor, on a monotone group, any candidate where it has a larger batch).
* **Provably infeasible.** A group whose least possible time (every term at its minimum)
  exceeds its time budget, or whose least possible memory exceeds its capacity, has no
  plan; for a monotone group, neither has it at any larger batch.

A candidate is solved only when its bound does not exceed the best objective found; the
ties are solved too (they are broken by the replayer's makespan).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.problem.groupmodel import GroupModel
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.solvers.checks import time_lower_bound
from qsync_opt.solvers.parts import part_floor

#: Relative margin below which a bound is taken to equal the best objective (not prune).
BOUND_REL = 1e-9
#: A cheap infeasibility proof must exceed the budget by this relative margin.
PROOF_REL = 1e-6


def batch_splits(problem: AllocationProblem, multiple: int | None = None,
                 limit: int = 64) -> list[dict[str, int]]:
    """Per-group per-device batches (multiples of ``multiple``) keeping the global batch.

    Default multiple: the smallest per-device batch / 16, at least 1. More than ``limit``
    candidates are thinned evenly; the problem's own split is always a candidate.
    """
    groups = problem.cluster.groups
    counts = [g.count for g in groups]
    own = [int(g.batch_per_device or problem.graph.batch_size) for g in groups]
    total = sum(n * b for n, b in zip(counts, own, strict=True))
    m = multiple or max(1, min(own) // 16)
    if m < 1:
        raise QsyncInputError(f"batch_multiple: expected a positive integer, got {m}")
    out: list[list[int]] = []

    def rec(i: int, left: int, acc: list[int]) -> None:
        if i == len(groups) - 1:
            if left > 0 and left % counts[i] == 0 and (left // counts[i]) % m == 0:
                out.append([*acc, left // counts[i]])
            return
        b = m
        while counts[i] * b < left:
            rec(i + 1, left - counts[i] * b, [*acc, b])
            b += m

    rec(0, total, [])
    if len(out) > limit:
        step = len(out) / limit
        out = [out[int(k * step)] for k in range(limit)]
    if own not in out:
        out.append(own)
    names = [g.name for g in groups]
    return [dict(zip(names, split, strict=True)) for split in out]


def memory_floor(g: GroupModel) -> float:
    """The least memory any assignment of the group has (each term at its minimum; the
    working set at least the largest of the units' least working sets)."""
    work = max([g.work0] + [min(r) for r in g.work1])
    return (g.mem0 + sum(min(r) for r in g.mem1)
            + sum(min(min(row) for row in p.mem) for p in g.pairs) + work)


def _no_less(a: GroupModel, b: GroupModel) -> bool:
    """Every coefficient of ``b`` at least ``a``'s, on the same structure (``b`` at the
    larger batch), the same Omega (non-negative) and capacity, a share no smaller."""
    if (a.choices != b.choices or a.derived != b.derived or len(a.pairs) != len(b.pairs)
            or a.omega1 != b.omega1 or a.capacity_bytes != b.capacity_bytes
            or b.weight < a.weight or b.time0 < a.time0 or b.mem0 < a.mem0
            or b.work0 < a.work0):
        return False
    if any(v < 0 for row in a.omega1 for v in row):
        return False
    for ra, rb in ((a.time1, b.time1), (a.mem1, b.mem1), (a.work1, b.work1)):
        if any(len(x) != len(y) or any(q < p for p, q in zip(x, y, strict=True))
               for x, y in zip(ra, rb, strict=True)):
            return False
    for pa, pb in zip(a.pairs, b.pairs, strict=True):
        if (pa.a, pa.b) != (pb.a, pb.b):
            return False
        for ma, mb in ((pa.time, pb.time), (pa.mem, pb.mem)):
            if any(q < p for x, y in zip(ma, mb, strict=True)
                   for p, q in zip(x, y, strict=True)):
                return False
    return True


class SplitBounds:
    """What solved candidates tell about the others (see the module's docstring).

    ``subs``: the problem re-made at each candidate split (same group order). The check of
    monotonicity runs once, here. What is learnt is a fact about a candidate *at a target*
    and holds at every smaller target too (a smaller target only removes plans), so it is
    kept across calls: :meth:`at` gives the view for one call's target and backend, sharing
    what every earlier call recorded (the Pareto sweep asks for the same candidates at many
    targets). :meth:`record` and :meth:`lower_bound` are cheap.
    """

    def __init__(self, subs: Sequence[AllocationProblem],
                 monotone: Sequence[bool] | None = None, *, enabled: bool = True) -> None:
        #: False: no bound and no proof (every candidate is solved: the reference procedure)
        self.enabled = enabled
        self.subs = list(subs)
        n_groups = len(self.subs[0].groups) if self.subs else 0
        self.batch = [[g.batch for g in s.groups] for s in self.subs]
        #: per group, the candidates in ascending batch and whether each step from one to
        #: the next keeps every coefficient no less (:func:`_no_less`)
        self._order = [sorted(range(len(self.subs)), key=[b[gi] for b in self.batch].__getitem__)
                       for gi in range(n_groups)]
        if monotone is None:
            same_tail = len({s.tail_ms for s in self.subs}) <= 1
            steps = [[same_tail and _no_less(self.subs[i].groups[gi], self.subs[j].groups[gi])
                      for i, j in zip(order, order[1:], strict=False)]
                     for gi, order in enumerate(self._order)]
        else:
            steps = [[bool(monotone[gi])] * max(len(order) - 1, 0)
                     for gi, order in enumerate(self._order)]
        self.monotone = [all(st) for st in steps]
        #: per group: the number of failed steps before each position, and each batch's
        #: first and last position in the order
        self._failed = [[0, *itertools.accumulate(not ok for ok in st)] for st in steps]
        self._span: list[dict[int, tuple[int, int]]] = []
        for gi, order in enumerate(self._order):
            span: dict[int, tuple[int, int]] = {}
            for pos, i in enumerate(order):
                b = self.batch[i][gi]
                span[b] = (span.get(b, (pos, pos))[0], pos)
            self._span.append(span)
        self.floor = [[part_floor(s, [gi]) for gi in range(n_groups)] for s in self.subs]
        #: (candidate, target, per-group parts of its optimum there), exact backends only
        self.parts: list[tuple[int, float, list[float]]] = []
        #: (candidate, target, per-group lower bounds there from the LP relaxation): they
        #: bound every backend's plan, so they count whatever the backend
        self.relaxed: list[tuple[int, float, list[float]]] = []
        #: (candidate, group, target, that group's part of the optimum there): one group's
        #: program solved alone to optimality, exact backends only
        self.group_parts: list[tuple[int, int, float, float]] = []
        #: (group, batch, target): one group's program solved alone by an exact backend
        #: has no plan there (read, as ``no_plan``, by exact views only)
        self.group_no_plan: list[tuple[int, int, float]] = []
        #: (candidate, target): the exact model has no plan there
        self.no_plan: list[tuple[int, float]] = []
        #: (group, batch, target): the group has no plan at that batch and target
        self.dead: list[tuple[int, int, float]] = []
        #: this view's target; whether solved parts and no-plan results count (exact PuLP
        #: backends only) and the factor parts are discounted by for the optimality gap
        self.target = float("inf")
        self.exact = True
        self.discount = 1.0

    def at(self, target_ms: float, *, exact: bool, discount: float = 1.0) -> SplitBounds:
        """The view for one call at ``target_ms`` (sharing everything recorded)."""
        out = copy.copy(self)
        out.target, out.exact, out.discount = float(target_ms), exact, discount
        return out

    def _holds(self, recorded_at: float) -> bool:
        """A fact recorded at that target holds at this view's target."""
        return recorded_at >= self.target * (1 - 1e-12)

    def rises(self, gi: int, low: int, high: int) -> bool:
        """Whether group ``gi``'s coefficients are no less at batch ``high`` than at ``low``
        (``low < high``, both candidates' batches): every step between them in ascending
        batch keeps every coefficient no less. A fact about the group at ``low`` (its least
        part, or that it has no plan) then holds at ``high`` too; a group that is monotone
        over only part of its batches propagates facts within that part."""
        if not low < high:
            return False
        first = self._span[gi][low][0]
        last = self._span[gi][high][1]
        return self._failed[gi][last] == self._failed[gi][first]

    def proven_infeasible(self, i: int) -> bool:
        """Whether candidate ``i`` has no plan at this target: an exact solve found none at
        a target no smaller, or a group of it has none, by the cheap floors or (monotone
        groups) at a batch no larger; what the floors prove is remembered."""
        if not self.enabled:
            return False
        if self.exact and any(j == i and self._holds(t) for j, t in self.no_plan):
            return True
        sub = self.subs[i]
        budget = self.target - sub.tail_ms
        for gi, g in enumerate(sub.groups):
            b = self.batch[i][gi]
            facts = self.dead + self.group_no_plan if self.exact else self.dead
            if any(h == gi and (bb == b or self.rises(gi, bb, b)) and self._holds(t)
                   for h, bb, t in facts):
                return True
            if (time_lower_bound(g) > budget + PROOF_REL * abs(budget)
                    or memory_floor(g) > g.capacity_bytes * (1 + PROOF_REL)):
                self.dead.append((gi, b, self.target))
                return True
        return False

    def record(self, i: int, parts: list[float] | None) -> None:
        """Candidate ``i`` solved at this target by an exact backend to optimality: its
        per-group parts of the objective, or None (no plan). Other backends record nothing."""
        if not self.exact:
            return
        if parts is None:
            self.no_plan.append((i, self.target))
        else:
            self.parts.append((i, self.target, parts))

    def record_group(self, i: int, gi: int, part: float | None) -> None:
        """Group ``gi`` of candidate ``i`` solved alone at this target by an exact backend to
        optimality: its part of the objective, or None (the group has no plan there, so
        neither has the candidate). Other backends record nothing."""
        if not self.exact:
            return
        if part is None:
            self.group_no_plan.append((gi, self.batch[i][gi], self.target))
        else:
            self.group_parts.append((i, gi, self.target, part))

    def record_relaxed(self, i: int, bounds: list[float | None]) -> None:
        """Candidate ``i``'s per-group lower bounds at this target from the LP relaxation
        (None: that group's relaxation has no point, so the group has no plan there)."""
        for gi, v in enumerate(bounds):
            if v is None:
                self.dead.append((gi, self.batch[i][gi], self.target))
        if all(v is not None for v in bounds):
            self.relaxed.append((i, self.target, [float(v or 0.0) for v in bounds]))

    def lower_bound(self, i: int) -> float:
        """A lower bound on candidate ``i``'s least objective at this target."""
        if not self.enabled:
            return float("-inf")
        return sum(self.group_bound(i, gi) for gi in range(len(self.batch[i])))

    def group_bound(self, i: int, gi: int) -> float:
        """A lower bound on group ``gi``'s part of candidate ``i``'s least objective at this
        target (its floor, else what a relaxation or an optimum recorded tells)."""
        if not self.enabled:
            return float("-inf")
        best = self.floor[i][gi]
        b = self.batch[i][gi]
        facts = [(j, t, parts[gi], 1.0) for j, t, parts in self.relaxed]
        if self.exact:
            facts += [(j, t, parts[gi], self.discount) for j, t, parts in self.parts]
            facts += [(j, t, part, self.discount) for j, h, t, part in self.group_parts
                      if h == gi]
        for j, t, part, discount in facts:
            bj = self.batch[j][gi]
            if (bj == b or self.rises(gi, bj, b)) and self._holds(t):
                best = max(best, part * discount)
        return best

    def beats(self, bound: float, best: float) -> bool:
        """Whether a candidate with this lower bound can still match or beat ``best``."""
        if not self.enabled:
            return True
        return bound <= best + BOUND_REL * max(abs(best), 1e-300)
