"""Whether a returned plan is dominated, and the plan the project recommends instead.

One plan *dominates* another when, both scored by the evaluator, it fits memory, is as fast
or faster (throughput: the global batch over the replayer's iteration time, so a plan that
leaves groups out is compared fairly) and as little or less degraded (the objective), with
at least one of the two strictly better (beyond :data:`REL_TOL`).

``solve`` asks :func:`dominance_note` after its solve: the cheap baselines (uniform precision,
dynamic batching, the strong groups alone: no search, a few evaluations each) are scored
and, when one dominates the plan, one line names it and the flag that finds such plans
(``--joint-split`` when it is another batch split; a lower ``--target-ms`` when the plan
already came from the joint split or the baseline keeps the batch split). The joint split
itself is not run here (it is not cheap): a dominating batch split at the reference
precision is the cheap bound that shows the joint split has a plan at least as little
degraded at that split. The demo trains (part 1) and writes (part 2) :func:`recommend`'s
choice among its table's rows (:func:`recommend_row`), and ``compare`` marks each row another
row dominates (:func:`dominated_by`, :func:`marked_table`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.documents.schemas import Plan
from qsync_opt.planner.call import run_backend
from qsync_opt.planner.compare import CompareRow, format_rows
from qsync_opt.problem.evaluator import Evaluation
from qsync_opt.problem.program import EVAL_TOL, AllocationProblem
from qsync_opt.solvers import SolveOptions

#: Relative tolerance of "as fast" and "as little degraded": differences within it are ties.
REL_TOL = EVAL_TOL
#: Absolute tolerance of the degradation (an objective of 0 against 1e-15 is a tie).
ABS_TOL = 1e-12
#: The baselines scored after every solve: none searches, each costs a few evaluations.
CHEAP_BASELINES = ("uniform", "dynamic-batching", "strong-only")
_LABELS = {"uniform": "uniform precision (baseline)",
           "dynamic-batching": "dynamic batching (baseline)",
           "strong-only": "the strong groups alone (baseline)"}


@dataclass(frozen=True)
class Candidate:
    """A plan scored by the evaluator, under the allocator's name (``solver``)."""

    solver: str
    plan: Plan
    ev: Evaluation

    @property
    def label(self) -> str:
        if self.solver.endswith("+split"):
            return f"the joint split ({self.solver.removesuffix('+split')} with --joint-split)"
        return _LABELS.get(self.solver, f"{self.solver}'s plan")

    @property
    def batches(self) -> dict[str, int]:
        return {n: g.batch_per_device for n, g in self.plan.groups.items()}


def _finite(*xs: float) -> bool:
    return all(math.isfinite(x) for x in xs)


def dominates(a: Evaluation, b: Evaluation) -> bool:
    """``a`` dominates ``b``: ``a`` fits memory, is as fast or faster (samples/s) and as little
    or less degraded (objective), at least one strictly (beyond the tolerances)."""
    if not a.fits or not _finite(a.samples_per_s, b.samples_per_s, a.objective, b.objective):
        return False
    tol = ABS_TOL + REL_TOL * max(abs(a.objective), abs(b.objective))
    faster = a.samples_per_s > b.samples_per_s * (1 + REL_TOL)
    as_fast = a.samples_per_s >= b.samples_per_s * (1 - REL_TOL)
    less = a.objective < b.objective - tol
    as_little = a.objective <= b.objective + tol
    return as_fast and as_little and (faster or less)


def dominators(ev: Evaluation, candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates that dominate ``ev``: first those no other of them dominates, then the
    rest, each part the least degraded first (the fastest among ties)."""
    got = sorted((c for c in candidates if dominates(c.ev, ev)),
                 key=lambda c: (c.ev.objective, -c.ev.samples_per_s))
    # within the tolerances the order alone could put a dominated one first
    free = [c for c in got if not any(dominates(o.ev, c.ev) for o in got)]
    return free + [c for c in got if c not in free]


def baseline_candidates(problem: AllocationProblem, options: SolveOptions,
                        skip: Sequence[str] = ()) -> list[Candidate]:
    """The cheap baselines' plans for ``problem``, each scored by the evaluator (a baseline
    that cannot make a plan here is left out)."""
    out = []
    for name in CHEAP_BASELINES:
        if name in skip:
            continue
        try:
            plan, _, ev = run_backend(problem, name, options)
        except QsyncInputError:
            continue
        if plan is not None and ev is not None:
            out.append(Candidate(name, plan, ev))
    return out


def _speed(ev: Evaluation, other: Evaluation) -> str:
    text = f"{ev.replay_makespan_ms:.2f} ms"
    if ev.global_batch != other.global_batch:
        text += f" ({ev.samples_per_s:.1f} samples/s at global batch {ev.global_batch})"
    return text


def _remedy(problem: AllocationProblem, plan: Plan, best: Candidate, joint_split: bool) -> str:
    """What finds such a plan: the flag, or leaving the weak groups out."""
    left = [g.name for g in problem.cluster.groups if g.name not in best.plan.groups]
    if left:
        return (f"the group(s) {', '.join(left)} do not pay here: leave them out of "
                "--cluster")
    own = {n: g.batch_per_device for n, g in plan.groups.items()}
    if best.batches != own and not joint_split:
        return ("re-run with --joint-split (the batch split chosen with the precisions), or "
                "take its plan from `compare --plans DIR`")
    return (f"re-run with a lower --target-ms (its linear makespan is "
            f"{best.ev.makespan_ms:.2f} ms), or take its plan from `compare --plans DIR`")


def note_for(problem: AllocationProblem, plan: Plan, ev: Evaluation,
             candidates: Sequence[Candidate], *, joint_split: bool = False) -> str | None:
    """One line when a candidate dominates ``plan`` (scored ``ev``), else None."""
    found = dominators(ev, candidates)
    if not found:
        return None
    best = found[0]
    return (f"note: {best.label} reaches {_speed(best.ev, ev)} at degradation "
            f"{best.ev.objective:.3g}, dominating this plan ({_speed(ev, best.ev)}, "
            f"{ev.objective:.3g}); {_remedy(problem, plan, best, joint_split)}")


def dominance_note(problem: AllocationProblem, plan: Plan, ev: Evaluation, solver: str,
                   options: SolveOptions, *, joint_split: bool = False) -> str | None:
    """``solve``'s check: the cheap baselines against the returned plan (see the module)."""
    cands = baseline_candidates(problem, options, skip=(solver,))
    return note_for(problem, plan, ev, cands, joint_split=joint_split)


def recommend(chosen: Candidate, others: Sequence[Candidate]) -> tuple[Candidate, str | None]:
    """The plan the project recommends: ``chosen`` unless another candidate dominates it;
    then the first of :func:`dominators` (one no other candidate dominates, the least
    degraded of those). Returns the plan and why, in words (None when ``chosen`` stands)."""
    found = dominators(chosen.ev, [c for c in others if c.solver != chosen.solver])
    if not found:
        return chosen, None
    best = found[0]
    why = (f"{best.label} dominates {chosen.solver}'s plan: {_speed(best.ev, chosen.ev)} at "
           f"degradation {best.ev.objective:.3g} against {_speed(chosen.ev, best.ev)} at "
           f"{chosen.ev.objective:.3g}, both scored by the evaluator")
    return best, why


#: The legend of :func:`marked_table`'s mark (printed once, when a row carries it).
MARK_LEGEND = ("[dominated by X]: row X's plan fits memory and is as fast or faster "
               "(samples/s) and as little or less degraded (objective), one strictly, both "
               "scored by the evaluator")


def row_candidates(rows: Sequence[CompareRow], every_group: Sequence[str] | None = None
                   ) -> list[Candidate]:
    """The rows with a scored plan, as candidates (``every_group``: only plans over all of
    these groups)."""
    return [Candidate(r.solver, r.plan, r.ev) for r in rows
            if r.plan is not None and r.ev is not None
            and (every_group is None or set(r.plan.groups) == set(every_group))]


def dominated_by(rows: Sequence[CompareRow]) -> list[str | None]:
    """Per row of a comparison, the allocator X of the row whose plan dominates the row's
    (the first of :func:`dominators`: one no other row dominates), else None."""
    cands = row_candidates(rows)
    out: list[str | None] = []
    for r in rows:
        found = (dominators(r.ev, [c for c in cands if c.solver != r.solver])
                 if r.ev is not None else [])
        out.append(found[0].solver if found else None)
    return out


def marked_table(rows: Sequence[CompareRow]) -> str:
    """:func:`~qsync_opt.planner.compare.format_rows` with the dominated rows marked, and the mark's
    legend on one line after the table when a row carries it."""
    marks = [f"[dominated by {x}]" if x else None for x in dominated_by(rows)]
    text = format_rows(rows, marks)
    return text + (f"\n{MARK_LEGEND}" if any(marks) else "")


def recommend_row(rows: Sequence[CompareRow], every_group: Sequence[str] | None = None
                  ) -> tuple[Candidate, str | None, CompareRow] | None:
    """The plan a comparison recommends: the first exact allocator's feasible plan unless
    another row's plan dominates it (:func:`recommend`; ``every_group``: only plans over all
    of these groups compete). Returns it, why (None when the exact plan stands) and the
    exact row; None when no exact allocator found a feasible plan."""
    exact = next((r for r in rows if r.solver in ("highs", "cpsat", "cbc")
                  and r.plan is not None and r.ev is not None and r.feasible), None)
    if exact is None:
        return None
    cands = row_candidates(rows, every_group)
    own = next((c for c in cands if c.solver == exact.solver), None)
    if own is None:  # the exact plan leaves a group out: it stands alone
        assert exact.plan is not None and exact.ev is not None
        return Candidate(exact.solver, exact.plan, exact.ev), None, exact
    best, why = recommend(own, cands)
    return best, why, exact
