"""benchmarks/code_shape.py: every count on a small tree made to sit on each side of its
limit, and the script's output (text and JSON) on this repository."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO, load_benchmark

CS = load_benchmark("code_shape")


def _lines(n: int, prefix: str = "x") -> str:
    return "".join(f"{prefix}{i} = {i}\n" for i in range(n))


def _function(name: str, span: int) -> str:
    """A function whose ``def`` to last line spans ``span`` lines."""
    return f"def {name}():\n" + "".join(f"    {name}_{i} = {i}\n" for i in range(span - 1))


IMPORTS = '''\
import json
from typing import Any
import typing


class K:
    import os  # a class body is no function

    def method(self, a: Any, b: list[Any], *args: Any, **kwargs: typing.Any) -> Any:
        import re
        if a:
            from matplotlib import pyplot
        try:
            import ns3
        except ImportError:
            pass

        def inner(c: "Any", d: int) -> None:
            from ..cuda import kernels
            from torch.utils import cpp_extension
            import transformers.models

        return inner


def free(e: Any = None) -> None:
    from . import sibling
'''

BLOCK = "".join(f"value_{i} = compute({i}, 'a')\n" for i in range(6))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    lib = tmp_path / "qsync_opt"
    (lib / "sub").mkdir(parents=True)
    (tmp_path / "solvers").mkdir()
    (tmp_path / "docs").mkdir()
    (lib / "long.py").write_text(_lines(701, "long"))
    (lib / "edge.py").write_text(_lines(700, "edge"))
    (tmp_path / "solvers" / "funcs.py").write_text(
        _function("at_80", 80) + _function("at_81", 81) + _function("at_101", 101)
        + "class C:\n" + "".join("    " + ln + "\n"
                                 for ln in _function("method_90", 90).splitlines()))
    (lib / "sub" / "imports.py").write_text(IMPORTS)
    (tmp_path / "README.md").write_text("a\nb\nc\n")
    (tmp_path / "docs" / "BENCHMARKS.md").write_text("one line\n")
    # a block of six lines in two places (one of them in tests/), a block of five in two
    (tmp_path / "tests").mkdir()
    (lib / "copy_a.py").write_text("# a\n" + BLOCK + "other = 1\n")
    (tmp_path / "tests" / "copy_b.py").write_text("import os\n\n" + BLOCK)
    five = "".join(f"short_{i} = run({i})\n" for i in range(5))
    (lib / "five_a.py").write_text(five)
    (lib / "five_b.py").write_text(five)
    return tmp_path


def test_each_count_on_both_sides_of_its_limit(tree: Path) -> None:
    shape = CS.measure(tree, use_tool=False)
    assert shape.modules_over_700 == 1 and shape.long_modules == ["qsync_opt/long.py 701"]
    assert shape.functions_over_80 == 3 and shape.functions_over_100 == 1
    assert [f.split()[1:] for f in shape.long_functions] == [
        ["at_101", "101"], ["C.method_90", "90"], ["at_81", "81"]]
    # re, matplotlib, ns3, kernels, cpp_extension, transformers, sibling: not json/typing at
    # the top of the module, nor os in a class body
    assert shape.function_imports == 7
    assert shape.imports_by_module == {"qsync_opt/sub/imports.py": 7}
    assert shape.function_imports_optional == 5
    # a, *args, **kwargs, "Any", e; not list[Any], not the return
    assert shape.any_parameters == 5
    assert (shape.readme_lines, shape.benchmarks_doc_lines) == (3, 1)
    assert shape.duplicate_pairs is None
    assert shape.duplicate_pairs_window_hash == 1


def test_a_block_in_too_many_places_and_a_repeating_run_are_not_copies(tmp_path: Path) -> None:
    lib = tmp_path / "models"
    lib.mkdir()
    for i in range(9):
        (lib / f"m{i}.py").write_text(BLOCK)
    (lib / "rep.py").write_text("step(1)\nstep(2)\n" * 5)
    assert CS.window_hash_pairs(tmp_path) == 0
    (lib / "m8.py").unlink()  # eight places: every two of them a pair
    assert CS.window_hash_pairs(tmp_path) == 8 * 7 // 2


def test_a_missing_readme_counts_zero_lines(tmp_path: Path) -> None:
    (tmp_path / "cuda").mkdir()
    shape = CS.measure(tmp_path, use_tool=False)
    assert (shape.readme_lines, shape.library_modules, shape.modules_over_700) == (0, 0, 0)


def test_the_script_on_this_repository(capsys: pytest.CaptureFixture[str]) -> None:
    assert CS.main(["--no-tool", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["long_functions"]) == data["functions_over_80"]
    assert len(data["long_modules"]) == data["modules_over_700"]
    assert sum(data["imports_by_module"].values()) == data["function_imports"]
    assert sum(data["any_by_module"].values()) == data["any_parameters"]
    assert data["readme_lines"] == len((REPO / "README.md").read_text().splitlines())
    assert data["library_modules"] > 100 and data["duplicate_pairs"] is None

    text = CS.render(CS.Shape(**data), with_lists=True)
    counts = dict(line.split(": ", 1) for line in text.split("\n\n")[0].splitlines())
    assert list(counts) == list(CS.COUNTS)
    assert counts == {k: "null" if data[k] is None else str(data[k]) for k in CS.COUNTS}
    assert f"long_functions ({data['functions_over_80']}):" in text
    assert "function_imports_by_module (" in text and "any_parameters_by_module (" in text


def test_a_repo_that_is_no_folder_is_refused(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert CS.main(["--repo", str(tmp_path / "missing"), "--no-tool"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
