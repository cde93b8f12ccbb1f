"""Errors a user can act on.

Everything the CLI turns into one line and exit code 2 derives from :class:`QsyncInputError`;
pydantic's ``ValidationError`` is formatted the same way by :func:`describe_validation_error`.
Text that came from the user (a name, a value, a path) is printed through :func:`one_line`,
so no message ever spans lines.
"""

from __future__ import annotations

from pydantic import ValidationError


class QsyncInputError(ValueError):
    """Bad input from the user: a file, a name, a value. The message names the field."""


class SchemaVersionError(QsyncInputError):
    """A file written by another qsync-opt version (or another kind of file)."""


class TraceError(QsyncInputError):
    """No tracer could turn the model into a graph; the message says why, in one line."""


class OutputError(QsyncInputError):
    """An output file could not be written (read-only folder, full disk, file-size limit,
    a folder where the file should be). The file that was there is unchanged."""


#: Invalid fields a validation message lists before "and N more".
MAX_REPORTED = 5


def one_line(text: str) -> str:
    """``text`` with every non-printable character (newline, tab, escape, NUL, line and
    paragraph separators...) written as its Python escape (``\\n``, ``\\x1b``), so that it
    prints on one line and shows what was there. Printable text is returned unchanged."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def describe_validation_error(err: ValidationError, where: str = "") -> str:
    """One line naming each invalid field (dotted path) and what was expected (the first
    :data:`MAX_REPORTED` of them, then how many more). A check of the whole document (an
    empty path) says what it is about itself, naming the flags or fields: its message is
    given alone, never under a made-up path such as ``(root)``."""
    parts = []
    errors = err.errors()
    for e in errors[:MAX_REPORTED]:
        loc = ".".join(str(x) for x in e.get("loc", ()))
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        got = e.get("input")
        if (e.get("type") != "missing" and isinstance(got, (int, float, str, bool))
                and "got" not in msg):
            text = repr(got)  # the value as it was read, shortened
            msg += f", got {text[:40] + '...' if len(text) > 43 else text}"
        parts.append(f"{loc}: {msg}" if loc else msg)
    if len(errors) > MAX_REPORTED:
        parts.append(f"and {len(errors) - MAX_REPORTED} more")
    prefix = f"{where}: " if where else ""
    return one_line(prefix + "; ".join(parts))
