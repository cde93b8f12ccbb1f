"""Why no plan exists, and what would make one: the least memory and the least time.

When the program of docs/ALLOCATION.md has no solution, it is for one of two reasons per
group (with a fixed target the groups do not interact):

* **memory**: even the assignment with the least memory does not fit the group's capacity.
  :func:`min_memory` finds that least memory exactly: a small integer program per group
  (the formulation of :mod:`qsync_opt.solvers.formulation` with the memory as objective,
  solved by HiGHS or CBC: unary and pair terms, derived units' AND rows, the working-set max
  ``W``), re-scored with ``GroupModel.memory_bytes``;
* **time**: even the fastest assignment that fits memory takes longer than the target
  allows (``solvers.fastest.fastest_times``).

:func:`explain` states both in lines a user can act on (resnet50, a batch of 384 on a T4)::

    t4 (t4): needs 17.9 GiB at its least-memory plan, has 14.2 GiB (15.0 usable, 5% headroom)
    t4: 0.79 GiB fixed (fp32 weights, ...), 0.04 GiB weight copies, 17.09 GiB activations and
        working set at batch 384 per device: batch 301 fits with the same plan
    t4: pinned ops hold 0.024% of its least-memory plan's memory: fc (classifier head,
        0.016%), loss.cross_entropy (loss, 0.008%)
    fastest makespan reachable: 594.7 ms (t4 at its fastest plan); target 300.0 ms

and :class:`InfeasibleProblem` carries them as a :class:`~qsync_opt.core.errors.QsyncInputError`
whose message is one line (the CLI's errors are one line each).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.documents.schemas import OpRole
from qsync_opt.problem.groupmodel import GroupModel
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.solvers import CbcOptions, HighsOptions, SolveOptions
from qsync_opt.solvers.checks import FEAS_REL, check_resolution
from qsync_opt.solvers.fastest import fastest_plans
from qsync_opt.solvers.formulation import formulate_group
from qsync_opt.solvers.pulp_model import read_assignment, to_pulp
from qsync_opt.solvers.pulp_runs import available, pulp_module, run
from qsync_opt.solvers.timing import Stopwatch

GIB = float(2**30)
#: How many pinned ops a line names (the heaviest first).
TOP_PINNED = 3


# --------------------------------------------------------------------------- least memory


def _memory_upper_bound(g: GroupModel) -> float:
    """A bound no assignment's memory exceeds (every term at its largest)."""
    ub = g.mem0 + sum(max(row) for row in g.mem1 if row)
    ub += sum(max(max(r) for r in p.mem) for p in g.pairs if p.mem and p.mem[0])
    ub += max([g.work0] + [max(row) for row in g.work1 if row])
    return ub


def _exact_backend() -> str:
    for name in ("highs", "cbc"):
        if available(name):
            return name
    raise QsyncInputError("diagnose: no PuLP solver (HiGHS or CBC) is available")


def _group_min_memory(g: GroupModel, gi: int, backend: str, time_limit_s: float
                      ) -> tuple[float, list[int]]:
    if not g.choices:
        return g.memory_bytes([]), []
    # The group's own rows, with a capacity no assignment reaches: its memory row never
    # binds, and the rows keep the scale of the real program (normalised to ~1).
    ub = _memory_upper_bound(g)
    loose = dataclasses.replace(g, capacity_bytes=ub * (1 + 1e-6) + 1.0)
    pulp = pulp_module()
    prog = to_pulp(pulp, formulate_group(loose, gi, objective="memory"), f"min_memory_{gi}")
    # No gap at all: the least memory is reported as a bound the user can rely on.
    opts = SolveOptions(rel_gap=0.0, highs=HighsOptions({"mip_abs_gap": 0.0}),
                        cbc=CbcOptions(("allowableGap 0",)))
    status = run(pulp, prog, backend, opts, time_limit_s, False, Stopwatch(), []).status
    if status != "OPTIMAL":
        raise QsyncInputError(
            f"diagnose: the least-memory program of group {g.name} ended {status} "
            f"({backend}); no exact minimum")
    a = read_assignment(prog.groups[0])
    return g.memory_bytes(a), a


def min_memory(problem: AllocationProblem, *, time_limit_s: float = 60.0
               ) -> dict[str, tuple[float, list[int]]]:
    """Per group, the least memory (bytes, ``GroupModel.memory_bytes``) of any assignment,
    whatever its time, and an assignment reaching it (choice indices of the real units).

    Exact: one integer program per group minimising the linear model's memory (unary and
    pair terms, derived units' AND rows, the working-set max), solved without a gap; the
    value returned is the exact model's memory of the solver's assignment.
    """
    backend = _exact_backend()
    return {g.name: _group_min_memory(g, gi, backend, time_limit_s)
            for gi, g in enumerate(problem.groups)}


def _fastest(problem: AllocationProblem, time_limit_s: float,
             skip: frozenset[str] = frozenset()) -> dict[str, tuple[float, list[int]] | None]:
    """Per group the least time over memory-feasible assignments and one reaching it (None:
    none, or the group is in ``skip``, known not to fit)."""
    return fastest_plans(problem, _exact_backend(), time_limit_s, skip)


# --------------------------------------------------------------------------- pinned ops


@dataclass
class PinnedShare:
    """A pinned op's weight in one group's plan: its saved activations and low-precision
    weight copy (bytes), its compute and cast time (ms), and their shares of the group's."""

    op: str
    reason: str
    memory_bytes: float
    memory_share: float
    time_ms: float
    time_share: float

    @property
    def label(self) -> str:
        """The reason's head ("classifier head", "loss", "pinned by you to fp16")."""
        return self.reason.split(":", 1)[0].strip()


def _precisions(problem: AllocationProblem, g: GroupModel, assignment: Sequence[int]
                ) -> list[Precision | None]:
    """Each op's precision in the replayer's form (None: not choosable) for ``g``."""
    return problem.replayer.rules.plan_row(
        [unit.ops for unit in problem.units],
        [g.choices[u][assignment[u]] for u in range(len(problem.units))])


def pinned_shares(problem: AllocationProblem, group: str, assignment: Sequence[int]
                  ) -> list[PinnedShare]:
    """Every pinned op (graph-pinned, with its ``pin_reason``, and the user's
    ``options.pinned``) with its memory and time in ``group`` under ``assignment``."""
    rep = problem.replayer
    rules = rep.rules
    gi = next(i for i, g in enumerate(problem.groups) if g.name == group)
    g = problem.groups[gi]
    grp = rules.groups[gi]
    prec = _precisions(problem, g, assignment)
    din, dout = rules.dtypes(prec)
    total_mem = g.memory_bytes(assignment)
    total_ms = g.time_ms(assignment)
    user = problem.options.pinned
    out = []
    for i, op in enumerate(rep.ops):
        if op.role == OpRole.pinned:
            reason = op.pin_reason or "pinned"
        elif op.name in user:
            reason = f"pinned by you to {Precision(user[op.name]).value}"
        else:
            continue
        saved, wcopy, _ = rules.op_memory(grp, i, prec, din, dout)
        ms = rules.op_ms(grp, i, prec, din, dout)
        mem = saved + wcopy
        out.append(PinnedShare(op.name, reason, mem, mem / total_mem if total_mem else 0.0,
                               ms, ms / total_ms if total_ms else 0.0))
    return out


# --------------------------------------------------------------------------- explain


@dataclass
class Diagnosis:
    """What blocks a plan, per group. ``min_memory_bytes``: each group's least memory;
    ``fastest_ms``: its least compute time over memory-feasible assignments (None: none
    fits); ``fastest_makespan_ms``: the largest of those plus the tail (over the groups that
    fit; None if none does); ``blocking``: the groups that cannot fit or cannot meet the
    target; ``lines``: all of it in words."""

    lines: list[str]
    min_memory_bytes: dict[str, float]
    fastest_ms: dict[str, float | None]
    fastest_makespan_ms: float | None
    blocking: list[str]
    target_ms: float = 0.0
    min_memory_assignment: dict[str, list[int]] = field(default_factory=dict)
    fastest_assignment: dict[str, list[int]] = field(default_factory=dict)
    pinned: dict[str, list[PinnedShare]] = field(default_factory=dict)

    @property
    def feasible_alone(self) -> bool:
        """Every group fits and meets the target on its own (so a plan exists)."""
        return not self.blocking


def _decimals(a: float, b: float, scale: float, lo: int = 1) -> int:
    """Decimals to print ``a`` and ``b`` (divided by ``scale``) with: ``lo``, more if that
    would show them equal."""
    for d in range(lo, lo + 6):
        if f"{a / scale:.{d}f}" != f"{b / scale:.{d}f}":
            return d
    return lo + 6


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%" if x >= 0.001 or x == 0 else f"{100 * x:.2g}%"


def _pinned_line(group: str, plan: str, shares: list[PinnedShare], kind: str) -> str | None:
    """``group: pinned ops hold 1.2% of its least-memory plan's memory: fc (classifier head,
    0.9%), ...``: the total, then the heaviest ``TOP_PINNED`` ops (None: none weighs)."""
    if kind == "memory":
        def key(s: PinnedShare) -> float:
            return s.memory_bytes

        def share(s: PinnedShare) -> float:
            return s.memory_share
        verb = "hold"
    else:
        def key(s: PinnedShare) -> float:
            return s.time_ms

        def share(s: PinnedShare) -> float:
            return s.time_share
        verb = "take"
    weighing = sorted((s for s in shares if key(s) > 0), key=key, reverse=True)
    if not weighing:
        return None
    parts = [f"{s.op} ({s.label}, {_pct(share(s))})" for s in weighing[:TOP_PINNED]]
    more = len(weighing) - TOP_PINNED
    tail = f", and {more} more" if more > 0 else ""
    total = sum(share(s) for s in weighing)
    return (f"{group}: pinned ops {verb} {_pct(total)} of its {plan}'s {kind}: "
            f"{', '.join(parts)}{tail}")


def memory_split(problem: AllocationProblem, group: str, assignment: Sequence[int]
                 ) -> tuple[float, float, float]:
    """(fixed bytes, low-precision weight copies, bytes that scale with the batch) of
    ``group`` under ``assignment``: fixed is the fp32 weights, gradients, optimizer state,
    buffers and context; the rest (saved activations, the working set) is proportional to
    the per-device batch."""
    rules = problem.replayer.rules
    gi = next(i for i, g in enumerate(problem.groups) if g.name == group)
    g = problem.groups[gi]
    grp = rules.groups[gi]
    fixed = float(sum(rules.static_memory(grp).values()))
    prec = _precisions(problem, g, assignment)
    din, dout = rules.dtypes(prec)
    copies = sum(rules.op_memory(grp, i, prec, din, dout)[1] for i in range(rules.n))
    return fixed, copies, g.memory_bytes(assignment) - fixed - copies


def _memory_lines(problem: AllocationProblem, g: GroupModel, need: float, a: list[int]
                  ) -> list[str]:
    headroom = problem.options.memory_headroom
    d = _decimals(need, g.capacity_bytes, GIB)
    lines = [f"{g.name} ({g.device}): needs {need / GIB:.{d}f} GiB at its least-memory plan, "
             f"has {g.capacity_bytes / GIB:.{d}f} GiB ({g.usable_bytes / GIB:.{d}f} usable, "
             f"{100 * headroom:.3g}% headroom)"]
    fixed, copies, scaled = memory_split(problem, g.name, a)
    room = g.capacity_bytes - fixed - copies
    head = (f"{g.name}: {fixed / GIB:.2f} GiB fixed (fp32 weights, gradients, optimizer "
            f"state, buffers, context), {copies / GIB:.2f} GiB weight copies, "
            f"{scaled / GIB:.2f} GiB activations and working set at batch {g.batch} per device")
    fit = math.floor(g.batch * room / scaled) if scaled > 0 and room > 0 else 0
    if fit >= 1:
        lines.append(f"{head}: batch {fit} fits with the same plan")
    else:
        lines.append(f"{head}: not even batch 1 fits")
    return lines


def explain(problem: AllocationProblem, *, time_limit_s: float = 60.0) -> Diagnosis:
    """Why ``problem`` has no plan (or that it has one), group by group.

    Memory: a group whose least memory exceeds its capacity (the line gives both, the
    card's usable memory and headroom, what of it is fixed and what scales with the batch,
    and the largest batch the least-memory plan fits). Time: when the fastest
    memory-feasible plans give a makespan over the target, the group that sets it. For each
    blocking group, the pinned ops that weigh most in its least-memory (or fastest) plan,
    with their share.
    """
    mins = min_memory(problem, time_limit_s=time_limit_s)
    too_big = frozenset(g.name for g in problem.groups
                        if mins[g.name][0] > g.capacity_bytes * (1 + FEAS_REL))
    fast = _fastest(problem, time_limit_s, too_big)
    lines: list[str] = []
    blocking: list[str] = []
    pinned: dict[str, list[PinnedShare]] = {}
    for g in problem.groups:
        need, a = mins[g.name]
        if g.name in too_big:
            blocking.append(g.name)
            lines.extend(_memory_lines(problem, g, need, a))
            shares = pinned[g.name] = pinned_shares(problem, g.name, a)
            line = _pinned_line(g.name, "least-memory plan", shares, "memory")
            if line:
                lines.append(line)
    fastest_ms = {n: (v[0] if v is not None else None) for n, v in fast.items()}
    known = {n: t for n, t in fastest_ms.items() if t is not None}
    makespan = max(known.values()) + problem.tail_ms if known else None
    budget = problem.group_budget_ms()
    late = sorted((n for n, t in known.items() if t > budget + FEAS_REL * abs(budget)),
                  key=lambda n: -known[n])
    if late and makespan is not None:
        d = _decimals(makespan, problem.target_ms, 1.0)
        some = "" if len(known) == len(problem.groups) else " (over the groups that fit)"
        also = "".join(f", {n} also over it at {known[n] + problem.tail_ms:.{d}f} ms"
                       for n in late[1:])
        source = "" if problem.target_source == "given" else f" ({problem.target_source})"
        lines.append(f"fastest makespan reachable{some}: {makespan:.{d}f} ms ({late[0]} at its "
                     f"fastest plan); target {problem.target_ms:.{d}f} ms{source}{also}")
        for n in late:
            if n not in blocking:
                blocking.append(n)
            if n in problem.held_groups:
                lines.append(
                    f"{n}: held at its reference precision "
                    f"({Precision(problem.options.reference).value}) as a strong group, so its fastest "
                    "plan is its reference plan; lower_reference=True (--lower-reference) lets "
                    "the solver lower it")
            fa = fast[n]
            assert fa is not None
            shares = pinned_shares(problem, n, fa[1])
            pinned.setdefault(n, shares)
            line = _pinned_line(n, "fastest plan", shares, "time")
            if line:
                lines.append(line)
    if not blocking:
        lines.append("each group fits and can meet the target on its own: a plan exists, and "
                     "a solver that found none stopped at a limit (time limit, tolerance)")
    return Diagnosis(
        lines=lines, min_memory_bytes={n: v[0] for n, v in mins.items()},
        fastest_ms=fastest_ms, fastest_makespan_ms=makespan, blocking=blocking,
        target_ms=problem.target_ms,
        min_memory_assignment={n: list(v[1]) for n, v in mins.items()},
        fastest_assignment={n: list(v[1]) for n, v in fast.items() if v is not None},
        pinned=pinned)


#: What :func:`precheck` verifies, weakest first.
PRECHECKS = ("fixed", "memory", "target")


def precheck(problem: AllocationProblem, check: str = "target", *,
             time_limit_s: float = 60.0) -> list[str]:
    """What blocks every plan and needs no indicator (the problem may carry a placeholder:
    memory and time do not depend on it), as :func:`explain`'s lines; empty if nothing does.

    ``"fixed"``: a group whose fixed memory (fp32 weights, gradients, optimizer state,
    buffers, context) alone exceeds its capacity, which no precision and no batch split
    changes; ``"memory"``: also a group whose least-memory plan does not fit at this batch
    split; ``"target"``: also a target the fastest memory-feasible plans miss (for a given
    target; the default one falls back to the lexicographic mode when out of reach).
    Without a PuLP solver only ``"fixed"`` is checked.
    """
    if check not in PRECHECKS:
        raise QsyncInputError(f"check: expected one of {', '.join(PRECHECKS)}, got {check!r}")
    check_resolution(problem)  # costs no makespan can resolve: refused, not "no plan"
    rep = problem.replayer
    fixed_lines = []
    for gi, g in enumerate(problem.groups):
        fixed = float(sum(rep.rules.static_memory(rep.groups[gi]).values()))
        if fixed > g.capacity_bytes * (1 + FEAS_REL):
            fixed_lines.append(
                f"{g.name} ({g.device}): {fixed / GIB:.2f} GiB fixed (fp32 weights, gradients, "
                f"optimizer state, buffers, context) exceed its {g.capacity_bytes / GIB:.2f} GiB "
                "at every precision and every batch")
    if not fixed_lines and check == "fixed":
        return []
    try:
        diagnosis = explain(problem, time_limit_s=time_limit_s)
    except QsyncInputError:  # no PuLP solver: the fixed memory is all that can be said
        return fixed_lines
    if fixed_lines:
        return fixed_lines + diagnosis.lines
    memory = [n for n in diagnosis.blocking
              if diagnosis.min_memory_bytes[n] > problem.group(n).capacity_bytes * (1 + FEAS_REL)]
    time_bound = check == "target" and problem.target_source == "given"
    if memory or (time_bound and diagnosis.blocking):
        return diagnosis.lines
    return []


class InfeasibleProblem(QsyncInputError):
    """No plan exists; ``diagnosis`` says why. ``str()`` is one line (the lines joined with
    "; "), :meth:`format_lines` one line per finding."""

    def __init__(self, diagnosis: Diagnosis) -> None:
        self.diagnosis = diagnosis
        self.lines = [" ".join(line.split()) for line in diagnosis.lines]
        super().__init__("; ".join(self.lines))

    def __str__(self) -> str:
        return "; ".join(self.lines)

    def format_lines(self, indent: str = "") -> str:
        """The findings one per line (no trailing newline), each prefixed by ``indent``."""
        return "\n".join(indent + line for line in self.lines)
