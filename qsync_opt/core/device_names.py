"""Device names: the catalog's canonical names, their aliases and the derived-CPU spelling.

Dependency-free (only :mod:`qsync_opt.core.errors`), so the schemas can check a device name
without the catalog's figures; :mod:`qsync_opt.costs.devices` holds the figures and checks at
import that its entries are exactly :data:`CATALOG_NAMES`, in order.
"""

from __future__ import annotations

import re
from decimal import Decimal

from qsync_opt.core.errors import QsyncInputError

#: The catalog's canonical names, in the catalog's order (:data:`qsync_opt.costs.devices.CATALOG`).
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
#: Catalog cards with a published INT4 tensor-core peak (docs/DEVICES.md; costs/devices.py checks
#: at import that these are exactly the entries whose ``peak_tflops`` has ``int4``).
INT4_CARDS: tuple[str, ...] = ("t4", "a10")
#: The opt-in suffix: ``t4:int4`` is the T4 with int4 on its menu (``cpu/2~t4:int4``: a
#: derived CPU standing in for it). No default menu has int4 (precision.OPT_IN).
INT4_SUFFIX = ":int4"
INT4_HELP = ("int4 is enabled per device with the suffix :int4 (t4:int4, a10:int4, "
             "cpu/2~t4:int4) on a card with a published INT4 peak: " + ", ".join(INT4_CARDS))

#: ``cpu/F[:MEM][~CARD]`` (see :mod:`qsync_opt.costs.devices`).
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
    if key.endswith(INT4_SUFFIX):
        return _canonical_int4(name, key[: -len(INT4_SUFFIX)])
    if key.startswith("cpu/"):
        return _canonical_derived(name, key)
    key = ALIASES.get(key, key)
    if key in CATALOG_NAMES or key == CPU:
        return key
    raise _unknown(name)


def int4_card(name: str) -> str | None:
    """The catalog card whose menu a device name takes (``cpu/2~t4`` -> ``t4``; ``cpu`` and
    ``cpu/2`` -> None), for the INT4 check. ``name`` is canonical, without ``:int4``."""
    if name.startswith("cpu/"):
        m = DERIVED_RE.match(name)
        return m["card"] if m else None
    return None if name == CPU else name


def _canonical_int4(name: str, base: str) -> str:
    if base.endswith(INT4_SUFFIX):
        raise QsyncInputError(f"device {name!r}: :int4 written twice")
    canon = canonical_name(base)
    card = int4_card(canon)
    if card is None:
        raise QsyncInputError(
            f"device {name!r}: int4 needs a card with an INT4 peak; a CPU takes it from its "
            f"~CARD, e.g. cpu/2~t4:int4 ({INT4_HELP})")
    if card not in INT4_CARDS:
        raise QsyncInputError(
            f"device {name!r}: {card} has no INT4 peak in the catalog (docs/DEVICES.md), so "
            f"int4 cannot be enabled on it; cards with one: {', '.join(INT4_CARDS)}")
    return canon + INT4_SUFFIX


def has_int4(name: str) -> bool:
    """Whether the device ``name`` (canonical) has int4 enabled (the ``:int4`` suffix)."""
    return name.endswith(INT4_SUFFIX)


def can_enable_int4(name: str) -> bool:
    """Whether ``name`` (canonical) is, or stands in for, a card with an INT4 peak."""
    base = name[: -len(INT4_SUFFIX)] if has_int4(name) else name
    return int4_card(base) in INT4_CARDS


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
    """Whether ``name`` is a derived CPU (``cpu/F...``, with or without ``:int4``)."""
    return name.strip().lower().startswith("cpu/")
