"""The formulation translated into PuLP, and one run of CBC or HiGHS on it.

Translation (:func:`to_pulp`): every variable and row of the
:class:`~.formulation.Formulation`, in its order and with its names; coefficients that are
0 are dropped. Floating-point numerics: each row is normalised by its ``scale`` (the time
rows by the group budget, the memory and working-set rows by the capacity, the working set
``W`` expressed in units of the capacity), so the solvers' absolute tolerances act
relatively. The degradation objective is each unit's ``w * Omega`` less its least (a
constant, :attr:`PulpProgram.obj_offset`), divided by its largest coefficient
(:attr:`PulpProgram.obj_scale`); the time objective is in ms, the memory objective in units
of the capacity. A forbidden choice is a binary with upper bound 0.

Solver specifics. HiGHS runs through pulp's ``HiGHS`` class (highspy), subclassed to pass
the model in bulk, to warm-start with ``setSolution`` (pulp's class has no warm start) and
to read the model status and ``mip_dual_bound``. CBC runs through pulp's bundled command
(``PULP_CBC_CMD``, else ``COIN_CMD``) with ``-mips`` for a warm start; its bound is read from
its log ("Lower bound", rounded down past its printed digits). The model's transfer to the
solver (highspy arrays, or the MPS file and solution file) counts as building, the
solver's run as solving.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
from qsync_opt.solvers.base import SolveOptions
from qsync_opt.solvers.formulation import Block, Formulation
from qsync_opt.solvers.timing import Stopwatch, solver_limit

PULP_NAMES = {"cbc": ("PULP_CBC_CMD", "COIN_CMD"), "highs": ("HiGHS",)}
#: Feasibility and integrality tolerance asked of CBC and HiGHS (rows are normalised to ~1).
FEAS_TOL = 1e-9
#: The absolute gap asked of CBC and HiGHS, as a fraction of ``rel_gap`` (in the program's
#: units, where the largest objective coefficient is 1): an OPTIMAL plan whose objective is
#: at least 1e-3 of that coefficient is then proven within the relative gap; a smaller one is
#: re-solved without the choices that cannot be in a better plan (``driver.loose_optimum``),
#: which rescales its objective.
ABS_GAP_OF_REL = 1e-3


def abs_gap(rel_gap: float) -> float:
    """The absolute gap (program units) asked of the solver for a relative gap."""
    return max(ABS_GAP_OF_REL * min(max(rel_gap, 0.0), 1e-3), 1e-13)


def pulp_module() -> ModuleType:
    import pulp  # lazy: importing PuLP costs ~0.3 s, kept off paths that never solve

    return pulp


def available_pulp_solvers() -> list[str]:
    """The solvers PuLP can run here (asked of PuLP once per process: it probes each one)."""
    return list(_pulp_solvers())


@functools.cache
def _pulp_solvers() -> tuple[str, ...]:
    try:
        pulp = pulp_module()
    except Exception:
        return ()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return tuple(pulp.listSolvers(onlyAvailable=True))
        except Exception:
            return ()


def available(backend: str) -> bool:
    """Whether PuLP can run ``backend`` ("cbc" or "highs") here."""
    have = available_pulp_solvers()
    return any(n in have for n in PULP_NAMES[backend])


# --------------------------------------------------------------------------- translation


@dataclass
class PulpGroup:
    """One group's PuLP variables and its time and memory constraints (whose constants a
    repair tightens), with the scales they are normalised by."""

    block: Block
    x: list[list[Any]]
    pairs: list[tuple[int, list[list[Any]]]]  # (pair index, y[ka][kb])
    w: Any
    time_row: Any
    mem_row: Any
    time_scale: float
    mem_scale: float

    @property
    def gi(self) -> int:
        return self.block.gi


@dataclass
class PulpProgram:
    lp: Any
    form: Formulation
    groups: list[PulpGroup]
    n_variables: int = 0
    n_constraints: int = 0
    obj_terms: list[tuple[Any, float]] = field(default_factory=list)
    #: The degradation objective is multiplied by this (largest coefficient -> 1) so that
    #: the solvers' absolute tolerances do not swallow small Omegas; bounds are divided back.
    obj_scale: float = 1.0
    #: Each unit's coefficients are shifted by their least (``w * min Omega``, a constant
    #: of every assignment): the program's objective is the exact one minus this.
    obj_offset: float = 0.0


_SENSES = {"==": "LpConstraintEQ", "<=": "LpConstraintLE", ">=": "LpConstraintGE"}


def _objective_terms(form: Formulation, lpv: list[Any]) -> tuple[list[tuple[Any, float]],
                                                                 float]:
    """The objective's PuLP terms (unscaled) and the constant left out of them."""
    obj = form.objective
    if obj.kind == "degradation":
        coef = dict(obj.terms)
        terms: list[tuple[Any, float]] = []
        offset = 0.0
        for b in form.blocks:
            lows = []
            for u in range(b.n_real):
                row = [coef[v] for v in b.x[u]]
                low = min(row, default=0.0)
                lows.append(low)
                for v, t in zip(b.x[u], row, strict=True):
                    shifted = t - low
                    if shifted and form.variables[v].ub != 0.0:
                        terms.append((lpv[v], shifted))
            offset += sum(lows)
        return terms, offset
    variables = form.variables
    if obj.kind == "time":  # in ms: the normalised row's coefficients times its scale
        return [(lpv[v], (c * variables[v].unit / obj.scale) * obj.scale)
                for v, c in obj.terms if c], 0.0
    return [(lpv[v], c * variables[v].unit / obj.scale) for v, c in obj.terms if c], 0.0


def _column_bounds(form: Formulation) -> list[tuple[float, float | None]]:
    """Each variable's (lower, upper) bound in the normalised units (a forbidden binary's
    upper bound is 0)."""
    out: list[tuple[float, float | None]] = []
    for var in form.variables:
        if var.kind == "binary":
            out.append((0.0, 0.0 if var.ub == 0.0 else 1.0))
        else:
            out.append((var.lb / var.unit if var.unit != 1.0 else var.lb, var.ub))
    return out


def _normalised_rows(form: Formulation) -> Iterator[tuple[Any, list[tuple[int, float]], float]]:
    """Each row as (row, its nonzero terms divided by its scale, its right-hand side less
    its constant, divided by its scale)."""
    units = [var.unit for var in form.variables]
    for row in form.rows:
        s = row.scale
        terms = [(v, c / s if units[v] == 1.0 else c * units[v] / s) for v, c in row.terms if c]
        rhs = row.rhs if s == 1.0 and not row.constant else (row.rhs - row.constant) / s
        yield row, terms, rhs


def _scaled_objective(form: Formulation, cols: list[Any]
                      ) -> tuple[list[tuple[Any, float]], float, float]:
    """The objective's terms over ``cols`` (one per variable) in the program's units, with
    its scale and offset (see :class:`PulpProgram`)."""
    terms, offset = _objective_terms(form, cols)
    scale = 1.0
    if form.objective.kind == "degradation":
        top = max((abs(c) for _, c in terms), default=0.0)
        if top > 0:
            scale = 1.0 / top
            terms = [(v, c * scale) for v, c in terms]
    else:
        offset = 0.0
    return terms, scale, offset


def to_pulp(pulp: ModuleType, form: Formulation, name: str) -> PulpProgram:
    """The PuLP model of ``form`` (see the module's docstring for the numerics)."""
    lp = pulp.LpProblem(name, pulp.LpMinimize)
    LpAffineExpression, LpConstraint = pulp.LpAffineExpression, pulp.LpConstraint
    senses = {s: getattr(pulp, n) for s, n in _SENSES.items()}
    add_var, add_con = lp.add_variable, lp.addConstraint
    lpv: list[Any] = []
    for var, (lb, ub) in zip(form.variables, _column_bounds(form), strict=True):
        if var.kind == "binary":
            v = add_var(var.name, 0, 1, pulp.LpBinary)
            if ub == 0.0:
                v.upBound = 0  # (after creation: a binary's bounds are set to 0..1)
        else:
            v = add_var(var.name, lb, ub)
        lpv.append(v)
    cons: list[Any] = []
    for row, terms, rhs in _normalised_rows(form):
        con = LpConstraint(LpAffineExpression([(lpv[v], c) for v, c in terms]),
                           senses[row.sense], row.name, rhs)
        add_con(con)
        cons.append(con)
    groups = []
    for b in form.blocks:
        x = [[lpv[v] for v in row] for row in b.x]
        pairs = [(pi, [[lpv[v] for v in yrow] for yrow in y]) for pi, y in b.pairs]
        time_row = cons[b.time_row] if b.time_row is not None else None
        groups.append(PulpGroup(b, x, pairs, lpv[b.w], time_row, cons[b.mem_row],
                                b.time_scale, b.mem_scale))
    prog = PulpProgram(lp, form, groups, form.n_variables, form.n_constraints)
    terms, prog.obj_scale, prog.obj_offset = _scaled_objective(form, lpv)
    prog.obj_terms = terms
    lp.setObjective(LpAffineExpression(terms))
    return prog


def lp_relaxation(form: Formulation, options: SolveOptions) -> tuple[str, float | None]:
    """The optimum of ``form``'s LP relaxation (every binary continuous in [0, 1]), solved
    by HiGHS on the same normalised rows as :func:`to_pulp` gives it, passed straight to
    highspy: ("OPTIMAL", objective in the formulation's units), ("INFEASIBLE", None) or
    (another status, None)."""
    import highspy  # lazy: importing HiGHS costs ~0.25 s, kept off paths that never solve
    limit = solver_limit(float(options.time_limit_s))
    if not limit > 0:  # not started: too little time left for a run and its margin
        return "TIME_LIMIT", None
    global _HIGHS_BANNER_DONE
    if _HIGHS_BANNER_DONE:
        h = highspy.Highs()
    else:
        with _quiet_stdout():
            h = highspy.Highs()
        _HIGHS_BANNER_DONE = True
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", limit)
    h.setOptionValue("random_seed", int(options.seed))
    h.setOptionValue("primal_feasibility_tolerance", FEAS_TOL)
    if options.threads:
        h.setOptionValue("threads", int(options.threads))
    _use_threads(options.threads)
    inf = highspy.kHighsInf
    bounds = _column_bounds(form)
    h.addVars(len(bounds), np.array([lb for lb, _ in bounds], dtype=np.float64),
              np.array([inf if ub is None else ub for _, ub in bounds], dtype=np.float64))
    terms, scale, offset = _scaled_objective(form, list(range(len(bounds))))
    if terms:
        h.changeColsCost(len(terms), np.array([v for v, _ in terms], dtype=np.int32),
                         np.array([c for _, c in terms], dtype=np.float64))
    lower: list[float] = []
    upper: list[float] = []
    starts: list[int] = []
    index: list[int] = []
    value: list[float] = []
    for row, rterms, rhs in _normalised_rows(form):
        starts.append(len(index))
        index.extend(v for v, _ in rterms)
        value.extend(c for _, c in rterms)
        lower.append(rhs if row.sense in ("==", ">=") else -inf)
        upper.append(rhs if row.sense in ("==", "<=") else inf)
    if lower:
        h.addRows(len(lower), np.array(lower, dtype=np.float64),
                  np.array(upper, dtype=np.float64), len(index),
                  np.array(starts, dtype=np.int32), np.array(index, dtype=np.int32),
                  np.array(value, dtype=np.float64))
    h.run()
    S = highspy.HighsModelStatus
    status = h.getModelStatus()
    if status == S.kOptimal:
        return "OPTIMAL", h.getInfo().objective_function_value / scale + offset
    if status in (S.kInfeasible, S.kUnboundedOrInfeasible):
        return "INFEASIBLE", None
    return str(status), None


def set_start(prog: PulpProgram, hints: Mapping[str, Sequence[int]]) -> None:
    """The variables' initial values at the given choices (a warm start; a hint that takes
    a choice fixed to 0, a hopeless one, is passed as given: the solver discards a start
    that breaks a bound)."""
    point = prog.form.point(hints)
    for pg in prog.groups:
        b = pg.block
        for row, vs in zip(b.x, pg.x, strict=True):
            for i, v in zip(row, vs, strict=True):
                v.setInitialValue(int(point[i]), check=False)
        for (_, y), (_, yv) in zip(b.pairs, pg.pairs, strict=True):
            for yrow, vrow in zip(y, yv, strict=True):
                for i, v in zip(yrow, vrow, strict=True):
                    v.setInitialValue(int(point[i]), check=False)
        pg.w.setInitialValue(point[b.w] / pg.mem_scale, check=False)


def read_assignment(pg: PulpGroup) -> list[int]:
    """The real units' choices (the derived ones follow from them)."""
    out = []
    for row in pg.x[:pg.block.n_real]:
        vals = [v.varValue if v.varValue is not None else 0.0 for v in row]
        out.append(max(range(len(vals)), key=vals.__getitem__))
    return out


# --------------------------------------------------------------------------- one run


@dataclass
class Outcome:
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


def _use_threads(threads: int | None) -> None:
    """HiGHS fixes its thread pool at the first run in a process; a run asking for another
    thread count fails (model status kNotset) unless the pool is reset: reset it then."""
    import highspy  # lazy: importing HiGHS costs ~0.25 s, kept off paths that never solve

    global _HIGHS_THREADS
    want = int(threads or 0)
    if want != _HIGHS_THREADS:
        if _HIGHS_THREADS is not None:
            highspy.Highs.resetGlobalScheduler(True)
        _HIGHS_THREADS = want


def _load_model(pulp: ModuleType, lp: Any) -> list[Any]:
    """Pass ``lp``'s columns, objective, integrality and rows to its highspy model in bulk
    (numpy arrays, not one column and row at a time); its variables, indexed."""
    import highspy  # lazy: importing HiGHS costs ~0.25 s, kept off paths that never solve
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
    lower: list[float] = []
    upper: list[float] = []
    starts: list[int] = []
    index: list[int] = []
    value: list[float] = []
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
    return variables


def _highs_class(pulp: Any) -> Any:  # Any: the class subclasses one of its members
    class _Highs(pulp.HiGHS):
        """pulp's HiGHS, with the model passed to highspy in bulk (numpy arrays, not one
        column and row at a time), a warm start (highspy setSolution), the run timed apart
        from the transfer, and the model status and dual bound kept."""

        start_values: list[tuple[Any, float]] | None = None
        run_s = 0.0
        transfer_s = 0.0
        outcome: tuple[Any, Any, float, float] | None = None

        def actualSolve(self, lp: Any) -> Any:
            global _HIGHS_BANNER_DONE
            t0 = time.perf_counter()
            if _HIGHS_BANNER_DONE:
                self.createAndConfigureSolver(lp)
            else:
                with _quiet_stdout():
                    self.createAndConfigureSolver(lp)
                _HIGHS_BANNER_DONE = True
            variables = _load_model(pulp, lp)
            h = lp.solverModel
            if self.start_values is not None:
                idx = [v.index for v, _ in self.start_values]
                val = [float(s) for _, s in self.start_values]
                h.setSolution(len(idx), np.asarray(idx, dtype=np.int32),
                              np.asarray(val, dtype=np.float64))
            _use_threads(self.threads)
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


def _cbc_class(pulp: Any, base_name: str) -> Any:  # Any: subclasses one of its members
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
_CBC_GAP = re.compile(r"Exiting as integer gap of\s*([0-9.eE+-]+)")
_CBC_BEST = re.compile(r"Search completed - best objective\s*([0-9.eE+-]+)")
_CBC_NUM = r"\s*:?\s*(-?[0-9.eE+-]+|inf|-inf|1e\+50|-1e\+50)"


def cbc_log_value(text: str, label: str, lower: bool = False) -> float | None:
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



def run(pulp: ModuleType, prog: PulpProgram, backend: str, options: SolveOptions, time_limit: float,
        start: bool, sw: Stopwatch, messages: list[str]) -> Outcome:
    """Run CBC or HiGHS (``backend``) on ``prog`` for at most ``time_limit`` seconds
    (``start``: from the variables' initial values); the solver's time goes to
    ``sw.solve_s``, the model's transfer to it to ``sw.build_s``. The solver is handed
    :func:`~.timing.solver_limit` of ``time_limit`` (room for its own overrun and the work
    after it) and is not started when that is 0 (TIME_LIMIT, no plan)."""
    asked = time_limit
    time_limit = solver_limit(time_limit)
    if not time_limit > 0:
        messages.append(f"{backend} not started: {asked:.3g} s left is below its minimum "
                        "run with the safety margin")
        return Outcome("TIME_LIMIT", None, 0.0, "no time left to start the solver")
    if backend == "highs":
        return _run_highs(pulp, prog, options, time_limit, start, sw)
    return _run_cbc(pulp, prog, options, time_limit, start, sw, messages)


def _run_highs(pulp: ModuleType, prog: PulpProgram, options: SolveOptions, time_limit: float,
               start: bool, sw: Stopwatch) -> Outcome:
    """One HiGHS run (through highspy) handed ``time_limit`` seconds."""
    lp = prog.lp
    cls = _highs_class(pulp)
    params: dict[str, Any] = {"random_seed": int(options.seed),
                              "mip_feasibility_tolerance": FEAS_TOL,
                              "primal_feasibility_tolerance": FEAS_TOL,
                              "mip_abs_gap": abs_gap(options.rel_gap)}
    params.update(options.highs.params)
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
    import highspy  # lazy: importing HiGHS costs ~0.25 s, kept off paths that never solve

    S = highspy.HighsModelStatus
    has_sol = primal == 2  # kSolutionStatusFeasible
    bound = dual_bound if math.isfinite(dual_bound) else None
    reported = obj_value if has_sol and math.isfinite(obj_value) else None
    if mstatus == S.kOptimal:
        return Outcome("OPTIMAL", bound, solver.run_s, objective=reported)
    if mstatus in (S.kInfeasible, S.kUnboundedOrInfeasible):
        return Outcome("INFEASIBLE", None, solver.run_s)
    if mstatus in (S.kTimeLimit, S.kInterrupt, S.kIterationLimit, S.kSolutionLimit,
                   S.kObjectiveBound, S.kObjectiveTarget):
        return Outcome("FEASIBLE" if has_sol else "TIME_LIMIT", bound, solver.run_s,
                        objective=reported)
    return Outcome("ERROR", None, solver.run_s, f"HiGHS model status {mstatus}")


def _run_cbc(pulp: ModuleType, prog: PulpProgram, options: SolveOptions, time_limit: float,
             start: bool, sw: Stopwatch, messages: list[str]) -> Outcome:
    """One CBC run (its command line) handed ``time_limit`` seconds; the bound read from
    its log when it stops early."""
    lp = prog.lp
    have = available_pulp_solvers()
    cls_name = next(n for n in PULP_NAMES["cbc"] if n in have)
    fd, log_path = tempfile.mkstemp(suffix=".log", prefix="qsync_cbc_")
    os.close(fd)
    try:
        # (CBC's cutoff increment, 1e-5 by default, would act as an absolute gap too)
        extra = [f"integerTolerance {FEAS_TOL}", f"primalTolerance {FEAS_TOL}",
                 f"allowableGap {abs_gap(options.rel_gap):g}",
                 f"increment {abs_gap(options.rel_gap):g}"]
        if options.seed:
            extra.append(f"randomCbcSeed {int(options.seed)}")
        extra += list(options.cbc.args)
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
    obj = cbc_log_value(text, "Objective value")
    lower = cbc_log_value(text, "Lower bound", lower=True)
    # The summary prints the bound to a few digits only (1.735 for 1.73549438 with a gap of
    # 4e-12); the search's own lines give it in full: best objective minus the gap it exited at.
    gap, best = _CBC_GAP.search(text), _CBC_BEST.search(text)
    if gap and best:
        try:
            full = float(best.group(1)) - float(gap.group(1))
        except ValueError:
            full = math.nan
        if math.isfinite(full):
            lower = full if lower is None else max(lower, full)
    if lp.status == pulp.LpStatusInfeasible or result.startswith(
            ("Problem proven infeasible", "Linear relaxation infeasible")):
        return Outcome("INFEASIBLE", None, run)
    if lp.status == pulp.LpStatusOptimal and lp.sol_status == pulp.LpSolutionOptimal:
        # (within the gap tolerance CBC prints a lower bound; proven optimal, it does not)
        return Outcome("OPTIMAL", lower if lower is not None else obj, run, objective=obj)
    if lp.status == pulp.LpStatusOptimal and lp.sol_status == pulp.LpSolutionIntegerFeasible:
        return Outcome("FEASIBLE", lower, run, objective=obj)
    if lp.status == pulp.LpStatusNotSolved:
        return Outcome("TIME_LIMIT", lower, run)
    return Outcome("ERROR", None, run, f"CBC: {result or pulp.LpStatus[lp.status]}")

