"""The parsers of ``graph``, ``estimate``, ``replay`` and ``indicate`` (their bodies:
:mod:`qsync_opt.cli.model`)."""

from __future__ import annotations

import argparse
from typing import Any

from qsync_opt.cli.args import (
    BATCH,
    BATCHES,
    COMPRESSOR_TEXT,
    GBPS_TEXT,
    INT4_FLAG_HELP,
    SEED,
    Deferred,
    add_sync_args,
    command,
    finite_float,
    int_range,
    model_args,
    positive_int,
)
from qsync_opt.costs.cluster import SHORTHAND_HELP
from qsync_opt.documents.schemas import MAX_BATCH
from qsync_opt.indicator import METHODS
from qsync_opt.netsim.cluster import COMM_MODEL_HELP


def add_graph_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``graph`` (its body: :func:`~qsync_opt.cli.model.cmd_graph`)."""
    sp = command(sub, "graph", "trace a workload into a ModelGraph")
    model_args(sp)
    sp.add_argument("--out", help="write the ModelGraph JSON here")
    sp.add_argument("--ops", action="store_true", help="print every op")
    sp.set_defaults(fn=Deferred("qsync_opt.cli.model", "cmd_graph"))
    return sp


def add_estimate_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``estimate`` (its body: :func:`~qsync_opt.cli.model.cmd_estimate`)."""
    sp = command(sub, "estimate", "roofline cost estimates of a workload on a cluster")
    model_args(sp)
    sp.add_argument("--cluster", required=True, help=f"cluster file (.toml/.json) or {SHORTHAND_HELP}")
    sp.add_argument("--int4", action="store_true", help=INT4_FLAG_HELP)
    sp.add_argument("--out", help="write the CostTable JSON here")
    sp.set_defaults(fn=Deferred("qsync_opt.cli.model", "cmd_estimate"))
    return sp


def add_replay_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``replay`` (its body: :func:`~qsync_opt.cli.model.cmd_replay`)."""
    sp = command(sub, "replay", "simulate one iteration of a plan (default: the uniform plans)")
    model_args(sp)
    sp.add_argument("--cluster", help=f"cluster file or {SHORTHAND_HELP} (default: the plan's)")
    sp.add_argument("--int4", action="store_true", help=INT4_FLAG_HELP)
    sp.add_argument("--plan", help="Plan JSON to replay")
    sp.add_argument("--trace", help="write a Chrome/Perfetto trace JSON here")
    sp.add_argument("--optimizer", choices=["sgd", "adam"], default=None,
                    help="the optimizer step's time (default sgd)")
    sp.add_argument("--bucket-mb", type=finite_float(0, 2**20, lo_open=True), default=None,
                    help="DDP bucket cap in MiB")
    sp.add_argument("--write-plans", metavar="DIR", help="write the uniform plans as Plan JSON")
    add_sync_args(sp)
    sp.add_argument("--comm-model", default=None, metavar="MODEL",
                    help=f"bucket all-reduce times: {COMM_MODEL_HELP}")
    g = sp.add_argument_group("pipeline", "predict a pipeline of stages with compressed "
                              "point-to-point boundaries instead of data parallelism")
    g.add_argument("--pipeline-stages", type=int_range(2, 64), default=None, metavar="N")
    g.add_argument("--rank-groups", default=None, metavar="R:GROUP,...",
                   help="the group of each stage (default: the cluster's devices in order)")
    g.add_argument("--cuts", default=None, metavar="OP,...",
                   help="where stages 2..N begin (default: balanced on each stage's time)")
    g.add_argument("--micro-batches", type=positive_int(MAX_BATCH), default=None, metavar="M")
    g.add_argument("--compress-act", type=COMPRESSOR_TEXT, default=None, metavar="C",
                   help="none, topk:F (or N%%), quant:B[,stochastic]")
    g.add_argument("--compress-grad", type=COMPRESSOR_TEXT, default=None, metavar="C")
    g.add_argument("--link-gbps", type=GBPS_TEXT, default=None, metavar="G,...",
                   help="link bandwidths between stages, Gb/s (default 1,10)")
    g.add_argument("--latency-us", type=finite_float(0, 1e7), default=None,
                   help="one-way link latency (default 50 us)")
    sp.set_defaults(fn=Deferred("qsync_opt.cli.model", "cmd_replay"))
    return sp


def add_indicate_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``indicate`` (its body: :func:`~qsync_opt.cli.model.cmd_indicate`)."""
    sp = command(sub, "indicate", "measure each op's sensitivity to each precision")
    sp.add_argument("--model", required=True,
                    help="workload name (qsync-opt models) or path/file.py:fn (that file is "
                         "run; its data() and loss() are used where it has them)")
    sp.add_argument("--method", default=METHODS[0],
                    choices=METHODS)
    sp.add_argument("--batches", type=BATCHES, default=10, help="batches to average over")
    sp.add_argument("--batch", type=BATCH, default=None, help="batch size (default: workload's)")
    sp.add_argument("--seed", type=SEED, default=0)
    sp.add_argument("--gamma", type=finite_float(0, 1e6), default=4.0, help="forward weight (qsync)")
    sp.add_argument("--top", type=positive_int(100_000), default=5, help="rows in each table")
    sp.add_argument("--no-cache", action="store_true", help="recompute even if cached")
    sp.add_argument("--fast", action="store_true",
                    help="qsync: propagate variances in bf16 for 2 samples per batch (large "
                         "models; scales still from whole batches)")
    sp.add_argument("--out", help="write the IndicatorTable JSON here")
    sp.set_defaults(fn=Deferred("qsync_opt.cli.model", "cmd_indicate"))
    return sp
