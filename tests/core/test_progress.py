"""qsync_opt.core.progress: a bar only once its step has run its delay, only when enabled."""

from __future__ import annotations

import io

import pytest

from qsync_opt.core.progress import Progress


def test_disabled_bar_writes_nothing():
    out = io.StringIO()
    with Progress("x", total=3, enabled=False, delay_s=0, stream=out) as bar:
        for _ in range(3):
            bar.advance()
    assert out.getvalue() == ""


def test_short_step_writes_nothing():
    out = io.StringIO()
    with Progress("x", total=3, enabled=True, delay_s=3600, stream=out) as bar:
        bar.advance()
    assert out.getvalue() == ""


def test_bar_draws_counts_and_ends_its_line():
    out = io.StringIO()
    with Progress("joint split", total=4, enabled=True, delay_s=0, stream=out) as bar:
        bar.update(2, note="1 solved")
        bar.update(4)
    text = out.getvalue()
    assert text.startswith("\rjoint split: [")
    assert "2/4" in text and "4/4" in text and "1 solved" in text
    assert text.endswith("\n") and text.count("\n") == 1


def test_count_without_total():
    bar = Progress("scan", enabled=True, delay_s=0, stream=io.StringIO())
    bar.update(7)
    assert bar.line().startswith("scan: 7 ")


# -----------------------------------------------------------------------------
# a run whose output is not a terminal (nohup, a batch scheduler) writes a line every so often


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_log_line_every_interval_and_none_between():
    from qsync_opt.core.progress import ProgressLog

    out, clock = io.StringIO(), _Clock()
    log = ProgressLog("train", 1000, 30.0, stream=out, clock=clock)
    for step in range(1, 101):
        clock.t += 1.0  # one step a second
        log.update(step, 2.5)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 == log.lines  # at 30, 60 and 90 s
    assert lines[0] == "train: step 30/1000, loss 2.5000, 1 steps/s, 16m 10s left"
    assert lines[2] == "train: step 90/1000, loss 2.5000, 1 steps/s, 15m 10s left"


def test_a_resumed_run_counts_its_own_steps_and_a_bad_loss_is_said():
    from qsync_opt.core.progress import ProgressLog

    out, clock = io.StringIO(), _Clock()
    log = ProgressLog("train", 100, 10.0, start=40, stream=out, clock=clock)
    clock.t += 10.0
    log.update(60, float("nan"))  # 20 steps in 10 s since the resume at 40
    assert out.getvalue() == "train: step 60/100, loss not finite, 2 steps/s, 20s left\n"


def test_interval_zero_writes_nothing():
    from qsync_opt.core.progress import ProgressLog

    out, clock = io.StringIO(), _Clock()
    log = ProgressLog("train", 10, 0.0, stream=out, clock=clock)
    for step in range(10):
        clock.t += 1e6
        log.update(step, 1.0)
    assert out.getvalue() == ""


def test_durations_read_as_a_person_writes_them():
    from qsync_opt.core.progress import duration

    assert [duration(x) for x in (0, 42.4, 245, 3600 * 3 + 7 * 60, float("inf"), -5)] == \
        ["0s", "42s", "4m 05s", "3h 07m", "unknown", "0s"]


def test_the_default_interval_is_stated_in_the_help_and_the_config():
    from qsync_opt.cli import build_parser
    from qsync_opt.core.progress import LOG_EVERY_S
    from qsync_opt.runtime.config import TrainConfig

    assert LOG_EVERY_S == 30.0
    assert TrainConfig.model_fields["progress_every_s"].default == LOG_EVERY_S
    sub = next(a for a in build_parser()._actions if hasattr(a, "choices")
               and isinstance(a.choices, dict))
    flag = sub.choices["train"]._option_string_actions["--progress-every"]
    assert flag.default == LOG_EVERY_S and "default 30" in (flag.help or "")


def test_step_progress_draws_a_bar_on_a_terminal_and_lines_elsewhere(capsys):
    from qsync_opt.runtime.metrics import StepProgress

    StepProgress(2, 1e-9, tty=True).update(2, 1.0)
    err = capsys.readouterr().err
    assert err.startswith("\r[") and "2/2 loss 1.0000" in err
    p = StepProgress(2, 1e-9, tty=False)
    p.update(1, 1.0)
    assert capsys.readouterr().err.startswith("train: step 1/2, loss 1.0000, ")
    StepProgress(2, 1e-9, tty=False, report=False).update(1, 1.0)  # not rank 0
    assert capsys.readouterr().err == ""


def _train(tmp_path, capsys, *extra):
    from qsync_opt.cli import main

    rc = main(["train", "--model", "digits_cnn", "--emulate-dp", "--steps", "3", "--batch",
               "16", "--out", str(tmp_path / "o"), "--no-resume", *extra])
    return rc, capsys.readouterr().err


def test_a_run_into_a_pipe_prints_progress_lines(tmp_path, capsys, runtime_quiet):
    """stderr is not a terminal here (captured), as under nohup or a batch scheduler (the
    torchrun case, a real pipe: tests/pipeline/test_pipetrain.py's slow test): with a short interval
    every step writes its line; with 0, none."""
    import sys

    assert not sys.stderr.isatty()
    rc, err = _train(tmp_path, capsys, "--progress-every", "0.000001")
    assert rc == 0, err
    lines = [x for x in err.splitlines() if x.startswith("train: step ")]
    assert [x.split(",")[0] for x in lines] == [f"train: step {k}/3" for k in (1, 2, 3)]
    assert all(" steps/s, " in x and x.endswith(" left") for x in lines)
    rc, err = _train(tmp_path, capsys, "--progress-every", "0")
    assert rc == 0 and "train: step" not in err, err


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "1e9", "86401", "٣", "²", "1e", "",
                                   "0x10", "true"])
def test_a_bad_progress_interval_is_one_line(tmp_path, capsys, value):
    from qsync_opt.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["train", "--model", "digits_cnn", "--out", str(tmp_path / "o"), "--dry-run",
              f"--progress-every={value}"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    assert "--progress-every: expected seconds from 0 (none) to 86400" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), 1e12, True])
def test_the_config_refuses_a_bad_interval_naming_the_flag(tmp_path, value):
    from pydantic import ValidationError

    from qsync_opt.runtime.config import TrainConfig

    with pytest.raises(ValidationError, match="--progress-every"):
        TrainConfig(workload="digits_cnn", plan_path="p", rank_groups=["cpu"], steps=1,
                    out_dir=str(tmp_path), progress_every_s=value)
