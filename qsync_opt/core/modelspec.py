"""What the planner knows of a workload before importing any model code (so torch): whether
a ``--model`` spec names a user's file (:func:`is_user_model`), and the digest of the
package's own sources that the caches of built-in workloads are keyed on
(:func:`package_code_digest`)."""

from __future__ import annotations

import functools
import hashlib
import sys
from importlib import util
from pathlib import Path

__all__ = ["is_user_model", "package_code_digest"]


def is_user_model(spec: str) -> bool:
    """True when ``spec`` names a user's Python file (``path/file.py:fn``), which importing
    runs; anything else is a registry name (qsync-opt models), which runs only our code."""
    path_s, sep, fn_name = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
    return bool(sep) and path_s.endswith(".py")


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
