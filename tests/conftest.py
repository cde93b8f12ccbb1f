"""Shared fixtures: traced graphs are computed once per session (tracing is meta-only).

Under ``CI=true`` (the CI runner and ``.ci/run`` set it) nothing native may be missing
silently: ``QSYNC_REQUIRE_CPP=1`` is set here, before any test module loads the ops, so a
C++ build that fails raises in every test (and every rank a test starts) that reaches the
kernels instead of the Python references serving, and tests/ops/test_cuda.py fails where nvcc is
missing or the CUDA kernels do not load.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import GLOO_STEPS

from qsync_opt import ModelGraph, trace

REPO = Path(__file__).resolve().parents[1]

if os.environ.get("CI") == "true":
    os.environ.setdefault("QSYNC_REQUIRE_CPP", "1")


#: The cyclic garbage collector's thresholds for the test process (Python's: 700, 10, 10).
#: The process holds a large heap (torch, the documents, traced graphs), which every older-
#: generation pass walks: at the default thresholds about 10,000 passes took 15% of the
#: tests' CPU. Cycles are still collected, after 50,000 allocations instead of 700.
GC_THRESHOLDS = (50_000, 20, 100)


def pytest_configure(config: pytest.Config) -> None:
    gc.set_threshold(*GC_THRESHOLDS)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        # A worker of a parallel run (make test): the workers share the cores, so each runs
        # torch on its share; at torch's default (one thread per core) N workers would run
        # N threads per core, and OpenMP's waiting threads spin on cores another worker needs.
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


if importlib.util.find_spec("xdist") is not None:  # pytest-xdist: `make setup` installs it

    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        """Under ``--dist loadgroup`` (the Makefile's): one unit per test file or
        ``xdist_group``, heaviest first (tests/support/schedule.py)."""
        if config.getvalue("dist") != "loadgroup":
            return None
        from support.schedule import FileOrGroupScheduling

        return FileOrGroupScheduling(config, log)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection built (the test modules, their parameters) lives to the end: moved
    out of the collector's reach, so that no later pass walks it again."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _fresh_part_memo() -> None:
    """Each test starts with no part solved before (solvers.memo's memo is per process)."""
    from qsync_opt.solvers.memo import clear_part_memo

    clear_part_memo()


@contextlib.contextmanager
def _fixed_cpu() -> Iterator[Any]:
    from qsync_opt.costs import devices
    from qsync_opt.documents.io import load
    from qsync_opt.documents.schemas import DeviceSpec

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
    import io

    from qsync_opt.cli import main

    out = tmp_path_factory.mktemp("demo_part_2")
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["demo", "--no-local", "--method", "random", "--out", str(out)])
    return code, stdout.getvalue(), stderr.getvalue(), out


@pytest.fixture(scope="session")
def digits_mixed_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A digits_cnn plan for groups "cpu" (fp32, batch 48) and "cpu_2" (conv1 bf16, conv2
    int8 with stochastic rounding, fc1 fp16 with loss scaling; batch 16), written directly, so
    the runtime under test does not depend on what a solver picks."""
    from qsync_opt import parse_shorthand
    from qsync_opt.problem.plan import make_plan

    path = tmp_path_factory.mktemp("plan") / "mixed.json"
    make_plan(trace("digits_cnn"), parse_shorthand("cpux1@48+cpux1@16"),
              {"cpu_2": {"conv1": "bf16", "conv2": "int8", "fc1": "fp16"}}).save(path)
    return path


@pytest.fixture(scope="session")
def gloo_straight(digits_mixed_plan: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of one uninterrupted `qsync-opt train` of :func:`digits_mixed_plan` on two
    gloo ranks (torchrun, one rank per group): GLOO_STEPS steps, a checkpoint every 2 steps,
    state hashes logged. Made once for the session: the runs that are killed and resumed,
    and the ranks' agreement, are all checked against it."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("gloo") / "straight"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), QSYNC_LOG_STATE_HASH="1")
    env.pop("QSYNC_LAUNCHER_PID", None)
    cmd = [sys.executable, "-m", "qsync_opt.cli", "train", "--model", "digits_cnn",
           "--plan", str(digits_mixed_plan), "--nproc", "2", "--rank-groups", "0:cpu,1:cpu_2",
           "--steps", str(GLOO_STEPS), "--out", str(out), "--backend", "gloo",
           "--timeout", "300", "--checkpoint-every", "2"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One torch thread for the test, as the ranks run (OMP_NUM_THREADS=1): the same kernels,
    so sums reduce in the same order and an int8 or 4-bit rounding cannot flip; the number
    before is restored. A module takes it with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
