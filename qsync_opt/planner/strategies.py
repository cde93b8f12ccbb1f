"""The strategy search: the synchronisation, the gradient transport and the precisions
chosen together (``qsync-opt solve --allow ...``).

For every candidate of the allowed space (:mod:`qsync_opt.strategy.space`) the problem is
re-made with that candidate's communication: the transport prices each DDP bucket (fp16
sends half the bytes; under ``--comm-model netsim`` every bucket's time is the packet
simulator's, and a dlcp transport runs the simulator's bounded-loss priority queues at its
bound), and the sync mode is the replayer's sync model (Local SGD and QSR pay one
parameter average per round). The precision program then chooses precisions under that
candidate's own default target (the strong groups at their reference, no straggler), and
the replayer's makespan of its plan is the candidate's predicted step.

The chosen strategy is the one with the most predicted samples a second (for the
data-parallel candidates, whose global batch is the same, the shortest step; a pipeline is
one replica of its batch); ties (within :data:`TIE_REL`) go to the least degradation, then
to the strategy that changes training least
(:attr:`~qsync_opt.strategy.space.Candidate.risk_rank`).

**Pruning, exactly.** With the strong groups held at their reference, no plan of a
candidate steps faster than the strong groups alone at their reference under that
candidate's communication (:meth:`~qsync_opt.problem.program.AllocationProblem.no_straggler_replay_ms`:
every other group can only delay a bucket or the barrier). Candidates are solved in the
order of that bound, and one whose bound exceeds the best step found is not solved: it
cannot be chosen (data-parallel candidates share the global batch, so a longer step is
fewer samples a second). A pruned candidate may still have less degradation than the chosen one,
so the Pareto set is over the solved candidates; ``prune=False`` solves every candidate
(the whole frontier). Each solved candidate's step is checked against its bound; should a
step ever fall below it (a strong group not held), pruning stops for the rest of the search.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from qsync_opt.core.figures import new_figure, png_bytes
from qsync_opt.documents.io import atomic_write_bytes
from qsync_opt.documents.jobstrategy import PipelineStrategy, Strategy, StrategyPrediction
from qsync_opt.documents.schemas import Plan, SolveReport
from qsync_opt.netsim.cluster import CommModelSpec, parse_comm_model, transport_costs
from qsync_opt.planner.call import InfeasibleError, SolveTimeLimit
from qsync_opt.planner.risks import strategy_risks
from qsync_opt.problem.evaluator import Evaluation, evaluate
from qsync_opt.problem.plan import make_plan
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.replayer import PeriodicSync
from qsync_opt.replayer.syncmodel import sync_model_for
from qsync_opt.solvers import SolveOptions
from qsync_opt.strategy.modes import parse_transport
from qsync_opt.strategy.space import Candidate, StrategySpace, candidates

__all__ = ["StrategyRow", "StrategySearch", "candidate_problem", "plan_with_strategy",
           "plan_of", "plot_strategies", "search_strategies"]

#: Steps within this relative difference are a tie (broken by degradation, then risk).
TIE_REL = 1e-9
#: A solved step below its bound by more than this (relative) means the bound did not hold.
BOUND_SLACK = 1e-9


@dataclasses.dataclass
class StrategyRow:
    """One candidate: its bound, and (solved) its plan, report and evaluation; ``status``
    is ``solved``, ``pruned``, ``no plan`` or ``time limit``."""

    candidate: Candidate
    bound_ms: float
    status: str = "pending"
    plan: Plan | None = None
    report: SolveReport | None = None
    evaluation: Evaluation | None = None
    prediction: StrategyPrediction | None = None
    pareto: bool = False
    note: str = ""
    #: a pipeline candidate's stages, groups, cuts and micro-batches
    pipeline: PipelineStrategy | None = None

    @property
    def step_ms(self) -> float:
        return self.prediction.step_ms if self.prediction is not None else float("inf")

    @property
    def throughput(self) -> float:
        """Predicted samples a second (0 without a prediction)."""
        return self.prediction.samples_per_s if self.prediction is not None else 0.0

    @property
    def degradation(self) -> float:
        if self.prediction is not None and self.prediction.degradation is not None:
            return self.prediction.degradation
        ev = self.evaluation
        return ev.objective if ev is not None else float("inf")

    def to_json(self) -> dict[str, object]:
        return {"sync": self.candidate.sync, "transport": self.candidate.transport,
                "stages": self.candidate.stages, "bound_ms": self.bound_ms,
                "status": self.status, "pareto": self.pareto, "note": self.note,
                "predicted": (None if self.prediction is None
                              else self.prediction.model_dump(mode="json"))}


@dataclasses.dataclass
class StrategySearch:
    """The search's rows (in the order solved), the chosen row and its v2 plan."""

    rows: list[StrategyRow]
    chosen: StrategyRow
    plan: Plan
    space: StrategySpace
    comm_model: str
    wall_s: float

    @property
    def solved(self) -> int:
        return sum(r.status in ("solved", "no plan", "time limit") for r in self.rows)

    @property
    def pruned(self) -> int:
        return sum(r.status == "pruned" for r in self.rows)

    def to_json(self) -> dict[str, object]:
        return {"space": self.space.describe(), "comm_model": self.comm_model,
                "candidates": len(self.rows), "solved": self.solved, "pruned": self.pruned,
                "chosen": self.chosen.candidate.describe(), "wall_s": self.wall_s,
                "rows": [r.to_json() for r in self.rows]}


def candidate_problem(base: AllocationProblem, cand: Candidate, spec: CommModelSpec, *,
                      lr: float, lr_schedule: str, steps: int) -> AllocationProblem:
    """``base`` re-made with ``cand``'s communication (its costs' buckets and sync model);
    the graph, cluster, indicator and every other option are ``base``'s."""
    sync = sync_model_for(cand.sync, lr=lr, lr_schedule=lr_schedule, steps=steps)
    options = dataclasses.replace(base.options, sync=sync)
    costs = transport_costs(base.graph, base.cluster, base.costs, cand.transport, spec)
    return AllocationProblem(base.graph, base.cluster, costs, base.indicator, options,
                             schedules=base.schedules)


def _prediction(problem: AllocationProblem, ev: Evaluation, spec: CommModelSpec,
                cand: Candidate) -> StrategyPrediction:
    """The candidate's figures: the replayer's step, the slowest group's compute, what is
    left exposed of the communication, and the payload each rank hands to its collectives
    per step (DDP: every bucket, half of it under fp16; Local SGD and QSR: the FP32
    parameters once per round)."""
    compute = max((g.replay_compute_ms for g in ev.groups.values()), default=0.0)
    sync = problem.options.sync
    if isinstance(sync, PeriodicSync):
        per_step = sum(o.param_count for o in problem.graph.ops) * 4 / sync.mean_period
        syncs = 1.0 / sync.mean_period
    else:
        half = parse_transport(cand.transport).kind == "fp16"
        per_step = sum(b.bytes for b in problem.costs.buckets) * (0.5 if half else 1.0)
        syncs = 1.0
    return StrategyPrediction(
        step_ms=ev.replay_makespan_ms, compute_ms=compute,
        comm_ms=max(0.0, ev.replay_makespan_ms - compute), bytes_per_step=float(per_step),
        syncs_per_step=min(1.0, syncs), samples_per_s=ev.samples_per_s,
        degradation=ev.objective, comm_model=spec.describe())


SolveFn = Callable[[AllocationProblem, SolveOptions], tuple[Plan, SolveReport]]


def _solve_row(row: StrategyRow, problem: AllocationProblem, solve_fn: SolveFn,
               opts: SolveOptions, spec: CommModelSpec) -> None:
    try:
        plan, report = solve_fn(problem, opts)
    except InfeasibleError as exc:
        row.status, row.note = "no plan", str(exc).split("\n")[0]
        return
    except SolveTimeLimit:
        row.status, row.note = "time limit", "no plan within the time limit"
        return
    ev = evaluate(problem, plan)
    pred = _prediction(problem, ev, spec, row.candidate)
    row.status, row.plan, row.report, row.evaluation, row.prediction = (
        "solved", plan, report, ev, pred)


def _better(a: StrategyRow, b: StrategyRow | None) -> bool:
    """Whether ``a`` beats ``b``: more samples a second (a pipeline is one replica, so its
    global batch is not the data-parallel one's), then less degradation, then less risk."""
    if b is None:
        return True
    if a.throughput > b.throughput * (1 + TIE_REL):
        return True
    if a.throughput < b.throughput * (1 - TIE_REL):
        return False
    return (a.degradation, a.candidate.risk_rank) < (b.degradation, b.candidate.risk_rank)


def _mark_pareto(rows: list[StrategyRow]) -> None:
    solved = [r for r in rows if r.status == "solved"]
    for r in solved:
        r.pareto = not any(
            (o.throughput >= r.throughput and o.degradation <= r.degradation)
            and (o.throughput > r.throughput or o.degradation < r.degradation)
            for o in solved if o is not r)


def _bounded_rows(base: AllocationProblem, space: StrategySpace, spec: CommModelSpec,
                  sync_args: dict[str, object]
                  ) -> list[tuple[StrategyRow, AllocationProblem]]:
    """Every candidate's problem and bound, in the order of the bound (then risk)."""
    out = []
    for cand in candidates(space):
        if cand.stages != 1:
            continue  # predicted after the data-parallel candidates (pipeline_rows)
        sub = candidate_problem(base, cand, spec, **sync_args)  # type: ignore[arg-type]
        held = set(sub.held_groups) >= set(sub.strong_groups)
        bound = sub.no_straggler_replay_ms() if held else 0.0
        out.append((StrategyRow(cand, bound), sub))
    out.sort(key=lambda rs: (rs[0].bound_ms, rs[0].candidate.risk_rank))
    return out


def search_strategies(base: AllocationProblem, space: StrategySpace, solve_fn: SolveFn,
                      opts: SolveOptions, *, comm_model: str | None = None,
                      lr: float = 0.05, lr_schedule: str = "constant", steps: int = 100,
                      prune: bool = True) -> StrategySearch:
    """Search ``space`` (module docstring). ``solve_fn(problem, opts)``: one candidate's
    solve (:func:`qsync_opt.planner.solve.solve` with the command's solver and mode);
    ``opts.time_limit_s`` bounds the whole search, each candidate getting what is left."""
    t0 = time.perf_counter()
    spec = parse_comm_model(comm_model)
    pairs = _bounded_rows(base, space, spec,
                          {"lr": lr, "lr_schedule": lr_schedule, "steps": steps})
    best: StrategyRow | None = None
    bound_holds = True
    for row, sub in pairs:
        if prune and bound_holds and best is not None and \
                row.bound_ms > best.step_ms * (1 + TIE_REL):
            row.status = "pruned"
            row.note = (f"cannot step faster than {row.bound_ms:.3f} ms; "
                        f"{best.candidate.describe()} steps in {best.step_ms:.3f} ms")
            continue
        left = opts.time_limit_s - (time.perf_counter() - t0)
        if left <= 0:
            row.status, row.note = "time limit", "not started: the time limit ran out"
            continue
        _solve_row(row, sub, solve_fn, dataclasses.replace(opts, time_limit_s=left), spec)
        if row.status != "solved":
            continue
        if row.step_ms < row.bound_ms * (1 - BOUND_SLACK):
            bound_holds = False
        if _better(row, best):
            best = row
    rows = [r for r, _ in pairs]
    for row in pipeline_rows(base, space, rows):
        rows.append(row)
        if row.status == "solved" and _better(row, best):
            best = row
    if best is None or best.plan is None:
        raise InfeasibleError("no strategy of the allowed space has a plan: "
                              + "; ".join(f"{r.candidate.describe()}: {r.note}" for r in rows))
    _mark_pareto(rows)
    plan = plan_of(best, space)
    return StrategySearch(rows, best, plan, space, spec.describe(),
                          time.perf_counter() - t0)


def _stage_groups(base: AllocationProblem, stages: int) -> list[str] | None:
    """The groups of the first ``stages`` devices in the cluster's order (None: fewer)."""
    devices = [g.name for g in base.cluster.groups for _ in range(g.count)]
    return devices[:stages] if len(devices) >= stages else None


def pipeline_rows(base: AllocationProblem, space: StrategySpace,
                  rows: list[StrategyRow]) -> list[StrategyRow]:
    """The pipeline candidates, predicted (GPipe, :func:`qsync_opt.pipeline.predict.
    predict_pipeline`) at the precisions solved for ddp over fp32 (else fp32): stage ``k`` on
    the group of the cluster's ``k``-th device, cuts balanced, ``2 x stages`` micro-batches
    (at most the batch), each boundary over the cluster's inter-node link. A pipeline is one
    replica: its throughput is its batch over its step."""
    cands = [c for c in candidates(space) if c.stages > 1]
    if not cands:
        return []
    # lazy: a pipeline candidate builds the model (torch) to find its boundaries' tensors
    from qsync_opt.pipeline.predict import predict_pipeline

    ddp = next((r for r in rows if r.candidate == Candidate() and r.plan is not None), None)
    plan = ddp.plan if ddp is not None and ddp.plan is not None else make_plan(
        base.graph, base.cluster, {})
    batch = base.graph.batch_size
    out = []
    for cand in cands:
        groups = _stage_groups(base, cand.stages)
        row = StrategyRow(cand, 0.0)
        if groups is None or base.graph.workload_sha256 is not None:
            row.status = "no plan"
            row.note = ("a pipeline runs a registry workload" if groups is not None else
                        f"{cand.stages} stages need {cand.stages} devices")
            out.append(row)
            continue
        micro = min(batch, 2 * cand.stages)
        res = predict_pipeline(base.graph.workload, plan, groups, cuts=None, batch=batch,
                               micro_batches=micro, compress_act="none", compress_grad="none",
                               gbps=[base.cluster.inter_node_bandwidth_gb_per_s * 8],
                               latency_us=base.cluster.inter_node_latency_us)
        step = float(res["steps"][0]["uncompressed_ms"])
        compute = max(st["fwd_ms"] + st["bwd_ms"] for st in res["stages"]) * micro
        row.status, row.plan = "solved", plan
        row.evaluation = ddp.evaluation if ddp is not None else None
        row.pipeline = PipelineStrategy(stages=cand.stages, stage_groups=groups,
                                        cuts=list(res["cuts"]), micro_batches=micro)
        row.prediction = StrategyPrediction(
            step_ms=step, compute_ms=min(step, compute), comm_ms=max(0.0, step - compute),
            bytes_per_step=float(sum(b["raw_bytes"] for b in res["boundaries"]) * micro * 2),
            syncs_per_step=1.0, samples_per_s=batch / step * 1000.0 if step > 0 else 0.0,
            degradation=row.evaluation.objective if row.evaluation is not None else 0.0,
            comm_model=f"GPipe over {base.cluster.inter_node_bandwidth_gb_per_s:g} GB/s")
        row.note = f"{micro} micro-batches; the precisions solved for ddp / fp32"
        out.append(row)
    return out


def plan_of(row: StrategyRow, space: StrategySpace | None) -> Plan:
    """A solved candidate's plan as version 2: its strategy, prediction and risks (the
    search writes the chosen one's)."""
    assert row.plan is not None and row.prediction is not None
    strategy = Strategy(sync=row.candidate.sync, transport=row.candidate.transport,
                        pipeline=row.pipeline, predicted=row.prediction,
                        risks=strategy_risks(row.candidate),
                        space=None if space is None else space.describe())
    return row.plan.model_copy(update={"schema_version": 2, "strategy": strategy})


def plan_with_strategy(problem: AllocationProblem, plan: Plan, ev: Evaluation,
                       cand: Candidate, comm_model: str | None = None) -> Plan:
    """``plan`` (solved on ``problem``, made for ``cand``'s communication) as version 2,
    recording ``cand`` and what the planner predicted for it (``solve --sync MODE``)."""
    spec = parse_comm_model(comm_model)
    row = StrategyRow(cand, 0.0, "solved", plan, None, ev, _prediction(problem, ev, spec, cand))
    return plan_of(row, None)


def plot_strategies(search: StrategySearch, path: str, what: str = "--png") -> None:
    """The solved strategies' degradation against throughput (the Pareto set joined, the
    chosen one ringed), written atomically."""
    rows = [r for r in search.rows if r.prediction is not None]
    fig = new_figure((8, 5.2))
    ax = fig.add_subplot()
    for r in rows:
        assert r.prediction is not None
        ax.scatter([r.prediction.samples_per_s], [r.degradation],
                   color="tab:blue" if r.pareto else "tab:gray", zorder=3)
        ax.annotate(r.candidate.describe()[:28], (r.prediction.samples_per_s, r.degradation),
                    fontsize=7, xytext=(4, 4), textcoords="offset points")
    front = sorted((r for r in rows if r.pareto), key=lambda r: r.step_ms, reverse=True)
    ax.plot([r.prediction.samples_per_s for r in front if r.prediction is not None],
            [r.degradation for r in front], color="tab:blue", label="Pareto set (solved)")
    c = search.chosen
    if c.prediction is not None:
        ax.scatter([c.prediction.samples_per_s], [c.degradation], s=200, facecolors="none",
                   edgecolors="tab:red", label="chosen", zorder=4)
    ax.set_xlabel(f"throughput, samples/s (replayer; {search.comm_model})")
    ax.set_ylabel("degradation (sum of batch-weighted Omega)")
    ax.set_title(f"strategies: {search.solved} solved, {search.pruned} pruned")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    atomic_write_bytes(path, png_bytes(fig, tight=True), what=what)
