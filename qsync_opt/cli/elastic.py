"""``qsync-opt train --elastic``: the launch (the re-plan cache, the spec, the agents) and the
ranks' entry under the agents, ``python -m qsync_opt.cli.elastic CONFIG``.

Both sit here, above the planner and the training packages, because they join the two: the
launcher builds the re-plan problem once (:class:`~qsync_opt.planner.replan.ReplanCache`,
saved in ``OUT/elastic/replan_cache.json``), and every world's logical rank 0 loads it and
re-solves for the groups present (:func:`replanner`), handing the answer to
:func:`qsync_opt.job.elastic.run_elastic`. The launch itself is
:mod:`qsync_opt.job.elastic_launch`; the behaviour is docs/ELASTIC.md.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import cast

from qsync_opt.cli.replanning import CACHE_NAME
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.documents.outfolder import read_bytes
from qsync_opt.documents.schemas import Plan
from qsync_opt.job import elastic_launch
from qsync_opt.job.elastic import Replanner, WorldPlan, run_elastic
from qsync_opt.job.launch import free_port
from qsync_opt.job.online import Replanner as OnlineReplanner
from qsync_opt.job.rank import rank_entry
from qsync_opt.ops import load_cpu
from qsync_opt.planner.replan import ReplanCache
from qsync_opt.runtime.config import TrainConfig
from qsync_opt.runtime.events import read_events
from qsync_opt.runtime.faults import FaultPlan
from qsync_opt.runtime.membership import (
    ELASTIC_DIR,
    WARM_STEPS,
    ElasticSpec,
    parse_membership,
    read_spec,
    reset_run_state,
    write_spec,
)

__all__ = ["cmd_elastic", "elastic_spec", "last_world", "main", "replanner",
           "summary_line"]



def elastic_spec(args: argparse.Namespace, config: TrainConfig, plan: Plan) -> ElasticSpec:
    """The spec of an elastic run from its flags and plan: one agent per group, each with
    as many ranks as the plan gives the group devices (a re-plan splits the global batch
    over devices); ``--membership`` checked against the groups and ``--steps``."""
    groups = [g.name for g in plan.cluster.groups if g.name in config.rank_groups]
    ranks = {g: config.rank_groups.count(g) for g in groups}
    for g in plan.cluster.groups:
        if g.name in ranks and ranks[g.name] != g.count:
            raise QsyncInputError(
                f"--elastic: group {g.name} has {g.count} device(s) in the plan but the run "
                f"gives it {ranks[g.name]} rank(s); an elastic run needs one rank per device "
                "(a re-plan splits the global batch over the devices present)")
    if config.link is not None:
        raise QsyncInputError("--emulate-link: not with --elastic (the ranks change with "
                              "every world)")
    text = getattr(args, "membership", None)
    changes = parse_membership(text, groups, config.steps) if text else ()
    return ElasticSpec(
        groups=groups, ranks=ranks,
        devices={g.name: g.device for g in plan.cluster.groups if g.name in ranks},
        max_lost_s=args.max_lost_s, checkpoint_every=config.checkpoint_every,
        membership=[c.text() for c in changes], all_gone_s=args.all_gone_timeout,
        replan_cache=str(Path(config.out_dir, ELASTIC_DIR, CACHE_NAME)))


def cmd_elastic(args: argparse.Namespace, config: TrainConfig, config_path: Path,
                spec: ElasticSpec) -> int:
    """Build the re-plan cache and the spec, then print the per-machine commands
    (``--print-command``), the local agents' commands (``--dry-run``), or run the agents
    here and play ``--membership``."""
    plan = Plan.load(config.plan_path)
    run_id = f"qsync-{secrets.token_hex(4)}"
    if args.print_command:
        endpoint = args.rdzv_endpoint or "HOST0:29400"
        cache = _replan_cache(plan, config)  # bad input refused before anything is printed
        sys.stdout.write("\n".join(elastic_launch.cluster_commands(
            spec, config_path, run_id, args.max_restarts, endpoint)) + "\n")
        write_spec(config.out_dir, spec)
        reset_run_state(config.out_dir, spec.groups)
        cache.save(spec.replan_cache)
        return 0
    endpoint = f"127.0.0.1:{free_port()}"
    if args.dry_run:
        for g in spec.groups:
            cmd = elastic_launch.agent_command(config_path, spec.ranks[g], endpoint, run_id,
                                               len(spec.groups), args.max_restarts)
            sys.stdout.write(f"QSYNC_NODE_GROUP={shlex.quote(g)} "
                             + " ".join(shlex.quote(c) for c in cmd) + "\n")
        return 0
    _replan_cache(plan, config).save(spec.replan_cache)
    write_spec(config.out_dir, spec)
    reset_run_state(config.out_dir, spec.groups)
    every = ("every " + str(spec.checkpoint_every) + " step(s) (--checkpoint-every)"
             if spec.checkpoint_every else
             f"chosen from the measured step time so a crash loses at most "
             f"{spec.max_lost_s:g} s of work (--max-lost-s)")
    sys.stdout.write(f"elastic: {len(spec.groups)} agent(s) ({', '.join(spec.groups)}), "
                     f"rendezvous {endpoint} id {run_id}; checkpoints {every}\n")
    load_cpu()  # compile the C++ kernels once here, not in every rank at once
    env = dict(os.environ, QSYNC_LAUNCHER_PID=str(os.getpid()))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    store = elastic_launch.host_store(endpoint)
    agents = elastic_launch.Agents(spec, config_path, endpoint, run_id, args.max_restarts, env)
    try:
        rc, reason = elastic_launch.run_local(agents, Path(config.out_dir), spec.changes())
    finally:
        agents.stop_all(15)
        del store
    if rc != 0:
        sys.stderr.write(f"qsync-opt: train: elastic run stopped: {reason}\n")
    return rc


def last_world(config: TrainConfig) -> TrainConfig:
    """The config as the last world ran it (its ranks' groups, from ``summary.json``), for
    the summary line; the launch config when there is no summary."""
    try:
        data = read_bytes(config.out_dir, "summary.json")
        doc = json.loads(data) if data is not None else None
    except (OSError, ValueError, RecursionError, QsyncInputError):
        return config
    groups = doc.get("rank_groups") if isinstance(doc, dict) else None
    if isinstance(groups, list) and groups and all(isinstance(g, str) for g in groups):
        return config.model_copy(update={"rank_groups": groups})
    return config


def summary_line(config: TrainConfig) -> str | None:
    """After a finished elastic run: its changes, the steps they lost, the checkpoint
    interval and why (from ``summary.json`` and the events); None without a summary."""
    try:
        data = read_bytes(config.out_dir, "summary.json")
        doc = json.loads(data) if data is not None else None
    except (OSError, ValueError, RecursionError, QsyncInputError):
        return None
    if not isinstance(doc, dict):
        return None
    changes = [e for e in read_events(config.out_dir) if e["kind"] == "membership"]
    lost = sum(int(e.get("lost_steps") or 0) for e in changes)
    every, budget = doc.get("checkpoint_every"), doc.get("max_lost_s")
    if config.checkpoint_every:
        interval = f"a checkpoint every {every} step(s) (--checkpoint-every)"
    elif every:
        interval = (f"a checkpoint every {every} step(s) (chosen from the last world's "
                    f"measured step time: at most {budget:g} s of work lost to a crash)")
    else:
        interval = (f"no checkpoint interval chosen in the last world (it ran fewer than "
                    f"{WARM_STEPS} steps; its end was checkpointed)")
    return (f"  elastic: {len(changes)} membership change(s), {lost} step(s) lost; "
            f"{interval}; the story: {config.out_dir}/events.jsonl")


def _replan_cache(plan: Plan, config: TrainConfig) -> ReplanCache:
    """The run's re-plan problem, built once (with ``--replan-indicator``'s table, if given)."""
    online = config.online
    return ReplanCache.build(plan, config.workload,
                             indicator=online.indicator if online is not None else None)


def replanner(cache: ReplanCache, launch_plan: Plan) -> Replanner:
    """The re-plan the ranks call: every group present runs the launch plan as given;
    fewer are re-solved at the global batch (QsyncInputError when none fits)."""
    every = [g.name for g in launch_plan.cluster.groups]

    def replan(groups: list[str], global_batch: int) -> WorldPlan:
        if groups == every:
            step, per_group = cache.predict(launch_plan, {})
            return WorldPlan(launch_plan, step, per_group, 0.0, ["the launch plan"])
        r = cache.replan(groups, {}, global_batch)
        return WorldPlan(r.plan, r.predicted_step_ms, dict(r.predicted_group_ms), r.solve_s,
                         list(r.changes))

    return replan


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m qsync_opt.cli.elastic CONFIG.json``: one rank of one world (under a
    torchrun elastic agent); 2 and one line on bad input."""
    def body(config: TrainConfig, faults: FaultPlan) -> int:
        cache = ReplanCache.load(read_spec(config.out_dir).replan_cache)
        return run_elastic(config, replanner(cache, Plan.load(config.plan_path)), faults,
                           online=lambda cfg, plan: cast(OnlineReplanner, cache))

    # a failure other than bad input: a peer died or the world broke; the agent restarts us
    return rank_entry(argv, "qsync_opt.cli.elastic", body, cut=300)


if __name__ == "__main__":
    sys.exit(main())
