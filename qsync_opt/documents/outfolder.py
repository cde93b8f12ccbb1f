"""Output folders: every write, append, read and delete inside one never follows a link.

A command that writes into a folder (``train --out``, ``sweep --out``, ``demo --out``...) may
be handed a folder someone else made: a shared run folder, a sweep export. A symbolic link
planted inside it (``summary.json -> ~/.bashrc``, ``ckpt -> another run's ckpt``) must not
let the command write, append, truncate or delete outside. So, below the folder given
(``root``, which may itself be a link: it is followed, as the user named it):

- every folder on the way is opened with ``O_NOFOLLOW | O_DIRECTORY`` relative to its
  parent's descriptor (no path is re-resolved, so no race swaps a component for a link);
- a file is written atomically (a temporary file in its folder, fsynced, ``os.replace``d
  over the name: the rename replaces the entry, it never follows it), appended to and read
  with ``O_NOFOLLOW``, deleted (files, whole folders) by descriptor;
- a link, or anything but a regular file where a file is written (a FIFO, a device), is
  refused in one line naming it (:class:`~qsync_opt.core.errors.OutputError`, exit code 2).

No link inside is ever followed: the one link the tool creates itself (``train``'s
``checkpoint.pt``) is replaced, never written through. Before any work, a command checks its
folder (:func:`check_folder`: a writable folder, or one it can make) and the names it will
write (:func:`check_names`), so a refusal throws no work away.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, TextIO

from qsync_opt.core.errors import OutputError, one_line

__all__ = ["append_text", "check_folder", "check_names", "ensure_folder", "list_names",
           "make_folder", "read_bytes", "remove", "replace_link", "swap_folder", "write",
           "write_bytes", "write_text"]

_DIR = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _refusal(root: Path, rel: str, why: str, what: str) -> OutputError:
    return OutputError(one_line(
        f"{what} {root}: {Path(root, rel)} {why}; nothing inside an output folder is "
        f"followed or written through: remove it, or use another {what}"))


def _kind(st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if stat.S_ISDIR(st.st_mode):
        return "is a folder"
    if stat.S_ISREG(st.st_mode):
        return "is a file"
    return "is not a regular file (a FIFO, socket or device)"


def _parts(root: Path, path: str | os.PathLike[str]) -> list[str]:
    """``path`` as components under ``root``: a relative ``path`` is relative to ``root``,
    an absolute one must lie (lexically) under it."""
    p = Path(path)
    if p.is_absolute():
        rel = os.path.relpath(os.path.abspath(p), os.path.abspath(root))
    else:
        rel = os.path.normpath(p)
    parts = [x for x in Path(rel).parts if x not in ("", ".")]
    if not parts or parts[0] == ".." or Path(rel).is_absolute():
        raise ValueError(f"{path}: not a path inside {root}")
    return parts


def _open_root(root: Path, what: str) -> int:
    """The folder given, followed if a link (FileNotFoundError: it does not exist)."""
    try:
        return os.open(root, _DIR)
    except FileNotFoundError:
        raise
    except NotADirectoryError:
        raise OutputError(one_line(f"{what} {root}: is a file, not a folder")) from None
    except OSError as exc:
        raise OutputError(one_line(f"{what} {root}: cannot open "
                                   f"({exc.strerror or exc.__class__.__name__})")) from None


def _open_sub(fd: int, name: str, create: bool, root: Path, rel: str, what: str) -> int:
    """Folder ``name`` in folder ``fd``, never through a link (created when ``create``)."""
    if create:
        try:
            os.mkdir(name, 0o777, dir_fd=fd)
        except FileExistsError:
            pass
        except OSError as exc:
            raise OutputError(one_line(f"{what} {root}: cannot create {Path(root, rel)} "
                                       f"({exc.strerror})")) from None
    try:
        return os.open(name, _DIR | _NOFOLLOW, dir_fd=fd)
    except OSError as exc:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            raise exc from None
        raise _refusal(root, rel, _kind(st), what) from None


@contextmanager
def _folder_of(root: str | os.PathLike[str], path: str | os.PathLike[str], what: str,
               create: bool) -> Iterator[tuple[int, str, str]]:
    """(descriptor of the folder holding ``path``'s last component, that name, ``path``
    relative to ``root``)."""
    root = Path(root)
    parts = _parts(root, path)
    if create:
        _make_root(root, what)
    fds = [_open_root(root, what)]
    try:
        for i, name in enumerate(parts[:-1]):
            fds.append(_open_sub(fds[-1], name, create, root, os.path.join(*parts[:i + 1]),
                                 what))
        yield fds[-1], parts[-1], os.path.join(*parts)
    finally:
        for fd in fds:
            os.close(fd)


def _lstat(fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def ensure_folder(root: str | os.PathLike[str], what: str = "--out") -> Path:
    """``root`` as an output folder: created with its parents when missing; refused (one
    line naming ``what``) when it is a file, a link to one, or not writable. Call it before
    any work whose result would go there."""
    root = _make_root(Path(root), what)
    fd = _open_root(root, what)
    try:  # writable? a probe file, created and removed (root ignores the mode bits)
        name = f".qsync-probe.{secrets.token_hex(4)}.tmp"
        try:
            os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600,
                             dir_fd=fd))
            os.unlink(name, dir_fd=fd)
        except OSError as exc:
            raise OutputError(one_line(f"{what} {root}: cannot write into it "
                                       f"({exc.strerror or exc.__class__.__name__})")) from None
    finally:
        os.close(fd)
    return root


def check_folder(root: str | os.PathLike[str], what: str = "--out") -> Path:
    """As :func:`ensure_folder`, but nothing is created: a missing ``root`` must be creatable
    (its nearest existing ancestor a folder this process may write into)."""
    root = Path(root)
    if root.exists() or root.is_symlink():
        if root.is_dir():
            return ensure_folder(root, what)  # exists: only the probe, nothing left
        _make_root(root, what)  # raises: a file, a link to one or to nothing
    up = root.parent
    while not up.exists() and up != up.parent and not up.is_symlink():
        up = up.parent
    if not up.is_dir():
        raise OutputError(one_line(f"{what} {root}: a part of the path is not a folder"))
    if not os.access(up, os.W_OK | os.X_OK):
        raise OutputError(one_line(f"{what} {root}: cannot create it in {up} "
                                   "(permission denied)"))
    return root


def _make_root(root: Path, what: str) -> Path:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        kind = ("a link to nothing" if root.is_symlink() and not root.exists() else
                "a link to a file" if root.is_symlink() else "a file")
        raise OutputError(one_line(f"{what} {root}: is {kind}, not a folder")) from None
    except NotADirectoryError:
        raise OutputError(one_line(f"{what} {root}: a part of the path is a file, not a "
                                   "folder")) from None
    except OSError as exc:
        raise OutputError(one_line(f"{what} {root}: cannot create "
                                   f"({exc.strerror or exc.__class__.__name__})")) from None
    if not root.is_dir():
        raise OutputError(one_line(f"{what} {root}: is a file, not a folder"))
    return root


def make_folder(root: str | os.PathLike[str], path: str | os.PathLike[str],
                what: str = "--out") -> Path:
    """Create folder ``path`` (relative to ``root`` or under it) and its parents inside
    ``root``; a link or a file on the way is refused."""
    with _folder_of(root, Path(path) / "x", what, create=True):
        pass
    return Path(root, *_parts(Path(root), path))


def write(root: str | os.PathLike[str], path: str | os.PathLike[str],
          fill: Callable[[BinaryIO], object], what: str = "--out") -> Path:
    """Write ``path`` inside ``root`` atomically: ``fill(fh)`` on a temporary file in its
    folder, fsync, rename over the name (folders on the way created). An existing link or
    non-regular file there is refused; an existing file keeps its mode."""
    with _folder_of(root, path, what, create=True) as (fd, name, rel):
        st = _lstat(fd, name)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise _refusal(Path(root), rel, _kind(st), what)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        tmp = f".{name[:200]}.{secrets.token_hex(4)}.tmp"
        try:
            tfd = os.open(tmp, flags, 0o666, dir_fd=fd)
        except OSError as exc:
            raise OutputError(one_line(f"{what}: cannot write {Path(root, rel)} "
                                       f"({exc.strerror})")) from None
        try:
            with os.fdopen(tfd, "wb") as fh:
                if st is not None:
                    os.fchmod(fh.fileno(), stat.S_IMODE(st.st_mode))
                fill(fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException as exc:
            try:
                os.unlink(tmp, dir_fd=fd)
            except OSError:
                pass
            if isinstance(exc, OSError) and not isinstance(exc, OutputError):
                raise OutputError(one_line(f"{what}: cannot write {Path(root, rel)} "
                                           f"({exc.strerror or exc.__class__.__name__})")
                                  ) from None
            raise
        try:
            os.fsync(fd)
        except OSError:
            pass
    return Path(root, rel)


def write_bytes(root: str | os.PathLike[str], path: str | os.PathLike[str], data: bytes,
                what: str = "--out") -> Path:
    return write(root, path, lambda fh: fh.write(data), what)


def write_text(root: str | os.PathLike[str], path: str | os.PathLike[str], text: str,
               what: str = "--out") -> Path:
    return write_bytes(root, path, text.encode("utf-8"), what)


def read_bytes(root: str | os.PathLike[str], path: str | os.PathLike[str],
               what: str = "--out") -> bytes | None:
    """The bytes of file ``path`` inside ``root`` (None: there is none); a link or a
    non-regular file on the way or there is refused."""
    try:
        with _folder_of(root, path, what, create=False) as (fd, name, rel):
            try:
                ffd = os.open(name, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0),
                              dir_fd=fd)
            except FileNotFoundError:
                return None
            except OSError:
                st = _lstat(fd, name)
                if st is None:
                    return None
                raise _refusal(Path(root), rel, _kind(st), what) from None
            with os.fdopen(ffd, "rb") as fh:
                st = os.fstat(fh.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise _refusal(Path(root), rel, _kind(st), what)
                return fh.read()
    except FileNotFoundError:
        return None


def append_text(root: str | os.PathLike[str], path: str | os.PathLike[str],
                what: str = "--out") -> TextIO:
    """``path`` inside ``root`` opened for appending text (created when missing); a link or
    a non-regular file there is refused, never opened."""
    with _folder_of(root, path, what, create=True) as (fd, name, rel):
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        try:
            ffd = os.open(name, flags | getattr(os, "O_NONBLOCK", 0), 0o666, dir_fd=fd)
        except OSError as exc:
            st = _lstat(fd, name)
            if st is not None and not stat.S_ISREG(st.st_mode):
                raise _refusal(Path(root), rel, _kind(st), what) from None
            raise OutputError(one_line(f"{what}: cannot write {Path(root, rel)} "
                                       f"({exc.strerror})")) from None
        st = os.fstat(ffd)
        if not stat.S_ISREG(st.st_mode):
            os.close(ffd)
            raise _refusal(Path(root), rel, _kind(st), what)
        os.set_blocking(ffd, True)
        return open(ffd, "a", encoding="utf-8")


def remove(root: str | os.PathLike[str], path: str | os.PathLike[str],
           what: str = "--out", *, links: bool = False) -> bool:
    """Delete file or folder ``path`` inside ``root`` (a folder with everything in it, by
    descriptor: nothing below is followed). A link there is refused, unless ``links`` (a
    link the tool made: removed, not followed). False: nothing was there."""
    try:
        with _folder_of(root, path, what, create=False) as (fd, name, rel):
            st = _lstat(fd, name)
            if st is None:
                return False
            if stat.S_ISLNK(st.st_mode) and not links:
                raise _refusal(Path(root), rel, _kind(st), what)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)
            return True
    except FileNotFoundError:
        return False


def list_names(root: str | os.PathLike[str], path: str | os.PathLike[str] | None = None,
               what: str = "--out") -> list[tuple[str, os.stat_result]]:
    """The entries of folder ``path`` inside ``root`` (``root`` itself when None) with their
    ``lstat``; [] when it does not exist. A link on the way is refused."""
    root = Path(root)
    try:
        if path is None:
            fd = _open_root(root, what)
            try:
                return [(n, os.stat(n, dir_fd=fd, follow_symlinks=False))
                        for n in sorted(os.listdir(fd))]
            finally:
                os.close(fd)
        with _folder_of(root, Path(path) / "x", what, create=False) as (fd, _name, _rel):
            return [(n, os.stat(n, dir_fd=fd, follow_symlinks=False))
                    for n in sorted(os.listdir(fd))]
    except FileNotFoundError:
        return []


def check_names(root: str | os.PathLike[str], files: Iterable[str] = (),
                folders: Iterable[str] = (), what: str = "--out") -> None:
    """Before a command writes into ``root``: each of ``files`` that exists must be a
    regular file, each of ``folders`` a real folder whose whole tree holds no link and
    nothing but folders and regular files. Refused in one line naming the first that is
    not."""
    root = Path(root)
    for rel in files:
        try:
            with _folder_of(root, rel, what, create=False) as (fd, name, r):
                st = _lstat(fd, name)
                if st is not None and not stat.S_ISREG(st.st_mode):
                    raise _refusal(root, r, _kind(st), what)
        except FileNotFoundError:
            continue
    for rel in folders:
        _check_tree(root, rel, what)


def _check_tree(root: Path, rel: str, what: str) -> None:
    try:
        with _folder_of(root, Path(rel) / "x", what, create=False) as (fd, _n, _r):
            stack = [(os.dup(fd), rel)]
    except FileNotFoundError:
        return
    while stack:
        fd, here = stack.pop()
        try:
            for name in sorted(os.listdir(fd)):
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                sub = os.path.join(here, name)
                if stat.S_ISDIR(st.st_mode):
                    stack.append((os.open(name, _DIR | _NOFOLLOW, dir_fd=fd), sub))
                elif not stat.S_ISREG(st.st_mode):
                    for other, _ in stack:
                        os.close(other)
                    stack.clear()
                    raise _refusal(root, sub, _kind(st), what)
        finally:
            os.close(fd)


def replace_link(root: str | os.PathLike[str], path: str | os.PathLike[str], target: str,
                 what: str = "--out") -> bool:
    """Make ``path`` inside ``root`` a link to ``target`` (relative), replacing a link there
    (never following it); a regular file or folder there is left alone (False)."""
    with _folder_of(root, path, what, create=True) as (fd, name, _rel):
        st = _lstat(fd, name)
        if st is not None and not stat.S_ISLNK(st.st_mode):
            return False
        tmp = f".{name}.{secrets.token_hex(4)}.tmp"
        try:
            os.symlink(target, tmp, dir_fd=fd)
            os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError:
            try:
                os.unlink(tmp, dir_fd=fd)
            except OSError:
                pass
            return False
    return True


def swap_folder(root: str | os.PathLike[str], new: str, name: str,
                what: str = "--out") -> None:
    """Folder ``new`` (at the top of ``root``) takes the place of folder ``name``, which is
    then deleted whole: renames and deletes by descriptor, a link at ``name`` refused."""
    with _folder_of(root, name, what, create=False) as (fd, last, rel):
        st = _lstat(fd, last)
        aside = None
        if st is not None:
            if not stat.S_ISDIR(st.st_mode):
                raise _refusal(Path(root), rel, _kind(st), what)
            aside = f".{last}.{secrets.token_hex(4)}.old.tmp"
            os.rename(last, aside, src_dir_fd=fd, dst_dir_fd=fd)
        try:
            os.rename(new, last, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException:
            if aside is not None:
                os.rename(aside, last, src_dir_fd=fd, dst_dir_fd=fd)
            raise
        if aside is not None:
            shutil.rmtree(aside, dir_fd=fd)
        os.fsync(fd)
