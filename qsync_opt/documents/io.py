"""Reading and writing documents: the module callers import for files and documents.

A document is written as its JSON (:func:`to_json`), atomically, and read back refusing other
kinds, unknown versions and bad fields in one line naming the file. The file functions
(atomic writes, reads and parses with limits) are :mod:`qsync_opt.documents.files`'; the document
functions are :mod:`qsync_opt.documents.schemas`' (so that ``Document.save`` and ``Document.load``
need nothing above the schemas); both are re-exported here, so a caller needs one import.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

from qsync_opt.documents.files import (
    MAX_DEPTH,
    atomic_write,
    atomic_write_bytes,
    atomic_write_text,
    check_depth,
    check_output_file,
    parse_text,
    read_json,
    read_text,
    write_failure,
)
from qsync_opt.documents.schemas import Document, parse_document, to_json

__all__ = ["MAX_DEPTH", "atomic_write", "atomic_write_bytes", "atomic_write_text",
           "check_depth", "check_output_file", "load", "parse_document", "parse_text",
           "read_json", "read_text", "save", "to_json", "write_failure"]

D = TypeVar("D", bound=Document)


def save(doc: Document, path: str | os.PathLike[str], *, what: str | None = None) -> Path:
    """Write a document as JSON, atomically (see :func:`qsync_opt.documents.files.atomic_write`);
    ``what``: the flag or field the path came from, named by a failed write."""
    return doc.save(path, what=what)


def load(path: str | os.PathLike[str], cls: type[D]) -> D:
    """Read a document of type ``cls`` from a JSON file."""
    return cls.load(path)
