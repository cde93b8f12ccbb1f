"""A solver's report checked against the solution it returned: the objective it reports
must be the solution's own (recomputed from the problem), and an OPTIMAL one must lie
within the gap of its bound. One check for every exact backend; what differs between them
(their units, tolerances and words) is data, a :class:`ReportCheck` per backend.

A solver can report an optimum that its solution does not carry (HiGHS with a start has
reported kOptimal with the optimum's objective while ``getSolution`` still held the start;
CP-SAT's presolve has certified a wrong optimum): the backend then re-solves without the
start, and keeps a plan still inconsistent as FEASIBLE without the solver's bound.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReportCheck:
    """One backend's tolerances and words for the check (objectives in its scaled units).

    The reported objective may differ from the solution's own ``own`` by
    ``objective_abs + objective_rel * max(1, |own|)``; an OPTIMAL solution may lie above its
    bound by ``rel_gap * max(gap_floor, |own|) + gap_abs`` (plus the objective tolerance
    when ``gap_adds_objective_tol``). ``differs`` and ``above`` say why the report fails
    (fields ``own``, ``reported``, ``bound``); ``retried`` and ``kept`` say what was done
    (fields ``tag``, ``solver``, ``status``, ``why``)."""

    objective_abs: float
    objective_rel: float
    gap_floor: float
    gap_abs: float
    gap_adds_objective_tol: bool
    differs: str
    above: str
    retried: str
    kept: str

    def why(self, status: str, own: float, reported: float | None, bound: float | None,
            rel_gap: float) -> str | None:
        """Why the report does not describe the solution (None: it does)."""
        tol = self.objective_abs + self.objective_rel * max(1.0, abs(own))
        if reported is not None and abs(own - reported) > tol:
            return self.differs.format(own=own, reported=reported)
        slack = rel_gap * max(self.gap_floor, abs(own)) + self.gap_abs
        if self.gap_adds_objective_tol:
            slack += tol
        if status == "OPTIMAL" and bound is not None and own - bound > slack:
            return self.above.format(own=own, bound=bound)
        return None

    def retried_note(self, tag: str, solver: str, status: str, why: str) -> str:
        """The message of a run repeated without its start."""
        return self.retried.format(tag=tag, solver=solver, status=status, why=why)

    def kept_note(self, tag: str, solver: str, status: str, why: str) -> str:
        """The message of a plan kept as FEASIBLE, the solver's bound dropped."""
        return self.kept.format(tag=tag, solver=solver, status=status, why=why)
