"""The suite's tiers read from the test files (no import, no collection): which test functions
carry the ``slow`` mark. tests/test_suite_tiers.py holds the rules about the tiers;
tests/support/schedule.py weighs the work units of a parallel run with it."""

from __future__ import annotations

import ast
from pathlib import Path


def is_slow_marker(node: ast.expr) -> bool:
    """``pytest.mark.slow`` (or ``mark.slow``), called or not."""
    if isinstance(node, ast.Call):
        node = node.func
    return isinstance(node, ast.Attribute) and node.attr == "slow"


def module_is_slow(tree: ast.Module) -> bool:
    """Whether the module's ``pytestmark`` holds the slow mark."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, ast.List | ast.Tuple) else [
                node.value]
            if any(is_slow_marker(v) for v in values):
                return True
    return False


def has_slow_parameters(node: ast.FunctionDef) -> bool:
    """Whether one of the test's ``pytest.param(..., marks=...)`` carries the slow mark."""
    for call in ast.walk(node):
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "param"):
            for kw in call.keywords:
                marks = kw.value.elts if isinstance(kw.value, ast.List | ast.Tuple) else [
                    kw.value]
                if kw.arg == "marks" and any(is_slow_marker(m) for m in marks):
                    return True
    return False


def slow_by_test(path: Path, parameters: bool = False) -> dict[str, bool]:
    """Every test function of one file and whether it is in the slow tier (with
    ``parameters``: also when one of its parameters is)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    whole = module_is_slow(tree)
    return {node.name: (whole or any(is_slow_marker(d) for d in node.decorator_list)
                        or (parameters and any(has_slow_parameters(d)
                                               for d in node.decorator_list)))
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test")}


def fast_tests(path: Path) -> list[str]:
    """The test functions of one file that the fast tier runs (no ``slow`` mark)."""
    return [name for name, slow in slow_by_test(path).items() if not slow]
