"""The two tiers of the suite: ``make test`` runs every test, ``make test-fast`` every test not
marked ``slow``, and the fast tier keeps tests of every package (every folder of tests/)."""

from __future__ import annotations

import ast
import re

from helpers import REPO

from support.tiers import fast_tests
from support.tiers import is_slow_marker as _is_slow_marker
from support.tiers import module_is_slow as _module_is_slow

TESTS = REPO / "tests"


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


#: The session-scoped fixtures of tests/conftest.py that make one run for the whole session
#: (a two-rank training run, the demo's planning part): their tests form one unit of a
#: parallel run (tests/support/schedule.py), so that the run is made by one worker only.
SESSION_RUNS = ("gloo_straight", "demo_part_2")


def _xdist_groups(node: ast.FunctionDef) -> set[str]:
    groups = set()
    for d in node.decorator_list:
        if (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
                and d.func.attr == "xdist_group" and d.args
                and isinstance(d.args[0], ast.Constant)):
            groups.add(str(d.args[0].value))
    return groups


def test_the_tests_of_a_session_run_are_one_unit_of_a_parallel_run() -> None:
    users: dict[str, list[str]] = {name: [] for name in SESSION_RUNS}
    wrong = []
    for path in sorted(TESTS.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test")):
                continue
            for name in {a.arg for a in node.args.args} & set(SESSION_RUNS):
                users[name].append(node.name)
                if _xdist_groups(node) != {name}:
                    wrong.append(f"{path.relative_to(REPO)}::{node.name}")
    assert all(users.values()), users  # the reader saw each fixture's tests
    assert wrong == [], f"add @pytest.mark.xdist_group(<the fixture>) to: {wrong}"


def test_a_parallel_run_hands_out_files_and_groups_heaviest_first(tmp_path) -> None:
    from support.schedule import SLOW_WEIGHT, function_of, unit_of, weight_of

    assert unit_of("tests/a/test_x.py::test_f[1-2]") == "tests/a/test_x.py"
    assert unit_of("tests/a/test_x.py::TestC::test_f") == "tests/a/test_x.py"
    assert unit_of("tests/a/test_x.py::test_f[1]@gloo_straight") == "group:gloo_straight"
    assert unit_of("tests/a/test_x.py::test_f[a@b]") == "tests/a/test_x.py"  # a parameter
    assert function_of("tests/a/test_x.py::TestC::test_f[a@b]@g") == ("tests/a/test_x.py",
                                                                       "test_f")
    (tmp_path / "test_w.py").write_text(
        "import pytest\n@pytest.mark.slow\ndef test_slow(): pass\ndef test_fast(): pass\n"
        "@pytest.mark.parametrize('x', [pytest.param(1, marks=pytest.mark.slow)])\n"
        "def test_slow_param(x): pass\n"
        "@pytest.mark.parametrize('x', [pytest.param(1, marks=[pytest.mark.skip])])\n"
        "def test_other_param(x): pass\n")
    ids = ["test_w.py::test_slow[1]", "test_w.py::test_slow[2]@g", "test_w.py::test_fast",
           "test_w.py::test_slow_param[1]", "test_w.py::test_other_param[1]"]
    assert weight_of(tmp_path, ids) == 3 * SLOW_WEIGHT + 2


def test_the_makefile_runs_the_tiers_on_parallel_workers() -> None:
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    parallel = re.search(r"^PARALLEL := (.*)$", text, re.MULTILINE)
    assert parallel and "-n $(TEST_WORKERS)" in parallel[1] and "--dist loadgroup" in parallel[1]
    targets = dict(re.findall(r"^([\w-]+):[^\n]*\n((?:\t[^\n]*\n)+)", text, re.MULTILINE))
    for target in ("test", "test-fast"):
        assert "$(PARALLEL)" in targets[target], target
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'"pytest-xdist==[\d.]+"', pyproject)  # pinned: a fresh clone gets it
