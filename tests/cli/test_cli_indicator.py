"""The indicator behind solve/compare/pareto: cached for a user's file by its sha256 and the
indicator's settings, one line saying what was computed and how long (or the cache),
progress off a terminal, and ops without a value pinned fp32 with the reason printed."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from qsync_opt import indicator as ind
from support.harness import run_cli

_FILE = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.rare = nn.Linear(8, 8)

    def forward(self, x):
        if {branch}:  # the example's batch (3) takes the branch; the indicator's (2) does not
            x = self.rare(x)
        return self.b(torch.relu(self.a(x)))


def build():
    torch.manual_seed(0)
    return Net(), torch.randn(3, 8)
'''


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    from qsync_opt.indicator import default_cache_dir

    return default_cache_dir()  # under the error model's version folder


def _file(tmp_path: Path, branch: str = "x.shape[0] == 3", name: str = "net.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(_FILE.format(branch=branch)))
    return f"{path}:build"


def _solve(spec: str, out: Path, *extra: str) -> tuple[int, str, str]:
    return run_cli("solve", "--model", spec, "--cluster", "cpux2", "--out", str(out),
                   "--indicator-batches", "1", "--indicator-batch", "2", "--solver", "highs",
                   *extra)


def test_solve_caches_a_user_files_indicator_by_its_hash_and_says_so(tmp_path, cache) -> None:
    spec = _file(tmp_path, branch="False")
    code, out, err = _solve(spec, tmp_path / "p.json")
    assert code == 0, err
    said = [ln for ln in out.splitlines() if ln.startswith("indicator qsync: computed")]
    assert len(said) == 1 and " s (" in said[0] and "cached in" in said[0]
    assert len(list(cache.glob("user-build-*.json"))) == 1
    code, out, err = _solve(spec, tmp_path / "p2.json")
    assert code == 0, err
    assert "indicator qsync: from the cache" in out and "computed on" not in out + err
    # the same content at another path: the same cache entry
    other = tmp_path / "elsewhere"
    other.mkdir()
    spec2 = _file(other, branch="False")
    code, out, err = _solve(spec2, tmp_path / "p3.json")
    assert code == 0 and "from the cache" in out
    # other settings or other content: computed again
    code, out, err = _solve(spec, tmp_path / "p4.json", "--method", "wvar")
    assert code == 0 and "indicator wvar: computed" in out
    spec3 = _file(tmp_path, branch="x.shape[0] == 99")
    code, out, err = _solve(spec3, tmp_path / "p5.json")
    assert code == 0 and "indicator qsync: computed" in out
    assert len(list(cache.glob("user-build-*.json"))) == 3


def test_solve_json_keeps_stdout_clean(tmp_path, cache) -> None:
    code, out, err = _solve(_file(tmp_path, branch="False"), tmp_path / "p.json", "--json")
    assert code == 0, err
    json.loads(out)
    assert "indicator qsync: computed" in err


def test_an_op_without_a_value_is_pinned_and_solve_says_why(tmp_path, cache) -> None:
    spec = _file(tmp_path)
    code, out, err = _solve(spec, tmp_path / "p.json")
    assert code == 0, err
    assert "indicator qsync: rare pinned fp32 (no indicator value: not in the model's graph at" \
        in out
    plan = json.loads((tmp_path / "p.json").read_text())
    assert all(g["precisions"]["rare"] == "fp32" for g in plan["groups"].values())
    # a cached table keeps its unmeasured ops, so they are pinned again
    code, out, err = _solve(spec, tmp_path / "p2.json")
    assert code == 0 and "from the cache" in out and "rare pinned fp32" in out


@pytest.mark.parametrize("method", ["qsync", "random"])  # random: refused after it ran
def test_a_refusal_starts_with_the_error_not_the_indicators_lines(tmp_path, cache,
                                                                   method) -> None:
    code, out, err = _solve(_file(tmp_path, branch="False"), tmp_path / "p.json",
                            "--target-ms", "1e-9", "--method", method)
    assert code == 3 and err.startswith("qsync-opt: error: ") and "no plan" in err.splitlines()[0], err  # 3: infeasible
    assert "indicator" not in out and "computed" not in err
    assert not (tmp_path / "p.json").exists()


def test_indicate_says_what_it_computed(tmp_path, cache) -> None:
    code, out, err = run_cli("indicate", "--model", "digits_cnn", "--batches", "1",
                             "--batch", "4")
    assert code == 0, err
    assert "indicator qsync: computed on this CPU in" in err
    code, out, err = run_cli("indicate", "--model", "digits_cnn", "--batches", "1",
                             "--batch", "4")
    assert code == 0 and "indicator qsync: from the cache" in err


def test_progress_off_a_terminal_is_a_plain_line(monkeypatch, capsys) -> None:
    monkeypatch.setattr(ind.compute, "PROGRESS_EVERY_S", 0.0)
    tick = ind.compute.IndicatorProgress(True, "qsync", 4)
    tick.tty = False
    for i in range(1, 5):
        tick(i)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and len(lines) == 3  # not after the last batch: the summary says it
    assert lines[0].startswith("indicator qsync: batch 1/4,") and "left" in lines[0]
    off = ind.compute.IndicatorProgress(False, "qsync", 4)
    off(1)
    assert capsys.readouterr().err == ""
