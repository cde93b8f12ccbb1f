"""Reading and writing documents. The only module (with the CLI) that touches files.

Writes are atomic: the text goes to a temporary file in the target's folder, is flushed and
fsynced, then renamed over the target, so a crash never leaves a half-written file and an
existing file is replaced whole or not at all.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar

from pydantic import ValidationError

from .errors import QsyncInputError, SchemaVersionError, describe_validation_error
from .schemas import Document

D = TypeVar("D", bound=Document)


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> Path:
    """Call ``write(fh)`` on a temporary binary file in ``path``'s folder, fsync it, and
    rename it over ``path``: the target is replaced whole or not at all."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; parent folders are created."""
    data = text.encode("utf-8")
    return atomic_write(path, lambda fh: fh.write(data))


def to_json(doc: Document, indent: int | None = 2) -> str:
    return doc.model_dump_json(indent=indent) + "\n"


def save(doc: Document, path: str | os.PathLike[str]) -> Path:
    """Write a document as JSON, atomically."""
    return atomic_write_text(path, to_json(doc))


def read_json(path: str | os.PathLike[str]) -> object:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise QsyncInputError(f"{p}: file not found") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise QsyncInputError(f"{p}: cannot read ({exc.__class__.__name__})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise QsyncInputError(f"{p}: not valid JSON (line {exc.lineno}: {exc.msg})") from None


def parse_document(data: object, cls: type[D], where: str = "") -> D:
    """Validate parsed JSON as ``cls``, refusing other kinds and unknown versions clearly."""
    prefix = f"{where}: " if where else ""
    if not isinstance(data, dict):
        raise QsyncInputError(f"{prefix}expected a JSON object holding a {cls.SCHEMA_NAME}")
    name = data.get("schema_name")
    version = data.get("schema_version")
    if name is not None and name != cls.SCHEMA_NAME:
        raise SchemaVersionError(f"{prefix}schema_name is {name!r}, expected {cls.SCHEMA_NAME!r}")
    if version is not None and version != cls.SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{prefix}schema_version {version!r} of {cls.SCHEMA_NAME} is not one this "
            f"qsync-opt reads (it reads version {cls.SCHEMA_VERSION})"
        )
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise QsyncInputError(describe_validation_error(exc, where)) from None


def load(path: str | os.PathLike[str], cls: type[D]) -> D:
    """Read a document of type ``cls`` from a JSON file."""
    return parse_document(read_json(path), cls, where=str(path))
