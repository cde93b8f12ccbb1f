"""The evaluator: how good a plan is, independent of the allocator that made it.

Every plan any backend returns is scored here (:func:`evaluate`): its objective, the
linear and the replayer's makespan, throughput, memory per group and every violated
constraint. A plan made for another batch split is scored on the problem re-made for that
split (kept per problem, so scoring many plans of the same split re-makes it once).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.documents.schemas import ClusterSpec, Plan
from qsync_opt.problem.plan import plan_graph_difference
from qsync_opt.problem.program import EVAL_TOL, AllocationProblem, ProblemOptions
from qsync_opt.replayer import Timeline


@dataclass
class GroupEvaluation:
    name: str
    device: str
    batch: int
    linear_ms: float
    replay_compute_ms: float
    degradation: float
    linear_memory_bytes: float
    replay_memory_bytes: int
    capacity_bytes: float
    fits: bool


@dataclass
class Evaluation:
    """How good a plan is, independent of the allocator that made it."""

    objective: float
    makespan_ms: float  # linear model
    replay_makespan_ms: float
    samples_per_s: float  # global batch / replayer makespan
    global_batch: int
    target_ms: float
    meets_target: bool  # linear model
    replay_meets_target: bool
    fits: bool
    groups: dict[str, GroupEvaluation]
    violations: list[str]
    timeline: Timeline | None = field(default=None, repr=False)

    @property
    def feasible(self) -> bool:
        return not self.violations

    def to_json(self) -> dict[str, Any]:
        return {
            "objective": self.objective, "makespan_ms": self.makespan_ms,
            "replay_makespan_ms": self.replay_makespan_ms, "samples_per_s": self.samples_per_s,
            "global_batch": self.global_batch, "target_ms": self.target_ms,
            "meets_target": self.meets_target, "replay_meets_target": self.replay_meets_target,
            "fits": self.fits, "feasible": self.feasible, "violations": self.violations,
            "groups": {n: g.__dict__ for n, g in self.groups.items()},
        }


def evaluate(problem: AllocationProblem, plan: Plan, *, target_ms: float | None = None
             ) -> Evaluation:
    """Score ``plan`` on ``problem``: objective, linear and replayer makespans, throughput,
    memory per group and every violated constraint.

    A plan whose cluster differs from the problem's (another batch split, groups left out)
    is scored on the problem re-made for that cluster (kept per cluster: a held group costs
what it costs free, and the target only decides ``meets_target``), against the same
target.
    """
    if plan.graph_hash != problem.graph.structure_hash():
        raise QsyncInputError(plan_graph_difference(plan, problem.graph))
    target = problem.target_ms if target_ms is None else target_ms
    prob = problem
    if _cluster_key(plan.cluster) != _cluster_key(problem.cluster):
        # No group held at its reference (any plan assigns) and no target (scores do not
        # depend on one: the target is compared below), so one re-made problem per
        # cluster serves every target.
        opts = ProblemOptions(**{**problem.options.to_json(), "target_ms": None,
                                 "strong_groups": None, "lower_reference": True})
        key = _cluster_key(plan.cluster) + json.dumps(opts.to_json(), sort_keys=True,
                                                      default=str)
        remade = problem.remade.get(key)
        if remade is None:
            remade = problem.remade[key] = problem.with_cluster(plan.cluster, opts)
        prob = remade
    a = prob.assignment(plan)
    tl = prob.replayer.simulate(plan, events=False)
    violations: list[str] = []
    groups: dict[str, GroupEvaluation] = {}
    for g in prob.groups:
        lin = g.time_ms(a[g.name])
        mem = g.memory_bytes(a[g.name])
        gt = tl.groups[g.name]
        fits = mem <= g.capacity_bytes * (1 + EVAL_TOL) and gt.peak_memory_bytes <= g.capacity_bytes * (1 + EVAL_TOL)
        if not fits:
            violations.append(
                f"{g.name}: memory {max(mem, gt.peak_memory_bytes) / 2**30:.2f} GiB exceeds "
                f"{g.capacity_bytes / 2**30:.2f} GiB")
        groups[g.name] = GroupEvaluation(
            name=g.name, device=g.device, batch=g.batch, linear_ms=lin,
            replay_compute_ms=gt.compute_ms, degradation=g.degradation(a[g.name]),
            linear_memory_bytes=mem, replay_memory_bytes=gt.peak_memory_bytes,
            capacity_bytes=g.capacity_bytes, fits=fits)
    makespan = prob.makespan_ms(a)
    meets = makespan <= target * (1 + EVAL_TOL)
    if not meets:
        violations.append(f"linear makespan {makespan:.3f} ms exceeds the target {target:.3f} ms")
    replay = tl.iteration_ms
    return Evaluation(
        objective=prob.objective(a), makespan_ms=makespan, replay_makespan_ms=replay,
        samples_per_s=prob.global_batch / replay * 1e3 if replay > 0 else float("inf"),
        global_batch=prob.global_batch, target_ms=target, meets_target=meets,
        replay_meets_target=replay <= target * (1 + EVAL_TOL),
        fits=all(g.fits for g in groups.values()), groups=groups, violations=violations,
        timeline=tl)


def _cluster_key(cluster: ClusterSpec) -> str:
    return json.dumps([(g.name, g.device, g.count, g.batch_per_device) for g in cluster.groups])
