"""QSync's allocator: start fast, then raise precision where it buys the most.

The algorithm of the paper (docs/PAPERS.md, QSync allocator paragraph), over every device group:

1. **Start** from the fastest plan that fits memory on each group, casts counted. From
   each candidate (per unit the choice with the least unary time, ties to the lower
   precision; and each uniform precision, since casts favour uniform plans): while the
   group does not fit, move the unit whose move saves the most memory (with its current
   neighbours) to that choice; then a single-unit descent on the group's time with every
   cast against the current neighbours. The fastest candidate wins. Where it misses the
   group's time budget or memory, the exact fastest plan (``solvers.fastest.fastest_plans``:
   least time under memory, HiGHS or CBC) replaces it, so a start exists whenever any plan
   meets the target. A group with no start ends the solve: INFEASIBLE, with the figure.
2. **Raise.** A max-heap holds, per (group, unit), the indicator gain of raising the unit
   one step on that group's menu, ``weight_g * (Omega[u][k] - Omega[u][k-1])``. Pop, apply
   the move, check it; keep it only if every group fits memory and the makespan stays
   within the target, then push the unit's next step. A rejected move is undone at once.
3. **Sweep.** Raising one op can remove casts and make the iteration faster, so after the
   heap empties the rejected moves are tried again (a bounded number of sweeps) while any is
   accepted, each acceptance feeding the heap again.

The check is pluggable (``SolveOptions.acceptance``):

* ``"replayer"`` (QSync's way): an :class:`~qsync_opt.replayer.IncrementalReplay` of the
  whole cluster re-scores every move: the makespan as the target defines it, every group's
  replayer compute (casts included) plus the tail (last bucket, optimizer), <= target, and
  every group's replayer peak memory <= its capacity (after headroom); the evaluator's
  linear rows must hold too, so every plan returned is one ``evaluate`` calls feasible.
  The replayer's whole iteration (with the all-reduce the backward leaves exposed) is
  reported, not checked: the target does not count it.
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
from typing import NamedTuple

from qsync_opt.solvers.acceptance import (
    ACCEPTANCES,
    REL_TOL,
    Acceptance,
    LinearAcceptance,
    LinearState,
    ReplayAcceptance,
)
from qsync_opt.solvers.base import SolveOptions
from qsync_opt.solvers.checks import cheap_infeasibility, check_numbers
from qsync_opt.solvers.fastest import FastestTimeLimit, group_fastest
from qsync_opt.solvers.report import finish, mode_text
from qsync_opt.solvers.timing import Stopwatch

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.documents.schemas import Plan, SolveReport
from qsync_opt.problem.groupmodel import GroupModel
from qsync_opt.problem.program import AllocationProblem

log = logging.getLogger(__name__)

#: How many times the rejected moves are re-tried after the heap empties.
MAX_SWEEPS = 8
#: At most this many sweeps of the start's single-unit descent per candidate.
MAX_DESCENT_SWEEPS = 20




class _StartFailure(NamedTuple):
    """Why no start exists: ``kind`` "memory" (``figure``: the smallest bytes found), "time"
    (the fastest makespan found, ms) or "time_limit" (none found in time) on ``group``."""

    kind: str
    group: GroupModel
    figure: float
    note: str


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
    def _fit_memory(lin: LinearState, gi: int, deadline: float = float("inf"),
                    sw: Stopwatch | None = None) -> tuple[bool, float, int]:
        """Move units of group gi to lower-memory choices, largest saving first, until the
        group fits (the linear memory, which the replayer's never exceeds) or ``sw.wall_s``
        passes ``deadline``. Returns (fits, bytes, moves)."""
        g = lin.groups[gi]
        moves = 0
        while lin.memory(gi) > g.capacity_bytes * (1 + REL_TOL):
            if sw is not None and sw.wall_s > deadline:
                return False, lin.memory(gi), moves
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
                return False, lin.memory(gi), moves
            _, u, k = best
            lin.move(gi, u, k)
            moves += 1
        return True, lin.memory(gi), moves

    @staticmethod
    def _descend(lin: LinearState, gi: int, deadline: float, sw: Stopwatch) -> int:
        """Single-unit descent on group gi's time, casts against the current neighbours
        included: sweep the units, moving each to its choice that saves the most time while
        the group still fits memory, until a sweep saves nothing. Returns the moves made."""
        g = lin.groups[gi]
        cap = g.capacity_bytes * (1 + REL_TOL)
        moves = 0
        for _ in range(MAX_DESCENT_SWEEPS):
            moved = False
            for u, ch in enumerate(g.choices):
                if len(ch) < 2:
                    continue
                if sw.wall_s > deadline:
                    return moves
                cur = lin.a[gi][u]
                tol = 1e-12 * max(abs(lin.time[gi]), 1.0)
                best_dt, best_k = -tol, -1
                for k in range(len(ch)):
                    if k == cur:
                        continue
                    dt, _ = lin.delta(gi, u, k)
                    if dt < best_dt and lin.memory_after(gi, u, k) <= cap:
                        best_dt, best_k = dt, k
                if best_k >= 0:
                    lin.move(gi, u, best_k)
                    moves += 1
                    moved = True
            if not moved:
                break
        return moves

    def _start_group(self, lin: LinearState, gi: int, deadline: float, sw: Stopwatch
                     ) -> tuple[str, float, list[int], int] | None:
        """The fastest memory-feasible start this allocator finds for group gi, cast-aware:
        from the unary-fastest plan and from each uniform precision (casts favour a uniform
        plan), fit memory, then descend; the fastest wins. (name, ms, assignment, units moved
        to fit memory), or None when no candidate fits memory. Leaves group gi at the
        winner."""
        g = lin.groups[gi]
        fast = list(lin.a[gi][:g.n_units])
        cands: list[tuple[str, list[int]]] = [("unary-fastest", fast)]
        for p in sorted({p for ch in g.choices for p in ch}, key=lambda q: q.info.rank):
            a = [ch.index(p) if p in ch else fast[u] for u, ch in enumerate(g.choices)]
            if all(a != c for _, c in cands):
                cands.append((f"uniform {p.value}", a))
        best: tuple[str, float, list[int], int] | None = None
        for name, a in cands:
            lin.load(gi, a)
            fits, _, fit_moves = self._fit_memory(lin, gi, deadline, sw)
            if sw.wall_s > deadline and best is not None:
                break
            if not fits:
                continue
            self._descend(lin, gi, deadline, sw)
            if best is None or lin.time[gi] < best[1]:
                best = (name, lin.time[gi], list(lin.a[gi][:g.n_units]), fit_moves)
            if sw.wall_s > deadline:
                break
        if best is not None:
            lin.load(gi, best[2])
        return best

    def _start(self, problem: AllocationProblem, lin: LinearState, options: SolveOptions,
               sw: Stopwatch, messages: list[str]) -> _StartFailure | None:
        """Set ``lin`` to the start: per group the fastest plan that fits memory, found by
        :meth:`_start_group` and, where that misses the group's time budget or memory, by
        the exact program. None when every group has a start within its budget; else what
        failed (an unproven exact result never proves there is none: "time_limit")."""
        budget = problem.group_budget_ms()
        tol = REL_TOL * problem.target_ms
        deadline = options.time_limit_s
        for gi, g in enumerate(lin.groups):
            found = self._start_group(lin, gi, deadline, sw)
            exact_note = ""
            if found is None or found[1] > budget + tol:
                limit = options.time_limit_s - sw.wall_s
                try:
                    exact = group_fastest(problem, gi, limit)
                except FastestTimeLimit:
                    return _StartFailure("time_limit", g, 0.0, f"the exact fastest plan of "
                                         f"group {g.name} was not found in the time left")
                if exact is None:
                    exact_note = " (no MIP backend for the exact fastest plan)"
                else:
                    backend, res = exact
                    if res is not None and (found is None or res.ms < found[1]):
                        lin.load(gi, res.assignment)
                        messages.append(
                            f"start: group {g.name}: the exact fastest plan ({backend}, least "
                            f"time under memory{'' if res.proven else ', not proven'}), "
                            f"{res.ms:.4f} ms"
                            + (f"; this allocator's own start took {found[1]:.4f} ms"
                               if found is not None else "") + f" (budget {budget:.4f} ms)")
                        found = ("exact fastest", res.ms, list(res.assignment), 0)
                    if res is not None and found is not None and not res.proven \
                            and found[1] > budget + tol and not res.bound_ms > budget + tol:
                        return _StartFailure("time_limit", g, limit, (
                            f"group {g.name}: the fastest plan found takes {found[1]:.4f} ms, "
                            f"budget {budget:.4f} ms; {backend} did not prove its least time in "
                            f"{limit:.3g} s (bound {res.bound_ms:.4f} ms): a faster plan may exist"))
                    if res is None:
                        exact_note = (f" (the exact program, {backend}, found no plan"
                                      + (" that fits memory either" if found is None else "")
                                      + ")")
                    elif found is not None and found[0] != "exact fastest":
                        exact_note = (f" (the exact fastest plan, {backend}, is no faster: "
                                      f"{res.bound_ms + problem.tail_ms:.3f} ms at least)")
            if found is None:
                fits, need, _ = self._fit_memory(lin, gi, deadline, sw)
                return _StartFailure("memory", g, need, exact_note)
            if found[0] != "exact fastest":
                messages.append(
                    f"start: group {g.name}: fastest plan found from the {found[0]} plan "
                    + (f"({found[3]} unit(s) moved to lower-memory choices to fit, then "
                       "single-unit descent, " if found[3] else "(single-unit descent, ")
                    + f"casts against the neighbours counted), {found[1]:.4f} ms (budget "
                    f"{budget:.4f} ms){exact_note}")
            if found[1] > budget + tol:
                return _StartFailure("time", g, found[1] + problem.tail_ms, exact_note)
        return None

    # ------------------------------------------------------------------ the solve

    def solve(self, problem: AllocationProblem, options: SolveOptions
              ) -> tuple[Plan | None, SolveReport]:
        sw = Stopwatch()
        check_numbers(problem)
        if options.acceptance not in ACCEPTANCES:
            raise QsyncInputError(
                f"acceptance: expected {' or '.join(ACCEPTANCES)}, got {options.acceptance!r}")
        messages = self._intro(options)
        with sw.building():
            lin = LinearState(problem, self.fastest(problem))
        with sw.solving():
            # 1. The fastest plan that fits memory, group by group.
            failed = self._start(problem, lin, options, sw, messages)
        if failed is not None:
            return self._no_start(problem, failed, options, sw, messages)
        with sw.building():
            acc = (ReplayAcceptance(problem, lin.assignment(), lin)
                   if options.acceptance == "replayer" else LinearAcceptance(problem, lin))
        with sw.solving():
            start_ms = acc.makespan_ms()
            start_ok = all(acc.ok(gi) for gi in range(len(lin.groups)))
        if not start_ok:
            messages.append(
                f"the fastest memory-feasible plan takes {start_ms:.3f} ms ({acc.name} "
                f"makespan) against the target {problem.target_ms:.3f} ms, or does not fit "
                f"the {acc.name} model's memory, though the linear model admits it: no "
                "plan of this allocator meets it")
            return self._report(problem, None, "INFEASIBLE", options, sw, messages,
                                {**self._counts(acc, 0), "fastest_makespan_ms": start_ms})
        with sw.solving():
            messages.append(f"start: fastest plan, {start_ms:.3f} ms ({acc.name} makespan) "
                            f"against the target {problem.target_ms:.3f} ms")
            search = RaiseSearch(lin, acc, self.per_ms, sw, options.time_limit_s)
            search.drain()  # 2. the heap of raises
            sweeps, swept = search.sweep()  # 3. sweeps over the rejected moves
            status, counts = self._raised(problem, search, sweeps, swept, options, messages)
        return self._report(problem, lin.assignment(), status, options, sw, messages, counts)

    def _intro(self, options: SolveOptions) -> list[str]:
        """The report's first messages: what ranks and checks the moves, what is ignored."""
        messages = [
            f"{self.name}: QSync's allocator, "
            + ("moves ranked by indicator gain per added millisecond (linear time with the "
               "current neighbours, re-evaluated lazily)" if self.per_ms else
               "moves ranked by indicator gain")
            + f"; each move checked by the {options.acceptance} model"]
        ignored = [n for n, v in (("hints", options.hints), ("warm_start", options.warm_start))
                   if v is not None]
        if ignored:
            messages.append(f"{self.name} ignores {', '.join(ignored)} (it builds its own start)")
        return messages

    def _counts(self, acc: Acceptance | None, accepted: int) -> dict[str, object]:
        """The report's counts of checks and moves (``acc`` None: no move was checked)."""
        out: dict[str, object] = {"replayer_calls": acc.calls if acc else 0,
                                  "checks": acc.checks if acc else 0, "accepted": accepted,
                                  "per_ms": self.per_ms}
        if isinstance(acc, ReplayAcceptance):
            out["linear_vetoes"] = acc.vetoes
        return out

    def _report(self, problem: AllocationProblem, assignment: dict[str, list[int]] | None,
                status: str, options: SolveOptions, sw: Stopwatch, messages: list[str],
                counts: dict[str, object]) -> tuple[Plan | None, SolveReport]:
        return finish(problem, self.name, assignment, status=status, mode=mode_text(problem),
                      options=options, sw=sw, messages=messages, extra_options=counts)

    def _no_start(self, problem: AllocationProblem, failed: _StartFailure,
                  options: SolveOptions, sw: Stopwatch, messages: list[str]
                  ) -> tuple[Plan | None, SolveReport]:
        """The report when a group has no start: out of time, out of memory, or too slow."""
        counts = self._counts(None, 0)
        g = failed.group
        if failed.kind == "time_limit":
            proof = cheap_infeasibility(problem)  # the least time or memory alone may prove it
            messages.extend(proof or [f"stopped at the time limit ({options.time_limit_s:g} "
                                      f"s) before a start was found: {failed.note}"])
            return self._report(problem, None, "INFEASIBLE" if proof else "TIME_LIMIT",
                                options, sw, messages, counts)
        if failed.kind == "memory":
            need = failed.figure
            messages.append(
                f"group {g.name} ({g.device}) cannot fit memory: the smallest plan found "
                f"needs {need / 2**30:.3f} GiB ({need:.0f} bytes) against a capacity of "
                f"{g.capacity_bytes / 2**30:.3f} GiB ({g.capacity_bytes:.0f} bytes)"
                f"{failed.note}; lower its batch or the memory headroom")
            return self._report(problem, None, "INFEASIBLE", options, sw, messages, counts)
        ms = failed.figure
        messages.append(
            f"the fastest memory-feasible plan takes {ms:.3f} ms (linear makespan: "
            f"group {g.name}'s compute plus the tail){failed.note} against the "
            f"target {problem.target_ms:.3f} ms: no plan of this allocator meets it; "
            "raise the target or give the slower groups a smaller batch "
            "(dynamic-batching)")
        return self._report(problem, None, "INFEASIBLE", options, sw, messages,
                            {**counts, "fastest_makespan_ms": ms})

    def _raised(self, problem: AllocationProblem, search: RaiseSearch, sweeps: int,
                swept: int, options: SolveOptions, messages: list[str]
                ) -> tuple[str, dict[str, object]]:
        """The status and the report's counts once the raises are done, with messages."""
        acc = search.acc
        if sweeps:
            messages.append(
                f"after the heap emptied, {sweeps} sweep(s) re-tried the rejected moves "
                f"(raising an op can remove casts and free time for others): {swept} more "
                f"accepted, {len(search.rejected)} still rejected")
        status = "FEASIBLE"
        if search.stopped:
            status = "TIME_LIMIT"
            messages.append(f"stopped at the time limit ({options.time_limit_s} s); the plan "
                            "so far satisfies the check")
        end_ms = acc.makespan_ms()
        messages.append(
            f"{search.accepted} move(s) accepted in {acc.checks} check(s)"
            + (f", {acc.calls} replayer call(s)" if acc.calls else "")
            + f"; {acc.name} makespan {end_ms:.3f} ms")
        counts: dict[str, object] = {**self._counts(acc, search.accepted), "sweeps": sweeps,
                                     "makespan_ms": end_ms}
        if isinstance(acc, ReplayAcceptance):
            it = acc.iteration_ms()
            counts["replay_iteration_ms"] = it
            if acc.vetoes:
                messages.append(
                    f"{acc.vetoes} move(s) the replayer admitted were refused by the "
                    "evaluator's linear rows (its memory bounds the replayer's from above)")
            if it > problem.target_ms * (1 + REL_TOL):
                messages.append(
                    f"the replayer's whole iteration is {it:.3f} ms: {it - end_ms:.3f} ms "
                    "more of the all-reduce stays exposed than the target's definition "
                    "(compute plus the last bucket and the optimizer) counts")
        return status, counts


#: A raise in the heap: (-rank, group, unit, the choice it raises from).
RaiseEntry = tuple[float, int, int, int]


class RaiseSearch:
    """Steps 2 and 3 of the allocator: the max-heap of raises (each unit one step up its
    group's menu, ranked by indicator gain, or gain per added millisecond), each popped
    raise applied and checked (undone when refused), then sweeps over the refused ones."""

    def __init__(self, lin: LinearState, acc: Acceptance, per_ms: bool, sw: Stopwatch,
                 time_limit_s: float) -> None:
        self.lin, self.acc, self.per_ms = lin, acc, per_ms
        self.sw, self.time_limit_s = sw, time_limit_s
        self.heap: list[RaiseEntry] = []
        self.rejected: list[RaiseEntry] = []
        self.accepted = 0
        self.stopped = False
        for gi, g in enumerate(lin.groups):
            for u in range(len(g.choices)):
                self.push(gi, u)

    def gain(self, gi: int, u: int, k: int) -> float:
        g = self.lin.groups[gi]
        om = g.omega1[u]
        return g.weight * (om[k] - om[k - 1])

    def rank(self, gi: int, u: int, k: int) -> float:
        gv = self.gain(gi, u, k)
        if not self.per_ms:
            return gv
        dt, _ = self.lin.delta(gi, u, k - 1)
        return gv / max(dt, 1e-9)

    def push(self, gi: int, u: int) -> None:
        """Queue the unit's next raise, if it gains anything."""
        k = self.lin.a[gi][u]
        if k > 0 and self.gain(gi, u, k) > 0:
            heapq.heappush(self.heap, (-self.rank(gi, u, k), gi, u, k))

    def attempt(self, gi: int, u: int, k: int) -> bool:
        """Raise unit u on group gi from k to k-1; undo it if the check fails."""
        lin, acc = self.lin, self.acc
        lin.move(gi, u, k - 1)
        acc.apply(gi, u, k - 1)
        if acc.ok(gi):
            return True
        lin.move(gi, u, k)
        acc.apply(gi, u, k)
        return False

    def try_move(self, entry: RaiseEntry) -> bool:
        """Check one raise; keep it (and queue the unit's next) or note the refusal."""
        _, gi, u, k = entry
        if self.attempt(gi, u, k):
            self.accepted += 1
            self.push(gi, u)
            return True
        self.rejected.append(entry)
        return False

    def drain(self) -> int:
        """Pop and try raises until the heap is empty or time is up; the number kept."""
        n = 0
        while self.heap:
            if self.sw.wall_s > self.time_limit_s:
                self.stopped = True
                return n
            neg, gi, u, k = heapq.heappop(self.heap)
            if self.lin.a[gi][u] != k:
                continue  # stale
            if self.per_ms:
                r = self.rank(gi, u, k)
                if abs(r - (-neg)) > 1e-12 * max(abs(r), 1.0):
                    heapq.heappush(self.heap, (-r, gi, u, k))
                    continue
            n += self.try_move((neg, gi, u, k))
        return n

    def sweep(self) -> tuple[int, int]:
        """Re-try the refused raises (at most ``MAX_SWEEPS`` times) while any is kept: the
        sweeps made and the raises they kept."""
        sweeps = swept = 0
        while self.rejected and not self.stopped and sweeps < MAX_SWEEPS:
            sweeps += 1
            todo = sorted(self.rejected)
            self.rejected.clear()
            got = 0
            for entry in todo:
                if self.lin.a[entry[1]][entry[2]] != entry[3]:
                    continue
                got += self.try_move(entry)
            got += self.drain()
            swept += got
            if not got:
                break
        return sweeps, swept
