"""Cluster specs from a shorthand (``v100x16+t4x16``) or a TOML/JSON file.

Shorthand: groups joined by ``+``, each ``DEVICExCOUNT`` with an optional ``@BATCH`` (per
device batch). Group names default to the device name, suffixed ``_2``, ``_3`` when a device
repeats; devices per node default to min(count, 8). DEVICE may be a derived CPU,
``cpu/F[:MEM][~CARD]`` (this machine's measured CPU slowed F times, memory capped at MEM, the
precision menu of CARD; see qsync_opt.costs.devices): ``cpux1+cpu/2x1`` is a hybrid cluster on one
CPU box, its groups named ``cpu`` and ``cpu_2`` (derived CPUs count as repeats of ``cpu``). A file holds the ClusterSpec fields
(``schema_name``/``schema_version`` optional); see examples/.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import ValidationError

from qsync_opt.core.errors import QsyncInputError, describe_validation_error, one_line
from qsync_opt.costs.devices import canonical_name, is_derived
from qsync_opt.documents.io import parse_document, parse_text
from qsync_opt.documents.schemas import MAX_BATCH, MAX_DEVICES, MAX_GROUPS, ClusterSpec

_GROUP_RE = re.compile(
    r"^(?P<device>[a-z][a-z0-9_]*?(?:/[0-9.]+(?::[0-9.]+[gm])?(?:~[a-z][a-z0-9_]*?)?)?"
    r"(?::int4)?)"
    r"x(?P<count>[0-9]+)(?:@(?P<batch>[0-9]+))?$")  # ASCII digits: never ٣
SHORTHAND_HELP = ("DEVICExCOUNT[@BATCH] joined by '+', e.g. v100x16+t4x16 or a100x8@64+t4x8@32; "
                  "DEVICE may be a derived CPU cpu/F[:MEM][~CARD] (this CPU slowed F times, "
                  "memory capped at MEM like 4g or 512m, CARD's precision menu), e.g. "
                  "cpux1+cpu/2x1 or cpux1+cpu/3:4g~t4x1; DEVICE:int4 adds int4 to a card "
                  "with an INT4 peak (t4:int4x8, cpu/2~t4:int4x1)")


def _shown(text: str, limit: int = 120) -> str:
    """``text`` quoted for a message, cut in the middle when long (a 600,000-group
    shorthand is not echoed whole)."""
    if len(text) > limit:
        text = f"{text[:limit // 2]}...{text[-limit // 2:]}"
    return repr(text)


def _bounded_int(digits: str, what: str, limit: int, i: int, part: str) -> int:
    """``digits`` as an int, refusing beyond ``limit`` before converting (a number of 5000
    digits is a ValueError in ``int()``; one of 25 digits overflows the solvers)."""
    significant = digits.lstrip("0") or "0"
    if len(significant) > len(str(limit)) or int(significant) > limit:
        raise QsyncInputError(one_line(
            f"cluster: group {i} {_shown(part)}: {what} {digits} is more than the limit "
            f"{limit}"))
    return int(significant)


def parse_shorthand(text: str, devices_per_node: int = 8) -> ClusterSpec:
    """Parse ``v100x16+t4x16`` into a ClusterSpec.

    Messages name the group by its index (``groups.1.device``) and echo what was written
    (``cpu/2:0.000001g``, not a canonical ``1e-06g``), on one line.
    """
    raw_parts = text.strip().split("+")
    if not text.strip() or any(not p.strip() for p in raw_parts):
        raise QsyncInputError(one_line(
            f"cluster: empty group in {_shown(text)}; expected {SHORTHAND_HELP}"))
    if len(raw_parts) > MAX_GROUPS:
        raise QsyncInputError(f"cluster: {len(raw_parts)} groups, more than the {MAX_GROUPS} "
                              "a cluster may have")
    groups = []
    used: dict[str, int] = {}
    for i, written in enumerate(raw_parts):
        written = written.strip()
        part = written.lower()
        m = _GROUP_RE.match(part)
        if not m:
            raise QsyncInputError(one_line(
                f"cluster: group {i} {_shown(written)} is not DEVICExCOUNT[@BATCH]; "
                f"expected {SHORTHAND_HELP}"))
        device = m["device"]
        if is_derived(device):
            try:
                canonical_name(device)  # a bad factor/cap/card: its own one-line message
            except QsyncInputError as exc:
                raise QsyncInputError(one_line(
                    f"cluster: group {i} {_shown(written)}: {exc}")) from None
        base = device.split("/", 1)[0].split(":", 1)[0]
        used[base] = used.get(base, 0) + 1
        name = base if used[base] == 1 else f"{base}_{used[base]}"
        count = _bounded_int(m["count"], "count", MAX_DEVICES, i, written)
        group: dict[str, object] = {"name": name, "device": device, "count": count,
                                    "devices_per_node": max(1, min(count, devices_per_node))}
        if m["batch"]:
            group["batch_per_device"] = _bounded_int(m["batch"], "batch", MAX_BATCH, i, written)
        groups.append(group)
    try:
        return ClusterSpec.model_validate({"groups": groups})
    except ValidationError as exc:
        raise QsyncInputError(describe_validation_error(exc, "cluster")) from None


def load_cluster_file(path: str | Path) -> ClusterSpec:
    """Read a ClusterSpec from TOML (``.toml``) or JSON."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise QsyncInputError(one_line(f"{p}: file not found")) from None
    except OSError as exc:
        raise QsyncInputError(one_line(f"{p}: cannot read ({exc.__class__.__name__})")) from None
    kind = "TOML" if p.suffix.lower() == ".toml" else "JSON"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise QsyncInputError(one_line(f"{p}: not valid {kind} ({exc})")) from None
    return parse_document(parse_text(text, kind, str(p)), ClusterSpec, where=str(p))


def load_cluster(spec: str | Path | ClusterSpec) -> ClusterSpec:
    """A ClusterSpec from a file path, a shorthand string, or a ClusterSpec (returned as is)."""
    if isinstance(spec, ClusterSpec):
        return spec
    text = str(spec)
    try:
        is_file = Path(text).is_file()
    except (OSError, ValueError):  # a name too long for a path, a NUL byte: a shorthand
        is_file = False
    if is_file or text.endswith((".toml", ".json")):
        return load_cluster_file(text)
    return parse_shorthand(text)
