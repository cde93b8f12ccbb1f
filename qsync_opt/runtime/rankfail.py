"""How ``qsync-opt train`` reports a failed torchrun: the failing rank from torchrun's
"Root Cause" block, and the ranks' own one-line failures kept apart from torchrun's report.

A rank that refuses its input (a ``data()`` batch of another shape, a loss without grad)
prints one line, ``qsync-opt train: ...``, and exits 2 (:mod:`qsync_opt.job.rank`); every rank may print
the same line, and torchrun then logs and raises its ``ChildFailedError`` (40-odd lines).
The launcher holds those back (:func:`sort_line`) and raises the rank's refusal as the
command's own :class:`~qsync_opt.core.errors.QsyncInputError`: one line on stderr, exit code 2,
the line ``--emulate-dp`` gives. A refusal is the run's cause whichever rank torchrun names
first: a peer that was waiting in a collective fails too (a gloo read error, exit 1), and
torchrun may name that peer, its clock reading the same second. Any other failure shows
torchrun's report and names the rank that failed first (exit code 1).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence

from qsync_opt.core.errors import QsyncInputError

__all__ = ["RANK_ERROR", "exit_codes", "failed_rank", "refusal", "report_failure", "sort_line"]

_ROOT_CAUSE = re.compile(r"Root Cause")
_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
#: torchrun's own failure report (its elastic log lines, its ChildFailedError traceback).
_TORCHRUN_REPORT = re.compile(
    r"^(?:[WE]\d{4} [0-9:.]+ \d+ torch/distributed/elastic/|Traceback \(most recent call)")
#: How a rank's one-line failure starts (qsync_opt.job.rank.main).
RANK_ERROR = "qsync-opt train: "
#: A rank's line for a failure that is not a refusal of input (qsync_opt.job.rank.main).
_RANK_FAILURE = re.compile(r"qsync-opt train: rank \d+: [A-Za-z_][\w.]*: ")


def failed_rank(lines: Sequence[str]) -> tuple[int | None, int | None]:
    """(rank, exit code) of torchrun's "Root Cause" block, where it printed one."""
    start = next((i for i, ln in enumerate(lines) if _ROOT_CAUSE.search(ln)), None)
    if start is None:
        return None, None
    rank = code = None
    for ln in lines[start:start + 12]:
        if rank is None and (m := _RANK.match(ln)):
            rank = int(m[1])
        if code is None and (m := _EXIT.match(ln)):
            code = int(m[1])
    return rank, code


def exit_codes(lines: Sequence[str]) -> list[int]:
    """The exit code of every failed rank torchrun's report lists (root cause and others)."""
    return [int(m[1]) for ln in lines if (m := _EXIT.match(ln))]


def refusal(errors: Sequence[str]) -> str | None:
    """The first of the ranks' lines that refuses input (not a rank's other failure), without
    its ``qsync-opt train: `` prefix."""
    for line in errors:
        if line.startswith(RANK_ERROR) and not _RANK_FAILURE.match(line):
            return line[len(RANK_ERROR):].strip()
    return None


def sort_line(line: str, report: dict[str, list[str]]) -> bool:
    """True when ``line`` is kept in ``report`` instead of shown: a rank's failure line
    (``report["errors"]``, each distinct one once) or torchrun's report from its first line
    on (``report["held"]``)."""
    if line.startswith(RANK_ERROR):
        if line not in report["errors"]:
            report["errors"].append(line)
        return True
    if report["held"] or _TORCHRUN_REPORT.match(line):
        report["held"].append(line)
        return True
    return False


def report_failure(rc: int, tail: Sequence[str], report: dict[str, list[str]],
                   rank_groups: Sequence[str]) -> int:
    """Say why torchrun failed and return 1; when a rank refused its input (it exited with
    code 2, whichever rank torchrun names first), raise that refusal instead: the command's
    one line, exit code 2."""
    rank, code = failed_rank(tail)
    refused = refusal(report["errors"])
    if refused and (code == 2 or 2 in exit_codes([*report["held"], *tail])):
        raise QsyncInputError(refused)  # the line a one-process run gives, exit code 2
    sys.stdout.write("".join(report["held"]))
    sys.stderr.write("".join(report["errors"]))
    if rank is not None:
        sys.stderr.write(f"qsync-opt: train: rank {rank} ({rank_groups[rank]}) failed "
                         f"first (exit code {code}); see its output above\n"
                         if rank < len(rank_groups) else
                         f"qsync-opt: train: rank {rank} failed (exit code {code})\n")
    else:
        sys.stderr.write(f"qsync-opt: train: torchrun exited with code {rc}; see the output "
                         "above\n")
    return 1
