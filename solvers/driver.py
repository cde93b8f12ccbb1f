"""The driver of every exact backend: one call's orchestration, written once.

A backend (:class:`~.base.ExactBackend`) translates the formulation and runs one part; the
driver owns the rest: the deadline of the whole call (greedy's warm start included), the
checks of the input, the warm start, the parts (one program per group, or one for all),
each part's equal share of the time that remains and the second pass over parts left
unsolved or unproven, the memo of parts solved before in this process, the loose-optimum
loop, and the report.

The loose-optimum loop. A backend proves an OPTIMAL within an absolute tolerance
(``PartResult.objective_tol``: HiGHS's or CBC's absolute gap, CP-SAT's objective rounding).
When that tolerance exceeds the relative gap of the plan's objective (one Omega 1e5 times
the rest, the optimum made of the rest), the OPTIMAL is not trusted as proven: the part is
re-solved without the choices whose term alone exceeds the plan's whole objective (no
better plan takes one, :func:`excluded_choices`), which rescales the objective to what is
left; a plan still not proven that way after :data:`MAX_RESCALES` re-solves, or when time
or the excluded choices run out, is FEASIBLE (the backend says what becomes of its bound).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from qsync_opt.solvers import parts, timing
from qsync_opt.solvers.base import ExactBackend, Forbidden, PartResult, SolveOptions, Translation
from qsync_opt.solvers.checks import check_numbers, infeasible_messages
from qsync_opt.solvers.memo import memo_hit, memo_key, memo_store
from qsync_opt.solvers.parts import better_of, part_floor, part_objective, program_parts
from qsync_opt.solvers.report import finish, mode_text
from qsync_opt.solvers.timing import Deadline, Stopwatch
from qsync_opt.solvers.warmstart import start_hints

from qsync_opt.documents.schemas import Plan, SolveReport
from qsync_opt.problem.groupmodel import GroupModel
from qsync_opt.problem.program import AllocationProblem

#: Re-solves of a program whose OPTIMAL was only proven within the absolute tolerance.
MAX_RESCALES = 3
#: A second pass over unsolved or unproven parts only when this much time is left.
MIN_RETRY_S = 0.05

#: ``solve_part(groups, time limit s, start or None)``: one part's result.
PartSolver = Callable[[Sequence[int], float, Mapping[str, Sequence[int]] | None], PartResult]


@dataclass
class PartsOutcome:
    """What solving every part gave: the status, the assignment (None: no plan), the bound
    (sum over parts; a part with none counts its trivial floor) and the programs' size."""

    status: str
    assignment: dict[str, list[int]] | None
    bound: float | None
    n_variables: int
    n_constraints: int


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


def loose_optimum(problem: AllocationProblem, gis: Sequence[int], result: PartResult,
                  rel_gap: float, tolerance_name: str) -> str | None:
    """Why an OPTIMAL result is not proven within the relative gap (None: it is): its
    absolute tolerance exceeds ``rel_gap`` of the plan's objective. A plan at the part's
    floor (every unit at its least ``w * Omega``) is optimal whatever the tolerances."""
    tol = result.objective_tol
    if result.status != "OPTIMAL" or result.assignment is None or tol is None:
        return None
    z = part_objective(problem, gis, result.assignment)
    if z - part_floor(problem, gis) <= 0.0 or tol <= rel_gap * abs(z):
        return None
    return (f"{tolerance_name} of {tol:.3g} is more than the relative gap {rel_gap:g} of "
            f"the plan's objective {z:.6g} (Omegas of very different sizes)")


class PartRunner:
    """One call's part solver: the backend's run of a part, then the loose-optimum loop."""

    def __init__(self, backend: ExactBackend, translation: Translation) -> None:
        self.backend = backend
        self.translation = translation

    def __call__(self, gis: Sequence[int], limit: float,
                 start: Mapping[str, Sequence[int]] | None) -> PartResult:
        t = self.translation
        end = timing.clock() + max(limit, 0.0)
        seed = start if start is not None else t.hints
        result = self.backend.run(t, gis, limit, seed, None)
        return self.tightened(gis, result, end)

    def tightened(self, gis: Sequence[int], result: PartResult, end: float) -> PartResult:
        """``result``, re-solved without the choices no better plan takes while its OPTIMAL
        is loose (:func:`loose_optimum`); kept as FEASIBLE when that does not prove it."""
        t, backend = self.translation, self.backend
        problem, messages, tag = t.problem, t.messages, t.tag(gis)
        forbid: Forbidden | None = None
        for rnd in range(MAX_RESCALES + 1):
            why = loose_optimum(problem, gis, result, t.options.rel_gap, backend.tolerance_name)
            if why is None or result.assignment is None:
                return result
            objective = part_objective(problem, gis, result.assignment)
            new = excluded_choices(problem, gis, result.assignment)
            if new == forbid or timing.clock() >= end or rnd == MAX_RESCALES:
                messages.append(f"{tag}: {backend.name} reported OPTIMAL, but {why}; status "
                                f"FEASIBLE{backend.demotion_note}")
                return backend.demoted(result, objective)
            forbid = new
            n_out = sum(len(v) for v in forbid.values())
            messages.append(f"{tag}: {backend.name} reported OPTIMAL, but {why}; re-solved "
                            f"without the {n_out} choice(s) whose Omega alone exceeds the "
                            "plan's (no better plan takes them), "
                            + backend.rescale_note(t, gis, forbid))
            again = backend.run(t, gis, end - timing.clock(), result.assignment, forbid)
            if again.assignment is None or part_objective(
                    problem, gis, again.assignment) > objective:
                messages.append(f"{tag}: the re-solve gave {again.status} and no better plan; "
                                f"the first plan is kept as FEASIBLE{backend.demotion_note}")
                return backend.demoted(result, objective)
            result = dataclasses.replace(again, n_variables=result.n_variables,
                                         n_constraints=result.n_constraints)
        return result


def _tag(problem: AllocationProblem, gis: Sequence[int]) -> str:
    return problem.groups[gis[0]].name if len(gis) == 1 else "all"


@dataclass
class _PartsPass:
    """The state of one call's passes over its parts."""

    problem: AllocationProblem
    parts: Sequence[Sequence[int]]
    solve_part: PartSolver
    deadline: Deadline
    messages: list[str]
    memo: tuple[Any, ...] | None
    results: list[PartResult | None]
    n_variables: int = 0
    n_constraints: int = 0

    def failed(self, status: str) -> PartsOutcome:
        return PartsOutcome(status, None, None, self.n_variables, self.n_constraints)


def _answered_part(state: _PartsPass, gis: Sequence[int]) -> PartResult | None:
    """The part's result without a solver run: its least-degradation plan, or the memo's
    answer (with a message); None when it must be run."""
    problem, messages = state.problem, state.messages
    least = parts.least_part(problem, gis)  # (module attribute: tests replace it)
    if least is not None:
        messages.append(f"{_tag(problem, gis)}: every unit at its least degradation meets "
                        "the target and capacity: that is the optimum, no solver run")
        return least
    key = memo_key(state.memo, problem, gis) if state.memo is not None else None
    hit = memo_hit(key, problem, gis, problem.group_budget_ms()) if key else None
    if hit is None:
        return None
    at, res = hit
    messages.append(f"{memo_line_prefix(problem, gis)}{res.status} at a "
                    f"time budget of {at:.4f} ms, which answers this budget, "
                    f"{problem.group_budget_ms():.4f} ms): not solved again")
    if res.status == "INFEASIBLE":
        messages.extend(infeasible_messages(problem, gis, problem.group_budget_ms()))
    return res


def _first_pass(state: _PartsPass) -> PartsOutcome | None:
    """Each part in turn, with an equal share of the time that remains; an INFEASIBLE or
    ERROR part ends the call (returned), else None."""
    problem = state.problem
    for i, gis in enumerate(state.parts):
        res = _answered_part(state, gis)  # (a least-degradation plan: OPTIMAL, no size)
        if res is None:
            if state.deadline.expired():  # nothing is run past the deadline
                state.results[i] = PartResult("TIME_LIMIT", None, None)
                continue
            res = state.solve_part(gis, state.deadline.share(len(state.parts) - i), None)
            if state.memo is not None:
                memo_store(memo_key(state.memo, problem, gis), problem.group_budget_ms(), res)
        state.n_variables += res.n_variables
        state.n_constraints += res.n_constraints
        state.results[i] = res
        if res.status in ("INFEASIBLE", "ERROR"):
            return state.failed(res.status)
    return None


def _second_pass(state: _PartsPass, rel_gap: float) -> PartsOutcome | None:
    """Once every part had its turn, the time left shared among those that ran out of
    their share without a plan, or with one not proven optimal (started from their plan,
    if any), the better result kept; a part that then proves no plan ends the call."""
    retry = [i for i, r in enumerate(state.results)
             if r is not None and r.status in ("TIME_LIMIT", "FEASIBLE")]
    for j, i in enumerate(retry):
        left = state.deadline.share(len(retry) - j)
        if left < MIN_RETRY_S:
            break
        old = state.results[i]
        assert old is not None
        gis = state.parts[i]
        new = state.solve_part(gis, left, old.assignment)
        if new.status in ("INFEASIBLE", "ERROR") and old.assignment is None:
            return state.failed(new.status)
        kept = better_of(state.problem, gis, old, new, rel_gap)
        state.results[i] = kept
        state.messages.append(f"{_tag(state.problem, gis)}: second pass with {left:.3g} s of "
                              f"the time left (first pass {old.status}): {kept.status}")
    return None


def _combined(state: _PartsPass) -> PartsOutcome:
    """The parts' results as one: OPTIMAL when every part is, TIME_LIMIT (no plan) when a
    part has none, else FEASIBLE; the bound summed (a part without one counts its floor)."""
    problem = state.problem
    status = "OPTIMAL"
    assignment: dict[str, list[int]] = {}
    bound = 0.0
    for gis, r in zip(state.parts, state.results, strict=True):
        assert r is not None
        bound += r.bound if r.bound is not None else part_floor(problem, gis)
        if r.assignment is None:
            status = "TIME_LIMIT"
            state.messages.append(f"{_tag(problem, gis)}: no plan within its share of the "
                                  "time limit")
            continue
        assignment.update(r.assignment)
        if r.status != "OPTIMAL" and status == "OPTIMAL":
            status = "FEASIBLE"
    return PartsOutcome(status, None if status == "TIME_LIMIT" else assignment, bound,
                        state.n_variables, state.n_constraints)


def solve_parts(problem: AllocationProblem, parts: Sequence[Sequence[int]],
                solve_part: PartSolver, deadline: Deadline, messages: list[str],
                rel_gap: float, memo: tuple[Any, ...] | None = None) -> PartsOutcome:
    """Solve each part (``solve_part(groups, time limit s, start or None)``) within the
    deadline: each part gets an equal share of the time that remains. A part that ran out
    of its share without a plan, or with one not proven optimal, does not end the call:
    once every part had its turn, the time left is shared among those again (started from
    their plan, if any), the better result kept.

    ``memo``: what makes the backend's answer to a program (its name and the options that
    change it); with it, a part already solved in this process, to optimality or to no
    plan, at this budget or at a larger one that answers this one (:func:`.memo.memo_hit`),
    is not solved again (the Pareto sweep and the joint split meet the same group at the
    same batch many times)."""
    state = _PartsPass(problem, parts, solve_part, deadline, messages, memo,
                       [None] * len(parts))
    ended = _first_pass(state) or _second_pass(state, rel_gap)
    return ended if ended is not None else _combined(state)


def _hints(problem: AllocationProblem, options: SolveOptions, backend: ExactBackend,
           deadline: Deadline, messages: list[str]) -> dict[str, list[int]] | None:
    hints = start_hints(problem, options, messages, deadline)
    if hints is not None and backend.hint_note is not None:
        messages.append(backend.hint_note)
    return hints


def solve_assignment(backend: ExactBackend, problem: AllocationProblem, options: SolveOptions,
                     sw: Stopwatch, messages: list[str]) -> tuple[PartsOutcome, Translation]:
    """Every part of ``problem`` solved by ``backend`` within ``options.time_limit_s`` (the
    whole call, greedy's warm start included), and the call's translation. Translated
    first: a proof of no plan found there ends the call before any warm start or run."""
    deadline = Deadline(options.time_limit_s)
    check_numbers(problem)
    t = backend.translate(problem, options, sw, messages)
    if t.proof:
        program_parts(problem, options, messages)
        messages.extend(t.proof)
        return PartsOutcome("INFEASIBLE", None, None, 0, 0), t
    t.hints = _hints(problem, options, backend, deadline, messages)
    parts = program_parts(problem, options, messages)
    memo = t.memo_key if t.hints is None else None
    return solve_parts(problem, parts, PartRunner(backend, t), deadline, messages,
                       options.rel_gap, memo), t


def solve_group_alone(backend: ExactBackend, problem: AllocationProblem, gi: int,
                      options: SolveOptions) -> tuple[PartResult | None, list[str]]:
    """Group ``gi``'s program of ``problem`` solved on its own, as the decomposed call's
    first pass solves it (the memo consulted and filled, the loose-optimum loop), within
    ``options.time_limit_s``: its result and the messages that part's solve wrote. None
    (nothing run) where the call would not use the memo (a warm start, one program for all
    groups) or its translation proves no plan: the part's answer would then differ from
    the call's own or not be kept. The joint split bounds a candidate split by one group
    this way; when the split is then solved whole, the memo answers that group."""
    messages: list[str] = []
    if (not options.decompose or options.hints is not None
            or options.warm_start is not None):
        return None, messages
    deadline = Deadline(options.time_limit_s)
    check_numbers(problem)
    t = backend.translate(problem, options, Stopwatch(), messages)
    if t.proof or t.memo_key is None:
        return None, messages
    state = _PartsPass(problem, [[gi]], PartRunner(backend, t), deadline, messages,
                       t.memo_key, [None])
    _first_pass(state)
    return state.results[0], messages


def memo_line_prefix(problem: AllocationProblem, gis: Sequence[int]) -> str:
    """How the message of a part the memo answered begins (:func:`_answered_part`)."""
    return f"{_tag(problem, gis)}: solved before in this process ("


def solve_exact(backend: ExactBackend, problem: AllocationProblem, options: SolveOptions
                ) -> tuple[Plan | None, SolveReport]:
    """One call of an exact backend: the plan (None when there is none) and the report."""
    sw = Stopwatch()
    messages: list[str] = []
    mode = mode_text(problem)
    if not backend.is_available():
        messages.append(f"{backend.name}: solver not available ({backend.requires} missing)")
        return finish(problem, backend.name, None, status="ERROR", mode=mode,
                      options=options, sw=sw, messages=messages)
    got, t = solve_assignment(backend, problem, options, sw, messages)
    bound = got.bound
    if got.assignment is not None and got.status == "OPTIMAL" and bound is not None:
        bound = min(bound, problem.objective(got.assignment))
    if got.assignment is not None and got.status == "FEASIBLE":
        note = backend.unproven_note(t, got.n_variables)
        if note is not None:
            messages.append(note)
    return finish(problem, backend.name, got.assignment, status=got.status, mode=mode,
                  options=options, sw=sw, bound=bound, n_variables=got.n_variables,
                  n_constraints=got.n_constraints, messages=messages,
                  extra_options=t.report_options, optimal_tol=t.optimal_tol)
