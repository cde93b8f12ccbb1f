"""Files: written atomically, and read and parsed with limits. Knows nothing of documents
(:mod:`qsync_opt.documents.schemas` saves and loads them through it; :mod:`qsync_opt.documents.io` is the
module callers import).

Writes are atomic: the bytes go to a temporary file in the target's folder, are flushed and
fsynced, then the temporary file is renamed over the target, so a crash never leaves a
half-written file and an existing file is replaced whole or not at all. The new file keeps the
permission bits of the file it replaces (a new file gets the umask's default, as ``open()``
would give it), and a target that is a symbolic link is written through: the link stays, the
file it points to is replaced. A target that is not a regular file (``/dev/null``,
``/dev/stdout``, a FIFO) is written into, not replaced. That is for a file the user named
(``--out plan.json``, ``--png``); a file the tool names inside an output folder (a run's
files, checkpoints, exports) is written by :mod:`qsync_opt.documents.outfolder`, which never follows
a link there. :func:`check_output_file` refuses an output file that cannot be written
before the work that makes it.

Reads refuse, in one line naming the file: files that do not parse, numbers of more digits
than Python converts, and documents nested deeper than :data:`MAX_DEPTH` levels (a
RecursionError otherwise).
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from qsync_opt.core.errors import OutputError, QsyncInputError, one_line

#: Deepest nesting of objects/arrays (tables/arrays in TOML) a document may have. The
#: deepest schema (a Plan's cluster groups, an IndicatorTable's terms) uses 5.
MAX_DEPTH = 32


# ----------------------------------------------------------------------------- writing


def _write_target(path: str | os.PathLike[str]) -> Path:
    """The file a write to ``path`` replaces: ``path`` itself, or where its symbolic
    link(s) lead (a dangling link: the file it names is created)."""
    p = Path(path)
    return Path(os.path.realpath(p)) if p.is_symlink() else p


def _open_temp(folder: Path, name: str) -> tuple[int, Path]:
    """Create a new temporary file in ``folder`` with mode 0666 less the umask (and any
    default ACL), as ``open()`` creates a file."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    flags |= getattr(os, "O_BINARY", 0)
    stem = name[:200]  # the suffix must not push the name past NAME_MAX
    for _ in range(100):
        tmp = folder / f".{stem}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary file name", str(folder))


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _replace(target: Path, write: Callable[[BinaryIO], object]) -> None:
    if target.is_dir():
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        # /dev/null, /dev/stdout, a FIFO: written into, never replaced by a regular file
        with open(target, "wb") as fh:
            write(fh)
        return
    mode = stat.S_IMODE(st.st_mode) if st is not None else None
    fd, tmp = _open_temp(target.parent, target.name)
    try:
        with os.fdopen(fd, "wb") as fh:
            if mode is not None:
                os.fchmod(fh.fileno(), mode)
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_folder(target.parent)


def write_failure(what: str, path: str | os.PathLike[str], exc: OSError) -> OutputError:
    """The one-line error of a failed write: ``WHAT: cannot write PATH (reason)``."""
    reason = exc.strerror or exc.__class__.__name__
    return OutputError(one_line(f"{what}: cannot write {os.fspath(path)} ({reason})"))


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object], *,
                 what: str | None = None) -> Path:
    """Call ``write(fh)`` on a temporary binary file in ``path``'s folder, fsync it, and
    rename it over ``path``: the target is replaced whole or not at all, keeping its mode;
    a symbolic link is written through. Parent folders are created.

    A failure to write (read-only folder, full disk, the file-size limit, ``path`` a
    folder) raises the ``OSError``; given ``what`` (the option or field the path came
    from, e.g. ``"--out"``) it raises :class:`~qsync_opt.core.errors.OutputError` naming it,
    in one line. Either way nothing is left behind and an existing file is unchanged.
    """
    try:
        _replace(_write_target(path), write)
    except OSError as exc:
        if what is None:
            raise
        raise write_failure(what, path, exc) from None
    return Path(path)


def check_output_file(path: str | os.PathLike[str], what: str) -> None:
    """Before the work whose result goes to ``path`` (a file the user named, written by
    :func:`atomic_write`): refuse, in the one line a failed write gives (:func:`write_failure`),
    a folder there, a path through a file, or a folder that cannot be written into, so no
    work is thrown away."""
    def refuse(code: int) -> OutputError:
        return write_failure(what, path, OSError(code, os.strerror(code)))

    target = _write_target(path)
    if target.is_dir():
        raise refuse(errno.EISDIR)
    parent = target.parent
    while not parent.exists() and parent != parent.parent and not parent.is_symlink():
        parent = parent.parent
    if not parent.is_dir():
        raise refuse(errno.ENOTDIR)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise refuse(errno.EACCES)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *,
                       what: str | None = None) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_write`)."""
    return atomic_write(path, lambda fh: fh.write(data), what=what)


def atomic_write_text(path: str | os.PathLike[str], text: str, *,
                      what: str | None = None) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`atomic_write`)."""
    return atomic_write_bytes(path, text.encode("utf-8"), what=what)


# ----------------------------------------------------------------------------- reading


def check_depth(data: object, where: str = "", limit: int = MAX_DEPTH) -> None:
    """Refuse data nested deeper than ``limit`` levels of dicts/lists (no recursion)."""
    stack: list[tuple[object, int]] = [(data, 1)]
    while stack:
        x, depth = stack.pop()
        if not isinstance(x, (dict, list, tuple)):
            continue
        if depth > limit:
            prefix = f"{where}: " if where else ""
            raise QsyncInputError(one_line(f"{prefix}nested deeper than {limit} levels of "
                                           "objects/arrays, the most a document may have"))
        children = x.values() if isinstance(x, dict) else x
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list, tuple)))


def parse_text(text: str, kind: str, where: str) -> object:
    """Parse ``text`` as ``kind`` ("JSON" or "TOML"): the data, or a one-line
    :class:`QsyncInputError` naming ``where`` (bad syntax, a number too long to convert,
    nesting deeper than :data:`MAX_DEPTH`)."""
    try:
        data = tomllib.loads(text) if kind == "TOML" else json.loads(text)
    except RecursionError:
        raise QsyncInputError(one_line(
            f"{where}: nested deeper than {MAX_DEPTH} levels of objects/arrays, the most a "
            "document may have")) from None
    except json.JSONDecodeError as exc:
        raise QsyncInputError(one_line(
            f"{where}: not valid JSON (line {exc.lineno}: {exc.msg})")) from None
    except ValueError as exc:  # TOMLDecodeError, or an integer of > 4300 digits
        raise QsyncInputError(one_line(f"{where}: not valid {kind} ({exc})")) from None
    check_depth(data, where)
    return data


def read_text(path: str | os.PathLike[str]) -> str:
    """A file's UTF-8 text, or a one-line QsyncInputError naming it."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise QsyncInputError(one_line(f"{p}: file not found")) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise QsyncInputError(one_line(f"{p}: cannot read ({exc.__class__.__name__})")) from None


def read_json(path: str | os.PathLike[str]) -> object:
    return parse_text(read_text(path), "JSON", str(path))
