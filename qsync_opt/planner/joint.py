"""The joint precision-and-split search: the per-group batch split chosen together with the
precisions, one copy of the program per candidate split, solving as few copies as the split
bounds (:mod:`qsync_opt.planner.splits`) allow."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from qsync_opt.core.progress import Progress
from qsync_opt.documents.schemas import ClusterSpec, Plan, SolveReport
from qsync_opt.planner.call import (
    ScoredRun,
    SolveCall,
    backend_for,
    no_plan_error,
    reachable_ms,
    run_backend,
    time_limit_error,
)
from qsync_opt.planner.refine import refine_against_replayer
from qsync_opt.planner.splits import BOUND_REL, SplitBounds, batch_splits
from qsync_opt.problem.evaluator import Evaluation
from qsync_opt.problem.program import AllocationProblem, ProblemOptions
from qsync_opt.solvers import SolveOptions
from qsync_opt.solvers.backends import get_backend
from qsync_opt.solvers.driver import memo_line_prefix, solve_group_alone
from qsync_opt.solvers.ilp import FastestTimeLimit, PulpIlp
from qsync_opt.solvers.parts import least_part, part_objective
from qsync_opt.solvers.relaxation import relaxation_bound

#: Relative slack above the smallest reachable makespan in the lexicographic mode.
LEXICOGRAPHIC_SLACK = 0.02
#: At most this many candidate batch splits in the joint model (evenly thinned beyond).
MAX_SPLITS = 64


#: No candidate of the joint split is built or started with less than this many seconds of
#: the limit left: building one takes up to ~0.06 s on resnet50 and its solver run needs
#: solvers.timing.solver_limit's room (each HiGHS/CBC run is handed what is left less a
#: margin for its own overrun and the work after it), so the limit bounds the whole call.
MIN_CANDIDATE_S = 0.25


#: False: the joint split solves every candidate (the reference procedure, for tests).
PRUNE_SPLITS = True


def split_bounds(problem: AllocationProblem, subs: list[AllocationProblem], solver: str,
            opts: SolveOptions, target_ms: float) -> SplitBounds:
    """The split bounds of these candidates, their monotonicity checked once per set of
    candidates (shared by the problem's retargeted copies, as the candidates are).

    Bounds from solved splits are used only with the exact PuLP backends, whose optimum is
    the model's within ``rel_gap`` (the parts are discounted by twice that): CP-SAT solves
    a rounded model and the heuristics no model at all, so their objectives bound nothing.
    The floors' proofs of no plan hold for every backend (none returns a plan the exact
    model refuses)."""
    if not PRUNE_SPLITS:
        return SplitBounds(subs, [False] * len(problem.groups), enabled=False).at(
            target_ms, exact=False)
    key = tuple(id(s) for s in subs)
    got = problem.split_search_cache.get(key)
    if not isinstance(got, SplitBounds):
        got = problem.split_search_cache[key] = SplitBounds(subs)
    return got.at(target_ms, exact=type(get_backend(solver)) is PulpIlp,
                  discount=1.0 - 2.0 * opts.rel_gap)


def split_cluster(problem: AllocationProblem, split: dict[str, int]) -> ClusterSpec:
    return problem.cluster.model_copy(update={"groups": [
        g.model_copy(update={"batch_per_device": split[g.name]}) for g in problem.cluster.groups]})


def solve_joint(problem: AllocationProblem, solver: str, opts: SolveOptions, refine: int,
                multiple: int | None, mode: str, slack: float,
                extra_splits: Sequence[dict[str, int]] = (), call: SolveCall | None = None,
                progress: bool = False) -> tuple[Plan, SolveReport]:
    """Precisions and batch split together: one copy of the program per candidate split,
    the best copy selected. The copies share no variable, so the disjunctive program (a
    binary per split) is solved exactly by solving each copy and taking the least
    objective; ties go to the shorter replayer makespan. Within the call's deadline: each
    copy's first solve gets an equal share of the time that remains.

    In ``auto`` mode with the default target, when no split meets it (the default target is
    the strong groups' time at their *given* batch, which a split that moves samples onto
    them cannot meet), it falls back as :func:`solve` does: first the smallest makespan any
    split reaches (exact backends), then the least degradation within ``slack`` of it."""
    t0 = time.perf_counter()
    call = call or SolveCall.start(opts)
    splits = batch_splits(problem, multiple, MAX_SPLITS)
    for extra in extra_splits:
        if extra not in splits:
            splits.append(dict(extra))
    target, source = problem.target_ms, problem.target_source
    cands = joint_candidates(problem, solver, opts, splits, target, source, call)
    splits, subs = cands.splits, cands.problems
    bounds = split_bounds(problem, subs, solver, opts, target)
    attempt = joint_attempt(problem, solver, opts, refine, splits, subs, target, source, call,
                            bounds, progress, cands.given_first)
    lexi = None
    if (not attempt.results and not attempt.timed_out and mode == "auto"
            and problem.options.target_ms is None and backend_for(solver).exact):
        try:
            reach = [reachable_ms(sub.retarget(target, source=source), call) for sub in subs]
        except FastestTimeLimit:
            reach = []
            attempt.timed_out += 1
        best = min((r for r in reach if r is not None), default=None)
        if best is not None and best > target:
            at = splits[reach.index(best)]
            lexi = (f"lexicographic: the default target {target:.3f} ms is out of reach at "
                    f"every batch split; smallest reachable makespan {best:.3f} ms (at "
                    + ", ".join(f"{k}={v}" for k, v in at.items())
                    + f"), least degradation within {slack:.0%} of it")
            target = best * (1 + slack)
            attempt = joint_attempt(problem, solver, opts, refine, splits, subs, target, lexi,
                                    call, split_bounds(problem, subs, solver, opts, target),
                                    progress)
    if not attempt.results:
        status = "TIME_LIMIT" if attempt.timed_out else "INFEASIBLE"
        rep = SolveReport(solver=solver, status=status, mode="joint split",
                          messages=[f"no plan meets the target {target:.3f} ms at any of "
                                    f"{len(splits)} batch splits"
                                    + (f" ({attempt.timed_out} stopped at the time limit)"
                                       if attempt.timed_out else "")])
        if attempt.timed_out:
            raise time_limit_error(problem, solver, rep, call)
        raise no_plan_error(problem, solver, rep, call)
    split, plan, report, ev = min(attempt.results, key=lambda r: (r[3].objective,
                                                                  r[3].replay_makespan_ms))
    msgs = [*_search_messages(problem, attempt, splits, cands.unbuilt, split, ev),
            *report.messages]
    if lexi is not None:
        msgs.insert(0, lexi)
        how = (f"joint precision and batch split, lexicographic (makespan first, then "
               f"degradation within {slack:.0%}): {lexi}")
    else:
        how = (f"joint precision and batch split, least degradation under makespan target "
               f"{target:.3f} ms ({source})")
    report = report.model_copy(update={
        "mode": how, "messages": msgs, "n_variables": attempt.n_vars,
        "n_constraints": attempt.n_cons, "wall_s": time.perf_counter() - t0})
    plan = plan.model_copy(update={"provenance": {
        **plan.provenance, "joint_split": True, "candidate_splits": len(splits)}})
    return plan, report


def given_split(problem: AllocationProblem) -> dict[str, int]:
    """The problem's own per-device batch of every group."""
    return {g.name: int(g.batch_per_device or problem.graph.batch_size)
            for g in problem.cluster.groups}


def _search_messages(problem: AllocationProblem, attempt: JointAttempt,
                     splits: list[dict[str, int]], unbuilt: int, split: dict[str, int],
                     ev: Evaluation) -> list[str]:
    """What the search did: candidates solved, proven, bounded, refined; the split chosen."""
    own = given_split(problem)
    at_own = next((r[0] for r in attempt.first if r[1] == own), None)
    return [*([f"joint batch split: the given split solved first; {unbuilt} other "
               "candidate split(s) not built: the time limit ran out"] if unbuilt else []),
            f"joint batch split: {len(splits)} candidate splits (global batch "
            f"{problem.global_batch}): {attempt.solved} solved, {len(attempt.first)} with a "
            f"plan, {attempt.proven_infeasible} without one by their floors or LP "
            f"relaxations, {attempt.bounded} skipped (bounded above the best; "
            f"{attempt.relaxed} relaxations solved"
            + (f", {attempt.alone} group program(s) solved alone for a bound"
               if attempt.alone else "") + f"), {attempt.refined} refined"
            + (f", {attempt.unstarted} not started (under {MIN_CANDIDATE_S:g} s of the "
               "limit left)" if attempt.unstarted else "") + "; chosen "
            + ", ".join(f"{k}={v}" for k, v in split.items())
            + f", objective {ev.objective:.6g}"
            + (f" against {at_own:.6g} at the given split (before refinement)"
               if at_own is not None else "; the given split has no plan")]


@dataclasses.dataclass(frozen=True)
class JointCandidates:
    """The candidate splits built, their problems, the given split's first solve (by its
    index among them) and how many candidates were not built."""

    splits: list[dict[str, int]]
    problems: list[AllocationProblem]
    given_first: dict[int, ScoredRun]
    unbuilt: int


def joint_candidates(problem: AllocationProblem, solver: str, opts: SolveOptions,
                     splits: list[dict[str, int]], target: float, source: str, call: SolveCall
                     ) -> JointCandidates:
    """The candidates' problems, the given split's first: it is built and solved (with up
    to half the time left) before the others are built, and the others are built only while
    time is left (building them all takes seconds on a large model)."""
    fixed_opts = ProblemOptions(**{**problem.options.to_json(), "target_ms": problem.target_ms,
                                   "strong_groups": None})

    def make(split: dict[str, int]) -> AllocationProblem:
        key = tuple(sorted(split.items()))
        sub = problem.split_cache.get(key)
        if sub is None:
            sub = problem.split_cache[key] = problem.with_cluster(
                split_cluster(problem, split), fixed_opts)
        return sub

    own = given_split(problem)
    own_i = splits.index(own) if own in splits else 0
    built: dict[int, AllocationProblem] = {own_i: make(splits[own_i])}
    first = ScoredRun(*run_backend(built[own_i].retarget(target, source=source), solver, opts,
                                   call.child(call.deadline.remaining() / 2)))
    for i, split in enumerate(splits):
        if i not in built:
            if call.deadline.remaining() < MIN_CANDIDATE_S:
                break
            built[i] = make(split)
    keep = sorted(built)
    return JointCandidates([splits[i] for i in keep], [built[i] for i in keep],
                           {keep.index(own_i): first}, len(splits) - len(keep))


@dataclasses.dataclass
class JointAttempt:
    """The copies of one joint solve at one target: first solves, refined results."""

    first: list[tuple[float, dict[str, int], AllocationProblem]]
    results: list[tuple[dict[str, int], Plan, SolveReport, Evaluation]]
    refined: int = 0
    timed_out: int = 0
    n_vars: int = 0
    n_cons: int = 0
    #: candidates never solved: proven infeasible by the floors, or bounded above the best
    proven_infeasible: int = 0
    bounded: int = 0
    solved: int = 0
    #: candidates whose LP relaxation was solved (for their bounds) before any solve
    relaxed: int = 0
    #: candidates not started: less than MIN_CANDIDATE_S of the limit was left
    unstarted: int = 0
    #: group programs solved alone for a candidate's bound (:func:`bound_by_groups`)
    alone: int = 0


def plan_parts(sub: AllocationProblem, plan: Plan) -> list[float]:
    """Each group's part of the plan's objective on ``sub``."""
    a = sub.assignment(plan)
    return [g.weight * g.degradation(a[g.name]) for g in sub.groups]


def joint_attempt(problem: AllocationProblem, solver: str, opts: SolveOptions, refine: int,
                  splits: list[dict[str, int]], subs: list[AllocationProblem], target: float,
                  source: str, call: SolveCall, bounds: SplitBounds, progress: bool = False,
                  pre: dict[int, ScoredRun] | None = None) -> JointAttempt:
    """The best copy, exactly, solving as few copies as the bounds allow.

    The reference procedure solves every copy once without refinement, then refines them
    in ascending order of that objective (ties in candidate order) and stops once the best
    refined objective is no more than the next copy's (refinement only tightens a target,
    so a refined objective is at least the unrefined one). Here a copy is solved only while
    its lower bound (:class:`~qsync_opt.planner.splits.SplitBounds`) can match the best refined
    objective so far, best first: the given split first, then the copy of least bound, the
    one farthest from any solved or relaxed copy first among equal bounds (a bisection of
    the split axis). A copy taken for the first time is relaxed (its groups' LP
    relaxations) and goes back among the others; taken again, its bound still the least,
    it is solved, its groups that need a solver one at a time while its bound can still
    match the best (:func:`bound_by_groups`). A copy whose floors prove it has no plan is
    not solved. Every skipped copy's objective is
    above the best refined one, which the reference procedure would have kept as well, so
    the result is the same plan. ``pre``: candidates already solved once at this target
    (the given split, solved before the others were built), not solved again."""
    search = _SplitSearch(problem, solver, opts, refine, splits, subs, target, source, call,
                          bounds, pre)
    bar = Progress("joint split", total=len(splits), enabled=progress)
    while (i := search.pick()) is not None:
        bar.update(len(splits) - len(search.left), note=f"{search.out.solved} solved")
        if not search.step(i):
            break
    search.refine_solved()
    bar.update(len(splits), note=f"{search.out.solved} solved")
    bar.close()
    return search.out


class _SplitSearch:
    """The state of one :func:`joint_attempt`: the candidates left, those solved, their
    first solves and refined results, and the best refined objective so far."""

    def __init__(self, problem: AllocationProblem, solver: str, opts: SolveOptions,
                 refine: int, splits: list[dict[str, int]], subs: list[AllocationProblem],
                 target: float, source: str, call: SolveCall, bounds: SplitBounds,
                 pre: dict[int, ScoredRun] | None) -> None:
        self.solver, self.opts, self.refine, self.call = solver, opts, refine, call
        self.splits, self.subs, self.bounds = splits, subs, bounds
        self.target, self.source = target, source
        self.out = JointAttempt(first=[], results=[])
        self.pre = dict(pre or {})
        own = given_split(problem)
        self.own = next((i for i, sp in enumerate(splits) if sp == own), 0)
        self.left = set(range(len(splits)))
        self.solved: list[int] = []
        #: candidates whose LP relaxation was tried (each is tried once, before its solve)
        self.relaxed: set[int] = set()
        self.firsts: dict[int, tuple[float, ScoredRun]] = {}
        self.refined: dict[int, ScoredRun] = {}
        self.best = float("inf")

    def refine_solved(self) -> float:
        """The reference refinement over the copies solved so far (memoised); the best
        refined objective."""
        out, firsts = self.out, self.firsts
        out.results = []
        order = sorted(firsts, key=lambda i: (firsts[i][0], i))
        out.first = [(firsts[i][0], self.splits[i], self.subs[i]) for i in order]
        for i in order:
            lower = firsts[i][0]
            if out.results and min(r[3].objective for r in out.results) <= lower:
                break
            if out.results and self.call.deadline.expired():
                break
            if i not in self.refined:
                self.refined[i] = self._refined(i)
                out.refined += 1
            got = self.refined[i]
            if got.plan is not None and got.evaluation is not None:
                out.results.append((self.splits[i], got.plan, got.report, got.evaluation))
        return min((r[3].objective for r in out.results), default=float("inf"))

    def _refined(self, i: int) -> ScoredRun:
        first = self.firsts[i][1]
        # An OPTIMAL first solve is the refinement's round 0 (the same solve again gives
        # the same plan); another is solved again with the whole call's time.
        got = refine_against_replayer(
            self.subs[i].retarget(self.target, source=self.source), self.solver, self.opts,
            self.refine, self.call, first=first if first.report.status == "OPTIMAL" else None)
        return first if got.plan is None else got  # no time to solve it again: the first

    def pick(self) -> int | None:
        """The next candidate: the given split first, then the least lower bound, the one
        farthest from any solved or relaxed candidate among equal bounds (None: none
        left)."""
        open_ = sorted(self.left)
        if not open_:
            return None
        if not self.bounds.enabled:  # the reference procedure: every candidate, in order
            return open_[0]
        if self.own in self.left and not self.solved:
            return self.own
        lbs = {i: self.bounds.lower_bound(i) for i in open_}
        low = min(lbs.values())
        ties = [i for i in open_ if lbs[i] <= low + BOUND_REL * max(abs(low), 1e-300)]
        seen = [*self.solved, *self.relaxed]
        return max(ties, key=lambda i: (min((abs(i - j) for j in seen), default=0), -i))

    def step(self, i: int) -> bool:
        """Relax candidate ``i`` (the first time it is taken) or solve it once (unless its
        bounds settle it) and refine; False: the search ends (every candidate left is
        bounded, or the time is spent)."""
        out, bounds = self.out, self.bounds
        if self.best < float("inf") and not bounds.beats(bounds.lower_bound(i), self.best):
            out.bounded += len(self.left)
            return False
        if i not in self.pre and self.call.deadline.remaining() < MIN_CANDIDATE_S:
            out.unstarted += len(self.left)
            out.timed_out += 1
            return False
        sub = self.subs[i].retarget(self.target, source=self.source)
        if i in self.pre:  # solved before the other candidates were built
            got = self.pre.pop(i)
        elif bounds.enabled and i not in self.relaxed:
            # its bound first: it is solved when picked again (its bound still the least)
            self.relaxed.add(i)
            if joint_relax(sub, i, self.opts, self.call, bounds, out, len(self.left)):
                self.left.discard(i)
            return True
        else:
            run = joint_first(sub, i, self.solver, self.opts, self.call, bounds, out,
                              len(self.left) - 1, self.best)
            if run is None:
                self.left.discard(i)
                return True
            got = ScoredRun(*run)
        self.left.discard(i)
        self.solved.append(i)
        out.solved += 1
        out.n_vars += got.report.n_variables
        out.n_cons += got.report.n_constraints
        out.timed_out += got.report.status == "TIME_LIMIT"
        if got.plan is None or got.evaluation is None:
            if got.report.status == "INFEASIBLE":
                bounds.record(i, None)
            return True
        if got.report.status == "OPTIMAL":
            bounds.record(i, plan_parts(sub, got.plan))
        self.firsts[i] = (got.evaluation.objective, got)
        self.best = self.refine_solved()
        return True


def joint_relax(sub: AllocationProblem, i: int, opts: SolveOptions, call: SolveCall,
                bounds: SplitBounds, out: JointAttempt, n_left: int) -> bool:
    """Candidate ``i``'s bound from its floors and its groups' LP relaxations (``sub``: its
    problem at this target, ``n_left`` candidates left with it); True when they prove it
    has no plan (the counts go to ``out``)."""
    if bounds.proven_infeasible(i):
        out.proven_infeasible += 1
        bounds.record(i, None)
        return True
    relaxed = [relaxation_bound(sub, [gi], opts.with_time_left(
        max(call.deadline.share(n_left), 1e-3))) for gi in range(len(sub.groups))]
    if all(st != "UNKNOWN" for st, _ in relaxed):
        out.relaxed += 1
        bounds.record_relaxed(i, [v if st == "OPTIMAL" else None for st, v in relaxed])
        if bounds.proven_infeasible(i):
            out.proven_infeasible += 1
            return True
    return False


def joint_first(sub: AllocationProblem, i: int, solver: str, opts: SolveOptions, call: SolveCall,
                bounds: SplitBounds, out: JointAttempt, n_left: int, best: float
                ) -> tuple[Plan | None, SolveReport, Evaluation | None] | None:
    """Candidate ``i``'s first solve (``sub``: its problem at this target, ``n_left`` other
    candidates left), or None when its floors prove it has no plan or its groups solved
    alone prove it cannot beat ``best`` (:func:`bound_by_groups`; the counts go to ``out``).
    The groups solved alone are answered by the memo in the solve of the whole candidate;
    their lines in its report are those of their own solves, as if solved there."""
    if bounds.proven_infeasible(i):
        out.proven_infeasible += 1
        bounds.record(i, None)
        return None
    share = call.deadline.share(n_left + 1)
    settled, lines, last = bound_by_groups(sub, i, solver, opts.with_time_left(share),
                                           bounds, out, best)
    if settled:
        return None
    plan, report, ev = run_backend(sub, solver, opts, call.child(call.deadline.share(n_left + 1)))
    if report.status == "INFEASIBLE" and last is not None:
        bounds.record_group(i, last, None)  # every other group has a plan: this one has none
    if lines:
        report = report.model_copy(update={"messages": own_lines(sub, report.messages, lines)})
    return plan, report, ev


def bound_by_groups(sub: AllocationProblem, i: int, solver: str, opts: SolveOptions,
                    bounds: SplitBounds, out: JointAttempt, best: float
                    ) -> tuple[bool, dict[int, list[str]], int | None]:
    """Candidate ``i``'s groups that need a solver, but the last, each solved alone (the
    largest bound first) while the candidate's bound can still match ``best``: with a fixed
    target the groups do not interact, so a group's optimum bounds its part of every plan
    of the candidate, and a group without a plan (remembered for larger batches of a
    monotone group) leaves it none. Returns whether that settled the candidate (it cannot
    beat ``best``, or has no plan), the lines each group's solve wrote (by group), and the
    one group left to the candidate's solve when every other was solved alone with a plan
    (else None). Only with the exact PuLP backends (their optima and proofs are exact)."""
    lines: dict[int, list[str]] = {}
    if not (bounds.enabled and bounds.exact):
        return False, lines, None
    backend = get_backend(solver)
    if not isinstance(backend, PulpIlp):
        return False, lines, None
    hard = sorted((gi for gi in range(len(sub.groups)) if least_part(sub, [gi]) is None),
                  key=lambda gi: (-bounds.group_bound(i, gi), gi))
    for gi in hard[:-1]:
        res, msgs = solve_group_alone(backend, sub, gi, opts)
        if res is None or res.status not in ("OPTIMAL", "INFEASIBLE"):
            return False, lines, None
        out.alone += 1
        lines[gi] = msgs
        if res.assignment is None:  # INFEASIBLE: neither has the candidate a plan
            bounds.record_group(i, gi, None)
            out.proven_infeasible += 1
            return True, lines, None
        bounds.record_group(i, gi, part_objective(sub, [gi], res.assignment))
        if best < float("inf") and not bounds.beats(bounds.lower_bound(i), best):
            out.bounded += 1
            return True, lines, None
    return False, lines, hard[-1] if hard else None


def own_lines(sub: AllocationProblem, messages: Sequence[str],
              lines: dict[int, list[str]]) -> list[str]:
    """``messages`` with the memo's line of each group in ``lines`` replaced by that group's
    own lines (what the solve would have written had it solved the group itself)."""
    prefixes = {gi: memo_line_prefix(sub, [gi]) for gi in lines}
    out: list[str] = []
    for m in messages:
        gi = next((g for g, p in prefixes.items() if m.startswith(p)), None)
        out.extend(lines[gi] if gi is not None else [m])
    return out
