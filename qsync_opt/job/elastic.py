"""An elastic run's rank: one world of the groups present, from its checkpoint to its end.

Each torchrun elastic agent runs one device group's ranks (``QSYNC_NODE_GROUP`` in its
environment). Every time the groups present change, the agents restart their ranks and each
rank runs :func:`run_elastic` once, for the world that formed:

1. **Who is here.** The ranks swap their node's group, local rank and device through the
   world's store (rank 0 of the rendezvous hosts it) and order themselves by the plan's
   group order, then local rank: the *logical* rank every rank-indexed thing uses (the
   batch slice, the per-rank RNG, the metrics file). So a world of the same groups is laid
   out the same whatever order the agents joined in, and a replay is bit-exact. A node that
   came back with another device than its group left with is refused by name (it leaves;
   the others restart without it).
2. **Re-plan.** Logical rank 0 re-solves the plan for the groups present at the same
   global batch (the problem built once at launch and cached in the run's folder: only the
   solve runs) and hands the plan to the others through the store. One rank solves and
   broadcasts, rather than every rank solving the same problem, so that every rank runs
   the same plan even where a solver's answer depends on time limits or the machine; the
   other ranks' CPUs stay free. A plan that cannot fit the groups present stops the run
   (every rank exits 0, the checkpoint untouched, a ``stop`` event naming what lacks).
3. **Resume.** The newest complete checkpoint set is loaded even when another world wrote
   it: under ddp every replica's weights and optimizer state are equal, so each rank takes
   them from the old world's rank 0; a rank whose (group, local rank) ran in the old world
   keeps that replica's RNG and quantisation seeds, others get them derived from (seed,
   step, logical rank) (:func:`derived_rng`). The global batch, the learning-rate
   schedule and the step counter carry on.
4. **Train**, asking at every step boundary whether the world ends there
   (:meth:`ElasticTrainer.at_boundary`): a graceful leave asked in ``OUT/leave/GROUP``, a
   SIGTERM from the agent (its node leaves, or a new node waits to join), a scheduled
   return. Then every rank saves that step's checkpoint (zero steps lost), the leaving
   group's ranks stop their agent and exit, the others exit with
   :data:`~qsync_opt.runtime.membership.RESTART_EXIT_CODE` and their agents restart them
   into the next world. A peer that dies (its collective fails) ends the world too: the
   next one resumes from the last checkpoint and counts the steps lost.

Events (``OUT/events.jsonl``, written by logical rank 0): ``world`` at each start,
``membership`` after the first step of a changed world, ``checkpoint`` at each commit,
``stop`` at the end. The re-plan is given as a function (:data:`Replanner`): the planner
sits above the training packages, and its entry (:mod:`qsync_opt.cli.elastic`) hands it in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from qsync_opt.core.errors import QsyncInputError, one_line
from qsync_opt.documents.io import to_json
from qsync_opt.documents.outfolder import write_text
from qsync_opt.documents.schemas import Plan
from qsync_opt.job.online import OnlineControl, ReplannerFactory
from qsync_opt.job.rank import backend_and_device
from qsync_opt.job.steps import Trainer, TrainingError
from qsync_opt.ops import load_cpu
from qsync_opt.runtime.checkpoint import load_checkpoint, qseeds, replica_entry, set_qseeds
from qsync_opt.runtime.config import CheckpointSet, TrainConfig
from qsync_opt.runtime.emulate import SlowdownHooks, add_slowdown
from qsync_opt.runtime.events import EventLog
from qsync_opt.runtime.faults import DIE_EXIT_CODE, NO_FAULTS, FaultPlan
from qsync_opt.runtime.membership import (
    CRASH_AT_ENV,
    DIE_IN_REPLAN_ENV,
    ELASTIC_DIR,
    FAULT_FIRED,
    NODE_DEVICE_ENV,
    NODE_GROUP_ENV,
    RESTART_EXIT_CODE,
    WARM_STEPS,
    ElasticSpec,
    checkpoint_interval,
    leave_requests,
    read_spec,
    read_world,
    remove_leave,
    take_exits,
    write_exit,
    write_stop,
    write_world,
)
from qsync_opt.runtime.metrics import clean, write_json
from qsync_opt.runtime.prepare import Setup, build_model, prepare
from qsync_opt.sync.replicas import GradientSync, make_sync

__all__ = ["ElasticTrainer", "Node", "Replanner", "WorldPlan", "world_plan",
           "derived_rng", "logical_order", "run_elastic"]

_KEY = "qsync/elastic"


@dataclass(frozen=True)
class WorldPlan:
    """A re-plan's answer: the plan for the groups present and its predicted step time
    (whole and per group, ms), how long the solve took and what it changed."""

    plan: Plan
    predicted_step_ms: float | None
    predicted_group_ms: dict[str, float] = field(default_factory=dict)
    solve_s: float = 0.0
    changes: list[str] = field(default_factory=list)


#: (groups present in plan order, global batch) -> the world's plan; raises
#: QsyncInputError naming the group and what it lacks when no plan fits.
Replanner = Callable[[list[str], int], WorldPlan]


@dataclass(frozen=True)
class Node:
    """One rank as the rendezvous numbered it: its agent's group, local rank, device."""

    rank: int
    group: str
    local: int
    device: str


def logical_order(nodes: list[Node], groups: list[str]) -> list[Node]:
    """The ranks in logical order: the plan's group order, then local rank, then the
    rendezvous rank (ties only between two agents of one group)."""
    pos = {g: i for i, g in enumerate(groups)}
    return sorted(nodes, key=lambda n: (pos.get(n.group, len(pos)), n.local, n.rank))


def _seed_of(*parts: object) -> int:
    text = ":".join(str(p) for p in parts)
    return int(hashlib.sha256(text.encode()).hexdigest()[:12], 16)


def derived_rng(seed: int, step: int, rank: int) -> torch.Tensor:
    """A rank's torch RNG state in a world that starts at ``step`` from a checkpoint of
    another world, where no replica of its place existed: a function of the three only."""
    g = torch.Generator()
    g.manual_seed(_seed_of("rng", seed, step, rank))
    return g.get_state()


def _derived_qseeds(model: torch.nn.Module, seed: int, step: int, rank: int) -> None:
    set_qseeds(model, {n: _seed_of("q", seed, step, rank, n) & 0x7FFFFFFF
                       for n in qseeds(model)})


# ----------------------------------------------------------------------------- the store


def _world_store(rank: int, world: int, timeout_s: float) -> dist.Store:
    """The world's store: a TCPStore at the agent's MASTER_ADDR:MASTER_PORT, hosted by the
    rendezvous's rank 0 (the agents run with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a fresh
    port every round, nothing left over from the last world)."""
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    use_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world, is_master=rank == 0 and not use_agent,
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return dist.PrefixStore(f"{_KEY}/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}", store)


def _swap_nodes(store: dist.Store, me: Node, world: int) -> list[Node]:
    store.set(f"node/{me.rank}", json.dumps([me.group, me.local, me.device]))
    out = []
    for r in range(world):
        g, local, dev = json.loads(store.get(f"node/{r}"))
        out.append(Node(r, str(g), int(local), str(dev)))
    _all_read(store, "nodes-read", me.rank, world)
    return out


def _all_read(store: dist.Store, key: str, rank: int, world: int,
              timeout_s: float = 120.0) -> None:
    """Every rank has read what it needed from the store before its host (the rendezvous's
    rank 0) may go: a world that ends at once (a node refused, no plan) must not take the
    store from a rank still reading it."""
    store.add(key, 1)
    if rank != 0:
        return
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < world and time.monotonic() < deadline:
        time.sleep(0.02)


# ----------------------------------------------------------------------------- the trainer


class ElasticTrainer(Trainer):
    """The step loop of one world of an elastic run (module docstring): the checkpoint
    mapped across worlds, the boundary checks, the events."""

    def __init__(self, setup: Setup, ranks: list[int], models: list[torch.nn.Module],
                 sync: GradientSync, device: torch.device, *, spec: ElasticSpec,
                 world_plan: WorldPlan, events: EventLog | None, faults: FaultPlan = NO_FAULTS,
                 log_state_hash: bool = False) -> None:
        super().__init__(setup, ranks, models, sync, device, faults=faults,
                         log_state_hash=log_state_hash)
        self.spec, self.world_plan, self.events = spec, world_plan, events
        self.group = self.cfg.rank_groups[self.ranks[0]]
        self.present = list(dict.fromkeys(self.cfg.rank_groups))
        self.stop_asked = False  # SIGTERM: the agent stops this rank
        self.leaving: list[str] = []
        self.reason = ""
        self.started = time.time()
        self.boundary_times: list[float] = []
        self.start_step = 0
        self.previous = read_world(self.out) if events is not None else None
        self.exits: list[dict[str, Any]] = []
        self.crash_at = _int_env(CRASH_AT_ENV)

    # -- resuming across worlds
    def restore(self, cs: CheckpointSet) -> None:
        old_groups: list[str] = list(cs.run.get("rank_groups") or [])
        if old_groups == self.cfg.rank_groups:
            super().restore(cs)  # the same world: every rank its own file
            return
        old = [(g, old_groups[:i].count(g)) for i, g in enumerate(old_groups)]
        for i, (r, m, opt) in enumerate(zip(self.ranks, self.models, self.opts, strict=True)):
            g = self.cfg.rank_groups[r]
            place = (g, self.cfg.rank_groups[:r].count(g))
            same = old.index(place) if place in old else None
            ck = load_checkpoint(cs.rank_file(0), "train", follow=False)
            if int(ck["step"]) != cs.step:
                raise TrainingError(f"{cs.rank_file(0)}: not the checkpoint of step {cs.step}")
            m.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optimizer"])
            self.scalers[i].load_state_dict(ck)
            rep = None
            if same is not None:
                mine = load_checkpoint(cs.rank_file(same), "train", follow=False)
                rep = replica_entry(mine, same)
            if rep is not None:
                set_qseeds(m, rep["qseeds"])
                self.rngs[i] = rep["rng"]
            else:
                _derived_qseeds(m, self.cfg.seed, cs.step, r)
                self.rngs[i] = derived_rng(self.cfg.seed, cs.step, r)
            if i == 0:
                self.step = int(ck["step"])
                self.bad_run, self.skipped = int(ck["bad_run"]), int(ck["skipped"])
                self.last_loss = float(ck["last_loss"])

    def begin(self) -> int:
        start = super().begin()
        self.start_step = start
        if self.events is not None:
            self.exits = take_exits(self.out)
            wp = self.world_plan
            self.events.write("world", start, groups=self.present,
                              world_size=self.cfg.world_size, plan=self.cfg.plan_path,
                              predicted_step_ms=wp.predicted_step_ms,
                              predicted_group_ms=wp.predicted_group_ms, resumed_from=start,
                              solve_s=wp.solve_s, plan_changes=wp.changes)
            write_world(self.out, {"groups": self.present, "start": start,
                                   "predicted_step_ms": wp.predicted_step_ms,
                                   "time": self.started})
        return start

    def committed(self, folder: Path) -> None:
        if self.events is not None:
            self.events.write("checkpoint", self.step, path=str(folder),
                              world=self.present)

    # -- the boundary
    def at_boundary(self) -> bool:
        now = time.time()
        self.boundary_times.append(now)
        done = self.step - self.start_step
        if done == 1 and self.events is not None:
            self._membership_event(now)
        if done == WARM_STEPS and self.spec.checkpoint_every == 0:
            self._choose_interval()
        if self.crash_at is not None and self.step == self.crash_at:
            # the record first: the next world counts the lost steps and the time from here
            write_exit(self.out, 20_000 + self.ranks[0], self.step, "crash (membership "
                       "switch: the agent killed)", self.present)
            _crash_node()
        return self._world_ends()

    def _world_ends(self) -> bool:
        """Every rank's flags summed: a SIGTERM, a leave asked (per group), a scheduled
        return of a group not here; the world ends at this boundary when any is set."""
        groups = self.spec.groups
        asked = leave_requests(self.out, groups)
        flags = torch.zeros(1 + len(groups), dtype=torch.float64)
        flags[0] = float(self.stop_asked)
        at = asked.get(self.group, -1)
        if self.group in asked and (at is None or at <= self.step):
            flags[1 + groups.index(self.group)] = 1.0
        t = flags.to(self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        flags = t.cpu()
        self.leaving = [g for i, g in enumerate(groups) if flags[1 + i] > 0]
        joins = [c.group for c in self.spec.changes()
                 if not c.leave and c.step == self.step and c.group not in self.present]
        if flags[0] > 0:
            self.reason = "the agent stops its ranks (a node leaves or waits to join)"
        elif self.leaving:
            self.reason = f"graceful leave of {', '.join(self.leaving)}"
        elif joins and self.step > self.start_step:
            self.reason = f"return of {', '.join(joins)}"
        else:
            return False
        return True

    def _choose_interval(self) -> None:
        """The checkpoint interval from the measured step time (the slowest rank's mean over
        the warm steps, the first step left out) so a crash loses at most max_lost_s."""
        ts = self.boundary_times
        step_s = (ts[-1] - ts[1]) / max(1, len(ts) - 2)
        t = torch.tensor([step_s], dtype=torch.float64).to(self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        step_s = float(t.cpu()[0])
        self.checkpoint_every = checkpoint_interval(step_s, self.spec.max_lost_s)
        if self.events is not None:
            sys.stdout.write(f"qsync-opt: elastic: checkpoint every {self.checkpoint_every} "
                             f"step(s) (measured {step_s * 1e3:.0f} ms a step; at most "
                             f"{self.spec.max_lost_s:g} s of work lost to a crash)\n")
            sys.stdout.flush()

    def _membership_event(self, now: float) -> None:
        prev = self.previous
        if prev is None:
            return
        exits = self.exits
        noticed = min((float(e["time"]) for e in exits), default=None)
        reached = max((int(e["step"]) for e in exits), default=self.start_step)
        self.events.write(  # type: ignore[union-attr]
            "membership", self.start_step, old_groups=prev.get("groups"),
            new_groups=self.present, old_predicted_ms=prev.get("predicted_step_ms"),
            new_predicted_ms=self.world_plan.predicted_step_ms,
            change_to_first_step_s=(round(now - noticed, 3) if noticed is not None else None),
            lost_steps=max(0, reached - self.start_step),
            reasons=sorted({str(e.get("reason")) for e in exits}))


def _int_env(name: str) -> int | None:
    text = os.environ.get(name, "").strip()
    return int(text) if text.isdigit() else None


def _crash_node() -> None:
    """The membership switch's crash: the agent dies by SIGKILL, then this rank."""
    sys.stdout.flush()
    try:
        os.kill(os.getppid(), signal.SIGKILL)
    finally:
        os._exit(DIE_EXIT_CODE)


# ----------------------------------------------------------------------------- one world


def run_elastic(config: TrainConfig, replan: Replanner, faults: FaultPlan | None = None,
                online: ReplannerFactory | None = None) -> int:
    """This rank's part of the world that formed (module docstring); the exit code: 0
    (done, or this group left, or the run stopped), RESTART_EXIT_CODE (into the next
    world). ``online``: the planner's side of ``--replan auto`` inside each world
    (:mod:`qsync_opt.job.online`; a membership change re-plans from the cache afresh)."""
    faults = _once(config.out_dir, FaultPlan.from_env() if faults is None else faults)
    spec = read_spec(config.out_dir)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    group = os.environ.get(NODE_GROUP_ENV, "")
    if group not in spec.groups:
        raise QsyncInputError(f"{NODE_GROUP_ENV}: {group!r} is not a group of the run "
                              f"({', '.join(spec.groups)})")
    me = Node(rank, group, int(os.environ.get("LOCAL_RANK", "0")),
              os.environ.get(NODE_DEVICE_ENV) or spec.devices[group])
    store = _world_store(rank, world, config.timeout_s)
    nodes = logical_order(_swap_nodes(store, me, world), spec.groups)
    refused = [n for n in nodes if n.device != spec.devices[n.group]]
    if refused:
        return _refuse(config, spec, me, refused)
    logical = nodes.index(me)
    rank_groups = [n.group for n in nodes]
    wp = world_plan(store, config, spec, rank_groups, logical, replan)
    if wp is None:
        return 0  # no plan fits: stopped (rank 0 wrote why)
    cfg = config.model_copy(update={
        "rank_groups": rank_groups, "plan_path": _plan_file(config, wp, rank_groups),
        "slowdown": {g: f for g, f in config.slowdown.items() if g in rank_groups}})
    setup: Setup = prepare(cfg)
    load_cpu()  # before any collective: a build never holds up the world
    backend, device = backend_and_device(cfg, setup, logical, me.local)
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=logical,
                            world_size=world, timeout=timedelta(seconds=config.timeout_s))
    try:
        return _train_world(setup, spec, wp, logical, device, faults, online)
    finally:
        dist.destroy_process_group()


def _fired(out: str) -> bool:
    return (Path(out) / ELASTIC_DIR / FAULT_FIRED).exists()


def _fire(out: str, code: int) -> None:
    """An injected fault strikes: marked in the run's folder first (once per run)."""
    write_text(out, Path(ELASTIC_DIR, FAULT_FIRED), f"{code}\n")
    sys.stdout.flush()
    os._exit(code)


def _once(out: str, faults: FaultPlan) -> FaultPlan:
    """The test faults of an elastic run strike once per run: after one fired, the
    restarted ranks run without them (else the same fault would end every world)."""
    if faults.empty or _fired(out):
        return NO_FAULTS
    return dataclasses.replace(faults, exit=lambda code: _fire(out, code))


def _refuse(config: TrainConfig, spec: ElasticSpec, me: Node, refused: list[Node]) -> int:
    """A node whose device is not its group's: it leaves (its agent stopped), the others
    restart without it; the run says which and why."""
    bad = refused[0]
    line = (f"qsync-opt: elastic: group {bad.group} returned with device {bad.device}, it "
            f"left with {spec.devices[bad.group]}: refused (its plan, costs and memory were "
            "made for the other card); the run goes on without it")
    if me in refused:
        sys.stderr.write(line + "\n")
        write_exit(config.out_dir, 10_000 + me.rank, 0, "refused: " + line, [me.group])
        if me.local == 0:  # one signal: the agent stops all its ranks
            _stop_own_agent()
        return 0
    return RESTART_EXIT_CODE


def _stop_own_agent() -> None:
    try:
        os.kill(os.getppid(), signal.SIGTERM)
    except OSError:
        pass


def world_plan(store: dist.Store, config: TrainConfig, spec: ElasticSpec,
                rank_groups: list[str], logical: int, replan: Replanner) -> WorldPlan | None:
    """Logical rank 0 solves and sets the answer in the store; every rank reads it. No plan:
    rank 0 writes the ``stop`` event, every rank returns None."""
    present = list(dict.fromkeys(rank_groups))
    if logical == 0:
        try:
            wp = replan(present, _global_batch(config))
            if (os.environ.get(DIE_IN_REPLAN_ENV) == "1" and present != spec.groups
                    and not _fired(config.out_dir)):
                _fire(config.out_dir, DIE_EXIT_CODE)  # test hook: a kill in the re-plan
            doc = {"plan": json.loads(to_json(wp.plan)), "predicted_step_ms": wp.predicted_step_ms,
                   "predicted_group_ms": wp.predicted_group_ms, "solve_s": wp.solve_s,
                   "changes": wp.changes}
        except QsyncInputError as exc:
            doc = {"error": one_line(str(exc))}
        store.set("plan", json.dumps(doc))
    doc = json.loads(store.get("plan"))
    _all_read(store, "plan-read", int(os.environ.get("RANK", "0")),
              int(os.environ.get("WORLD_SIZE", "1")))
    if "error" in doc:
        if logical == 0:
            _stop_for(config, f"no plan fits the groups present ({', '.join(present)}): "
                              f"{doc['error']}")
        return None
    return WorldPlan(Plan.model_validate(doc["plan"]), doc["predicted_step_ms"],
                     doc["predicted_group_ms"], doc["solve_s"], doc["changes"])


def _global_batch(config: TrainConfig) -> int:
    plan = Plan.load(config.plan_path)
    return sum(plan.groups[g].batch_per_device for g in config.rank_groups)


def _plan_file(config: TrainConfig, wp: WorldPlan, rank_groups: list[str]) -> str:
    """The world's plan, written by every rank to the same path (same bytes, atomically)."""
    key = hashlib.sha256(to_json(wp.plan).encode()).hexdigest()[:12]
    rel = Path(ELASTIC_DIR, f"plan-{key}.json")
    write_text(config.out_dir, rel, to_json(wp.plan))
    return str(Path(config.out_dir, rel))


def _stop_for(config: TrainConfig, reason: str) -> None:
    cs = write_stop(config.out_dir, reason)
    sys.stderr.write(f"qsync-opt: elastic: stopped: {reason}; the checkpoint "
                     f"{cs.path if cs else '(none)'} is intact\n")


def _train_world(setup: Setup, spec: ElasticSpec, wp: WorldPlan, logical: int,
                 device: torch.device, faults: FaultPlan,
                 online: ReplannerFactory | None) -> int:
    cfg = setup.config
    model = build_model(setup, logical, device)
    group = cfg.rank_groups[logical]
    slowdown = add_slowdown(model, cfg.slowdown.get(group, 1.0))
    if slowdown is None and cfg.online is not None:
        slowdown = SlowdownHooks(model, 1.0)  # a re-plan reads its own compute there
    sync = make_sync(cfg, cfg.world_size, device, emulated=False, cluster=setup.plan.cluster,
                     setup=setup)
    events = EventLog(cfg.out_dir) if logical == 0 else None
    tr = ElasticTrainer(setup, [logical], [model], sync, device, faults=faults,
                        log_state_hash=os.environ.get("QSYNC_LOG_STATE_HASH") == "1",
                        spec=spec, world_plan=wp, events=events)
    if cfg.online is not None:
        tr.online = OnlineControl(tr, [slowdown], online)
    signal.signal(signal.SIGTERM, lambda *_: setattr(tr, "stop_asked", True))
    try:
        res = tr.train(show_progress=logical == 0)
    except Exception as exc:  # a peer died: this world ends, the next resumes
        write_exit(cfg.out_dir, logical, tr.step, f"{type(exc).__name__}: "
                   f"{one_line(str(exc))[:200]}", tr.present)
        raise
    finally:
        del slowdown
    if tr.left:
        write_exit(cfg.out_dir, logical, tr.step, tr.reason, tr.present)
        if tr.group in tr.leaving:
            remove_leave(cfg.out_dir, tr.group)
            if os.environ.get("LOCAL_RANK", "0") == "0":  # one signal: the agent stops all
                _stop_own_agent()
            return 0
        return RESTART_EXIT_CODE
    summary = clean(tr.summary(res["state_sha256"], [res["evals"][logical]], res["wall_s"],
                               res["resumed_from"]))
    summary.update(rank=logical, checkpoint_every=tr.checkpoint_every,
                   max_lost_s=spec.max_lost_s)
    write_json(Path(cfg.out_dir) / f"summary.rank{logical}.json", summary)
    if events is not None:
        write_json(Path(cfg.out_dir) / "summary.json", summary)
        events.write("stop", tr.step, reason="done",
                     checkpoint=str(Path(cfg.out_dir, "ckpt", f"step-{tr.step:08d}")))
        events.close()
    dist.barrier()
    return 0
