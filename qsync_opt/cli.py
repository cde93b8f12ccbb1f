"""The ``qsync-opt`` command line.

Tables for people, ``--json`` for programs. Bad input exits with code 2 and one line on
stderr naming the field and what was expected (control characters in it escaped); every
numeric flag is checked by its argparse type (finite, in its range); files are written
atomically, and a write that fails (read-only folder, full disk, file-size limit, a folder
in the way) is one line naming the flag, exit 2, the file that was there unchanged.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from pydantic import ValidationError

from . import __version__
from .cluster import SHORTHAND_HELP, load_cluster
from .costs import estimate, group_summary
from .devices import CATALOG, get_device
from .errors import QsyncInputError, describe_validation_error, one_line
from .graph import TIE_MODES, is_user_model, load_user_workload, trace, unseen_ops
from .io import atomic_write_text, load, save, to_json
from .models import WORKLOADS
from .plan import check_plan, make_plan, plan_model
from .replayer import Replayer, Timeline
from .report import straggler_reason
from .schemas import MAX_BATCH, ModelGraph, OpRole, Plan, json_schema, schema_names
from .user_model import UserWorkload

log = logging.getLogger(__name__)

GiB = 1024**3


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line with exit code 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {one_line(message)}\n")
        raise SystemExit(2)


# ----------------------------------------------------------------------------- flag types
# argparse types: a bad value is "argument --flag: expected ..., got 'VALUE'" (the value as
# written), exit 2, before any work. Every numeric flag has one.


def _flag_type(name: str, parse: Callable[[str], Any], ok: Callable[[Any], bool],
               expected: str) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except (ValueError, OverflowError):
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    convert.__name__ = name
    return convert


def int_range(lo: int, hi: int, expected: str | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi]."""
    return _flag_type("int", int, lambda v: lo <= v <= hi,
                      expected or f"an integer from {lo} to {hi}")


def positive_int(hi: int) -> Callable[[str], int]:
    """An argparse type: an integer in [1, hi]."""
    return int_range(1, hi, f"a positive integer (at most {hi})")


def finite_float(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
                 hi_open: bool = False, expected: str | None = None) -> Callable[[str], float]:
    """An argparse type: a finite float (never inf or nan) in the given range."""

    def ok(v: float) -> bool:
        return (math.isfinite(v)
                and (lo is None or (v > lo if lo_open else v >= lo))
                and (hi is None or (v < hi if hi_open else v <= hi)))

    def shown(x: float) -> str:
        return str(int(x)) if float(x).is_integer() else repr(x)

    if expected is None:
        left = "" if lo is None else f"{'>' if lo_open else '>='} {shown(lo)}"
        right = "" if hi is None else f"{'<' if hi_open else '<='} {shown(hi)}"
        expected = "a finite number" + (f" {left}" if left else "") + (
            f"{' and' if left else ''} {right}" if right else "")
    return _flag_type("float", float, ok, expected)


BATCH = positive_int(MAX_BATCH)
BATCHES = positive_int(100_000)
SEED = int_range(0, 2**31 - 1)  # CP-SAT's random_seed is an int32
POSITIVE_SECONDS = finite_float(0, 1e7, lo_open=True,
                                expected="a positive finite number of seconds (at most 1e7)")
FRACTION = finite_float(0, 1, hi_open=True, expected="a fraction from 0 up to (not including) 1")


def _table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [[str(h) for h in header]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for j, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if j and _numeric(c) else c.ljust(w)
                               for c, w in zip(r, widths, strict=True)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        if abs(x) >= 100:
            return f"{x:,.1f}".removesuffix(".0")
        return f"{x:.4g}"
    if isinstance(x, int) and not isinstance(x, bool):
        return f"{x:,}"
    return str(x)


def _numeric(s: str) -> bool:
    return s.replace(",", "").replace(".", "").replace("-", "").isdigit()


def _emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


# ----------------------------------------------------------------------------- commands


def cmd_models(args: argparse.Namespace) -> int:
    rows = [(w.name, w.default_batch, w.input_doc, "real" if w.real_data else "synthetic",
             w.description) for w in WORKLOADS.values()]
    if args.json:
        _emit_json([{"name": r[0], "default_batch": r[1], "inputs": r[2], "data": r[3],
                     "description": r[4]} for r in rows])
    else:
        print(_table(rows, ["model", "batch", "inputs", "data", "description"]))
        print("\nYour own model: --model path/file.py:fn, where fn() returns (module, example_inputs) "
              "(a tensor, a tuple or a dict of keyword tensors); optional loss(outputs, batch) "
              "and data(batch_size, seed) in the same file. That file is run (imported), so "
              "pass only a file you trust.")
    return 0


def cmd_devices(args: argparse.Namespace) -> int:
    specs = [*CATALOG.values()]
    if args.cpu:
        specs.append(get_device("cpu"))
    if args.json:
        _emit_json([s.model_dump(mode="json") for s in specs])
        return 0
    rows = []
    for s in specs:
        r = s.peak_tflops
        rows.append((s.name, s.compute_capability or "-", f"{s.usable_memory_bytes / GiB:.1f}",
                     s.memory_bandwidth_gb_per_s,
                     *(r.get(k, "-") for k in ("fp32", "tf32", "fp16", "bf16", "int8", "fp8_e4m3")),
                     ",".join(p.value for p in s.precisions)))
    print(_table(rows, ["device", "cc", "GiB", "GB/s", "fp32", "tf32", "fp16", "bf16", "int8",
                        "fp8", "precisions"]))
    print("\nDense peak TFLOPS (TOPS for int8) from datasheets; sources in qsync_opt/devices.py.")
    print("Emulated, but costed at the peaks above: fp8 = e4m3-rounded inputs and weights, FP32 "
          "GEMM, FP32 gradients;\nint8/int8_full attention matmuls = int8-rounded operands, FP32 "
          "matmul. int8 Linear/Conv2d run real int8 GEMMs.")
    if not args.cpu:
        print("`cpu` (this machine) is measured on first use: add --cpu to show it.")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    _emit_json(json_schema(args.name))
    return 0


def _workload_arg(args: argparse.Namespace, model_sha256: str | None = None) -> Any:
    """``--model``: a registry name as it is, a ``PATH.py:FUNCTION`` file loaded (it is run:
    the user named it; with ``model_sha256`` it must have that content hash first)."""
    if is_user_model(args.model):
        return load_user_workload(args.model, sha256=model_sha256)
    return args.model


def _trace_args(args: argparse.Namespace, model_sha256: str | None = None,
                workload: Any = None) -> ModelGraph:
    """The graph of ``--model`` (see :func:`_workload_arg`), at ``--batch``: a user's file at
    its example's batch by default, at another on synthetic inputs shaped like them."""
    wl = workload if workload is not None else _workload_arg(args, model_sha256)
    return trace(wl, args.batch, pin_head=not args.unpin_head, tie=args.tie)


def _user_lines(wl: Any) -> list[str]:
    """What a user's file uses (its loss and data), one line each; none for a registry name."""
    if not isinstance(wl, UserWorkload):
        return []
    return [wl.loss_line(), wl.data_line()]


def graph_summary_lines(graph: ModelGraph, seconds: float | None = None) -> list[str]:
    n_ch = len(graph.choosable_ops())
    pinned = [o for o in graph.ops if o.role == OpRole.pinned]
    gemm_flops = sum(o.fwd_flops for o in graph.ops if o.kind.value in ("linear", "conv", "matmul"))
    head = [o.name for o in pinned if o.pin_reason and o.pin_reason.startswith("classifier")]
    took = f" in {seconds:.2f} s" if seconds is not None else ""
    return [
        f"graph: {graph.workload} at batch {graph.batch_size}, traced with "
        f"{graph.trace_method}{took}",
        f"  ops {len(graph.ops)} (choosable {n_ch}, pinned {len(pinned)}), edges "
        f"{len(graph.edges)}, depth {graph.max_depth}",
        f"  parameters {graph.param_count / 1e6:.2f} M ({graph.param_bytes / 2**20:.1f} MiB FP32)",
        f"  forward {graph.total_fwd_flops / 1e9:.1f} GFLOP per batch, "
        f"{gemm_flops / 2 / graph.batch_size / 1e9:.2f} G multiply-adds per sample in GEMMs "
        f"(a multiply-add = 2 FLOPs)",
        f"  activations saved for backward (measured, FP32): "
        f"{graph.saved_activation_bytes / 2**20:.1f} MiB",
        f"  classifier head pinned to fp32: {', '.join(head) or 'none'}",
    ] + [f"  unseen (the planner cannot look inside; over 1% of the parameters or FLOPs): "
         f"{line}" for line in unseen_ops(graph)]


def cmd_graph(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    wl = _workload_arg(args)
    graph = _trace_args(args, workload=wl)
    secs = time.perf_counter() - t0
    if args.out:
        save(graph, args.out, what="--out")
    if args.json:
        sys.stdout.write(to_json(graph))
        return 0
    print("\n".join(graph_summary_lines(graph, secs)))
    for line in _user_lines(wl):
        print(f"  {line}")
    if args.ops:
        rows = [(o.name, o.kind.value, o.role.value, "x".join(map(str, o.output_shapes[0])),
                 o.fwd_flops / 1e6, o.saved_bytes / 2**20, o.depth) for o in graph.ops]
        print()
        print(_table(rows, ["op", "kind", "role", "output", "fwd MFLOP", "saved MiB", "depth"]))
    if args.out:
        print(f"wrote {args.out}")
    return 0


def estimate_summary_lines(graph: ModelGraph, cluster: Any, costs: Any) -> list[str]:
    rows = []
    for r in group_summary(graph, cluster, costs):
        rows.append((r["group"], r["device"], r["count"], r["batch_per_device"],
                     r["compute_fp32_ms"], r["compute_fastest_ms"], r["allreduce_ms"],
                     r["optimizer_ms"], f"{int(r['memory_fp32_bytes']) / GiB:.1f}",
                     f"{int(r['capacity_bytes']) / GiB:.1f}"))
    lines = [
        _table(rows, ["group", "device", "n", "batch", "fp32 ms", "fastest ms", "allreduce ms",
                      "optim ms", "mem GiB", "cap GiB"]),
        f"  all-reduce: {len(costs.buckets)} buckets over {costs.comm.world_size} devices, "
        f"bottleneck {costs.comm.bottleneck}",
        "  fp32/fastest ms: serial sums of per-op forward+backward estimates at FP32 and at each "
        "op's fastest precision (casts ignored); the replayer overlaps communication.",
    ]
    return lines


def cmd_estimate(args: argparse.Namespace) -> int:
    graph = _trace_args(args)
    cluster = load_cluster(args.cluster)
    costs = estimate(graph, cluster)
    if args.out:
        save(costs, args.out, what="--out")
    if args.json:
        sys.stdout.write(to_json(costs))
        return 0
    print(f"cluster: {args.cluster} ({cluster.world_size} devices, {cluster.nodes} nodes)")
    print("\n".join(estimate_summary_lines(graph, cluster, costs)))
    print(f"  {len(costs.entries)} op-cost entries, {len(costs.casts)} cast models "
          f"({costs.notes[0]})")
    if args.out:
        print(f"wrote {args.out}")
    return 0


def uniform_plans(rep: Replayer) -> dict[str, dict[str, dict[str, Any]]]:
    """The comparison plans: everything at its highest precision; then the groups slower
    than the fastest one (the weak groups) at their lowest precision."""
    high = rep.uniform("highest")
    plans: dict[str, dict[str, dict[str, Any]]] = {"uniform-highest": high}
    tl = rep.simulate(high, events=False)
    fastest = min(g.compute_ms for g in tl.groups.values())
    weak = [n for n, g in tl.groups.items() if g.compute_ms > 1.01 * fastest]
    if weak:
        low = rep.uniform("lowest")
        plans["weak-lowest"] = {n: (low[n] if n in weak else high[n]) for n in high}
    return plans


def replay_rows(name: str, tl: Timeline) -> list[tuple[Any, ...]]:
    rows = []
    for g in tl.groups.values():
        rows.append((name, g.name, g.device, g.batch_per_device, g.compute_ms, g.cast_ms,
                     g.n_casts, g.exposed_comm_ms, g.straggler_wait_ms, tl.iteration_ms,
                     f"{g.peak_memory_bytes / GiB:.2f}/{g.capacity_bytes / GiB:.1f}",
                     "yes" if g.fits else "NO"))
    return rows


REPLAY_HEADER = ["plan", "group", "device", "batch", "compute ms", "casts ms", "casts",
                 "exposed comm", "waits ms", "iteration ms", "peak/cap GiB", "fits"]


def _trace_path(base: str, name: str, several: bool) -> str:
    if not several:
        return base
    stem, dot, ext = base.rpartition(".")
    return f"{stem}.{name}.{ext}" if dot else f"{base}.{name}"


def cmd_replay(args: argparse.Namespace) -> int:
    plan_doc: Plan | None = None
    sha: str | None = None
    if args.plan:
        plan_doc = load(args.plan, Plan)
        sha = plan_model(plan_doc, args.model)  # before --model's file runs
    graph = _trace_args(args, sha)
    if plan_doc is not None:
        check_plan(plan_doc, graph)
    if args.cluster:
        cluster = load_cluster(args.cluster)
    elif plan_doc is not None:
        cluster = plan_doc.cluster
    else:
        raise QsyncInputError("cluster: --cluster is required without --plan")
    costs = estimate(graph, cluster)
    rep = Replayer(graph, cluster, costs, optimizer=args.optimizer,
                   bucket_cap_bytes=(int(args.bucket_mb * 2**20) if args.bucket_mb is not None
                                     else None))
    plans: dict[str, Any] = {"plan": plan_doc} if plan_doc is not None else uniform_plans(rep)
    timelines = {name: rep.simulate(p) for name, p in plans.items()}
    if args.trace:
        for name, tl in timelines.items():
            atomic_write_text(_trace_path(args.trace, name, len(timelines) > 1),
                              tl.chrome_trace_json(), what="--trace")
    if args.write_plans:
        for name, p in plans.items():
            if not isinstance(p, Plan):
                save(make_plan(graph, cluster, p, {"solver": name}),
                     f"{args.write_plans}/{name}.plan.json", what="--write-plans")
    if args.json:
        _emit_json({name: tl.summary() for name, tl in timelines.items()})
        return 0
    rows = [r for name, tl in timelines.items() for r in replay_rows(name, tl)]
    print(_table(rows, REPLAY_HEADER))
    for name, tl in timelines.items():
        path = " -> ".join(
            (f"{s['kind']} {s.get('group', '')}".strip() if s["kind"] != "allreduce"
             else f"bucket {s['bucket']}") for s in tl.critical_path)
        print(f"{name}: iteration {tl.iteration_ms:.1f} ms, straggler {tl.straggler}; "
              f"critical path: {path}")
    if args.trace:
        print(f"wrote trace(s) for chrome://tracing or ui.perfetto.dev at {args.trace}")
    return 0


def cmd_indicate(args: argparse.Namespace) -> int:
    from .indicator import fast_options, indicate, rank_table
    from .precision import Precision

    t0 = time.perf_counter()
    fast = fast_options() if args.fast else {}
    table = indicate(_workload_arg(args), args.batches, args.method, batch=args.batch,
                     seed=args.seed,
                     gamma=args.gamma, cache=not args.no_cache,
                     progress=sys.stderr.isatty() and not args.json, **fast)
    secs = time.perf_counter() - t0
    if args.out:
        save(table, args.out, what="--out")
    if args.json:
        sys.stdout.write(to_json(table))
        return 0
    ranked = rank_table(table, Precision.int8)
    k = min(args.top, len(ranked))
    cols = [p for p in (Precision.int8, Precision.int8_full, Precision.fp8, Precision.bf16,
                        Precision.fp16) if any(p in r for r in table.values.values())]

    def rows(items: list[tuple[str, float]]) -> list[tuple[Any, ...]]:
        return [(op, *(table.values[op].get(p, "-") for p in cols)) for op, _ in items]

    print(f"indicator {table.method} of {table.workload}: {len(ranked)} choosable ops, "
          f"{table.batches} batch(es) of {table.batch_size}, {table.data} data, {secs:.1f} s")
    header = ["op", *(p.value for p in cols)]
    print(f"\nmost sensitive (by int8):\n{_table(rows(ranked[:k]), header)}")
    print(f"\nleast sensitive:\n{_table(rows(ranked[-k:][::-1]), header)}")
    for note in table.notes:
        print(f"  {note}")
    if args.out:
        print(f"wrote {args.out}")
    return 0


def _problem_options(args: argparse.Namespace) -> Any:
    from .problem import ProblemOptions

    pins = {}
    for item in args.pin or []:
        op, sep, prec = item.partition("=")
        if not sep or not op or not prec:
            raise QsyncInputError(f"pin: expected OP=PRECISION, got {item!r}")
        pins[op] = prec
    return ProblemOptions(target_ms=args.target_ms, memory_headroom=args.headroom, pinned=pins,
                          optimizer=args.optimizer, reference=args.reference,
                          lower_reference=True if args.lower_reference else None)


def _solve_options(args: argparse.Namespace) -> Any:
    from .solvers import SolveOptions

    if args.time_limit is not None and not args.time_limit > 0:
        raise QsyncInputError(f"time-limit: expected a positive number of seconds, got {args.time_limit}")
    return SolveOptions(time_limit_s=args.time_limit or 60.0, threads=args.threads,
                        seed=args.seed, rel_gap=args.gap, warm_start=args.warm_start,
                        acceptance=args.acceptance)


def _build_problem(args: argparse.Namespace, check: str | None) -> Any:
    """The problem of a solve/compare/pareto command. ``check``: what to verify before a
    computed indicator runs the model (``build_problem``)."""
    from .solve import build_problem

    if args.indicator_batch is not None and args.indicator_batch < 1:
        raise QsyncInputError(
            f"indicator-batch: expected a positive integer, got {args.indicator_batch}")
    graph = _trace_args(args)
    return build_problem(graph, args.cluster, indicator=args.indicator, costs=args.costs,
                         options=_problem_options(args), indicator_method=args.method,
                         indicator_batches=args.indicator_batches,
                         indicator_batch=args.indicator_batch,
                         progress=sys.stderr.isatty(), check=check)


def plan_lines(problem: Any, plan: Plan, ev: Any) -> list[str]:
    """Per group: how many ops run at each precision, time and memory."""
    from collections import Counter

    lines = []
    for name, gp in plan.groups.items():
        counts = Counter(p.value for p in gp.precisions.values())
        mix = ", ".join(f"{n} {p}" for p, n in counts.most_common())
        g = ev.groups[name]
        lines.append(f"  {name} ({g.device}, batch {g.batch}): {mix}; linear {g.linear_ms:.1f} ms, "
                     f"replayer compute {g.replay_compute_ms:.1f} ms, memory "
                     f"{g.replay_memory_bytes / GiB:.2f}/{g.capacity_bytes / GiB:.1f} GiB")
    return lines


def cmd_solve(args: argparse.Namespace) -> int:
    from .problem import evaluate
    from .solve import solve

    # Another batch split can fit what this one does not; the budget mode has no target.
    check = "fixed" if args.joint_split else "memory" if args.mode == "budget" else "target"
    problem = _build_problem(args, check)
    plan, report = solve(problem, args.solver, _solve_options(args), mode=args.mode,
                         degradation_budget=args.budget, refine=args.refine,
                         joint_split=args.joint_split, batch_multiple=args.batch_multiple)
    ev = evaluate(problem, plan)
    save(plan, args.out, what="--out")
    if args.report:
        save(report, args.report, what="--report")
    if args.json:
        _emit_json({"plan": args.out, "report": report.model_dump(mode="json"),
                    "evaluation": ev.to_json()})
        return 0
    print(f"{args.solver}: {report.status}, objective {ev.objective:.6g}"
          + (f", gap {report.gap:.2g}" if report.gap is not None else "")
          + f"; {report.mode}")
    print(f"  makespan {ev.makespan_ms:.2f} ms linear, {ev.replay_makespan_ms:.2f} ms replayer "
          f"(target {ev.target_ms:.2f}); {ev.samples_per_s:.1f} samples/s; "
          f"build {report.build_s:.3f} s, solve {report.solve_s:.3f} s, wall {report.wall_s:.3f} s")
    print("\n".join(plan_lines(problem, plan, ev)))
    for r in report.rounds:
        print(f"  round {r['round']}: target {r['target_ms']:.2f} ms -> linear "
              f"{r['makespan_ms']:.2f} ms, replayer {r['replay_makespan_ms']:.2f} ms, "
              f"objective {r['objective']:.6g}")
    for m in report.messages:
        print(f"  {m}")
    for note in problem.notes:
        print(f"  note: {note}")
    print(f"wrote {args.out}" + (f" and {args.report}" if args.report else ""))
    return 0


def cmd_pareto(args: argparse.Namespace) -> int:
    from .frontier import ONCE, SWEPT, format_points, frontier, frontier_json, plot_frontier

    if args.points < 2:
        raise QsyncInputError(f"points: expected at least 2, got {args.points}")
    problem = _build_problem(args, "memory")  # the sweep starts at the split's fastest plan
    allocators = [a for a in SWEPT + ONCE if not (args.no_split and a == "exact+split")]
    pts = frontier(problem, points=args.points, exact=args.exact, allocators=allocators,
                   options=_solve_options(args), batch_multiple=args.batch_multiple)
    doc = {"workload": problem.graph.workload, "cluster": args.cluster,
           "global_batch": problem.global_batch, **frontier_json(pts)}
    atomic_write_text(args.out, json.dumps(doc, indent=2) + "\n", what="--out")
    if args.png:
        plot_frontier(pts, args.png, f"{problem.graph.workload} on {args.cluster}",
                      what="--png")
    if args.json:
        _emit_json(doc)
        return 0
    print(format_points(pts))
    print(f"wrote {args.out}" + (f" and {args.png}" if args.png else ""))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from .solve import compare, format_rows

    # No check: the baselines (strong-only leaves the weak groups out) have rows whatever
    # the rest; the indicator still refuses to outgrow this machine.
    problem = _build_problem(args, None)
    names = [s.strip() for s in args.solvers.split(",")] if args.solvers else None
    rows = compare(problem, names, _solve_options(args), refine=args.refine,
                   joint_split=args.joint_split, batch_multiple=args.batch_multiple)
    doc = {"workload": problem.graph.workload, "cluster": args.cluster,
           "target_ms": problem.target_ms, "target_source": problem.target_source,
           "rows": [r.to_json() for r in rows]}
    if args.plans:
        for r in rows:
            if r.plan is not None:
                save(r.plan, f"{args.plans}/{r.solver}.plan.json", what="--plans")
    if args.json is not None:
        text = json.dumps(doc, indent=2) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
            return 0
        atomic_write_text(args.json, text, what="--json")
    print(f"{problem.graph.workload} on {args.cluster}: target {problem.target_ms:.2f} ms "
          f"({problem.target_source})")
    print(format_rows(rows))
    for r in rows:
        if r.status in ("ERROR", "INFEASIBLE") and r.messages:
            print(f"  {r.solver}: {r.messages[-1]}")
    if args.json not in (None, "-"):
        print(f"wrote {args.json}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if not getattr(args, "no_local", False):
        from pathlib import Path

        from .demo import local_job

        print(f"qsync-opt {__version__} demo, part 1 of 2: the whole job, measured on this machine\n")
        local_job(Path(args.out or "qsync-demo"), steps=args.steps)
        print("== part 2 of 2: planning showcase from catalog estimates\n")
    model, shorthand = "resnet50", "v100x16+t4x16"
    t0 = time.perf_counter()
    graph = trace(model)
    secs = time.perf_counter() - t0
    cluster = load_cluster(shorthand)
    costs = estimate(graph, cluster)
    print(f"qsync-opt {__version__} demo: {model} on {shorthand} (catalog estimates, no GPU)\n")
    print("\n".join(graph_summary_lines(graph, secs)))
    print()
    print(f"cluster: {shorthand} ({cluster.world_size} devices, {cluster.nodes} nodes)")
    print("\n".join(estimate_summary_lines(graph, cluster, costs)))
    rows = {r["group"]: r for r in group_summary(graph, cluster, costs)}
    v, t = rows["v100"], rows["t4"]
    print(f"\nAt FP32 the T4 group computes {float(t['compute_fp32_ms']) / float(v['compute_fp32_ms']):.1f}x "
          f"slower than the V100 group: the V100s wait for it, the wait the allocator must remove.")
    rep = Replayer(graph, cluster, costs)
    timelines = {name: rep.simulate(p) for name, p in uniform_plans(rep).items()}
    print("\nreplayer: one iteration, casts and bucketed all-reduce overlapped with backward")
    rows = [r for name, tl in timelines.items() for r in replay_rows(name, tl)]
    print(_table(rows, REPLAY_HEADER))
    high, low = timelines["uniform-highest"], timelines.get("weak-lowest")
    print(f"straggler at FP32 (the group whose iteration ends last): {straggler_reason(high)}")
    if low is not None:
        t_hi, t_lo = high.groups["t4"], low.groups["t4"]
        print(f"Uniform lowest precision on the T4s cuts their compute from {t_hi.compute_ms:.0f} "
              f"to {t_lo.compute_ms:.0f} ms ({t_lo.n_casts} casts, {t_lo.cast_ms:.0f} ms of them) "
              f"against the V100s' {high.groups['v100'].compute_ms:.0f} ms: the iteration goes "
              f"from {high.iteration_ms:.0f} to {low.iteration_ms:.0f} ms in these estimates; "
              f"straggler: {straggler_reason(low)}.")
    # The planning job: indicator, every allocator, the plan written, the straggler gone.
    from .indicator import fast_options, indicate
    from .problem import AllocationProblem, evaluate
    from .solve import compare, format_rows
    from .solvers.ilp import fastest_times

    t0 = time.perf_counter()
    ind = indicate(model, args.indicator_batches, args.method, batch=8,
                   progress=sys.stderr.isatty(), **fast_options())
    print(f"\nindicator: {ind.method} on {ind.batches} {ind.data} batch(es) of {ind.batch_size} "
          f"on this CPU in {time.perf_counter() - t0:.1f} s (cached for the next run)")
    problem = AllocationProblem(graph, cluster, costs, ind)
    fastest = fastest_times(problem)["t4"]
    print(f"allocation problem: {len(problem.units)} decisions per group, target "
          f"{problem.target_ms:.1f} ms ({problem.target_source}); the T4s' fastest plan "
          f"computes in {fastest:.0f} ms, so precision alone can end the V100s' wait\n"
          if fastest is not None else "")
    rows = compare(problem, joint_split=True)
    print(format_rows(rows))
    print("(rounds: solve-replay refinement rounds; highs+split chooses the per-card batch "
          "split together with the precisions, global batch fixed)")
    chosen = next((r for r in rows if r.solver in ("cpsat", "highs", "cbc") and r.plan is not None
                   and r.feasible), None)
    out = args.out or "qsync-demo"
    if chosen is not None and chosen.plan is not None:
        ev = evaluate(problem, chosen.plan)
        save(chosen.plan, f"{out}/plan.json", what="--out")
        by = {r.solver: r for r in rows}
        print(f"\n{chosen.solver}'s plan ({chosen.status}):")
        print("\n".join(plan_lines(problem, chosen.plan, ev)))
        tl = ev.timeline
        assert tl is not None
        ratio = tl.groups["t4"].compute_ms / tl.groups["v100"].compute_ms
        wait, wait_hi = tl.groups["v100"].straggler_wait_ms, high.groups["v100"].straggler_wait_ms
        print(f"The T4s compute in {ratio:.2f}x the V100s' time ("
              + ("the V100s no longer wait for the T4s" if wait <= 1e-6 * tl.iteration_ms
                 else f"the V100s still wait {wait:.0f} ms for the T4s")
              + f"; {wait_hi:.0f} ms with every card at FP32): iteration "
              f"{ev.replay_makespan_ms:.0f} ms in the replayer against {high.iteration_ms:.0f} ms "
              f"with every card at FP32; straggler: {straggler_reason(tl)}.")
        so = by.get("strong-only")
        if so is not None and so.samples_per_s:
            print(f"Throughput {ev.samples_per_s:.0f} samples/s against {so.samples_per_s:.0f} "
                  f"with the V100s alone ({ev.samples_per_s / so.samples_per_s:.2f}x).")
        split = next((r for r in rows if r.solver.endswith("+split") and r.plan is not None), None)
        if split is not None and split.objective is not None and chosen.objective:
            print(f"With the batch split chosen too ({', '.join(f'{g}={b}' for g, b in split.batches.items())} "
                  f"per card), the same makespan costs {split.objective / chosen.objective:.0%} of "
                  "the precision-only plan's degradation.")
        print(f"wrote {out}/plan.json")
        from .frontier import format_points, frontier, plot_frontier

        pts = frontier(problem, points=4, allocators=("exact", "greedy", "uniform",
                                                      "dynamic-batching", "strong-only"))
        print("\nPareto frontier (degradation against throughput as the target sweeps; "
              "`qsync-opt pareto` adds the joint split):")
        print(format_points(pts))
        plot_frontier(pts, f"{out}/frontier.png", f"{model} on {shorthand}", what="--out")
        print(f"wrote {out}/frontier.png")
    else:
        print("\nno exact allocator found a feasible plan; see the table above")
    if args.out:
        save(graph, f"{args.out}/graph.json", what="--out")
        save(costs, f"{args.out}/costs.json", what="--out")
        save(ind, f"{args.out}/indicator.json", what="--out")
        atomic_write_text(f"{args.out}/cluster.json", to_json(cluster), what="--out")
        print(f"wrote {args.out}/graph.json, costs.json, indicator.json, cluster.json")
    return 0


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="qsync-opt", description="Precision plans for mixed GPU clusters.")
    p.add_argument("--version", action="version", version=f"qsync-opt {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument("--json", action="store_true", help="machine-readable output on stdout")
        return sp

    add("models", "list the built-in workloads").set_defaults(fn=cmd_models)
    sp = add("devices", "list the device catalog")
    sp.add_argument("--cpu", action="store_true", help="also measure and show this machine's CPU")
    sp.set_defaults(fn=cmd_devices)
    sp = sub.add_parser("schema", help="print the JSON Schema of a document")
    sp.add_argument("name", help=f"one of: {', '.join(schema_names())}")
    sp.set_defaults(fn=cmd_schema, json=True)

    def model_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--model", required=True,
                        help="workload name (qsync-opt models) or path/file.py:fn (that file "
                             "is run: it is imported and fn() called)")
        sp.add_argument("--batch", type=BATCH, default=None, help="per-device batch to trace at")
        sp.add_argument("--unpin-head", action="store_true",
                        help="let the classifier head's precision be chosen")
        sp.add_argument("--tie", choices=TIE_MODES, default="none", help="tie groups")

    sp = add("graph", "trace a workload into a ModelGraph")
    model_args(sp)
    sp.add_argument("--out", help="write the ModelGraph JSON here")
    sp.add_argument("--ops", action="store_true", help="print every op")
    sp.set_defaults(fn=cmd_graph)
    sp = add("estimate", "roofline cost estimates of a workload on a cluster")
    model_args(sp)
    sp.add_argument("--cluster", required=True, help=f"cluster file (.toml/.json) or {SHORTHAND_HELP}")
    sp.add_argument("--out", help="write the CostTable JSON here")
    sp.set_defaults(fn=cmd_estimate)
    sp = add("replay", "simulate one iteration of a plan (default: the uniform plans)")
    model_args(sp)
    sp.add_argument("--cluster", help=f"cluster file or {SHORTHAND_HELP} (default: the plan's)")
    sp.add_argument("--plan", help="Plan JSON to replay")
    sp.add_argument("--trace", help="write a Chrome/Perfetto trace JSON here")
    sp.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    sp.add_argument("--bucket-mb", type=finite_float(0, 2**20, lo_open=True), default=None,
                    help="DDP bucket cap in MiB")
    sp.add_argument("--write-plans", metavar="DIR", help="write the uniform plans as Plan JSON")
    sp.set_defaults(fn=cmd_replay)
    sp = add("indicate", "measure each op's sensitivity to each precision")
    sp.add_argument("--model", required=True,
                    help="workload name (qsync-opt models) or path/file.py:fn (that file is "
                         "run; its data() and loss() are used where it has them)")
    sp.add_argument("--method", default="qsync",
                    choices=["qsync", "wvar", "hessian", "fisher", "random"])
    sp.add_argument("--batches", type=BATCHES, default=10, help="batches to average over")
    sp.add_argument("--batch", type=BATCH, default=None, help="batch size (default: workload's)")
    sp.add_argument("--seed", type=SEED, default=0)
    sp.add_argument("--gamma", type=finite_float(0), default=4.0, help="forward weight (qsync)")
    sp.add_argument("--top", type=positive_int(100_000), default=5, help="rows in each table")
    sp.add_argument("--no-cache", action="store_true", help="recompute even if cached")
    sp.add_argument("--fast", action="store_true",
                    help="qsync: propagate variances in bf16 for 2 samples per batch (large "
                         "models; scales still from whole batches)")
    sp.add_argument("--out", help="write the IndicatorTable JSON here")
    sp.set_defaults(fn=cmd_indicate)
    def problem_args(sp: argparse.ArgumentParser) -> None:
        model_args(sp)
        sp.add_argument("--cluster", required=True, help=f"cluster file or {SHORTHAND_HELP}")
        sp.add_argument("--indicator", help="IndicatorTable JSON (default: computed and cached)")
        sp.add_argument("--method", default="qsync",
                        choices=["qsync", "wvar", "hessian", "fisher", "random"],
                        help="indicator method when it is computed")
        sp.add_argument("--indicator-batches", type=BATCHES, default=10,
                        help="batches the computed indicator averages over")
        sp.add_argument("--indicator-batch", type=BATCH, default=None,
                        help="batch the computed indicator runs at (default: the traced "
                             "batch, at most 8)")
        sp.add_argument("--costs", help="CostTable JSON (default: roofline estimates)")
        sp.add_argument("--target-ms", type=finite_float(0, lo_open=True), default=None,
                        help="makespan target (default: strong groups at their reference)")
        sp.add_argument("--headroom", type=FRACTION, default=0.0,
                        help="fraction of each card's memory kept free")
        sp.add_argument("--reference", default="fp32", help="strong groups' reference precision")
        sp.add_argument("--lower-reference", action="store_true",
                        help="let the solver lower the strong groups below their reference "
                             "(default: held there, unless the target needs them faster or "
                             "their reference plan does not fit memory)")
        sp.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
        sp.add_argument("--pin", action="append", metavar="OP=PRECISION",
                        help="fix an op's precision on every group (repeatable)")
        sp.add_argument("--time-limit", type=POSITIVE_SECONDS, default=None,
                        help="seconds for the whole solve: every round, fallback and "
                             "diagnosis (default 60)")
        sp.add_argument("--threads", type=int_range(0, 1024), default=0,
                        help="solver threads (0: default)")
        sp.add_argument("--seed", type=SEED, default=0)
        sp.add_argument("--gap", type=finite_float(0, 1), default=1e-6,
                        help="relative optimality gap")
        sp.add_argument("--warm-start", choices=["greedy"], default=None,
                        help="hint the exact solvers with greedy's plan")
        sp.add_argument("--acceptance", choices=["replayer", "linear"], default="replayer",
                        help="greedy's move check")
        sp.add_argument("--refine", type=int_range(0, 100), default=3,
                        help="solve-replay refinement rounds for the exact solvers")
        sp.add_argument("--batch-multiple", type=BATCH, default=None,
                        help="joint split: per-device batches are multiples of this")

    sp = add("solve", "choose every op's precision on every group")
    problem_args(sp)
    sp.add_argument("--solver", default="cpsat",
                    help="highs, cbc, cpsat, greedy, greedy-per-ms, uniform, dynamic-batching, "
                         "additive-ilp or strong-only")
    sp.add_argument("--out", required=True, help="write the Plan JSON here")
    sp.add_argument("--report", help="also write the SolveReport JSON here")
    sp.add_argument("--mode", choices=["auto", "target", "budget"], default="auto",
                    help="least degradation under the target (auto: lexicographic when the "
                         "default target is out of reach), or least makespan under --budget")
    sp.add_argument("--budget", type=finite_float(0), default=None,
                    help="degradation budget (--mode budget)")
    sp.add_argument("--joint-split", action="store_true",
                    help="choose the per-group batch split together with the precisions")
    sp.set_defaults(fn=cmd_solve)
    sp = sub.add_parser("compare", help="every allocator and baseline side by side",
                        description="every allocator and baseline side by side")
    problem_args(sp)
    sp.add_argument("--solvers", help="comma-separated subset (default: all)")
    sp.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                    help='write {"rows": [...]} to FILE (stdout without FILE)')
    sp.add_argument("--plans", metavar="DIR", help="write every plan into this folder")
    sp.add_argument("--joint-split", action="store_true",
                    help="add a row choosing the batch split with the precisions")
    sp.set_defaults(fn=cmd_compare)
    from .profile import add_profile_parser
    from .report import add_report_parser
    from .runtime.launch import add_train_parser

    add_report_parser(sub)
    add_train_parser(sub)
    add_profile_parser(sub)
    sp = add("pareto", "degradation against throughput as the makespan target sweeps")
    problem_args(sp)
    sp.add_argument("--out", required=True, help="write the frontier's points (JSON) here")
    sp.add_argument("--png", help="also plot it here")
    sp.add_argument("--points", type=int_range(2, 1000), default=8, help="targets swept")
    sp.add_argument("--exact", default="highs", help="exact backend (highs, cbc, cpsat)")
    sp.add_argument("--no-split", action="store_true",
                    help="leave out the joint batch split series (faster)")
    sp.set_defaults(fn=cmd_pareto)
    sp = sub.add_parser("demo", help="the main job on built-in defaults (no GPU needed)")
    sp.add_argument("--out", help="write the plan, graph, costs, indicator and cluster JSON "
                    "into this folder (default: the plan only, into ./qsync-demo)")
    sp.add_argument("--method", default="qsync",
                    choices=["qsync", "wvar", "hessian", "fisher", "random"],
                    help="indicator method")
    sp.add_argument("--indicator-batches", type=BATCHES, default=4,
                    help="synthetic batches of 8 the indicator averages over")
    sp.add_argument("--no-local", action="store_true",
                    help="skip part 1 (profile, plan, train and check on this CPU)")
    sp.add_argument("--steps", type=positive_int(1_000_000), default=80,
                    help="training steps per run in part 1 (default 80; four runs, A B B A)")
    sp.set_defaults(fn=cmd_demo)
    return p


def _error(message: str) -> int:
    """The CLI's one error line: control characters in ``message`` shown escaped."""
    sys.stderr.write(f"qsync-opt: error: {one_line(str(message))}\n")
    return 2


def _fail_writes_with_efbig() -> None:
    """A write past the file-size limit (RLIMIT_FSIZE) kills the process with SIGXFSZ by
    default, mid-write; ignored, the write fails with EFBIG and the atomic writer reports it
    in one line, the file that was there unchanged."""
    sigxfsz = getattr(signal, "SIGXFSZ", None)
    if sigxfsz is not None and threading.current_thread() is threading.main_thread():
        signal.signal(sigxfsz, signal.SIG_IGN)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    # parsers of other modules (profile, train) may type these plain int: checked here too
    batch = getattr(args, "batch", None)
    if isinstance(batch, int) and not 1 <= batch <= MAX_BATCH:
        parser.error(f"argument --batch: expected a positive integer (at most {MAX_BATCH}), "
                     f"got {batch}")
    batches = getattr(args, "batches", None)
    if isinstance(batches, int) and batches < 1:
        parser.error(f"argument --batches: expected a positive integer, got {batches}")
    _fail_writes_with_efbig()
    from .solve import InfeasibleError

    try:
        return int(args.fn(args))
    except InfeasibleError as exc:  # what would make it feasible, one finding per line
        _error(exc.head)
        for line in exc.lines:
            sys.stderr.write(f"  {one_line(str(line))}\n")
        return 2
    except QsyncInputError as exc:
        return _error(str(exc))
    except ValidationError as exc:
        return _error(describe_validation_error(exc))
    except BrokenPipeError:
        return 0
    except OSError as exc:  # a file no writer labelled: still one line, never a traceback
        where = f"{exc.filename}: " if exc.filename is not None else ""
        return _error(f"{where}{exc.strerror or exc.__class__.__name__}")


if __name__ == "__main__":
    raise SystemExit(main())
