"""Test utilities for the ops: run on one CPU implementation, and check integer-GEMM layouts.

- :func:`use_backend` runs the block on the C++ kernels (``"cpp"``; skips the calling test
  when they are not built) or on the Python references (``"python"``).
- :func:`strict_int_mm` makes ``torch._int_mm`` refuse operands whose strides give no valid
  leading dimension, the layouts oneDNN's s8 GEMM (behind ``torch._int_mm`` on AVX512-VNNI
  CPUs) misreads, and records the shapes of every call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch

from qsync_opt.ops import backends, load_cpu

__all__ = ["BACKENDS", "strict_int_mm", "use_backend"]

#: The two CPU implementations every op has.
BACKENDS = ("cpp", "python")


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the block on ``name``: ``"cpp"`` (pytest.skip when not built) or ``"python"``."""
    if name == "cpp":
        ok, why = load_cpu()
        if not ok:
            import pytest

            pytest.skip(f"C++ kernels not built: {why}")
        yield
        return
    if name != "python":
        raise ValueError(f"backend: expected one of {BACKENDS}, got {name!r}")
    with mock.patch.object(backends, "use_cpp", lambda t: False):
        yield


def valid_leading_dim(t: torch.Tensor) -> bool:
    """Whether a 2-D operand has a leading dimension oneDNN reads correctly: row-major when
    stride(1) == 1 (leading dimension stride(0)), transposed otherwise (stride(1))."""
    rows, cols = t.shape
    s0, s1 = t.stride()
    return s0 >= max(1, cols) if s1 == 1 else s0 == 1 and s1 >= max(1, rows)


@contextlib.contextmanager
def strict_int_mm() -> Iterator[list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """``torch._int_mm`` asserting valid leading dimensions; yields the calls' shapes."""
    real = torch._int_mm
    calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def checked(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        for name, t in (("a", a), ("b", b)):
            assert valid_leading_dim(t), (f"{name} {tuple(t.shape)} strides {t.stride()}: "
                                          "no valid leading dim")
        calls.append((tuple(a.shape), tuple(b.shape)))
        return real(a, b)

    with mock.patch.object(torch, "_int_mm", checked):
        yield calls
