"""The exact backends' driver (solvers/driver.py), tested once for every backend through a
scripted backend: the loose-optimum loop (re-solve without the choices no better plan
takes, else demote to FEASIBLE), the parts and their shares, the proof found while
translating; and the typed per-backend options with their older ``extra`` spelling."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from qsync_opt.solvers import (
    CbcOptions,
    CpSatOptions,
    DynamicBatchingOptions,
    HighsOptions,
    SolveOptions,
    UniformOptions,
    driver,
    parts,
    timing,
)
from qsync_opt.solvers.base import Forbidden, PartResult, Translation
from qsync_opt.solvers.cpsat import CpSat
from qsync_opt.solvers.driver import MAX_RESCALES, excluded_choices, solve_exact
from qsync_opt.solvers.ilp import PulpIlp
from qsync_opt.solvers.timing import Stopwatch

from qsync_opt import estimate, parse_shorthand
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.problem.synthetic import random_indicator, synthetic_graph


@functools.cache
def _problem() -> AllocationProblem:
    """Two groups of 12 Linear layers, each with a real choice of precision."""
    g = synthetic_graph(12, batch=64, width=256)
    c = parse_shorthand("a100x1+t4x1")
    return AllocationProblem(g, c, estimate(g, c), random_indicator(g))


class Scripted:
    """An exact backend whose runs return scripted results (one list per call), recording
    each call's (groups, start, forbid)."""

    name = "scripted"
    exact = True
    requires = "nothing"
    hint_note = None
    tolerance_name = "its scripted tolerance"
    demotion_note = ", its bound dropped"

    def __init__(self, results: list[Any], proof: list[str] | None = None,
                 on_run: Any = None) -> None:
        self.results = list(results)
        self.calls: list[tuple[list[int], Any, Any]] = []
        self.proof = proof or []
        self.on_run = on_run

    def is_available(self) -> bool:
        return True

    def translate(self, problem: AllocationProblem, options: SolveOptions, sw: Stopwatch,
                  messages: list[str]) -> Translation:
        return Translation(problem, options, sw, messages, proof=list(self.proof),
                           report_options={"scripted": True})

    def run(self, translation: Translation, gis: Sequence[int], limit: float,
            start: Mapping[str, Sequence[int]] | None, forbid: Forbidden | None
            ) -> PartResult:
        self.calls.append((list(gis), start, forbid))
        if self.on_run is not None:
            self.on_run(limit)
        make = self.results.pop(0)
        return make(translation.problem, gis)

    def rescale_note(self, translation: Translation, gis: Sequence[int],
                     forbid: Forbidden) -> str:
        return "rescaled by the script"

    def demoted(self, result: PartResult, objective: float) -> PartResult:
        return dataclasses.replace(result, status="FEASIBLE", bound=None)

    def unproven_note(self, translation: Translation, n_variables: int) -> str | None:
        return "scripted: not proven"


def _lowest(problem: AllocationProblem, gis: Sequence[int]) -> dict[str, list[int]]:
    return {problem.groups[gi].name: problem.groups[gi].lowest() for gi in gis}


def _least(problem: AllocationProblem, gis: Sequence[int]) -> dict[str, list[int]]:
    """Every unit at its least Omega: the part's floor."""
    return {problem.groups[gi].name: [min(range(len(r)), key=r.__getitem__)
                                      for r in problem.groups[gi].omega1] for gi in gis}


def _loose(problem: AllocationProblem, gis: Sequence[int]) -> PartResult:
    """OPTIMAL, but proven only within a tolerance far above the relative gap."""
    a = _lowest(problem, gis)
    return PartResult("OPTIMAL", a, parts.part_floor(problem, gis), 10, 5, objective_tol=1e9)


def _proven(problem: AllocationProblem, gis: Sequence[int]) -> PartResult:
    a = _least(problem, gis)
    return PartResult("OPTIMAL", a, parts.part_objective(problem, gis, a), 7, 3)


def _none(problem: AllocationProblem, gis: Sequence[int]) -> PartResult:
    return PartResult("TIME_LIMIT", None, None)


@pytest.fixture
def no_shortcut(monkeypatch):
    """Every part runs (none is answered by its least-degradation plan)."""
    monkeypatch.setattr(parts, "least_part", lambda problem, gis: None)


def test_a_loose_optimum_is_resolved_without_the_dominated_choices(no_shortcut) -> None:
    """The a100 group (held at its reference) has one choice per op: its plan is its
    floor, proven whatever the tolerance; the t4 group's loose OPTIMAL is re-solved."""
    prob = _problem()
    backend = Scripted([_loose, _loose, _proven])
    plan, rep = solve_exact(backend, prob, SolveOptions(time_limit_s=30.0))
    assert plan is not None and rep.status == "OPTIMAL", rep.messages
    assert [c[0] for c in backend.calls] == [[0], [1], [1]]
    first, again = backend.calls[1], backend.calls[2]
    assert first[1] is None and first[2] is None
    assert again[1] == _lowest(prob, [1])  # started from the loose plan
    assert again[2] == excluded_choices(prob, [1], _lowest(prob, [1]))
    assert any(m.startswith("t4: scripted reported OPTIMAL, but its scripted tolerance")
               and "re-solved without the" in m and m.endswith("rescaled by the script")
               for m in rep.messages), rep.messages
    # the size reported is the first program's (the re-solve's is the same program)
    assert rep.n_variables == 10 + 10 and rep.n_constraints == 5 + 5
    assert rep.options["scripted"] is True


def test_a_resolve_without_a_better_plan_demotes_to_feasible(monkeypatch,
                                                            no_shortcut) -> None:
    monkeypatch.setattr(driver, "MIN_RETRY_S", 1e9)  # no second pass
    prob = _problem()
    backend = Scripted([_loose, _loose, _none])
    plan, rep = solve_exact(backend, prob, SolveOptions(time_limit_s=30.0))
    assert plan is not None and rep.status == "FEASIBLE", rep.messages
    assert rep.bound is None or rep.bound <= rep.objective
    assert any("no better plan; the first plan is kept as FEASIBLE, its bound dropped" in m
               for m in rep.messages), rep.messages
    assert "scripted: not proven" in rep.messages  # the backend's note on FEASIBLE


def test_an_optimum_that_stays_loose_is_demoted_after_a_bounded_number_of_resolves(
        monkeypatch, no_shortcut) -> None:
    """The re-solve returns the same loose plan: the excluded choices repeat, so the loop
    stops (at most MAX_RESCALES re-solves in any case) and the plan is FEASIBLE."""
    monkeypatch.setattr(driver, "MIN_RETRY_S", 1e9)  # no second pass
    prob = _problem()
    backend = Scripted([_loose] * (2 * (MAX_RESCALES + 1)))
    plan, rep = solve_exact(backend, prob, SolveOptions(time_limit_s=30.0))
    assert plan is not None and rep.status == "FEASIBLE"
    assert [c[0] for c in backend.calls] == [[0], [1], [1]]  # t4: the run and one re-solve
    assert any(m.startswith("t4: scripted reported OPTIMAL, but its scripted tolerance of "
                            "1e+09 is more than the relative gap")
               and m.endswith("status FEASIBLE, its bound dropped")
               for m in rep.messages), rep.messages


def test_no_resolve_once_the_part_has_no_time_left(monkeypatch, no_shortcut) -> None:
    prob = _problem()
    now = [0.0]
    monkeypatch.setattr(timing, "clock", lambda: now[0])

    def spend(limit: float) -> None:
        now[0] += max(limit, 0.0)  # each run takes all it is given

    backend = Scripted([_loose, _loose], on_run=spend)
    plan, rep = solve_exact(backend, prob, SolveOptions(time_limit_s=10.0))
    assert [c[2] for c in backend.calls] == [None, None]  # no re-solve
    assert rep.status == "FEASIBLE" and plan is not None


def test_a_proof_found_while_translating_runs_nothing(no_shortcut) -> None:
    prob = _problem()
    backend = Scripted([], proof=["group x: no plan, by proof"])
    plan, rep = solve_exact(backend, prob, SolveOptions(time_limit_s=10.0))
    assert plan is None and rep.status == "INFEASIBLE"
    assert backend.calls == [] and "group x: no plan, by proof" in rep.messages


def test_the_second_pass_gives_a_part_without_a_plan_the_time_left(monkeypatch,
                                                                   no_shortcut) -> None:
    prob = _problem()
    backend = Scripted([_none, _proven, _proven])
    plan, rep = solve_exact(backend, prob, SolveOptions(time_limit_s=30.0))
    assert plan is not None and rep.status == "OPTIMAL"
    assert [c[0] for c in backend.calls] == [[0], [1], [0]]
    assert any("second pass" in m for m in rep.messages)
    monkeypatch.setattr(driver, "MIN_RETRY_S", 1e9)  # no second pass: no plan
    backend = Scripted([_none, _proven])
    plan, rep = solve_exact(backend, prob, SolveOptions(time_limit_s=30.0))
    assert plan is None and rep.status == "TIME_LIMIT" and len(backend.calls) == 2


def test_both_real_backends_leave_the_loop_to_the_driver() -> None:
    """Neither backend module holds a rescale loop of its own: the loop's messages are
    written in the driver only."""
    import inspect

    from qsync_opt.solvers import cpsat, ilp

    for module in (ilp, cpsat):
        text = inspect.getsource(module)
        assert "MAX_RESCALES" not in text and "excluded_choices" not in text
        assert "whose Omega alone exceeds" not in text and "loose_optimum" not in text
    assert "whose Omega alone exceeds" in inspect.getsource(driver)
    for backend in (PulpIlp("highs"), PulpIlp("cbc"), CpSat()):
        for member in ("translate", "run", "rescale_note", "demoted", "unproven_note",
                       "requires", "hint_note", "tolerance_name", "demotion_note"):
            assert hasattr(backend, member), (backend.name, member)


# ------------------------------------------------------------------ typed options


def test_the_older_extra_spelling_fills_the_typed_options() -> None:
    old = SolveOptions(extra={"highs": {"mip_abs_gap": 0.0}, "cbc": ["allowableGap 0"],
                              "cpsat": {"num_search_workers": 1}, "cpsat_units": 1e2,
                              "uniform_precision": "fastest", "batch_multiple": 8})
    new = SolveOptions(highs=HighsOptions({"mip_abs_gap": 0.0}),
                       cbc=CbcOptions(("allowableGap 0",)),
                       cpsat=CpSatOptions(units=1e2, params={"num_search_workers": 1}),
                       uniform=UniformOptions("fastest"),
                       dynamic_batching=DynamicBatchingOptions(8))
    for name in ("highs", "cbc", "cpsat", "uniform", "dynamic_batching"):
        assert getattr(old, name) == getattr(new, name), name
    # a solve inside the call keeps them
    assert old.with_time_left(1.0).cpsat == new.cpsat
    assert SolveOptions().cpsat == CpSatOptions() and SolveOptions().highs.params == {}


@pytest.mark.parametrize("make, field", [
    (lambda: SolveOptions(extra={"cpsat_unit": 1e2}), "extra"),
    (lambda: SolveOptions(extra={"highs": ["mip_abs_gap"]}), "highs.params"),
    (lambda: HighsOptions({"": 1.0}), "highs.params"),
    (lambda: HighsOptions({"mip_abs_gap": [0.0]}), "highs.params"),
    (lambda: CbcOptions(("allowableGap 0", 3)), "cbc.args"),  # type: ignore[arg-type]
    (lambda: SolveOptions(extra={"cbc": "allowableGap 0"}), "cbc.args"),
    (lambda: CpSatOptions(units="1e2"), "cpsat.units"),  # type: ignore[arg-type]
    (lambda: CpSatOptions(units=float("nan")), "cpsat.units"),
    (lambda: CpSatOptions(units=0.5), "cpsat.units"),
    (lambda: CpSatOptions(units=True), "cpsat.units"),
    (lambda: CpSatOptions(params={1: 2}), "cpsat.params"),  # type: ignore[dict-item]
    (lambda: UniformOptions(precision=None), "uniform.precision"),  # type: ignore[arg-type]
    (lambda: DynamicBatchingOptions(batch_multiple="8"),  # type: ignore[arg-type]
     "dynamic_batching.batch_multiple"),
    (lambda: DynamicBatchingOptions(batch_multiple=0), "dynamic_batching.batch_multiple"),
    (lambda: SolveOptions(extra={"batch_multiple": True}), "dynamic_batching.batch_multiple"),
])
def test_bad_backend_options_are_refused_naming_the_field(make, field) -> None:
    with pytest.raises(QsyncInputError, match=field.replace(".", r"\.")):
        make()


def test_cpsat_units_reach_the_scaling() -> None:
    prob = _problem()
    prob = prob.retarget(prob.makespan_ms(prob.reference_assignment()) * 1.5)
    if not CpSat().is_available():
        pytest.skip("ortools is not installed")
    _, default = CpSat().solve(prob, SolveOptions(time_limit_s=20.0))
    _, coarse = CpSat().solve(prob, SolveOptions(time_limit_s=20.0,
                                                 cpsat=CpSatOptions(units=1e2)))
    assert "scaled" not in default.options  # scaled: no cheap proof of no plan here
    assert coarse.options["time_unit_ms"] == pytest.approx(
        default.options["time_unit_ms"] * 1e6)


@functools.cache
def _one_huge_omega() -> AllocationProblem:
    """30 Linear layers on one A100 and one T4, the target halfway between the A100's
    reference time and the T4's, and one Omega of the T4 group 1e8 times what it was: the
    solvers' absolute tolerance on the objective (HiGHS's and CBC's gap, CP-SAT's rounding)
    then exceeds the relative gap of the optimum, which is made of the other Omegas."""
    g = synthetic_graph(30, batch=256, width=1024)
    c = parse_shorthand("a100x1+t4x1")
    prob = AllocationProblem(g, c, estimate(g, c), random_indicator(g))
    ref = max(prob.reference_times.values()) + prob.tail_ms
    prob = prob.with_options(target_ms=prob.target_ms + 0.5 * (ref - prob.target_ms))
    t4 = prob.groups[1]
    omega = [list(r) for r in t4.omega1]
    k = max(range(len(omega[0])), key=omega[0].__getitem__)
    omega[0][k] *= 1e8
    prob.groups[1] = dataclasses.replace(t4, omega1=omega)
    return prob


@pytest.mark.parametrize("name", ["highs", "cbc", "cpsat"])
def test_every_exact_backend_goes_through_the_loose_optimum_loop(name) -> None:
    """Each real backend's loose OPTIMAL is re-solved by the driver without the choices no
    better plan takes, and the re-solve proves the optimum every backend agrees on."""
    backend = {"highs": PulpIlp("highs"), "cbc": PulpIlp("cbc"), "cpsat": CpSat()}[name]
    assert backend.is_available(), f"{name} is not installed here"
    prob = _one_huge_omega()
    plan, rep = backend.solve(prob, SolveOptions(time_limit_s=60.0))
    assert plan is not None and rep.status == "OPTIMAL", rep.messages
    assert any(m.startswith(f"t4: {name} reported OPTIMAL, but ") and
               "re-solved without the" in m for m in rep.messages), rep.messages
    _, exact = PulpIlp("highs").solve(prob, SolveOptions(time_limit_s=60.0, rel_gap=0.0))
    assert exact.objective is not None and rep.objective is not None
    assert rep.objective == pytest.approx(exact.objective, rel=1e-6)
    assert rep.bound is not None and rep.bound <= rep.objective
