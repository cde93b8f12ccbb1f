"""benchmarks/bench_cli_plan.py: the commands it times, its table, its refusals, and one
short end-to-end run against a baseline."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("qsync_bench_cli_plan",
                                                  REPO / "benchmarks" / "bench_cli_plan.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["qsync_bench_cli_plan"] = module
    spec.loader.exec_module(module)
    return module


B = _bench()


def test_the_cases_are_the_three_commands_of_the_figure(tmp_path) -> None:
    got = B.cases("resnet50", "v100x16+t4x16", "highs", tmp_path)
    assert list(got) == ["solve", "joint split", "pareto"]
    assert got["joint split"][:1] == ["solve"] and "--joint-split" in got["joint split"]
    assert got["pareto"][0] == "pareto" and "--png" in got["pareto"]


def test_the_table_gives_medians_and_the_joint_split_ratio() -> None:
    t = {("this", "solve"): B.Timing([1.0, 3.0, 2.0], [1.0, 1.0, 1.0], 9.0),
         ("this", "joint split"): B.Timing([4.0, 4.0, 4.0], [3.0, 3.0, 3.0], 5.0)}
    lines = B.table(t, {"this": "x"}, 3)
    assert any(ln.split()[:4] == ["this", "solve", "2.00", "1.00"] for ln in lines)
    assert any("joint split / solve: 2.00x wall, 3.00x cpu" in ln for ln in lines)


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--baseline", "/nonexistent/qsync-opt"],
                                  ["--exe", "/nonexistent"]])
def test_bad_arguments_are_refused(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        B.main(argv)
    assert exc.value.code == 2 and "Traceback" not in capsys.readouterr().err


@pytest.mark.slow
def test_a_short_run_against_a_baseline(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    exe = str(Path(sys.executable).parent / "qsync-opt")
    assert B.main(["--repeats", "1", "--model", "digits_cnn", "--cluster", "cpux2",
                   "--only", "solve", "--baseline", exe]) == 0
    out = capsys.readouterr().out
    assert "load before" in out and "load after" in out
    assert [ln.split()[:2] for ln in out.splitlines() if " solve " in f" {ln} "
            and ln.split()[0] in ("this", "baseline")] == [["this", "solve"],
                                                           ["baseline", "solve"]]
