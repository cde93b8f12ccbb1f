"""Compare backends: one row per allocator and baseline, each plan scored by the evaluator,
and the rows as a fixed-width table."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.units import GIB, fmt_bytes
from qsync_opt.documents.schemas import Plan, SolveReport
from qsync_opt.planner.call import (
    InfeasibleError,
    SolveCall,
    SolveTimeLimit,
    backend_for,
    run_backend,
)
from qsync_opt.planner.joint import LEXICOGRAPHIC_SLACK, solve_joint
from qsync_opt.planner.refine import REFINE_ROUNDS, refine_against_replayer
from qsync_opt.problem.evaluator import Evaluation, evaluate
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.solvers import SolveOptions
from qsync_opt.solvers.backends import registry


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
            elif backend_for(name).exact and refine:
                refined = refine_against_replayer(problem, name, options or SolveOptions(),
                                                  refine, SolveCall.start(options or SolveOptions()))
                plan, report = refined.plan, refined.report
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
