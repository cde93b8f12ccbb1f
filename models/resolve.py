"""A workload named by a string: a registry name (a built-in) or a user's ``path/file.py:fn``
(:mod:`qsync_opt.models.user`); either way a :class:`~qsync_opt.models.Workload`."""

from __future__ import annotations

import torch
from qsync_opt.models import Workload, get_workload
from qsync_opt.models.user import UserWorkload
from qsync_opt.models.user import load_user_workload as _load
from torch import nn

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.modelspec import is_user_model, model_file_sha256

__all__ = ["is_user_model", "load_user_model", "load_user_workload", "model_file_sha256",
           "resolve_workload"]


def load_user_workload(spec: str, *, sha256: str | None = None) -> UserWorkload:
    """``path/file.py:fn`` as a :class:`~qsync_opt.models.user.UserWorkload` (this RUNS the
    file; with ``sha256`` its content must have that hash, checked before it runs)."""
    return _load(spec, sha256)


def load_user_model(spec: str, *, sha256: str | None = None
                    ) -> tuple[nn.Module, tuple[torch.Tensor, ...] | dict[str, torch.Tensor]]:
    """Import ``path/file.py:fn`` (this RUNS the file) and call ``fn()``, which returns
    ``(module, example_inputs)``: the module and its inputs (a tuple of positional tensors,
    or a dict of keyword tensors). With ``sha256``, the file must have that content hash,
    checked before it runs."""
    wl = load_user_workload(spec, sha256=sha256)
    ex = wl.example
    return wl.model, ((ex,) if isinstance(ex, torch.Tensor) else ex)


def resolve_workload(name: str, *, sha256: str | None = None) -> Workload:
    """A registry name, or ``path.py:fn`` for a user's model (imported: it runs), as a
    :class:`Workload` (a built-in, or a :class:`~qsync_opt.models.user.UserWorkload`)."""
    if is_user_model(name):
        return load_user_workload(name, sha256=sha256)
    try:
        return get_workload(name)
    except (KeyError, ValueError) as exc:
        raise QsyncInputError(f"model: {exc.args[0] if exc.args else exc}") from None
