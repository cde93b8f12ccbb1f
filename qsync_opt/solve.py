"""The allocator API: build a problem, solve it with any backend, compare backends.

Every plan any backend returns passes through :func:`qsync_opt.problem.evaluate`; the
report's messages carry the evaluation, and :func:`compare` tabulates it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cluster import load_cluster
from .costs import estimate
from .errors import QsyncInputError
from .graph import trace
from .io import load
from .problem import AllocationProblem, Evaluation, ProblemOptions, evaluate
from .schemas import ClusterSpec, CostTable, IndicatorTable, ModelGraph, Plan, SolveReport
from .solvers import SolveOptions, get_backend, registry

#: Per-device batch at which the indicator runs on this CPU when none is given.
INDICATOR_BATCH = 8


class InfeasibleError(QsyncInputError):
    """No plan satisfies the problem; ``report`` says what the solver found."""

    def __init__(self, message: str, report: SolveReport | None = None) -> None:
        super().__init__(message)
        self.report = report


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
) -> AllocationProblem:
    """Graph + cluster + costs + indicator -> :class:`AllocationProblem`.

    ``model``: a registry name, ``path.py:fn`` or a traced graph. Costs default to the
    roofline estimate; the indicator defaults to ``indicate()`` on this CPU (cached), at a
    small batch for the catalog workloads (Omega is relative, so it holds at every batch).
    """
    graph = model if isinstance(model, ModelGraph) else trace(model, batch)
    cl = load_cluster(cluster)
    if costs is None:
        table = estimate(graph, cl)
    elif isinstance(costs, CostTable):
        table = costs
    else:
        table = load(costs, CostTable)
    if indicator is None:
        import torch

        from .indicator import indicate

        torch_rows = {"term_dtype": torch.bfloat16, "term_rows": 2} if indicator_fast else {}
        ind = indicate(graph.workload, indicator_batches, indicator_method,
                       batch=indicator_batch or min(INDICATOR_BATCH, graph.batch_size),
                       progress=progress, **torch_rows)  # type: ignore[arg-type]
    elif isinstance(indicator, IndicatorTable):
        ind = indicator
    else:
        ind = load(indicator, IndicatorTable)
    return AllocationProblem(graph, cl, table, ind, options)


def solve(problem: AllocationProblem, solver: str = "cpsat",
          options: SolveOptions | None = None) -> tuple[Plan, SolveReport]:
    """Solve with one backend; the plan is checked by the evaluator before it is returned.

    Raises :class:`InfeasibleError` (carrying the report) when the backend finds no plan.
    """
    plan, report, ev = _run(problem, solver, options or SolveOptions())
    if plan is None:
        said = "; ".join(m.replace("\n", " ") for m in report.messages[-3:])
        raise InfeasibleError(f"{solver}: no plan ({report.status}); {said}", report)
    return plan, report


def _run(problem: AllocationProblem, solver: str, options: SolveOptions
         ) -> tuple[Plan | None, SolveReport, Evaluation | None]:
    try:
        backend = get_backend(solver)
    except KeyError as exc:
        raise QsyncInputError(f"solver: {exc.args[0]}") from None
    if not backend.is_available():
        raise QsyncInputError(f"solver: {solver} is not available here (its package or binary "
                              "is missing)")
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
    messages: list[str] = field(default_factory=list)
    plan: Plan | None = field(default=None, repr=False)
    report: SolveReport | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"solver": self.solver, "status": self.status, "feasible": self.feasible,
                "objective": self.objective, "gap": self.gap, "makespan_ms": self.makespan_ms,
                "replay_makespan_ms": self.replay_makespan_ms,
                "samples_per_s": self.samples_per_s, "peak_memory_gib": self.peak_memory_gib,
                "wall_s": self.wall_s, "messages": self.messages}


def compare(problem: AllocationProblem, solvers: Sequence[str] | None = None,
            options: SolveOptions | None = None) -> list[CompareRow]:
    """One row per allocator and baseline (all available ones by default), each scored by
    the evaluator. Unavailable backends are listed with status ERROR."""
    names = list(solvers) if solvers is not None else list(registry())
    rows: list[CompareRow] = []
    for name in names:
        t0 = time.perf_counter()
        try:
            plan, report, ev = _run(problem, name, options or SolveOptions())
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
            report=report))
    return rows


def format_rows(rows: Sequence[CompareRow]) -> str:
    """The comparison as a fixed-width table."""
    head = (f"{'solver':>17} {'status':>10} {'ok':>3} {'objective':>11} {'linear ms':>10} "
            f"{'replay ms':>10} {'samples/s':>10} {'wall s':>8}  peak GiB per group")
    lines = [head]
    for r in rows:
        def num(v: float | None, fmt: str) -> str:
            width = int(fmt.split(".")[0])
            return format(v, fmt) if v is not None else "-".rjust(width)
        mem = " ".join(f"{g}={v:.1f}" for g, v in r.peak_memory_gib.items())
        lines.append(f"{r.solver:>17} {r.status:>10} {'yes' if r.feasible else 'no':>3} "
                     f"{num(r.objective, '11.5g')} {num(r.makespan_ms, '10.2f')} "
                     f"{num(r.replay_makespan_ms, '10.2f')} {num(r.samples_per_s, '10.1f')} "
                     f"{r.wall_s:8.3f}  {mem}")
    return "\n".join(lines)
