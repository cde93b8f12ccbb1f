"""The replayer's event loop: one iteration, op by op on each group's compute stream, the
gradient buckets through the sync model, the optimizer step, the critical path."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qsync_opt.core.precision import Precision
from qsync_opt.documents.schemas import ClusterSpec, CostTable, ModelGraph, Plan
from qsync_opt.replayer.incremental import IncrementalReplay
from qsync_opt.replayer.prepared import PreparedReplay
from qsync_opt.replayer.syncmodel import PeriodicSync, SyncSchedule
from qsync_opt.replayer.timeline import Event, GroupTimeline, Timeline


class Replayer(PreparedReplay):
    """Prepared simulation of one (graph, cluster, costs): build once, replay many plans.

    ``optimizer`` is ``"sgd"`` (momentum) or ``"adam"``; ``sync`` the synchronisation model
    (DDP all-reduce by default); ``bucket_cap_bytes`` re-buckets the gradients (default: the
    CostTable's buckets); ``context_bytes`` is reserved per GPU device (0 on the CPU).
    :meth:`simulate` is the event loop; :meth:`incremental` the fast path.
    """

    # ------------------------------------------------------------------ the event loop

    def simulate(self, plan: Plan | Mapping[str, Mapping[str, Precision | str]],
                 *, events: bool = True) -> Timeline:
        """Simulate one iteration (the event-loop oracle); ``events=False`` skips the list."""
        precs = self.precisions_for(plan)
        rules = self.rules
        all_events: list[Event] = []
        ready: list[list[float]] = []
        per_group: list[dict[str, Any]] = []
        for grp, prec in zip(self.groups, precs, strict=True):
            din, dout = rules.dtypes(prec)
            t = 0.0
            cast_ms = 0.0
            n_casts = 0
            done_bwd = [0.0] * self.n
            items = [rules.op_items(grp, i, prec, din, dout, named=events) for i in range(self.n)]
            # Forward in order, then backward in reverse, on one compute stream; every item
            # that is not the op itself is a cast.
            for phase, order, op_kind in ((0, range(self.n), "fwd"),
                                          (1, range(self.n - 1, -1, -1), "bwd")):
                for i in order:
                    for kind, name, ms, args in items[i][phase]:
                        if events:
                            all_events.append(Event(grp.name, "compute", kind, name, t, ms, args))
                        if kind != op_kind:
                            cast_ms += ms
                            n_casts += 1
                        t += ms
                    if phase == 1:
                        done_bwd[i] = t
                if phase == 0:
                    fwd_end = t
            ready.append([done_bwd[f] for f in self.bucket_first])
            terms = [rules.mem_terms(grp, i, prec, din, dout) for i in range(self.n)]
            mem = rules.peak_memory(grp, [[t[c] for t in terms]
                                          for c in range(rules.n_mem_terms)])
            per_group.append({"fwd": fwd_end, "bwd": t - fwd_end, "end_bwd": t,
                              "cast": cast_ms, "n_casts": n_casts, "mem": mem})
        sched = self.sync.schedule(ready, self.bucket_ms)
        ev_list: list[Event] | None = all_events if events else None
        if events and not isinstance(self.sync, PeriodicSync):
            for grp in self.groups:
                for k, (s, e) in enumerate(zip(sched.start_ms, sched.end_ms, strict=True)):
                    all_events.append(Event(grp.name, "comm", "allreduce", f"bucket {k}", s, e - s,
                                            {"bytes": self.costs.buckets[k].bytes
                                             if k < len(self.costs.buckets) else None}))
        return self._finish(per_group, ready, sched, ev_list)

    def _finish(self, per_group: list[dict[str, Any]], ready: list[list[float]],
                sched: SyncSchedule, events: list[Event] | None) -> Timeline:
        comm_end = sched.comm_end_ms
        slowest_bwd = max(pg["end_bwd"] for pg in per_group)
        groups: dict[str, GroupTimeline] = {}
        for grp, pg in zip(self.groups, per_group, strict=True):
            start_opt = max(pg["end_bwd"], comm_end) + self.stats_sync_ms
            end = start_opt + grp.optimizer_ms + self.buffer_sync_ms
            if events is not None:
                events.append(Event(grp.name, "compute", "optimizer", f"{self.optimizer} step",
                                    start_opt, grp.optimizer_ms, None))
            mem = pg["mem"]
            groups[grp.name] = GroupTimeline(
                name=grp.name, device=grp.device, batch_per_device=grp.batch,
                forward_ms=pg["fwd"], backward_ms=pg["bwd"], cast_ms=pg["cast"],
                n_casts=pg["n_casts"], optimizer_ms=grp.optimizer_ms, end_ms=end,
                exposed_comm_ms=max(0.0, comm_end - max(pg["end_bwd"], slowest_bwd)),
                straggler_wait_ms=slowest_bwd - pg["end_bwd"],
                memory=mem, peak_memory_bytes=int(sum(mem.values())), capacity_bytes=grp.capacity)
        iteration = max(g.end_ms for g in groups.values())
        return Timeline(iteration_ms=iteration, groups=groups, bucket_start_ms=sched.start_ms,
                        bucket_end_ms=sched.end_ms,
                        critical_path=self._critical_path(groups, ready, sched),
                        events=events if events is not None else [],
                        bucket_ready_ms=[list(r) for r in ready])

    def _critical_path(self, groups: dict[str, GroupTimeline], ready: list[list[float]],
                       sched: SyncSchedule) -> list[dict[str, Any]]:
        """The chain of work that sets the iteration time, latest first then reversed."""
        last = max(groups.values(), key=lambda g: g.end_ms)
        path: list[dict[str, Any]] = [{"kind": "optimizer", "group": last.name,
                                       "start_ms": last.end_ms - last.optimizer_ms,
                                       "end_ms": last.end_ms}]
        comm_end = sched.comm_end_ms
        bwd_end = last.compute_ms
        if not sched.end_ms or bwd_end >= comm_end:
            path.append({"kind": "compute", "group": last.name, "start_ms": 0.0,
                         "end_ms": bwd_end})
            return list(reversed(path))
        k = len(sched.end_ms) - 1
        while k >= 0:
            path.append({"kind": "allreduce", "bucket": k, "start_ms": sched.start_ms[k],
                         "end_ms": sched.end_ms[k]})
            g_idx = max(range(len(ready)), key=lambda g: ready[g][k])
            prev_end = sched.end_ms[k - 1] if k > 0 else 0.0
            if ready[g_idx][k] >= prev_end:
                path.append({"kind": "compute", "group": self.groups[g_idx].name,
                             "start_ms": 0.0, "end_ms": ready[g_idx][k],
                             "until": f"backward of {self.ops[self.bucket_first[k]].name}"})
                break
            k -= 1
        return list(reversed(path))

    def incremental(self, plan: Plan | Mapping[str, Mapping[str, Precision | str]]
                    ) -> IncrementalReplay:
        """A stateful replay of ``plan`` that answers one-op changes quickly."""
        return IncrementalReplay(self, plan)


def simulate(graph: ModelGraph, cluster: ClusterSpec, costs: CostTable,
             plan: Plan | Mapping[str, Mapping[str, Precision | str]], **kw: Any) -> Timeline:
    """Simulate one training iteration of ``plan`` (see :class:`Replayer` for options)."""
    return Replayer(graph, cluster, costs, **kw).simulate(plan)
