"""The ``train`` command's body over :mod:`qsync_opt.job.launch` (the checks, the run's
config, torchrun) and the runtime (:mod:`qsync_opt.job.rank`); its parser is
:mod:`qsync_opt.cli.parsers.train`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from qsync_opt.cli.elastic import cmd_elastic, elastic_spec, last_world, summary_line
from qsync_opt.cli.replanning import make_replanner
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.documents.outfolder import read_bytes
from qsync_opt.documents.schemas import Plan
from qsync_opt.job import launch
from qsync_opt.job.launch import TrainRequest
from qsync_opt.job.rank import emulate
from qsync_opt.ops import load_cpu
from qsync_opt.pipeline.spec import PipelineRequest
from qsync_opt.runtime.config import TrainConfig
from qsync_opt.runtime.metrics import ranks_text, sync_line
from qsync_opt.runtime.online import OnlineSpec, parse_injection
from qsync_opt.runtime.rankfail import report_failure

__all__ = ["cmd_train", "train_request"]

log = logging.getLogger("qsync_opt.job.launch")  # the launcher's warnings keep its logger's name



def train_request(args: argparse.Namespace) -> TrainRequest:
    """The parsed flags as the launcher's :class:`~qsync_opt.job.launch.TrainRequest`."""
    return TrainRequest(
        model=args.model, plan=args.plan, cluster=args.cluster, batch=args.batch,
        nproc=args.nproc, rank_groups=args.rank_groups, steps=args.steps, lr=args.lr,
        lr_schedule=args.lr_schedule, optimizer=args.optimizer, momentum=args.momentum,
        weight_decay=args.weight_decay, sync=args.sync, comm=args.comm, override=args.override,
        average_optimizer_state=args.average_optimizer_state, seed=args.seed, out=args.out,
        checkpoint_every=args.checkpoint_every, resume=not args.no_resume,
        resume_anyway=args.resume_anyway, emulate_dp=args.emulate_dp,
        elastic=getattr(args, "elastic", False),
        timeout_s=args.timeout, backend=args.backend, progress_every_s=args.progress_every,
        measure_memory=args.measure_memory, emulate_link=args.emulate_link,
        pipeline=PipelineRequest(
            stages=args.pipeline_stages, cuts=args.cuts, micro_batches=args.micro_batches,
            compress_act=args.compress_act, compress_grad=args.compress_grad,
            feedback=args.feedback, compress_at_eval=args.compress_at_eval),
        online=online_spec(args))


def online_spec(args: argparse.Namespace) -> OnlineSpec | None:
    """The ``--replan*`` and ``--inject-slowdown`` flags (None: all at their defaults)."""
    injections = [parse_injection(t) for t in args.inject_slowdown or ()]
    if args.replan == "off" and not injections:
        return None
    return OnlineSpec(replan=args.replan, replan_threshold=args.replan_threshold,
                      replan_window=args.replan_window,
                      replan_calibration=args.replan_calibration,
                      indicator=args.replan_indicator, inject_slowdown=injections)


def cmd_train(args: argparse.Namespace) -> int:
    """``qsync-opt train``: 0 on success, 1 when a rank failed; bad input raises (exit 2)."""
    lines: list[str] = []
    pending: dict[str, Any] = {}
    config = launch.build_config(train_request(args), lines, pending)
    if getattr(args, "membership", None) and not config.elastic:
        raise QsyncInputError("--membership: only with --elastic")
    if getattr(args, "rdzv_endpoint", None) and not (config.elastic and args.print_command):
        raise QsyncInputError("--rdzv-endpoint: only with --elastic --print-command (the "
                              "commands for a cluster); on this machine the launcher picks "
                              "a free port itself")
    spec = (elastic_spec(args, config, pending.get("plan") or Plan.load(config.plan_path))
            if config.elastic else None)  # checked before anything is written
    path = launch.write_config(config, pending.get("plan"))
    for warning in pending["warnings"]:  # after every check: a refusal is one line
        log.warning(warning)
    for line in lines:
        sys.stdout.write(line + "\n")
    sys.stdout.write(f"wrote {path} ({config.world_size} rank(s): "
                     f"{', '.join(config.rank_groups)})\n")
    if config.slowdown:
        sys.stdout.write("emulation: compute stretched "
                         + ", ".join(f"{g} x{f:g}" for g, f in config.slowdown.items())
                         + " (equal CPUs standing in for slower cards)\n")
    if config.link is not None:
        sys.stdout.write(f"emulation: link {config.link.describe()} between the ranks "
                         "(sleeps on top of the real transfers)\n")
    if config.online is not None:
        sys.stdout.write(_online_line(config.online) + "\n")
    if config.elastic:
        assert spec is not None
        rc = cmd_elastic(args, config, path, spec)
        if rc == 0 and not (args.print_command or args.dry_run):
            _print_summary(last_world(config))
            told = summary_line(config)
            if told:
                sys.stdout.write(told + "\n")
        return rc
    if args.print_command:
        plan = Plan.load(config.plan_path)
        sys.stdout.write("\n".join(launch.multinode_commands(config, plan, path)) + "\n")
        return 0
    if config.emulate_dp:
        if args.dry_run:
            return 0
        result = (emulate(config, replanner=make_replanner) if config.online is not None
                  else emulate(config))
        if isinstance(result, int) and not isinstance(result, bool):
            return result
        _print_summary(config)
        return 0
    if launch.worker_module(config) == launch.REPLAN_WORKER:  # the worker that re-plans
        cmd = launch.local_command(path, config.world_size, launch.free_port(),
                                   launch.REPLAN_WORKER)
    else:
        cmd = launch.local_command(path, config.world_size, launch.free_port())
    if args.dry_run:
        sys.stdout.write(" ".join(shlex.quote(c) for c in cmd) + "\n")
        return 0
    load_cpu()  # compile the C++ kernels once here, not in every rank at once
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    report: dict[str, list[str]] = {"errors": [], "held": []}
    rc, tail = launch.run_streaming(cmd, env, report)
    if rc == 0:
        _print_summary(config)
        return 0
    return report_failure(rc, tail, report, config.rank_groups)


def _online_line(spec: OnlineSpec) -> str:
    """What ``--replan`` and ``--inject-slowdown`` will do, in one line."""
    parts = [f"re-plan {spec.replan}"]
    if spec.replan == "auto":
        parts[0] += (f" (a group {spec.replan_threshold:.0%} slower than calibrated on "
                     f"{spec.replan_window} consecutive steps, calibrated on the first "
                     f"{spec.replan_calibration} of each plan)")
    parts += [f"slowdown injected: {i.group} x{i.factor:g} from step {i.step}"
              for i in spec.inject_slowdown]
    return "online: " + "; ".join(parts)


def _planned_line(config: TrainConfig, doc: dict[str, Any]) -> str | None:
    """What a version-2 plan predicted for its strategy beside what the run measured (its
    payload a step and its syncs a step); None without a prediction or a measurement."""
    try:
        plan = Plan.load(config.plan_path)
    except (OSError, ValueError):
        return None
    comm = doc.get("communication")
    pred = plan.strategy.predicted if plan.strategy is not None else None
    if pred is None or not isinstance(comm, dict) or not comm.get("steps"):
        return None
    steps = int(comm["steps"])
    return (f"  the plan predicted {pred.bytes_per_step / 1e6:.3f} MB and "
            f"{pred.syncs_per_step:.3g} syncs a step ({plan.strategy.describe()}"  # type: ignore[union-attr]
            f"); measured {int(comm['bytes_sent']) / steps / 1e6:.3f} MB and "
            f"{int(comm['rounds']) / steps:.3g}"
            + ("" if not config.overrides else "; OVERRIDDEN: " + "; ".join(config.overrides)))


def _print_summary(config: TrainConfig) -> None:
    """One line from the run's summary.json (silently nothing when the worker wrote none),
    then the communication and the pipeline's boundaries."""
    path = Path(config.out_dir) / "summary.json"
    try:
        data = read_bytes(path.parent, path.name)  # never through a link in --out
        doc = json.loads(data) if data is not None else None
    except (OSError, ValueError, RecursionError):
        return
    if not isinstance(doc, dict):
        return
    acc = doc.get("eval_accuracy")

    def loss(key: str, measured: bool = True) -> str:
        # the runtime writes a non-finite number as null (strict JSON)
        v = doc.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return f"{v:.4f}"
        return "not finite" if measured else "not measured"

    warnings = [w for w in doc.get("warnings") or [] if isinstance(w, str)]
    for w in warnings:  # loudly: on stderr too, and first on the summary's line
        sys.stderr.write(f"qsync-opt: train: WARNING: {w}\n")
    sys.stdout.write(
        "".join(f"WARNING: {w}. " for w in warnings)
        + f"trained {doc.get('steps')} steps on {doc.get('world_size')} rank(s) "
        f"({ranks_text(config.rank_groups, doc)}): final loss "
        f"{loss('final_loss')}, eval loss {loss('eval_loss', config.eval_batches > 0)}"
        + (f", eval accuracy {acc:.3f}" if acc is not None else "")
        + f", {doc.get('skipped_steps', 0)} skipped step(s); {path.parent}\n")
    comm = sync_line(doc)
    if comm:
        sys.stdout.write(comm + "\n")
    planned = _planned_line(config, doc)
    if planned:
        sys.stdout.write(planned + "\n")
    if doc.get("mode") == "pipeline":
        for b in doc.get("boundaries") or []:
            a, g = b.get("act_bytes_per_step"), b.get("grad_bytes_per_step")
            if a is None or g is None:
                continue
            match = (b.get("act_bytes") == b.get("act_bytes_predicted")
                     and b.get("grad_bytes") == b.get("grad_bytes_predicted"))
            sys.stdout.write(
                f"  boundary {b['name']} (stage {b['src']} -> {b['dst']}): "
                f"{a / 2**10:.1f} KiB activations, {g / 2**10:.1f} KiB gradients a step "
                f"({'equal to' if match else 'NOT equal to'} the wire formula)\n")
        if "eval_loss_compressed" in doc:
            sys.stdout.write(f"  eval loss with compressed activations "
                             f"{loss('eval_loss_compressed', config.eval_batches > 0)}\n")

