"""What CBC's log says: its result line, the objective of its solution and its lower bound
(the closing summary prints the bound to a few digits only, so it is taken down past its
printed digits, or read in full from the search's own lines)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_CBC_RESULT = re.compile(r"^Result - (.*)$", re.M)
_CBC_GAP = re.compile(r"Exiting as integer gap of\s*([0-9.eE+-]+)")
_CBC_BEST = re.compile(r"Search completed - best objective\s*([0-9.eE+-]+)")
_CBC_NUM = r"\s*:?\s*(-?[0-9.eE+-]+|inf|-inf|1e\+50|-1e\+50)"


@dataclass
class CbcLog:
    """CBC's result line (empty when missing), its objective and lower bound (None: not
    printed), and whether it mentions the warm start."""

    result: str
    objective: float | None
    lower: float | None
    mentions_start: bool


def cbc_log_value(text: str, label: str, lower: bool = False) -> float | None:
    """A number from CBC's closing summary. ``lower``: it is a lower bound printed with
    few decimals, so take it down by half its last printed digit (a valid bound still)."""
    m = re.search(rf"^{label}{_CBC_NUM}", text, re.M)
    if not m:
        return None
    try:
        v = float(m.group(1))
    except ValueError:
        return None
    if not (math.isfinite(v) and abs(v) < 1e49):
        return None
    if lower:
        digits = m.group(1).split("e")[0].split("E")[0]
        decimals = len(digits.split(".")[1]) if "." in digits else 0
        if "e" not in m.group(1).lower():
            v -= 0.5 * 10.0 ** -decimals
    return v


def read_cbc_log(text: str) -> CbcLog:
    """The log's result, objective and lower bound."""
    m = _CBC_RESULT.search(text)
    result = m.group(1).strip() if m else ""
    obj = cbc_log_value(text, "Objective value")
    lower = cbc_log_value(text, "Lower bound", lower=True)
    # The summary prints the bound to a few digits only (1.735 for 1.73549438 with a gap of
    # 4e-12); the search's own lines give it in full: best objective minus the gap it exited at.
    gap, best = _CBC_GAP.search(text), _CBC_BEST.search(text)
    if gap and best:
        try:
            full = float(best.group(1)) - float(gap.group(1))
        except ValueError:
            full = math.nan
        if math.isfinite(full):
            lower = full if lower is None else max(lower, full)
    return CbcLog(result, obj, lower, "mipstart" in text.lower() or "MIPStart" in text)
