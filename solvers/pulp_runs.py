"""One run of CBC or HiGHS, through PuLP, on a program :mod:`.pulp_model` translated.

HiGHS runs through pulp's ``HiGHS`` class (highspy), subclassed to pass the model in bulk,
to warm-start with ``setSolution`` (pulp's class has no warm start) and to read the model
status and ``mip_dual_bound``. CBC runs through pulp's bundled command (``PULP_CBC_CMD``,
else ``COIN_CMD``) with ``-mips`` for a warm start; its bound is read from its log
(:mod:`.cbc_log`). The model's transfer to the solver (highspy arrays, or the MPS file and
solution file) counts as building, the solver's run as solving.
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
from qsync_opt.solvers.base import SolveOptions
from qsync_opt.solvers.cbc_log import read_cbc_log
from qsync_opt.solvers.highs_process import RowArrays, add_columns, use_threads, without_banner
from qsync_opt.solvers.pulp_model import PulpProgram
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


def _load_model(pulp: ModuleType, lp: Any) -> list[Any]:
    """Pass ``lp``'s columns, objective, integrality and rows to its highspy model in bulk
    (numpy arrays, not one column and row at a time); its variables, indexed."""
    import highspy  # lazy: importing HiGHS costs ~0.25 s, kept off paths that never solve
    h = lp.solverModel
    inf = highspy.kHighsInf
    variables = lp.variables()
    for i, v in enumerate(variables):
        v.index = i
    add_columns(h, [-inf if v.lowBound is None else v.lowBound for v in variables],
                [inf if v.upBound is None else v.upBound for v in variables],
                [(v.index, c) for v, c in lp.objective.items() if c])
    ints = [v.index for v in variables if v.cat == pulp.LpInteger]
    if ints:
        h.changeColsIntegrality(
            len(ints), np.array(ints, dtype=np.int32),
            np.full(len(ints), int(highspy.HighsVarType.kInteger), dtype=np.uint8))
    rows = RowArrays()
    for i, con in enumerate(lp._constraints.values()):
        con.index = i
        lb, ub = con.getLb(), con.getUb()
        rows.add(-inf if lb is None else lb, inf if ub is None else ub,
                 ((v.index, c) for v, c in con.items() if c))
    rows.load(h)
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
            t0 = time.perf_counter()
            without_banner(lambda: self.createAndConfigureSolver(lp))
            variables = _load_model(pulp, lp)
            h = lp.solverModel
            if self.start_values is not None:
                idx = [v.index for v, _ in self.start_values]
                val = [float(s) for _, s in self.start_values]
                h.setSolution(len(idx), np.asarray(idx, dtype=np.int32),
                              np.asarray(val, dtype=np.float64))
            use_threads(self.threads)
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
    log = read_cbc_log(text)
    if start and not log.mentions_start:
        messages.append("cbc: warm start given but not reported in CBC's log")
    result, obj, lower = log.result, log.objective, log.lower
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

