"""The Pareto frontier: degradation against throughput as the makespan target sweeps.

For each target between the smallest reachable makespan and the all-reference makespan,
the exact backend (at the given batch split, and with the joint batch split), QSync's
greedy and the additive ILP each give a plan; the target-free baselines (uniform,
dynamic batching, strong-only) give one point each. Every point is scored by the evaluator.

Why the exact frontier cannot be dominated: a plan with linear makespan m and degradation d
is feasible for the target m, so the exact optimum at m is at most d; the optimum does not
increase with the target, so no plan is both faster (in the linear model) and less degraded
than an exact point. With the joint split this holds against every plan that trains the
same global batch, dynamic batching included. ``strong-only`` trains a smaller global batch
(the weak cards' samples are dropped), so it is drawn as a reference, not a competitor.

So that this shows in the points, each exact series is also solved at the makespan of every
other same-batch point, unless one of its points already matches that point (is as fast
and as little degraded): then no solve there could show anything the series does not.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.figures import new_figure, png_bytes
from qsync_opt.core.progress import Progress
from qsync_opt.documents.io import atomic_write_bytes
from qsync_opt.documents.outfolder import write_bytes
from qsync_opt.planner.call import InfeasibleError, SolveTimeLimit, reachable_ms, run_backend
from qsync_opt.planner.joint import solve_joint
from qsync_opt.problem.evaluator import evaluate
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.solvers import SolveOptions

#: Allocators swept over the targets, and baselines scored once.
SWEPT = ("exact", "exact+split", "greedy", "additive-ilp")
ONCE = ("uniform", "dynamic-batching", "strong-only")


@dataclass
class FrontierPoint:
    allocator: str
    target_ms: float | None
    status: str
    objective: float | None
    makespan_ms: float | None
    replay_makespan_ms: float | None
    samples_per_s: float | None  # global batch / linear makespan
    replay_samples_per_s: float | None
    global_batch: int | None
    batches: dict[str, int] | None
    feasible: bool

    def dominates(self, other: FrontierPoint, tol: float = 1e-9) -> bool:
        """Better or equal on both axes (less degradation, more samples/s), better on one."""
        if None in (self.objective, self.samples_per_s, other.objective, other.samples_per_s):
            return False
        a_obj, a_thr = self.objective, self.samples_per_s
        b_obj, b_thr = other.objective, other.samples_per_s
        assert a_obj is not None and a_thr is not None and b_obj is not None and b_thr is not None
        no_worse = a_obj <= b_obj + tol * max(1.0, abs(b_obj)) and a_thr >= b_thr * (1 - tol)
        better = a_obj < b_obj - tol * max(1.0, abs(b_obj)) or a_thr > b_thr * (1 + tol)
        return no_worse and better


def target_range(problem: AllocationProblem) -> tuple[float, float]:
    """(smallest reachable makespan, all-reference makespan) of the linear model."""

    lo = reachable_ms(problem)
    if lo is None:  # infeasible, not bad input (its own exit code in the CLI)
        raise InfeasibleError("frontier: no plan fits memory; see `qsync-opt solve` for why")
    hi = problem.makespan_ms(problem.reference_assignment())
    return lo, max(hi, lo * 1.05)


def frontier(problem: AllocationProblem, *, points: int = 8, exact: str = "highs",
             allocators: Sequence[str] = SWEPT + ONCE, options: SolveOptions | None = None,
             batch_multiple: int | None = None, progress: bool = False) -> list[FrontierPoint]:
    """Sweep the makespan target over ``points`` values and score every allocator
    (``progress``: a bar on stderr, drawn once the sweep has run 2 s)."""

    if points < 2:
        raise QsyncInputError(f"points: expected at least 2, got {points}")
    unknown = set(allocators) - set(SWEPT) - set(ONCE)
    if unknown:
        raise QsyncInputError(f"allocators: unknown {', '.join(sorted(unknown))}; known: "
                              f"{', '.join(SWEPT + ONCE)}")
    opts = options or SolveOptions()
    lo, hi = target_range(problem)
    targets = [lo + (hi - lo) * k / (points - 1) for k in range(points)]
    out: list[FrontierPoint] = []

    def point(name: str, target: float | None, plan: Any, status: str) -> FrontierPoint:
        if plan is None:
            return FrontierPoint(name, target, status, None, None, None, None, None, None, None,
                                 False)

        ev = evaluate(problem, plan, target_ms=target)
        return FrontierPoint(
            allocator=name, target_ms=target, status=status, objective=ev.objective,
            makespan_ms=ev.makespan_ms, replay_makespan_ms=ev.replay_makespan_ms,
            samples_per_s=ev.global_batch / ev.makespan_ms * 1e3,
            replay_samples_per_s=ev.samples_per_s, global_batch=ev.global_batch,
            batches={n: g.batch_per_device for n, g in plan.groups.items()},
            feasible=ev.fits and (target is None or ev.meets_target))

    once = [n for n in allocators if n in ONCE]
    swept = [n for n in allocators if n not in ONCE and not n.startswith("exact")]
    bar = Progress("pareto", total=len(once) + len(targets) * len(swept), enabled=progress)
    for name in once:
        plan, rep, _ = run_backend(problem, name, opts)
        out.append(point(name, None, plan, rep.status))
        bar.advance(note=name)
    extra_splits = [p.batches for p in out if p.allocator == "dynamic-batching" and p.batches]
    for t in targets:
        prob = problem.retarget(t)
        for name in allocators:
            if name in ONCE or name.startswith("exact"):
                continue
            plan, rep, _ = run_backend(prob, name, opts)
            out.append(point(name, t, plan, rep.status))
            bar.advance(note=name)
    # The exact series also at the makespan of every other same-batch point that none of
    # its points yet matches (as fast and as little degraded), so that a tie in degradation
    # cannot hide a faster plan; then only its non-dominated points are kept.
    same: dict[float, float] = {}
    for p in out:
        if (p.makespan_ms is not None and p.objective is not None
                and p.global_batch == problem.global_batch and lo <= p.makespan_ms <= hi):
            same[p.makespan_ms] = min(same.get(p.makespan_ms, p.objective), p.objective)
    extra = sorted(set(same) - set(targets))
    series_names = [n for n in ("exact", "exact+split") if n in allocators]
    bar.total = (bar.total or 0) + (len(targets) + len(extra)) * len(series_names)
    for name in series_names:
        series: list[FrontierPoint] = []
        for t in targets:
            series.append(_exact_point(problem, name, t, exact, opts, batch_multiple,
                                       extra_splits, point, bar))
        for t in extra:
            if any(matched(q, t, same[t]) for q in series):
                bar.advance(note=f"{name} at {t:.1f} ms: matched")
                continue
            series.append(_exact_point(problem, name, t, exact, opts, batch_multiple,
                                       extra_splits, point, bar))
        out.extend(p for p in series
                   if p.objective is None or not any(q.dominates(p) for q in series))
    bar.close()
    return out


def matched(q: FrontierPoint, makespan_ms: float, objective: float, tol: float = 1e-9) -> bool:
    """Whether ``q`` is as fast as ``makespan_ms`` and as little degraded as ``objective``
    (a point there then dominates no point of ``q``'s series that is not dominated there
    already: solving at that makespan can only add a point, never remove a domination)."""
    if q.makespan_ms is None or q.objective is None:
        return False
    return (q.makespan_ms <= makespan_ms * (1 + tol)
            and q.objective <= objective + tol * max(1.0, abs(objective)))


def _exact_point(problem: AllocationProblem, name: str, t: float, exact: str,
                 opts: SolveOptions, batch_multiple: int | None,
                 extra_splits: list[dict[str, int]], point: Callable[..., FrontierPoint],
                 bar: Progress) -> FrontierPoint:
    """The ``exact`` (given split) or ``exact+split`` (joint split) point at target ``t``."""

    bar.advance(note=f"{name} at {t:.1f} ms")
    prob = problem.retarget(t)
    if name == "exact+split":
        try:
            joint, rep = solve_joint(prob, exact, opts, 0, batch_multiple, "target", 0.0,
                                     extra_splits=extra_splits)
            return point(name, t, joint, rep.status)
        except InfeasibleError as exc:
            return point(name, t, None, exc.report.status if exc.report else "INFEASIBLE")
        except SolveTimeLimit:  # no plan within the limit: a point without a plan
            return point(name, t, None, "TIME_LIMIT")
    plan, rep, _ = run_backend(prob, exact, opts)
    return point(name, t, plan, rep.status)


def frontier_json(points: Sequence[FrontierPoint]) -> dict[str, Any]:
    return {"points": [asdict(p) for p in points]}


STYLE = {"exact": ("tab:blue", "o", "-"), "exact+split": ("tab:purple", "D", "-"),
         "greedy": ("tab:orange", "s", "--"), "additive-ilp": ("tab:gray", "x", ":"),
         "uniform": ("tab:red", "v", ""), "dynamic-batching": ("tab:green", "^", ""),
         "strong-only": ("black", "*", "")}


def plot_frontier(points: Sequence[FrontierPoint], path: str | os.PathLike[str],
                  title: str = "", *, what: str | None = None,
                  folder: str | os.PathLike[str] | None = None) -> Path:
    """Degradation against samples/s (linear model), one series per allocator; a PNG
    written by :func:`qsync_opt.documents.io.atomic_write_bytes` (``what``: the flag the path came
    from, for a one-line error when it cannot be written), or, given the output ``folder``
    it is a name in, by :func:`qsync_opt.documents.outfolder.write_bytes` (no link there followed)."""
    fig = new_figure((8, 5.2))
    ax = fig.subplots()
    for name in STYLE:
        pts = sorted((p for p in points if p.allocator == name and p.objective is not None
                      and p.samples_per_s is not None), key=lambda p: p.samples_per_s or 0.0)
        if not pts:
            continue
        xs = [float(p.samples_per_s or 0.0) for p in pts]  # both set: filtered above
        ys = [float(p.objective or 0.0) for p in pts]
        colour, marker, line = STYLE[name]
        label = name + ("" if all(p.feasible for p in pts) else " (some miss the target)")
        if name == "strong-only":
            label = "strong-only (smaller global batch)"
        ax.plot(xs, ys, color=colour,
                marker=marker, linestyle=line or "none", label=label, alpha=0.85)
    ax.set_xlabel("throughput, samples/s (linear model)")
    ax.set_ylabel("degradation (sum of batch-weighted Omega)")
    ax.set_title(title or "Pareto frontier")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    png = png_bytes(fig, tight=True)
    if folder is not None:
        return write_bytes(folder, path, png, what or "--out")
    return atomic_write_bytes(path, png, what=what)


def format_points(points: Sequence[FrontierPoint]) -> str:
    head = (f"{'allocator':>16} {'target ms':>10} {'status':>10} {'objective':>11} "
            f"{'linear ms':>10} {'replay ms':>10} {'samples/s':>10} {'batches':>s}")
    lines = [head]
    for p in points:
        def f(v: float | None, fmt: str) -> str:
            return format(v, fmt) if v is not None else "-".rjust(int(fmt.split(".")[0]))
        b = ",".join(f"{k}={v}" for k, v in (p.batches or {}).items())
        lines.append(f"{p.allocator:>16} {f(p.target_ms, '10.2f')} {p.status:>10} "
                     f"{f(p.objective, '11.5g')} {f(p.makespan_ms, '10.2f')} "
                     f"{f(p.replay_makespan_ms, '10.2f')} {f(p.samples_per_s, '10.1f')} {b}")
    return "\n".join(lines)
