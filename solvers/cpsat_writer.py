"""The CP-SAT model of a part: each group's block of the formulation written row by row
with its integer coefficients (:class:`BlockWriter`: one-hot rows become
``add_exactly_one``, a forbidden choice an equality to 0, the working set ``W`` an integer
variable in memory units), the warm start as CP-SAT hints, and the solution read back as
each group's choices with its own scaled objective."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from qsync_opt.solvers.formulation import Row
from qsync_opt.solvers.integers import IntGroup

from qsync_opt.problem.program import AllocationProblem

if TYPE_CHECKING:  # OR-Tools is imported when a solve needs it (heavy to import)
    from ortools.sat.python.cp_model import CpModel, CpSolver


def chosen(solver: CpSolver, row: Sequence[Any]) -> int:
    """The index of the variable of a one-hot row that is 1 in the solver's solution."""
    values = [solver.value(v) for v in row]
    return max(range(len(values)), key=values.__getitem__)


def build_model(cp_model: ModuleType, gis: Sequence[int], ints: Mapping[int, IntGroup],
                hints: Mapping[str, Sequence[int]] | None
                ) -> tuple[Any, dict[int, list[list[Any]]], int, int]:
    """The CP-SAT model of the groups ``gis``: each group's block of the formulation,
    row by row, with its integer coefficients (``ints``, :class:`BlockWriter`); with its
    one-hot variables per group and its numbers of variables and constraints."""
    model = cp_model.CpModel()
    xs: dict[int, list[list[Any]]] = {}
    terms: list[tuple[Any, int]] = []
    n_vars = n_cons = 0
    for gi in gis:
        writer = BlockWriter(cp_model, model, ints[gi])
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


def read_solution(solver: CpSolver, problem: AllocationProblem, gis: Sequence[int],
                  xs: Mapping[int, list[list[Any]]], ints: Mapping[int, IntGroup]
                  ) -> tuple[dict[str, list[int]], int]:
    """Each group's choices in the solver's solution, and their scaled objective
    recomputed from the integer coefficients."""
    assignment: dict[str, list[int]] = {}
    own = 0
    for gi in gis:
        g = problem.groups[gi]
        assignment[g.name] = [chosen(solver, row) for row in xs[gi][:len(g.choices)]]
        own += sum(r[k] for r, k in zip(ints[gi].obj1, assignment[g.name], strict=True))
    return assignment, own


class BlockWriter:
    """One group's block of the formulation written into a CP-SAT model with its integer
    coefficients: one-hot rows become ``add_exactly_one``, a forbidden choice an equality
    to 0, the working set ``W`` an integer variable in memory units."""

    def __init__(self, cp_model: ModuleType, model: CpModel, ig: IntGroup) -> None:
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

    def _write_row(self, r: Row) -> int:
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
