"""Why a planning call ends without a plan: :class:`InfeasibleError` (no plan exists) and
:class:`SolveTimeLimit` (none found in time). Their own module, light to import: the command
line catches them without importing the solve pipeline."""

from __future__ import annotations

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.documents.schemas import SolveReport


class InfeasibleError(QsyncInputError):
    """No plan satisfies the problem; ``report`` says what the solver found and ``lines``
    what would make it feasible (smallest memory per group, fastest makespan, blocking pins)."""

    def __init__(self, message: str, report: SolveReport | None = None) -> None:
        super().__init__(message)
        self.report = report
        self.head = message
        self.lines: list[str] = []


class SolveTimeLimit(QsyncInputError):
    """The time limit of the whole call ran out before any plan was found (a plan may
    exist: this is not infeasibility). ``report`` is the last solver report, ``bound`` the
    best bound on the objective found (None: none)."""

    def __init__(self, message: str, report: SolveReport | None = None,
                 bound: float | None = None) -> None:
        super().__init__(message)
        self.report = report
        self.bound = bound
