"""The allocator API: build a problem, solve it with any backend, compare backends.

Every plan any backend returns passes through :func:`qsync_opt.problem.evaluator.evaluate`; the
report's messages carry the evaluation, and :func:`compare` tabulates it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.progress import Progress
from qsync_opt.core.units import GIB, fmt_bytes
from qsync_opt.costs.cluster import load_cluster
from qsync_opt.costs.devices import get_device
from qsync_opt.costs.roofline import estimate
from qsync_opt.documents.io import load
from qsync_opt.documents.schemas import (
    ClusterSpec,
    CostTable,
    IndicatorTable,
    ModelGraph,
    Plan,
    SolveReport,
)
from qsync_opt.graph import trace
from qsync_opt.planner.splits import BOUND_REL, SplitBounds, batch_splits
from qsync_opt.problem.evaluator import Evaluation, evaluate
from qsync_opt.problem.program import AllocationProblem, ProblemOptions
from qsync_opt.solvers import SolveOptions, get_backend, registry, timing
from qsync_opt.solvers.checks import check_numbers
from qsync_opt.solvers.relaxation import relaxation_bound
from qsync_opt.solvers.report import ZERO_REL, mode_text, objective_scale
from qsync_opt.solvers.timing import Deadline

#: Per-device batch at which the indicator runs on this CPU when none is given.
INDICATOR_BATCH = 8


class InfeasibleError(QsyncInputError):
    """No plan satisfies the problem; ``report`` says what the solver found and ``lines``
    what would make it feasible (smallest memory per group, fastest makespan, blocking pins)."""

    def __init__(self, message: str, report: SolveReport | None = None) -> None:
        super().__init__(message)
        self.report = report
        self.head = message
        self.lines: list[str] = []


class SolveTimeLimit(QsyncInputError):
    """The time limit of the whole call ran out before any plan was found (a plan may
    exist: this is not infeasibility). ``report`` is the last solver report, ``bound`` the
    best bound on the objective found (None: none)."""

    def __init__(self, message: str, report: SolveReport | None = None,
                 bound: float | None = None) -> None:
        super().__init__(message)
        self.report = report
        self.bound = bound


@dataclass
class _Call:
    """One call's deadline (every solve, refinement round, fallback, tie comparison and
    diagnosis inside it gets at most what remains) and the reachable makespans it found
    (they do not depend on the target; keyed by the problem's group models)."""

    deadline: Deadline
    reach: dict[int, tuple[Any, float | None]] = field(default_factory=dict)

    @classmethod
    def start(cls, options: SolveOptions) -> _Call:
        return cls(Deadline(options.time_limit_s))

    @property
    def limit_s(self) -> float:
        return self.deadline.seconds

    def child(self, seconds: float) -> _Call:
        """A call ending after ``seconds`` or with this one, whichever is first."""
        sub = Deadline(self.deadline.seconds)
        sub.end = min(self.deadline.end, timing.clock() + max(seconds, 0.0))
        return _Call(sub, self.reach)


def build_problem(
    model: str | ModelGraph,
    cluster: str | Path | ClusterSpec,
    *,
    indicator: str | Path | IndicatorTable | None = None,
    costs: str | Path | CostTable | None = None,
    options: ProblemOptions | None = None,
    batch: int | None = None,
    indicator_method: str = "qsync",
    indicator_batches: int = 10,
    indicator_batch: int | None = None,
    indicator_fast: bool = True,
    progress: bool = False,
    check: str | None = "fixed",
    comm_model: str | None = None,
) -> AllocationProblem:
    """Graph + cluster + costs + indicator -> :class:`AllocationProblem`.

    ``model``: a registry name, ``path.py:fn`` or a traced graph. Costs default to the
    roofline estimate; the indicator defaults to ``indicate()`` on this CPU (cached), at a
    small batch for the catalog workloads (Omega is relative, so it holds at every batch).

    Before an indicator is computed (it runs the model), what needs none is checked on the
    problem built with a placeholder indicator (``diagnose.precheck``): ``check="fixed"``
    (default: fixed memory no precision or batch split removes), ``"memory"`` (also the
    least-memory plan at this split) or ``"target"`` (also a given target out of reach);
    a failure raises :class:`InfeasibleError` with the diagnosis, and no model is run.
    ``indicate()`` then refuses when its memory estimate exceeds what this machine has.
    ``comm_model``: ``netsim:p50|p99[,...]`` takes every bucket's all-reduce time from the
    packet simulator (:func:`qsync_opt.netsim.cluster.parse_comm_model`), so the plan is
    made against the network's median or its tail.
    """
    graph = model if isinstance(model, ModelGraph) else trace(model, batch)
    cl = load_cluster(cluster)
    if costs is None:
        table = estimate(graph, cl)
    elif isinstance(costs, CostTable):
        table = costs
    else:
        table = load(costs, CostTable)
    if comm_model is not None:
        from qsync_opt.netsim.cluster import parse_comm_model, with_netsim_comm

        table = with_netsim_comm(graph, cl, table, parse_comm_model(comm_model))
    if indicator is None:
        from qsync_opt.indicator import fast_options, indicate, placeholder_indicator

        if check is not None and indicator_method != "random":
            from qsync_opt.planner.diagnose import precheck

            trial = AllocationProblem(graph, cl, table, placeholder_indicator(graph), options)
            lines = precheck(trial, check)
            if lines:
                head = (f"no plan, found before computing the {indicator_method} indicator "
                        "(no model was run)")
                err = InfeasibleError(f"{head}: " + "; ".join(lines))
                err.head, err.lines = head, lines
                raise err
        ind = indicate(graph.workload, indicator_batches, indicator_method,
                       batch=indicator_batch or min(INDICATOR_BATCH, graph.batch_size),
                       progress=progress,
                       needs={p for g in cl.groups for p in get_device(g.device).precisions},
                       **(fast_options() if indicator_fast else {}))
    elif isinstance(indicator, IndicatorTable):
        ind = indicator
    else:
        ind = load(indicator, IndicatorTable)
    return AllocationProblem(graph, cl, table, ind, options)


#: Relative slack above the smallest reachable makespan in the lexicographic mode.
LEXICOGRAPHIC_SLACK = 0.02
#: Solve-replay refinement rounds by default.
REFINE_ROUNDS = 3
#: At most this many candidate batch splits in the joint model (evenly thinned beyond).
MAX_SPLITS = 64
#: No candidate of the joint split is built or started with less than this many seconds of
#: the limit left: building one takes up to ~0.06 s on resnet50 and its solver run needs
#: solvers.timing.solver_limit's room (each HiGHS/CBC run is handed what is left less a
#: margin for its own overrun and the work after it), so the limit bounds the whole call.
MIN_CANDIDATE_S = 0.25


def solve(problem: AllocationProblem, solver: str = "cpsat",
          options: SolveOptions | None = None, *, mode: str = "auto",
          degradation_budget: float | None = None, refine: int = REFINE_ROUNDS,
          joint_split: bool = False, batch_multiple: int | None = None,
          slack: float = LEXICOGRAPHIC_SLACK, compare_ties: bool = True,
          progress: bool = False) -> tuple[Plan, SolveReport]:
    """Solve with one backend; the plan is checked by the evaluator before it is returned.

    ``mode``: ``"target"`` (least degradation under the makespan target), ``"budget"``
    (least makespan under ``degradation_budget``), or ``"auto"``: the target mode, and when
    the *default* target is out of reach even at the fastest precisions, lexicographic —
    first the smallest reachable makespan (the backend's own figure for greedy and the
    baselines), then the least degradation within ``slack`` of it. The report's ``mode``
    says which ran and why. ``refine``: rounds of solve-replay refinement for the exact
    backends (re-solve with the target tightened by the replayer's excess, never below the
    smallest reachable makespan; the best round is kept). ``joint_split``: choose the
    per-group batch split (global batch fixed, multiples of ``batch_multiple``) together
    with the precisions. With tie groups, the untied optimum is also solved and the report
    says what tying cost. ``progress``: a bar on stderr for the joint split's candidates
    (drawn once the step has run 2 s, :mod:`qsync_opt.core.progress`).

    ``options.time_limit_s`` bounds the WHOLE call: every solve, refinement round, fallback,
    tie comparison and diagnosis gets only what remains.

    Raises :class:`InfeasibleError` (carrying the report, and a diagnosis of what would make
    it feasible when one is available) when no plan exists, and :class:`SolveTimeLimit`
    when the time limit ran out before any plan was found.
    """
    opts = options or SolveOptions()
    if mode not in ("auto", "target", "budget"):
        raise QsyncInputError(f"mode: expected auto, target or budget, got {mode!r}")
    if refine < 0:
        raise QsyncInputError(f"refine: expected a non-negative number of rounds, got {refine}")
    call = _Call.start(opts)
    check_numbers(problem)  # every backend and mode refuses the same numbers
    if mode == "budget":
        if degradation_budget is None or not degradation_budget >= 0:
            raise QsyncInputError("degradation_budget: the budget mode needs a number >= 0")
        plan, report = _solve_budget(problem, solver, opts, degradation_budget, call=call)
    elif joint_split:
        plan, report = solve_joint(problem, solver, opts, refine, batch_multiple, mode, slack,
                                    call=call, progress=progress)
    else:
        plan, report = _solve_modes(problem, solver, opts, refine, mode, slack, call)
    if compare_ties and plan is not None:
        report = _tie_note(problem, solver, opts, plan, report, call)
    return plan, report


#: The diagnosis of an infeasible problem runs only with at least this much time left.
MIN_DIAGNOSIS_S = 0.05


def _fail(problem: AllocationProblem, solver: str, report: SolveReport,
          call: _Call | None = None) -> InfeasibleError:
    """The error of a solve without a plan: the diagnosis (exact least memory and fastest
    makespan per group) when there is time for it; for a backend that is not exact, its
    own figure first (the diagnosis is the exact model's)."""
    said = "; ".join(m.replace("\n", " ") for m in report.messages[-3:])
    lines: list[str] = []
    left = call.deadline.remaining() if call is not None else 60.0
    if left >= MIN_DIAGNOSIS_S:
        try:
            from qsync_opt.planner.diagnose import explain

            # explain gives each group's least-memory program the limit, and the fastest
            # plans share it: n + 1 shares at most.
            lines = explain(problem, time_limit_s=left / (len(problem.groups) + 1)).lines
        except Exception:  # noqa: BLE001 - the diagnosis is a help, never a second error
            lines = []
    exact = _is_exact(solver)
    if not exact:
        own = _own_fastest(report)
        first = (f"{solver}'s fastest plan takes {own:.3f} ms against the target "
                 f"{problem.target_ms:.3f} ms ({solver}'s own makespan)" if own is not None
                 else said)
        lines = [first, *(f"exact model: {ln}" for ln in lines)]
    elif left < MIN_DIAGNOSIS_S:
        lines = [said, "(no time left for a diagnosis)"]
    err = InfeasibleError(f"{solver}: no plan ({report.status}); "
                          + ("; ".join(lines) if lines else said), report)
    err.head = f"{solver}: no plan ({report.status})"
    err.lines = lines or [said]
    return err


def _time_limit(problem: AllocationProblem, solver: str, report: SolveReport,
                call: _Call) -> SolveTimeLimit:
    """No plan within the call's time limit: say so, with the best bound found."""
    scale, _, low = objective_scale(problem)
    bound = report.bound if report.bound is not None else low
    trivial = abs(bound - low) <= ZERO_REL * max(scale, 1e-300)
    msg = (f"{solver}: no plan found within {call.limit_s:g} s (the time limit of the whole "
           f"solve; status TIME_LIMIT, not infeasible; best bound on the degradation "
           f"{bound:.6g}" + (" (the trivial one: every op at its least Omega)" if trivial
                             else "")
           + "); give more time (time_limit_s, --time-limit)")
    return SolveTimeLimit(msg, report, bound)


def _is_exact(solver: str) -> bool:
    try:
        return bool(get_backend(solver).exact)
    except KeyError:
        return False


def _own_fastest(report: SolveReport) -> float | None:
    """A backend's own smallest makespan when it reports one (greedy: its fastest plan,
    in the makespan of its acceptance check)."""
    v = report.options.get("fastest_makespan_ms")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def reachable_ms(problem: AllocationProblem, call: _Call | None = None) -> float | None:
    """The smallest makespan any memory-feasible plan reaches in the linear model (None:
    some group fits nothing, or no PuLP solver). Within ``call``'s deadline (60 s without
    one); raises :class:`~qsync_opt.solvers.ilp.FastestTimeLimit` when time runs out."""
    from qsync_opt.solvers.ilp import FastestTimeLimit, PulpIlp, fastest_times

    key = id(problem.groups)
    if call is not None and key in call.reach:
        return call.reach[key][1]
    backend = next((b for b in ("highs", "cbc") if PulpIlp(b).is_available()), None)
    if backend is None:
        return None
    limit = call.deadline.remaining() if call is not None else 60.0
    if not limit > 0:
        raise FastestTimeLimit("fastest plans: no time left")
    times = fastest_times(problem, backend=backend, time_limit_s=limit)
    best = (None if any(t is None for t in times.values())
            else max(t for t in times.values() if t is not None) + problem.tail_ms)
    if call is not None:
        call.reach[key] = (problem.groups, best)
    return best


def _solve_modes(problem: AllocationProblem, solver: str, opts: SolveOptions, refine: int,
                 mode: str, slack: float, call: _Call) -> tuple[Plan, SolveReport]:
    from qsync_opt.solvers.ilp import FastestTimeLimit

    plan, report = _solve_refined(problem, solver, opts, refine, call)
    if plan is not None:
        return plan, report
    if report.status == "TIME_LIMIT":
        raise _time_limit(problem, solver, report, call)
    default_target = problem.options.target_ms is None
    if mode == "auto" and default_target and report.status == "INFEASIBLE":
        if _backend(solver).exact:
            try:
                best = reachable_ms(problem, call)
            except FastestTimeLimit:
                raise _time_limit(problem, solver, report, call) from None
            whose = "smallest reachable makespan"
        else:  # the backend's own figure: what it reaches, in its own makespan
            best = _own_fastest(report)
            whose = f"smallest makespan {solver} reaches (its fastest plan)"
        if best is not None and best > problem.target_ms:
            lex = problem.retarget(best * (1 + slack), source=(
                f"lexicographic: the default target {problem.target_ms:.3f} ms is out of reach "
                f"even at the fastest precisions; {whose} {best:.3f} ms, "
                f"least degradation within {slack:.0%} of it"))
            plan, report2 = _solve_refined(lex, solver, opts, refine, call)
            if plan is not None:
                msgs = [f"default target {problem.target_ms:.3f} ms out of reach: "
                        f"{whose} {best:.3f} ms", *report2.messages]
                return plan, report2.model_copy(update={
                    "mode": f"lexicographic (makespan first, then degradation within "
                            f"{slack:.0%}): {lex.target_source}", "messages": msgs})
            if report2.status == "TIME_LIMIT":
                raise _time_limit(problem, solver, report2, call)
    raise _fail(problem, solver, report, call)


#: A replayer makespan within this relative margin of the target meets it.
MEETS_REL = 1e-7


def _solve_refined(problem: AllocationProblem, solver: str, opts: SolveOptions, refine: int,
                   call: _Call | None = None) -> tuple[Plan | None, SolveReport]:
    plan, report, _ = _solve_refined_ev(problem, solver, opts, refine, call)
    return plan, report


def _solve_refined_ev(problem: AllocationProblem, solver: str, opts: SolveOptions, refine: int,
                      call: _Call | None = None,
                      first: tuple[Plan, SolveReport, Evaluation] | None = None
                      ) -> tuple[Plan | None, SolveReport, Evaluation | None]:
    """Solve; for exact backends, re-solve with the linear target tightened by the
    replayer's excess, at most ``refine`` times, never below the floor (the smallest
    makespan the linear model reaches). The best round is kept: the least objective among
    those meeting the target in the replayer, else the least replayer makespan. The report
    lists the rounds (``kept`` marks the one returned) and says plainly when re-targeting
    the linear model cannot meet the replayer's target. ``first``: round 0 already solved
    (an OPTIMAL solve of ``problem`` with these options: solving it again gives it again)."""
    from qsync_opt.solvers.ilp import FastestTimeLimit

    call = call or _Call.start(opts)
    target = problem.target_ms
    backend = _backend(solver)
    prob = problem
    rounds: list[dict[str, Any]] = []
    results: list[tuple[Plan, SolveReport, Evaluation]] = []
    last_report: SolveReport | None = None
    messages: list[str] = []
    floor: float | None = None
    at_floor = stuck = False

    def meets(ev: Evaluation) -> bool:
        return ev.replay_makespan_ms <= target * (1 + MEETS_REL)

    for r in range(refine + 1 if backend.exact else 1):
        if r and call.deadline.expired():
            messages.append(f"refinement stopped at the time limit ({call.limit_s:g} s) "
                            f"after {r} round(s)")
            break
        plan: Plan | None
        ev: Evaluation | None
        if r == 0 and first is not None:
            plan, report, ev = first
        else:
            plan, report, ev = run_backend(prob, solver, opts, call)
        last_report = report
        if plan is None or ev is None:
            if r:
                messages.append(f"refinement round {r}: target {prob.target_ms:.3f} ms leaves "
                                f"no plan ({report.status}); keeping the best earlier round")
            break
        replay = ev.replay_makespan_ms
        rounds.append({"round": r, "target_ms": prob.target_ms, "objective": ev.objective,
                       "makespan_ms": ev.makespan_ms, "replay_makespan_ms": replay,
                       "status": report.status})
        results.append((plan, report, ev))
        if meets(ev) or not backend.exact or r == refine:
            break
        if at_floor:  # the linear target cannot go lower
            stuck = True
            break
        nxt = prob.target_ms - (replay - target)
        if floor is None:
            try:
                floor = reachable_ms(problem, call)
            except FastestTimeLimit:
                floor = None
            if floor is None:  # unknown: the tail alone, and never 0
                floor = max(problem.tail_ms, 1e-9 * target)
        if nxt <= floor:
            if prob.target_ms <= floor * (1 + 1e-12):
                stuck = True
                break
            nxt, at_floor = floor, True
        prob = problem.retarget(nxt, source=f"refined: {problem.target_source}")
    if not results:
        assert last_report is not None
        return None, last_report.model_copy(update={"messages": [*last_report.messages,
                                                                 *messages]}), None
    good = [i for i, (_, _, ev) in enumerate(results) if meets(ev)]
    if good:
        k = min(good, key=lambda i: (results[i][2].objective,
                                     results[i][2].replay_makespan_ms))
    else:
        k = min(range(len(results)), key=lambda i: (results[i][2].replay_makespan_ms,
                                                    results[i][2].objective))
    plan, report, ev = results[k]
    for i, row in enumerate(rounds):
        row["kept"] = i == k
    which = (f" (round {k} of rounds 0-{len(rounds) - 1} kept)" if len(rounds) > 1 else "")
    if meets(ev):
        verdict = (f"meets the target {target:.3f} ms in the replayer "
                   f"({ev.replay_makespan_ms:.3f} ms)")
        if len(rounds) > 1:
            verdict += f" after {len(rounds) - 1} refinement round(s){which}"
    else:
        verdict = (f"does NOT meet the target {target:.3f} ms in the replayer: "
                   f"{ev.replay_makespan_ms:.3f} ms after {len(rounds) - 1} refinement "
                   f"round(s){which} (linear model {ev.makespan_ms:.3f} ms)")
        if stuck:
            floor_ms = rounds[-1]["target_ms"]
            verdict += (f"; the replayer's target cannot be met by re-targeting the linear "
                        f"model: at its floor {floor_ms:.3f} ms (the smallest makespan any "
                        f"plan reaches in the linear model) the replayer gives "
                        f"{rounds[-1]['replay_makespan_ms']:.3f} ms; raise the target to at "
                        f"least {min(r_['replay_makespan_ms'] for r_ in rounds):.3f} ms or "
                        "change the cluster")
    plan = plan.model_copy(update={"provenance": {**plan.provenance, "target_ms": target,
                                                  "refine_rounds": len(rounds) - 1,
                                                  "refine_round_kept": k}})
    mode = mode_text(problem) + (f"; refined to a linear target of "
                                 f"{rounds[k]['target_ms']:.3f} ms" if k else "")
    return plan, report.model_copy(update={"rounds": rounds, "mode": mode,
                                           "messages": [*report.messages, *messages, verdict]}), ev


def _solve_budget(problem: AllocationProblem, solver: str, opts: SolveOptions,
                  budget: float, rel_tol: float = 1e-3, call: _Call | None = None
                  ) -> tuple[Plan, SolveReport]:
    """Least linear makespan whose optimal degradation is within ``budget``: bisection on the
    target (the optimum of the target mode is non-increasing in the target), within the
    call's deadline (stopped early, the best plan so far is returned and the mode says so)."""
    from qsync_opt.solvers.ilp import FastestTimeLimit

    call = call or _Call.start(opts)
    try:
        lo = reachable_ms(problem, call)
    except FastestTimeLimit:
        raise SolveTimeLimit(f"{solver}: no plan found within {call.limit_s:g} s (the time "
                             "limit ran out finding the smallest reachable makespan)") from None
    if lo is None:
        lo = problem.tail_ms + 1e-6
    best: tuple[Plan, SolveReport] | None = None
    last: list[SolveReport] = []

    def probe(t: float) -> tuple[Plan, SolveReport] | None:
        plan, report, ev = run_backend(problem.retarget(t), solver, opts, call)
        last[:] = [report]
        if plan is None or ev is None or ev.objective > budget * (1 + 1e-9) + 1e-15:
            return None
        return plan, report

    def out_of_time() -> bool:
        return bool(last) and last[0].status == "TIME_LIMIT"

    got = probe(lo)
    probes = 1
    stopped = False
    if got is not None:
        best, hi = got, lo
    else:
        hi = max(lo * 1.25, problem.target_ms)
        while (got := probe(hi)) is None:
            probes += 1
            if out_of_time():
                raise _time_limit(problem, solver, last[0], call)
            if hi > 64 * lo:
                raise InfeasibleError(
                    f"degradation_budget: no plan within {budget:.6g} at any makespan up to "
                    f"{hi:.1f} ms (memory forces more degradation)")
            hi *= 2
        best = got
        while hi - lo > rel_tol * hi:
            if call.deadline.expired():
                stopped = True
                break
            mid = (lo + hi) / 2
            probes += 1
            got = probe(mid)
            if got is None:
                if out_of_time():
                    stopped = True
                    break
                lo = mid
            else:
                hi, best = mid, got
    plan, report = best
    mode = (f"least makespan under degradation budget {budget:.6g}: bisection on the target "
            f"to {rel_tol:.0e} relative ({probes} solves), makespan target {hi:.3f} ms")
    if stopped:
        mode += (f"; stopped at the time limit ({call.limit_s:g} s) with the interval "
                 f"[{lo:.3f}, {hi:.3f}] ms")
    return plan, report.model_copy(update={"mode": mode})


#: False: the joint split solves every candidate (the reference procedure, for tests).
PRUNE_SPLITS = True


def _bounds(problem: AllocationProblem, subs: list[AllocationProblem], solver: str,
            opts: SolveOptions, target_ms: float) -> SplitBounds:
    """The split bounds of these candidates, their monotonicity checked once per set of
    candidates (shared by the problem's retargeted copies, as the candidates are).

    Bounds from solved splits are used only with the exact PuLP backends, whose optimum is
    the model's within ``rel_gap`` (the parts are discounted by twice that): CP-SAT solves
    a rounded model and the heuristics no model at all, so their objectives bound nothing.
    The floors' proofs of no plan hold for every backend (none returns a plan the exact
    model refuses)."""
    from qsync_opt.solvers.ilp import PulpIlp

    if not PRUNE_SPLITS:
        return SplitBounds(subs, [False] * len(problem.groups), enabled=False).at(
            target_ms, exact=False)
    key = tuple(id(s) for s in subs)
    got = problem.split_search_cache.get(key)
    if not isinstance(got, SplitBounds):
        got = problem.split_search_cache[key] = SplitBounds(subs)
    return got.at(target_ms, exact=type(get_backend(solver)) is PulpIlp,
                  discount=1.0 - 2.0 * opts.rel_gap)


def _split_cluster(problem: AllocationProblem, split: dict[str, int]) -> ClusterSpec:
    return problem.cluster.model_copy(update={"groups": [
        g.model_copy(update={"batch_per_device": split[g.name]}) for g in problem.cluster.groups]})


def solve_joint(problem: AllocationProblem, solver: str, opts: SolveOptions, refine: int,
                multiple: int | None, mode: str, slack: float,
                extra_splits: Sequence[dict[str, int]] = (), call: _Call | None = None,
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
    from qsync_opt.solvers.ilp import FastestTimeLimit

    t0 = time.perf_counter()
    call = call or _Call.start(opts)
    splits = batch_splits(problem, multiple, MAX_SPLITS)
    for extra in extra_splits:
        if extra not in splits:
            splits.append(dict(extra))
    target, source = problem.target_ms, problem.target_source
    splits, subs, pre, unbuilt = _joint_candidates(problem, solver, opts, splits, target,
                                                   source, call)
    bounds = _bounds(problem, subs, solver, opts, target)
    attempt = _joint_attempt(problem, solver, opts, refine, splits, subs, target, source, call,
                             bounds, progress, pre)
    lexi = None
    if (not attempt.results and not attempt.timed_out and mode == "auto"
            and problem.options.target_ms is None and _backend(solver).exact):
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
            attempt = _joint_attempt(problem, solver, opts, refine, splits, subs, target, lexi,
                                     call, _bounds(problem, subs, solver, opts, target),
                                     progress)
    if not attempt.results:
        status = "TIME_LIMIT" if attempt.timed_out else "INFEASIBLE"
        rep = SolveReport(solver=solver, status=status, mode="joint split",
                          messages=[f"no plan meets the target {target:.3f} ms at any of "
                                    f"{len(splits)} batch splits"
                                    + (f" ({attempt.timed_out} stopped at the time limit)"
                                       if attempt.timed_out else "")])
        if attempt.timed_out:
            raise _time_limit(problem, solver, rep, call)
        raise _fail(problem, solver, rep, call)
    own = {g.name: int(g.batch_per_device or problem.graph.batch_size)
           for g in problem.cluster.groups}
    split, plan, report, ev = min(attempt.results, key=lambda r: (r[3].objective,
                                                                  r[3].replay_makespan_ms))
    at_own = next((r[0] for r in attempt.first if r[1] == own), None)
    msgs = [*([f"joint batch split: the given split solved first; {unbuilt} other "
               "candidate split(s) not built: the time limit ran out"] if unbuilt else []),
            f"joint batch split: {len(splits)} candidate splits (global batch "
            f"{problem.global_batch}): {attempt.solved} solved, {len(attempt.first)} with a "
            f"plan, {attempt.proven_infeasible} without one by their floors or LP "
            f"relaxations, {attempt.bounded} skipped (bounded above the best; "
            f"{attempt.relaxed} relaxations solved), {attempt.refined} refined"
            + (f", {attempt.unstarted} not started (under {MIN_CANDIDATE_S:g} s of the "
               "limit left)" if attempt.unstarted else "") + "; chosen " + ", ".join(f"{k}={v}" for k, v in split.items())
            + f", objective {ev.objective:.6g}"
            + (f" against {at_own:.6g} at the given split (before refinement)"
               if at_own is not None else "; the given split has no plan"), *report.messages]
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


def _joint_candidates(problem: AllocationProblem, solver: str, opts: SolveOptions,
                      splits: list[dict[str, int]], target: float, source: str, call: _Call
                      ) -> tuple[list[dict[str, int]], list[AllocationProblem],
                                 dict[int, tuple[Plan | None, SolveReport, Evaluation | None]],
                                 int]:
    """The candidates' problems, the given split's first: it is built and solved (with up
    to half the time left) before the others are built, and the others are built only while
    time is left (building them all takes seconds on a large model). Returns the candidates
    built, their problems, the given split's first solve by its index, and how many
    candidates were not built."""
    fixed_opts = ProblemOptions(**{**problem.options.to_json(), "target_ms": problem.target_ms,
                                   "strong_groups": None})

    def make(split: dict[str, int]) -> AllocationProblem:
        key = tuple(sorted(split.items()))
        sub = problem.split_cache.get(key)
        if sub is None:
            sub = problem.split_cache[key] = problem.with_cluster(
                _split_cluster(problem, split), fixed_opts)
        return sub

    own = {g.name: int(g.batch_per_device or problem.graph.batch_size)
           for g in problem.cluster.groups}
    own_i = splits.index(own) if own in splits else 0
    built: dict[int, AllocationProblem] = {own_i: make(splits[own_i])}
    first = run_backend(built[own_i].retarget(target, source=source), solver, opts,
                        call.child(call.deadline.remaining() / 2))
    for i, split in enumerate(splits):
        if i not in built:
            if call.deadline.remaining() < MIN_CANDIDATE_S:
                break
            built[i] = make(split)
    keep = sorted(built)
    return ([splits[i] for i in keep], [built[i] for i in keep], {keep.index(own_i): first},
            len(splits) - len(keep))


@dataclasses.dataclass
class _JointAttempt:
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


def _parts(sub: AllocationProblem, plan: Plan) -> list[float]:
    """Each group's part of the plan's objective on ``sub``."""
    a = sub.assignment(plan)
    return [g.weight * g.degradation(a[g.name]) for g in sub.groups]


def _joint_attempt(problem: AllocationProblem, solver: str, opts: SolveOptions, refine: int,
                   splits: list[dict[str, int]], subs: list[AllocationProblem], target: float,
                   source: str, call: _Call, bounds: SplitBounds, progress: bool = False,
                   pre: dict[int, tuple[Plan | None, SolveReport, Evaluation | None]]
                   | None = None) -> _JointAttempt:
    """The best copy, exactly, solving as few copies as the bounds allow.

    The reference procedure solves every copy once without refinement, then refines them
    in ascending order of that objective (ties in candidate order) and stops once the best
    refined objective is no more than the next copy's (refinement only tightens a target,
    so a refined objective is at least the unrefined one). Here a copy is solved only while
    its lower bound (:class:`~qsync_opt.planner.splits.SplitBounds`) can match the best refined
    objective so far: copies in ascending bound, the one farthest from any solved copy
    first among equal bounds (a bisection of the split axis), the given split first; a copy
    whose floors prove it has no plan is not solved. Every skipped copy's objective is
    above the best refined one, which the reference procedure would have kept as well, so
    the result is the same plan. ``pre``: candidates already solved once at this target
    (the given split, solved before the others were built), not solved again."""
    out = _JointAttempt(first=[], results=[])
    pre = dict(pre or {})
    own = next((i for i, sp in enumerate(splits)
                if sp == {g.name: int(g.batch_per_device or problem.graph.batch_size)
                          for g in problem.cluster.groups}), 0)
    left = set(range(len(splits)))
    solved: list[int] = []
    firsts: dict[int, tuple[float, Plan, SolveReport, Evaluation]] = {}
    refined: dict[int, tuple[Plan | None, SolveReport, Evaluation | None]] = {}
    best = float("inf")

    def refine_loop() -> float:
        """The reference refinement over the copies solved so far (memoised)."""
        out.results = []
        order = sorted(firsts, key=lambda i: (firsts[i][0], i))
        out.first = [(firsts[i][0], splits[i], subs[i]) for i in order]
        for i in order:
            lower = firsts[i][0]
            if out.results and min(r[3].objective for r in out.results) <= lower:
                break
            if out.results and call.deadline.expired():
                break
            if i not in refined:
                _, f_plan, f_rep, f_ev = firsts[i]
                # An OPTIMAL first solve is the refinement's round 0 (the same solve again
                # gives the same plan); another is solved again with the whole call's time.
                refined[i] = _solve_refined_ev(
                    subs[i].retarget(target, source=source), solver, opts, refine, call,
                    first=(f_plan, f_rep, f_ev) if f_rep.status == "OPTIMAL" else None)
                if refined[i][0] is None:  # no time left to solve it again: the first plan
                    refined[i] = (f_plan, f_rep, f_ev)
                out.refined += 1
            plan, report, ev = refined[i]
            if plan is not None and ev is not None:
                out.results.append((splits[i], plan, report, ev))
        return min((r[3].objective for r in out.results), default=float("inf"))

    def pick() -> int | None:
        open_ = sorted(left)
        if not open_:
            return None
        if not bounds.enabled:  # the reference procedure: every candidate, in order
            return open_[0]
        if own in left and not solved:
            return own
        lbs = {i: bounds.lower_bound(i) for i in open_}
        low = min(lbs.values())
        ties = [i for i in open_ if lbs[i] <= low + BOUND_REL * max(abs(low), 1e-300)]
        return max(ties, key=lambda i: (min((abs(i - j) for j in solved), default=0), -i))

    bar = Progress("joint split", total=len(splits), enabled=progress)
    while (i := pick()) is not None:
        bar.update(len(splits) - len(left), note=f"{out.solved} solved")
        if best < float("inf") and not bounds.beats(bounds.lower_bound(i), best):
            out.bounded += len(left)
            break
        if i not in pre and call.deadline.remaining() < MIN_CANDIDATE_S:
            out.unstarted += len(left)
            out.timed_out += 1
            break
        left.discard(i)
        sub = subs[i].retarget(target, source=source)
        if i in pre:  # solved before the other candidates were built
            plan, report, ev = pre.pop(i)
        else:
            got = _joint_first(sub, i, solver, opts, call, bounds, out, len(left), best)
            if got is None:
                continue
            plan, report, ev = got
        solved.append(i)
        out.solved += 1
        out.n_vars += report.n_variables
        out.n_cons += report.n_constraints
        out.timed_out += report.status == "TIME_LIMIT"
        if plan is None or ev is None:
            if report.status == "INFEASIBLE":
                bounds.record(i, None)
            continue
        if report.status == "OPTIMAL":
            bounds.record(i, _parts(sub, plan))
        firsts[i] = (ev.objective, plan, report, ev)
        best = refine_loop()
    refine_loop()
    bar.update(len(splits), note=f"{out.solved} solved")
    bar.close()
    return out


def _joint_first(sub: AllocationProblem, i: int, solver: str, opts: SolveOptions, call: _Call,
                 bounds: SplitBounds, out: _JointAttempt, n_left: int, best: float
                 ) -> tuple[Plan | None, SolveReport, Evaluation | None] | None:
    """Candidate ``i``'s first solve (``sub``: its problem at this target), or None when its
    floors or its groups' LP relaxations prove it has no plan or cannot beat ``best`` (the
    counts go to ``out``)."""
    if bounds.proven_infeasible(i):
        out.proven_infeasible += 1
        bounds.record(i, None)
        return None
    if bounds.enabled:  # the LP relaxation first: it may prove the copy cannot win
        relaxed = [relaxation_bound(sub, [gi], opts.with_time_left(
            max(call.deadline.share(n_left + 1), 1e-3))) for gi in range(len(sub.groups))]
        if all(st != "UNKNOWN" for st, _ in relaxed):
            out.relaxed += 1
            bounds.record_relaxed(i, [v if st == "OPTIMAL" else None for st, v in relaxed])
            if bounds.proven_infeasible(i):
                out.proven_infeasible += 1
                return None
            if best < float("inf") and not bounds.beats(bounds.lower_bound(i), best):
                out.bounded += 1
                return None
    return run_backend(sub, solver, opts, call.child(call.deadline.share(n_left + 1)))


def _tie_note(problem: AllocationProblem, solver: str, opts: SolveOptions, plan: Plan,
              report: SolveReport, call: _Call | None = None) -> SolveReport:
    """With tie groups, solve the untied problem too and say what tying costs (within the
    call's deadline)."""
    tied = [u for u in problem.units if len(u.ops) > 1 and not u.name.startswith("module:")]
    if not tied or not _backend(solver).exact or not problem.options.ties:
        return report
    call = call or _Call.start(opts)
    if call.deadline.expired():
        note = (f"tie groups: {len(tied)} tied decisions restrict the problem; what tying "
                f"costs was not measured (the time limit of {call.limit_s:g} s was spent)")
        return report.model_copy(update={"messages": [*report.messages, note]})
    free = AllocationProblem(problem.graph, problem.cluster, problem.costs, problem.indicator,
                             dataclasses.replace(problem.options, ties=False,
                                                 target_ms=problem.target_ms))
    fplan, freport, _ = run_backend(free, solver, opts, call)
    if fplan is None or report.objective is None or freport.objective is None:
        note = (f"tie groups: {len(tied)} tied decisions restrict the problem; the untied "
                f"problem found no plan ({freport.status})")
    else:
        d = report.objective - freport.objective
        rel = d / freport.objective if freport.objective else 0.0
        note = (f"tie groups: {len(problem.units)} decisions instead of {len(free.units)}; "
                f"tying restricts the problem and costs {d:.6g} of objective "
                f"({rel:+.1%} over the untied optimum {freport.objective:.6g})")
    return report.model_copy(update={"messages": [*report.messages, note]})


def _backend(solver: str) -> Any:
    try:
        backend = get_backend(solver)
    except KeyError as exc:
        raise QsyncInputError(f"solver: {exc.args[0]}") from None
    if not backend.is_available():
        raise QsyncInputError(f"solver: {solver} is not available here (its package or binary "
                              "is missing)")
    return backend


def run_backend(problem: AllocationProblem, solver: str, options: SolveOptions,
                call: _Call | None = None) -> tuple[Plan | None, SolveReport, Evaluation | None]:
    """One backend solve, scored by the evaluator; with ``call``, its time limit is what
    remains of the call (nothing is run once that is spent: status TIME_LIMIT)."""
    backend = _backend(solver)
    if call is not None:
        left = call.deadline.remaining()
        if not left > 0:
            return None, SolveReport(
                solver=solver, status="TIME_LIMIT", mode=mode_text(problem),
                options=options.to_json(),
                messages=[f"not run: the time limit of the whole solve "
                          f"({call.limit_s:g} s) was spent"]), None
        options = options.with_time_left(left)
    plan, report = backend.solve(problem, options)
    if plan is None:
        return None, report, None
    ev = evaluate(problem, plan)
    msgs = list(report.messages)
    msgs.append(f"evaluated: objective {ev.objective:.6g}, linear makespan {ev.makespan_ms:.3f} ms, "
                f"replayer {ev.replay_makespan_ms:.3f} ms, {ev.samples_per_s:.1f} samples/s"
                + (f"; violations: {'; '.join(ev.violations)}" if ev.violations else ""))
    if ev.violations and report.status in ("OPTIMAL", "FEASIBLE") and backend.exact:
        msgs.append("BUG: an exact backend returned a plan the evaluator rejects")
    return plan, report.model_copy(update={"messages": msgs}), ev


@dataclass
class CompareRow:
    solver: str
    status: str
    feasible: bool
    objective: float | None
    makespan_ms: float | None
    replay_makespan_ms: float | None
    samples_per_s: float | None
    peak_memory_gib: dict[str, float]
    wall_s: float
    gap: float | None = None
    rounds: int = 0  # solve-replay refinement rounds after the first solve
    batches: dict[str, int] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)
    plan: Plan | None = field(default=None, repr=False)
    report: SolveReport | None = field(default=None, repr=False)
    ev: Evaluation | None = field(default=None, repr=False)  # the plan scored

    def to_json(self) -> dict[str, Any]:
        return {"solver": self.solver, "status": self.status, "feasible": self.feasible,
                "objective": self.objective, "gap": self.gap, "makespan_ms": self.makespan_ms,
                "replay_makespan_ms": self.replay_makespan_ms,
                "samples_per_s": self.samples_per_s, "peak_memory_gib": self.peak_memory_gib,
                "wall_s": self.wall_s, "rounds": self.rounds, "batches": self.batches,
                "messages": self.messages}


def compare(problem: AllocationProblem, solvers: Sequence[str] | None = None,
            options: SolveOptions | None = None, *, refine: int = REFINE_ROUNDS,
            joint_split: bool = False, batch_multiple: int | None = None) -> list[CompareRow]:
    """One row per allocator and baseline (all available ones by default), each scored by
    the evaluator. Exact backends run with solve-replay refinement (``rounds`` in the row);
    ``joint_split`` adds a row for the first exact backend choosing the batch split too.
    Unavailable backends are listed with status ERROR."""
    names = list(solvers) if solvers is not None else list(registry())
    if joint_split:
        first = next((n for n in names if n in ("highs", "cbc", "cpsat")), None)
        if first is not None:
            names.insert(names.index(first) + 1, f"{first}+split")
    rows: list[CompareRow] = []
    for name in names:
        t0 = time.perf_counter()
        try:
            if name.endswith("+split"):
                base = name.removesuffix("+split")
                try:
                    plan, report = solve_joint(problem, base, options or SolveOptions(), refine,
                                                batch_multiple, "target", LEXICOGRAPHIC_SLACK)
                except (InfeasibleError, SolveTimeLimit) as exc:
                    assert exc.report is not None
                    plan, report = None, exc.report
                ev = evaluate(problem, plan) if plan is not None else None
            elif _backend(name).exact and refine:
                plan, report = _solve_refined(problem, name, options or SolveOptions(), refine,
                                              _Call.start(options or SolveOptions()))
                ev = evaluate(problem, plan) if plan is not None else None
            else:
                plan, report, ev = run_backend(problem, name, options or SolveOptions())
        except QsyncInputError as exc:
            rows.append(CompareRow(name, "ERROR", False, None, None, None, None, {},
                                   time.perf_counter() - t0, messages=[str(exc)]))
            continue
        wall = time.perf_counter() - t0
        if plan is None or ev is None:
            rows.append(CompareRow(name, report.status, False, None, None, None, None, {}, wall,
                                   messages=list(report.messages), report=report))
            continue
        rows.append(CompareRow(
            solver=name, status=report.status, feasible=ev.feasible, objective=ev.objective,
            makespan_ms=ev.makespan_ms, replay_makespan_ms=ev.replay_makespan_ms,
            samples_per_s=ev.samples_per_s,
            peak_memory_gib={g: e.replay_memory_bytes / 2**30 for g, e in ev.groups.items()},
            wall_s=wall, gap=report.gap, messages=list(report.messages), plan=plan,
            report=report, rounds=max(0, len(report.rounds) - 1),
            batches={n: g.batch_per_device for n, g in plan.groups.items()}, ev=ev))
    return rows


def format_rows(rows: Sequence[CompareRow], marks: Sequence[str | None] | None = None) -> str:
    """The comparison as a fixed-width table; ``marks``: per row, a trailing mark (the
    dominated rows': ``qsync_opt.planner.dominance.marked_table``) or None."""
    head = (f"{'solver':>17} {'status':>10} {'ok':>3} {'objective':>11} {'linear ms':>10} "
            f"{'replay ms':>10} {'samples/s':>10} {'rounds':>6} {'wall s':>8}  batches; "
            "peak memory per group")
    lines = [head]
    for i, r in enumerate(rows):
        def num(v: float | None, fmt: str) -> str:
            width = int(fmt.split(".")[0])
            return format(v, fmt) if v is not None else "-".rjust(width)
        mem = " ".join(f"{g}={fmt_bytes(v * GIB).replace(' ', '')}"
                       for g, v in r.peak_memory_gib.items())
        split = ",".join(str(b) for b in r.batches.values())
        lines.append(f"{r.solver:>17} {r.status:>10} {'yes' if r.feasible else 'no':>3} "
                     f"{num(r.objective, '11.5g')} {num(r.makespan_ms, '10.2f')} "
                     f"{num(r.replay_makespan_ms, '10.2f')} {num(r.samples_per_s, '10.1f')} "
                     f"{r.rounds:6d} {r.wall_s:8.3f}  {split}; {mem}"
                     + (f"  {marks[i]}" if marks is not None and marks[i] else ""))
    return "\n".join(lines)
