"""Commands on one workload: ``graph`` (trace), ``estimate`` (roofline costs),
``replay`` (simulate plans) and ``indicate`` (per-op sensitivity); their parsers are
:mod:`qsync_opt.cli.parsers.model`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from qsync_opt.cli.args import (
    cluster_arg,
    emit_json,
    notes_after_success,
    sync_arg,
    trace_args,
    workload_arg,
)
from qsync_opt.cli.summaries import (
    REPLAY_HEADER,
    estimate_summary_lines,
    format_table,
    graph_summary_lines,
    replay_rows,
    uniform_plans,
)
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.costs.roofline import estimate
from qsync_opt.documents import outfolder
from qsync_opt.documents.io import atomic_write_text, load, save, to_json
from qsync_opt.documents.schemas import Document, Plan
from qsync_opt.indicator import (
    fast_options,
    indicate,
    rank_table,
)
from qsync_opt.netsim.cluster import parse_comm_model, transport_costs, with_netsim_comm
from qsync_opt.problem.plan import check_plan, make_plan, plan_model
from qsync_opt.replayer import Replayer
from qsync_opt.runtime.config import rank_groups_example
from qsync_opt.runtime.ranks import resolve_ranks
from qsync_opt.strategy.checks import check_strategy
from qsync_opt.strategy.modes import parse_sync


def _user_lines(wl: Any) -> list[str]:
    """What a user's file uses (its loss and data), one line each; none for a registry name
    (``--model`` as given) or a built-in."""
    return [] if isinstance(wl, str) else wl.usage_lines()


def _save_or_json(doc: Document, args: argparse.Namespace) -> bool:
    """``--out``: write ``doc`` there (atomically); ``--json``: print it on stdout, and True:
    the command prints nothing more."""
    if args.out:
        save(doc, args.out, what="--out")
    if args.json:
        sys.stdout.write(to_json(doc))
        return True
    return False


def cmd_graph(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    wl = workload_arg(args)
    graph = trace_args(args, workload=wl)
    secs = time.perf_counter() - t0
    if _save_or_json(graph, args):
        return 0
    print("\n".join(graph_summary_lines(graph, secs)))
    for line in _user_lines(wl):
        print(f"  {line}")
    if args.ops:
        rows = [(o.name, o.kind.value, o.role.value, "x".join(map(str, o.output_shapes[0])),
                 o.fwd_flops / 1e6, o.saved_bytes / 2**20, o.depth) for o in graph.ops]
        print()
        print(format_table(rows, ["op", "kind", "role", "output", "fwd MFLOP", "saved MiB", "depth"]))
    if args.out:
        print(f"wrote {args.out}")
    return 0


@notes_after_success
def cmd_estimate(args: argparse.Namespace) -> int:
    graph = trace_args(args)
    cluster = cluster_arg(args)
    costs = estimate(graph, cluster)
    if _save_or_json(costs, args):
        return 0
    print(f"cluster: {args.cluster} ({cluster.world_size} devices, {cluster.nodes} nodes)")
    print("\n".join(estimate_summary_lines(graph, cluster, costs)))
    print(f"  {len(costs.entries)} op-cost entries, {len(costs.casts)} cast models "
          f"({costs.notes[0]})")
    if args.out:
        print(f"wrote {args.out}")
    return 0


def _trace_path(base: str, name: str, several: bool) -> str:
    if not several:
        return base
    stem, dot, ext = base.rpartition(".")
    return f"{stem}.{name}.{ext}" if dot else f"{base}.{name}"


def _write_trace(base: str, name: str, several: bool, text: str) -> None:
    """``--trace``: the file named (a link there written through, as named), or beside it
    one file per timeline, names the tool made: never written through a link."""
    if not several:
        atomic_write_text(base, text, what="--trace")
        return
    path = Path(_trace_path(base, name, several))
    outfolder.write_text(path.parent, path.name, text, what="--trace")


#: replay's flags of one mode: (flag, attribute, default); given in the other, refused.
_PIPELINE_ONLY = (("--rank-groups", "rank_groups", None), ("--cuts", "cuts", None),
                  ("--micro-batches", "micro_batches", 1), ("--compress-act", "compress_act",
                                                             "none"),
                  ("--compress-grad", "compress_grad", "none"),
                  ("--link-gbps", "link_gbps", "1,10"), ("--latency-us", "latency_us", 50.0))
_DP_ONLY = (("--sync", "sync"), ("--lr", "lr"), ("--lr-schedule", "lr_schedule"),
            ("--steps", "steps"), ("--comm-model", "comm_model"), ("--bucket-mb", "bucket_mb"),
            ("--trace", "trace"), ("--write-plans", "write_plans"), ("--optimizer", "optimizer"))


def _replay_checks(args: argparse.Namespace) -> Any:
    """Every flag of ``replay`` checked before any work: a flag of the mode not chosen (a
    pipeline's under data parallelism, or the other way) is refused, never ignored; the
    defaults filled in. Returns the sync model (:func:`sync_arg`)."""
    pipelined = getattr(args, "pipeline_stages", None) is not None
    if getattr(args, "comm_model", None):  # its own keys first, then where it applies
        parse_comm_model(args.comm_model)
    for flag, attr, *default in _PIPELINE_ONLY:
        if getattr(args, attr, None) is None:
            setattr(args, attr, default[0])
        elif not pipelined:
            raise QsyncInputError(f"{flag}: only with --pipeline-stages N")
    if pipelined:
        for flag, attr in _DP_ONLY:
            if getattr(args, attr, None) is not None:
                raise QsyncInputError(f"{flag}: not with --pipeline-stages (a pipeline's "
                                      "step has no data-parallel sync, buckets or trace here)")
        return None
    if args.optimizer is None:
        args.optimizer = "sgd"
    return sync_arg(args)


def _plan_strategy_flags(args: argparse.Namespace, plan: Plan) -> str | None:
    """A version-2 plan's strategy as replay's flags: its sync mode (``--sync`` given
    otherwise: refused, naming both) and its pipeline (``--pipeline-stages`` and the
    boundaries' flags, unless given); returns its transport (None: version 1)."""
    strategy = plan.strategy
    if strategy is None:
        return None
    check_strategy(strategy, plan.cluster)
    if args.sync is not None and parse_sync(args.sync) != parse_sync(strategy.sync):
        raise QsyncInputError(f"--sync {args.sync}: the plan's strategy says {strategy.sync} "
                              "(plan field strategy.sync); leave --sync out to replay the plan")
    pipe = strategy.pipeline
    if pipe is None:
        if strategy.sync != "ddp":
            args.sync = strategy.sync
        return strategy.transport
    if getattr(args, "pipeline_stages", None) is None:
        args.pipeline_stages = pipe.stages
        args.rank_groups = ",".join(f"{i}:{g}" for i, g in enumerate(pipe.stage_groups))
        args.cuts = None if pipe.cuts is None else ",".join(pipe.cuts)
        args.micro_batches, args.compress_act = pipe.micro_batches, pipe.compress_act
        args.compress_grad = pipe.compress_grad
    return strategy.transport


@notes_after_success
def cmd_replay(args: argparse.Namespace) -> int:
    plan_doc: Plan | None = None
    transport: str | None = None
    if args.plan:
        plan_doc = load(args.plan, Plan)
        transport = _plan_strategy_flags(args, plan_doc)
    sync = _replay_checks(args)
    sha: str | None = None
    if plan_doc is not None:
        sha = plan_model(plan_doc, args.model)  # before --model's file runs
    graph = trace_args(args, sha)
    if plan_doc is not None:
        check_plan(plan_doc, graph)
    if args.cluster:
        cluster = cluster_arg(args)
    elif plan_doc is not None:
        cluster = plan_doc.cluster
    else:
        raise QsyncInputError("cluster: --cluster is required without --plan")
    if getattr(args, "comm_model", None):  # checked whole (each key) before any work
        parse_comm_model(args.comm_model)
        if getattr(args, "pipeline_stages", None) is not None:
            raise QsyncInputError("--comm-model: not with --pipeline-stages (the pipeline "
                                  "replay's links are --link-gbps and --latency-us)")
    if getattr(args, "pipeline_stages", None) is not None:
        return _replay_pipeline(args, plan_doc, graph, cluster)
    costs = estimate(graph, cluster)
    spec = parse_comm_model(getattr(args, "comm_model", None))
    if transport is not None:  # the plan's transport prices the buckets (fp16: half)
        costs = transport_costs(graph, cluster, costs, transport, spec)
        if not args.json:
            print(f"strategy from the plan: {plan_doc.strategy.describe()}")  # type: ignore[union-attr]
    elif getattr(args, "comm_model", None):
        costs = with_netsim_comm(graph, cluster.with_default_batch(graph.batch_size), costs, spec)
    if getattr(args, "comm_model", None) and not args.json:
        print(f"comm model: {spec.describe()}")
    rep = Replayer(graph, cluster, costs, optimizer=args.optimizer, sync=sync,
                   bucket_cap_bytes=(int(args.bucket_mb * 2**20) if args.bucket_mb is not None
                                     else None))
    plans: dict[str, Any] = {"plan": plan_doc} if plan_doc is not None else uniform_plans(rep)
    timelines = {name: rep.simulate(p) for name, p in plans.items()}
    if args.trace:
        for name, tl in timelines.items():
            _write_trace(args.trace, name, len(timelines) > 1, tl.chrome_trace_json())
    if args.write_plans:
        for name, p in plans.items():
            if not isinstance(p, Plan):
                outfolder.write_text(args.write_plans, f"{name}.plan.json",
                                     to_json(make_plan(graph, cluster, p, {"solver": name})),
                                     what="--write-plans")
    if args.json:
        emit_json({name: tl.summary() for name, tl in timelines.items()})
        return 0
    if rep.sync.name != "allreduce":
        print(f"{rep.sync.describe()}: {rep.buffer_sync_ms:.3f} ms a step")  # type: ignore[attr-defined]
    rows = [r for name, tl in timelines.items() for r in replay_rows(name, tl)]
    print(format_table(rows, REPLAY_HEADER))
    for name, tl in timelines.items():
        path = " -> ".join(
            (f"{s['kind']} {s.get('group', '')}".strip() if s["kind"] != "allreduce"
             else f"bucket {s['bucket']}") for s in tl.critical_path)
        print(f"{name}: iteration {tl.iteration_ms:.1f} ms, straggler {tl.straggler}; "
              f"critical path: {path}")
    if args.trace:
        print(f"wrote trace(s) for chrome://tracing or ui.perfetto.dev at {args.trace}")
    return 0


def _replay_pipeline(args: argparse.Namespace, plan_doc: Plan | None, graph: Any,
                     cluster: Any) -> int:
    """``replay --pipeline-stages N``: the GPipe step of the plan's groups as stages."""
    # lazy: the prediction traces and cuts the model (torch); a replay without a pipeline
    # runs torch-free from the graph cache
    from qsync_opt.pipeline.predict import predict_pipeline

    plan = plan_doc if plan_doc is not None else make_plan(
        graph, cluster, {}, {"solver": "none (every op at fp32)"})
    n = args.pipeline_stages
    devices = sum(g.count for g in plan.cluster.groups)
    if args.rank_groups is None and devices != n:
        raise QsyncInputError(
            f"--pipeline-stages {n}: the cluster has {devices} devices; say which group runs "
            "each stage with --rank-groups (e.g. "
            + rank_groups_example([g.name for g in plan.cluster.groups], n) + ")")
    ranks = resolve_ranks(plan, n if args.rank_groups is None else None, args.rank_groups)
    if len(ranks) != n:
        raise QsyncInputError(f"--rank-groups: names {len(ranks)} stages, --pipeline-stages "
                              f"is {n}")
    try:
        gbps = [float(x) for x in str(args.link_gbps).split(",") if x.strip()]
    except ValueError:
        gbps = []
    if not gbps or not all(0 < g < 1e6 for g in gbps):
        raise QsyncInputError(f"--link-gbps: expected positive numbers (Gb/s) separated by "
                              f"commas, got {args.link_gbps!r}")
    cuts = [c.strip() for c in args.cuts.split(",") if c.strip()] if args.cuts else None
    res = predict_pipeline(args.model, plan, ranks, cuts=cuts, batch=graph.batch_size,
                           micro_batches=args.micro_batches, compress_act=args.compress_act,
                           compress_grad=args.compress_grad, gbps=gbps,
                           latency_us=args.latency_us)
    if args.json:
        emit_json(res)
        return 0
    print(f"pipeline: {n} stages at {', '.join(res['cuts'])}; batch {res['batch']} in "
          f"{res['micro_batches']} micro-batch(es) of {res['micro_batch']}; act "
          f"{res['compress_act']}, grad {res['compress_grad']}; latency "
          f"{res['latency_us']:g} us")
    print(format_table([(s["stage"], s["group"], s["device"], f"{s['fwd_ms']:.3f}",
                         f"{s['bwd_ms']:.3f}") for s in res["stages"]],
                       ("stage", "group", "device", "fwd ms/micro", "bwd ms/micro")))
    print(format_table([(b["name"], f"{b['src']} -> {b['dst']}", "x".join(map(str, b["shape"])),
                         f"{b['raw_bytes'] / 2**10:.1f}", f"{b['act_bytes'] / 2**10:.1f}",
                         f"{b['grad_bytes'] / 2**10:.1f}") for b in res["boundaries"]],
                       ("boundary", "stages", "tensor", "raw KiB", "act KiB", "grad KiB")))
    print(format_table([(f"{s['gbps']:g}", f"{s['uncompressed_ms']:.3f}",
                         f"{s['compressed_ms']:.3f}",
                         f"{s['uncompressed_ms'] / s['compressed_ms']:.2f}x",
                         f"{s['bubble_frac']:.2f}") for s in res["steps"]],
                       ("Gb/s", "uncompressed ms", "compressed ms", "speed-up", "bubble")))
    return 0


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def say_all(lines: list[str], to_stderr: bool) -> None:
    """The indicator's lines (:func:`qsync_opt.cli.planning.computed_indicator`) after a
    command's result: on stdout, or on stderr where stdout is JSON."""
    for line in lines:
        if to_stderr:
            _say(line)
        else:
            print(line)


def cmd_indicate(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    fast = fast_options() if args.fast else {}
    table = indicate(workload_arg(args), args.batches, args.method, batch=args.batch,
                     seed=args.seed,
                     gamma=args.gamma, cache=not args.no_cache,
                     progress=not args.json, report=None if args.json else _say, **fast)
    secs = time.perf_counter() - t0
    if _save_or_json(table, args):
        return 0
    ranked = rank_table(table, Precision.int8)
    k = min(args.top, len(ranked))
    cols = [p for p in (Precision.int8, Precision.int8_full, Precision.fp8, Precision.bf16,
                        Precision.fp16, Precision.int4)
            if any(p in r for r in table.values.values())]

    def rows(items: list[tuple[str, float]]) -> list[tuple[Any, ...]]:
        return [(op, *(table.values[op].get(p, "-") for p in cols)) for op, _ in items]

    print(f"indicator {table.method} of {table.workload}: {len(ranked)} choosable ops, "
          f"{table.batches} batch(es) of {table.batch_size}, {table.data} data, {secs:.1f} s")
    header = ["op", *(p.value for p in cols)]
    print(f"\nmost sensitive (by int8):\n{format_table(rows(ranked[:k]), header)}")
    print(f"\nleast sensitive:\n{format_table(rows(ranked[-k:][::-1]), header)}")
    for note in table.notes:
        print(f"  {note}")
    if args.out:
        print(f"wrote {args.out}")
    return 0
