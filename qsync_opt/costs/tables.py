"""CostTable algebra that needs no torch: the cast fit, medians and spreads, a new
comm model, derived CPUs (``cpu/F``) and merging profiles of several machines."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import DType, Precision
from qsync_opt.costs.devices import canonical_name, get_device, is_derived
from qsync_opt.costs.roofline import gradient_buckets
from qsync_opt.documents.schemas import CommModel, CostTable, ModelGraph


def fit_cast(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``times ~ a * sizes + b``; returns ``(a, b)`` (units of ``times``).

    Neither coefficient is clamped here (the caller clamps to the schema's >= 0).
    """
    n = len(sizes)
    if n != len(times) or n < 2:
        raise QsyncInputError("fit_cast: need at least two (size, time) pairs of equal length")
    mx = sum(sizes) / n
    my = sum(times) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    if sxx == 0:
        raise QsyncInputError("fit_cast: sizes must not all be equal")
    sxy = sum((x - mx) * (y - my) for x, y in zip(sizes, times, strict=True))
    a = sxy / sxx
    return a, my - a * mx


def median_iqr(samples: Sequence[float]) -> tuple[float, float]:
    """(median, interquartile range / median) of ``samples``."""
    med = statistics.median(samples)
    if len(samples) >= 4:
        q = statistics.quantiles(samples, n=4)
        iqr = q[2] - q[0]
    else:
        iqr = max(samples) - min(samples)
    return med, (iqr / med if med > 0 else 0.0)


def with_comm(table: CostTable, graph: ModelGraph, comm: CommModel) -> CostTable:
    """``table`` with ``comm`` and the gradient buckets recomputed for it."""
    return table.model_copy(update={
        "comm": comm, "buckets": gradient_buckets(graph, comm, table.bucket_cap_bytes),
        "notes": [*table.notes, f"comm: {comm.bottleneck}: {comm.bandwidth_gb_per_s:.3g} GB/s, "
                                f"{comm.latency_us:.3g} us per hop ({comm.source})"]})


def derive(table: CostTable, devices: Iterable[str]) -> CostTable:
    """The table plus entries for derived CPUs (``cpu/F``), built from its ``cpu`` entries.

    A derived CPU's rank runs on this CPU with every op's measured compute stretched ``F``x
    (:mod:`qsync_opt.runtime.emulate`): its entries and casts are the ``cpu`` ones times
    ``F``, restricted to its precision menu; the optimizer step is not stretched and keeps
    the ``cpu`` time. Devices already in the table are left as they are.
    """
    have = {e.device for e in table.entries}
    entries, casts, opt = list(table.entries), list(table.casts), list(table.optimizer)
    notes = list(table.notes)
    for name in devices:
        key = canonical_name(name)
        if key in have or not is_derived(key):
            continue
        if "cpu" not in have:
            raise QsyncInputError(f"derive: {key} is built from cpu, and the table has no cpu "
                                  "entries (profile this CPU first)")
        spec = get_device(key)
        f = float(spec.slowdown or 1.0)
        menu = set(spec.precisions)
        entries += [e.model_copy(update={"device": key, "fwd_ms": e.fwd_ms * f,
                                         "bwd_ms": e.bwd_ms * f})
                    for e in table.entries if e.device == "cpu"
                    and (e.precision in menu or e.precision == Precision.fp32)]
        # int4 (opt-in) runs on this CPU through the int8 kernels, values in int8 storage:
        # where the cpu was not profiled at int4, its int8 times are int4's.
        int4_from_int8 = Precision.int4 in menu and not any(
            e.device == "cpu" and e.precision == Precision.int4 for e in table.entries)
        if int4_from_int8:
            entries += [e.model_copy(update={"device": key, "precision": Precision.int4,
                                             "fwd_ms": e.fwd_ms * f, "bwd_ms": e.bwd_ms * f})
                        for e in table.entries
                        if e.device == "cpu" and e.precision == Precision.int8]
        casts += [c.model_copy(update={"device": key, "a_ms_per_element": c.a_ms_per_element * f,
                                       "b_ms": c.b_ms * f})
                  for c in table.casts if c.device == "cpu"]
        if int4_from_int8:
            casts += [c.model_copy(update={"device": key, "dst": DType.int4,
                                           "a_ms_per_element": c.a_ms_per_element * f,
                                           "b_ms": c.b_ms * f})
                      for c in table.casts if c.device == "cpu" and c.dst == DType.int8]
        opt += [o.model_copy(update={"device": key}) for o in table.optimizer
                if o.device == "cpu"]
        notes.append(f"{key}: derived from the cpu entries, every op and cast x{f:g} (the "
                     "runtime stretches that rank's measured compute); optimizer step as cpu")
        if "cpu" in table.environment:
            env = {**table.environment, key: {**table.environment["cpu"],
                                              "derived": f"cpu x{f:g}"}}
            table = table.model_copy(update={"environment": env})
        have.add(key)
    return table.model_copy(update={"entries": entries, "casts": casts, "optimizer": opt,
                                    "notes": notes})


def merge(tables: Sequence[CostTable]) -> CostTable:
    """One table from profiles of several machines (one per device type).

    Entries, casts and optimizer costs keep their device and source; notes are concatenated
    (each profile's notes already name its device; untagged ones get ``[tableN]``). The comm
    model and buckets are taken from the first table whose comm was measured, else the first.
    Tables for different graphs, or two tables for the same device, are refused.
    """
    if not tables:
        raise QsyncInputError("merge: no cost tables given")
    first = tables[0]
    for i, t in enumerate(tables[1:], 1):
        if t.graph_hash != first.graph_hash:
            raise QsyncInputError(
                f"merge: table {i} is for graph {t.graph_hash} ({t.workload}), table 0 for "
                f"{first.graph_hash} ({first.workload}); profile the same traced graph")
    flows = {t.activation_flow for t in tables}
    if len(flows) > 1:
        raise QsyncInputError(
            "merge: the tables describe different activation flows "
            f"({', '.join(f'table {i}: {t.activation_flow}' for i, t in enumerate(tables))}); "
            "profile every device with the same --method (context gives 'fp32'), or use "
            "estimates ('native') for all of them")
    seen: dict[str, int] = {}
    for i, t in enumerate(tables):
        for dev in sorted({e.device for e in t.entries}):
            if dev in seen:
                raise QsyncInputError(f"merge: device {dev} appears in tables {seen[dev]} and {i}")
            seen[dev] = i
    base = next((t for t in tables if t.comm.source == "measured"), first)
    notes: list[str] = []
    for t in tables:
        devs = sorted({e.device for e in t.entries})
        for n in t.notes:
            notes.append(n if any(n.startswith(f"{d}:") for d in devs)
                         else f"[{','.join(devs)}] {n}")
    notes.append(f"merged from {len(tables)} tables; comm and buckets from the table of "
                 f"{', '.join(sorted({e.device for e in base.entries}))}")
    return CostTable(
        workload=first.workload, graph_hash=first.graph_hash,
        entries=[e for t in tables for e in t.entries],
        casts=[c for t in tables for c in t.casts],
        comm=base.comm, buckets=base.buckets, bucket_cap_bytes=base.bucket_cap_bytes,
        optimizer=[o for t in tables for o in t.optimizer],
        efficiencies=base.efficiencies, notes=notes, activation_flow=first.activation_flow,
        environment={k: v for t in tables for k, v in t.environment.items()})
