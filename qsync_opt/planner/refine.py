"""Solve-replay refinement: re-solve with the linear target tightened by the replayer's
excess until the replayer's makespan meets the target, never below the smallest makespan the
linear model reaches; the best round is kept."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qsync_opt.documents.schemas import Plan, SolveReport
from qsync_opt.planner.call import ScoredRun, SolveCall, backend_for, reachable_ms, run_backend
from qsync_opt.problem.evaluator import Evaluation
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.solvers import SolveOptions
from qsync_opt.solvers.ilp import FastestTimeLimit
from qsync_opt.solvers.report import mode_text

#: Solve-replay refinement rounds by default.
REFINE_ROUNDS = 3


#: A replayer makespan within this relative margin of the target meets it.
MEETS_REL = 1e-7


@dataclass
class _RoundLog:
    """The rounds of one refinement: a row per round with a plan, its scored result, the
    last report (a plan or not), the messages, and whether the floor stopped it."""

    target: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    results: list[tuple[Plan, SolveReport, Evaluation]] = field(default_factory=list)
    last_report: SolveReport | None = None
    messages: list[str] = field(default_factory=list)
    stuck: bool = False

    def meets(self, ev: Evaluation) -> bool:
        return ev.replay_makespan_ms <= self.target * (1 + MEETS_REL)


def refine_against_replayer(problem: AllocationProblem, solver: str, opts: SolveOptions,
                            refine: int, call: SolveCall | None = None,
                            first: ScoredRun | None = None) -> ScoredRun:
    """Solve; for exact backends, re-solve with the linear target tightened by the
    replayer's excess, at most ``refine`` times, never below the floor (the smallest
    makespan the linear model reaches). The best round is kept: the least objective among
    those meeting the target in the replayer, else the least replayer makespan. The report
    lists the rounds (``kept`` marks the one returned) and says plainly when re-targeting
    the linear model cannot meet the replayer's target. ``first``: round 0 already solved
    (an OPTIMAL solve of ``problem`` with these options: solving it again gives it again)."""
    call = call or SolveCall.start(opts)
    log = _run_rounds(problem, solver, opts, refine, call, first)
    if not log.results:
        assert log.last_report is not None
        return ScoredRun(None, log.last_report.model_copy(update={
            "messages": [*log.last_report.messages, *log.messages]}), None)
    return _kept_round(problem, log)


def _run_rounds(problem: AllocationProblem, solver: str, opts: SolveOptions, refine: int,
                call: SolveCall, first: ScoredRun | None) -> _RoundLog:
    """Round 0, then (exact backends) a round per tightened target until one meets the
    target in the replayer, the floor is reached, the rounds or the time run out."""
    target = problem.target_ms
    exact = backend_for(solver).exact
    log = _RoundLog(target)
    prob = problem
    floor: float | None = None
    at_floor = False
    for r in range(refine + 1 if exact else 1):
        if r and call.deadline.expired():
            log.messages.append(f"refinement stopped at the time limit ({call.limit_s:g} s) "
                                f"after {r} round(s)")
            break
        if r == 0 and first is not None:
            plan, report, ev = first.plan, first.report, first.evaluation
        else:
            plan, report, ev = run_backend(prob, solver, opts, call)
        log.last_report = report
        if plan is None or ev is None:
            if r:
                log.messages.append(f"refinement round {r}: target {prob.target_ms:.3f} ms "
                                    f"leaves no plan ({report.status}); keeping the best "
                                    "earlier round")
            break
        replay = ev.replay_makespan_ms
        log.rows.append({"round": r, "target_ms": prob.target_ms, "objective": ev.objective,
                         "makespan_ms": ev.makespan_ms, "replay_makespan_ms": replay,
                         "status": report.status})
        log.results.append((plan, report, ev))
        if log.meets(ev) or not exact or r == refine:
            break
        if at_floor:  # the linear target cannot go lower
            log.stuck = True
            break
        nxt = prob.target_ms - (replay - target)
        if floor is None:
            floor = _floor(problem, call)
        if nxt <= floor:
            if prob.target_ms <= floor * (1 + 1e-12):
                log.stuck = True
                break
            nxt, at_floor = floor, True
        prob = problem.retarget(nxt, source=f"refined: {problem.target_source}")
    return log


def _floor(problem: AllocationProblem, call: SolveCall) -> float:
    """The lowest linear target refinement may set: the smallest reachable makespan (when
    unknown, the tail alone, and never 0)."""
    try:
        floor = reachable_ms(problem, call)
    except FastestTimeLimit:
        floor = None
    return floor if floor is not None else max(problem.tail_ms, 1e-9 * problem.target_ms)


def _kept_round(problem: AllocationProblem, log: _RoundLog) -> ScoredRun:
    """The best round, its plan's provenance and its report saying what refinement did."""
    target, rounds, results = log.target, log.rows, log.results
    good = [i for i, (_, _, ev) in enumerate(results) if log.meets(ev)]
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
    if log.meets(ev):
        verdict = (f"meets the target {target:.3f} ms in the replayer "
                   f"({ev.replay_makespan_ms:.3f} ms)")
        if len(rounds) > 1:
            verdict += f" after {len(rounds) - 1} refinement round(s){which}"
    else:
        verdict = (f"does NOT meet the target {target:.3f} ms in the replayer: "
                   f"{ev.replay_makespan_ms:.3f} ms after {len(rounds) - 1} refinement "
                   f"round(s){which} (linear model {ev.makespan_ms:.3f} ms)")
        if log.stuck:
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
    return ScoredRun(plan, report.model_copy(update={
        "rounds": rounds, "mode": mode,
        "messages": [*report.messages, *log.messages, verdict]}), ev)
