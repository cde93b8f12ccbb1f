"""The formulation translated into PuLP (:func:`to_pulp`), a warm start set on it and the
choices read back from its solution.

Every variable and row of the :class:`~.formulation.Formulation`, in its order and with its
names; coefficients that are 0 are dropped. Floating-point numerics: each row is
normalised by its ``scale`` (the time rows by the group budget, the memory and working-set
rows by the capacity, the working set ``W`` expressed in units of the capacity), so the
solvers' absolute tolerances act relatively. The degradation objective is each unit's
``w * Omega`` less its least (a constant, :attr:`PulpProgram.obj_offset`), divided by its
largest coefficient (:attr:`PulpProgram.obj_scale`); the time objective is in ms, the
memory objective in units of the capacity. A forbidden choice is a binary with upper bound
0. The same normalised rows and objective feed the LP relaxation (:mod:`.relaxation`).
One run of CBC or HiGHS on the program is :mod:`.pulp_runs`'.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from qsync_opt.solvers.formulation import Block, Formulation


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


def column_bounds(form: Formulation) -> list[tuple[float, float | None]]:
    """Each variable's (lower, upper) bound in the normalised units (a forbidden binary's
    upper bound is 0)."""
    out: list[tuple[float, float | None]] = []
    for var in form.variables:
        if var.kind == "binary":
            out.append((0.0, 0.0 if var.ub == 0.0 else 1.0))
        else:
            out.append((var.lb / var.unit if var.unit != 1.0 else var.lb, var.ub))
    return out


def normalised_rows(form: Formulation) -> Iterator[tuple[Any, list[tuple[int, float]], float]]:
    """Each row as (row, its nonzero terms divided by its scale, its right-hand side less
    its constant, divided by its scale)."""
    units = [var.unit for var in form.variables]
    for row in form.rows:
        s = row.scale
        terms = [(v, c / s if units[v] == 1.0 else c * units[v] / s) for v, c in row.terms if c]
        rhs = row.rhs if s == 1.0 and not row.constant else (row.rhs - row.constant) / s
        yield row, terms, rhs


def scaled_objective(form: Formulation, cols: list[Any]
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
    for var, (lb, ub) in zip(form.variables, column_bounds(form), strict=True):
        if var.kind == "binary":
            v = add_var(var.name, 0, 1, pulp.LpBinary)
            if ub == 0.0:
                v.upBound = 0  # (after creation: a binary's bounds are set to 0..1)
        else:
            v = add_var(var.name, lb, ub)
        lpv.append(v)
    cons: list[Any] = []
    for row, terms, rhs in normalised_rows(form):
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
    terms, prog.obj_scale, prog.obj_offset = scaled_objective(form, lpv)
    prog.obj_terms = terms
    lp.setObjective(LpAffineExpression(terms))
    return prog


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
