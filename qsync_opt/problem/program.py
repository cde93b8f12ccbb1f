"""The allocation problem: the one input every allocator and the evaluator read.

:class:`AllocationProblem` turns a graph, a cluster, a CostTable, an IndicatorTable and
:class:`ProblemOptions` into, per device group, the coefficients of the integer program of
docs/ARCHITECTURE.md (The allocation problem, the replayer and the runtime):

* **Decision units.** One decision per choosable op, or per tie group (ops that share one
  decision). A unit's choices on a group are the precisions every one of its ops allows,
  intersected with the card's menu and with any user pin.
* **Time of a group** (one device, one iteration, compute stream only), in ms::

      C_g(x) = c0 + sum_u t_u[x_u] + sum_{(a,b)} t_ab[x_a, x_b]

  The unary and pair terms are *derived from the replayer's own cost rules*
  (:meth:`qsync_opt.costs.rules.CostRules.op_items`, which the replayer runs), op by op: every op's items depend on the unit that sets its own
  dtype (itself if choosable, the producer upstream of a pass-through) and, per float
  in-edge, on the unit that sets that producer's dtype. Items are additive over in-edges,
  so each op splits into a self term and one pair term per edge: casts sit exactly on the
  edges (after collapsing pass-through chains) where producer and consumer dtypes differ.
* **Memory of one device**, in bytes: static FP32 weights, gradients, optimizer state,
  buffers and context, plus unary/pair terms for low-precision weight copies and saved
  activations, plus the largest single op's working set (a max: one row per unit in the
  program, ``W >= w_u[x_u]``), against ``capacity * (1 - memory_headroom)``.
* **Degradation**: ``sum_u Omega_u[x_u]`` from the indicator (Omega is relative, so it is
  the same at every batch, see ``indicator.scale_to_batch``); the objective weighs each
  group by its share of the global batch.
* **Makespan** (the linear model): ``T = max_g C_g + tail + opt``, ``tail`` the all-reduce
  of the last gradient bucket (the one that cannot overlap backward), ``opt`` the slowest
  optimizer step. The replayer scores the same plan with overlap and bucket alignment.

* **Derived units.** A promoting op (add, cat) fed only by decision units runs in the
  widest of their dtypes (autocast). Its dtype is not a decision but it sets the casts
  downstream, so it becomes a *derived unit* (``GroupModel.derived``): it has choices
  (fp32/fp16/bf16) and unary/pair terms like any unit, and ``derived_rows()`` gives the
  AND rows that tie its choice to its inputs' (ResNet's residual adds, once batch norm runs
  in its input's dtype as under autocast, chain these).

Where the linear model is exact. On every catalog workload the linear model reproduces the
replayer's per-group compute time and memory for any plan (tests hold them equal). One
rule of the replayer is not pairwise and is approximated, with a note: an op with two or
more choosable producers *and* storage shared with an earlier op takes its saved-activation
bytes as the maximum over its producers' choices (an upper bound). It does not occur in the
catalog models.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.costs.batchmodel import TableCosts
from qsync_opt.documents.schemas import (
    ClusterSpec,
    CostTable,
    IndicatorTable,
    ModelGraph,
    Plan,
)
from qsync_opt.problem.coefficients import GroupInputs, ScheduleCache, group_model
from qsync_opt.problem.groupmodel import (
    GroupModel,
    Unit,
    check_finite,
    held_at_reference,
    scale_time,
)
from qsync_opt.problem.plan import make_plan
from qsync_opt.replayer import PeriodicSync, Replayer

#: Precisions a strong group may run as its reference.
REFERENCE_PRECISIONS = (Precision.fp32, Precision.tf32, Precision.bf16, Precision.fp16)


@dataclass(frozen=True)
class ProblemOptions:
    """What the user decides besides graph, cluster, costs and indicator.

    ``target_ms``: makespan target of the linear model (None: the strong groups' time at
    their reference precision, i.e. no straggler). ``memory_headroom``: fraction of each
    card's usable memory kept free. ``pinned``: op name -> precision, on every group (an op a
    group cannot run at that precision is an error). ``reference``: the strong groups'
    reference precision (fp32 as QSync; tf32/bf16 as most A100/H100 users run), used where
    a card offers it. ``strong_groups``: which groups set the default target (None: the
    fastest at the reference). ``casts``: False drops every cast term (the additive model of
    QSync's and HAWQ-V3's ILP, for the baseline). ``ties``: False gives every op its own
    decision even where the graph ties it (calls of one module stay tied: they are one set
    of weights), to measure what tying costs. ``lower_reference``: whether the solver may
    lower the strong groups below their reference precision. None (default): they are
    *held* at it (each of their units has that one choice) under the default target and
    under a given target they meet at their reference; a given target below that frees
    them, and the problem's notes say so. False: always held; True: never. A strong group
    whose reference plan does not fit its memory is never held (the notes say so). The
    decision is made when the problem is built; ``retarget`` keeps it (solve-replay
    refinement tightens the linear target, never by lowering the strong groups).
    ``sync``: the replayer's sync model (None: DDP's all-reduce every step; a
    :class:`~qsync_opt.replayer.PeriodicSync` for Local SGD / QSR, whose communication is paid
    once per round, so the time it frees goes to higher precision).
    """

    target_ms: float | None = None
    memory_headroom: float = 0.0
    pinned: Mapping[str, Precision | str] = field(default_factory=dict)
    optimizer: str = "sgd"
    reference: Precision | str = Precision.fp32
    strong_groups: tuple[str, ...] | None = None
    casts: bool = True
    ties: bool = True
    lower_reference: bool | None = None
    sync: Any = None

    def __post_init__(self) -> None:
        if self.target_ms is not None and not (
                isinstance(self.target_ms, (int, float)) and not isinstance(self.target_ms, bool)
                and 0 < self.target_ms < math.inf):
            raise QsyncInputError(
                f"target_ms: expected a positive finite number, got {self.target_ms!r}")
        if not 0 <= self.memory_headroom < 1:
            raise QsyncInputError(
                f"memory_headroom: expected a fraction in [0, 1), got {self.memory_headroom}")
        if self.optimizer not in ("sgd", "adam"):
            raise QsyncInputError(f"optimizer: expected sgd or adam, got {self.optimizer!r}")
        if self.lower_reference is not None and not isinstance(self.lower_reference, bool):
            raise QsyncInputError(
                f"lower_reference: expected true, false or null, got {self.lower_reference!r}")
        try:
            ref = Precision(self.reference)
        except ValueError:
            raise QsyncInputError(f"reference: unknown precision {self.reference!r}") from None
        if ref not in REFERENCE_PRECISIONS:
            raise QsyncInputError(
                f"reference: expected one of {', '.join(p.value for p in REFERENCE_PRECISIONS)}, "
                f"got {ref.value}")
        object.__setattr__(self, "reference", ref)
        pins = {}
        for op, p in dict(self.pinned).items():
            try:
                pins[op] = Precision(p)
            except ValueError:
                raise QsyncInputError(f"pinned: op {op}: unknown precision {p!r}") from None
        object.__setattr__(self, "pinned", pins)
        if self.strong_groups is not None:
            object.__setattr__(self, "strong_groups", tuple(self.strong_groups))
        if isinstance(self.sync, Mapping):  # as to_json wrote it
            try:
                object.__setattr__(self, "sync", PeriodicSync(**dict(self.sync)))
            except (TypeError, ValueError) as exc:
                raise QsyncInputError(f"sync: {exc}") from None

    def to_json(self) -> dict[str, Any]:
        return {"target_ms": self.target_ms, "memory_headroom": self.memory_headroom,
                "pinned": {k: Precision(v).value for k, v in self.pinned.items()},
                "optimizer": self.optimizer, "reference": Precision(self.reference).value,
                "strong_groups": list(self.strong_groups) if self.strong_groups else None,
                "casts": self.casts, "ties": self.ties, "lower_reference": self.lower_reference,
                "sync": (None if self.sync is None else
                         {"mean_period": self.sync.mean_period, "mode": self.sync.mode,
                          "rounds": self.sync.rounds, "steps": self.sync.steps})}



def _hash(doc: Any) -> str:
    return str(doc.content_hash())


#: Relative slack on the target and capacity checks (solver tolerances are ~1e-9 relative).
EVAL_TOL = 1e-7


def pin_unmeasured(options: ProblemOptions, indicator: IndicatorTable, graph: ModelGraph
                   ) -> tuple[ProblemOptions, list[str]]:
    """``options`` with every choosable op of ``graph`` that ``indicator`` could not measure
    (:attr:`~qsync_opt.documents.schemas.IndicatorTable.unmeasured`) pinned fp32, unless the user
    pinned it already; and those ops' names. Every problem is made through here, so no path
    (the CLI, :func:`qsync_opt.planner.solve.build_problem`, a problem made directly) lowers such
    an op for free."""
    choosable = {o.name for o in graph.choosable_ops()}
    new = sorted(n for n in indicator.unmeasured if n in choosable and n not in options.pinned)
    if not new:
        return options, []
    pins = {**options.pinned, **dict.fromkeys(new, Precision.fp32)}
    return dataclasses.replace(options, pinned=pins), new


class AllocationProblem:
    """The integer program's data for one (graph, cluster with batches, costs, indicator).

    ``cost_provider`` makes costs for another cluster or batch split (dynamic batching,
    leaving groups out, the joint split); by default
    :class:`~qsync_opt.costs.batchmodel.TableCosts` of ``costs`` (estimated costs re-estimated
    with the same efficiencies, measured ones from a fitted batch model). The problem never
    estimates costs itself. ``schedules``: how the groups' coefficients are derived
    (:class:`~qsync_opt.problem.coefficients.Schedule`), shared with the problems made from
    this one (another batch split derives its coefficients without walking the ops again).
    """

    def __init__(self, graph: ModelGraph, cluster: ClusterSpec, costs: CostTable,
                 indicator: IndicatorTable, options: ProblemOptions | None = None, *,
                 cost_provider: Callable[[ClusterSpec], CostTable] | None = None,
                 schedules: ScheduleCache | None = None,
                 time_scale: Mapping[str, float] | None = None) -> None:
        self.graph = graph
        #: Group name -> factor its compute time terms are multiplied by (a group measured
        #: slower than its costs say: :mod:`qsync_opt.planner.replan`); kept by the problems
        #: made from this one.
        self.time_scale: dict[str, float] = dict(time_scale or {})
        self.schedules: ScheduleCache = {} if schedules is None else schedules
        self.cluster = cluster.with_default_batch(graph.batch_size)
        self.costs = costs
        self.indicator = indicator
        self.options = options or ProblemOptions()
        self.cost_provider = cost_provider
        #: Problems re-made for other batch splits (shared by retarget() copies).
        self.split_cache: dict[tuple[tuple[str, int], ...], AllocationProblem] = {}
        #: What the joint split search keeps about a set of those problems (planner/solve.py).
        self.split_search_cache: dict[tuple[int, ...], Any] = {}
        #: Problems the evaluator re-made for plans of other clusters, by cluster and options.
        self.remade: dict[str, AllocationProblem] = {}
        if indicator.graph_hash != graph.structure_hash() and (
                indicator.workload != graph.workload
                or any(o.name not in indicator.values for o in graph.choosable_ops())):
            raise QsyncInputError(
                f"indicator: made for graph {indicator.graph_hash} ({indicator.workload}), not "
                f"{graph.structure_hash()} ({graph.workload})")
        self.replayer = Replayer(graph, self.cluster, costs, optimizer=self.options.optimizer,
                                 enforce_ties=self.options.ties, sync=self.options.sync)
        self.notes: list[str] = []
        if indicator.graph_hash != graph.structure_hash():
            self.notes.append(
                f"indicator measured on {indicator.workload} at batch {indicator.batch_size} "
                f"(graph {indicator.graph_hash}); matched to this graph by op name (its values "
                + ("are expected changes of the batch-mean loss, about the same at every batch)"
                   if indicator.method == "curv" else
                   "are relative, so they hold at every batch)"))
        if indicator.method == "curv":
            self.notes.append(
                "indicator curv: each value is the op's expected increase of the batch-mean "
                "loss per training step at that precision, in nats (second order); the "
                "objective is the plan's predicted loss increase per step, each group's weighted "
                "by its share of the batch")
        ops = {o.name: o for o in graph.ops}
        self.options, unmeasured = pin_unmeasured(self.options, indicator, graph)
        if unmeasured:
            self.notes.append(
                f"indicator {indicator.method}: {len(unmeasured)} op(s) without a value pinned "
                f"fp32 ({', '.join(unmeasured[:5])}{' ...' if len(unmeasured) > 5 else ''}; "
                "the indicator could not measure them, and a value is never assumed)")
        for name in self.options.pinned:
            if name not in ops:
                raise QsyncInputError(f"pinned: graph {graph.workload} has no op {name!r}")
            if not ops[name].choosable:
                raise QsyncInputError(f"pinned: op {name} is {ops[name].role.value}, not choosable")
        self.units = self._units()
        self.unit_of = {op: u for u, unit in enumerate(self.units) for op in unit.ops}
        rep = self.replayer
        self.bucket_tail_ms = rep.bucket_ms[-1] if rep.bucket_ms else 0.0
        # The optimizer and, on the runtime's profiled tables, its per-step bookkeeping syncs.
        self.optimizer_ms = max(g.optimizer_ms for g in rep.groups) + rep.step_sync_ms
        self.global_batch = sum(g.count * int(g.batch_per_device or 1) for g in self.cluster.groups)
        self.groups = self._group_models()
        self.reference_times = {g.name: g.time_ms(g.reference) for g in self.groups}
        self.strong_groups = self._strong_groups()
        #: The strong groups' makespan at their reference in the linear model (no straggler).
        self.reference_makespan_ms = (max(self.reference_times[g] for g in self.strong_groups)
                                      + self.bucket_tail_ms + self.optimizer_ms)
        if self.options.target_ms is not None:
            self.target_ms = float(self.options.target_ms)
            self.target_source = "given"
        else:
            self.target_ms = self.reference_makespan_ms
            self.target_source = (f"default: strong group(s) {', '.join(self.strong_groups)} at "
                                  f"{Precision(self.options.reference).value} (no straggler)")
        #: The strong groups held at their reference precision (``options.lower_reference``):
        #: each of their units has that one choice.
        self.held_groups = self._hold_reference()

    # ------------------------------------------------------------------ construction

    def _units(self) -> list[Unit]:
        units: list[Unit] = []
        by_tie: dict[str, list[str]] = {}
        order: list[str] = []
        for op in self.graph.ops:
            if not op.choosable:
                continue
            tie = op.tie_group if (self.options.ties or (op.tie_group or "").startswith(
                "module:")) else None
            key = tie or f"op:{op.name}"
            if key not in by_tie:
                by_tie[key] = []
                order.append(key)
            by_tie[key].append(op.name)
        for key in order:
            names = by_tie[key]
            units.append(Unit(name=names[0] if len(names) == 1 else key, ops=tuple(names)))
        return units

    def _group_models(self) -> list[GroupModel]:
        """Every group's coefficients (:mod:`qsync_opt.problem.coefficients`), checked finite;
        a note when the linear model bounds some ops' saved activations."""
        rep = self.replayer
        inputs = GroupInputs(
            rules=rep.rules, units=self.units, unit_of=self.unit_of, pinned=self.options.pinned,
            casts=self.options.casts, memory_headroom=self.options.memory_headroom,
            reference=Precision(self.options.reference), indicator=self.indicator,
            cluster=self.cluster, graph_batch=self.graph.batch_size)
        built = [group_model(inputs, gi, self.schedules) for gi in range(len(rep.groups))]
        groups = [scale_time(model, self.time_scale.get(model.name, 1.0)) for model, _ in built]
        memory_or = built[0][1] if built else 0
        check_finite(groups, [u.ops[0] for u in self.units])
        if memory_or:
            self.notes.append(
                f"linear model: {memory_or} ops with several choosable producers "
                "take their saved-activation bytes as the maximum over those producers' choices")
        return groups

    def _strong_groups(self) -> tuple[str, ...]:
        names = [g.name for g in self.groups]
        if self.options.strong_groups is not None:
            bad = [s for s in self.options.strong_groups if s not in names]
            if bad or not self.options.strong_groups:
                raise QsyncInputError(
                    f"strong_groups: expected names among {', '.join(names)}, got "
                    f"{', '.join(self.options.strong_groups) or 'none'}")
            return tuple(self.options.strong_groups)
        best = min(self.reference_times.values())
        return tuple(n for n in names if self.reference_times[n] <= best * (1 + 1e-9))

    def _hold_reference(self) -> tuple[str, ...]:
        """Hold the strong groups at their reference precision as ``options.lower_reference``
        says (None: unless a given target is below what they reach there); a strong group
        whose reference plan does not fit its memory stays free. The notes say why a strong
        group is not held."""
        lower = self.options.lower_reference
        if lower:
            return ()
        ref = Precision(self.options.reference).value
        strong = ", ".join(self.strong_groups)
        if lower is None and self.target_ms < self.reference_makespan_ms * (1 - 1e-9):
            self.notes.append(
                f"the target {self.target_ms:.3f} ms is below the strong group(s)' "
                f"{self.reference_makespan_ms:.3f} ms at their reference {ref}: {strong} may be "
                "lowered too (lower_reference=False holds them)")
            return ()
        held = []
        for gi, g in enumerate(self.groups):
            if g.name not in self.strong_groups:
                continue
            need = g.memory_bytes(g.reference)
            if need > g.capacity_bytes * (1 + EVAL_TOL):
                self.notes.append(
                    f"strong group {g.name} ({g.device}) is not held at its reference {ref}: "
                    f"its reference plan needs {need / 2**30:.2f} GiB, has "
                    f"{g.capacity_bytes / 2**30:.2f} GiB, so the solver may lower its ops to "
                    "fit memory")
                continue
            self.groups[gi] = held_at_reference(g)
            held.append(g.name)
        if held and self.options.target_ms is None:
            # The replayer also exposes the all-reduce the backward does not hide (buckets
            # queue on the links); with the strong groups held no plan removes it.
            replay = self.no_straggler_replay_ms()
            if replay > self.target_ms * (1 + 1e-9):
                self.notes.append(
                    f"with no straggler the replayer's iteration is {replay:.3f} ms, the "
                    f"default target {self.target_ms:.3f} ms plus {replay - self.target_ms:.3f} "
                    f"ms of all-reduce left exposed after the backward of {', '.join(held)} "
                    "(held at the reference): no plan meets the target in the replayer")
        return tuple(held)

    def no_straggler_replay_ms(self) -> float:
        """The replayer's iteration with the strong groups at their reference and no group
        slower than them: the strong groups' forward and backward, the all-reduce of their
        buckets (each starts when theirs are ready and the previous one is done), then the
        step syncs and the slowest optimizer step (as ``Replayer.simulate`` times them)."""
        rep = self.replayer
        rules = rep.rules
        ready: list[list[float]] = []
        ends: list[float] = []
        for gi, g in enumerate(self.groups):
            if g.name not in self.strong_groups:
                continue
            grp = rep.groups[gi]
            prec = rules.plan_row([unit.ops for unit in self.units],
                                  [g.choices[u][g.reference[u]] for u in range(len(self.units))])
            din, dout = rules.dtypes(prec)
            items = [rules.op_items(grp, i, prec, din, dout) for i in range(rep.n)]
            t = sum(x[2] for fwd, _ in items for x in fwd)
            done = [0.0] * rep.n
            for i in range(rep.n - 1, -1, -1):
                t += sum(x[2] for x in items[i][1])
                done[i] = t
            ready.append([done[f] for f in rep.bucket_first])
            ends.append(t)
        comm_end = rep.sync.schedule(ready, rep.bucket_ms).comm_end_ms
        return (max(max(ends), comm_end) + rep.stats_sync_ms
                + max(grp.optimizer_ms for grp in rep.groups) + rep.buffer_sync_ms)

    # ------------------------------------------------------------------ plans

    def group(self, name: str) -> GroupModel:
        for g in self.groups:
            if g.name == name:
                return g
        raise QsyncInputError(f"no group {name!r}; groups: {', '.join(g.name for g in self.groups)}")

    def assignment(self, plan: Plan | Mapping[str, Mapping[str, Precision | str]]
                   ) -> dict[str, list[int]]:
        """Choice indices per group for a plan (validated by the replayer's rules)."""
        precs = self.replayer.precisions_for(plan)
        out: dict[str, list[int]] = {}
        for g, row in zip(self.groups, precs, strict=True):
            a = []
            for u, unit in enumerate(self.units):
                p = row[self.replayer.index[unit.ops[0]]]
                if p not in g.choices[u]:
                    held = (f" ({g.name} is held at its reference precision: "
                            "lower_reference=True, or --lower-reference, frees it)"
                            if g.name in self.held_groups else "")
                    raise QsyncInputError(
                        f"plan: group {g.name}, op {unit.ops[0]}: {p} is not among the "
                        f"problem's choices {', '.join(q.value for q in g.choices[u])}{held}")
                a.append(g.choices[u].index(p))
            out[g.name] = a
        return out

    def precisions(self, assignment: Mapping[str, Sequence[int]]) -> dict[str, dict[str, Precision]]:
        """Op -> precision per group from choice indices."""
        out: dict[str, dict[str, Precision]] = {}
        for g in self.groups:
            a = assignment[g.name]
            out[g.name] = {op: g.choices[u][a[u]] for u, unit in enumerate(self.units)
                           for op in unit.ops}
        return out

    def make_plan(self, assignment: Mapping[str, Sequence[int]],
                  provenance: Mapping[str, Any] | None = None) -> Plan:
        prov = dict(self.provenance())
        prov.update(provenance or {})
        return make_plan(self.graph, self.cluster, self.precisions(assignment), prov)

    def provenance(self) -> dict[str, Any]:
        return {"graph_hash": self.graph.structure_hash(), "graph_batch": self.graph.batch_size,
                "graph_tie_mode": self.graph.tie_mode, "costs_hash": _hash(self.costs),
                "indicator_hash": _hash(self.indicator), "indicator_method": self.indicator.method,
                "target_ms": self.target_ms, "reference": Precision(self.options.reference).value,
                "memory_headroom": self.options.memory_headroom,
                "optimizer": self.options.optimizer,
                "held_at_reference": ",".join(self.held_groups)}

    def reference_assignment(self) -> dict[str, list[int]]:
        return {g.name: list(g.reference) for g in self.groups}

    def makespan_ms(self, assignment: Mapping[str, Sequence[int]]) -> float:
        """The linear model's makespan."""
        return max(g.time_ms(assignment[g.name]) for g in self.groups) + self.tail_ms

    @property
    def tail_ms(self) -> float:
        """What every group's time is charged after its backward: last bucket + optimizer."""
        return self.bucket_tail_ms + self.optimizer_ms

    def group_budget_ms(self) -> float:
        """A group's compute time allowed by the target (the per-group time row's bound)."""
        return self.target_ms - self.tail_ms

    def objective(self, assignment: Mapping[str, Sequence[int]]) -> float:
        return sum(g.weight * g.degradation(assignment[g.name]) for g in self.groups)

    # ------------------------------------------------------------------ variations

    def with_cluster(self, cluster: ClusterSpec, options: ProblemOptions | None = None,
                     time_scale: Mapping[str, float] | None = None) -> AllocationProblem:
        """The same problem on another cluster or batch split (``time_scale``: the groups'
        compute time factors, None: this problem's).

        Costs are kept when they already cover the new batches and world size; otherwise
        they come from ``cost_provider``, by default :class:`~qsync_opt.costs.batchmodel.TableCosts`
        of this problem's table (estimated costs re-estimated with the same efficiencies,
        measured ones from a fitted batch model).
        """
        cluster = cluster.with_default_batch(self.graph.batch_size)
        have = {(c.device, c.batch_size) for c in self.costs.entries}
        need = {(g.device, int(g.batch_per_device or self.graph.batch_size))
                for g in cluster.groups}
        same_world = cluster.world_size == self.cluster.world_size
        costs = self.costs
        if not need <= have or not same_world:
            provider = self.cost_provider or TableCosts(self.costs, self.graph)
            costs = provider(cluster)
        opts = options or self.options
        names = {g.name for g in cluster.groups}
        if opts.strong_groups is None and self.held_groups and set(self.held_groups) <= names:
            # The groups held here stay the strong ones (held where the target allows),
            # whatever group is fastest at the new split.
            opts = dataclasses.replace(opts, strong_groups=self.held_groups)
        return AllocationProblem(self.graph, cluster, costs, self.indicator, opts,
                                 cost_provider=self.cost_provider, schedules=self.schedules,
                                 time_scale=self.time_scale if time_scale is None else time_scale)

    def retarget(self, target_ms: float, source: str = "given") -> AllocationProblem:
        """The same problem with another makespan target (no coefficient is rebuilt)."""
        if not 0 < target_ms < math.inf:
            raise QsyncInputError(
                f"target_ms: expected a positive finite number, got {target_ms!r}")
        other = copy.copy(self)
        other.target_ms = float(target_ms)
        other.target_source = source
        other.options = dataclasses.replace(self.options, target_ms=float(target_ms))
        return other

    def with_options(self, **changes: Any) -> AllocationProblem:
        opts = self.options.to_json()
        opts.update(changes)
        if opts.get("strong_groups") is not None:
            opts["strong_groups"] = tuple(opts["strong_groups"])
        return AllocationProblem(self.graph, self.cluster, self.costs, self.indicator,
                                 ProblemOptions(**opts), cost_provider=self.cost_provider,
                                 schedules=self.schedules, time_scale=self.time_scale)

    def size(self) -> dict[str, int]:
        """Units, one-hot variables and pair variables per group (for reports)."""
        return {
            "units": len(self.units),
            "x_vars": sum(len(c) for g in self.groups for c in g.choices),
            "pair_vars": sum(len(p.time) * len(p.time[0]) for g in self.groups for p in g.pairs),
        }

    def describe(self) -> dict[str, Any]:
        return {"workload": self.graph.workload, "groups": [
            {"name": g.name, "device": g.device, "count": g.count, "batch": g.batch,
             "weight": g.weight, "reference_ms": self.reference_times[g.name],
             "capacity_bytes": g.capacity_bytes} for g in self.groups],
            "target_ms": self.target_ms, "target_source": self.target_source,
            "held_at_reference": list(self.held_groups),
            "tail_ms": self.tail_ms, **self.size(), "notes": self.notes}
