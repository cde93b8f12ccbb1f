"""Errors a user can act on.

Everything the CLI turns into one line and exit code 2 derives from :class:`QsyncInputError`;
pydantic's ``ValidationError`` is formatted the same way by :func:`describe_validation_error`.
"""

from __future__ import annotations

from pydantic import ValidationError


class QsyncInputError(ValueError):
    """Bad input from the user: a file, a name, a value. The message names the field."""


class SchemaVersionError(QsyncInputError):
    """A file written by another qsync-opt version (or another kind of file)."""


class TraceError(QsyncInputError):
    """No tracer could turn the model into a graph; the message says why, in one line."""


def describe_validation_error(err: ValidationError, where: str = "") -> str:
    """One line naming each invalid field (dotted path) and what was expected."""
    parts = []
    for e in err.errors():
        loc = ".".join(_printable(str(x)) for x in e.get("loc", ())) or "(root)"
        msg = _printable(str(e.get("msg", "invalid")).removeprefix("Value error, "))
        parts.append(f"{loc}: {msg}")
    prefix = f"{where}: " if where else ""
    return prefix + "; ".join(parts)


def _printable(text: str) -> str:
    """A field name or message on one line: control characters shown escaped."""
    return text if text.isprintable() else repr(text)[1:-1]
