"""What every backend shares: turning an assignment into a Plan and a SolveReport, the one
definition of the optimality gap, the deadline of a whole call, solving a problem part by
part (one program per group) within it, and the exact backends' check of an assignment
against the floating-point model (``FEAS_REL``) and their rescaling rule
(:func:`excluded_choices`)."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import QsyncInputError
from ..problem import AllocationProblem, GroupModel, check_finite
from ..schemas import Plan, SolveReport
from .base import SolveOptions

#: The clock every deadline reads (monotonic seconds). Tests may replace it (a fake clock).
clock: Callable[[], float] = time.perf_counter
#: Objective differences below this fraction of the largest possible objective are zero
#: (bounds of -3.9e-16 on an optimum of 0 are solver noise, not a gap).
ZERO_REL = 1e-12
#: What the exact backends call feasible: time <= budget * (1 + FEAS_REL) and memory <=
#: capacity * (1 + FEAS_REL) in the floating-point model (100x inside the evaluator's
#: EVAL_TOL; it absorbs the last-ulp differences of ``target - tail`` against a sum of terms).
FEAS_REL = 1e-9
#: Re-solves of a program whose OPTIMAL was only proven within the absolute gap.
MAX_RESCALES = 3
#: How far a HiGHS or CBC run may overrun the limit handed to it, as a fraction of that
#: limit (a plain 2 s HiGHS run took 2.65 s on a loaded machine: 33%), and the seconds the
#: work after a run takes (reading its solution back, the evaluator, the report).
SOLVER_OVERRUN = 0.35
AFTER_RUN_S = 0.05
#: No HiGHS or CBC run, and no candidate of the joint split, starts with less than this
#: many seconds to hand to it (:func:`solver_limit`).
MIN_RUN_S = 0.02


def solver_limit(seconds: float) -> float:
    """The limit to hand a HiGHS or CBC run that must be over, with the work after it,
    within ``seconds``: ``(seconds - AFTER_RUN_S) / (1 + SOLVER_OVERRUN)``, so that a run
    overrunning by :data:`SOLVER_OVERRUN` still ends in time; 0 (do not start it) when that
    is less than :data:`MIN_RUN_S`."""
    if not seconds > 0 or not math.isfinite(seconds):
        return 0.0 if not seconds > 0 else seconds
    handed = (seconds - AFTER_RUN_S) / (1.0 + SOLVER_OVERRUN)
    return handed if handed >= MIN_RUN_S else 0.0


class Deadline:
    """The wall-clock limit of a whole call: every solver run, refinement round, fallback and
    diagnosis inside it gets at most :meth:`remaining` seconds (read from :data:`clock`)."""

    def __init__(self, seconds: float) -> None:
        if not seconds > 0 or not math.isfinite(seconds):
            raise QsyncInputError(f"time_limit_s: expected a positive number of seconds, "
                                  f"got {seconds}")
        self.seconds = float(seconds)
        self.end = clock() + self.seconds

    def remaining(self) -> float:
        """Seconds left (0 once expired)."""
        return max(0.0, self.end - clock())

    def expired(self) -> bool:
        return self.remaining() <= 0.0

    def share(self, parts_left: int) -> float:
        """An equal share of the remaining time among ``parts_left`` parts still to solve."""
        return self.remaining() / max(1, parts_left)

    def options(self, options: SolveOptions, share: int = 1) -> SolveOptions:
        """``options`` with the time limit cut to this deadline's share."""
        return options.with_time_left(self.share(share))


def objective_scale(problem: AllocationProblem) -> tuple[float, float, float]:
    """(largest possible |objective|, largest single |term|, least possible objective): the
    sums of each unit's largest |weight * Omega|, the largest such term, and the sum of each
    unit's smallest weight * Omega (a bound no assignment goes below)."""
    total = top = low = 0.0
    for g in problem.groups:
        for row in g.omega1:
            if row:
                terms = [g.weight * v for v in row]
                big = max(abs(v) for v in terms)
                total += big
                top = max(top, big)
                low += min(terms)
    return total, top, low


def relative_gap(objective: float | None, bound: float | None, scale: float) -> float | None:
    """The one gap of every backend: ``(objective - bound) / max(|objective|, |bound|)``,
    0 when the difference is within ``ZERO_REL * scale`` (both ~0 included: a proven optimum
    of 0 has gap 0); None without a bound."""
    if objective is None or bound is None:
        return None
    diff = objective - bound
    if diff <= ZERO_REL * max(scale, 0.0):
        return 0.0
    return diff / max(abs(objective), abs(bound))


def clean_bound(objective: float | None, bound: float | None, problem: AllocationProblem,
                messages: list[str]) -> float | None:
    """A bound clamped to what is known: never below the least possible objective (tiny
    negative bounds of a 0 optimum), never above the plan's own objective (within
    tolerance; a bound far above it is solver output that contradicts itself: dropped,
    with a message)."""
    if bound is None or not math.isfinite(bound):
        return None
    scale, _, low = objective_scale(problem)
    bound = max(bound, low)
    if objective is not None and bound > objective:
        if bound - objective > 1e-9 * max(abs(objective), ZERO_REL * scale) + ZERO_REL * scale:
            messages.append(f"bound {bound:.6g} above the plan's own objective {objective:.6g}: "
                            "the solver's output contradicts itself; bound dropped")
            return None
        bound = objective
    return bound


@dataclass
class PartResult:
    """One program's outcome (the groups of one part): its assignment (None: none found),
    the bound on its objective and its size."""

    status: str  # OPTIMAL, FEASIBLE, INFEASIBLE, TIME_LIMIT, ERROR
    assignment: dict[str, list[int]] | None
    bound: float | None
    n_variables: int = 0
    n_constraints: int = 0


def part_objective(problem: AllocationProblem, gis: Sequence[int],
                   assignment: Mapping[str, Sequence[int]]) -> float:
    return sum(problem.groups[gi].weight * problem.groups[gi].degradation(
        assignment[problem.groups[gi].name]) for gi in gis)


def part_floor(problem: AllocationProblem, gis: Sequence[int]) -> float:
    """The least objective any assignment of these groups has (a trivial bound)."""
    return sum(g.weight * min(r) for gi in gis for g in [problem.groups[gi]] for r in g.omega1
               if r)


def least_part(problem: AllocationProblem, gis: Sequence[int]) -> PartResult | None:
    """The part's optimum when no solver is needed (None otherwise): every real unit at its
    least ``Omega`` (the first, most exact, of equal ones) has the least objective any
    assignment has; when it meets each group's time budget and capacity exactly (no
    tolerance), it is optimal, its objective its own bound."""
    budget = problem.group_budget_ms()
    out: dict[str, list[int]] = {}
    for gi in gis:
        g = problem.groups[gi]
        if not all(g.omega1):
            return None
        a = [min(range(len(row)), key=row.__getitem__) for row in g.omega1]
        dt, dm = exact_violation(g, a, budget, rel=0.0)
        if dt > 0 or dm > 0:
            return None
        out[g.name] = a
    return PartResult("OPTIMAL", out, part_objective(problem, gis, out))


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


def _memo_key(memo: tuple[Any, ...], problem: AllocationProblem,
              gis: Sequence[int]) -> tuple[Any, ...]:
    return (memo, tuple(group_digest(problem.groups[gi]) for gi in gis))


def _memo_hit(key: tuple[Any, ...], problem: AllocationProblem, gis: Sequence[int],
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


def _memo_store(key: tuple[Any, ...], budget: float, res: PartResult) -> None:
    if res.status not in ("OPTIMAL", "INFEASIBLE"):
        return
    if key not in _PART_MEMO and len(_PART_MEMO) >= PART_MEMO_SIZE:
        del _PART_MEMO[next(iter(_PART_MEMO))]
    _PART_MEMO.setdefault(key, []).append((budget, res))


#: A second pass over unsolved or unproven parts only when this much time is left.
MIN_RETRY_S = 0.05


def solve_parts(problem: AllocationProblem, parts: Sequence[Sequence[int]],
                solve_part: Callable[[Sequence[int], float, Mapping[str, Sequence[int]] | None],
                                     PartResult],
                deadline: Deadline, messages: list[str], rel_gap: float,
                memo: tuple[Any, ...] | None = None
                ) -> tuple[str, dict[str, list[int]] | None, float | None, int, int]:
    """Solve each part (``solve_part(groups, time limit s, start or None)``) within the
    deadline: each part gets an equal share of the time that remains. A part that ran out
    of its share without a plan, or with one not proven optimal, does not end the call:
    once every part had its turn, the time left is shared among those again (started from
    their plan, if any), the better result kept. Returns status, assignment, bound (sum over
    parts; a part with none counts its trivial floor), variables, constraints.

    ``memo``: what makes the backend's answer to a program (its name and the options that
    change it); with it, a part already solved in this process, to optimality or to no
    plan, at this budget or at a larger one that answers this one (:func:`_memo_hit`), is
    not solved again (the Pareto sweep and the joint split meet the same group at the same
    batch many times)."""
    results: list[PartResult | None] = [None] * len(parts)
    n_vars = n_cons = 0

    def tag(gis: Sequence[int]) -> str:
        return problem.groups[gis[0]].name if len(gis) == 1 else "all"

    for i, gis in enumerate(parts):
        least = least_part(problem, gis)
        if least is not None:
            results[i] = least
            messages.append(f"{tag(gis)}: every unit at its least degradation meets the "
                            "target and capacity: that is the optimum, no solver run")
            continue
        key = _memo_key(memo, problem, gis) if memo is not None else None
        hit = _memo_hit(key, problem, gis, problem.group_budget_ms()) if key else None
        if hit is not None:
            at, res = hit
            messages.append(f"{tag(gis)}: solved before in this process ({res.status} at a "
                            f"time budget of {at:.4f} ms, which answers this budget, "
                            f"{problem.group_budget_ms():.4f} ms): not solved again")
            if res.status == "INFEASIBLE":
                messages.extend(infeasible_messages(problem, gis, problem.group_budget_ms()))
        elif deadline.expired():  # nothing is run past the deadline
            results[i] = PartResult("TIME_LIMIT", None, None)
            continue
        else:
            res = solve_part(gis, deadline.share(len(parts) - i), None)
            if key is not None:
                _memo_store(key, problem.group_budget_ms(), res)
        n_vars += res.n_variables
        n_cons += res.n_constraints
        results[i] = res
        if res.status in ("INFEASIBLE", "ERROR"):
            return res.status, None, None, n_vars, n_cons
    retry = [i for i, r in enumerate(results)
             if r is not None and r.status in ("TIME_LIMIT", "FEASIBLE")]
    for j, i in enumerate(retry):
        left = deadline.share(len(retry) - j)
        if left < MIN_RETRY_S:
            break
        old = results[i]
        assert old is not None
        new = solve_part(parts[i], left, old.assignment)
        if new.status in ("INFEASIBLE", "ERROR") and old.assignment is None:
            return new.status, None, None, n_vars, n_cons
        results[i] = _better(problem, parts[i], old, new, rel_gap)
        r = results[i]
        assert r is not None
        messages.append(f"{tag(parts[i])}: second pass with {left:.3g} s of the time left "
                        f"(first pass {old.status}): {r.status}")
    status = "OPTIMAL"
    assignment: dict[str, list[int]] = {}
    bound = 0.0
    for gis, r in zip(parts, results, strict=True):
        assert r is not None
        bound += r.bound if r.bound is not None else part_floor(problem, gis)
        if r.assignment is None:
            status = "TIME_LIMIT"
            messages.append(f"{tag(gis)}: no plan within its share of the time limit")
            continue
        assignment.update(r.assignment)
        if r.status != "OPTIMAL" and status == "OPTIMAL":
            status = "FEASIBLE"
    if status == "TIME_LIMIT":
        return status, None, bound, n_vars, n_cons
    return status, assignment, bound, n_vars, n_cons


def _better(problem: AllocationProblem, gis: Sequence[int], old: PartResult, new: PartResult,
            rel_gap: float) -> PartResult:
    """The better of two runs on the same part: the lower objective, the higher bound."""
    bounds = [b for b in (old.bound, new.bound) if b is not None]
    bound = max(bounds) if bounds else None
    cands = [r for r in (old, new) if r.assignment is not None]
    if not cands:
        return PartResult("TIME_LIMIT", None, bound)
    pick = min(cands, key=lambda r: part_objective(problem, gis, r.assignment or {}))
    obj = part_objective(problem, gis, pick.assignment or {})
    scale = objective_scale(problem)[0]
    proven = pick.status == "OPTIMAL" or (
        bound is not None and obj - bound <= rel_gap * abs(obj) + ZERO_REL * scale)
    return PartResult("OPTIMAL" if proven else "FEASIBLE", pick.assignment, bound)


class Stopwatch:
    """``build_s`` (model building) and ``solve_s`` (the solver itself), measured apart."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.build_s = 0.0
        self.solve_s = 0.0

    def building(self) -> _Lap:
        return _Lap(self, "build_s")

    def solving(self) -> _Lap:
        return _Lap(self, "solve_s")

    @property
    def wall_s(self) -> float:
        return time.perf_counter() - self.t0


class _Lap:
    def __init__(self, sw: Stopwatch, attr: str) -> None:
        self.sw, self.attr = sw, attr

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        setattr(self.sw, self.attr, getattr(self.sw, self.attr) + time.perf_counter() - self.start)


def finish(
    problem: AllocationProblem,
    solver: str,
    assignment: Mapping[str, Sequence[int]] | None,
    *,
    status: str,
    mode: str,
    options: SolveOptions,
    sw: Stopwatch,
    bound: float | None = None,
    n_variables: int = 0,
    n_constraints: int = 0,
    messages: Sequence[str] = (),
    extra_options: Mapping[str, Any] | None = None,
    plan: Plan | None = None,
    optimal_tol: float = 0.0,
) -> tuple[Plan | None, SolveReport]:
    """The Plan (None when there is no assignment) and the report of one solve.

    ``objective`` is always recomputed from the problem (never taken from the solver); the
    bound is clamped (:func:`clean_bound`) and ``gap`` is :func:`relative_gap`. A status
    OPTIMAL whose plan lies further above the bound than the gap tolerance allows
    (``options.rel_gap``, HiGHS's absolute 1e-6 of the largest term, ``optimal_tol``) is
    not trusted: it becomes FEASIBLE, with a message.
    """
    objective = None
    messages = list(messages)
    if plan is None and assignment is not None:
        objective = problem.objective(assignment)
    elif plan is not None:
        objective = problem.objective(problem.assignment(plan)) if plan.cluster == problem.cluster else None
    scale, top, _ = objective_scale(problem)
    bound = clean_bound(objective, bound, problem, messages)
    gap = relative_gap(objective, bound, scale)
    if status == "OPTIMAL" and objective is not None and bound is not None:
        allowed = (options.rel_gap * abs(objective) + 1e-6 * top + optimal_tol
                   + ZERO_REL * scale)
        if objective - bound > allowed:
            messages.append(f"{solver}: reported OPTIMAL, but the plan's own objective "
                            f"{objective:.6g} is {objective - bound:.3g} above the bound "
                            f"{bound:.6g} (more than the gap tolerance): status FEASIBLE")
            status = "FEASIBLE"
    opts: dict[str, Any] = options.to_json()
    opts.update(extra_options or {})
    clean = {k: v for k, v in opts.items() if v is None or isinstance(v, (str, int, float, bool))}
    report = SolveReport.model_validate(dict(
        solver=solver, status=status, mode=mode,
        objective=objective, bound=bound, gap=gap, build_s=sw.build_s, solve_s=sw.solve_s,
        wall_s=sw.wall_s, n_variables=n_variables, n_constraints=n_constraints, options=clean,
        messages=messages))
    if plan is None and assignment is not None:
        plan = problem.make_plan(assignment, {
            "solver": solver, "status": status, "objective": objective, "bound": bound,
            "gap": gap, "mode": mode,
            **{f"option.{k}": v for k, v in clean.items()}})
    return plan, report


def mode_text(problem: AllocationProblem) -> str:
    return (f"least degradation under makespan target {problem.target_ms:.3f} ms "
            f"({problem.target_source})")


def check_hints(problem: AllocationProblem, hints: Mapping[str, Sequence[int]] | None) -> None:
    if hints is None:
        return
    for g in problem.groups:
        a = hints.get(g.name)
        if a is None or len(a) != len(g.choices) or any(
                not 0 <= k < len(c) for k, c in zip(a, g.choices, strict=True)):
            raise QsyncInputError(f"hints: group {g.name} needs one valid choice index per unit")


def program_parts(problem: AllocationProblem, options: SolveOptions,
                  messages: list[str]) -> list[list[int]]:
    """Which groups each program holds: one per group (decomposed: with a fixed target the
    groups do not interact) or all in one; the choice is written to ``messages``."""
    n = len(problem.groups)
    if options.decompose:
        messages.append(f"decomposed: one program per group ({n} groups); with a fixed "
                        "target the groups do not interact")
        return [[gi] for gi in range(n)]
    messages.append(f"monolithic: one program for all {n} groups")
    return [list(range(n))]


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


def shifted_omega(g: GroupModel) -> list[list[float]]:
    """``w * Omega`` of each real unit's choices less the unit's least (all >= 0, one 0)."""
    out = []
    for row in g.omega1:
        terms = [g.weight * v for v in row]
        low = min(terms, default=0.0)
        out.append([t - low for t in terms])
    return out


def excluded_choices(problem: AllocationProblem, gis: Sequence[int],
                     assignment: Mapping[str, Sequence[int]]
                     ) -> dict[int, frozenset[tuple[int, int]]]:
    """Per group, the (unit, choice) pairs whose shifted ``w * Omega`` alone exceeds the
    plan's whole shifted objective: every term is >= 0, so no plan at least as good takes
    one. Leaving them out makes the largest coefficient at most the plan's objective."""
    shifted = {gi: shifted_omega(problem.groups[gi]) for gi in gis}
    z = sum(row[k] for gi in gis
            for row, k in zip(shifted[gi], assignment[problem.groups[gi].name], strict=True))
    return {gi: frozenset((u, k) for u, row in enumerate(shifted[gi])
                          for k, v in enumerate(row) if v > z) for gi in gis}
