"""The exact program in OR-Tools CP-SAT (Boolean x and y, integer coefficients):
translation and one run of a part.

The model is a translation of :mod:`.formulation`'s program (one-hot ``x``, pair variables
``y`` tied to ``x`` by their marginal rows, AND rows for derived units, the working set
``W`` as an integer variable), in two steps: :func:`.integers.integer_group` turns each
group's block into integers (the rounding, its scale factors and slacks kept in
:class:`.integers.Scaling` and recorded in the report), then :meth:`CpSat._build` writes
the rows of the chosen groups, family by family (one-hot rows become
``add_exactly_one``). The driver (:mod:`.driver`) runs it: the deadline, the parts, the
warm start and the loose-optimum loop are its (an OPTIMAL whose objective rounding could
hide a better plan is re-solved on an objective scale fitted to the choices left).

Each program is solved on the outer model first; if its optimum is feasible in the exact
model (``GroupModel.time_ms`` / ``memory_bytes``, relative tolerance ``FEAS_REL``) it is the
exact optimum (up to ``2 * max_objective_error``). Otherwise the optimum sits within the
rounding slack of a bound, and the inner model gives the plan (status OPTIMAL only if it
meets the outer bound within the gap). Either way the exact objective of CP-SAT's plan is
at most the optimum of the problem with the budget reduced by ``max_time_slack_ms`` and the
capacity by ``max_mem_slack_bytes``, plus ``2 * max_objective_error`` and the relative gap;
the reported bound (the outer model's) is a bound on the exact problem.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from qsync_opt.solvers import timing
from qsync_opt.solvers.base import Forbidden, PartResult, SolveOptions, Translation
from qsync_opt.solvers.checks import cheap_infeasibility, exact_violation, infeasible_messages
from qsync_opt.solvers.driver import solve_exact
from qsync_opt.solvers.formulation import formulate
from qsync_opt.solvers.integers import (
    IntGroup,
    Scaling,
    integer_group,
    omega_scale_for,
    scaling_for,
)
from qsync_opt.solvers.timing import Stopwatch

from qsync_opt.documents.schemas import Plan, SolveReport
from qsync_opt.problem.program import AllocationProblem


def _chosen(solver: Any, row: Sequence[Any]) -> int:
    """The index of the variable of a one-hot row that is 1 in the solver's solution."""
    values = [solver.value(v) for v in row]
    return max(range(len(values)), key=values.__getitem__)


@dataclass
class _Solved:
    status: str  # OPTIMAL, FEASIBLE, INFEASIBLE, TIME_LIMIT, ERROR
    assignment: dict[str, list[int]] | None
    bound: float  # scaled objective bound / omega_scale
    name: str  # CP-SAT's status name
    wall_s: float
    own: int | None = None  # the assignment's scaled objective, recomputed
    reported: float | None = None  # CP-SAT's objective_value
    scaled_bound: float | None = None  # CP-SAT's best_objective_bound


#: Programs at most this large (variables) run on one CP-SAT worker by default: measured on
#: this 2-core machine, one worker proves resnet50 (1.6k variables) in 0.19 s and
#: gpt2_medium (4.5k per group) in 2.7 s, against 0.28 s and 6.5 s with 8; the 600-op
#: synthetic graph (26k per group) needs the 8-worker portfolio (2 workers stayed unproven
#: after 60 s in the issue's probe).
SMALL_PROGRAM_VARS = 20_000


def prefer_highs(problem: AllocationProblem, n_variables: int) -> str:
    """What the report says when CP-SAT stops without proving its plan optimal: the menu's
    size, and that HiGHS is the backend to prefer there (on BERT-base with ``--int4`` at
    batch 32 CP-SAT stopped at its limit with a 0.7% gap after 56 s where HiGHS proves
    the optimum: CP-SAT's integer model grows with the menu, HiGHS's LP bounds do not)."""
    menu = max((len(c) for g in problem.groups for c in g.choices), default=0)
    return (f"cpsat stopped without proving the optimum (a gap remains) on a program of "
            f"{n_variables} variables, up to {menu} choices per op: on large menus (--int4, "
            "many precisions) prefer --solver highs, which proves such programs in floating "
            "point")


def default_workers(n_variables: int) -> int:
    """CP-SAT workers when the user sets no thread count."""
    return 1 if n_variables <= SMALL_PROGRAM_VARS else 8


@dataclass
class IntModels:
    """The integer models a run of a part uses: the inner (costs up, bounds down) and the
    outer (costs down, bounds up) coefficients per group, and their scaling."""

    inner: Mapping[int, IntGroup]
    outer: Mapping[int, IntGroup]
    scaling: Scaling


@dataclass
class CpSatTranslation(Translation):
    """A CP-SAT call: OR-Tools' model module and the call's integer models."""

    cp_model: Any = None
    models: IntModels = field(default_factory=lambda: IntModels({}, {}, Scaling(0, 0, 0)))


def scaling_message(form_rows: int, sc: Scaling) -> str:
    """What the report says of the call's integer scaling."""
    return (f"integer scaling (the formulation's {form_rows} rows translated twice): "
            f"time unit {sc.time_unit_ms:g} ms, memory unit {sc.mem_unit_bytes:g} B, "
            f"objective x{sc.omega_scale:g} rounded to nearest; the inner model rounds "
            "costs up and bounds down (its plans are feasible in the exact model) and may "
            f"lose assignments within {sc.max_time_slack_ms:.3g} ms of the budget or "
            f"{sc.max_mem_slack_bytes:.3g} B of the capacity; the outer model (costs down, "
            f"bounds up) gives the bound; objective error <= {sc.max_objective_error:.3g}")


class CpSat:
    """OR-Tools CP-SAT on the exact program (integer-scaled, conservatively)."""

    name = "cpsat"
    exact = True
    requires = "ortools"
    hint_note = "warm start: hints given to CP-SAT (add_hint)"
    tolerance_name = "its objective's possible rounding error"
    demotion_note = ", its bound lowered by that rounding error"

    def is_available(self) -> bool:
        try:
            from ortools.sat.python import cp_model  # noqa: F401
        except Exception:
            return False
        return True

    def solve(self, problem: AllocationProblem, options: SolveOptions
              ) -> tuple[Plan | None, SolveReport]:
        """Per program (one per group, or one for all): first the *outer* model (a
        relaxation); if its optimum is feasible in the exact model it is the exact optimum.
        Otherwise (an optimum within the rounding slack of a bound) the *inner* model, whose
        every solution is exactly feasible, gives the plan and the outer model the bound."""
        return solve_exact(self, problem, options)

    # ------------------------------------------------------- what the driver calls

    def translate(self, problem: AllocationProblem, options: SolveOptions, sw: Stopwatch,
                  messages: list[str]) -> CpSatTranslation:
        """The call's integer models (the formulation translated twice, inner and outer),
        or, before any scaling, the groups' least time and memory's proof of no plan
        (costs far above a tiny budget need no integers)."""
        from ortools.sat.python import cp_model  # lazy: OR-Tools is heavy to import

        proof = cheap_infeasibility(problem)
        if proof:  # the report's scaling keys are always there: zero units, no integers
            none = {**Scaling(0.0, 0.0, 0.0).to_json(), "scaled": False}
            return CpSatTranslation(problem, options, sw, messages, proof=proof,
                                    report_options=none)
        with sw.building():
            sc = scaling_for(problem, options.cpsat.units)
            form = formulate(problem)
            inner: dict[int, IntGroup] = {}
            outer: dict[int, IntGroup] = {}
            for b in form.blocks:
                group, time_slack, mem_slack, objective_error = integer_group(form, b, sc)
                inner[b.gi] = group
                outer[b.gi] = integer_group(form, b, sc, outer=True)[0]
                sc.max_time_slack_ms = max(sc.max_time_slack_ms, time_slack)
                sc.max_mem_slack_bytes = max(sc.max_mem_slack_bytes, mem_slack)
                sc.max_objective_error += objective_error
        messages.append(scaling_message(len(form.rows), sc))
        report = {**sc.to_json(), "num_workers": options.threads or "auto",
                  "linearization_level": 2, "presolve_inclusion_work_limit": 0}
        return CpSatTranslation(problem, options, sw, messages, report_options=report,
                                optimal_tol=2 * sc.max_objective_error + 1.0 / sc.omega_scale,
                                cp_model=cp_model, models=IntModels(inner, outer, sc))

    def run(self, translation: CpSatTranslation, gis: Sequence[int], limit: float,
            start: Mapping[str, Sequence[int]] | None, forbid: Forbidden | None
            ) -> PartResult:
        t = translation
        models = t.models if forbid is None else self._rescaled(t, gis, forbid)
        return self._solve_part(t, gis, limit, start, models)

    def rescale_note(self, translation: CpSatTranslation, gis: Sequence[int],
                     forbid: Forbidden) -> str:
        return f"objective x{self._rescaled_scaling(translation, gis, forbid).omega_scale:g}"

    def demoted(self, result: PartResult, objective: float) -> PartResult:
        """FEASIBLE, its bound lowered to ``objective`` less the rounding error at most."""
        err = result.objective_tol or 0.0
        return dataclasses.replace(result, status="FEASIBLE",
                                   bound=min(result.bound, objective - err)
                                   if result.bound is not None else None)

    def unproven_note(self, translation: CpSatTranslation, n_variables: int) -> str | None:
        return prefer_highs(translation.problem, n_variables)

    # ------------------------------------------------------------ one part

    @staticmethod
    def _rescaled_scaling(t: CpSatTranslation, gis: Sequence[int], forbid: Forbidden
                          ) -> Scaling:
        """The call's scaling with the objective scale fitted to the choices left."""
        total = sum(abs(g.weight) * max(abs(v) for k, v in enumerate(row)
                                        if (u, k) not in forbid[gi])
                    for gi in gis for g in [t.problem.groups[gi]]
                    for u, row in enumerate(g.omega1) if row)
        return dataclasses.replace(t.models.scaling, omega_scale=omega_scale_for(total))

    def _rescaled(self, t: CpSatTranslation, gis: Sequence[int], forbid: Forbidden
                  ) -> IntModels:
        """The part's integer models without the choices ``forbid`` names."""
        sc = self._rescaled_scaling(t, gis, forbid)
        form = formulate(t.problem, gis, forbid=forbid)
        return IntModels({b.gi: integer_group(form, b, sc)[0] for b in form.blocks},
                         {b.gi: integer_group(form, b, sc, outer=True)[0]
                          for b in form.blocks}, sc)

    def _solve_part(self, t: CpSatTranslation, gis: Sequence[int], limit: float,
                    start: Mapping[str, Sequence[int]] | None, models: IntModels
                    ) -> PartResult:
        """The outer model (3/4 of the share at most: the inner model is rarely needed);
        its optimum when the exact model accepts it, else the inner model's plan."""
        problem, messages, tag = t.problem, t.messages, t.tag(gis)
        t_end = timing.clock() + max(limit, 0.0)
        err = sum(models.inner[gi].obj_err for gi in gis)
        obj_min = sum(models.inner[gi].obj_min for gi in gis)
        out, nv, nc = self._solve_once(t.cp_model, problem, gis, models.outer, start,
                                       t.options, limit * 0.75, models.scaling, t.sw, messages)
        lb = max(obj_min, out.bound - err)
        if out.status == "INFEASIBLE":
            messages.extend(infeasible_messages(problem, gis, problem.group_budget_ms()))
            messages.append(f"{tag}: no assignment meets the target and capacity "
                            "(proven on the outer model, a relaxation)")
            return PartResult("INFEASIBLE", None, None, nv, nc)
        if out.status == "ERROR":
            messages.append(f"{tag}: CP-SAT {out.name}")
            return PartResult("ERROR", None, None, nv, nc)
        found = out.assignment
        if found is not None and any(
                max(exact_violation(problem.groups[gi], found[problem.groups[gi].name],
                                    problem.group_budget_ms())) > 0 for gi in gis):
            found = None
        if found is None:
            return self._from_inner(t, gis, models, out, start, t_end, lb, err, nv, nc)
        return PartResult(out.status, found, lb, nv, nc, objective_tol=2 * err)

    def _from_inner(self, t: CpSatTranslation, gis: Sequence[int], models: IntModels,
                    out: _Solved, start: Mapping[str, Sequence[int]] | None, t_end: float,
                    lb: float, err: float, nv: int, nc: int) -> PartResult:
        """The inner model's plan (every solution is feasible in the exact model), OPTIMAL
        when it meets the outer bound within the gap."""
        problem, messages, tag, sc = t.problem, t.messages, t.tag(gis), models.scaling
        res, _, _ = self._solve_once(t.cp_model, problem, gis, models.inner,
                                     out.assignment or start, t.options,
                                     t_end - timing.clock(), sc, t.sw, messages)
        if res.assignment is None:
            if res.status == "INFEASIBLE":
                messages.append(
                    f"{tag}: infeasible within the scaling slack: the inner model has "
                    "no solution, so any exactly feasible assignment lies within "
                    f"{sc.max_time_slack_ms:.3g} ms of the budget or "
                    f"{sc.max_mem_slack_bytes:.3g} B of the capacity (the outer "
                    "optimum fails the exact model); highs/cbc decide such cases")
                return PartResult("INFEASIBLE", None, None, nv, nc)
            messages.append(f"{tag}: CP-SAT {res.name} after {res.wall_s:.2f} s, no solution")
            return PartResult("TIME_LIMIT" if res.status != "ERROR" else "ERROR",
                              None, lb, nv, nc)
        found = res.assignment
        for gi in gis:
            g = problem.groups[gi]
            dt, dm = exact_violation(g, found[g.name], problem.group_budget_ms(), rel=0.0)
            if dt > 0 or dm > 0:  # cannot happen with conservative rounding
                messages.append(f"group {g.name}: CP-SAT plan exceeds the exact "
                                f"model by {dt:.3g} ms / {dm:.3g} B (scaling bug)")
        obj = sum(problem.groups[gi].weight * problem.groups[gi].degradation(
            found[problem.groups[gi].name]) for gi in gis)
        proven = (out.status == "OPTIMAL" and obj - lb
                  <= t.options.rel_gap * abs(obj) + 2 * err + 1e-12)
        why = ("the outer optimum lies within the rounding slack of a bound"
               if out.assignment is not None else
               f"the outer model found no solution in its time ({out.name})")
        messages.append(f"{tag}: {why}; plan from the inner model ({res.name})"
                        + ("" if proven else f", {obj - lb:.3g} above the outer bound"))
        return PartResult("OPTIMAL" if proven else "FEASIBLE", found, lb, nv, nc,
                          objective_tol=2 * err)

    # ----------------------------------------------------------- the CP-SAT model

    def _build(self, cp_model: ModuleType, problem: AllocationProblem, gis: Sequence[int],
               ints: Mapping[int, IntGroup], hints: Mapping[str, Sequence[int]] | None
               ) -> tuple[Any, dict[int, list[list[Any]]], int, int]:
        """The CP-SAT model of the groups ``gis``: each group's block of the formulation,
        row by row, with its integer coefficients (``ints``, :class:`_BlockWriter`)."""
        model = cp_model.CpModel()
        xs: dict[int, list[list[Any]]] = {}
        terms: list[tuple[Any, int]] = []
        n_vars = n_cons = 0
        for gi in gis:
            writer = _BlockWriter(cp_model, model, ints[gi])
            xs[gi] = writer.x
            terms.extend(writer.objective_terms())
            writer.write_rows()
            if hints is not None:
                writer.hint(hints)
            n_vars += len(writer.cv)
            n_cons += writer.n_cons
        model.minimize(cp_model.LinearExpr.weighted_sum([v for v, _ in terms],
                                                         [c for _, c in terms]))
        return model, xs, n_vars, n_cons

    def _solve_once(self, cp_model: ModuleType, problem: AllocationProblem, gis: Sequence[int],
                    ints: Mapping[int, IntGroup], hints: Mapping[str, Sequence[int]] | None,
                    options: SolveOptions, time_limit: float, sc: Scaling, sw: Stopwatch,
                    messages: list[str] | None = None) -> tuple[_Solved, int, int]:
        """One CP-SAT run; its solution is checked against CP-SAT's own report (the scaled
        objective of the returned assignment must equal ``objective_value``, and an OPTIMAL
        one must lie within the gap of the bound). On a mismatch with hints it is re-solved
        without them; without hints the plan is kept as FEASIBLE and the bound dropped."""
        t_end = timing.clock() + max(time_limit, 0.0)
        solved, nv, nc = self._solve_raw(cp_model, problem, gis, ints, hints, options,
                                         t_end, sc, sw)
        why = self._inconsistency(solved, options.rel_gap)
        if why is None:
            return solved, nv, nc
        tag = problem.groups[gis[0]].name if len(gis) == 1 else "all"
        if hints is not None and t_end - timing.clock() > 0:
            if messages is not None:
                messages.append(f"{tag}: CP-SAT reported {solved.name}, but {why}; re-solved "
                                "without the hints")
            solved, nv, nc = self._solve_raw(cp_model, problem, gis, ints, None, options,
                                             t_end, sc, sw)
            why = self._inconsistency(solved, options.rel_gap)
            if why is None:
                return solved, nv, nc
        if messages is not None:
            messages.append(f"{tag}: CP-SAT reported {solved.name}, but {why}; the plan is "
                            "kept as FEASIBLE and CP-SAT's bound dropped")
        floor = sum(ints[gi].obj_min for gi in gis)
        return dataclasses.replace(solved, status="FEASIBLE", bound=floor), nv, nc

    @staticmethod
    def _inconsistency(solved: _Solved, rel_gap: float) -> str | None:
        if solved.assignment is None or solved.own is None or solved.reported is None:
            return None
        if abs(solved.own - solved.reported) > 0.5:
            return (f"its solution's own scaled objective {solved.own} differs from the "
                    f"reported {solved.reported:.17g}")
        if solved.status == "OPTIMAL" and solved.scaled_bound is not None and (
                solved.own - solved.scaled_bound > rel_gap * max(1.0, abs(solved.own)) + 1.0):
            return (f"its solution's own scaled objective {solved.own} is above its bound "
                    f"{solved.scaled_bound:.17g} by more than the gap")
        return None

    def _solve_raw(self, cp_model: ModuleType, problem: AllocationProblem, gis: Sequence[int],
                   ints: Mapping[int, IntGroup], hints: Mapping[str, Sequence[int]] | None,
                   options: SolveOptions, t_end: float, sc: Scaling, sw: Stopwatch
                   ) -> tuple[_Solved, int, int]:
        """Build and run CP-SAT until ``t_end`` (a :data:`.timing.clock` time); nothing is
        run when building used up the time (status TIME_LIMIT)."""
        with sw.building():
            model, xs, nv, nc = self._build(cp_model, problem, gis, ints, hints)
        time_limit = t_end - timing.clock()
        if not time_limit > 0:
            return _Solved("TIME_LIMIT", None, -math.inf, "not run (no time left)", 0.0), nv, nc
        solver = cp_model.CpSolver()
        prm = solver.parameters
        prm.num_workers = options.threads or default_workers(nv)
        prm.linearization_level = 2
        prm.max_time_in_seconds = max(time_limit, 1e-3)
        prm.random_seed = int(options.seed)
        prm.relative_gap_limit = options.rel_gap
        # OR-Tools 9.15: the at-most-one/linear inclusion presolve can certify a wrong
        # optimum (google/or-tools#5293); it did so here on the one-hot rows with the
        # time row. Switching that presolve family off is the workaround.
        prm.presolve_inclusion_work_limit = 0
        for k, v in options.cpsat.params.items():  # raw CP-SAT parameters
            setattr(prm, k, v)
        with sw.solving():
            st = solver.solve(model)
        name = solver.status_name(st)
        status = {cp_model.OPTIMAL: "OPTIMAL", cp_model.FEASIBLE: "FEASIBLE",
                  cp_model.INFEASIBLE: "INFEASIBLE", cp_model.UNKNOWN: "TIME_LIMIT"
                  }.get(st, "ERROR")
        assignment = None
        own: int | None = None
        reported: float | None = None
        if status in ("OPTIMAL", "FEASIBLE"):
            assignment = {}
            own = 0
            for gi in gis:
                g = problem.groups[gi]
                assignment[g.name] = [_chosen(solver, row) for row in xs[gi][:len(g.choices)]]
                own += sum(r[k] for r, k in zip(ints[gi].obj1, assignment[g.name], strict=True))
            reported = solver.objective_value
        has_bound = status in ("OPTIMAL", "FEASIBLE", "TIME_LIMIT")
        raw_bound = solver.best_objective_bound if has_bound else None
        bound = raw_bound / sc.omega_scale if raw_bound is not None else -math.inf
        if status == "ERROR":
            name += f" ({model.validate()})"
        return _Solved(status, assignment, bound, name, solver.wall_time, own, reported,
                       raw_bound), nv, nc


class _BlockWriter:
    """One group's block of the formulation written into a CP-SAT model with its integer
    coefficients: one-hot rows become ``add_exactly_one``, a forbidden choice an equality
    to 0, the working set ``W`` an integer variable in memory units."""

    def __init__(self, cp_model: ModuleType, model: Any, ig: IntGroup) -> None:
        self.model, self.ig, self.block, self.form = model, ig, ig.block, ig.form
        self.expr = cp_model.LinearExpr
        b, variables = self.block, self.form.variables
        w_hi = max([ig.work0] + [max(r) for r in ig.work1.values()])
        self.cv: dict[int, Any] = {}
        for i in range(b.x[0][0] if b.x else b.w, b.w + 1):
            var = variables[i]
            self.cv[i] = (model.new_int_var(ig.work0, w_hi, var.name) if i == b.w
                          else model.new_bool_var(var.name))
        self.n_cons = 0
        for _, y in b.pairs:  # a hopeless pair combination (formulation.Hopeless)
            for v in (v for yrow in y for v in yrow if variables[v].ub == 0.0):
                model.add(self.cv[v] == 0)
                self.n_cons += 1
        self.x = [[self.cv[v] for v in row] for row in b.x]
        # the integer coefficients by variable, for the time and memory rows
        self.t_int: dict[int, int] = {}
        self.m_int: dict[int, int] = {}
        for u, row in enumerate(b.x):
            for k, v in enumerate(row):
                self.t_int[v], self.m_int[v] = ig.time1[u][k], ig.mem1[u][k]
        for (_, y), (_, pt, pm) in zip(b.pairs, ig.pairs, strict=True):
            for ka, yrow in enumerate(y):
                for kb, v in enumerate(yrow):
                    self.t_int[v], self.m_int[v] = pt[ka][kb], pm[ka][kb]
        self.m_int[b.w] = 1
        self.unit_of = {v: u for u, row in enumerate(b.x) for v in row}

    def objective_terms(self) -> list[tuple[Any, int]]:
        """The real units' (variable, integer w * Omega) terms, zeros left out."""
        b, ig = self.block, self.ig
        return [(self.cv[v], ig.obj1[u][k]) for u, row in enumerate(b.x) if u < b.n_real
                for k, v in enumerate(row) if ig.obj1[u][k]]

    def write_rows(self) -> None:
        for ri in self.block.rows:
            self.n_cons += self._write_row(self.form.rows[ri])

    def _write_row(self, r: Any) -> int:
        """One row of the block; the number of constraints it became."""
        cv, model, expr, fam = self.cv, self.model, self.expr, r.family
        if fam == "one_hot":
            model.add_exactly_one([cv[v] for v, _ in r.terms])
            zeros = [v for v, _ in r.terms if self.form.variables[v].ub == 0.0]
            for v in zeros:
                model.add(cv[v] == 0)
            return 1 + len(zeros)
        if fam == "derived_and":  # sum S_i - x[d,k] >= 0
            model.add(cv[r.terms[-1][0]] <= expr.sum([cv[v] for v, _ in r.terms[:-1]]))
        elif fam == "derived_all":  # sum_i S_i - x[d,k] <= n - 1
            model.add(cv[r.terms[-1][0]] >= expr.sum([cv[v] for v, _ in r.terms[:-1]])
                      - int(r.rhs))
        elif fam in ("pair_a", "pair_b"):  # sum y - x = 0
            model.add(expr.sum([cv[v] for v, _ in r.terms[:-1]]) == cv[r.terms[-1][0]])
        elif fam == "working_set":  # W - sum work1 x >= 0
            u = self.unit_of[r.terms[0][0]]
            model.add(cv[self.block.w] >= expr.weighted_sum(self.x[u], self.ig.work1[u]))
        elif fam in ("time", "memory"):
            coefs = self.t_int if fam == "time" else self.m_int
            terms = [(cv[v], coefs[v]) for v, _ in r.terms if coefs[v]]
            rhs = self.ig.time_rhs if fam == "time" else self.ig.mem_rhs
            model.add(expr.weighted_sum([v for v, _ in terms], [c for _, c in terms]) <= rhs)
        else:  # pragma: no cover - a family this translation does not know
            raise ValueError(f"cpsat: no translation of the row family {fam!r}")
        return 1

    def hint(self, hints: Mapping[str, Sequence[int]]) -> None:
        b = self.block
        point = self.form.point({b.group.name: hints[b.group.name]})
        for v in range(b.x[0][0] if b.x else b.w, b.w):
            self.model.add_hint(self.cv[v], int(point[v]))
