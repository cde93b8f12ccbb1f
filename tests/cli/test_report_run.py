"""``qsync-opt report --run DIR``: the run's story printed, as JSON and drawn; every bad
input (the folder, links planted in it, the figure's path, flags of a plan's report beside
--run) one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qsync_opt.cli import main
from qsync_opt.runtime.events import EVENTS_NAME
from support.run_story import leave_and_return, write_rows


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's refusal
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def _refused(rc: int, err: str) -> None:
    assert rc == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err


def test_the_story_is_printed(tmp_path, capsys):
    run = leave_and_return(tmp_path / "run")
    rc, out, err = _run(["report", "--run", str(run)], capsys)
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith(f"run {run}: steps 0..49; 3 period(s), 2 membership change(s)")
    assert ("steps lost: 3 (3 at the change of step 20); 0 beyond the last checkpoint "
            "(step 50)") in lines
    assert "stopped at step 50: done; checkpoint ckpt/step-00000050" in lines


def test_the_story_as_json_and_drawn(tmp_path, capsys):
    run = leave_and_return(tmp_path / "run")
    png = tmp_path / "figs" / "story.png"
    rc, out, err = _run(["report", "--run", str(run), "--json", "--png", str(png)], capsys)
    assert rc == 0 and err == f"wrote {png}\n"
    doc = json.loads(out)
    assert doc["lost_steps"] == 3 and doc["png"] == str(png) and doc["end_step"] == 50
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_an_ordinary_run_folder_reports_one_period(tmp_path, capsys):
    write_rows(tmp_path, 0, "cpu", range(5), lambda s: (2.0, 1.0))
    rc, out, _ = _run(["report", "--run", str(tmp_path)], capsys)
    assert rc == 0
    assert "  steps 0..4          metrics    world 1   groups cpu; predicted - ms/step" in out
    assert "no stop recorded: the run was killed, or is still running" in out


@pytest.mark.parametrize("extra,needle", [
    (["--plan", "p.json"], "argument --plan: not allowed with argument --run"),
    (["--costs", "c.json"], "--costs: not allowed with --run"),
    (["--graph", "g.json"], "--graph: not allowed with --run"),
    (["--model", "m.py:f"], "--model: not allowed with --run"),
])
def test_a_plan_report_flag_beside_run_is_refused(tmp_path, capsys, extra, needle):
    run = leave_and_return(tmp_path / "run")
    rc, out, err = _run(["report", "--run", str(run), *extra], capsys)
    _refused(rc, err)
    assert needle in err and out == ""


def test_neither_plan_nor_run_is_refused(capsys):
    rc, _, err = _run(["report"], capsys)
    _refused(rc, err)
    assert "one of the arguments --plan --run is required" in err


def _hostile(tmp_path: Path, case: str) -> tuple[Path, Path | None]:
    """(the --run folder, the --png path or None) of a hostile case."""
    run = tmp_path / "run"
    if case == "missing":
        return run, None
    if case == "file":
        run.write_text("x")
        return run, None
    if case == "empty":
        run.mkdir()
        return run, None
    leave_and_return(run)
    if case in ("events-link", "metrics-link"):
        name = EVENTS_NAME if case == "events-link" else "metrics.rank0.jsonl"
        (run / name).unlink()
        os.symlink(tmp_path / "elsewhere", run / name)
        return run, None
    if case == "png-folder":
        (tmp_path / "fig.png").mkdir()
    elif case == "png-link":
        os.symlink(tmp_path / "victim.png", tmp_path / "fig.png")
    elif case == "png-through-file":
        (tmp_path / "afile").write_text("x")
        return run, tmp_path / "afile" / "fig.png"
    return run, tmp_path / "fig.png"


@pytest.mark.parametrize("case,needle", [
    ("missing", "no such folder"), ("file", "is a file, not a folder"),
    ("empty", "no events.jsonl and no metrics row"),
    ("events-link", "events.jsonl is a symbolic link"),
    ("metrics-link", "metrics.rank0.jsonl is a symbolic link"),
    ("png-folder", "Is a directory"), ("png-link", "is a symbolic link"),
    ("png-through-file", "Not a directory"),
])
def test_hostile_inputs_are_one_line_exit_2(tmp_path, capsys, case, needle):
    run, png = _hostile(tmp_path, case)
    argv = ["report", "--run", str(run)] + (["--png", str(png)] if png else [])
    rc, out, err = _run(argv, capsys)
    _refused(rc, err)
    assert needle in err and out == ""
    assert not (tmp_path / "victim.png").exists()  # a planted link is never written through


def test_the_story_imports_no_torch(tmp_path):
    """A run's story is read on a machine without torch (a laptop given the run's folder)."""
    run = leave_and_return(tmp_path / "run")
    code = ("import sys; sys.modules['torch'] = None\n"
            "from qsync_opt.cli import main\n"
            f"sys.exit(main(['report', '--run', {str(run)!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "steps lost: 3" in done.stdout


@pytest.mark.slow
def test_a_real_train_folder_tells_its_story(tmp_path, capsys):
    """An ordinary ``train`` run (no events.jsonl): one period from its metrics, its
    checkpoint set on disk, its summary."""
    out = tmp_path / "o"
    rc, _, err = _run(["train", "--model", "digits_cnn", "--steps", "4", "--checkpoint-every",
                       "2", "--out", str(out)], capsys)
    assert rc == 0, err
    rc, text, err = _run(["report", "--run", str(out)], capsys)
    assert rc == 0 and err == ""
    lines = text.splitlines()
    assert lines[0] == (f"run {out}: steps 0..3; 1 period(s), 0 membership change(s), "
                        "0 re-plan(s); 4 metrics row(s) in 1 rank file(s)")
    assert lines[-2:] == ["steps lost: 0; 0 beyond the last checkpoint (step 4)",
                          "finished: summary.json says 4 step(s) (no stop event)"]
