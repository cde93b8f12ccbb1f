"""Shared fixtures: traced graphs are computed once per session (tracing is meta-only).

Under ``CI=true`` (the CI runner and ``.ci/run`` set it) nothing native may be missing
silently: ``QSYNC_REQUIRE_CPP=1`` is set here, before any test module loads the ops, so a
C++ build that fails raises in every test (and every rank a test starts) that reaches the
kernels instead of the Python references serving, and tests/test_cuda.py fails where nvcc is
missing or the CUDA kernels do not load.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qsync_opt import ModelGraph, trace

REPO = Path(__file__).resolve().parents[1]

if os.environ.get("CI") == "true":
    os.environ.setdefault("QSYNC_REQUIRE_CPP", "1")


@pytest.fixture(autouse=True)
def _fresh_part_memo() -> None:
    """Each test starts with no part solved before (solvers.common's memo is per process)."""
    from qsync_opt.solvers.common import clear_part_memo

    clear_part_memo()


@contextlib.contextmanager
def _fixed_cpu() -> Iterator[Any]:
    from qsync_opt import devices
    from qsync_opt.io import load
    from qsync_opt.schemas import DeviceSpec

    spec = load(REPO / "tests" / "golden" / "input.cpu.DeviceSpec.json", DeviceSpec)
    mp = pytest.MonkeyPatch()
    mp.setattr(devices, "measure_cpu", lambda: spec)
    devices._derived_cpu.cache_clear()  # cpu/2 is derived from the (now fixed) cpu
    try:
        yield spec
    finally:
        mp.undo()
        devices._derived_cpu.cache_clear()


@pytest.fixture
def fixed_cpu() -> Iterator[Any]:
    """The ``cpu`` device with fixed figures (``golden/input.cpu.DeviceSpec.json``) for a
    test whose outcome hangs on the CPU's speeds: the real one is measured on this machine
    (matmul rates, MemAvailable), so it differs between machines and between runs."""
    with _fixed_cpu() as spec:
        yield spec


@pytest.fixture(scope="module")
def fixed_cpu_module() -> Iterator[Any]:
    """:func:`fixed_cpu` for a whole module."""
    with _fixed_cpu() as spec:
        yield spec


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def resnet50_graph() -> ModelGraph:
    return trace("resnet50")


@pytest.fixture(scope="session")
def bert_graph() -> ModelGraph:
    return trace("bert_base")


@pytest.fixture(scope="session")
def digits_graph() -> ModelGraph:
    return trace("digits_cnn")


@pytest.fixture(scope="session")
def demo_part_2(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, str, Path]:
    """``qsync-opt demo --no-local --method random`` run once for the session (part 2, the
    planning showcase, on the random indicator): (exit code, stdout, stderr, its --out)."""
    from qsync_opt.testing import run_cli

    out = tmp_path_factory.mktemp("demo_part_2")
    code, stdout, stderr = run_cli("demo", "--no-local", "--method", "random", "--out", str(out))
    return code, stdout, stderr, out


@pytest.fixture
def runtime_quiet(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """For training-run tests: no fault variable set (the plans are handed in) and one
    torch thread (the runs are tiny, and the machine is shared)."""
    import torch

    from qsync_opt.runtime.faults import ENV

    for var in ENV.values():
        monkeypatch.delenv(var, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
