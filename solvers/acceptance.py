"""How greedy checks a move: every group's assignment with its linear time and memory kept
up to date per move (:class:`LinearState`), and the two checks a move must pass, the linear
model's (:class:`LinearAcceptance`) or the incremental replayer's with the linear rows too
(:class:`ReplayAcceptance`, QSync's way)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from qsync_opt.core.precision import Precision
from qsync_opt.costs.rules import widest_precision
from qsync_opt.problem.groupmodel import DerivedUnit, GroupModel
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.replayer import Change, IncrementalReplay

#: Relative slack of the acceptance checks, well inside the evaluator's (EVAL_TOL = 1e-7),
#: so float drift of incremental sums cannot flip a verdict the evaluator would give.
REL_TOL = 1e-9
#: The checks a move can be given (``SolveOptions.acceptance``).
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
            self.a.append([])
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
            self.time.append(0.0)
            self.mem_sum.append(0.0)
            self.work.append([])
            self.work_max.append(0.0)
            self.load(len(self.a) - 1, assignment[g.name])

    def load(self, gi: int, real: Sequence[int]) -> None:
        """Set group gi's whole assignment (its real units' choices), recomputing its sums."""
        g = self.groups[gi]
        full = g.complete(real) if g.derived else list(real)
        self.a[gi] = full
        self.time[gi] = g.time_ms(real)
        self.mem_sum[gi] = (g.mem0 + sum(row[c] for row, c in zip(g.mem1, full, strict=True))
                            + sum(p.mem[full[p.a]][full[p.b]] for p in g.pairs))
        w = [row[c] for row, c in zip(g.work1, full, strict=True)]
        self.work[gi] = w
        self.work_max[gi] = max([g.work0, *w])

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
            c = d.choices.index(widest_precision(dtypes))
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
        top = self.work_max[gi]
        if all(w[v] < top for v in new):  # the largest working set stays: no rescan
            work = max(top, *(g.work1[v][kv] for v, kv in new.items()))
        else:
            work = max([g.work0, *(g.work1[v][new[v]] if v in new else x
                                   for v, x in enumerate(w))])
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

    The replayer scores the makespan as the target defines it (``AllocationProblem``: every
    group's compute, casts included, plus the tail: the last bucket's all-reduce and the
    optimizer step), i.e. ``max_g compute_g + tail`` with the replayer's per-group compute,
    and every group's peak memory against its capacity (after headroom). The all-reduce the
    backward does not hide is the target's business (the default target already includes
    what the strong groups expose), not a move's: counting it here refused plans the target
    admits. A move must also keep the group inside the evaluator's linear rows (time budget
    and the linear memory, which on fp32-flow tables is a conservative sum of the replayer's
    timeline), so that every accepted plan is one :func:`~qsync_opt.problem.evaluator.evaluate` calls
    feasible; ``vetoes`` counts the moves only those rows refused.

    Every op of a tie unit is set; a rejected move is undone by setting the old precision
    back, which re-costs the same neighbourhood, so the replay equals a fresh replay of the
    plan that was kept.
    """

    name = "replayer"

    def __init__(self, problem: AllocationProblem, assignment: Mapping[str, Sequence[int]],
                 lin: LinearState | None = None) -> None:
        self.problem = problem
        self.groups = problem.groups
        self.target = problem.target_ms
        self.tail = problem.tail_ms
        self.linear = LinearAcceptance(problem, lin or LinearState(problem, assignment))
        self.inc: IncrementalReplay = problem.replayer.incremental(problem.precisions(assignment))
        self.change: Change = self.inc.state()
        self.checks = 0
        self.vetoes = 0

    @property
    def calls(self) -> int:
        return self.inc.calls

    def apply(self, gi: int, u: int, k: int) -> None:
        g = self.groups[gi]
        self.change = self.inc.set_ops(g.name, self.problem.units[u].ops, g.choices[u][k])

    def group_memory(self, gi: int) -> float:
        return float(self.change.peak_memory_bytes[self.groups[gi].name])

    def replay_ok(self, gi: int) -> bool:
        """The replayer's verdict on group gi (a move changes only its group)."""
        ch = self.change
        g = self.groups[gi]
        return (ch.compute_ms[g.name] + self.tail <= self.target * (1 + REL_TOL)
                and ch.peak_memory_bytes[g.name] <= g.capacity_bytes * (1 + REL_TOL))

    def ok(self, gi: int) -> bool:
        """The replayer's verdict, then the evaluator's linear rows."""
        self.checks += 1
        if not self.replay_ok(gi):
            return False
        if not self.linear.ok(gi):
            self.vetoes += 1
            return False
        return True

    def makespan_ms(self) -> float:
        """The replayer's makespan as the target defines it."""
        return max(self.change.compute_ms.values()) + self.tail

    def iteration_ms(self) -> float:
        """The replayer's whole iteration (with the all-reduce the backward does not hide)."""
        return self.change.iteration_ms


Acceptance = LinearAcceptance | ReplayAcceptance
