"""Cluster specs from a shorthand (``v100x16+t4x16``) or a TOML/JSON file.

Shorthand: groups joined by ``+``, each ``DEVICExCOUNT`` with an optional ``@BATCH`` (per
device batch). Group names default to the device name, suffixed ``_2``, ``_3`` when a device
repeats; devices per node default to min(count, 8). DEVICE may be a derived CPU,
``cpu/F[:MEM][~CARD]`` (this machine's measured CPU slowed F times, memory capped at MEM, the
precision menu of CARD; see qsync_opt.devices): ``cpux1+cpu/2x1`` is a hybrid cluster on one
CPU box, its groups named ``cpu`` and ``cpu_2`` (derived CPUs count as repeats of ``cpu``). A file holds the ClusterSpec fields
(``schema_name``/``schema_version`` optional); see examples/.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

from pydantic import ValidationError

from .devices import canonical_name, is_derived
from .errors import QsyncInputError, describe_validation_error
from .io import parse_document
from .schemas import ClusterSpec

_GROUP_RE = re.compile(
    r"^(?P<device>[a-z][a-z0-9_]*?(?:/[0-9.]+(?::[0-9.]+[gm])?(?:~[a-z][a-z0-9_]*?)?)?)"
    r"x(?P<count>\d+)(?:@(?P<batch>\d+))?$")
SHORTHAND_HELP = ("DEVICExCOUNT[@BATCH] joined by '+', e.g. v100x16+t4x16 or a100x8@64+t4x8@32; "
                  "DEVICE may be a derived CPU cpu/F[:MEM][~CARD] (this CPU slowed F times, "
                  "memory capped at MEM like 4g or 512m, CARD's precision menu), e.g. "
                  "cpux1+cpu/2x1 or cpux1+cpu/3:4g~t4x1")


def parse_shorthand(text: str, devices_per_node: int = 8) -> ClusterSpec:
    """Parse ``v100x16+t4x16`` into a ClusterSpec."""
    parts = [p.strip().lower() for p in text.strip().split("+")]
    if not text.strip() or any(not p for p in parts):
        raise QsyncInputError(f"cluster: empty group in {text!r}; expected {SHORTHAND_HELP}")
    groups = []
    used: dict[str, int] = {}
    for i, part in enumerate(parts):
        m = _GROUP_RE.match(part)
        if not m:
            raise QsyncInputError(
                f"cluster: group {i} {part!r} is not DEVICExCOUNT[@BATCH]; expected {SHORTHAND_HELP}"
            )
        device = m["device"]
        if is_derived(device):
            device = canonical_name(device)  # a bad factor/cap/card: its own one-line message
        base = device.split("/", 1)[0]
        used[base] = used.get(base, 0) + 1
        name = base if used[base] == 1 else f"{base}_{used[base]}"
        count = int(m["count"])
        group = {"name": name, "device": device, "count": count,
                 "devices_per_node": max(1, min(count, devices_per_node))}
        if m["batch"]:
            group["batch_per_device"] = int(m["batch"])
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
        raise QsyncInputError(f"{p}: file not found") from None
    except OSError as exc:
        raise QsyncInputError(f"{p}: cannot read ({exc.__class__.__name__})") from None
    try:
        if p.suffix.lower() == ".toml":
            data: object = tomllib.loads(raw.decode("utf-8"))
        else:
            data = json.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        kind = "TOML" if p.suffix.lower() == ".toml" else "JSON"
        raise QsyncInputError(f"{p}: not valid {kind} ({exc})") from None
    return parse_document(data, ClusterSpec, where=str(p))


def load_cluster(spec: str | Path | ClusterSpec) -> ClusterSpec:
    """A ClusterSpec from a file path, a shorthand string, or a ClusterSpec (returned as is)."""
    if isinstance(spec, ClusterSpec):
        return spec
    text = str(spec)
    if Path(text).is_file() or text.endswith((".toml", ".json")):
        return load_cluster_file(text)
    return parse_shorthand(text)
