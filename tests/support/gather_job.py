"""One rank of a gather through :func:`qsync_opt.runtime.gather.all_gather_json`, for
tests/test_wheel.py (spawned by :func:`qsync_opt.profile.gloo.spawn_local`, which imports it
as ``support.gather_job`` in each process)."""

from __future__ import annotations

import json
from typing import Any

from qsync_opt.runtime.gather import all_gather_json

__all__ = ["gather_job"]


def gather_job(rank: int, values: list[Any]) -> str:
    """Rank ``rank`` sends ``values[rank]``; what it got back, as JSON text (NaN kept)."""
    return json.dumps(all_gather_json(values[rank]))
