"""The one report check of the exact backends (solvers.consistency) with each backend's
tolerances and words: the verdicts and messages the backends gave before the check was
shared."""

from __future__ import annotations

import pytest
from qsync_opt.solvers.consistency import ReportCheck
from qsync_opt.solvers.cpsat import CPSAT_CHECK
from qsync_opt.solvers.ilp import PULP_CHECK


def _cpsat_before(status: str, own: int, reported: float, bound: float | None,
                  rel_gap: float) -> str | None:
    """CP-SAT's check as its backend wrote it (scaled integer units)."""
    if abs(own - reported) > 0.5:
        return (f"its solution's own scaled objective {own} differs from the "
                f"reported {reported:.17g}")
    if status == "OPTIMAL" and bound is not None and (
            own - bound > rel_gap * max(1.0, abs(own)) + 1.0):
        return (f"its solution's own scaled objective {own} is above its bound "
                f"{bound:.17g} by more than the gap")
    return None


def _pulp_before(status: str, own: float, reported: float | None, bound: float | None,
                 rel_gap: float) -> str | None:
    """The PuLP backend's check as it wrote it (the program's scaled units)."""
    tol = 1e-6 * max(1.0, abs(own))
    if reported is not None and abs(own - reported) > tol:
        return (f"its solution's own objective {own:.9g} differs from the objective it "
                f"reports, {reported:.9g} (scaled units)")
    if status == "OPTIMAL" and bound is not None and (
            own - bound > rel_gap * abs(own) + 1e-6 + tol):
        return (f"its solution's own objective {own:.9g} is above its bound "
                f"{bound:.9g} by more than the gap (scaled units)")
    return None


CPSAT_CASES = [  # (status, own, reported, bound, rel_gap)
    ("OPTIMAL", 1000, 1000.0, 1000.0, 1e-4),
    ("OPTIMAL", 1000, 1000.4, 999.0, 0.0),
    ("OPTIMAL", 1000, 1000.6, 999.0, 0.0),  # reported off by more than half a unit
    ("OPTIMAL", 1000, 1000.0, 998.9, 0.0),  # above its bound by more than one unit
    ("OPTIMAL", 1000, 1000.0, 998.9, 1e-3),  # ... but within the gap
    ("FEASIBLE", 1000, 1000.0, 10.0, 0.0),  # not OPTIMAL: no bound check
    ("OPTIMAL", 0, 0.0, -1.5, 0.0),
    ("OPTIMAL", 10 ** 15, 1e15, 1e15 - 2e11, 1e-4),
    ("OPTIMAL", -7, -7.0, None, 0.0),
]

PULP_CASES = [
    ("OPTIMAL", 1.0, 1.0, 1.0, 1e-4),
    ("OPTIMAL", 1.0, 1.0 + 2e-6, 1.0, 0.0),  # reported off by more than 1e-6
    ("OPTIMAL", 1.0, None, 0.99, 0.0),  # nothing reported; above its bound
    ("OPTIMAL", 1.0, 1.0, 1.0 - 1.9e-6, 0.0),  # within 1e-6 plus the objective tolerance
    ("OPTIMAL", 1.0, 1.0, 1.0 - 2.1e-6, 0.0),
    ("OPTIMAL", 0.0, 0.0, -3e-6, 0.0),
    ("TIME_LIMIT", 5.0, 5.0, 0.0, 0.0),
    ("OPTIMAL", 250.0, 250.0002, None, 0.0),
    ("OPTIMAL", -3.0, -3.0, -3.5, 0.1),
    ("OPTIMAL", float("nan"), 1.0, 0.0, 0.0),
]


@pytest.mark.parametrize("case", CPSAT_CASES)
def test_cpsat_check_says_what_the_backend_said(case) -> None:
    assert CPSAT_CHECK.why(*case) == _cpsat_before(*case)


@pytest.mark.parametrize("case", PULP_CASES)
def test_pulp_check_says_what_the_backend_said(case) -> None:
    assert PULP_CHECK.why(*case) == _pulp_before(*case)


def test_the_cases_reach_every_verdict() -> None:
    for check, cases in ((CPSAT_CHECK, CPSAT_CASES), (PULP_CHECK, PULP_CASES)):
        verdicts = [check.why(*c) for c in cases]
        assert None in verdicts
        assert any(v and "differs" in v for v in verdicts)
        assert any(v and "above its bound" in v for v in verdicts)


@pytest.mark.parametrize("check, solver, retried, kept", [
    (CPSAT_CHECK, "CP-SAT",
     "g0: CP-SAT reported OPTIMAL, but W; re-solved without the hints",
     "g0: CP-SAT reported OPTIMAL, but W; the plan is kept as FEASIBLE and CP-SAT's bound "
     "dropped"),
    (PULP_CHECK, "highs",
     "g0: highs reported OPTIMAL, but W; the solution looks like the warm start handed "
     "back; re-solved without the start",
     "g0: highs reported OPTIMAL, but W; the plan is kept as FEASIBLE (its own objective) "
     "and the solver's bound dropped"),
])
def test_the_notes_are_the_backends_words(check: ReportCheck, solver: str, retried: str,
                                          kept: str) -> None:
    assert check.retried_note("g0", solver, "OPTIMAL", "W") == retried
    assert check.kept_note("g0", solver, "OPTIMAL", "W") == kept
    # a reason holding braces is passed through, not formatted
    assert "{own}" in check.kept_note("g0", solver, "OPTIMAL", "{own}")
