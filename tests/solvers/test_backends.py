"""One contract for every backend of the registry (``qsync_opt.solvers.registry()``): a new
backend is tested by registering it.

On tiny problems (every assignment enumerated, scored with the exact floating-point model):

* an exact backend's OPTIMAL objective is the brute-force optimum (a backend that records
  an integer scaling's slack, ``max_time_slack_ms``, is held to the optimum of the problem
  shrunk by that slack, plus twice its recorded objective error); an inexact one never
  beats the optimum; a plan reported OPTIMAL or FEASIBLE on the problem's cluster passes
  the evaluator;
* an infeasible problem is reported INFEASIBLE, without a plan, by an exact backend and is
  never OPTIMAL for any;
* with a time limit too short to do anything, the report says so and still holds the
  contract (the limit recorded, no OPTIMAL plan that is not one);
* hints (the optimum's own choices) are accepted and do not change an exact optimum.

And the formulation the exact backends translate: every equation family present and
named, each translation carrying every row.
"""

from __future__ import annotations

import functools
import itertools
import math

import pytest
from qsync_opt.solvers import SolveOptions, registry
from qsync_opt.solvers.checks import FEAS_REL
from qsync_opt.solvers.formulation import FAMILIES, formulate

from qsync_opt import estimate, parse_shorthand
from qsync_opt.problem.evaluator import evaluate
from qsync_opt.problem.program import AllocationProblem, ProblemOptions
from qsync_opt.problem.synthetic import perturb_costs, random_indicator, synthetic_graph

BACKENDS = registry()
PARAMS = [pytest.param(name, id=name) for name in BACKENDS]
STATUSES = {"OPTIMAL", "FEASIBLE", "INFEASIBLE", "TIME_LIMIT", "ERROR"}
OPTS = SolveOptions(time_limit_s=30.0, rel_gap=1e-9)


@functools.cache
def _base(cluster: str, seed: int) -> AllocationProblem:
    g = synthetic_graph(3, seed=0, batch=256, width=1024)
    c = parse_shorthand(cluster)
    return AllocationProblem(g, c, perturb_costs(estimate(g, c), seed, 3.0),
                             random_indicator(g, seed), ProblemOptions())


def _tables(prob: AllocationProblem) -> list[list[tuple[tuple[int, ...], float, float, float]]]:
    return [[(a, g.time_ms(a), g.memory_bytes(a), g.degradation(a))
             for a in itertools.product(*[range(len(c)) for c in g.choices])]
            for g in prob.groups]


def _brute(prob: AllocationProblem, time_cut: float = 0.0, mem_cut: float = 0.0,
           tol: float = FEAS_REL) -> tuple[float, dict[str, list[int]]] | None:
    """The optimum and an assignment reaching it (None: infeasible), with the budget and
    each capacity reduced by the cuts."""
    budget = prob.group_budget_ms() - time_cut
    total, best_a = 0.0, {}
    for g, table in zip(prob.groups, _tables(prob), strict=True):
        cap = g.capacity_bytes - mem_cut
        ok = [(d, a) for a, t, m, d in table
              if t <= budget + tol * abs(budget) and m <= cap * (1 + tol)]
        if not ok:
            return None
        d, a = min(ok)
        total += g.weight * d
        best_a[g.name] = list(a)
    return total, best_a


@functools.cache
def _case(cluster: str, seed: int, frac: float, mem_frac: float | None) -> AllocationProblem:
    """A target ``frac`` of the way from the fastest to the reference makespan; a capacity
    ``mem_frac`` of the way through each group's memory range."""
    base = _base(cluster, seed)
    tables = _tables(base)
    fast = max(min(t for _, t, _, _ in tab) for tab in tables)
    ref = max(base.reference_times.values())
    prob = base.with_options(target_ms=base.tail_ms + fast + frac * (max(ref, fast) - fast))
    if mem_frac is not None:
        for g, tab in zip(prob.groups, _tables(prob), strict=True):
            mems = sorted(m for _, _, m, _ in tab)
            g.capacity_bytes = mems[0] + mem_frac * (mems[-1] - mems[0])
    return prob


CASES = [("a100x2+t4x2", 1, 0.3, None), ("t4x2", 2, 0.6, 0.5), ("a100x2+t4x2", 3, 0.9, 0.3),
         ("l4x2+t4x2", 4, 0.1, None)]


def _holds(prob: AllocationProblem, plan, rep, opt: float | None) -> None:
    """What every backend's answer satisfies."""
    assert rep.status in STATUSES
    if rep.status == "OPTIMAL":
        assert plan is not None
    if plan is not None and rep.status in ("OPTIMAL", "FEASIBLE") \
            and plan.cluster == prob.cluster:
        ev = evaluate(prob, plan)
        assert ev.violations == [], (rep.solver, ev.violations)
        assert rep.objective == pytest.approx(prob.objective(prob.assignment(plan)),
                                              rel=1e-12, abs=1e-12)
        if opt is not None:
            assert rep.objective >= opt - 1e-9 * max(1.0, abs(opt))


def _exact_optimum(prob: AllocationProblem, rep, opt: float) -> None:
    assert rep.status == "OPTIMAL", (rep.solver, rep.status, rep.messages)
    o = rep.options
    if "max_time_slack_ms" in o:  # an integer translation: held to its recorded rounding
        reduced = _brute(prob, o["max_time_slack_ms"], o["max_mem_slack_bytes"], tol=0.0)
        if reduced is not None:
            err = 2 * o["max_objective_error"]
            assert rep.objective <= reduced[0] + err + 1e-9 * max(1.0, abs(reduced[0]))
    else:
        assert rep.objective == pytest.approx(opt, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
@pytest.mark.parametrize("name", PARAMS)
def test_the_optimum_against_brute_force(name: str, case: tuple) -> None:
    backend = BACKENDS[name]
    assert backend.is_available(), f"{name} is registered but not available here"
    prob = _case(*case)
    found = _brute(prob)
    plan, rep = backend.solve(prob, OPTS)
    _holds(prob, plan, rep, found[0] if found else None)
    if backend.exact:
        if found is None:
            assert plan is None and rep.status == "INFEASIBLE"
        else:
            _exact_optimum(prob, rep, found[0])


@pytest.mark.parametrize("name", PARAMS)
def test_an_infeasible_problem_is_reported(name: str) -> None:
    base = _base("a100x2+t4x2", 1)
    fast = max(min(t for _, t, _, _ in tab) for tab in _tables(base))
    prob = base.with_options(target_ms=base.tail_ms + 0.5 * fast)
    assert _brute(prob) is None
    plan, rep = BACKENDS[name].solve(prob, OPTS)
    assert rep.status != "OPTIMAL"
    _holds(prob, plan, rep, None)
    if BACKENDS[name].exact:
        assert rep.status == "INFEASIBLE" and plan is None, (rep.status, rep.messages)


@pytest.mark.parametrize("name", PARAMS)
def test_a_time_limit_too_short_is_reported(name: str) -> None:
    prob = _case(*CASES[0])
    found = _brute(prob)
    plan, rep = BACKENDS[name].solve(prob, SolveOptions(time_limit_s=1e-6))
    assert rep.options["time_limit_s"] == 1e-6
    _holds(prob, plan, rep, found[0] if found else None)
    if BACKENDS[name].exact:
        assert rep.status in ("TIME_LIMIT", "OPTIMAL", "FEASIBLE")
        if rep.status == "TIME_LIMIT":
            assert plan is None


@pytest.mark.parametrize("name", PARAMS)
def test_hints_are_accepted(name: str) -> None:
    prob = _case(*CASES[0])
    found = _brute(prob)
    assert found is not None
    plan, rep = BACKENDS[name].solve(prob, SolveOptions(time_limit_s=30.0, rel_gap=1e-9,
                                                        hints=found[1]))
    assert rep.options["hints"] is True
    _holds(prob, plan, rep, found[0])
    if BACKENDS[name].exact:
        _exact_optimum(prob, rep, found[0])


# --------------------------------------------------------------------------- formulation


def test_the_formulation_names_every_family() -> None:
    prob = _case(*CASES[0])
    form = formulate(prob)
    fams = form.families()
    assert tuple(fams) == FAMILIES
    for fam in FAMILIES:  # this problem has derived units, pairs and working sets
        assert fams[fam], f"no {fam} rows"
    names = [r.name for r in form.rows]
    assert len(names) == len(set(names))
    assert len(fams["time"]) == len(fams["memory"]) == len(prob.groups)
    assert form.objective.kind == "degradation"
    # every row holds at any assignment's point, and the objective is the problem's
    _, a = _brute(prob) or (None, None)
    assert a is not None
    point = form.point(a)
    assert form.violations(point) == []
    assert form.value(point) == pytest.approx(prob.objective(a), rel=1e-12)


def test_a_time_or_memory_objective_drops_the_time_row() -> None:
    prob = _case(*CASES[0])
    for kind in ("time", "memory"):
        form = formulate(prob, [0], objective=kind)
        fams = form.families()
        assert fams["time"] == [] and len(fams["memory"]) == 1
        a = _brute(prob)[1]  # type: ignore[index]
        g = prob.groups[0]
        point = form.point({g.name: a[g.name]})
        want = g.time_ms(a[g.name]) if kind == "time" else g.memory_bytes(a[g.name])
        assert form.value(point) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="objective"):
        formulate(prob, objective="speed")  # type: ignore[arg-type]


def test_a_forbidden_choice_is_a_variable_fixed_to_zero() -> None:
    prob = _case(*CASES[0])
    gi = next(i for i, g in enumerate(prob.groups) if any(len(c) > 1 for c in g.choices))
    u = next(u for u, c in enumerate(prob.groups[gi].choices) if len(c) > 1)
    form = formulate(prob, [gi], forbid={gi: frozenset({(u, 0)})})
    b = form.blocks[0]
    assert form.variables[b.x[u][0]].ub == 0.0
    assert all(form.variables[v].ub == 1.0 for v in b.x[u][1:])


def test_the_translations_carry_every_row() -> None:
    from ortools.sat.python import cp_model
    from qsync_opt.solvers.cpsat_writer import build_model
    from qsync_opt.solvers.integers import integer_group, scaling_for
    from qsync_opt.solvers.pulp_model import to_pulp
    from qsync_opt.solvers.pulp_runs import pulp_module

    prob = _case(*CASES[0])
    form = formulate(prob)
    prog = to_pulp(pulp_module(), form, "t")
    assert [c.name for c in prog.lp.constraints()] == [r.name for r in form.rows]
    assert prog.n_variables == form.n_variables
    assert sorted(v.name for v in prog.lp.variables()) == sorted(
        v.name for v in form.variables)
    sc = scaling_for(prob)
    ints = {b.gi: integer_group(form, b, sc)[0] for b in form.blocks}
    model, _, nv, nc = build_model(cp_model, range(len(prob.groups)), ints, None)
    # one equality per variable fixed to 0 (a forbidden or hopeless choice) besides the rows
    fixed = sum(v.ub == 0.0 for v in form.variables)
    assert nv == form.n_variables and nc == form.n_constraints + fixed
    assert len(model.proto.constraints) == nc
    assert len(model.proto.variables) == nv
    assert all(math.isfinite(v) for v in (sc.time_unit_ms, sc.mem_unit_bytes,
                                          sc.omega_scale))
