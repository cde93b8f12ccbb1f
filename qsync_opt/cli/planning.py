"""Commands that choose precisions: ``solve``, ``compare`` (every allocator and
baseline) and ``pareto`` (the frontier as the target sweeps). Their parsers are
:mod:`qsync_opt.cli.parsers.planning`: this module, which imports the solve pipeline, is
imported only when one of them runs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from qsync_opt.cli.args import (
    cluster_arg,
    emit_json,
    notes_after_success,
    sync_arg,
    trace_args,
    workload_arg,
)
from qsync_opt.cli.model import say_all
from qsync_opt.cli.strategies import allow_space, solve_strategies, strategy_table
from qsync_opt.cli.summaries import plan_lines
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.costs.devices import get_device
from qsync_opt.documents.io import atomic_write_text, save
from qsync_opt.indicator import cover, indicate, placeholder_indicator
from qsync_opt.netsim.cluster import parse_comm_model
from qsync_opt.planner.compare import compare
from qsync_opt.planner.diagnose import precheck
from qsync_opt.planner.dominance import dominance_note, dominated_by, marked_table
from qsync_opt.planner.errors import InfeasibleError
from qsync_opt.planner.frontier import (
    ONCE,
    SWEPT,
    format_points,
    frontier,
    frontier_json,
    plot_frontier,
)
from qsync_opt.planner.solve import INDICATOR_BATCH, build_problem, solve
from qsync_opt.planner.strategies import plan_with_strategy
from qsync_opt.problem.evaluator import evaluate
from qsync_opt.problem.program import AllocationProblem, ProblemOptions
from qsync_opt.solvers import EXACT, SolveOptions
from qsync_opt.solvers.backends import registry
from qsync_opt.strategy.modes import parse_sync
from qsync_opt.strategy.space import Candidate


def _problem_options(args: argparse.Namespace, sync: Any = None) -> Any:
    pins = {}
    for item in args.pin or []:
        op, sep, prec = item.partition("=")
        if not sep or not op or not prec:
            raise QsyncInputError(f"pin: expected OP=PRECISION, got {item!r}")
        pins[op] = prec
    return ProblemOptions(target_ms=args.target_ms, memory_headroom=args.headroom, pinned=pins,
                          optimizer=args.optimizer, reference=args.reference,
                          lower_reference=True if args.lower_reference else None,
                          sync=sync)


def _solve_options(args: argparse.Namespace) -> Any:
    if args.time_limit is not None and not args.time_limit > 0:
        raise QsyncInputError(f"time-limit: expected a positive number of seconds, got {args.time_limit}")
    return SolveOptions(time_limit_s=args.time_limit or 60.0, threads=args.threads,
                        seed=args.seed, rel_gap=args.gap, warm_start=args.warm_start,
                        acceptance=args.acceptance)


def _check_names(args: argparse.Namespace) -> None:
    """The allocator names (``--solver``, ``--solvers``, ``--exact``) and ``--mode``'s
    ``--budget``, checked before anything is traced or computed (an unknown solver was
    refused only after the indicator had run)."""
    known = list(registry())
    given: list[tuple[str, str, list[str]]] = []
    if getattr(args, "solver", None) is not None:
        given.append(("--solver", args.solver, known))
    if getattr(args, "solvers", None) is not None:
        names = [n.strip() for n in args.solvers.split(",")]
        if len(set(names)) != len(names):
            raise QsyncInputError(f"--solvers: a name is given twice in {args.solvers!r}")
        given += [("--solvers", n, known) for n in names]
    if getattr(args, "exact", None) is not None:
        given.append(("--exact", args.exact, list(EXACT)))
    for flag, name, allowed in given:
        if name not in allowed:
            raise QsyncInputError(f"{flag}: expected one of {', '.join(allowed)}, got "
                                  f"{name!r}")
    mode = getattr(args, "mode", None)
    if mode is not None and (args.budget is not None) != (mode == "budget"):
        raise QsyncInputError("--budget: only with --mode budget" if args.budget is not None
                              else "--mode budget: needs --budget B (the degradation budget)")


def _build_problem(args: argparse.Namespace, check: str | None,
                   said: list[str] | None = None) -> Any:
    """The problem of a solve/compare/pareto command. ``check``: what to verify before a
    computed indicator runs the model (``build_problem``); the computed indicator is
    :func:`computed_indicator`'s (cached; the lines saying what it did go to ``said``)."""
    if args.indicator_batch is not None and args.indicator_batch < 1:
        raise QsyncInputError(
            f"indicator-batch: expected a positive integer, got {args.indicator_batch}")
    _check_names(args)
    options = _problem_options(args, sync_arg(args))  # every flag before the trace
    if getattr(args, "comm_model", None):
        parse_comm_model(args.comm_model)
    wl = workload_arg(args)
    graph = trace_args(args, workload=wl)
    cluster = cluster_arg(args)
    common: dict[str, Any] = dict(costs=args.costs, indicator_method=args.method,
                                  comm_model=None if getattr(args, "allow", None)
                                  else getattr(args, "comm_model", None))
    if args.indicator is not None:
        return build_problem(graph, cluster, indicator=args.indicator, options=options,
                             **common)
    return computed_indicator(args, wl, graph, cluster, options, check, common,
                              said if said is not None else [])


def computed_indicator(args: argparse.Namespace, wl: Any, graph: Any, cluster: Any,
                       options: Any, check: str | None, common: dict[str, Any],
                       said: list[str]) -> Any:
    """The problem of solve/compare/pareto with the indicator computed here: first what
    needs no indicator is checked (``diagnose.precheck`` on the problem with a placeholder:
    no model is run for a problem without a plan), then ``indicate()`` on the workload
    already loaded (a user's file is not run again; its table cached by its sha256), with
    progress on stderr (off a terminal, a line every half minute) and one line in ``said``
    saying what was computed and how long it took, or that it came from the cache. Ops the
    method could not measure are pinned fp32, a line each in ``said`` saying why; a value
    of 0 is never assumed. The command prints ``said`` with its result (:func:`say_all`),
    so a refusal stays one line."""
    method = args.method
    trial = build_problem(graph, cluster, indicator=placeholder_indicator(graph),
                          options=options, **common)
    if check is not None and method != "random":
        lines = precheck(trial, check)
        if lines:
            head = f"no plan, found before computing the {method} indicator (no model was run)"
            err = InfeasibleError(f"{head}: " + "; ".join(lines))
            err.head, err.lines = head, lines
            raise err
    table = indicate(wl, args.indicator_batches, method,
                     batch=args.indicator_batch or min(INDICATOR_BATCH, graph.batch_size),
                     progress=not args.json,
                     needs={p for g in trial.cluster.groups
                            for p in get_device(g.device).precisions},
                     report=said.append)
    table = cover(table, graph)
    pins = dict(options.pinned)
    for op, why in sorted(table.unmeasured.items()):
        if op not in pins:
            pins[op] = Precision.fp32
            said.append(f"indicator {method}: {op} pinned fp32 ({why})")
    if len(pins) != len(options.pinned):
        options = dataclasses.replace(options, pinned=pins)
    return AllocationProblem(graph, trial.cluster, trial.costs, table, options)


@notes_after_success
def cmd_solve(args: argparse.Namespace) -> int:
    # Another batch split can fit what this one does not; the budget mode has no target.
    check = "fixed" if args.joint_split else "memory" if args.mode == "budget" else "target"
    space = allow_space(args)
    said: list[str] = []
    if space is not None:
        return solve_strategies(args, space, _build_problem(args, "fixed", said), said,
                                _solve_options(args))
    problem = _build_problem(args, check, said)
    plan, report = solve(problem, args.solver, _solve_options(args), mode=args.mode,
                         degradation_budget=args.budget, refine=args.refine,
                         joint_split=args.joint_split, batch_multiple=args.batch_multiple,
                         progress=sys.stderr.isatty() and not args.json)
    ev = evaluate(problem, plan)
    if args.sync is not None:  # the plan records the sync mode it was made for (version 2)
        plan = plan_with_strategy(problem, plan, ev, Candidate(sync=parse_sync(
            args.sync).describe()), getattr(args, "comm_model", None))
    save(plan, args.out, what="--out")
    if args.report:
        save(report, args.report, what="--report")
    dominated = dominance_note(problem, plan, ev, args.solver, _solve_options(args),
                               joint_split=args.joint_split)
    if args.json:
        emit_json({"plan": args.out, "report": report.model_dump(mode="json"),
                    "evaluation": ev.to_json(), "dominated": dominated})
        say_all(said, True)
        return 0
    print(f"{args.solver}: {report.status}, objective {ev.objective:.6g}"
          + (f", gap {report.gap:.2g}" if report.gap is not None else "")
          + f"; {report.mode}")
    print(f"  makespan {ev.makespan_ms:.2f} ms linear, {ev.replay_makespan_ms:.2f} ms replayer "
          f"(target {ev.target_ms:.2f}); {ev.samples_per_s:.1f} samples/s; "
          f"build {report.build_s:.3f} s, solve {report.solve_s:.3f} s, wall {report.wall_s:.3f} s")
    print("\n".join(plan_lines(problem, plan, ev)))
    if problem.options.sync is not None:
        print(f"  {problem.options.sync.describe()}")
    for r in report.rounds:
        print(f"  round {r['round']}: target {r['target_ms']:.2f} ms -> linear "
              f"{r['makespan_ms']:.2f} ms, replayer {r['replay_makespan_ms']:.2f} ms, "
              f"objective {r['objective']:.6g}")
    for m in report.messages:
        print(f"  {m}")
    for note in problem.notes:
        print(f"  note: {note}")
    if dominated:
        print(dominated)
    say_all(said, False)
    print(f"wrote {args.out}" + (f" and {args.report}" if args.report else ""))
    return 0


@notes_after_success
def cmd_pareto(args: argparse.Namespace) -> int:
    if args.points < 2:
        raise QsyncInputError(f"points: expected at least 2, got {args.points}")
    said: list[str] = []
    space = allow_space(args)
    problem = _build_problem(args, "memory", said)  # the sweep starts at the split's fastest
    allocators = [a for a in SWEPT + ONCE if not (args.no_split and a == "exact+split")]
    pts = frontier(problem, points=args.points, exact=args.exact, allocators=allocators,
                   options=_solve_options(args), batch_multiple=args.batch_multiple,
                   progress=sys.stderr.isatty() and not args.json)
    doc = {"workload": problem.graph.workload, "cluster": args.cluster,
           "global_batch": problem.global_batch, **frontier_json(pts)}
    lines: list[str] = []
    if space is not None:  # every strategy solved: the whole Pareto set of strategies
        search, lines = strategy_table(args, space, problem, _solve_options(args), prune=False)
        doc["strategies"] = search.to_json()
    atomic_write_text(args.out, json.dumps(doc, indent=2) + "\n", what="--out")
    if args.png:
        plot_frontier(pts, args.png, f"{problem.graph.workload} on {args.cluster}",
                      what="--png")
    say_all(said, bool(args.json))
    if args.json:
        emit_json(doc)
        return 0
    print(format_points(pts))
    for line in lines:
        print(line)
    print(f"wrote {args.out}" + (f" and {args.png}" if args.png else ""))
    return 0


@notes_after_success
def cmd_compare(args: argparse.Namespace) -> int:
    # No check: the baselines (strong-only leaves the weak groups out) have rows whatever
    # the rest; the indicator still refuses to outgrow this machine.
    said: list[str] = []
    space = allow_space(args)
    problem = _build_problem(args, None, said)
    names = [s.strip() for s in args.solvers.split(",")] if args.solvers else None
    rows = compare(problem, names, _solve_options(args), refine=args.refine,
                   joint_split=args.joint_split, batch_multiple=args.batch_multiple)
    doc: dict[str, Any] = {
        "workload": problem.graph.workload, "cluster": args.cluster,
        "target_ms": problem.target_ms, "target_source": problem.target_source,
        "sync": problem.options.to_json()["sync"],
        "rows": [r.to_json() | {"dominated_by": x}
                 for r, x in zip(rows, dominated_by(rows), strict=True)]}
    lines: list[str] = []
    if space is not None:
        search, lines = strategy_table(args, space, problem, _solve_options(args),
                                       prune=False)
        doc["strategies"] = search.to_json()
    if args.plans:
        for r in rows:
            if r.plan is not None:
                save(r.plan, f"{args.plans}/{r.solver}.plan.json", what="--plans")
    say_all(said, args.json == "-")
    if args.json is not None:
        text = json.dumps(doc, indent=2) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
            return 0
        atomic_write_text(args.json, text, what="--json")
    print(f"{problem.graph.workload} on {args.cluster}: target {problem.target_ms:.2f} ms "
          f"({problem.target_source})")
    if problem.options.sync is not None:
        print(problem.options.sync.describe())
    print(marked_table(rows))
    for r in rows:
        if r.status in ("ERROR", "INFEASIBLE") and r.messages:
            print(f"  {r.solver}: {r.messages[-1]}")
    for line in lines:
        print(line)
    if args.json not in (None, "-"):
        print(f"wrote {args.json}")
    return 0
