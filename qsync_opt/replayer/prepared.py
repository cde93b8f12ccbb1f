"""A (graph, cluster, costs) prepared for replay: the inputs checked, the gradient buckets
indexed, the step syncs, the cost rules (:class:`~qsync_opt.costs.rules.CostRules`) built, and
plans validated into per-op precision rows. The event loop (:class:`~.loop.Replayer`) and
the incremental path (:class:`~.incremental.IncrementalReplay`) both start from it."""

from __future__ import annotations

from collections.abc import Mapping

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.costs.roofline import DDP_BUCKET_CAP_BYTES, gradient_buckets
from qsync_opt.costs.rules import (
    DEFAULT_CONTEXT_BYTES,
    CostRules,
    check_plan_entry,
    check_tie,
    fidelity,
)
from qsync_opt.documents.schemas import ClusterSpec, CostTable, ModelGraph, OpRole, Plan
from qsync_opt.replayer.syncmodel import AllReduceSync, PeriodicSync, SyncModel


class PreparedReplay:
    """Prepared simulation of one (graph, cluster, costs): build once, replay many plans.

    ``optimizer`` is ``"sgd"`` (momentum) or ``"adam"``; ``sync`` the synchronisation model
    (DDP all-reduce by default); ``bucket_cap_bytes`` re-buckets the gradients (default: the
    CostTable's buckets); ``context_bytes`` is reserved per GPU device (0 on the CPU).
    ``rules`` holds the cost-and-memory rules; ``ops``, ``index``, ``role``, ``in_edges``,
    ``out_edges``, ``groups`` and ``native_flow`` are the rules' own, shared.
    """

    def __init__(
        self,
        graph: ModelGraph,
        cluster: ClusterSpec,
        costs: CostTable,
        *,
        optimizer: str = "sgd",
        sync: SyncModel | None = None,
        bucket_cap_bytes: int | None = None,
        context_bytes: int = DEFAULT_CONTEXT_BYTES,
        enforce_ties: bool = True,
    ) -> None:
        if costs.graph_hash != graph.structure_hash():
            raise QsyncInputError(
                f"costs: made for graph {costs.graph_hash}, not this graph "
                f"({graph.structure_hash()}, {graph.workload})")
        if optimizer not in ("sgd", "adam"):
            raise QsyncInputError(f"optimizer: expected sgd or adam, got {optimizer!r}")
        self.graph = graph
        self.enforce_ties = enforce_ties  # False: tie groups are advisory (calls of one module stay tied)
        self.cluster = cluster.with_default_batch(graph.batch_size)
        self.costs = costs
        #: The runtime's per-step bookkeeping collectives (tables profiled on it): a 32-byte
        #: all-reduce of the step's statistics before the optimizer, and a broadcast of the
        #: buffers after it (qsync_opt.job.rank). Zero for one rank and for estimates.
        native_flow = costs.activation_flow == "native"
        comm = costs.comm
        self.stats_sync_ms = 0.0 if native_flow else comm.allreduce_ms(32)
        self.buffer_sync_ms = (0.0 if native_flow or not graph.buffer_bytes
                               else comm.broadcast_ms(graph.buffer_bytes))
        self.optimizer = optimizer
        self.sync: SyncModel = sync or AllReduceSync()
        if isinstance(self.sync, PeriodicSync):
            # Local SGD / QSR: no per-step bookkeeping; the round's averaging and statistics
            # all-reduce, spread over its steps, after the optimizer (replayer.sync)
            self.stats_sync_ms = 0.0
            self.buffer_sync_ms = self.sync.per_step_ms(comm, graph.param_bytes,
                                                        graph.buffer_bytes)
        self.step_sync_ms = self.stats_sync_ms + self.buffer_sync_ms
        names = {o.name for o in graph.ops}
        # Gradient buckets: the op indices whose gradients each bucket holds.
        buckets = costs.buckets if bucket_cap_bytes is None else gradient_buckets(
            graph, costs.comm, bucket_cap_bytes)
        self.bucket_cap_bytes = bucket_cap_bytes or costs.bucket_cap_bytes or DDP_BUCKET_CAP_BYTES
        for k, b in enumerate(buckets):  # a cost table is a data file: check what it names
            unknown = next((n for n in b.ops if n not in names), None)
            if unknown is not None or not b.ops:
                raise QsyncInputError(
                    f"costs: buckets.{k}.ops "
                    + (f"names op {unknown!r}, which graph {graph.workload!r} lacks"
                       if unknown is not None else "is empty")
                    + " (the table was made for another graph)")
        rules = CostRules(graph, self.cluster, costs, optimizer=optimizer,
                          context_bytes=context_bytes)
        #: The cost-and-memory rules (:mod:`qsync_opt.costs.rules`) this replay is made of.
        self.rules = rules
        self.native_flow = rules.native_flow
        self.ops = rules.ops
        self.n = rules.n
        self.index = rules.index
        self.role = rules.role
        self.in_edges = rules.in_edges
        self.out_edges = rules.out_edges
        self.groups = rules.groups
        self.bucket_ops = [[self.index[n] for n in b.ops] for b in buckets]
        self.bucket_first = [min(ix) for ix in self.bucket_ops]  # its last gradient ready
        self.bucket_ms = [b.allreduce_ms for b in buckets]
        if isinstance(self.sync, PeriodicSync):
            self.bucket_ms = [0.0] * len(buckets)  # no gradient is sent

    # ------------------------------------------------------------------ plan handling

    def precisions_for(self, plan: Plan | Mapping[str, Mapping[str, Precision | str]]
                       ) -> list[list[Precision | None]]:
        """Validate a plan and return, per group, each op's precision (None: not choosable).

        Choosable ops the plan leaves out run at fp32. Refused: an op the graph lacks, a
        pinned op set to anything but its pin, a precision the op or the card cannot run,
        tied ops with different precisions.
        """
        table: Mapping[str, Mapping[str, Precision | str]]
        if isinstance(plan, Plan):
            if plan.graph_hash != self.graph.structure_hash():
                raise QsyncInputError(
                    f"plan: made for graph {plan.graph_hash} ({plan.workload}), not "
                    f"{self.graph.structure_hash()} ({self.graph.workload})")
            table = {name: gp.precisions for name, gp in plan.groups.items()}
        else:
            table = {name: dict(v) for name, v in plan.items()}
        unknown_groups = set(table) - {g.name for g in self.groups}
        if unknown_groups:
            raise QsyncInputError(
                f"plan: no group {', '.join(sorted(unknown_groups))} in the cluster "
                f"(groups: {', '.join(g.name for g in self.groups)})")
        out: list[list[Precision | None]] = []
        for grp in self.groups:
            row: list[Precision | None] = [
                Precision.fp32 if r == OpRole.choosable else None for r in self.role]
            for name, value in table.get(grp.name, {}).items():
                i = self.index.get(name)
                if i is None:
                    raise QsyncInputError(
                        f"plan: group {grp.name} names op {name!r}, which graph "
                        f"{self.graph.workload} lacks")
                try:
                    p = Precision(value)
                except ValueError:
                    raise QsyncInputError(
                        f"plan: group {grp.name}, op {name}: unknown precision {value!r}") from None
                op = self.ops[i]
                if check_plan_entry(op, p, grp.allowed(op), f"plan: group {grp.name}", name,
                                    grp.device):
                    continue
                row[i] = p
            ties: dict[str, tuple[str, Precision]] = {}
            for op, q in zip(self.ops, row, strict=True):
                if op.tie_group and q is not None and (
                        self.enforce_ties or op.tie_group.startswith("module:")):
                    check_tie(ties, op.tie_group, op.name, q, f"plan: group {grp.name}")
            out.append(row)
        return out

    def uniform(self, choose: str = "highest") -> dict[str, dict[str, Precision]]:
        """Every group at its highest (or lowest, by fidelity) precision on every op."""
        plan: dict[str, dict[str, Precision]] = {}
        for grp in self.groups:
            row = {}
            for op in self.ops:
                if op.role != OpRole.choosable:
                    continue
                ranked = sorted(grp.allowed(op), key=fidelity)
                row[op.name] = ranked[-1] if choose == "highest" else ranked[0]
            plan[grp.name] = row
        return plan
