"""The command line without torch: ``qsync-opt --help`` and every command's ``--help``
import no torch, and a solve whose traced graph and indicator table are cached (the second
run of the same command) completes without importing torch, its output and plan the same as
the first run's. Each run is a fresh interpreter (the test process itself has torch)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qsync_opt.cli import COMMANDS, build_parser

#: Runs ``qsync_opt.cli.main(argv)``, then says on the last line of stderr whether torch
#: was imported; ``QSYNC_BLOCK_TORCH=1`` makes any import of torch fail loudly instead.
RUNNER = """
import json, os, sys
if os.environ.get("QSYNC_BLOCK_TORCH") == "1":
    sys.modules["torch"] = None
from qsync_opt.cli import main
try:
    rc = main(json.loads(sys.argv[1]))
except SystemExit as exc:
    rc = exc.code
sys.stdout.flush()
sys.stderr.write("\\nTORCH " + str("torch" in sys.modules and sys.modules["torch"] is not None)
                 + "\\n")
sys.exit(rc)
"""


def _run(argv: list[str], cache: Path, cwd: Path, block: bool = False
         ) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, XDG_CACHE_HOME=str(cache), OMP_NUM_THREADS="1",
               QSYNC_BLOCK_TORCH="1" if block else "0")
    return subprocess.run([sys.executable, "-c", RUNNER, json.dumps(argv)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def _torch_imported(p: subprocess.CompletedProcess[str]) -> bool:
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("TORCH "), p.stderr[-2000:]
    return last == "TORCH True"


def _timeless(text: str) -> str:
    """``text`` without what differs run to run: durations, the file written, and where the
    indicator came from (computed by the first run, read from the cache by the next)."""
    return "\n".join(re.sub(r"[0-9.]+ s\b", "T s", line) for line in text.splitlines()
                     if not line.startswith(("wrote ", "indicator ")))


def _command_names() -> list[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return list(sub.choices)  # type: ignore[union-attr]


def test_every_command_registers_its_parser() -> None:
    assert len(_command_names()) == len(COMMANDS)


#: Runs ``--help`` of each command named in ``sys.argv[1]`` (None: ``qsync-opt --help``) in
#: turn, in one fresh interpreter, and prints one JSON line per command: its exit code,
#: whether its usage was printed, and whether torch had been imported by then. Torch, once
#: imported, stays: the first command that imports it is the one whose line says so first.
HELP_RUNNER = """
import contextlib, io, json, sys
from qsync_opt.cli import main
for command in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            rc = main(["--help"] if command is None else [command, "--help"])
        except SystemExit as exc:
            rc = exc.code
    print(json.dumps([command, rc, "usage: qsync-opt" in out.getvalue(),
                      "torch" in sys.modules]), flush=True)
"""


@pytest.fixture(scope="module")
def help_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str | None, list[object]]:
    """Every command's ``--help`` (and the bare one), in one fresh interpreter."""
    tmp = tmp_path_factory.mktemp("help")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp / "cache"), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", HELP_RUNNER,
                        json.dumps([None, *_command_names()])], cwd=tmp, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return {c: rest for c, *rest in map(json.loads, p.stdout.splitlines())}


@pytest.mark.parametrize("command", [None, *_command_names()])
def test_help_imports_no_torch(command: str | None,
                               help_runs: dict[str | None, list[object]]) -> None:
    rc, usage, torch_imported = help_runs[command]
    assert rc == 0
    assert usage  # "usage: qsync-opt" on stdout
    assert not torch_imported  # nor by any command's --help before it


@pytest.mark.slow
@pytest.mark.parametrize("batch", [None, "16"])
def test_a_warm_solve_imports_no_torch(batch: str | None, tmp_path: Path) -> None:
    """Cold, the solve traces and measures (torch); warm, at the default batch (read from
    the cache's record of it) or a given one, it reads both caches and imports no torch,
    even when any import of torch would fail; the output and the plan are the first run's."""
    cache = tmp_path / "cache"
    argv = ["solve", "--model", "digits_cnn", "--cluster", "v100x1+t4x1", "--solver", "highs",
            "--indicator-batches", "2"] + (["--batch", batch] if batch else [])
    first = _run([*argv, "--out", "p1.json"], cache, tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert _torch_imported(first)  # traced and measured
    warm = _run([*argv, "--out", "p2.json"], cache, tmp_path)
    assert warm.returncode == 0, warm.stderr[-2000:]
    assert not _torch_imported(warm)
    blocked = _run([*argv, "--out", "p3.json"], cache, tmp_path, block=True)
    assert blocked.returncode == 0, blocked.stderr[-2000:]
    assert warm.stdout.count("indicator qsync: from the cache") == 1
    assert _timeless(warm.stdout) == _timeless(first.stdout) == _timeless(blocked.stdout)
    plans = [(tmp_path / f"p{i}.json").read_bytes() for i in (1, 2, 3)]
    assert plans[0] == plans[1] == plans[2]


@pytest.mark.slow
def test_a_broken_default_batch_record_is_traced_again(tmp_path: Path) -> None:
    """A default-batch record that is not a positive integer, or holds another key, is not
    used: the command traces (so imports torch) and its output is the same."""
    cache = tmp_path / "cache"
    argv = ["graph", "--model", "digits_cnn"]
    first = _run(argv, cache, tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    records = list((cache / "qsync-opt" / "graphs").glob("*-bdefault-*.json"))
    assert len(records) == 1
    stored = json.loads(records[0].read_text())
    for bad in (0, -3, True, "64", 1.5, None):
        records[0].write_text(json.dumps({**stored, "default_batch": bad}))
        again = _run(argv, cache, tmp_path)
        assert again.returncode == 0, again.stderr[-2000:]
        assert _torch_imported(again), bad
        assert _timeless(again.stdout) == _timeless(first.stdout)
        records = list((cache / "qsync-opt" / "graphs").glob("*-bdefault-*.json"))
        assert json.loads(records[0].read_text())["default_batch"] == stored["default_batch"]
    records[0].write_text(json.dumps({**stored, "key": {**stored["key"], "workload": "x"}}))
    again = _run(argv, cache, tmp_path)
    assert again.returncode == 0 and _timeless(again.stdout) == _timeless(first.stdout)
    assert _torch_imported(again)
    warm = _run(argv, cache, tmp_path)
    assert _timeless(warm.stdout) == _timeless(first.stdout) and not _torch_imported(warm)


def test_the_parsers_constants_match_their_modules() -> None:
    """train's and sweep's parsers state the launcher's and the sweep's description and
    limits without importing them."""
    from qsync_opt.cli.parsers import sweep as cli_sweep
    from qsync_opt.cli.parsers import train as cli_train
    from qsync_opt.hfta import sweep
    from qsync_opt.job import launch

    assert (launch.__doc__ or "").split("\n\n")[0] == cli_train.DESCRIPTION
    assert (sweep.__doc__ or "").split("\n\n")[0] == cli_sweep.DESCRIPTION
    assert launch.MAX_RANKS == cli_train.MAX_RANKS


#: The commands' bodies and what they import at their top (the solve pipeline, the solver
#: registry, torch): building the parser must import none of them.
BODIES = ("qsync_opt.cli.info", "qsync_opt.cli.workloads", "qsync_opt.cli.model",
          "qsync_opt.cli.planning", "qsync_opt.cli.netsim", "qsync_opt.cli.report",
          "qsync_opt.cli.train", "qsync_opt.cli.sweep", "qsync_opt.cli.profile",
          "qsync_opt.cli.demo", "qsync_opt.cli.walkthrough", "qsync_opt.planner.solve",
          "qsync_opt.solvers.backends", "numpy", "torch")


def test_building_the_parser_imports_no_command_body(tmp_path: Path) -> None:
    """``qsync-opt --help`` builds every command's parser; each names its body by module
    (Deferred), so no body, and nothing a body imports at its top, is imported."""
    code = ("import json, sys\nfrom qsync_opt.cli import build_parser\nbuild_parser()\n"
            f"print(json.dumps([m for m in {list(BODIES)!r} if m in sys.modules]))")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout) == []


def test_every_command_names_a_body_it_runs() -> None:
    """Every subcommand's default ``fn`` is a Deferred naming a function of a module of
    ``qsync_opt.cli`` that exists (a renamed body fails here, not when a user runs it)."""
    from qsync_opt.cli.args import Deferred

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name, parser in sub.choices.items():  # type: ignore[union-attr]
        fn = parser.get_default("fn")
        assert isinstance(fn, Deferred), name
        assert fn.module in BODIES and fn.module.startswith("qsync_opt.cli."), name
        assert callable(fn.resolve()), name


@pytest.mark.parametrize("argv", [
    ["replay", "--model", "digits_cnn", "--cluster", "cpux2", "--pipeline-stages", "2",
     "--compress-act", "gzip"],
    ["replay", "--model", "digits_cnn", "--cluster", "cpux2", "--pipeline-stages", "2",
     "--compress-grad", "quant:9"],
    ["train", "--model", "digits_cnn", "--pipeline-stages", "2", "--compress-act", "topk:0"],
    ["train", "--model", "digits_cnn", "--pipeline-stages", "2", "--compress-grad", "topk:x"],
])
def test_a_bad_compressor_flag_is_refused_without_torch(argv: list[str], tmp_path: Path
                                                        ) -> None:
    """A compressor's text is checked when the command line is parsed, without the codecs
    (which import torch): one line, exit 2, and the run never started."""
    p = _run(argv, tmp_path / "cache", tmp_path, block=True)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "--compress-" in p.stderr and "Traceback" not in p.stderr
    assert not _torch_imported(p)


def test_a_plan_against_another_model_file_is_refused_without_torch(tmp_path: Path) -> None:
    """A plan made from a model file, replayed with another file: the file's sha256 is
    read (never run) and compared before anything imports torch."""
    golden = json.loads((Path(__file__).resolve().parents[1] / "golden" /
                         "digits_cnn-highs.json").read_text())["plan"]
    (tmp_path / "m.py").write_text("raise SystemExit('this file must never run')\n")
    plan = {**golden, "workload": "m.py:build", "workload_sha256": "0" * 64}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    p = _run(["replay", "--plan", "plan.json", "--model", "m.py:build"], tmp_path / "cache",
             tmp_path, block=True)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "not the file the plan was made from" in p.stderr and "nothing was run" in p.stderr
    assert not _torch_imported(p)
