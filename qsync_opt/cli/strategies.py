"""``solve --allow ...``: the strategy search's command-line side: the flag, the table of
candidates (predicted step, throughput, degradation, bound, status, Pareto), the chosen
strategy with its risks, ``--json`` and the frontier picture (``--png``)."""

from __future__ import annotations

import argparse
from typing import Any

from qsync_opt.cli.args import SYNC_DEFAULTS, emit_json
from qsync_opt.cli.model import say_all
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.documents.io import save
from qsync_opt.documents.schemas import Plan, SolveReport
from qsync_opt.planner.solve import solve
from qsync_opt.planner.strategies import StrategySearch, plot_strategies, search_strategies
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.solvers import SolveOptions
from qsync_opt.strategy.space import Candidate, StrategySpace, parse_allow

__all__ = ["allow_space", "solve_strategies", "strategy_lines",
           "strategy_table"]


def allow_space(args: argparse.Namespace) -> StrategySpace | None:
    """``--allow``'s space (None without it), checked with its companions before any work:
    ``--sync`` beside it is refused (name the modes in ``--allow sync=``)."""
    items = getattr(args, "allow", None)
    if not items:
        for flag in ("no_prune", "png") if args.command == "solve" else ():
            if getattr(args, flag, None):
                raise QsyncInputError(f"--{flag.replace('_', '-')}: only with --allow")
        return None
    if getattr(args, "sync", None) is not None:
        raise QsyncInputError("--sync: with --allow, name the sync modes in --allow "
                              "sync=... (the planner chooses among them)")
    lr = SYNC_DEFAULTS["lr"] if args.lr is None else args.lr
    return parse_allow(list(items), lr=lr)


def sync_args(args: argparse.Namespace) -> dict[str, Any]:
    """The run's lr, schedule and steps the candidates' sync models are for."""
    return {k: SYNC_DEFAULTS[k] if getattr(args, k, None) is None else getattr(args, k)
            for k in SYNC_DEFAULTS}


def strategy_lines(search: StrategySearch) -> list[str]:
    """The search as the command prints it: what ran, one row per candidate, the choice."""
    out = [f"strategy search: {len(search.rows)} candidate(s) of {search.space.describe()}; "
           f"{search.solved} solved, {search.pruned} pruned by their bound; communication "
           f"priced by the {search.comm_model}; {search.wall_s:.2f} s"]
    head = f"  {'strategy':<34} {'bound ms':>9} {'step ms':>9} {'samples/s':>10} " \
           f"{'degradation':>12}  status"
    out.append(head)
    for r in search.rows:
        p = r.prediction
        mark = " *" if r is search.chosen else " P" if r.pareto else ""
        name = r.candidate.describe()
        name = name if len(name) <= 34 else name[:31] + "..."
        out.append(f"  {name:<34} {r.bound_ms:>9.3f} "
                   + (f"{p.step_ms:>9.3f} {p.samples_per_s:>10.1f} {r.degradation:>12.6g}"
                      if p is not None else f"{'-':>9} {'-':>10} {'-':>12}")
                   + f"  {r.status}{mark}" + (f" ({r.note})" if r.note and r.status != "solved"
                                              else ""))
    c = search.chosen
    out.append(f"chosen (*): {c.candidate.describe()}: {c.step_ms:.3f} ms a step, "
               f"{c.throughput:.1f} samples/s, degradation {c.degradation:.6g}; "
               "P: on the Pareto set of the solved strategies (throughput, degradation)")
    risks = search.plan.strategy.risks if search.plan.strategy is not None else []
    out += [f"  risk: {r}" for r in risks] or ["  risk: none beyond the precision plan's "
                                               "(ddp, fp32, no pipeline)"]
    return out


def solve_strategies(args: argparse.Namespace, space: StrategySpace,
                     problem: AllocationProblem, said: list[str], opts: SolveOptions) -> int:
    """``solve --allow``: search the space, write the chosen strategy's plan (version 2),
    print the table (or ``--json``), draw ``--png``."""
    if args.mode == "budget":
        raise QsyncInputError("--mode budget: with --allow each strategy is solved for the "
                              "least degradation under its own default target")

    def one(sub: AllocationProblem, o: SolveOptions) -> tuple[Plan, SolveReport]:
        return solve(sub, args.solver, o, mode=args.mode, refine=args.refine,
                     joint_split=args.joint_split, batch_multiple=args.batch_multiple,
                     compare_ties=False)

    search = search_strategies(problem, space, one, opts,
                               comm_model=getattr(args, "comm_model", None),
                               prune=not args.no_prune, **sync_args(args))
    save(search.plan, args.out, what="--out")
    if args.report and search.chosen.report is not None:
        save(search.chosen.report, args.report, what="--report")
    if args.png:
        plot_strategies(search, args.png)
    if args.json:
        emit_json({"plan": args.out, "search": search.to_json()})
        say_all(said, True)
        return 0
    print("\n".join(strategy_lines(search)))
    say_all(said, False)
    print(f"wrote {args.out}" + (f" and {args.report}" if args.report else "")
          + (f" and {args.png}" if args.png else ""))
    return 0


def strategy_table(args: argparse.Namespace, space: StrategySpace, problem: AllocationProblem,
                   opts: SolveOptions, *, prune: bool) -> tuple[StrategySearch, list[str]]:
    """``compare --allow`` / ``pareto --allow``: the strategies as rows (every one solved
    with ``highs`` unless pruning is asked for) and the lines that print them, with the
    chosen strategy against the precision-only plan (ddp over fp32)."""
    def one(sub: AllocationProblem, o: SolveOptions) -> tuple[Plan, SolveReport]:
        return solve(sub, "highs", o, refine=args.refine, compare_ties=False)

    search = search_strategies(problem, space, one, opts,
                               comm_model=getattr(args, "comm_model", None), prune=prune,
                               **sync_args(args))
    lines = strategy_lines(search)
    base = next((r for r in search.rows if r.candidate == Candidate()
                 and r.prediction is not None), None)
    c = search.chosen
    if base is not None and c.prediction is not None and base.prediction is not None:
        lines.append(f"chosen strategy {c.candidate.describe()}: "
                     f"{c.prediction.samples_per_s:.1f} samples/s against the precision-only "
                     f"plan's (ddp / fp32) {base.prediction.samples_per_s:.1f}: "
                     f"{c.prediction.samples_per_s / base.prediction.samples_per_s:.3f}x "
                     "predicted")
    return search, lines
