"""Cluster specs from a shorthand (``v100x16+t4x16``) or a TOML/JSON file.

Shorthand: groups joined by ``+``, each ``DEVICExCOUNT`` with an optional ``@BATCH`` (per
device batch). Group names default to the device name, suffixed ``_2``, ``_3`` when a device
repeats; devices per node default to min(count, 8). A file holds the ClusterSpec fields
(``schema_name``/``schema_version`` optional); see examples/.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

from pydantic import ValidationError

from .errors import QsyncInputError, describe_validation_error
from .io import parse_document
from .schemas import ClusterSpec

_GROUP_RE = re.compile(r"^(?P<device>[a-z][a-z0-9_]*?)x(?P<count>\d+)(?:@(?P<batch>\d+))?$")
SHORTHAND_HELP = "DEVICExCOUNT[@BATCH] joined by '+', e.g. v100x16+t4x16 or a100x8@64+t4x8@32"


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
        used[device] = used.get(device, 0) + 1
        name = device if used[device] == 1 else f"{device}_{used[device]}"
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
