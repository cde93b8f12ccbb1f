"""Re-planning a running job: the problem built once, a re-plan is only a solve.

:class:`ReplanCache` holds what every re-plan of one plan needs: the traced graph, the
plan's whole cluster, its costs and indicator and the problem's options, with the
:class:`~qsync_opt.problem.program.AllocationProblem` built from them once (its coefficient
schedules are shared by every problem a re-plan makes). :meth:`ReplanCache.replan` takes
the groups present (any subset of the plan's) and the groups measured slower than their
costs say (``slowdown``: group -> factor on its compute time terms), and solves the joint
precision and batch split (:func:`qsync_opt.planner.joint.solve_joint`) over the present
groups with the global batch kept. Nothing is traced, profiled or estimated from the
catalog again: costs for another world size come from the table's own batch model
(:class:`~qsync_opt.costs.batchmodel.TableCosts`), as for any split.

The rules a re-plan keeps (tests/planner/test_replan.py holds each):

* **Global batch.** Kept (the plan's sum over its groups of batch x count) unless given.
  The solve starts from it split evenly over the present devices (as ``solve
  --joint-split`` on a cluster written without batches: that split sets the default
  target, the strong groups at their reference, no straggler) and searches the splits
  that keep it. Where no split over the present devices sums to it exactly (e.g. an odd
  global batch over two groups of 16), the largest global batch below it that one does is
  used and a ``changes`` line says so. Where the present groups cannot hold it in memory
  at any split, the re-plan is refused (:class:`QsyncInputError`, ``global_batch: ...``,
  naming each group's least memory against its capacity): the run stops with its
  checkpoint rather than train another job silently.
* **Slowdown.** ``slowdown[g] = f`` multiplies group g's compute time terms by f (memory
  and degradation unchanged). Accepted: a real number with 1 <= f <= :data:`MAX_FACTOR`;
  NaN, infinities, 0, negatives, factors below 1 (a group faster than its costs is the
  calibration's business, not the planner's), booleans and strings are refused naming
  the group. A factor for a known group that is not present is ignored.
* **Never slower than keeping the plan.** When some present group is slowed (a factor
  above 1) and the current plan still applies (the same groups and global batch), the
  target is capped at the current plan's predicted step under that slowdown, and if the
  solver's plan is still predicted slower (the lexicographic fallback's slack), the
  current plan is kept (a ``changes`` line says so). Without a slowdown the solver's
  plan is returned as it is (a slowdown that went away gives the precision back).
* **Predictions.** The linear model's (the plan's ``makespan_ms`` and each group's
  compute ``time_ms``), slowdown included; a re-plan runs no replayer refinement (the
  replayer does not know the slowdown), so plans from ``solve`` with refinement may differ.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qsync_opt.core.errors import QsyncInputError, one_line
from qsync_opt.documents import outfolder
from qsync_opt.documents.base import MAX_BATCH
from qsync_opt.documents.io import parse_document, to_json
from qsync_opt.documents.schemas import (
    ClusterSpec,
    CostTable,
    IndicatorTable,
    ModelGraph,
    Plan,
)
from qsync_opt.graph import trace
from qsync_opt.planner.call import backend_for
from qsync_opt.planner.errors import InfeasibleError
from qsync_opt.planner.solve import build_problem, solve
from qsync_opt.problem.plan import check_plan
from qsync_opt.problem.program import AllocationProblem, DerivedCache, ProblemOptions
from qsync_opt.solvers import SolveOptions

__all__ = ["CACHE_KIND", "CACHE_VERSION", "MAX_FACTOR", "ReplanCache", "Replanned"]

#: What a cache file says it is, and its layout version.
CACHE_KIND = "qsync-opt replan cache"
CACHE_VERSION = 1
#: The largest slowdown factor accepted (a group 1000x slower is gone, not slow).
MAX_FACTOR = 1000.0
#: The solver of a re-plan (CP-SAT: one worker on these programs, so deterministic).
DEFAULT_SOLVER = "cpsat"
#: Seconds a re-plan's solve may take at most (it is stopped there: SolveTimeLimit).
DEFAULT_TIME_LIMIT_S = 30.0
#: :meth:`ReplanCache.warm` makes every subset ahead up to this many groups (2**n - 1 sets).
WARM_GROUPS = 4
#: Provenance keys of a plan that set the re-plan's options when none are given.
_OPTION_KEYS = ("memory_headroom", "optimizer", "reference")


@dataclass(frozen=True)
class Replanned:
    """One re-plan's result (see the module docstring for the rules)."""

    #: the plan for the groups given only (cluster restricted to them)
    plan: Plan
    #: the plan's predicted step time (linear model, slowdown included), ms
    predicted_step_ms: float
    #: per group, the compute part (ms per step of one device), slowdown included: what the
    #: runtime compares with its measured ``compute_ms``
    predicted_group_ms: dict[str, float]
    #: wall seconds of the re-solve alone (problem restricted, solved, scored)
    solve_s: float
    #: what changed beyond precisions, one line each
    changes: list[str] = field(default_factory=list)


class ReplanCache:
    """Everything a re-plan of ``plan`` needs, for any subset of its groups and any slowdown."""

    def __init__(self, problem: AllocationProblem, plan: Plan, *, solver: str = DEFAULT_SOLVER,
                 batch_multiple: int | None = None,
                 time_limit_s: float = DEFAULT_TIME_LIMIT_S) -> None:
        check_plan(plan, problem.graph)
        if [g.name for g in plan.cluster.groups] != [g.name for g in problem.cluster.groups]:
            raise QsyncInputError("plan: its groups are not the problem's")
        if batch_multiple is not None and (isinstance(batch_multiple, bool) or not isinstance(
                batch_multiple, int) or not 1 <= batch_multiple <= MAX_BATCH):
            raise QsyncInputError(
                f"batch_multiple: expected a positive integer, got {batch_multiple!r}")
        if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not (
                0 < time_limit_s <= 3600):
            raise QsyncInputError(
                f"time_limit_s: expected seconds in (0, 3600], got {time_limit_s!r}")
        if problem.derived is None:  # every problem a re-plan makes shares what it derived
            problem.derived = DerivedCache()
        self.problem = problem
        self.plan = plan
        self.solver = solver
        self.batch_multiple = batch_multiple
        self.time_limit_s = float(time_limit_s)

    # ------------------------------------------------------------------ building

    @classmethod
    def build(cls, plan: Plan, model: str | ModelGraph, *,
              indicator: str | Path | IndicatorTable | None = None,
              costs: str | Path | CostTable | None = None,
              options: ProblemOptions | None = None, solver: str = DEFAULT_SOLVER,
              batch_multiple: int | None = None, time_limit_s: float = DEFAULT_TIME_LIMIT_S,
              indicator_method: str | None = None) -> ReplanCache:
        """Build the problem of ``plan``'s whole cluster once, as ``qsync-opt solve`` does
        by default (:func:`~qsync_opt.planner.solve.build_problem`: roofline costs, the
        indicator computed on this CPU and cached) unless ``indicator``/``costs`` are
        given. ``options`` None: the plan's provenance's memory headroom, optimizer and
        reference precision (the target is not kept: each re-plan takes the present
        groups' default). ``indicator_method``: how the indicator is computed when none is
        given (None: the plan's provenance's method, else ``solve``'s default)."""
        graph = model if isinstance(model, ModelGraph) else trace(model, _graph_batch(plan))
        check_plan(plan, graph)
        method = plan.provenance.get("indicator_method")
        if indicator_method is None:  # the indicator the plan was made with, else the default
            indicator_method = method if isinstance(method, str) else "qsync"
        if options is None:
            prov = {k: plan.provenance[k] for k in _OPTION_KEYS if k in plan.provenance}
            try:
                options = ProblemOptions(**prov)  # type: ignore[arg-type]
            except (TypeError, ValueError) as exc:
                raise QsyncInputError(one_line(f"plan: provenance options: {exc}")) from None
        base, _ = even_cluster(plan.cluster, [g.name for g in plan.cluster.groups],
                               _global_batch(plan))
        problem = build_problem(graph, base, indicator=indicator, costs=costs,
                                options=options, indicator_method=indicator_method)
        return cls(problem, plan, solver=solver, batch_multiple=batch_multiple,
                   time_limit_s=time_limit_s)

    # ------------------------------------------------------------------ the file

    def to_json(self) -> str:
        p = self.problem
        doc = {"kind": CACHE_KIND, "version": CACHE_VERSION, "solver": self.solver,
               "batch_multiple": self.batch_multiple, "time_limit_s": self.time_limit_s,
               "options": p.options.to_json(),
               **{k: json.loads(to_json(d, indent=None)) for k, d in (
                   ("plan", self.plan), ("graph", p.graph), ("costs", p.costs),
                   ("indicator", p.indicator))}}
        return json.dumps(doc, separators=(",", ":")) + "\n"

    def save(self, path: str | Path) -> None:
        """Write the cache atomically as ``path`` inside its folder, never through a link."""
        target = Path(path)
        outfolder.write_text(target.parent, target.name, self.to_json(), what="replan cache")

    @classmethod
    def load(cls, path: str | Path) -> ReplanCache:
        """Read a cache :meth:`save` wrote; a missing, foreign, corrupt or other-version file
        (or a link) is refused in one line naming it. The problem is rebuilt from the
        stored documents (no tracing, profiling or estimating)."""
        target = Path(path)
        where = f"replan cache {target}"
        data = outfolder.read_bytes(target.parent, target.name, what="replan cache")
        if data is None:
            raise QsyncInputError(f"{where}: no such file")
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise QsyncInputError(f"{where}: not a JSON file (corrupt or truncated)") from None
        if not isinstance(doc, dict) or doc.get("kind") != CACHE_KIND:
            raise QsyncInputError(f"{where}: not a replan cache (no kind {CACHE_KIND!r})")
        if doc.get("version") != CACHE_VERSION:
            raise QsyncInputError(f"{where}: version {doc.get('version')!r}, this qsync-opt "
                                  f"reads version {CACHE_VERSION}")
        try:
            cache = cls._from_doc(doc, where)
        except QsyncInputError as exc:
            raise QsyncInputError(one_line(f"{where}: {exc}")) from None
        except (TypeError, ValueError, KeyError) as exc:
            raise QsyncInputError(one_line(f"{where}: corrupt ({type(exc).__name__}: {exc})")
                                  ) from None
        # the solver's library imported with the cache, not in the first re-plan (OR-Tools
        # takes about 0.2 s, pandas with it): a process that loads a cache will re-plan
        backend_for(cache.solver)
        return cache

    @classmethod
    def _from_doc(cls, doc: dict[str, Any], where: str) -> ReplanCache:
        plan = parse_document(doc["plan"], Plan, "plan")
        graph = parse_document(doc["graph"], ModelGraph, "graph")
        costs = parse_document(doc["costs"], CostTable, "costs")
        indicator = parse_document(doc["indicator"], IndicatorTable, "indicator")
        if not isinstance(doc["options"], dict):
            raise QsyncInputError("options: expected an object")
        options = ProblemOptions(**doc["options"])
        base, _ = even_cluster(plan.cluster, [g.name for g in plan.cluster.groups],
                               _global_batch(plan))
        problem = AllocationProblem(graph, base, costs, indicator, options)
        return cls(problem, plan, solver=str(doc["solver"]),
                   batch_multiple=doc["batch_multiple"], time_limit_s=doc["time_limit_s"])

    def warm(self, max_groups: int = WARM_GROUPS) -> float:
        """Make, ahead of any re-plan, what re-plans of the plan's groups derive (each
        candidate split's costs and coefficients, the solver's libraries): one re-plan of
        every non-empty subset of the groups when there are at most ``max_groups`` of them,
        else of all of them. Later re-plans of those groups, slowed or not, then only scale
        and solve. Returns the seconds it took."""
        t0 = time.perf_counter()
        names = [g.name for g in self.plan.cluster.groups]
        sets = ([list(c) for k in range(len(names), 0, -1)
                 for c in itertools.combinations(names, k)]
                if len(names) <= max_groups else [names])
        for present in sets:
            try:
                self.replan(present)
            except QsyncInputError:
                continue  # a subset with no plan (memory): nothing to make ahead
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ re-planning

    @property
    def global_batch(self) -> int:
        """The plan's global batch: its groups' batch per device times count, summed."""
        return _global_batch(self.plan)

    def replan(self, groups: Sequence[str], slowdown: Mapping[str, float] | None = None,
               global_batch: int | None = None, *, current: Plan | None = None) -> Replanned:
        """The plan for the ``groups`` present with ``slowdown`` (group -> factor on its
        compute time), keeping the global batch (or ``global_batch``). ``current``: the
        plan running now (default: the cache's plan), which a slowed re-plan never loses to
        (module docstring)."""
        present = self._present(groups)
        factors = self._factors(slowdown or {}, present)
        total = self._global_batch(global_batch)
        t0 = time.perf_counter()
        changes: list[str] = []
        gone = [g.name for g in self.plan.cluster.groups if g.name not in present]
        if gone:
            changes.append(f"groups gone: {', '.join(gone)}; planned over "
                           f"{', '.join(present)}")
        cluster, kept = self._start_cluster(present, total, changes)
        now = current or self.plan
        slowed = any(f > 1.0 for f in factors.values())
        base = self.problem.with_cluster(cluster, self._options(None), time_scale=factors)
        keep = self._current_step(now, cluster, factors) if slowed else None
        sub = base
        if keep is not None and keep < base.target_ms * (1 - 1e-9):
            sub = self.problem.with_cluster(cluster, self._options(keep), time_scale=factors)
        plan = self._solve(sub, present, kept)
        step, group_ms = self.predict(plan, factors)
        if keep is not None and step > keep * (1 + 1e-9):
            changes.append(f"kept the current plan: the re-solve predicts {step:.3f} ms, "
                           f"the current plan {keep:.3f} ms under this slowdown")
            plan = now
            step, group_ms = self.predict(plan, factors)
        changes.extend(_split_lines(now, plan))
        for g, f in sorted(factors.items()):
            if f != 1.0:
                changes.append(f"group {g}: compute costs scaled by {f:g} (measured slowdown)")
        return Replanned(plan=plan, predicted_step_ms=step, predicted_group_ms=group_ms,
                         solve_s=time.perf_counter() - t0, changes=changes)

    # ------------------------------------------------------------------ pieces

    def _present(self, groups: Sequence[str]) -> list[str]:
        if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence | set |
                                                                 frozenset):
            raise QsyncInputError(f"groups: expected a list of group names, got {groups!r}")
        names = [g.name for g in self.plan.cluster.groups]
        bad = [g for g in groups if not isinstance(g, str) or g not in names]
        if bad:
            raise QsyncInputError(f"groups: unknown group(s) {', '.join(map(repr, bad))}; the "
                                  f"plan's groups: {', '.join(names)}")
        if not groups:
            raise QsyncInputError("groups: no group present (a re-plan needs at least one)")
        given = set(groups)
        return [n for n in names if n in given]

    def _factors(self, slowdown: Mapping[str, float], present: list[str]) -> dict[str, float]:
        if not isinstance(slowdown, Mapping):
            raise QsyncInputError(f"slowdown: expected group -> factor, got {slowdown!r}")
        names = {g.name for g in self.plan.cluster.groups}
        out: dict[str, float] = {}
        for g, f in slowdown.items():
            if g not in names:
                raise QsyncInputError(f"slowdown: unknown group {g!r}; the plan's groups: "
                                      f"{', '.join(sorted(names))}")
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not (
                    math.isfinite(f) and 1.0 <= f <= MAX_FACTOR):
                raise QsyncInputError(
                    f"slowdown: group {g}: expected a factor from 1 to {MAX_FACTOR:g} (its "
                    f"compute time over its costs'), got {f!r}")
            if g in present:
                out[g] = float(f)
        return out

    def _global_batch(self, global_batch: int | None) -> int:
        if global_batch is None:
            return self.global_batch
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) or not (
                1 <= global_batch <= MAX_BATCH):
            raise QsyncInputError(f"global_batch: expected a whole number of samples from 1 "
                                  f"to {MAX_BATCH}, got {global_batch!r}")
        return global_batch

    def _start_cluster(self, present: list[str], total: int, changes: list[str]
                       ) -> tuple[ClusterSpec, int]:
        """:func:`even_cluster` of the present groups, with a line in ``changes`` for the
        global batch (kept, asked, or lowered to what the present devices can split)."""
        cluster, kept = even_cluster(self.plan.cluster, present, total)
        if kept != total:
            changes.append(f"global batch {total} -> {kept}: no split over "
                           + ", ".join(f"{g.name} x{g.count}" for g in cluster.groups)
                           + f" sums to {total}")
        elif total == self.global_batch:
            changes.append(f"global batch {total} kept")
        else:
            changes.append(f"global batch {self.global_batch} -> {total} (as asked)")
        return cluster, kept

    def _options(self, target_ms: float | None, lower_reference: bool | None = None
                 ) -> ProblemOptions:
        return dataclasses.replace(self.problem.options, target_ms=target_ms,
                                   strong_groups=None, lower_reference=lower_reference)

    def _scored(self, cluster: ClusterSpec, factors: Mapping[str, float]) -> AllocationProblem:
        """The problem that scores any plan of ``cluster`` (no group held, as the evaluator)."""
        return self.problem.with_cluster(cluster, self._options(None, lower_reference=True),
                                         time_scale=factors)

    def _current_step(self, now: Plan, cluster: ClusterSpec, factors: Mapping[str, float]
                      ) -> float | None:
        """The current plan's predicted step under ``factors`` when it still applies (the
        same groups, devices, counts and global batch as ``cluster``), else None."""
        def shape(c: ClusterSpec) -> list[tuple[str, str, int]]:
            return [(g.name, g.device, g.count) for g in c.groups]

        if shape(now.cluster) != shape(cluster) or sum(
                g.count * now.groups[g.name].batch_per_device for g in now.cluster.groups
        ) != sum(g.count * int(g.batch_per_device or 1) for g in cluster.groups):
            return None
        return self.predict(now, factors)[0]

    def predict(self, plan: Plan, slowdown: Mapping[str, float] | None = None
                ) -> tuple[float, dict[str, float]]:
        """``plan``'s predicted step (ms) and each group's compute part, as a re-plan
        predicts them (the linear model), under ``slowdown`` (group -> factor)."""
        factors = self._factors(slowdown or {}, [g.name for g in plan.cluster.groups])
        prob = self._scored(plan.cluster, factors)
        a = prob.assignment(plan)
        return prob.makespan_ms(a), {g.name: g.time_ms(a[g.name]) for g in prob.groups}

    def _solve(self, sub: AllocationProblem, present: list[str], total: int) -> Plan:
        opts = SolveOptions(time_limit_s=self.time_limit_s)
        try:
            plan, _ = solve(sub, self.solver, opts, refine=0, joint_split=True,
                            batch_multiple=self.batch_multiple, compare_ties=False)
        except InfeasibleError as exc:
            raise QsyncInputError(one_line(
                f"global_batch: no plan of {', '.join(present)} holds the global batch "
                f"{total}: {exc}")) from None
        check_plan(plan, self.problem.graph)
        return plan


def even_cluster(cluster: ClusterSpec, present: Sequence[str], total: int
                 ) -> tuple[ClusterSpec, int]:
    """``cluster``'s groups named in ``present`` with ``total`` samples split evenly over
    their devices (the solve's given split, as a cluster written without batches: it sets
    the default target, the strong groups at their reference at that batch), and the
    global batch it holds: ``total``, or the largest below it that the present devices
    can split exactly (the remainder goes one sample at a time to the largest group that
    takes it whole)."""
    groups = [g for g in cluster.groups if g.name in present]
    world = sum(g.count for g in groups)
    if total < world:
        raise QsyncInputError(
            f"global_batch: {total} samples cannot give each of the {world} devices of "
            f"{', '.join(g.name for g in groups)} one")
    counts = [g.count for g in groups]
    base, left = total // world, total % world
    extra = None
    for lower in range(0, min(base, EVEN_TRIES)):  # give up `lower` samples a device first
        extra = _extras(counts, left + lower * world)
        if extra is not None:
            base -= lower
            break
    if extra is None:  # no exact split near the even one: the largest below it
        extra, left = [0] * len(groups), left
        for i in sorted(range(len(groups)), key=lambda i: -counts[i]):
            extra[i], left = left // counts[i], left % counts[i]
    else:
        left = 0
    return cluster.model_copy(update={"groups": [
        g.model_copy(update={"batch_per_device": base + e})
        for g, e in zip(groups, extra, strict=True)]}), total - left


#: How many samples per device :func:`even_cluster` may take from the even split to make
#: the global batch exact.
EVEN_TRIES = 4


def _extras(counts: Sequence[int], amount: int) -> list[int] | None:
    """Whole numbers e with sum(counts[i] * e[i]) == amount, the largest counts taking the
    most (deterministic), or None where there are none."""
    order = sorted(range(len(counts)), key=lambda i: -counts[i])
    last: list[int | None] = [None] * (amount + 1)  # the group a sum was last reached by
    last[0] = -1
    for a in range(1, amount + 1):
        for i in order:
            if counts[i] <= a and last[a - counts[i]] is not None:
                last[a] = i
                break
    if last[amount] is None:
        return None
    out, a = [0] * len(counts), amount
    while a:
        by = last[a]
        assert by is not None and by >= 0
        out[by] += 1
        a -= counts[by]
    return out


def _global_batch(plan: Plan) -> int:
    return sum(g.count * plan.groups[g.name].batch_per_device for g in plan.cluster.groups)


def _graph_batch(plan: Plan) -> int | None:
    b = plan.provenance.get("graph_batch")
    return b if isinstance(b, int) and not isinstance(b, bool) else None


def _split_lines(old: Plan, new: Plan) -> list[str]:
    moved = [f"{n} {old.groups[n].batch_per_device} -> {p.batch_per_device}"
             for n, p in new.groups.items()
             if n in old.groups and old.groups[n].batch_per_device != p.batch_per_device]
    return [f"batch split moved: {', '.join(moved)}"] if moved else []
