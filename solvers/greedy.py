"""QSync's allocator: start fast, then raise precision where it buys the most.

The algorithm of the paper (docs/PAPERS.md, QSync allocator paragraph), over every device group:

1. **Start** from the fastest plan that fits memory on each group: per unit the choice with
   the least unary time (ties to the lower precision); while the group does not fit, move
   the unit whose move saves the most memory (with its current neighbours) to that choice.
   A start that does not fit, or that misses the target, ends the solve: INFEASIBLE.
2. **Raise.** A max-heap holds, per (group, unit), the indicator gain of raising the unit
   one step on that group's menu, ``weight_g * (Omega[u][k] - Omega[u][k-1])``. Pop, apply
   the move, check it; keep it only if every group fits memory and the makespan stays
   within the target, then push the unit's next step. A rejected move is undone at once.
3. **Sweep.** Raising one op can remove casts and make the iteration faster, so after the
   heap empties the rejected moves are tried again (a bounded number of sweeps) while any is
   accepted, each acceptance feeding the heap again.

The check is pluggable (``SolveOptions.acceptance``):

* ``"replayer"`` (QSync's way): an :class:`~qsync_opt.replayer.IncrementalReplay` of the
  whole cluster re-scores every move: replayer iteration time <= target and every group's
  replayer peak memory <= its capacity (after headroom).
* ``"linear"``: the problem's linear model, updated per move in O(degree of the unit):
  group time <= ``group_budget_ms()`` and group memory <= capacity.

Two flaws of QSync's public code are avoided: the time effect of a move is always measured
with the unit's current neighbours (its casts against their precisions), and a rejected
move leaves nothing behind in the plan or in the replay.

``Greedy(per_ms=True)`` ("greedy-per-ms") ranks moves by gain per millisecond of added
linear time instead (a move that saves time ranks first); the added time depends on the
neighbours' current precisions, so a popped entry is re-evaluated and pushed back when its
rank changed.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Mapping, Sequence

from ..errors import QsyncInputError
from ..precision import Precision
from ..problem import AllocationProblem, DerivedUnit, GroupModel, _widest_precision
from ..replayer import Change, IncrementalReplay
from ..schemas import Plan, SolveReport
from . import SolveOptions
from ._common import Stopwatch, finish, mode_text

log = logging.getLogger(__name__)

#: Relative slack of the acceptance checks, well inside the evaluator's (EVAL_TOL = 1e-7),
#: so float drift of incremental sums cannot flip a verdict the evaluator would give.
REL_TOL = 1e-9
#: How many times the rejected moves are re-tried after the heap empties.
MAX_SWEEPS = 8
ACCEPTANCES = ("replayer", "linear")


class LinearState:
    """Every group's assignment with its linear time and memory, kept up to date per move.

    The assignment is held in the problem's extended unit space: the real units, then the
    derived units (promoting ops whose dtype follows their inputs', ``GroupModel.derived``),
    so a move of unit u also moves the derived units downstream of it. Each unit's pair terms
    and derived dependants are indexed once, so a move costs O(degree of the unit); the
    working-set term (a max over units) is kept as a running maximum.
    """

    def __init__(self, problem: AllocationProblem, assignment: Mapping[str, Sequence[int]]
                 ) -> None:
        self.groups: list[GroupModel] = list(problem.groups)
        self.a: list[list[int]] = []  # extended assignment per group
        self.ext: list[list[tuple[Precision, ...]]] = []
        self.adj: list[list[list[int]]] = []  # pair indices per extended unit
        self.downstream: list[list[list[DerivedUnit]]] = []  # derived units a unit reaches
        self.time: list[float] = []
        self.mem_sum: list[float] = []  # memory without the working-set max
        self.work: list[list[float]] = []
        self.work_max: list[float] = []
        for g in self.groups:
            full = g.complete(assignment[g.name]) if g.derived else list(assignment[g.name])
            self.a.append(full)
            self.ext.append(g.all_choices)
            adj: list[list[int]] = [[] for _ in g.time1]
            for pi, p in enumerate(g.pairs):
                adj[p.a].append(pi)
                adj[p.b].append(pi)
            self.adj.append(adj)
            # The derived units each unit reaches through derived units, in index order
            # (derived units are listed in graph order, so inputs come first).
            consumers: dict[int, list[DerivedUnit]] = {}
            for d in g.derived:
                for x in d.inputs:
                    consumers.setdefault(x, []).append(d)
            down: list[list[DerivedUnit]] = []
            for v in range(len(g.time1)):
                found: dict[int, DerivedUnit] = {}
                stack = [v]
                while stack:
                    for d in consumers.get(stack.pop(), ()):
                        if d.index not in found:
                            found[d.index] = d
                            stack.append(d.index)
                down.append([found[i] for i in sorted(found)])
            self.downstream.append(down)
            self.time.append(g.time_ms(assignment[g.name]))
            self.mem_sum.append(
                g.mem0 + sum(row[c] for row, c in zip(g.mem1, full, strict=True))
                + sum(p.mem[full[p.a]][full[p.b]] for p in g.pairs))
            w = [row[c] for row, c in zip(g.work1, full, strict=True)]
            self.work.append(w)
            self.work_max.append(max([g.work0, *w]))

    def assignment(self) -> dict[str, list[int]]:
        """The real units' choices per group."""
        return {g.name: a[:g.n_units] for g, a in zip(self.groups, self.a, strict=True)}

    def changes(self, gi: int, u: int, k: int) -> dict[int, int]:
        """Extended unit -> new choice if unit u moved to k (u and the derived units that
        change with it)."""
        a = self.a[gi]
        new = {u: k}
        ext = self.ext[gi]
        for d in self.downstream[gi][u]:
            dtypes = {ext[x][new.get(x, a[x])].info.gives_out for x in d.inputs}
            c = d.choices.index(_widest_precision(dtypes))
            if c != a[d.index]:
                new[d.index] = c
        return new

    def delta(self, gi: int, u: int, k: int) -> tuple[float, float]:
        """(added time, added memory without the working set) of moving unit u to k."""
        return self._delta(gi, self.changes(gi, u, k))

    def _delta(self, gi: int, new: dict[int, int]) -> tuple[float, float]:
        g, a = self.groups[gi], self.a[gi]
        dt = dm = 0.0
        seen: set[int] = set()
        for v, kv in new.items():
            old = a[v]
            dt += g.time1[v][kv] - g.time1[v][old]
            dm += g.mem1[v][kv] - g.mem1[v][old]
            for pi in self.adj[gi][v]:
                if pi in seen:
                    continue
                seen.add(pi)
                p = g.pairs[pi]
                oa, ob = a[p.a], a[p.b]
                na, nb = new.get(p.a, oa), new.get(p.b, ob)
                dt += p.time[na][nb] - p.time[oa][ob]
                dm += p.mem[na][nb] - p.mem[oa][ob]
        return dt, dm

    def move(self, gi: int, u: int, k: int) -> None:
        new = self.changes(gi, u, k)
        dt, dm = self._delta(gi, new)
        g, a, w = self.groups[gi], self.a[gi], self.work[gi]
        self.time[gi] += dt
        self.mem_sum[gi] += dm
        rescan = False
        for v, kv in new.items():
            a[v] = kv
            old_w, new_w = w[v], g.work1[v][kv]
            w[v] = new_w
            if new_w >= self.work_max[gi]:
                self.work_max[gi] = new_w
            elif old_w >= self.work_max[gi]:
                rescan = True
        if rescan:
            self.work_max[gi] = max([g.work0, *w])

    def memory(self, gi: int) -> float:
        return self.mem_sum[gi] + self.work_max[gi]

    def memory_after(self, gi: int, u: int, k: int) -> float:
        """The group's memory if unit u moved to choice k (for ranking memory savings)."""
        new = self.changes(gi, u, k)
        _, dm = self._delta(gi, new)
        g, w = self.groups[gi], self.work[gi]
        work = max([g.work0, *(g.work1[v][new[v]] if v in new else x for v, x in enumerate(w))])
        return self.mem_sum[gi] + dm + work


class LinearAcceptance:
    """The linear model's check, read off the :class:`LinearState` the allocator keeps."""

    name = "linear"

    def __init__(self, problem: AllocationProblem, lin: LinearState) -> None:
        self.lin = lin
        self.budget = problem.group_budget_ms()
        self.target = problem.target_ms
        self.tail = problem.tail_ms
        self.checks = 0

    @property
    def calls(self) -> int:
        return 0

    def apply(self, gi: int, u: int, k: int) -> None:
        """Nothing to do: the allocator moves the shared linear state itself."""

    def group_memory(self, gi: int) -> float:
        return self.lin.memory(gi)

    def ok(self, gi: int) -> bool:
        """Group gi within its time budget and capacity (a move changes only its group)."""
        self.checks += 1
        g = self.lin.groups[gi]
        return (self.lin.time[gi] <= self.budget + REL_TOL * self.target
                and self.lin.memory(gi) <= g.capacity_bytes * (1 + REL_TOL))

    def makespan_ms(self) -> float:
        return max(self.lin.time) + self.tail


class ReplayAcceptance:
    """QSync's check: the incremental replayer of the whole cluster after every move.

    Every op of a tie unit is set; a rejected move is undone by setting the old precision
    back, which re-costs the same neighbourhood, so the replay equals a fresh replay of the
    plan that was kept.
    """

    name = "replayer"

    def __init__(self, problem: AllocationProblem, assignment: dict[str, Sequence[int]]) -> None:
        self.problem = problem
        self.groups = problem.groups
        self.target = problem.target_ms
        self.inc: IncrementalReplay = problem.replayer.incremental(problem.precisions(assignment))
        self.change: Change = self.inc.state()
        self.checks = 0

    @property
    def calls(self) -> int:
        return self.inc.calls

    def apply(self, gi: int, u: int, k: int) -> None:
        g = self.groups[gi]
        p = g.choices[u][k]
        for op in self.problem.units[u].ops:
            self.change = self.inc.set(g.name, op, p)

    def group_memory(self, gi: int) -> float:
        return float(self.change.peak_memory_bytes[self.groups[gi].name])

    def ok(self, gi: int) -> bool:
        """Replayer iteration within the target and every group within its capacity."""
        self.checks += 1
        ch = self.change
        if ch.iteration_ms > self.target * (1 + REL_TOL):
            return False
        return all(ch.peak_memory_bytes[g.name] <= g.capacity_bytes * (1 + REL_TOL)
                   for g in self.groups)

    def makespan_ms(self) -> float:
        return self.change.iteration_ms


Acceptance = LinearAcceptance | ReplayAcceptance


class Greedy:
    """QSync's greedy allocator (``per_ms``: rank moves by gain per added millisecond)."""

    exact = False

    def __init__(self, per_ms: bool = False) -> None:
        self.per_ms = per_ms
        self.name = "greedy-per-ms" if per_ms else "greedy"

    def is_available(self) -> bool:
        return True

    # ------------------------------------------------------------------ the start

    @staticmethod
    def fastest(problem: AllocationProblem) -> dict[str, list[int]]:
        """Per unit the choice with the least unary time, ties to the lower precision."""
        out: dict[str, list[int]] = {}
        for g in problem.groups:
            row = []
            for times in g.time1[:g.n_units]:
                best = min(times)
                tol = 1e-12 * max(abs(best), 1.0)
                row.append(max(k for k, t in enumerate(times) if t <= best + tol))
            out[g.name] = row
        return out

    @staticmethod
    def _fit_memory(lin: LinearState, acc: Acceptance, gi: int) -> tuple[bool, float, int]:
        """Move units of group gi to lower-memory choices, largest saving first, until the
        group fits (by the acceptance's memory). Returns (fits, bytes, moves)."""
        g = lin.groups[gi]
        moves = 0
        while acc.group_memory(gi) > g.capacity_bytes * (1 + REL_TOL):
            now = lin.memory(gi)
            best: tuple[float, int, int] | None = None
            for u, ch in enumerate(g.choices):
                for k in range(len(ch)):
                    if k == lin.a[gi][u]:
                        continue
                    after = lin.memory_after(gi, u, k)
                    # largest saving first; ties to the lower precision
                    if after < now and (best is None or (after, -k) < (best[0], -best[2])):
                        best = (after, u, k)
            if best is None:
                return False, acc.group_memory(gi), moves
            _, u, k = best
            lin.move(gi, u, k)
            acc.apply(gi, u, k)
            moves += 1
        return True, acc.group_memory(gi), moves

    # ------------------------------------------------------------------ the solve

    def solve(self, problem: AllocationProblem, options: SolveOptions
              ) -> tuple[Plan | None, SolveReport]:
        sw = Stopwatch()
        mode = mode_text(problem)
        if options.acceptance not in ACCEPTANCES:
            raise QsyncInputError(
                f"acceptance: expected {' or '.join(ACCEPTANCES)}, got {options.acceptance!r}")
        messages: list[str] = [
            f"{self.name}: QSync's allocator, "
            + ("moves ranked by indicator gain per added millisecond (linear time with the "
               "current neighbours, re-evaluated lazily)" if self.per_ms else
               "moves ranked by indicator gain")
            + f"; each move checked by the {options.acceptance} model"]
        ignored = [n for n, v in (("hints", options.hints), ("warm_start", options.warm_start))
                   if v is not None]
        if ignored:
            messages.append(f"{self.name} ignores {', '.join(ignored)} (it builds its own start)")
        with sw.building():
            start = self.fastest(problem)
            lin = LinearState(problem, start)
            acc: Acceptance = (ReplayAcceptance(problem, start) if options.acceptance == "replayer"
                               else LinearAcceptance(problem, lin))

        def extra() -> dict[str, object]:
            return {"replayer_calls": acc.calls, "checks": acc.checks, "accepted": accepted,
                    "per_ms": self.per_ms}

        accepted = 0
        groups = lin.groups
        with sw.solving():
            # 1. The fastest plan that fits memory, group by group.
            for gi, g in enumerate(groups):
                fits, need, moves = self._fit_memory(lin, acc, gi)
                if moves:
                    messages.append(f"start: {moves} unit(s) of group {g.name} moved to "
                                    "lower-memory choices to fit")
                if not fits:
                    messages.append(
                        f"group {g.name} ({g.device}) cannot fit memory: the smallest plan found "
                        f"needs {need / 2**30:.3f} GiB ({need:.0f} bytes) against a capacity of "
                        f"{g.capacity_bytes / 2**30:.3f} GiB ({g.capacity_bytes:.0f} bytes); lower "
                        "its batch or the memory headroom")
                    return finish(problem, self.name, None, status="INFEASIBLE", mode=mode,
                                  options=options, sw=sw, messages=messages,
                                  extra_options=extra())
            start_ms = acc.makespan_ms()
            if not all(acc.ok(gi) for gi in range(len(groups))):
                messages.append(
                    f"the fastest memory-feasible plan takes {start_ms:.3f} ms ({acc.name} "
                    f"makespan) against the target {problem.target_ms:.3f} ms: no plan of this "
                    "allocator meets it; raise the target or give the slower groups a smaller "
                    "batch (dynamic-batching)")
                return finish(problem, self.name, None, status="INFEASIBLE", mode=mode,
                              options=options, sw=sw, messages=messages,
                              extra_options={**extra(), "fastest_makespan_ms": start_ms})
            messages.append(f"start: fastest plan, {start_ms:.3f} ms ({acc.name} makespan) "
                            f"against the target {problem.target_ms:.3f} ms")

            # 2. The heap of raises.
            heap: list[tuple[float, int, int, int]] = []  # (-rank, gi, u, from choice k)

            def gain(gi: int, u: int, k: int) -> float:
                om = groups[gi].omega1[u]
                return groups[gi].weight * (om[k] - om[k - 1])

            def rank(gi: int, u: int, k: int) -> float:
                gv = gain(gi, u, k)
                if not self.per_ms:
                    return gv
                dt, _ = lin.delta(gi, u, k - 1)
                return gv / max(dt, 1e-9)

            def push(gi: int, u: int) -> None:
                k = lin.a[gi][u]
                if k > 0 and gain(gi, u, k) > 0:
                    r = rank(gi, u, k)
                    heapq.heappush(heap, (-r, gi, u, k))

            for gi, g in enumerate(groups):
                for u in range(len(g.choices)):
                    push(gi, u)

            def attempt(gi: int, u: int, k: int) -> bool:
                """Raise unit u on group gi from k to k-1; undo it if the check fails."""
                lin.move(gi, u, k - 1)
                acc.apply(gi, u, k - 1)
                if acc.ok(gi):
                    return True
                lin.move(gi, u, k)
                acc.apply(gi, u, k)
                return False

            rejected: list[tuple[float, int, int, int]] = []
            stopped = False

            def try_move(neg: float, gi: int, u: int, k: int) -> bool:
                """Check one raise; keep it (and queue the unit's next) or note the refusal."""
                nonlocal accepted
                if attempt(gi, u, k):
                    accepted += 1
                    push(gi, u)
                    return True
                rejected.append((neg, gi, u, k))
                return False

            def drain() -> int:
                nonlocal stopped
                n = 0
                while heap:
                    if sw.wall_s > options.time_limit_s:
                        stopped = True
                        return n
                    neg, gi, u, k = heapq.heappop(heap)
                    if lin.a[gi][u] != k:
                        continue  # stale
                    if self.per_ms:
                        r = rank(gi, u, k)
                        if abs(r - (-neg)) > 1e-12 * max(abs(r), 1.0):
                            heapq.heappush(heap, (-r, gi, u, k))
                            continue
                    n += try_move(neg, gi, u, k)
                return n

            drain()
            # 3. Sweeps over the rejected moves.
            sweeps = 0
            swept = 0
            while rejected and not stopped and sweeps < MAX_SWEEPS:
                sweeps += 1
                todo = sorted(rejected)
                rejected.clear()
                got = 0
                for neg, gi, u, k in todo:
                    if lin.a[gi][u] != k:
                        continue
                    got += try_move(neg, gi, u, k)
                got += drain()
                swept += got
                if not got:
                    break
            if sweeps:
                messages.append(
                    f"after the heap emptied, {sweeps} sweep(s) re-tried the rejected moves "
                    f"(raising an op can remove casts and free time for others): {swept} more "
                    f"accepted, {len(rejected)} still rejected")
            status = "FEASIBLE"
            if stopped:
                status = "TIME_LIMIT"
                messages.append(f"stopped at the time limit ({options.time_limit_s} s); the plan "
                                "so far satisfies the check")
            end_ms = acc.makespan_ms()
            messages.append(
                f"{accepted} move(s) accepted in {acc.checks} check(s)"
                + (f", {acc.calls} replayer call(s)" if acc.calls else "")
                + f"; {acc.name} makespan {end_ms:.3f} ms")
        assignment = lin.assignment()
        ext = {**extra(), "sweeps": sweeps, "makespan_ms": end_ms}
        return finish(problem, self.name, assignment, status=status, mode=mode, options=options,
                      sw=sw, messages=messages, extra_options=ext)
