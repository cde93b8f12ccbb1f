"""Device names: the catalog's canonical names, their aliases and the derived-CPU spelling.

Dependency-free (only :mod:`qsync_opt.errors`), so the schemas can check a device name
without the catalog's figures; :mod:`qsync_opt.devices` holds the figures and checks at
import that its entries are exactly :data:`CATALOG_NAMES`, in order.
"""

from __future__ import annotations

import re
from decimal import Decimal

from .errors import QsyncInputError

#: The catalog's canonical names, in the catalog's order (:data:`qsync_opt.devices.CATALOG`).
CATALOG_NAMES: tuple[str, ...] = (
    "t4", "v100", "v100_pcie", "a10", "l4", "a100_40gb", "a100_80gb", "a100_pcie_80gb",
    "h100", "h100_pcie", "h200",
)
ALIASES: dict[str, str] = {
    "v100_sxm2": "v100",
    "v100_sxm2_32gb": "v100",
    "a100": "a100_80gb",
    "a100_sxm": "a100_80gb",
    "h100_sxm": "h100",
}
CPU = "cpu"

#: ``cpu/F[:MEM][~CARD]`` (see :mod:`qsync_opt.devices`).
DERIVED_RE = re.compile(
    r"^cpu/(?P<factor>[0-9]*\.?[0-9]+)(?::(?P<mem>[0-9]*\.?[0-9]+)(?P<unit>[gm]))?"
    r"(?:~(?P<card>[a-z][a-z0-9_]*))?$")
DERIVED_HELP = "cpu/F[:MEM][~CARD], e.g. cpu/2, cpu/2:4g, cpu/3~t4 (this CPU slowed F times)"


def known_device_names() -> list[str]:
    """Canonical catalog names (aliases excluded), ``cpu`` last."""
    return [*CATALOG_NAMES, CPU]


def _unknown(name: str) -> QsyncInputError:
    return QsyncInputError(
        f"unknown device {name!r}; known: {', '.join(known_device_names())} "
        f"(aliases: {', '.join(f'{a}={c}' for a, c in sorted(ALIASES.items()))}; "
        f"derived: {DERIVED_HELP})"
    )


def canonical_name(name: str) -> str:
    """Resolve an alias (``a100`` -> ``a100_80gb``); unknown names raise with the known list.

    A derived CPU comes back in its canonical spelling: ``CPU/2.0~a100`` -> ``cpu/2~a100_80gb``.
    Refuses (QsyncInputError) an unknown name, a malformed derived name, a slowdown factor
    below 1, a memory cap not above 0 and a ``~CARD`` that is not a catalog card.
    """
    key = name.strip().lower()
    if key.startswith("cpu/"):
        return _canonical_derived(name, key)
    key = ALIASES.get(key, key)
    if key in CATALOG_NAMES or key == CPU:
        return key
    raise _unknown(name)


def number_text(x: float) -> str:
    """``x`` written out positionally (0.000001, never 1e-06: a derived name must read back
    through its own pattern), without trailing zeros."""
    return format(Decimal(repr(float(x))).normalize(), "f")


def _canonical_derived(name: str, key: str) -> str:
    m = DERIVED_RE.match(key)
    if not m:
        raise QsyncInputError(f"device {name!r}: a derived CPU is written {DERIVED_HELP}")
    factor = float(m["factor"])
    if not factor >= 1:
        raise QsyncInputError(f"device {name!r}: slowdown factor must be >= 1, got {m['factor']}")
    out = f"cpu/{number_text(factor)}"
    if m["mem"] is not None:
        mem = float(m["mem"])
        if not mem > 0:
            raise QsyncInputError(f"device {name!r}: memory cap must be > 0, got {m['mem']}")
        out += f":{number_text(mem)}{m['unit']}"
    if m["card"] is not None:
        card = ALIASES.get(m["card"], m["card"])
        if card not in CATALOG_NAMES:
            raise QsyncInputError(
                f"device {name!r}: ~{m['card']} is not a catalog card; "
                f"known: {', '.join(CATALOG_NAMES)}")
        out += f"~{card}"
    return out


def is_derived(name: str) -> bool:
    """Whether ``name`` is a derived CPU (``cpu/F...``)."""
    return name.strip().lower().startswith("cpu/")
