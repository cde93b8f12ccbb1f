"""The exact integer program in PuLP, solved by CBC or HiGHS, and the additive-ILP baseline.

Per device group ``g`` (choice indices into ``GroupModel.choices[u]``; the derived units of
promoting ops follow the real ones)::

    min  sum_u w_g * Omega_u[k] x[u,k]                              (real units only)
    s.t. sum_k x[u,k] = 1                                         (one-hot, x binary)
         sum_kb y[p,ka,kb] = x[a,ka],  sum_ka y[p,ka,kb] = x[b,kb]  (pair p = (a, b), y >= 0)
         x[d,k] <= S_i,  x[d,k] >= sum_i S_i - (n - 1)               (derived d = AND of inputs)
         time0 + sum t1 x + sum t_p y            <= target - tail    (the group's budget)
         mem0 + sum m1 x + sum m_p y + W         <= capacity
         W >= work0,  W >= sum_k work1[u][k] x[u,k]                 (largest working set)

The marginal rows make ``y`` the product of the two one-hot rows for any binary ``x``, so
``y`` need not be integer. Pair terms whose time and memory matrices are all zero are
skipped, as are working-set rows that can never exceed ``work0``. With a fixed target the
groups do not interact: by default one small program is solved per group
(``SolveOptions.decompose``; the time limit is shared out, the bounds summed).

Numerics. The time and memory rows are normalised (divided by the budget and the capacity)
and the solvers run with feasibility and integrality tolerances of 1e-9, so their absolute
tolerances act relatively. Every assignment is then checked with the exact model
(``GroupModel.time_ms`` / ``memory_bytes``, relative tolerance ``FEAS_REL``); in the rare
case a solver tolerance let a row slip, the row is tightened (by the violation plus 1e-9,
then 1e-7, 1e-5 of the bound) and the program re-solved, with a message.

The objective is each unit's ``w * Omega`` less its least (a constant), divided by its
largest coefficient; the solvers' absolute gap is 1e-3 of the relative one in those units.
An OPTIMAL plan whose objective is so small beside the largest coefficient that this gap
exceeds the relative gap of it (one Omega 1e5 times the rest) is not trusted as proven: the
program is re-solved without the choices whose term alone exceeds the plan's whole
objective (no better plan takes one), which makes the largest coefficient at most the
plan's objective; a plan still not proven that way is FEASIBLE, its bound dropped.

Solver specifics. HiGHS runs through pulp's ``HiGHS`` class (highspy), subclassed to pass
the model in bulk, to warm-start with ``setSolution`` (pulp's class has no warm start) and
to read the model status and ``mip_dual_bound``. CBC runs through pulp's bundled command
(``PULP_CBC_CMD``, else ``COIN_CMD``) with ``-mips`` for a warm start; its bound is read from
its log ("Lower bound", rounded down past its printed digits). ``build_s`` counts the PuLP
model and its transfer to the solver (highspy arrays, or the MPS file and solution file),
``solve_s`` the solver's run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import QsyncInputError
from ..problem import AllocationProblem, GroupModel, check_finite
from ..schemas import Plan, SolveReport
from . import _common
from ._common import (
    Deadline,
    PartResult,
    Stopwatch,
    check_hints,
    finish,
    infeasible_messages,
    mode_text,
    part_objective,
    program_parts,
    solve_parts,
)
from .base import SolveOptions

_PULP_NAMES = {"cbc": ("PULP_CBC_CMD", "COIN_CMD"), "highs": ("HiGHS",)}
#: What the exact backends call feasible: time <= budget * (1 + FEAS_REL) and memory <=
#: capacity * (1 + FEAS_REL) in the floating-point model (100x inside the evaluator's
#: EVAL_TOL; it absorbs the last-ulp differences of ``target - tail`` against a sum of terms).
FEAS_REL = 1e-9
#: Relative tightening of a row per repair (on top of the measured violation).
_REPAIR_MARGIN = 1e-9
_MAX_REPAIRS = 3
#: Feasibility and integrality tolerance asked of CBC and HiGHS (rows are normalised to ~1).
_FEAS_TOL = 1e-9
#: The absolute gap asked of CBC and HiGHS, as a fraction of ``rel_gap`` (in the program's
#: units, where the largest objective coefficient is 1): an OPTIMAL plan whose objective is
#: at least 1e-3 of that coefficient is then proven within the relative gap; a smaller one is
#: re-solved without the choices that cannot be in a better plan (see
#: :func:`loose_optimum`), which rescales its objective.
_ABS_GAP_OF_REL = 1e-3
#: Re-solves of a program whose OPTIMAL was only proven within the absolute gap.
MAX_RESCALES = 3


def abs_gap(rel_gap: float) -> float:
    """The absolute gap (program units) asked of the solver for a relative gap."""
    return max(_ABS_GAP_OF_REL * min(max(rel_gap, 0.0), 1e-3), 1e-13)


def pulp_module() -> Any:
    import pulp

    return pulp


def _available_pulp_solvers() -> list[str]:
    try:
        pulp = pulp_module()
    except Exception:
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return list(pulp.listSolvers(onlyAvailable=True))
        except Exception:
            return []


def greedy_hints(problem: AllocationProblem, messages: list[str],
                 deadline: Deadline | None = None) -> dict[str, list[int]] | None:
    """Greedy's assignment for a warm start (None, with a message, when there is none),
    within the call's ``deadline``."""
    t0 = time.perf_counter()
    try:
        from .greedy import Greedy
    except Exception as exc:  # the greedy backend is optional here
        messages.append(f"warm start: greedy unavailable ({type(exc).__name__}: {exc}); "
                        "solving without a warm start")
        return None
    try:
        limit = deadline.remaining() if deadline is not None else SolveOptions().time_limit_s
        if not limit > 0:
            messages.append("warm start: no time left for greedy; solving without a warm start")
            return None
        plan, _ = Greedy().solve(problem, SolveOptions(acceptance="linear", time_limit_s=limit))
    except Exception as exc:
        messages.append(f"warm start: greedy failed ({type(exc).__name__}: {exc}); "
                        "solving without a warm start")
        return None
    if plan is None:
        messages.append("warm start: greedy found no plan; solving without a warm start")
        return None
    hints = problem.assignment(plan)
    messages.append(f"warm start: greedy plan (objective {problem.objective(hints):.6g}, "
                    f"{time.perf_counter() - t0:.3f} s)")
    return hints


def start_hints(problem: AllocationProblem, options: SolveOptions, messages: list[str],
                deadline: Deadline | None = None) -> dict[str, list[int]] | None:
    """The warm start to give the solver: ``options.hints``, else greedy's plan if asked."""
    if options.hints is not None:
        check_hints(problem, options.hints)
        return {g.name: list(options.hints[g.name]) for g in problem.groups}
    if options.warm_start == "greedy":
        return greedy_hints(problem, messages, deadline)
    if options.warm_start is not None:
        messages.append(f"warm start: unknown kind {options.warm_start!r} ignored")
    return None


def ext_choices(g: GroupModel) -> list[tuple[Any, ...]]:
    """Choices of every unit of the program: the real units, then the derived units."""
    return list(g.all_choices) if getattr(g, "derived", None) else list(g.choices)


def complete(g: GroupModel, a: Sequence[int]) -> list[int]:
    """A real assignment extended with the derived units' (implied) choices."""
    return g.complete(a) if getattr(g, "derived", None) else list(a)


def derived_rows(g: GroupModel) -> list[tuple[int, int, list[list[tuple[int, int]]]]]:
    """AND rows tying each derived unit's 16-bit choices to its inputs' choices."""
    return g.derived_rows() if getattr(g, "derived", None) else []


def check_numbers(problem: AllocationProblem) -> None:
    """Refuse, in one line naming the quantity, a problem whose coefficients or budget are
    not finite (they reach the solvers' scaling otherwise)."""
    check_finite(problem.groups, [u.ops[0] for u in problem.units])
    budget = problem.group_budget_ms()
    if not math.isfinite(budget):
        raise QsyncInputError(f"target_ms: expected a finite number, got {problem.target_ms!r} "
                              f"(group budget {budget!r} ms)")


def exact_violation(g: GroupModel, a: Sequence[int], budget: float, rel: float = FEAS_REL
                    ) -> tuple[float, float]:
    """How far ``a`` exceeds the group's time budget (ms) and capacity (bytes), beyond the
    relative tolerance ``rel``; 0 if not."""
    return (max(0.0, g.time_ms(a) - budget - rel * abs(budget)),
            max(0.0, g.memory_bytes(a) - g.capacity_bytes * (1 + rel)))


def active_pairs(g: GroupModel) -> list[int]:
    """Indices of the pair terms with any nonzero time or memory coefficient."""
    return [i for i, p in enumerate(g.pairs)
            if any(v for row in p.time for v in row) or any(v for row in p.mem for v in row)]


def work_rows(g: GroupModel) -> list[int]:
    """Units whose working set can exceed ``work0`` (the only W rows needed)."""
    return [u for u, row in enumerate(g.work1) if row and max(row) > g.work0]


# --------------------------------------------------------------------------- PuLP model


@dataclass
class _GroupVars:
    gi: int
    x: list[list[Any]]
    pairs: list[tuple[int, list[list[Any]]]]  # (pair index, y[ka][kb])
    w: Any
    time_row: Any
    mem_row: Any
    time_scale: float
    mem_scale: float


@dataclass
class Program:
    lp: Any
    groups: list[_GroupVars]
    n_variables: int = 0
    n_constraints: int = 0
    obj_terms: list[tuple[Any, float]] = field(default_factory=list)
    #: The objective is multiplied by this (largest coefficient -> 1) so that the solvers'
    #: absolute tolerances do not swallow small Omegas; bounds are divided back.
    obj_scale: float = 1.0
    #: Each unit's coefficients are shifted by their least (``w * min Omega``, a constant
    #: of every assignment): the program's objective is the exact one minus this.
    obj_offset: float = 0.0


def _row_scale(v: float) -> float:
    return abs(v) if abs(v) > 1e-300 else 1.0


def shifted_omega(g: GroupModel) -> list[list[float]]:
    """``w * Omega`` of each real unit's choices less the unit's least (all >= 0, one 0)."""
    out = []
    for row in g.omega1:
        terms = [g.weight * v for v in row]
        low = min(terms, default=0.0)
        out.append([t - low for t in terms])
    return out


def add_group(pulp: Any, prog: Program, g: GroupModel, gi: int, budget: float,
               min_time: bool = False, forbid: frozenset[tuple[int, int]] = frozenset()
               ) -> _GroupVars:
    """Add group ``g``'s variables and rows to ``prog``. ``min_time``: the objective is the
    group's time (ms, without time0) and there is no time row. ``forbid``: (unit, choice)
    pairs fixed to 0 (choices no plan better than a known one can take)."""
    lp = prog.lp
    LpAffineExpression, LpConstraint = pulp.LpAffineExpression, pulp.LpConstraint
    EQ, LE, GE = pulp.LpConstraintEQ, pulp.LpConstraintLE, pulp.LpConstraintGE
    add_var, add_con = lp.add_variable, lp.addConstraint
    x: list[list[Any]] = []
    time_terms: list[tuple[Any, float]] = []
    mem_terms: list[tuple[Any, float]] = []
    ts = _row_scale(budget)
    ms = _row_scale(g.capacity_bytes)
    n_vars = n_cons = 0
    n_real = len(g.choices)
    shifted = shifted_omega(g) if not min_time else []
    if not min_time:
        prog.obj_offset += sum(g.weight * min(r) for r in g.omega1 if r)
    for u, ch in enumerate(ext_choices(g)):
        row = [add_var(f"x{gi}_{u}_{k}", 0, 1, pulp.LpBinary) for k in range(len(ch))]
        for k, v in enumerate(row):
            if (u, k) in forbid:
                v.upBound = 0  # (after creation: a binary's bounds are set to 0..1)
        n_vars += len(row)
        x.append(row)
        add_con(LpConstraint(LpAffineExpression([(v, 1) for v in row]), EQ, f"one{gi}_{u}", 1))
        n_cons += 1
        t1, m1 = g.time1[u], g.mem1[u]
        om = shifted[u] if u < n_real and not min_time else None
        for k, v in enumerate(row):
            if t1[k]:
                time_terms.append((v, t1[k] / ts))
            if m1[k]:
                mem_terms.append((v, m1[k] / ms))
            if om is not None and om[k] and (u, k) not in forbid:
                prog.obj_terms.append((v, om[k]))
    # Derived units (promoting ops fed only by units): x[d,k] = AND_i (input i gives k).
    for r, (d, k, inputs) in enumerate(derived_rows(g)):
        xd = x[d][k]
        sums = [[(x[u][j], 1) for u, j in opts] for opts in inputs]
        for i, terms in enumerate(sums):
            add_con(LpConstraint(LpAffineExpression([*terms, (xd, -1)]), GE,
                                 f"dand{gi}_{r}_{i}", 0))
        add_con(LpConstraint(LpAffineExpression([t for ts_ in sums for t in ts_] + [(xd, -1)]),
                             LE, f"dall{gi}_{r}", len(inputs) - 1))
        n_cons += len(inputs) + 1
    pair_vars: list[tuple[int, list[list[Any]]]] = []
    for pi in active_pairs(g):
        p = g.pairs[pi]
        xa, xb = x[p.a], x[p.b]
        y = [[add_var(f"y{gi}_{pi}_{ka}_{kb}", 0, None) for kb in range(len(xb))]
             for ka in range(len(xa))]
        n_vars += len(xa) * len(xb)
        for ka, yrow in enumerate(y):
            terms = [(v, 1) for v in yrow]
            terms.append((xa[ka], -1))
            add_con(LpConstraint(LpAffineExpression(terms), EQ, f"ma{gi}_{pi}_{ka}", 0))
            for kb, v in enumerate(yrow):
                if p.time[ka][kb]:
                    time_terms.append((v, p.time[ka][kb] / ts))
                if p.mem[ka][kb]:
                    mem_terms.append((v, p.mem[ka][kb] / ms))
        for kb in range(len(xb)):
            terms = [(y[ka][kb], 1) for ka in range(len(xa))]
            terms.append((xb[kb], -1))
            add_con(LpConstraint(LpAffineExpression(terms), EQ, f"mb{gi}_{pi}_{kb}", 0))
        n_cons += len(xa) + len(xb)
        pair_vars.append((pi, y))
    # Working set (in units of the capacity, like the memory row).
    w = add_var(f"w{gi}", g.work0 / ms, None)
    n_vars += 1
    for u in work_rows(g):
        terms = [(v, -g.work1[u][k] / ms) for k, v in enumerate(x[u]) if g.work1[u][k]]
        terms.append((w, 1))
        add_con(LpConstraint(LpAffineExpression(terms), GE, f"w{gi}_{u}", 0))
        n_cons += 1
    mem_terms.append((w, 1))
    # A row with no variables is still added (PuLP keeps it) so that infeasibility shows.
    time_row = LpConstraint(LpAffineExpression(time_terms), LE, f"time{gi}",
                            (budget - g.time0) / ts)
    mem_row = LpConstraint(LpAffineExpression(mem_terms), LE, f"mem{gi}",
                           (g.capacity_bytes - g.mem0) / ms)
    if min_time:
        prog.obj_terms.extend((v, c * ts) for v, c in time_terms)
    else:
        add_con(time_row)
        n_cons += 1
    add_con(mem_row)
    n_cons += 1
    prog.n_variables += n_vars
    prog.n_constraints += n_cons
    return _GroupVars(gi, x, pair_vars, w, time_row, mem_row, ts, ms)


def _build(pulp: Any, problem: AllocationProblem, gis: Sequence[int], name: str,
           forbid: Mapping[int, frozenset[tuple[int, int]]] | None = None) -> Program:
    lp = pulp.LpProblem(name, pulp.LpMinimize)
    prog = Program(lp, [])
    budget = problem.group_budget_ms()
    for gi in gis:
        prog.groups.append(add_group(pulp, prog, problem.groups[gi], gi, budget,
                                      forbid=(forbid or {}).get(gi, frozenset())))
    top = max((abs(c) for _, c in prog.obj_terms), default=0.0)
    if top > 0:
        prog.obj_scale = 1.0 / top
        prog.obj_terms = [(v, c * prog.obj_scale) for v, c in prog.obj_terms]
    lp.setObjective(pulp.LpAffineExpression(prog.obj_terms))
    return prog


def fastest_plans(problem: AllocationProblem, backend: str = "highs",
                  time_limit_s: float = 60.0, skip: frozenset[str] = frozenset()
                  ) -> dict[str, tuple[float, list[int]] | None]:
    """Per group, the least time (ms) over assignments that fit its memory and one reaching
    it (None: none fits, or the group is in ``skip``), by solving the program with the time
    as objective. ``time_limit_s`` bounds all groups together (each gets an equal share of
    what remains). A program stopped at its limit with a plan gives that plan's time (an
    upper bound on the least); one stopped without a plan raises :class:`FastestTimeLimit`
    (the group's least time is unknown, not absent)."""
    pulp = pulp_module()
    solver = PulpIlp(backend)
    deadline = Deadline(time_limit_s)
    out: dict[str, tuple[float, list[int]] | None] = {}
    todo = [g.name for g in problem.groups if g.name not in skip]
    for gi, g in enumerate(problem.groups):
        if g.name in skip:
            out[g.name] = None
            continue
        share = deadline.share(len(todo) - todo.index(g.name))
        lp = pulp.LpProblem(f"fastest_{gi}", pulp.LpMinimize)
        prog = Program(lp, [])
        gv = add_group(pulp, prog, g, gi, problem.group_budget_ms(), min_time=True)
        prog.groups.append(gv)
        lp.setObjective(pulp.LpAffineExpression(prog.obj_terms))
        res = solver._run(pulp, prog, SolveOptions(rel_gap=1e-9), share, False,
                          Stopwatch(), [])
        if res.status in ("OPTIMAL", "FEASIBLE"):
            a = read_assignment(gv, len(g.choices))
            out[g.name] = (g.time_ms(a), a)
        elif res.status == "INFEASIBLE":
            out[g.name] = None
        else:
            raise FastestTimeLimit(
                f"fastest plan of group {g.name}: {res.status} after {share:.3g} s "
                f"({time_limit_s:g} s for all groups), no plan; its least time is not known")
    return out


class FastestTimeLimit(QsyncInputError):
    """The least time of a group could not be proven within the time given."""


def fastest_times(problem: AllocationProblem, backend: str = "highs",
                  time_limit_s: float = 60.0) -> dict[str, float | None]:
    """Each group's least time (ms) over assignments that fit its memory (None: none fits).
    For choosing targets."""
    return {name: (v[0] if v is not None else None)
            for name, v in fastest_plans(problem, backend, time_limit_s).items()}


def _set_start(prog: Program, problem: AllocationProblem,
               hints: Mapping[str, Sequence[int]]) -> None:
    for gv in prog.groups:
        g = problem.groups[gv.gi]
        a = complete(g, hints[g.name])
        for u, row in enumerate(gv.x):
            for k, v in enumerate(row):
                v.setInitialValue(1 if a[u] == k else 0)
        for pi, y in gv.pairs:
            p = g.pairs[pi]
            for ka, yrow in enumerate(y):
                for kb, v in enumerate(yrow):
                    v.setInitialValue(1 if (a[p.a] == ka and a[p.b] == kb) else 0)
        work = max([g.work0] + [row[c] for row, c in zip(g.work1, a, strict=True)])
        gv.w.setInitialValue(work / gv.mem_scale, check=False)


def read_assignment(gv: _GroupVars, n_real: int) -> list[int]:
    """The real units' choices (the derived ones follow from them)."""
    out = []
    for row in gv.x[:n_real]:
        vals = [v.varValue if v.varValue is not None else 0.0 for v in row]
        out.append(max(range(len(vals)), key=vals.__getitem__))
    return out


# --------------------------------------------------------------------------- solvers


@dataclass
class _Outcome:
    status: str  # OPTIMAL, FEASIBLE, INFEASIBLE, TIME_LIMIT, ERROR
    bound: float | None
    solve_s: float
    detail: str = ""
    #: The objective the solver reports for its solution (the program's scaled units).
    objective: float | None = None
    #: The absolute gap the solver was allowed, in objective units (None: not known).
    abs_tol: float | None = None


#: The thread count of HiGHS's process-wide scheduler (None: not started by us yet).
_HIGHS_THREADS: int | None = None
_HIGHS_BANNER_DONE = False


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Silence file descriptor 1 (HiGHS prints its banner from C++ when the first Highs
    object is made, before output_flag can be set; it would corrupt JSON on stdout)."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _highs_class(pulp: Any) -> Any:
    class _Highs(pulp.HiGHS):  # type: ignore[misc, name-defined]
        """pulp's HiGHS, with the model passed to highspy in bulk (numpy arrays, not one
        column and row at a time), a warm start (highspy setSolution), the run timed apart
        from the transfer, and the model status and dual bound kept."""

        start_values: list[tuple[Any, float]] | None = None
        run_s = 0.0
        transfer_s = 0.0
        outcome: tuple[Any, Any, float, float] | None = None

        def actualSolve(self, lp: Any) -> Any:
            import highspy
            import numpy as np

            global _HIGHS_BANNER_DONE
            t0 = time.perf_counter()
            if _HIGHS_BANNER_DONE:
                self.createAndConfigureSolver(lp)
            else:
                with _quiet_stdout():
                    self.createAndConfigureSolver(lp)
                _HIGHS_BANNER_DONE = True
            h = lp.solverModel
            inf = highspy.kHighsInf
            variables = lp.variables()
            n = len(variables)
            for i, v in enumerate(variables):
                v.index = i
            h.addVars(n, np.array([-inf if v.lowBound is None else v.lowBound
                                   for v in variables], dtype=np.float64),
                      np.array([inf if v.upBound is None else v.upBound
                                for v in variables], dtype=np.float64))
            obj = [(v.index, c) for v, c in lp.objective.items() if c]
            if obj:
                h.changeColsCost(len(obj), np.array([i for i, _ in obj], dtype=np.int32),
                                 np.array([c for _, c in obj], dtype=np.float64))
            ints = [v.index for v in variables if v.cat == pulp.LpInteger]
            if ints:
                h.changeColsIntegrality(
                    len(ints), np.array(ints, dtype=np.int32),
                    np.full(len(ints), int(highspy.HighsVarType.kInteger), dtype=np.uint8))
            lower, upper, starts, index, value = [], [], [], [], []
            for i, con in enumerate(lp._constraints.values()):
                con.index = i
                starts.append(len(index))
                for v, c in con.items():
                    if c:
                        index.append(v.index)
                        value.append(c)
                lb, ub = con.getLb(), con.getUb()
                lower.append(-inf if lb is None else lb)
                upper.append(inf if ub is None else ub)
            if lower:
                h.addRows(len(lower), np.array(lower, dtype=np.float64),
                          np.array(upper, dtype=np.float64), len(index),
                          np.array(starts, dtype=np.int32), np.array(index, dtype=np.int32),
                          np.array(value, dtype=np.float64))
            if self.start_values is not None:
                idx = [v.index for v, _ in self.start_values]
                val = [float(s) for _, s in self.start_values]
                h.setSolution(len(idx), np.asarray(idx, dtype=np.int32),
                              np.asarray(val, dtype=np.float64))
            # HiGHS fixes its thread pool at the first run in a process; a run asking for
            # another thread count fails (model status kNotset) unless the pool is reset.
            global _HIGHS_THREADS
            want = int(self.threads or 0)
            if want != _HIGHS_THREADS:
                if _HIGHS_THREADS is not None:
                    highspy.Highs.resetGlobalScheduler(True)
                _HIGHS_THREADS = want
            t1 = time.perf_counter()
            self.callSolver(lp)
            t2 = time.perf_counter()
            self.transfer_s, self.run_s = t1 - t0, t2 - t1
            info = h.getInfo()
            mstatus = h.getModelStatus()
            self.outcome = (mstatus, info.primal_solution_status, info.mip_dual_bound,
                            info.objective_function_value)
            if info.primal_solution_status == 2:  # a feasible solution exists
                for v, x in zip(variables, h.getSolution().col_value, strict=True):
                    v.varValue = x
                lp.assignStatus(pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible)
                return pulp.LpStatusOptimal
            lp.assignStatus(pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound)
            return pulp.LpStatusNotSolved

    return _Highs


def _cbc_class(pulp: Any, base_name: str) -> Any:
    base = getattr(pulp, base_name)

    class _Cbc(base):  # type: ignore[misc, valid-type]
        """pulp's CBC command, timing the MPS write and solution read (model transfer)
        apart from the run."""

        io_s = 0.0

        def actualSolve(self, lp: Any, **kwargs: Any) -> Any:
            write = lp.writeMPS

            def timed_write(*a: Any, **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return write(*a, **k)
                finally:
                    self.io_s += time.perf_counter() - t

            lp.writeMPS = timed_write
            try:
                return super().actualSolve(lp, **kwargs)
            finally:
                del lp.writeMPS

        def readsol_MPS(self, *a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return super().readsol_MPS(*a, **k)
            finally:
                self.io_s += time.perf_counter() - t

    return _Cbc


_CBC_RESULT = re.compile(r"^Result - (.*)$", re.M)
_CBC_NUM = r"\s*:?\s*(-?[0-9.eE+-]+|inf|-inf|1e\+50|-1e\+50)"


def _cbc_log_value(text: str, label: str, lower: bool = False) -> float | None:
    """A number from CBC's closing summary. ``lower``: it is a lower bound printed with
    few decimals, so take it down by half its last printed digit (a valid bound still)."""
    m = re.search(rf"^{label}{_CBC_NUM}", text, re.M)
    if not m:
        return None
    try:
        v = float(m.group(1))
    except ValueError:
        return None
    if not (math.isfinite(v) and abs(v) < 1e49):
        return None
    if lower:
        digits = m.group(1).split("e")[0].split("E")[0]
        decimals = len(digits.split(".")[1]) if "." in digits else 0
        if "e" not in m.group(1).lower():
            v -= 0.5 * 10.0 ** -decimals
    return v


class PulpIlp:
    """The exact program in PuLP, solved by CBC (``backend="cbc"``) or HiGHS."""

    exact = True

    def __init__(self, backend: str = "highs") -> None:
        if backend not in _PULP_NAMES:
            raise ValueError(f"backend: expected cbc or highs, got {backend!r}")
        self.backend = backend
        self.name = backend

    def is_available(self) -> bool:
        have = _available_pulp_solvers()
        return any(n in have for n in _PULP_NAMES[self.backend])

    # ----------------------------------------------------------------- one solve

    def _run(self, pulp: Any, prog: Program, options: SolveOptions, time_limit: float,
             start: bool, sw: Stopwatch, messages: list[str]) -> _Outcome:
        lp = prog.lp
        if self.backend == "highs":
            cls = _highs_class(pulp)
            params: dict[str, Any] = {"random_seed": int(options.seed),
                                      "mip_feasibility_tolerance": _FEAS_TOL,
                                      "primal_feasibility_tolerance": _FEAS_TOL,
                                      "mip_abs_gap": abs_gap(options.rel_gap)}
            params.update(options.extra.get("highs", {}))
            solver = cls(msg=False, timeLimit=max(time_limit, 1e-3), gapRel=options.rel_gap,
                         threads=options.threads or None, **params)
            if start:
                solver.start_values = [(v, v.varValue) for v in lp.variables()
                                       if v.varValue is not None]
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                lp.solve(solver)
            total = time.perf_counter() - t0
            sw.solve_s += solver.run_s
            sw.build_s += total - solver.run_s  # model transfer into highspy
            assert solver.outcome is not None
            mstatus, primal, dual_bound, obj_value = solver.outcome
            import highspy

            S = highspy.HighsModelStatus
            has_sol = primal == 2  # kSolutionStatusFeasible
            bound = dual_bound if math.isfinite(dual_bound) else None
            reported = obj_value if has_sol and math.isfinite(obj_value) else None
            if mstatus == S.kOptimal:
                return _Outcome("OPTIMAL", bound, solver.run_s, objective=reported)
            if mstatus in (S.kInfeasible, S.kUnboundedOrInfeasible):
                return _Outcome("INFEASIBLE", None, solver.run_s)
            if mstatus in (S.kTimeLimit, S.kInterrupt, S.kIterationLimit, S.kSolutionLimit,
                           S.kObjectiveBound, S.kObjectiveTarget):
                return _Outcome("FEASIBLE" if has_sol else "TIME_LIMIT", bound, solver.run_s,
                                objective=reported)
            return _Outcome("ERROR", None, solver.run_s, f"HiGHS model status {mstatus}")
        # CBC through its command line: the log gives the bound when it stops early.
        have = _available_pulp_solvers()
        cls_name = next(n for n in _PULP_NAMES["cbc"] if n in have)
        fd, log_path = tempfile.mkstemp(suffix=".log", prefix="qsync_cbc_")
        os.close(fd)
        try:
            # (CBC's cutoff increment, 1e-5 by default, would act as an absolute gap too)
            extra = [f"integerTolerance {_FEAS_TOL}", f"primalTolerance {_FEAS_TOL}",
                     f"allowableGap {abs_gap(options.rel_gap):g}",
                     f"increment {abs_gap(options.rel_gap):g}"]
            if options.seed:
                extra.append(f"randomCbcSeed {int(options.seed)}")
            extra += list(options.extra.get("cbc", []))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                solver = _cbc_class(pulp, cls_name)(
                    msg=False, timeLimit=max(time_limit, 0.01), gapRel=options.rel_gap,
                    threads=options.threads or None, warmStart=start, logPath=log_path,
                    options=extra)
                t0 = time.perf_counter()
                lp.solve(solver)
            run = time.perf_counter() - t0 - solver.io_s
            with open(log_path) as f:
                text = f.read()
        finally:
            os.unlink(log_path)
        sw.solve_s += run
        sw.build_s += solver.io_s  # the MPS file out and the solution file in
        m = _CBC_RESULT.search(text)
        result = m.group(1).strip() if m else ""
        if start and "mipstart" not in text.lower() and "MIPStart" not in text:
            messages.append("cbc: warm start given but not reported in CBC's log")
        obj = _cbc_log_value(text, "Objective value")
        lower = _cbc_log_value(text, "Lower bound", lower=True)
        if lp.status == pulp.LpStatusInfeasible or result.startswith(
                ("Problem proven infeasible", "Linear relaxation infeasible")):
            return _Outcome("INFEASIBLE", None, run)
        if lp.status == pulp.LpStatusOptimal and lp.sol_status == pulp.LpSolutionOptimal:
            # (within the gap tolerance CBC prints a lower bound; proven optimal, it does not)
            return _Outcome("OPTIMAL", lower if lower is not None else obj, run, objective=obj)
        if lp.status == pulp.LpStatusOptimal and lp.sol_status == pulp.LpSolutionIntegerFeasible:
            return _Outcome("FEASIBLE", lower, run, objective=obj)
        if lp.status == pulp.LpStatusNotSolved:
            return _Outcome("TIME_LIMIT", lower, run)
        return _Outcome("ERROR", None, run, f"CBC: {result or pulp.LpStatus[lp.status]}")

    # ----------------------------------------------------------------- the backend

    def _solve_program(self, pulp: Any, problem: AllocationProblem, gis: Sequence[int],
                       options: SolveOptions, hints: Mapping[str, Sequence[int]] | None,
                       deadline: float, sw: Stopwatch, messages: list[str], tag: str,
                       forbid: Mapping[int, frozenset[tuple[int, int]]] | None = None
                       ) -> tuple[_Outcome, dict[str, list[int]] | None, int, int]:
        """Build and solve one program (the groups ``gis``) by ``deadline`` (a
        :data:`_common.clock` time); repair rows a solver tolerance let slip; check the
        solution against the solver's own report (:meth:`_inconsistency`) and, when they
        disagree, re-solve without the start. Returns the outcome (bound in objective
        units), the assignment of those groups, and the program's size."""
        with sw.building():
            prog = _build(pulp, problem, gis, f"qsync_{tag}", forbid)
            if hints is not None:
                _set_start(prog, problem, hints)
        budget = problem.group_budget_ms()
        out = _Outcome("ERROR", None, 0.0)
        assign: dict[str, list[int]] | None = None
        start = hints is not None
        rechecked = False
        attempt = 0
        while True:
            left = deadline - _common.clock()
            if not left > 0:  # nothing is run past the deadline (building took it)
                messages.append(f"{tag}: no time left to run {self.name} (the time limit "
                                "was spent before it)")
                return _Outcome("TIME_LIMIT", None, 0.0), None, prog.n_variables, prog.n_constraints
            out = self._run(pulp, prog, options, left, start, sw, messages)
            if out.status not in ("OPTIMAL", "FEASIBLE"):
                return self._unscaled(out, prog), None, prog.n_variables, prog.n_constraints
            assign = {problem.groups[gv.gi].name: read_assignment(
                gv, len(problem.groups[gv.gi].choices)) for gv in prog.groups}
            own = (part_objective(problem, gis, assign) - prog.obj_offset) * prog.obj_scale
            why = self._inconsistency(out, own, options.rel_gap)
            if why is not None:
                if start and not rechecked and deadline - _common.clock() > 0:
                    messages.append(f"{tag}: {self.name} reported {out.status}, but {why}; "
                                    "the solution looks like the warm start handed back; "
                                    "re-solved without the start")
                    start, rechecked = False, True
                    continue
                messages.append(f"{tag}: {self.name} reported {out.status}, but {why}; the "
                                "plan is kept as FEASIBLE (its own objective) and the "
                                "solver's bound dropped")
                out = dataclasses.replace(out, status="FEASIBLE", bound=None)
            slipped = False
            margin = _REPAIR_MARGIN * 100.0 ** attempt  # relative: 1e-9, 1e-7, 1e-5
            for gv in prog.groups:
                g = problem.groups[gv.gi]
                dt, dm = exact_violation(g, assign[g.name], budget)
                if dt > 0:
                    gv.time_row.constant += dt / gv.time_scale + margin
                    slipped = True
                if dm > 0:
                    gv.mem_row.constant += dm / gv.mem_scale + margin
                    slipped = True
            if not slipped:
                if attempt:
                    messages.append(
                        f"{tag}: {attempt} re-solve(s) after a row exceeded its bound within "
                        f"the solver's tolerance (rows tightened by up to "
                        f"{_REPAIR_MARGIN * 100.0 ** (attempt - 1):.0e} relative)")
                out = dataclasses.replace(out, abs_tol=abs_gap(options.rel_gap))
                return self._unscaled(out, prog), assign, prog.n_variables, prog.n_constraints
            if attempt == _MAX_REPAIRS:
                messages.append(f"{tag}: the solver's assignment still exceeds a bound after "
                                f"{_MAX_REPAIRS} tightenings; no plan")
                return (_Outcome("ERROR", None, out.solve_s), None, prog.n_variables,
                        prog.n_constraints)
            if _common.clock() >= deadline:
                messages.append(f"{tag}: the solver's assignment exceeds a bound within its "
                                "tolerance and no time is left to re-solve with the row "
                                "tightened; no plan")
                return (_Outcome("TIME_LIMIT", None, out.solve_s), None, prog.n_variables,
                        prog.n_constraints)
            attempt += 1

    @staticmethod
    def _unscaled(out: _Outcome, prog: Program) -> _Outcome:
        """The outcome with its bound and objective in objective units."""
        off = prog.obj_offset
        return dataclasses.replace(
            out, bound=None if out.bound is None else out.bound / prog.obj_scale + off,
            objective=None if out.objective is None else out.objective / prog.obj_scale + off,
            abs_tol=None if out.abs_tol is None else out.abs_tol / prog.obj_scale)

    @staticmethod
    def _inconsistency(out: _Outcome, own: float, rel_gap: float) -> str | None:
        """Why the solver's report does not describe the solution it returned (None: it
        does). ``own``: the returned assignment's objective recomputed from the problem, in
        the program's scaled units (the largest coefficient is 1). The reported objective
        must equal it, and an OPTIMAL one must lie within the gap of the bound (HiGHS with a
        start can report kOptimal with the optimum's objective while ``getSolution`` still
        holds the start)."""
        tol = 1e-6 * max(1.0, abs(own))
        if out.objective is not None and abs(own - out.objective) > tol:
            return (f"its solution's own objective {own:.9g} differs from the objective it "
                    f"reports, {out.objective:.9g} (scaled units)")
        if out.status == "OPTIMAL" and out.bound is not None and (
                own - out.bound > rel_gap * abs(own) + 1e-6 + tol):
            return (f"its solution's own objective {own:.9g} is above its bound "
                    f"{out.bound:.9g} by more than the gap (scaled units)")
        return None

    def solve_assignment(self, problem: AllocationProblem, options: SolveOptions,
                         sw: Stopwatch, messages: list[str]
                         ) -> tuple[str, dict[str, list[int]] | None, float | None, int, int]:
        """status, assignment (None if none), bound (objective units), n_vars, n_cons.

        ``options.time_limit_s`` bounds the whole solve (greedy's warm start included); the
        groups share what remains (:func:`_common.solve_parts`)."""
        pulp = pulp_module()
        deadline = Deadline(options.time_limit_s)
        check_numbers(problem)
        hints = start_hints(problem, options, messages, deadline)
        budget = problem.group_budget_ms()
        if self.backend == "highs" and hints is not None:
            messages.append("highs: warm start passed to highspy setSolution "
                            "(pulp's HiGHS class has no warmStart)")
        parts = program_parts(problem, options, messages)

        def solve_part(gis: Sequence[int], limit: float,
                       start: Mapping[str, Sequence[int]] | None) -> PartResult:
            tag = problem.groups[gis[0]].name if len(gis) == 1 else "all"
            end = _common.clock() + max(limit, 0.0)
            seed = start if start is not None else hints
            out, a, nv, nc = self._solve_program(pulp, problem, gis, options, seed, end, sw,
                                                 messages, tag)
            forbid: dict[int, frozenset[tuple[int, int]]] | None = None
            for rnd in range(MAX_RESCALES + 1):
                if out.status != "OPTIMAL" or a is None:
                    break
                why = loose_optimum(problem, gis, a, out.abs_tol, options.rel_gap)
                if why is None:
                    break
                new = excluded_choices(problem, gis, a)
                if new == forbid or _common.clock() >= end or rnd == MAX_RESCALES:
                    messages.append(f"{tag}: {self.name} reported OPTIMAL, but {why}; status "
                                    "FEASIBLE, its bound dropped")
                    out = dataclasses.replace(out, status="FEASIBLE", bound=None)
                    break
                n_out = sum(len(v) for v in new.values())
                messages.append(f"{tag}: {self.name} reported OPTIMAL, but {why}; re-solved "
                                f"without the {n_out} choice(s) whose Omega alone exceeds the "
                                "plan's (no better plan takes them), the objective rescaled")
                forbid = new
                out2, a2, nv, nc = self._solve_program(pulp, problem, gis, options, a, end,
                                                       sw, messages, tag, forbid)
                if a2 is None or part_objective(problem, gis, a2) > part_objective(
                        problem, gis, a):
                    messages.append(f"{tag}: the re-solve gave {out2.status} and no better "
                                    "plan; the first plan is kept as FEASIBLE (no bound: the "
                                    "first solve's is not proven)")
                    out = dataclasses.replace(out, status="FEASIBLE", bound=None)
                    break
                out, a = out2, a2
            if out.detail:
                messages.append(f"{tag}: {out.detail}")
            if out.status == "INFEASIBLE":
                messages.extend(infeasible_messages(problem, gis, budget))
                messages.append(f"{tag}: no assignment meets the target and capacity")
            return PartResult(out.status, a, out.bound, nv, nc)

        return solve_parts(problem, parts, solve_part, deadline, messages, options.rel_gap)

    def solve(self, problem: AllocationProblem, options: SolveOptions
              ) -> tuple[Plan | None, SolveReport]:
        sw = Stopwatch()
        messages: list[str] = []
        if not self.is_available():
            messages.append(f"{self.name}: solver not available (pulp or the binary missing)")
            return finish(problem, self.name, None, status="ERROR", mode=mode_text(problem),
                          options=options, sw=sw, messages=messages)
        status, a, bound, nv, nc = self.solve_assignment(problem, options, sw, messages)
        if a is not None and status == "OPTIMAL" and bound is not None:
            bound = min(bound, problem.objective(a))
        return finish(problem, self.name, a, status=status, mode=mode_text(problem),
                      options=options, sw=sw, bound=bound, n_variables=nv, n_constraints=nc,
                      messages=messages, extra_options={"backend": self.backend})


def loose_optimum(problem: AllocationProblem, gis: Sequence[int],
                  assignment: Mapping[str, Sequence[int]], abs_tol: float | None,
                  rel_gap: float) -> str | None:
    """Why an OPTIMAL plan is not proven within the relative gap (None: it is): the
    solver's absolute gap ``abs_tol`` (objective units) exceeds ``rel_gap`` of the plan's
    objective, as when one Omega is 1e5 times the rest and the optimum is made of the
    rest. A plan whose shifted objective is 0 is optimal whatever the tolerances."""
    if abs_tol is None:
        return None
    z = part_objective(problem, gis, assignment)
    low = sum(g.weight * min(r) for gi in gis for g in [problem.groups[gi]] for r in g.omega1
              if r)
    if z - low <= 0.0 or abs_tol <= rel_gap * abs(z):
        return None
    return (f"its absolute gap tolerance {abs_tol:.3g} is more than the relative gap "
            f"{rel_gap:g} of the plan's objective {z:.6g} (Omegas of very different sizes)")


def excluded_choices(problem: AllocationProblem, gis: Sequence[int],
                     assignment: Mapping[str, Sequence[int]]
                     ) -> dict[int, frozenset[tuple[int, int]]]:
    """Per group, the (unit, choice) pairs whose shifted ``w * Omega`` alone exceeds the
    plan's whole shifted objective: every term is >= 0, so no plan at least as good takes
    one. Leaving them out makes the largest coefficient at most the plan's objective."""
    shifted = {gi: shifted_omega(problem.groups[gi]) for gi in gis}
    z = sum(row[k] for gi in gis
            for row, k in zip(shifted[gi], assignment[problem.groups[gi].name], strict=True))
    return {gi: frozenset((u, k) for u, row in enumerate(shifted[gi])
                          for k, v in enumerate(row) if v > z) for gi in gis}


class AdditiveIlp:
    """Baseline: the one-hot ILP of QSync's and HAWQ-V3's code, with purely additive
    latency (no cast terms). Solved exactly on its own model, scored on the real one."""

    name = "additive-ilp"
    exact = False

    def _backend(self) -> PulpIlp | None:
        for b in ("highs", "cbc"):
            if PulpIlp(b).is_available():
                return PulpIlp(b)
        return None

    def is_available(self) -> bool:
        return self._backend() is not None

    def solve(self, problem: AllocationProblem, options: SolveOptions
              ) -> tuple[Plan | None, SolveReport]:
        sw = Stopwatch()
        messages: list[str] = []
        backend = self._backend()
        if backend is None:
            messages.append("additive-ilp: no PuLP solver available")
            return finish(problem, self.name, None, status="ERROR", mode=mode_text(problem),
                          options=options, sw=sw, messages=messages)
        with sw.building():
            additive = problem.with_options(casts=False, target_ms=problem.target_ms)
            for ga, g in zip(additive.groups, problem.groups, strict=True):
                ga.capacity_bytes = g.capacity_bytes  # the same bound, even if edited
        messages.append(
            f"additive model solved with {backend.name}: its time row ignores casts (QSync's "
            "and HAWQ-V3's ILP); the plan is scored on the cast-aware model")
        status, a, _, nv, nc = backend.solve_assignment(additive, options, sw, messages)
        if a is not None:
            budget = problem.group_budget_ms()
            bad = []
            for g in problem.groups:
                dt, dm = exact_violation(g, a[g.name], budget)
                if dt > 0:
                    bad.append(f"group {g.name}: time {g.time_ms(a[g.name]):.4f} ms exceeds "
                               f"the budget {budget:.4f} ms by {dt:.4f} ms once casts count")
                if dm > 0:
                    bad.append(f"group {g.name}: memory exceeds the capacity by {dm:.0f} bytes "
                               "in the cast-aware model")
            messages.extend(bad)
            status = "INFEASIBLE" if bad else "FEASIBLE"
            if bad:
                messages.append("the plan is returned although it violates the real model")
        return finish(problem, self.name, a, status=status, mode=mode_text(problem),
                      options=options, sw=sw, bound=None, n_variables=nv, n_constraints=nc,
                      messages=messages, extra_options={"backend": backend.name,
                                                        "casts": False})
