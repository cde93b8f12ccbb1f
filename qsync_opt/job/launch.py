"""``qsync-opt train``: check a plan against the ranks, write the run's config, launch torchrun.

::

    qsync-opt train --model digits_cnn --plan plan.json --nproc 2 [--rank-groups 0:v100,1:t4]

The launcher validates (the plan file loads, was made for ``--model``'s graph and passes
:func:`qsync_opt.problem.plan.check_plan` (every op there, no pin overridden, precisions the cards
run), names every group of ``--rank-groups``, and ``--nproc`` matches the ranks), also under
``--dry-run``; writes ``OUT/train_config.json``
(:class:`~qsync_opt.runtime.config.TrainConfig`, atomically) and runs
``python -m torch.distributed.run --nproc-per-node N ... -m qsync_opt.job.rank CONFIG``
with ``OMP_NUM_THREADS=1`` unless set, streaming the ranks' output; a failed run returns 1
and names the rank that failed first. ``--emulate-dp`` instead runs every rank's micro-batch
in this one process (synchronous data parallelism, emulated). ``--dry-run`` stops after
writing the config and printing the command.

Ranks map to groups: by default rank ``i`` takes the plan's groups in order, one rank per
device (``plan.cluster.groups[k].count`` ranks each), which needs ``--nproc`` equal to the
plan's device count; otherwise ``--rank-groups 0:GROUP,1:GROUP,...`` says which group each
rank runs (e.g. one rank per group for a ``v100x16+t4x16`` plan on one box). A group whose
device is a derived CPU (``cpu/2``) gets that slowdown in the config: the rank stretches its
measured compute time by it (emulation of a slower card; qsync_opt.runtime.emulate).

Many nodes: nothing changes but the launch, because torchrun does the distributing. Run the
same module with ``--nnodes K --node-rank I --master-addr HOST --master-port PORT`` on each
node (the config file and ``--out`` on a shared filesystem, or copied to the same path);
``--print-command`` prints those commands for the plan's nodes. Ranks are numbered node by
node, so rank ``i`` is ``node_rank * nproc_per_node + local_rank`` and gets
``rank_groups[i]``; on a GPU each rank detects its card and warns when the plan says another.

Resuming: when ``--out`` holds a committed checkpoint set (qsync_opt.runtime.config), the run
continues it, but only under the settings that wrote it (model, plan, seed, optimizer, lr,
batch split, world size); otherwise it is refused, each difference named, before anything in
``--out`` changes, unless ``--resume-anyway`` (``--no-resume`` starts afresh). Every rank
file of the set is loaded (``weights_only``) and checked before any rank starts: a corrupt
or foreign one is one line naming it. ``--out`` itself may be a link (followed); inside it
nothing is followed: a link where the run writes, reads or deletes is refused before any
work (:func:`~qsync_opt.runtime.config.check_out_folder`, :mod:`qsync_opt.documents.outfolder`).

Stopping: torchrun runs in its own session; SIGTERM, SIGINT and SIGHUP to the launcher are
forwarded to it (it stops its ranks), and a launcher killed by SIGKILL still takes torchrun
(a parent-death signal) and every rank (a watchdog on the launcher's pid) with it.

The command itself (its parser, its output) is :mod:`qsync_opt.cli.train`.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from qsync_opt.core.errors import QsyncInputError, describe_validation_error
from qsync_opt.core.progress import LOG_EVERY_S
from qsync_opt.costs.cluster import load_cluster
from qsync_opt.costs.devices import get_device, is_derived
from qsync_opt.costs.link import resolve_link
from qsync_opt.documents.io import to_json
from qsync_opt.documents.outfolder import write_text
from qsync_opt.documents.schemas import MAX_DEVICES, Plan
from qsync_opt.graph import is_user_model, load_user_workload, trace
from qsync_opt.job.planned import DEFAULT_COMM_FLAG, DEFAULT_SYNC_FLAG, apply_plan_strategy
from qsync_opt.models.user import UserWorkload
from qsync_opt.pipeline.spec import PipelineRequest, pipeline_spec
from qsync_opt.problem.plan import graph_for_plan, make_plan, plan_model
from qsync_opt.runtime.checkpoint import check_set_files
from qsync_opt.runtime.config import (
    AVERAGE_STATE_REFUSAL,
    DEFAULT_LR,
    PIPELINE_SYNC_REFUSAL,
    USER_MODEL_LR,
    PipelineSpec,
    TrainConfig,
    check_batches,
    check_out_folder,
    check_resume,
    rank_groups_example,
)
from qsync_opt.runtime.online import OnlineSpec
from qsync_opt.runtime.rankfail import sort_line
from qsync_opt.runtime.ranks import resolve_ranks
from qsync_opt.runtime.watchdog import watch_parents
from qsync_opt.strategy.checks import check_strategy
from qsync_opt.strategy.modes import check_combination, parse_comm, parse_sync
from qsync_opt.strategy.schedule import parse_schedule

__all__ = ["CONFIG_NAME", "MAX_RANKS", "REPLAN_WORKER", "WORKER_MODULE", "TrainRequest",
           "build_config", "checkpoint_note", "free_port", "local_command", "multinode_commands",
           "resolve_defaults", "resolve_ranks", "run_streaming", "watch_parents", "worker_module",
           "write_config"]

log = logging.getLogger(__name__)

CONFIG_NAME = "train_config.json"
WORKER_MODULE = "qsync_opt.job.rank"
#: The worker of a run that re-plans online (``--replan auto``): the rank entry with the
#: planner's side (:mod:`qsync_opt.cli.replanning`; named here, never imported).
REPLAN_WORKER = "qsync_opt.cli.replanning"


def worker_module(config: TrainConfig) -> str:
    """The module torchrun runs on every rank of ``config``'s run."""
    online = config.online
    return REPLAN_WORKER if online is not None and online.replan == "auto" else WORKER_MODULE


#: Ranks of one run (one process each).
MAX_RANKS = MAX_DEVICES


def _slowdowns(plan: Plan, ranks: Sequence[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for g in plan.cluster.groups:
        if g.name in ranks and is_derived(g.device):
            factor = get_device(g.device).slowdown
            if factor != 1:
                out[g.name] = factor
    return out


@dataclass(frozen=True)
class TrainRequest:
    """What ``qsync-opt train`` was asked, as plain values (built by the command line from
    its flags; :func:`build_config` checks it against the plan). ``lr`` and ``nproc`` None:
    their defaults (:func:`resolve_defaults`)."""

    model: str
    plan: str | None = None
    cluster: str | None = None
    batch: int | None = None
    nproc: int | None = None
    rank_groups: str | None = None
    steps: int = 100
    lr: float | None = None
    lr_schedule: str = "constant"
    optimizer: str = "sgd"
    momentum: float | None = None
    weight_decay: float = 0.0
    #: None: not given (a version-2 plan's strategy, else ddp and allreduce)
    sync: str | None = None
    comm: str | None = None
    #: ``--override``: flags that contradict a version-2 plan's strategy win (recorded)
    override: bool = False
    overrides: tuple[str, ...] = ()
    average_optimizer_state: bool = False
    seed: int = 0
    out: str | None = None
    checkpoint_every: int = 0
    resume: bool = True
    resume_anyway: bool = False
    emulate_dp: bool = False
    elastic: bool = False
    timeout_s: float = 120.0
    backend: str = "auto"
    progress_every_s: float = LOG_EVERY_S
    measure_memory: int | None = None
    emulate_link: str | None = None
    pipeline: PipelineRequest = field(default_factory=PipelineRequest)
    #: ``--replan``, ``--replan-*``, ``--inject-slowdown`` (None: neither)
    online: OnlineSpec | None = None

    @property
    def pipelined(self) -> bool:
        return self.pipeline.stages is not None


def resolve_defaults(request: TrainRequest, lines: list[str] | None = None) -> TrainRequest:
    """The request with ``lr`` (a model file's default, else the built-in workloads') and,
    for a pipeline without ``--nproc`` or ``--rank-groups``, ``nproc`` (one rank per stage)
    filled in; the flags that combine badly refused."""
    user = is_user_model(request.model)
    if request.lr is None:
        request = replace(request, lr=USER_MODEL_LR if user else DEFAULT_LR)
        if lines is not None and user:
            lines.append(f"no --lr: {USER_MODEL_LR}, a model file's default (the built-in "
                         f"workloads' {DEFAULT_LR} diverged ResNet-50, ConvNeXt and ViT)")
    _check_sync_flags(request)
    if request.momentum is not None and request.optimizer != "sgd":
        raise QsyncInputError(f"--momentum: only with --optimizer sgd ({request.optimizer} has "
                              "its own moment estimates)")
    stages = request.pipeline.stages
    if stages is None:
        flag = request.pipeline.flag_without_stages()
        if flag is not None:
            raise QsyncInputError(f"{flag}: only with --pipeline-stages N")
        return request
    if not 2 <= stages <= 64:
        raise QsyncInputError(f"--pipeline-stages: expected 2 to 64 stages, got {stages}")
    if request.nproc is None and request.rank_groups is None:
        request = replace(request, nproc=stages)
    return request


def build_config(request: TrainRequest, lines: list[str] | None = None,
                 pending: dict[str, Any] | None = None) -> TrainConfig:
    """Validate the request against the plan and return the run's TrainConfig.

    A user's model file (``--model PATH.py:FUNCTION``) is checked here, before any rank
    starts: its sha256 against the plan's (before it runs), the plan against its graph, then
    one batch of the global batch (its ``data()``, or synthetic) against the example inputs
    and its loss on two samples (a scalar). ``lines`` receives what was chosen (the loss and
    the data). Nothing is written: without ``--plan`` the fp32 plan goes into
    ``pending["plan"]`` and warnings into ``pending["warnings"]``, for :func:`write_config`
    and the caller once every check has passed."""
    request, loaded = with_plan_strategy(request, lines)
    request = resolve_defaults(request, lines)
    name0 = (Path(request.model.partition(":")[0]).stem if is_user_model(request.model)
             else request.model)
    out = Path(request.out) if request.out else Path("runs") / name0
    check_out_folder(out)  # a folder we may write, holding no planted link: before any work
    pending = {} if pending is None else pending
    pending.setdefault("warnings", [])
    plan, plan_path = _run_plan(request, out, pending, lines, loaded)
    workload, sha, user = _checked_model(request, plan)
    ranks = _stage_ranks(request, plan, pending["warnings"])
    pipeline = None
    if request.pipelined:
        if user is not None:
            raise QsyncInputError("--pipeline-stages: pipelines run the registry workloads "
                                  "(qsync-opt models), not a model file")
        check_batches(plan, ranks)
        pipeline = pipeline_spec(request.pipeline, plan, ranks, model=request.model,
                                 batch=request.batch, lines=lines)
    if lines is not None:
        note = checkpoint_note(request.checkpoint_every, request.steps)
        if note:
            lines.append(note)
    if user is not None:
        global_batch = sum(check_batches(plan, ranks))
        loss_line = user.check(global_batch, request.seed)
        if lines is not None:
            lines += [loss_line, user.data_line()]
    return _train_config(request, plan, plan_path, ranks, out, workload=workload, sha=sha,
                         pipeline=pipeline)


def with_plan_strategy(request: TrainRequest, lines: list[str] | None = None
                       ) -> tuple[TrainRequest, Plan | None]:
    """The request with ``--plan``'s strategy applied (:mod:`qsync_opt.job.planned`: a
    version-2 plan runs its own sync, transport and pipeline; a flag that contradicts it is
    refused unless ``--override``), and the plan read; without a plan, or with a
    version-1 one, the flags' defaults (ddp, allreduce)."""
    plan = None if request.plan is None else Plan.load(request.plan)
    if request.override and (plan is None or plan.strategy is None):
        raise QsyncInputError("--override: only beside a version-2 plan (one that holds its "
                              "strategy); here the flags choose the strategy already")
    if plan is None or plan.strategy is None:
        return replace(request, sync=request.sync or DEFAULT_SYNC_FLAG,
                       comm=request.comm or DEFAULT_COMM_FLAG), plan
    check_strategy(plan.strategy, plan.cluster)
    sync, comm, pipe, groups, overrides = apply_plan_strategy(
        plan, sync=request.sync, comm=request.comm, pipeline=request.pipeline,
        rank_groups=request.rank_groups, override=request.override)
    if lines is not None:
        lines.append(f"strategy from the plan: {plan.strategy.describe()}"
                     + "".join(f"; OVERRIDE {o}" for o in overrides))
    return replace(request, sync=sync, comm=comm, pipeline=pipe, rank_groups=groups,
                   overrides=tuple(overrides)), plan


def _run_plan(request: TrainRequest, out: Path, pending: dict[str, Any],
              lines: list[str] | None, loaded: Plan | None = None) -> tuple[Plan, Path]:
    """The run's plan and its path: ``--plan``'s, else the fp32 plan (made, not written:
    ``pending["plan"]``)."""
    if request.plan is None:
        plan_path = out / "fp32.plan.json"
        pending["plan"] = fp32_plan(request, out, write=False)
        if lines is not None:
            lines.append(f"no --plan: every op at fp32 on every rank ({plan_path})")
    else:
        for flag, val in (("--cluster", request.cluster),
                          ("--batch", None if request.pipelined else request.batch)):
            if val is not None:
                raise QsyncInputError(f"{flag}: only without --plan (the plan holds the "
                                      "cluster and the batches)")
        plan_path = Path(request.plan)
    plan = pending.get("plan") or loaded or Plan.load(plan_path)  # a bad file: one line
    return plan, plan_path


def _checked_model(request: TrainRequest, plan: Plan
                   ) -> tuple[str, str | None, UserWorkload | None]:
    """The plan against the model, as every command that reads a plan checks it: made for
    this model's graph, every op there, no pin overridden, precisions the cards run. Returns
    the config's workload, a model file's sha256 and its loaded workload."""
    workload, sha = request.model, None
    user = None
    if is_user_model(request.model):
        sha = plan_model(plan, request.model)  # the file's hash, before it runs
        user = load_user_workload(request.model, sha256=sha)
        workload = user.name  # absolute: the ranks may run in another folder
    graph_for_plan(plan, request.model, workload=user)
    return workload, sha, user


def _stage_ranks(request: TrainRequest, plan: Plan, warnings: list[str]) -> list[str]:
    """Every rank's group (:func:`resolve_ranks`); a pipeline on a cluster of another size
    than its stages must say which group runs each stage."""
    stages = request.pipeline.stages
    if stages is not None and request.rank_groups is None:
        devices = sum(g.count for g in plan.cluster.groups)
        if devices != stages and request.nproc == stages:
            whose = "the plan's cluster" if request.plan is not None else "--cluster"
            raise QsyncInputError(
                f"--pipeline-stages {stages}: {whose} has {devices} "
                "devices; say which group runs each stage with --rank-groups (e.g. "
                + rank_groups_example([g.name for g in plan.cluster.groups], stages) + ")")
    return resolve_ranks(plan, request.nproc, request.rank_groups, warnings)


def _train_config(request: TrainRequest, plan: Plan, plan_path: Path, ranks: list[str],
                  out: Path, *, workload: str, sha: str | None,
                  pipeline: PipelineSpec | None) -> TrainConfig:
    """The run's :class:`~qsync_opt.runtime.config.TrainConfig` (its own checks: one line)."""
    assert request.lr is not None  # resolve_defaults
    try:
        return TrainConfig(
            workload=workload, workload_sha256=sha, plan_path=str(plan_path.resolve()),
            rank_groups=ranks,
            steps=request.steps, lr=request.lr, optimizer=request.optimizer,
            momentum=0.9 if request.momentum is None else request.momentum,
            lr_schedule=request.lr_schedule, weight_decay=request.weight_decay,
            sync=request.sync or DEFAULT_SYNC_FLAG, comm=request.comm or DEFAULT_COMM_FLAG,
            overrides=list(request.overrides),
            average_optimizer_state=request.average_optimizer_state,
            seed=request.seed, out_dir=str(out.resolve()),
            checkpoint_every=request.checkpoint_every,
            resume=request.resume, emulate_dp=request.emulate_dp, elastic=request.elastic,
            slowdown=_slowdowns(plan, ranks), timeout_s=request.timeout_s,
            backend=request.backend, memory_step=request.measure_memory, pipeline=pipeline,
            link=resolve_link(request.emulate_link, plan.cluster, ranks),
            progress_every_s=request.progress_every_s, resume_anyway=request.resume_anyway,
            online=request.online)
    except ValidationError as exc:
        raise QsyncInputError(describe_validation_error(exc, "train")) from None


def checkpoint_note(every: int, steps: int) -> str | None:
    """The line that says what ``--checkpoint-every`` does when it is not below ``--steps``:
    no checkpoint inside the run, the one at its end only (every run writes that one)."""
    if every <= 0 or every < steps:
        return None
    return (f"--checkpoint-every {every} is not below --steps {steps}: the run's one "
            f"checkpoint is the one every run writes at its end (step {steps})")


def _check_sync_flags(request: TrainRequest) -> None:
    """--sync, --comm and --lr-schedule, and whether the sync mode and the transport combine:
    refused in one line before anything is written."""

    def flagged(fn: Callable[[str], Any], text: str, flag: str) -> Any:
        try:
            return fn(text)
        except QsyncInputError as exc:
            raise QsyncInputError(f"{flag}: {str(exc).partition(': ')[2]}") from None

    lr = request.lr
    assert lr is not None  # resolve_defaults
    mode = flagged(parse_sync, request.sync or DEFAULT_SYNC_FLAG, "--sync")
    comm = flagged(parse_comm, request.comm or DEFAULT_COMM_FLAG, "--comm")
    if request.steps >= 1 and lr > 0:  # else TrainConfig names --steps / --lr
        flagged(lambda t: parse_schedule(t, lr, request.steps), request.lr_schedule,
                "--lr-schedule")
    check_combination(mode, comm)
    # the config refuses these too; here they are refused before OUT/fp32.plan.json is made
    if request.pipelined and (mode.kind != "ddp" or comm.kind != "allreduce"):
        raise QsyncInputError(PIPELINE_SYNC_REFUSAL)
    if request.average_optimizer_state and not mode.averages_parameters:
        raise QsyncInputError(AVERAGE_STATE_REFUSAL)


def fp32_plan(request: TrainRequest, out: Path, write: bool = True) -> Plan | Path:
    """Without ``--plan``: every op at fp32 on every group of ``--cluster`` (default
    ``cpuxN``, N = ``--nproc`` or 1) at ``--batch`` per device, written to
    ``OUT/fp32.plan.json`` (atomically; the run reads it like any plan) and its path
    returned; with ``write=False`` the plan itself, nothing written."""
    if request.batch is not None and request.batch < 1:
        raise QsyncInputError(f"--batch: expected a positive integer, got {request.batch}")
    cluster = load_cluster(request.cluster or f"cpux{request.nproc or 1}")
    graph = trace(request.model, request.batch)
    plan = make_plan(graph, cluster, {}, provenance={"solver": "none (train without --plan: "
                                                     "fp32 everywhere)"})
    if not write:
        return plan
    return write_text(out, "fp32.plan.json", to_json(plan))


def write_config(config: TrainConfig, plan: Plan | None = None) -> Path:
    """Write ``OUT/train_config.json`` atomically and return its path.

    First, before anything in ``OUT`` changes: the plan's batches must be within the
    runtime's limits, and a resume must continue a run made with the same settings
    (:func:`~qsync_opt.runtime.config.check_resume`; QsyncInputError names each difference),
    so the old run's config is never overwritten by one that cannot resume it; ``OUT`` holds
    no link where the run writes (:func:`~qsync_opt.runtime.config.check_out_folder`), and
    every rank file of the set it resumes loads (a corrupt or foreign file: one line naming
    it). The config is written never through a link in ``OUT``; ``plan``:
    the fp32 plan of a run without ``--plan`` (:func:`build_config`), written to
    ``config.plan_path`` only after those checks.
    """
    fp32 = plan
    plan = fp32 if fp32 is not None else Plan.load(config.plan_path)
    check_batches(plan, config.rank_groups)
    check_out_folder(config.out_dir)
    cs = check_resume(config, plan)
    if cs is not None:  # every rank file loads, before any rank starts
        check_set_files(cs, "pipeline" if config.pipeline is not None else "train")
    out = check_out_folder(config.out_dir, create=True)
    if fp32 is not None:  # build_config made it: OUT/fp32.plan.json
        write_text(out, Path(config.plan_path).name, to_json(fp32))
    return write_text(out, CONFIG_NAME, to_json(config))


# ----------------------------------------------------------------------------- commands


def free_port() -> int:
    """A TCP port free on this host now (for the local rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def local_command(config_path: Path, nproc: int, port: int,
                  module: str = WORKER_MODULE) -> list[str]:
    """The single-node torchrun command line for ``nproc`` ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-port", str(port), "-m", module, str(config_path)]


def multinode_commands(config: TrainConfig, plan: Plan, config_path: Path) -> list[str]:
    """One torchrun command per node (static rendezvous, so rank order is node order).

    Nodes follow the plan: when every rank group is laid out one rank per device and all
    groups have the same devices per node ``d`` (each count a multiple of it), there are
    ``world / d`` nodes of ``d`` ranks; otherwise one node runs every rank.
    """
    world = config.world_size
    per_node = world
    default_layout = config.rank_groups == [g.name for g in plan.cluster.groups
                                            for _ in range(g.count)]
    dpn = {g.devices_per_node for g in plan.cluster.groups}
    if default_layout and len(dpn) == 1:
        d = dpn.pop()
        if all(g.count % d == 0 for g in plan.cluster.groups):
            per_node = d
    nnodes = world // per_node
    lines = [f"# {nnodes} node(s) x {per_node} rank(s); {CONFIG_NAME} and the out dir "
             f"must be at the same path on every node (shared filesystem or copied)"]
    for node in range(nnodes):
        ranks = config.rank_groups[node * per_node:(node + 1) * per_node]
        groups = ", ".join(dict.fromkeys(ranks))
        lines.append(f"# node {node}: ranks {node * per_node}..{(node + 1) * per_node - 1} "
                     f"({groups})")
        cmd = ["OMP_NUM_THREADS=1", "torchrun", "--nnodes", str(nnodes), "--node-rank",
               str(node), "--nproc-per-node", str(per_node), "--master-addr", "HOST0",
               "--master-port", "29500", "-m", worker_module(config), str(config_path)]
        lines.append(" ".join(shlex.quote(c) if "=" not in c else c for c in cmd))
    return lines


#: Run by the child before it becomes ``cmd``: on Linux, a parent-death signal (SIGTERM,
#: kept across exec) so that torchrun stops its ranks when the launcher dies, even by
#: SIGKILL; then, if the launcher is already gone, exit instead of starting.
_EXEC_WITH_PARENT_DEATH_SIGNAL = """\
import ctypes, os, signal, sys
if sys.platform.startswith("linux"):
    try:
        u = ctypes.c_ulong  # PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(1, u(int(signal.SIGTERM)), u(0), u(0), u(0))
    except (OSError, AttributeError):
        pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""
#: Signals forwarded to the child's process group (a second one sends SIGKILL).
FORWARDED = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP")
                  if hasattr(signal, n))
#: After a forwarded signal, how long torchrun has to stop its ranks before SIGKILL.
STOP_GRACE_S = 45.0
#: After the child exited, how long its output may still come (from its children).
EOF_GRACE_S = 5.0


def _signal_group(proc: subprocess.Popen[str], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError, AttributeError):
        try:
            proc.send_signal(sig)
        except (ProcessLookupError, OSError):
            pass


def run_streaming(cmd: Sequence[str], env: dict[str, str],
                  report: dict[str, list[str]] | None = None) -> tuple[int, list[str]]:
    """Run ``cmd``, copy its output (stdout and stderr merged) to ours line by line.

    The child runs in its own session (process group), with a parent-death signal on Linux
    and ``QSYNC_LAUNCHER_PID`` in its environment (each rank's watchdog polls it), so no
    rank outlives the launcher, however it dies. SIGTERM, SIGINT and SIGHUP sent to the
    launcher are forwarded to the child's process group (a second one, or
    :data:`STOP_GRACE_S` without the child exiting, sends SIGKILL); once the child has
    exited the launcher says so in one line and dies of the same signal.

    With ``report``, the ranks' failure lines (each once) go to ``report["errors"]`` and
    torchrun's failure report to ``report["held"]``, not to the output (:func:`cmd_train`).
    """
    tail: list[str] = []
    env = dict(env, QSYNC_LAUNCHER_PID=str(os.getpid()))
    got: list[int] = []
    box: list[subprocess.Popen[str]] = []
    timers: list[threading.Timer] = []

    def forward(signum: int, frame: object) -> None:
        got.append(signum)
        if not box:
            return
        _signal_group(box[0], signal.SIGKILL if len(got) > 1 else signum)
        if len(got) == 1:
            t = threading.Timer(STOP_GRACE_S, _signal_group, (box[0], signal.SIGKILL))
            t.daemon = True
            t.start()
            timers.append(t)

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in FORWARDED:
            if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
                previous[sig] = signal.signal(sig, forward)

    def copy_lines(stream: Any) -> None:
        for line in stream:
            tail.append(line.rstrip("\n"))
            del tail[:-400]  # the failure summary is at the end
            if report is not None and sort_line(line, report):
                continue
            sys.stdout.write(line)
            sys.stdout.flush()

    try:
        argv = [sys.executable, "-c", _EXEC_WITH_PARENT_DEATH_SIGNAL, str(os.getpid()),
                *cmd]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=env, text=True, bufsize=1, start_new_session=True)
        box.append(proc)
        if got:  # a signal came before the child existed
            forward(got.pop(), None)
        reader = threading.Thread(target=copy_lines, args=(proc.stdout,), daemon=True)
        reader.start()
        rc = proc.wait()  # the signal handlers run while it waits
        # The output ends when the last holder of the pipe exits: normally with the child.
        # An orphaned grandchild must not keep the launcher alive (the rank's watchdog
        # stops it once the launcher is gone), so the pipe is left to it after a grace.
        reader.join(EOF_GRACE_S)
        if not reader.is_alive() and proc.stdout is not None:
            proc.stdout.close()
    finally:
        for t in timers:
            t.cancel()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if got:
        sig = got[0]
        sys.stdout.flush()
        sys.stderr.write(f"qsync-opt: train: stopped by {signal.Signals(sig).name}; "
                         f"torchrun and its ranks were stopped (exit code {rc})\n")
        sys.stderr.flush()
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)  # die of it, as the caller expects
    return rc, tail
