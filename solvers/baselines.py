"""The field's baselines, scored by the same evaluator as the allocators.

* :class:`Uniform` ("uniform", QSync's UP): the strong groups at their reference precision,
  every other group at its lowest precision on every op. No search.
* :class:`DynamicBatching` ("dynamic-batching"): every group at its reference precision; the
  per-device batches are re-split, global batch fixed, so the groups take about the same
  time (QSync's other baseline: e.g. 144/112 for ResNet-50 on V100/T4).
* :class:`StrongOnly` ("strong-only"): the weak cards left out; the strong groups alone at
  their reference precision and their own batch. Its throughput answers the first question:
  do the weak cards pay at all?

None of them optimises the objective: each reports FEASIBLE when the evaluator finds no
violation of the problem's target and memory, otherwise INFEASIBLE, and returns its plan
either way so a comparison can show it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from qsync_opt.solvers.base import SolveOptions
from qsync_opt.solvers.report import finish
from qsync_opt.solvers.timing import Stopwatch

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.documents.schemas import ClusterSpec, Plan, SolveReport
from qsync_opt.problem.evaluator import Evaluation, evaluate
from qsync_opt.problem.groupmodel import GroupModel
from qsync_opt.problem.program import AllocationProblem

log = logging.getLogger(__name__)


def _verdict(problem: AllocationProblem, plan: Plan) -> tuple[str, Evaluation, str]:
    ev = evaluate(problem, plan)
    status = "FEASIBLE" if not ev.violations else "INFEASIBLE"
    text = (f"evaluated: linear makespan {ev.makespan_ms:.3f} ms, replayer "
            f"{ev.replay_makespan_ms:.3f} ms (target {ev.target_ms:.3f} ms), global batch "
            f"{ev.global_batch}, {ev.samples_per_s:.1f} samples/s"
            + (f"; violations: {'; '.join(ev.violations)}" if ev.violations else ""))
    return status, ev, text


def _stamp(sub: AllocationProblem, plan: Plan, solver: str, status: str, sw: Stopwatch
           ) -> Plan:
    """The plan with the provenance ``finish`` writes for plans it makes itself (no wall
    time: identical inputs give identical plan bytes; the report has it)."""
    prov = dict(plan.provenance)
    prov.update({"solver": solver, "status": status,
                 "objective": sub.objective(sub.assignment(plan))})
    return plan.model_copy(update={"provenance": prov})


def _scaled_notes(problem: AllocationProblem, sub: AllocationProblem) -> list[str]:
    """What a re-made cluster's costs took from the batch model (measured tables only)."""
    if sub.costs is problem.costs:
        return []
    return [f"costs not measured at this split: {n}" for n in sub.costs.notes
            if n.startswith("batch model:") and n not in problem.costs.notes]


def _sub_options(problem: AllocationProblem, cluster: ClusterSpec) -> Any:
    """The problem's options for a re-made cluster: the same target (so plans are compared
    against one number), strong groups kept where the new cluster still has them."""
    names = {g.name for g in cluster.groups}
    strong = problem.options.strong_groups
    if strong is not None and not set(strong) <= names:
        strong = None
    return dataclasses.replace(problem.options, target_ms=problem.target_ms, strong_groups=strong)


class Uniform:
    """QSync's UP baseline: strong groups at the reference, the others at one precision.

    ``options.uniform.precision`` picks the weak groups' precision: ``"lowest"``
    (default, as QSync's UP: each op's lowest choice), ``"fastest"`` (per group, the one
    uniform precision with the least linear time: on a T4 INT8 gives out FP32, so its casts
    can make uniform INT8 slower than uniform FP16), or a precision name (ops that cannot run
    it take their lowest choice).
    """

    name = "uniform"
    exact = False

    def is_available(self) -> bool:
        return True

    @staticmethod
    def _uniform(g: GroupModel, p: Precision) -> list[int]:
        return [c.index(p) if p in c else len(c) - 1 for c in g.choices]

    def _weak(self, g: GroupModel, how: str) -> tuple[list[int], str]:
        if how == "lowest":
            return g.lowest(), "the lowest precision"
        if how == "fastest":
            menu = sorted({p for c in g.choices for p in c}, key=lambda p: p.info.rank)
            best = min(menu, key=lambda p: (g.time_ms(self._uniform(g, p)), p.info.rank))
            return self._uniform(g, best), f"{best.value} (its fastest uniform precision)"
        try:
            p = Precision(how)
        except ValueError:
            raise QsyncInputError(
                f"uniform_precision: expected lowest, fastest or a precision name, got {how!r}"
            ) from None
        return self._uniform(g, p), p.value

    def solve(self, problem: AllocationProblem, options: SolveOptions
              ) -> tuple[Plan | None, SolveReport]:
        sw = Stopwatch()
        strong = set(problem.strong_groups)
        how = str(options.uniform.precision)
        chosen: list[str] = []
        with sw.solving():
            assignment: dict[str, list[int]] = {}
            for g in problem.groups:
                if g.name in strong:
                    assignment[g.name] = list(g.reference)
                else:
                    assignment[g.name], what = self._weak(g, how)
                    chosen.append(f"{g.name} at {what}")
            plan = problem.make_plan(assignment, {"solver": self.name})
            status, ev, text = _verdict(problem, plan)
        messages = [
            "uniform precision (QSync's UP baseline): strong group(s) "
            f"{', '.join(sorted(strong))} at the reference, "
            + (", ".join(chosen) + " on every op" if chosen else "no weak group"), text]
        return finish(problem, self.name, assignment, status=status,
                      mode="baseline: uniform precision, no search", options=options, sw=sw,
                      messages=messages, extra_options={"samples_per_s": ev.samples_per_s,
                                                        "uniform_precision": how})


class StrongOnly:
    """The strong groups alone, at the reference precision and their own batch."""

    name = "strong-only"
    exact = False

    def is_available(self) -> bool:
        return True

    def solve(self, problem: AllocationProblem, options: SolveOptions
              ) -> tuple[Plan | None, SolveReport]:
        sw = Stopwatch()
        strong = set(problem.strong_groups)
        with sw.building():
            cluster = problem.cluster.model_copy(update={
                "groups": [g for g in problem.cluster.groups if g.name in strong]})
            sub = problem.with_cluster(cluster, _sub_options(problem, cluster))
        with sw.solving():
            plan = sub.make_plan(sub.reference_assignment(), {"solver": self.name})
            status, ev, text = _verdict(problem, plan)
            plan = _stamp(sub, plan, self.name, status, sw)
        left = [g.name for g in problem.cluster.groups if g.name not in strong]
        messages = [
            f"strong-only: {', '.join(g.name for g in cluster.groups)} alone "
            f"({cluster.world_size} devices) at the reference precision, "
            + (f"{', '.join(left)} left out" if left else "no group left out")
            + f"; global batch {ev.global_batch} instead of {problem.global_batch}",
            *_scaled_notes(problem, sub), text]
        return finish(problem, self.name, None, status=status,
                      mode="baseline: strong groups only, no search", options=options, sw=sw,
                      messages=messages, plan=plan,
                      extra_options={"samples_per_s": ev.samples_per_s,
                                     "objective_strong_only": sub.objective(
                                         sub.reference_assignment())})


class DynamicBatching:
    """Reference precision everywhere; per-device batches re-split to balance the groups.

    The global batch (sum of count x batch) is kept exactly; every batch is a multiple of
    ``options.dynamic_batching.batch_multiple`` (default 1). The strong group with the most devices
    takes what is left of the global batch. With one other group its batch is found by
    binary search for the point where the two groups' linear times cross (both sides scored,
    memory respected, a narrowing step toward the side that fits when one does not); with
    more, by iterative proportional adjustment (each group's batch set to its measured
    samples per millisecond times a common time).
    """

    name = "dynamic-batching"
    exact = False
    #: Rounds of proportional adjustment with more than two groups.
    ROUNDS = 8

    def is_available(self) -> bool:
        return True

    def solve(self, problem: AllocationProblem, options: SolveOptions
              ) -> tuple[Plan | None, SolveReport]:
        sw = Stopwatch()
        multiple = int(options.dynamic_batching.batch_multiple)
        if multiple < 1:
            raise QsyncInputError(f"batch_multiple: expected a positive integer, got {multiple}")
        search = _Split(problem, multiple)
        with sw.solving():
            batches, notes = search.run()
            sub = search.problem(batches)
            plan = sub.make_plan(sub.reference_assignment(), {"solver": self.name})
            status, ev, text = _verdict(problem, plan)
            plan = _stamp(sub, plan, self.name, status, sw)
        split = ", ".join(f"{g.name} {b}" for g, b in zip(problem.groups, batches, strict=True))
        was = ", ".join(f"{g.name} {g.batch}" for g in problem.groups)
        times = search.scores[tuple(batches)][0]
        messages = [
            "dynamic batching (QSync's baseline): every group at its reference precision, "
            f"per-device batches re-split with the global batch {problem.global_batch} fixed: "
            f"{split} (was {was}); linear group times "
            + ", ".join(f"{g.name} {t:.2f} ms" for g, t in zip(problem.groups, times, strict=True))
            + f"; {len(search.scores)} split(s) scored", *notes,
            *_scaled_notes(problem, sub), text]
        return finish(problem, self.name, None, status=status,
                      mode="baseline: dynamic batching at the reference precision",
                      options=options, sw=sw, messages=messages, plan=plan,
                      extra_options={"samples_per_s": ev.samples_per_s,
                                     "batch_multiple": multiple, "splits_scored": len(search.scores),
                                     "batches": ",".join(str(b) for b in batches)})


class _Split:
    """Scores per-device batch splits (cached) and searches for a balanced one."""

    def __init__(self, problem: AllocationProblem, multiple: int) -> None:
        self.base = problem
        self.m = multiple
        self.counts = [g.count for g in problem.groups]
        self.total = problem.global_batch
        self.orig = [g.batch for g in problem.groups]
        strong = [i for i, g in enumerate(problem.groups) if g.name in problem.strong_groups]
        # The strong group with the most devices absorbs what the others leave.
        self.absorber = max(strong, key=lambda i: (self.counts[i], -i))
        # batches -> (linear time per group, fits per group, makespan)
        self.scores: dict[tuple[int, ...], tuple[list[float], list[bool], float]] = {}
        self._problems: dict[tuple[int, ...], AllocationProblem] = {}

    def problem(self, batches: Sequence[int]) -> AllocationProblem:
        key = tuple(batches)
        if key not in self._problems:
            cluster = self.base.cluster.model_copy(update={"groups": [
                g.model_copy(update={"batch_per_device": b})
                for g, b in zip(self.base.cluster.groups, batches, strict=True)]})
            self._problems[key] = (self.base if list(key) == self.orig else
                                   self.base.with_cluster(cluster, _sub_options(self.base, cluster)))
        return self._problems[key]

    def score(self, batches: Sequence[int]) -> tuple[list[float], list[bool], float]:
        key = tuple(batches)
        if key not in self.scores:
            sub = self.problem(key)
            ref = sub.reference_assignment()
            times = [g.time_ms(ref[g.name]) for g in sub.groups]
            fits = [g.memory_bytes(ref[g.name]) <= g.capacity_bytes for g in sub.groups]
            self.scores[key] = (times, fits, max(times) + sub.tail_ms)
        return self.scores[key]

    def _rank(self, batches: Sequence[int]) -> tuple[int, float]:
        _, fits, makespan = self.score(batches)
        return (0 if all(fits) else 1, makespan)

    def fill(self, batches: list[int]) -> list[int] | None:
        """Give the absorber what is left; None when that is not a positive multiple."""
        i = self.absorber
        rest = self.total - sum(c * b for j, (c, b) in enumerate(
            zip(self.counts, batches, strict=True)) if j != i)
        if rest <= 0 or rest % self.counts[i] or (rest // self.counts[i]) % self.m:
            return None
        out = list(batches)
        out[i] = rest // self.counts[i]
        return out

    def run(self) -> tuple[list[int], list[str]]:
        notes: list[str] = []
        n = len(self.counts)
        if n == 1:
            self.score(self.orig)
            return list(self.orig), ["one group: nothing to re-split"]
        best = list(self.orig)
        if all(b % self.m == 0 for b in self.orig):
            self.score(best)
        else:
            notes.append(f"the given batches are not multiples of {self.m}; searched splits only")
        if n == 2:
            found = self._two()
        else:
            found = self._proportional()
        candidates = [b for b in (found, best if tuple(best) in self.scores else None) if b]
        if not candidates:
            raise QsyncInputError(
                f"dynamic-batching: no split of the global batch {self.total} into "
                f"multiples of {self.m} per device exists for counts "
                f"{', '.join(str(c) for c in self.counts)}; change batch_multiple")
        pick = min(candidates, key=self._rank)
        if not all(self.score(pick)[1]):
            notes.append("no split scored fits every group's memory; the best one is returned")
        return pick, notes

    def _two(self) -> list[int] | None:
        """Binary search of the other group's batch for the crossing of the two times."""
        w, a = 1 - self.absorber, self.absorber
        cands = [b for b in range(self.m, self.total // self.counts[w] + 1, self.m)
                 if self._with(w, b) is not None]
        if not cands:
            return None

        def batches(j: int) -> list[int]:
            got = self._with(w, cands[j])
            assert got is not None  # (cands holds only the batches that fill)
            return got

        def at(j: int) -> tuple[list[float], list[bool], float]:
            return self.score(batches(j))

        # The other group's time grows with its batch and the absorber's shrinks.
        first = _first_true(0, len(cands), lambda j: at(j)[0][w] > at(j)[0][a])
        near = [j for j in (first - 1, first) if 0 <= j < len(cands)]
        j = min(near, key=lambda k: self._rank(batches(k)))
        fits = at(j)[1]
        if not fits[w]:
            # Its memory grows with its batch: the largest smaller batch that fits.
            k = _first_true(0, j, lambda k: not at(k)[1][w]) - 1
            if k >= 0 and all(at(k)[1]):
                j = k
        elif not fits[a]:
            # The absorber's memory shrinks as the other group takes more.
            k = _first_true(j + 1, len(cands), lambda k: at(k)[1][a])
            if k < len(cands) and all(at(k)[1]):
                j = k
        return self._with(w, cands[j])

    def _with(self, w: int, b: int) -> list[int] | None:
        batches = list(self.orig)
        batches[w] = b
        return self.fill(batches)

    def _proportional(self) -> list[int] | None:
        """Each group's batch proportional to its measured speed, the absorber the rest; a
        group that does not fit gets a cap below the batch it failed at."""
        batches = list(self.orig)
        best: list[int] | None = list(batches) if tuple(batches) in self.scores else None
        cap = [self.total // c for c in self.counts]
        for _ in range(DynamicBatching.ROUNDS):
            times, fits, _ = self.score(batches)
            for i, ok in enumerate(fits):
                if not ok and i != self.absorber:
                    cap[i] = min(cap[i], max(self.m, batches[i] - self.m))
            speed = [b / max(t, 1e-12) for b, t in zip(batches, times, strict=True)]
            common = self.total / sum(c * s for c, s in zip(self.counts, speed, strict=True))
            new = [min(cap[i], max(self.m, self.m * round(s * common / self.m)))
                   for i, s in enumerate(speed)]
            filled = self._repair(new)
            if filled is None or filled == batches:
                break
            batches = filled
            if best is None or self._rank(batches) < self._rank(best):
                best = list(batches)
        return best

    def _repair(self, batches: list[int]) -> list[int] | None:
        """Nudge non-absorber groups by one multiple until the absorber's share is valid."""
        out = self.fill(batches)
        if out is not None:
            return out
        others = [i for i in range(len(batches)) if i != self.absorber]
        for step in range(1, 4):
            for i in others:
                for sign in (1, -1):
                    trial = list(batches)
                    trial[i] += sign * step * self.m
                    if trial[i] >= self.m:
                        out = self.fill(trial)
                        if out is not None:
                            return out
        return None


def _first_true(lo: int, hi: int, pred: Callable[[int], bool]) -> int:
    """The smallest j in [lo, hi) with pred(j) for a predicate monotone False..True (hi if
    none)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
