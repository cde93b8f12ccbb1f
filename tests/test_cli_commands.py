"""The CLI package's seams: commands grouped by family, the indicator methods from one list,
``python -m qsync_opt.cli``, and the table output of ``indicate``."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from qsync_opt import __version__
from qsync_opt.cli import build_parser, main
from qsync_opt.errors import QsyncInputError
from qsync_opt.indicator import METHODS, check_method


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", ["indicate", "solve", "compare", "pareto", "demo"])
def test_every_method_flag_offers_the_indicator_methods(command: str) -> None:
    """``--method`` of every command that computes an indicator offers exactly
    ``indicator.METHODS``, the first of them by default."""
    sub = _subcommands(build_parser())[command]
    flag = sub._option_string_actions["--method"]
    assert tuple(flag.choices or ()) == METHODS
    assert flag.default == METHODS[0] == "qsync"


def test_an_unknown_method_is_refused_naming_the_list(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    with pytest.raises(QsyncInputError, match="method: expected one of qsync, wvar, hessian"):
        check_method("nope")
    with pytest.raises(SystemExit) as exc:
        main(["indicate", "--model", "digits_cnn", "--method", "nope"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid choice: 'nope'" in err


def test_indicate_prints_its_tables(capsys: pytest.CaptureFixture[str]) -> None:
    """The table output of ``indicate`` (its own variable ``table`` once shadowed the
    table formatter)."""
    code = main(["indicate", "--model", "digits_cnn", "--method", "random", "--batches", "1",
                 "--no-cache", "--top", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "indicator random of digits_cnn" in out
    assert "most sensitive (by int8):" in out and "least sensitive:" in out
    most = out.split("most sensitive (by int8):\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert most[0].split()[:2] == ["op", "int8"] and len(most) == 2 + 2  # header, rule, 2 rows


def test_python_m_runs_the_cli() -> None:
    """``python -m qsync_opt.cli`` (the training launcher and the demo run it) is the
    ``qsync-opt`` command."""
    res = subprocess.run([sys.executable, "-m", "qsync_opt.cli", "--version"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"qsync-opt {__version__}"


def test_the_commands_are_the_families_functions() -> None:
    """Each subcommand runs its family module's function (re-exported by ``qsync_opt.cli``,
    whose attribute the parser reads when it is built)."""
    import qsync_opt.cli as cli
    from qsync_opt.cli import demo, info, model, planning

    subs = _subcommands(build_parser())
    expected = {"models": info.cmd_models, "devices": info.cmd_devices,
                "schema": info.cmd_schema, "graph": model.cmd_graph,
                "estimate": model.cmd_estimate, "replay": model.cmd_replay,
                "indicate": model.cmd_indicate, "solve": planning.cmd_solve,
                "compare": planning.cmd_compare, "pareto": planning.cmd_pareto,
                "demo": demo.cmd_demo}
    for name, fn in expected.items():
        assert subs[name].get_default("fn") is fn, name
        assert getattr(cli, fn.__name__) is fn
