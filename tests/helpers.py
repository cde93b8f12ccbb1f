"""Helpers the tests share (importable as ``helpers``: pyproject puts tests/ on the path)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]

#: The steps of the session's uninterrupted two-rank run (conftest's ``gloo_straight``).
GLOO_STEPS = 6


def load_benchmark(name: str) -> ModuleType:
    """The script ``benchmarks/<name>.py`` as a module (``qsync_<name>``), loaded once:
    a later call returns the module already loaded."""
    module_name = f"qsync_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name,
                                                  REPO / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up here
    spec.loader.exec_module(module)
    return module
