"""The allocator API: build a problem and solve it with any backend.

Every plan any backend returns passes through :func:`qsync_opt.problem.evaluator.evaluate`; the
report's messages carry the evaluation (:func:`qsync_opt.planner.compare.compare` tabulates it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from qsync_opt.core.errors import QsyncInputError
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
from qsync_opt.indicator import fast_options, indicate, placeholder_indicator
from qsync_opt.netsim.cluster import parse_comm_model, with_netsim_comm
from qsync_opt.planner.call import (
    InfeasibleError,
    SolveCall,
    SolveTimeLimit,
    backend_for,
    no_plan_error,
    own_fastest,
    reachable_ms,
    run_backend,
    time_limit_error,
)
from qsync_opt.planner.diagnose import precheck
from qsync_opt.planner.joint import LEXICOGRAPHIC_SLACK, solve_joint
from qsync_opt.planner.refine import REFINE_ROUNDS, refine_against_replayer
from qsync_opt.problem.program import AllocationProblem, ProblemOptions
from qsync_opt.solvers import SolveOptions
from qsync_opt.solvers.checks import check_numbers
from qsync_opt.solvers.ilp import FastestTimeLimit

#: Per-device batch at which the indicator runs on this CPU when none is given.
INDICATOR_BATCH = 8


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
        table = with_netsim_comm(graph, cl, table, parse_comm_model(comm_model))
    if indicator is None:
        if check is not None and indicator_method != "random":
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
    call = SolveCall.start(opts)
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


def _solve_modes(problem: AllocationProblem, solver: str, opts: SolveOptions, refine: int,
                 mode: str, slack: float, call: SolveCall) -> tuple[Plan, SolveReport]:
    first = refine_against_replayer(problem, solver, opts, refine, call)
    plan, report = first.plan, first.report
    if plan is not None:
        return plan, report
    if report.status == "TIME_LIMIT":
        raise time_limit_error(problem, solver, report, call)
    default_target = problem.options.target_ms is None
    if mode == "auto" and default_target and report.status == "INFEASIBLE":
        if backend_for(solver).exact:
            try:
                best = reachable_ms(problem, call)
            except FastestTimeLimit:
                raise time_limit_error(problem, solver, report, call) from None
            whose = "smallest reachable makespan"
        else:  # the backend's own figure: what it reaches, in its own makespan
            best = own_fastest(report)
            whose = f"smallest makespan {solver} reaches (its fastest plan)"
        if best is not None and best > problem.target_ms:
            lex = problem.retarget(best * (1 + slack), source=(
                f"lexicographic: the default target {problem.target_ms:.3f} ms is out of reach "
                f"even at the fastest precisions; {whose} {best:.3f} ms, "
                f"least degradation within {slack:.0%} of it"))
            again = refine_against_replayer(lex, solver, opts, refine, call)
            plan, report2 = again.plan, again.report
            if plan is not None:
                msgs = [f"default target {problem.target_ms:.3f} ms out of reach: "
                        f"{whose} {best:.3f} ms", *report2.messages]
                return plan, report2.model_copy(update={
                    "mode": f"lexicographic (makespan first, then degradation within "
                            f"{slack:.0%}): {lex.target_source}", "messages": msgs})
            if report2.status == "TIME_LIMIT":
                raise time_limit_error(problem, solver, report2, call)
    raise no_plan_error(problem, solver, report, call)


def _solve_budget(problem: AllocationProblem, solver: str, opts: SolveOptions,
                  budget: float, rel_tol: float = 1e-3, call: SolveCall | None = None
                  ) -> tuple[Plan, SolveReport]:
    """Least linear makespan whose optimal degradation is within ``budget``: bisection on the
    target (the optimum of the target mode is non-increasing in the target), within the
    call's deadline (stopped early, the best plan so far is returned and the mode says so)."""
    call = call or SolveCall.start(opts)
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
                raise time_limit_error(problem, solver, last[0], call)
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


def _tie_note(problem: AllocationProblem, solver: str, opts: SolveOptions, plan: Plan,
              report: SolveReport, call: SolveCall | None = None) -> SolveReport:
    """With tie groups, solve the untied problem too and say what tying costs (within the
    call's deadline)."""
    tied = [u for u in problem.units if len(u.ops) > 1 and not u.name.startswith("module:")]
    if not tied or not backend_for(solver).exact or not problem.options.ties:
        return report
    call = call or SolveCall.start(opts)
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
