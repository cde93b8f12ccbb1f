"""Byte counts print in the unit that fits (qsync_opt.core.units)."""

from __future__ import annotations

from qsync_opt.core.units import GIB, KIB, MIB, fmt_bytes, fmt_pair
from qsync_opt.planner.compare import CompareRow, format_rows


def test_units_fit_the_size() -> None:
    assert fmt_bytes(12.18 * GIB) == "12.2 GiB"
    assert fmt_bytes(2.97 * MIB) == "2.97 MiB"
    assert fmt_bytes(740 * KIB) == "740 KiB"
    assert fmt_bytes(12) == "12 B"
    assert fmt_pair(9.02 * GIB, 15 * GIB) == "9.02/15 GiB"
    assert fmt_pair(2.4 * MIB, 512 * MIB) == "2.4/512 MiB"


def test_compare_table_never_prints_small_memory_as_zero_gib() -> None:
    row = CompareRow(solver="highs", status="OPTIMAL", feasible=True, objective=0.0,
                     makespan_ms=1.0, replay_makespan_ms=1.0, samples_per_s=1.0, wall_s=0.1,
                     peak_memory_gib={"cpu": 2.97 * MIB / GIB}, batches={"cpu": 32})
    text = format_rows([row])
    assert "cpu=2.97MiB" in text and "0.0" not in text.split(";")[-1]
