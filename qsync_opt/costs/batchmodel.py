"""Measured costs at per-device batches nobody measured: a fitted batch model, said so.

Dynamic batching and the strong-only baseline re-split the global batch, so they need costs
at per-device batches the profile did not run. Estimated tables are simply re-estimated
(:meth:`AllocationProblem.with_cluster`); a measured table gets its missing batches from
:class:`BatchScaling`, a ``cost_provider``:

* per (device, op, precision), forward and backward separately, ``t(b) = a + c * b`` with
  ``a, c >= 0``, least squares over the batches that were measured (two or more);
* with one measured batch, ``t(b) = t(b0) * b / b0`` (proportional: an op's fixed overhead
  is not separated from its per-sample work, so a smaller batch is charged too little and a
  larger one too much when launches dominate);
* the optimizer step and the casts (per element) do not depend on the batch and are kept;
* at another world size the measured ring all-reduce model (bandwidth, per-hop latency) is
  re-evaluated at the new size and the gradient buckets rebuilt.

Every entry made this way has ``source: "scaled"`` and the table's notes say which batches
were fitted, with which model, and which batches were made from them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.costs.roofline import estimate, gradient_buckets
from qsync_opt.documents.schemas import ClusterSpec, CostTable, ModelGraph, OpCost


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``t = a + c * b`` with ``a, c >= 0`` over ``(b, t)`` points.

    One distinct batch gives ``(0, t / b)``. The two-parameter non-negative problem is solved
    exactly: the unconstrained fit when both coefficients are non-negative, else the better
    of the two one-parameter fits on the boundary.
    """
    if not points:
        raise QsyncInputError("fit_line: no measured points")
    bs = sorted({b for b, _ in points})
    n = len(points)
    if len(bs) == 1:
        b0 = bs[0]
        mean_t = sum(t for _, t in points) / n
        return 0.0, mean_t / b0
    sb = sum(b for b, _ in points)
    st = sum(t for _, t in points)
    sbb = sum(b * b for b, _ in points)
    sbt = sum(b * t for b, t in points)
    det = n * sbb - sb * sb
    c = (n * sbt - sb * st) / det
    a = (st - c * sb) / n
    if a >= 0 and c >= 0:
        return a, c

    def sse(a_: float, c_: float) -> float:
        return sum((a_ + c_ * b - t) ** 2 for b, t in points)

    through_zero = (0.0, max(sbt / sbb, 0.0))  # a = 0
    flat = (max(st / n, 0.0), 0.0)             # c = 0
    return min(through_zero, flat, key=lambda ac: sse(*ac))


class BatchScaling:
    """A ``cost_provider`` for measured tables: entries at new batches from a batch model.

    ``tables``: one or more tables of the same graph and activation flow, measured at
    different per-device batches (their entries are pooled per device; each (device, batch)
    pair may come from one table only).
    """

    def __init__(self, tables: CostTable | Sequence[CostTable], graph: ModelGraph) -> None:
        tabs = [tables] if isinstance(tables, CostTable) else list(tables)
        if not tabs:
            raise QsyncInputError("BatchScaling: no cost tables given")
        base = tabs[0]
        for i, t in enumerate(tabs[1:], 1):
            if t.graph_hash != base.graph_hash:
                raise QsyncInputError(f"BatchScaling: table {i} is for graph {t.graph_hash}, "
                                      f"table 0 for {base.graph_hash}")
            if t.activation_flow != base.activation_flow:
                raise QsyncInputError(f"BatchScaling: table {i} has activation_flow "
                                      f"{t.activation_flow!r}, table 0 {base.activation_flow!r}")
        self.base = base
        self.graph = graph
        seen: dict[tuple[str, int], int] = {}
        self.entries: list[OpCost] = []
        for i, t in enumerate(tabs):
            for key in sorted({(e.device, e.batch_size) for e in t.entries}):
                if key in seen and seen[key] != i:
                    raise QsyncInputError(f"BatchScaling: {key[0]}@{key[1]} is in tables "
                                          f"{seen[key]} and {i}")
                seen[key] = i
            self.entries += t.entries
        points: dict[tuple[str, str, Precision], list[OpCost]] = defaultdict(list)
        for e in self.entries:
            points[(e.device, e.op, e.precision)].append(e)
        self._points = points
        self.measured: dict[str, list[int]] = defaultdict(list)
        for dev, b in sorted(seen):
            self.measured[dev].append(b)
        self._fits: dict[tuple[str, str, Precision], tuple[tuple[float, float],
                                                          tuple[float, float]]] = {}

    def fit(self, device: str, op: str, precision: Precision
            ) -> tuple[tuple[float, float], tuple[float, float]]:
        """``((a_fwd, c_fwd), (a_bwd, c_bwd))`` for one entry."""
        key = (device, op, precision)
        if key not in self._fits:
            pts = self._points[key]
            self._fits[key] = (fit_line([(e.batch_size, e.fwd_ms) for e in pts]),
                               fit_line([(e.batch_size, e.bwd_ms) for e in pts]))
        return self._fits[key]

    def model_text(self, device: str) -> str:
        bs = self.measured.get(device, [])
        if len(bs) >= 2:
            return (f"t(b) = a + c*b (a, c >= 0) per op, precision and pass, least squares "
                    f"over measured batches {', '.join(map(str, bs))}")
        return (f"t(b) = t({bs[0]}) x b/{bs[0]} per op, precision and pass (one measured "
                "batch: proportional, fixed overheads not separated)")

    def __call__(self, cluster: ClusterSpec) -> CostTable:
        need = sorted({(g.device, int(g.batch_per_device)) for g in cluster.groups
                       if g.batch_per_device is not None})
        have = {(e.device, e.batch_size) for e in self.entries}
        entries = list(self.entries)
        notes = list(self.base.notes)
        for dev, b in need:
            if (dev, b) in have:
                continue
            if dev not in self.measured:
                raise QsyncInputError(f"costs: no entries for device {dev} at any batch; "
                                      "profile it (or use estimated costs)")
            made = 0
            for (d, op, p), _pts in self._points.items():
                if d != dev:
                    continue
                (af, cf), (ab, cb) = self.fit(d, op, p)
                entries.append(OpCost(device=dev, batch_size=b, op=op, precision=p,
                                      fwd_ms=af + cf * b, bwd_ms=ab + cb * b, source="scaled"))
                made += 1
            notes.append(f"batch model: {dev}@{b}: {made} entries scaled from measured costs, "
                         f"{self.model_text(dev)}")
        table = self.base.model_copy(update={"entries": entries, "notes": notes})
        if cluster.world_size != table.comm.world_size:
            comm = table.comm.model_copy(update={"world_size": cluster.world_size})
            table = table.model_copy(update={
                "comm": comm,
                "buckets": gradient_buckets(self.graph, comm, table.bucket_cap_bytes),
                "notes": [*table.notes, f"batch model: comm: the {table.comm.source} ring model "
                          f"({table.comm.bandwidth_gb_per_s:.3g} GB/s, "
                          f"{table.comm.latency_us:.3g} us per hop) re-evaluated at world size "
                          f"{cluster.world_size} (was {table.comm.world_size})"]})
        return table


class TableCosts:
    """The default cost provider of a problem: costs for another cluster or batch split made
    from the problem's own table. Estimated tables are re-estimated with the same
    efficiencies and bucket cap (edits made to the table, such as
    ``synthetic.perturb_costs``, do not carry over); measured tables get the missing batches
    from a fitted batch model (:class:`BatchScaling`, whose notes say so; profile those
    batches for measured figures). The problem calls it; it never calls the problem."""

    def __init__(self, costs: CostTable, graph: ModelGraph) -> None:
        self.costs, self.graph = costs, graph

    def __call__(self, cluster: ClusterSpec) -> CostTable:
        if all(c.source == "estimated" for c in self.costs.entries):
            return estimate(self.graph, cluster, efficiencies=self.costs.efficiencies,
                            bucket_cap_bytes=self.costs.bucket_cap_bytes)
        return BatchScaling(self.costs, self.graph)(cluster)
