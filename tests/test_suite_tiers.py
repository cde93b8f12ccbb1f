"""The two tiers of the suite: ``make test`` runs every test, ``make test-fast`` every test not
marked ``slow``, and the fast tier keeps tests of every package (every folder of tests/)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from helpers import REPO

TESTS = REPO / "tests"


def _is_slow_marker(node: ast.expr) -> bool:
    """``pytest.mark.slow`` (or ``mark.slow``), called or not."""
    if isinstance(node, ast.Call):
        node = node.func
    return isinstance(node, ast.Attribute) and node.attr == "slow"


def _module_is_slow(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, ast.List | ast.Tuple) else [
                node.value]
            if any(_is_slow_marker(v) for v in values):
                return True
    return False


def fast_tests(path: Path) -> list[str]:
    """The test functions of one file that the fast tier runs (no ``slow`` mark)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if _module_is_slow(tree):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            if not any(_is_slow_marker(d) for d in node.decorator_list):
                found.append(node.name)
    return found


def test_the_marker_reader() -> None:
    source = ("import pytest\n@pytest.mark.slow\ndef test_a(): pass\n"
              "@pytest.mark.parametrize('x', [1])\ndef test_b(x): pass\n"
              "class TestC:\n    @pytest.mark.slow()\n    def test_d(self): pass\n")
    tree = ast.parse(source)
    assert not _module_is_slow(tree)
    names = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
             and not any(_is_slow_marker(d) for d in n.decorator_list)]
    assert names == ["test_b"]
    assert _module_is_slow(ast.parse("import pytest\npytestmark = [pytest.mark.slow]\n"))
    assert _module_is_slow(ast.parse("import pytest\npytestmark = pytest.mark.slow\n"))


def test_the_fast_tier_covers_every_folder_of_tests() -> None:
    folders = sorted({p.parent for p in TESTS.rglob("test_*.py")})
    assert folders, "no test files found"
    empty = [f.relative_to(REPO).as_posix() for f in folders
             if not any(fast_tests(p) for p in f.glob("test_*.py"))]
    assert empty == [], f"folders with no test outside the slow tier: {empty}"


def test_the_makefile_targets_are_the_two_tiers() -> None:
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    targets = dict(re.findall(r"^([\w-]+):[^\n]*\n((?:\t[^\n]*\n)+)", text, re.MULTILINE))
    assert re.search(r"-m pytest(\s|$)(?!.*-m )", targets["test"]), targets["test"]
    assert '-m pytest -m "not slow"' in targets["test-fast"], targets["test-fast"]
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'markers = \[[^\]]*"slow: ', pyproject)
