"""The solvers' own error, light to import (the command line catches it without importing
a solver): :class:`FastestTimeLimit`."""

from __future__ import annotations

from qsync_opt.core.errors import QsyncInputError


class FastestTimeLimit(QsyncInputError):
    """The least time of a group could not be proven within the time given."""
