"""The parser of ``train`` (its body, over the launcher: :mod:`qsync_opt.cli.train`).

Its help and limits are the launcher's, stated here without importing it (the launcher
imports torch; building the parser must not)."""

from __future__ import annotations

import argparse
from typing import Any

from qsync_opt.cli.args import Deferred
from qsync_opt.core.limits import MAX_STEPS, finite_float, int_range, positive_int, spec_type
from qsync_opt.core.progress import LOG_EVERY_S
from qsync_opt.costs.link import LINK_FLAG, LINK_HELP, parse_link
from qsync_opt.documents.schemas import MAX_BATCH, MAX_DEVICES
from qsync_opt.runtime.config import (
    DEFAULT_LR,
    MAX_ABS_SEED,
    MAX_PROGRESS_EVERY_S,
    MAX_TIMEOUT_S,
    USER_MODEL_LR,
)
from qsync_opt.runtime.membership import (
    ALL_GONE_S,
    MAX_LOST_S,
    MEMBERSHIP_FLAG,
    RDZV_FLAG,
    parse_endpoint,
    parse_membership,
)
from qsync_opt.runtime.online import INJECT_FLAG, parse_injection
from qsync_opt.runtime.straggler import (
    DEFAULT_CALIBRATION,
    DEFAULT_THRESHOLD,
    DEFAULT_WINDOW,
)
from qsync_opt.runtime.straggler import (
    MAX_STEPS as MAX_WINDOW,
)
from qsync_opt.strategy.compressor_text import parse_compressor_text
from qsync_opt.strategy.modes import parse_comm, parse_sync
from qsync_opt.strategy.schedule import SCHEDULE_SYNTAX, parse_schedule

__all__ = ["DESCRIPTION", "MAX_RANKS", "add_train_parser"]

#: The command's help description: the first line of :mod:`qsync_opt.job.launch`'s docstring.
DESCRIPTION = ("``qsync-opt train``: check a plan against the ranks, write the run's config, "
               "launch torchrun.")
#: ``--nproc``'s limit: the launcher's ``MAX_RANKS``.
MAX_RANKS = MAX_DEVICES

#: ``--progress-every``: seconds from 0 (none) to a day, ASCII digits only (limits.parse_float)
_seconds = finite_float(0, MAX_PROGRESS_EVERY_S,
                        expected=f"seconds from 0 (none) to {MAX_PROGRESS_EVERY_S:g}")


def add_train_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``train`` (its body: :func:`~qsync_opt.cli.train.cmd_train`)."""
    p = sub.add_parser(
        "train", help="train a model under a plan with torchrun (DDP, gloo on CPU, NCCL on GPU)",
        description=DESCRIPTION)
    _add_plan_flags(p)
    _add_optimizer_flags(p)
    _add_run_flags(p)
    _add_pipeline_flags(p)
    _add_elastic_flags(p)
    _add_online_flags(p)
    p.add_argument("--override", action="store_true",
                   help="run --sync/--comm/--pipeline-* flags that contradict a version-2 "
                        "plan's strategy instead of refusing them (each override is recorded "
                        "in the run's config)")
    p.add_argument("--print-command", action="store_true",
                   help="write the config and print the torchrun commands for the plan's "
                        "nodes (multi-node), without launching")
    p.add_argument("--dry-run", action="store_true",
                   help="write the config and print the local command, without launching")
    p.set_defaults(fn=Deferred("qsync_opt.cli.train", "cmd_train"))
    return p


def _add_plan_flags(p: argparse.ArgumentParser) -> None:
    """The model, the plan (or the fp32 plan's cluster and batch) and the ranks."""
    p.add_argument("--model", required=True,
                   help="workload the plan was made for (qsync-opt models), or its model file "
                        "PATH.py:FUNCTION (run on every rank; its sha256 must be the plan's)")
    p.add_argument("--plan", default=None,
                   help="Plan JSON (qsync-opt solve / plan); without it every op runs at fp32 "
                        "on every rank (a plan written to OUT/fp32.plan.json for --cluster)")
    p.add_argument("--cluster", default=None,
                   help="without --plan: the cluster of the fp32 plan (default cpuxN, N = "
                        "--nproc or 1)")
    p.add_argument("--batch", type=positive_int(MAX_BATCH), default=None,
                   help="without --plan: batch per device (default: the model's)")
    p.add_argument("--nproc", type=positive_int(MAX_RANKS), default=None,
                   help="processes (ranks) on this node; default: one per rank group, or the "
                        "plan's device count")
    p.add_argument("--rank-groups", default=None, metavar="R:GROUP,...",
                   help="group of each rank, e.g. 0:v100,1:t4 (default: the plan's groups in "
                        "order, one rank per device)")


def _add_optimizer_flags(p: argparse.ArgumentParser) -> None:
    """Steps, the optimizer and its schedule, and how the replicas agree."""
    p.add_argument("--steps", type=positive_int(MAX_STEPS), default=100,
                   help="optimizer steps in total (default 100)")
    p.add_argument("--lr", type=finite_float(0, 1e6, lo_open=True), default=None,
                   help=f"learning rate (default {DEFAULT_LR} for the built-in workloads, "
                        f"{USER_MODEL_LR} for a model file)")
    p.add_argument("--lr-schedule", type=spec_type(  # the warm-up against --steps: later
                       lambda t: parse_schedule(t, 1.0, MAX_STEPS), "lr_schedule"),
                   default="constant", metavar="SCHEDULE",
                   help=f"{SCHEDULE_SYNTAX} (default constant)")
    p.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], default="sgd")
    p.add_argument("--momentum", type=finite_float(0, 1, hi_open=True), default=None,
                   help="SGD momentum (default 0.9)")
    p.add_argument("--weight-decay", type=finite_float(0, 1e6), default=0.0,
                   help="SGD/Adam L2 term, AdamW's decoupled decay (default 0)")
    p.add_argument("--sync", type=spec_type(parse_sync, "sync"), default=None, metavar="MODE",
                   help="a version-2 plan's own by default, else ddp; "
                        "ddp (gradients all-reduced every step), local:H (parameters "
                        "averaged every H steps) or qsr:alpha=A,h_base=H0[,power=P] (QSR)")
    p.add_argument("--comm", type=spec_type(parse_comm, "comm"), default=None,
                   metavar="TRANSPORT",
                   help="gradient transport of ddp's all-reduce (a version-2 plan's own by "
                        "default, else allreduce): allreduce (FP32), "
                        "fp16, or dlcp[:p=P][,policy=priority|random|unbiased][,chunk_kib=K]"
                        "[,scenario=ring|incast|oversubscribed][,iterations=N][,buffer_kib=B] "
                        "(bounded-loss priority, in DDP's own buckets: each rank zero-fills the "
                        "chunks of K KiB that the packet simulator says the plan's cluster "
                        "loses of its messages (scenario default ring, switch buffers of B KiB, "
                        "default 4096), N simulated iterations (default 4) computed once up "
                        "front and cycled, at most a fraction P (default 0.05) of each gradient "
                        "tensor; a network that loses nothing drops nothing), or "
                        "dlcp:p=P,stress[,policy=...][,chunk_kib=K][,layer_bias=B] (stress: "
                        "a fraction P of each tensor every step). dlcp EMULATES the network's "
                        "losses for their effect on quality: it sends the same bytes and "
                        "saves no time here; the time DLCP saves is the packet simulator's "
                        "prediction (qsync-opt netsim)")
    p.add_argument("--average-optimizer-state", action="store_true",
                   help="local/qsr: also average the optimizer state at every sync")


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """The seed, the output folder, checkpoints and resuming, the process group."""
    p.add_argument("--seed", type=int_range(-MAX_ABS_SEED, MAX_ABS_SEED), default=0)
    p.add_argument("--out", default=None,
                   help="output folder: config, checkpoints, metrics.jsonl (default "
                        "runs/MODEL); a link inside it is refused, never followed")
    p.add_argument("--checkpoint-every", type=int_range(0, MAX_STEPS), default=0,
                   help="steps between checkpoints; every run also writes one at its end, "
                        "so an interval of --steps or more means that one only (default 0: "
                        "at the end only)")
    p.add_argument("--no-resume", action="store_true",
                   help="start afresh even when --out holds a checkpoint (its sets and an "
                        "older run's summaries are removed)")
    p.add_argument("--resume-anyway", action="store_true",
                   help="resume --out's checkpoint even when it was written with another "
                        "seed, lr, plan or batch split (refused by default, with the "
                        "differences named; never another model, optimizer or world size)")
    p.add_argument("--emulate-dp", action="store_true",
                   help="one process computes every rank's micro-batch (emulated data parallel)")
    p.add_argument("--timeout", type=finite_float(0, MAX_TIMEOUT_S, lo_open=True), default=120.0,
                   help="collective timeout in seconds: a dead rank fails the others (default 120)")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    p.add_argument(LINK_FLAG, type=spec_type(parse_link, LINK_FLAG), default=None,
                   metavar="LINK",
                   help=f"EMULATE a slower network between the ranks (default off): {LINK_HELP}, "
                        "bandwidths in GB/s (intra: between ranks of a group on one node; "
                        "default the same). Every gradient bucket, parameter average, "
                        "statistics all-reduce, buffer broadcast and pipeline payload also "
                        "takes the link's time for its real bytes (ring all-reduce 2(n-1)/n x "
                        "bytes / bandwidth + 2(n-1) x latency, a send bytes / bandwidth + "
                        "latency), overlapping backward where DDP's all-reduce does; the "
                        "config, the summary and every metrics row say 'emulated'")
    p.add_argument("--progress-every", type=_seconds, default=LOG_EVERY_S, metavar="S",
                   help="where the output is not a terminal (a file, a pipe, nohup, a batch "
                        "scheduler): a progress line every S seconds (steps done, loss, steps "
                        f"per second, time left; default {LOG_EVERY_S:g}, 0: none); a "
                        "terminal shows a bar")
    p.add_argument("--measure-memory", type=int_range(0, MAX_STEPS), default=None, metavar="STEP",
                   help="measure step STEP's exact peak live tensor bytes inside every CPU rank "
                        "(summary.rankR.json 'memory'); the step's time includes the tracking")


def _add_pipeline_flags(p: argparse.ArgumentParser) -> None:
    """``--pipeline-stages`` and its boundaries' compressors."""
    g = p.add_argument_group(
        "pipeline parallelism", "one rank per stage instead of one replica per rank; each "
        "stage at its rank group's plan, its boundaries compressed")
    g.add_argument("--pipeline-stages", type=int_range(2, 64), default=None, metavar="N",
                   help="cut the model into N stages, one rank each (ranks = stages)")
    g.add_argument("--cuts", default=None, metavar="OP,...",
                   help="where stages 2..N begin: op or block names of the traced model "
                        "(default: balanced on each stage's estimated time)")
    g.add_argument("--micro-batches", type=positive_int(MAX_BATCH), default=1, metavar="M",
                   help="GPipe micro-batches per step (default 1)")
    g.add_argument("--compress-act", type=spec_type(parse_compressor_text), default="none", metavar="C",
                   help="activation compressor: none, topk:F (or N%%), quant:B[,stochastic]")
    g.add_argument("--compress-grad", type=spec_type(parse_compressor_text), default="none", metavar="C",
                   help="gradient compressor, the same forms")
    g.add_argument("--feedback", choices=["none", "ef", "ef21", "aqsgd"], default="none",
                   help="feedback wrapper (aqsgd: per-sample activation buffers)")
    g.add_argument("--compress-at-eval", action="store_true",
                   help="compress the activations when scoring the held-out batches too "
                        "(the summary has both either way)")


def _add_elastic_flags(p: argparse.ArgumentParser) -> None:
    """``--elastic`` and its settings (docs/ELASTIC.md)."""
    g = p.add_argument_group(
        "elastic training", "groups leave and return while the run goes on: one torchrun "
        "elastic agent per group, a re-plan and a resume at every change (docs/ELASTIC.md)")
    g.add_argument("--elastic", action="store_true",
                   help="run under torchrun's elastic agents (c10d rendezvous, one agent per "
                        "group); with --print-command, print the per-machine commands")
    g.add_argument("--max-lost-s", type=finite_float(0, 86400, lo_open=True),
                   default=MAX_LOST_S, metavar="S",
                   help="elastic: without --checkpoint-every, checkpoint often enough "
                        "(from the measured step time) that a crash loses at most S seconds "
                        f"of work (default {MAX_LOST_S:g})")
    g.add_argument(MEMBERSHIP_FLAG, type=spec_type(parse_membership, MEMBERSHIP_FLAG), default=None,
                   metavar="CHANGES",
                   help="elastic, on this machine (tests, benchmarks): GROUP-@STEP[:crash] "
                        "removes the group's agent at that step (graceful by default: a "
                        "checkpoint first; crash: SIGKILL), GROUP+@STEP[=DEVICE] starts a new "
                        "one once the run reaches the step (=DEVICE: back with another "
                        "device, refused by name); comma-separated")
    g.add_argument("--max-restarts", type=int_range(0, 10_000), default=100, metavar="N",
                   help="elastic: restarts each agent allows (every membership change costs "
                        "one; default 100)")
    g.add_argument("--all-gone-timeout", type=finite_float(0, 86400), default=ALL_GONE_S,
                   metavar="S",
                   help="elastic: when every group is gone, wait S seconds for one to return, "
                        f"then stop with the checkpoint intact (default {ALL_GONE_S:g})")
    g.add_argument(RDZV_FLAG, type=spec_type(parse_endpoint, RDZV_FLAG), default=None,
                   metavar="HOST:PORT",
                   help="elastic with --print-command: the rendezvous store's address "
                        "(default HOST0:29400); on this machine the launcher picks a port")


def _add_online_flags(p: argparse.ArgumentParser) -> None:
    """Online re-planning and injected slowdowns (qsync_opt.runtime.online)."""
    p.add_argument("--replan", choices=("off", "auto"), default="off",
                   help="auto: re-plan inside the running world when a group is slower than "
                        "its plan predicts (precisions swapped in place, the batch split "
                        "moved, at a step boundary); default off")
    p.add_argument("--replan-threshold", type=finite_float(0, 10, lo_open=True),
                   default=DEFAULT_THRESHOLD,
                   help=f"how much slower than calibrated counts (default {DEFAULT_THRESHOLD:g}"
                        ": 10%%)")
    p.add_argument("--replan-window", type=positive_int(MAX_WINDOW), default=DEFAULT_WINDOW,
                   help=f"consecutive slow steps that re-plan (default {DEFAULT_WINDOW})")
    p.add_argument("--replan-calibration", type=positive_int(MAX_WINDOW),
                   default=DEFAULT_CALIBRATION,
                   help="steps of each plan that calibrate its prediction first (default "
                        f"{DEFAULT_CALIBRATION})")
    p.add_argument("--replan-indicator", default=None, metavar="PATH",
                   help="IndicatorTable the re-plans use (default: computed on this CPU as "
                        "qsync-opt solve does, cached)")
    p.add_argument(INJECT_FLAG, action="append", default=None, metavar="GROUP@STEP=FACTOR",
                   type=spec_type(parse_injection, INJECT_FLAG),
                   help="from step STEP on, stretch group GROUP's compute FACTOR times (an "
                        "emulated card slowing down: cpu/2 becoming cpu/3 is FACTOR 3); "
                        "repeatable")
