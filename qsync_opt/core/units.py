"""Byte counts for people: one formatter, so a 3 MiB figure never prints as "0.0 GiB"."""

from __future__ import annotations

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB


def unit_for(nbytes: float) -> tuple[str, int]:
    """The largest binary unit in which ``nbytes`` is at least 1 (B for less than 1 KiB)."""
    n = abs(nbytes)
    if n >= GIB:
        return "GiB", GIB
    if n >= MIB:
        return "MiB", MIB
    if n >= KIB:
        return "KiB", KIB
    return "B", 1


def fmt_bytes(nbytes: float, digits: int = 3) -> str:
    """``nbytes`` with ``digits`` significant figures in the unit that fits: 12.2 GiB,
    2.97 MiB, 740 KiB, 12 B."""
    name, size = unit_for(nbytes)
    v = nbytes / size
    if name == "B":
        return f"{int(round(v))} B"
    return f"{v:.{digits}g} {name}"


def fmt_pair(used: float, cap: float, digits: int = 3) -> str:
    """``used/cap unit`` in the unit of the larger of the two (9.02/15.0 GiB, 2.4/512 MiB)."""
    name, size = unit_for(max(used, cap))
    if name == "B":
        return f"{int(used)}/{int(cap)} B"
    return f"{used / size:.{digits}g}/{cap / size:.{digits}g} {name}"
