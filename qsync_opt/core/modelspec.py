"""What the planner knows of a workload before importing any model code (so torch): whether
a ``--model`` spec names a user's file (:func:`is_user_model`), that file's path and
content hash, read without running it (:func:`model_file_path`, :func:`model_file_sha256`),
and the digest of the package's own sources that the caches of built-in workloads are keyed
on (:func:`package_code_digest`)."""

from __future__ import annotations

import functools
import hashlib
import stat
import sys
from importlib import util
from pathlib import Path

from qsync_opt.core.errors import QsyncInputError

__all__ = ["MAX_MODEL_FILE_BYTES", "is_user_model", "model_file_path", "model_file_sha256",
           "package_code_digest", "read_model_file"]

#: A model file larger than this is refused unread (source, not weights).
MAX_MODEL_FILE_BYTES = 64 << 20


def is_user_model(spec: str) -> bool:
    """True when ``spec`` names a user's Python file (``path/file.py:fn``), which importing
    runs; anything else is a registry name (qsync-opt models), which runs only our code."""
    path_s, sep, fn_name = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
    return bool(sep) and path_s.endswith(".py")


def _one_line(text: str) -> str:
    return text if text.isprintable() else repr(text)


def model_file_path(spec: str) -> tuple[Path, str]:
    """The file and the function a ``path/file.py:fn`` spec names: the file a regular one
    of at most :data:`MAX_MODEL_FILE_BYTES` (refused in one line otherwise); nothing is read
    or run."""
    path_s, _, fn_name = spec.rpartition(":")
    if not path_s or not fn_name:
        raise QsyncInputError(f"model: {spec!r} is not PATH.py:FUNCTION")
    path = Path(path_s)
    try:
        exists = path.exists()
        regular = path.is_file() and stat.S_ISREG(path.stat().st_mode)
    except (OSError, ValueError):  # a name too long, a NUL byte, a link loop
        exists = regular = False
    if not exists:
        raise QsyncInputError(f"model: file {_one_line(str(path))} not found")
    if not regular:  # a FIFO would block the read, /dev/zero never end it
        raise QsyncInputError(f"model: {_one_line(str(path))} is not a regular file (a "
                              f"folder, device, FIFO or socket, or a link to one)")
    if path.stat().st_size > MAX_MODEL_FILE_BYTES:
        raise QsyncInputError(f"model: {_one_line(str(path))} is larger than "
                              f"{MAX_MODEL_FILE_BYTES >> 20} MiB: not a model file")
    return path, fn_name


def read_model_file(path: Path) -> bytes:
    """The model file's bytes (its read refused in one line)."""
    try:
        return path.read_bytes()
    except OSError as exc:
        raise QsyncInputError(f"model: cannot read {_one_line(str(path))} "
                              f"({exc.__class__.__name__})") from None


def model_file_sha256(spec: str) -> str:
    """sha256 (hex) of the file a ``path/file.py:fn`` spec names; reading it runs nothing."""
    path, _ = model_file_path(spec)
    return hashlib.sha256(read_model_file(path)).hexdigest()


def _models_folder() -> Path:
    """The folder of the built-in models (``qsync_opt.models``), found without importing
    it (importing it imports torch)."""
    spec = util.find_spec("qsync_opt.models")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        raise ImportError("qsync_opt.models is not installed")
    return Path(folders[0])


@functools.lru_cache(maxsize=1)
def package_code_digest() -> str:
    """sha256 (hex, 16 digits) over every Python source of the installed package and its
    built-in models (relative path and content, in sorted order): any change of the tracer,
    the annotator or a model's code gives another digest. Read once per process."""
    roots = [Path(sys.modules["qsync_opt"].__file__ or ".").parent, _models_folder()]
    h = hashlib.sha256()
    for i, root in enumerate(roots):
        for path in sorted(root.rglob("*.py")):
            h.update(f"{i}:{path.relative_to(root).as_posix()}\0".encode())
            h.update(path.read_bytes())
            h.update(b"\0")
    return h.hexdigest()[:16]
