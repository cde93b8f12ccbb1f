"""What the packet simulator loses of a training run's gradients, as the chunk masks the
runtime's DLCP drops (:func:`qsync_opt.strategy.droppolicy.apply_drops`): per simulated
iteration and rank, the chunks any lost byte range touches. The simulator itself
(:mod:`qsync_opt.netsim`) needs no torch; the masks are tensors."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.documents.schemas import ClusterSpec, ModelGraph
from qsync_opt.netsim.cluster import (
    DEFAULT_BUFFER_BYTES,
    SCENARIO_PATTERN,
    PlanLike,
    check_hosts,
    cluster_network,
    ddp_buckets,
    estimate_events,
    param_bucket_ready_ms,
    rank_cluster,
    run_iterations,
)
from qsync_opt.netsim.traffic import Bucket, NetConfig
from qsync_opt.strategy.droppolicy import ChunkTable

__all__ = ["dlcp_masks", "drop_mask"]


def drop_mask(table: ChunkTable, bucket: Bucket, lost: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The simulator's loss handed to the runtime's DLCP: the chunks of ``table``
    (:class:`qsync_opt.strategy.droppolicy.ChunkTable`) that any lost byte range ``(offset,
    bytes)`` of ``bucket`` (:func:`~qsync_opt.netsim.cluster.params_bucket` of the same
    numels) touches, as the bool mask :func:`qsync_opt.strategy.droppolicy.apply_drops`
    takes."""
    dropped = torch.zeros(table.n_chunks, dtype=torch.bool)
    starts, acc = [], 0
    for _, b, _ in bucket.layers:
        starts.append(acc)
        acc += b
    for off, size in lost:
        a, end = off, off + size
        while a < end:
            j = bucket.layer_at(a)
            param = int(bucket.layers[j][0])
            lo = starts[j]
            hi = min(end, lo + bucket.layers[j][1])
            e0, e1 = (a - lo) // 4, -(-(hi - lo) // 4)
            c0 = table.first[param] + e0 // table.chunk_elems
            c1 = table.first[param] + (e1 - 1) // table.chunk_elems
            dropped[c0:c1 + 1] = True
            a = hi
    return dropped


def dlcp_masks(table: ChunkTable, cluster: ClusterSpec, rank_groups: Sequence[str], *,
               scenario: str, cfg: NetConfig, iterations: int, seed: int,
               buffer_bytes: int = DEFAULT_BUFFER_BYTES, graph: ModelGraph | None = None,
               names: Sequence[str] | None = None, plan: PlanLike | None = None
               ) -> list[list[torch.Tensor]]:
    """What the network would lose of a training run's gradients, for the runtime's DLCP:
    ``iterations`` seeded simulated iterations (seed, seed + 1, ...) of the ranks'
    ``cluster`` (:func:`~qsync_opt.netsim.cluster.rank_cluster`) under ``scenario``, each
    DDP bucket (:func:`~qsync_opt.netsim.cluster.ddp_buckets` of ``table.numels``) leaving
    as its backward produces it (ready times from
    :func:`~qsync_opt.netsim.cluster.param_bucket_ready_ms` of ``graph``, the parameters'
    ``names`` and ``plan``, as the benchmark's network half emits them; without a graph,
    every bucket ready at once), and per iteration, per rank, the chunk mask
    (:func:`drop_mask`) of the packets lost of the messages that rank sent (a loss of the
    parameter server's reply: of the rank it was for), unbounded (the runtime bounds it per
    tensor)."""
    cl, device = rank_cluster(cluster, rank_groups)
    check_hosts(cl)
    net = cluster_network(cl, scenario, buffer_bytes=buffer_bytes)
    buckets = ddp_buckets(table.numels)
    est = estimate_events(net, buckets, SCENARIO_PATTERN[scenario], cfg.cell_bytes)
    if est > cfg.max_events:  # in the runtime's terms: its chunks are the cells
        kib = 2.0 ** math.ceil(math.log2(cfg.cell_bytes * est / cfg.max_events / 1024))
        raise QsyncInputError(
            f"comm: dlcp's network: a simulated iteration needs about {est:,} events at "
            f"chunk_kib={cfg.cell_bytes / 1024:g}, above the simulator's cap of "
            f"{cfg.max_events:,}; use chunk_kib={kib:g} or more")
    if graph is not None and names is not None:
        if len(names) != len(table.numels):
            raise ValueError("names: expected one name per parameter of the chunk table")
        ready = param_bucket_ready_ms(graph, cl, names, buckets, plan)
    else:
        ready = [[0.0] * len(buckets) for _ in cl.groups]
    runs = run_iterations(net, buckets, ready, cfg, pattern=SCENARIO_PATTERN[scenario],
                          iterations=iterations, seed=seed)
    dev_of = {h: i for i, h in enumerate(sorted(net.ranks))}  # host id -> device index
    rank_of = {d: r for r, d in enumerate(device)}
    out = []
    for res in runs:
        lost: list[list[list[tuple[int, int]]]] = [[[] for _ in buckets] for _ in device]
        for (k, off, size), (a, b) in zip(res.lost_ranges, res.lost_ends, strict=True):
            r = rank_of[dev_of[a if a in dev_of else b]]
            lost[r][k].append((off, size))
        masks = []
        for per_bucket in lost:
            m = torch.zeros(table.n_chunks, dtype=torch.bool)
            for k, ranges in enumerate(per_bucket):
                if ranges:
                    m |= drop_mask(table, buckets[k], ranges)
            masks.append(m)
        out.append(masks)
    return out
