"""How a parallel run (``make test``, ``make test-fast``: pytest-xdist's ``-n N --dist
loadgroup``) hands the suite to its workers.

A work unit is one test file, so that a module-scoped fixture (a profile, a traced graph, a
two-rank run whose outputs several tests read) is made once, by the worker that runs the
file. Tests that read one session-scoped run made by a fixture in tests/conftest.py
(``gloo_straight``, ``demo_part_2``) carry ``pytest.mark.xdist_group(<fixture>)`` and form
one unit across their files, so that the run is made once. The units go out heaviest first
(a slow test, or a test with a slow parameter, weighs as much as :data:`SLOW_WEIGHT` fast
ones; the marks are read from the files, tests/support/tiers.py), so that no multi-second unit is left for the end while the
other worker waits.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import cache
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling
from xdist.workermanage import WorkerController

from support.tiers import slow_by_test

#: How many fast tests one slow test weighs: the fast tier runs about 3,500 tests in about
#: 190 s (0.05 s each); the slow tier about 100 in about 500 s (5 s each).
SLOW_WEIGHT = 100


def unit_of(nodeid: str) -> str:
    """The work unit of a test: its ``xdist_group`` (added to the id as ``@name`` under
    ``--dist loadgroup``), else its file."""
    if nodeid.rfind("@") > nodeid.rfind("]"):  # a parameter may hold "@"
        return "group:" + nodeid.rsplit("@", 1)[1]
    return nodeid.split("::", 1)[0]


def function_of(nodeid: str) -> tuple[str, str]:
    """(file, test function) of a test id: its class, parameters and group dropped."""
    if nodeid.rfind("@") > nodeid.rfind("]"):
        nodeid = nodeid.rsplit("@", 1)[0]
    parts = nodeid.split("::")
    return parts[0], parts[-1].split("[", 1)[0]


@cache
def _slow_tests(root: Path, file: str) -> dict[str, bool]:
    path = root / file
    return slow_by_test(path, parameters=True) if path.suffix == ".py" and path.is_file() else {}


def weight_of(root: Path, nodeids: list[str]) -> int:
    """A unit's weight: 1 for each fast test, :data:`SLOW_WEIGHT` for each slow one."""
    total = 0
    for nodeid in nodeids:
        file, name = function_of(nodeid)
        total += SLOW_WEIGHT if _slow_tests(root, file).get(name, False) else 1
    return total


class FileOrGroupScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with a file (or an ``xdist_group``) as the unit, heaviest
    unit first."""

    def __init__(self, config: pytest.Config, log: object | None = None) -> None:
        super().__init__(config, log)  # type: ignore[arg-type]
        self._ordered = False

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def _assign_work_unit(self, node: WorkerController) -> None:
        if not self._ordered:  # the first call: the whole queue is built, nothing handed out
            self._ordered = True
            root = Path(self.config.rootpath)
            units = sorted(self.workqueue.items(),
                           key=lambda unit: -weight_of(root, list(unit[1])))
            self.workqueue = OrderedDict(units)
        super()._assign_work_unit(node)
