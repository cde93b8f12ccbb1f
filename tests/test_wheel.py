"""The wheel holds the product: no test code (helpers, harnesses, the torch-native copies of
third-party model patterns live in tests/support/) and no unpickling anywhere in the package.

The sources are scanned here (fast); tests/test_layout.py's ``test_wheel_contents`` applies
the same rules to the files of a built wheel.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support.product import PACKAGE_SOURCES, find_test_code, find_unpickling

ROOT = Path(__file__).resolve().parents[1]


def _package_modules() -> list[tuple[str, str]]:
    out = []
    for folder in PACKAGE_SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" not in path.parts:
                out.append((path.relative_to(ROOT).as_posix(), path.read_text()))
    return out


def test_the_package_holds_no_test_code() -> None:
    modules = _package_modules()
    assert len(modules) > 100  # the scan saw the package
    found = [r for path, src in modules for r in find_test_code(path, src)]
    assert not found, "test code in the package (move it to tests/support/): " + "; ".join(found)


def test_the_package_never_unpickles() -> None:
    found = [r for path, src in _package_modules() for r in find_unpickling(path, src)]
    assert not found, "unpickling in the package: " + "; ".join(found)


def test_the_test_helpers_live_under_tests() -> None:
    """What moved out of the package is importable from tests/support/, and gone from it."""
    import importlib.util

    for name in ("support.harness", "support.ops_backends", "support.patterns",
                 "support.pipeline_jobs"):
        assert importlib.util.find_spec(name) is not None, name
    for name in ("qsync_opt.testing", "qsync_opt.ops.testing", "qsync_opt.models.patterns"):
        assert importlib.util.find_spec(name) is None, name
    import qsync_opt.pipeline.dist as pipedist

    assert not hasattr(pipedist, "run_stage_job") and not hasattr(pipedist, "job_result")


@pytest.mark.parametrize("path, source", [
    ("qsync_opt/testing.py", "x = 1\n"),
    ("qsync_opt/ops/test_ops.py", "x = 1\n"),
    ("qsync_opt/conftest.py", "x = 1\n"),
    ("qsync_opt/support/things.py", "x = 1\n"),
    ("qsync_opt/tests/things.py", "x = 1\n"),
    ("qsync_opt/util.py", "import pytest\n"),
    ("qsync_opt/util.py", "def f():\n    from unittest import mock\n"),
    ("qsync_opt/util.py", "import unittest.mock as m\n"),
    ("qsync_opt/util.py", "from hypothesis import given\n"),
])
def test_test_code_is_seen(path: str, source: str) -> None:
    assert find_test_code(path, source)


@pytest.mark.parametrize("path, source", [
    ("qsync_opt/testbed.py", "x = 1\n"),
    ("qsync_opt/problem/plan.py", "from .testing_tools import x\n"),
    ("qsync_opt/problem/plan.py", "from . import pytest_like\n"),
])
def test_product_code_is_not_test_code(path: str, source: str) -> None:
    assert not find_test_code(path, source)


@pytest.mark.parametrize("source", [
    "import pickle\npickle.loads(b)\n",
    "import pickle\npickle.load(fh)\n",
    "import pickle\npickle.Unpickler(fh).load()\n",
    "import marshal\nmarshal.loads(b)\n",
    "import shelve\nshelve.open('f')\n",
    "torch.load(fh)\n",
    "torch.load(fh, weights_only=False)\n",
    "torch.load(fh, map_location='cpu', weights_only=flag)\n",
    "dist.all_gather_object(out, mine)\n",
    "torch.distributed.gather_object(mine, out)\n",
    "dist.broadcast_object_list(xs)\n",
    "dist.recv_object_list(xs, src=0)\n",
    "np.load('x.npy', allow_pickle=True)\n",
    "numpy.load('x.npy', allow_pickle=flag)\n",
    "import pandas as pd\npd.read_pickle('x')\n",
])
def test_unpickling_is_seen(source: str) -> None:
    assert find_unpickling("m.py", source)


@pytest.mark.parametrize("source", [
    "torch.load(fh, map_location='cpu', weights_only=True)\n",
    "import pickle\ntry:\n    f()\nexcept pickle.UnpicklingError:\n    pass\n",
    "np.load('x.npy')\n",
    "np.load('x.npy', allow_pickle=False)\n",
    "json.loads(text)\n",
    "dist.all_gather(out, t)\n",
    "torch.save(state, fh)\n",
])
def test_safe_reads_are_not_unpickling(source: str) -> None:
    assert not find_unpickling("m.py", source)


@pytest.mark.slow
def test_plain_values_are_gathered_as_json() -> None:
    """The pipeline's stages share their summaries through ``all_gather_json`` instead of
    ``all_gather_object``: every rank's value comes back in rank order, of any length (the
    empty one too), non-ASCII text, NaN and infinities kept, tuples as lists."""
    import json
    import math

    from qsync_opt.profile.gloo import spawn_local
    from support.gather_job import gather_job

    values = [{"rank": 0, "shapes": {"conv2": (8, 4, 3, 3)}, "evals": ([1.5, math.nan], 7)},
              {},
              {"rank": 2, "mix": {"int8": 3}, "name": "über ✓", "loss": -math.inf,
               "long": list(range(5000))}]
    got = json.loads(spawn_local(gather_job, len(values), values, timeout_s=300))
    assert json.dumps(got) == json.dumps(values)
    assert got[0]["shapes"]["conv2"] == [8, 4, 3, 3] and math.isnan(got[0]["evals"][0][1])
