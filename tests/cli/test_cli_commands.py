"""The CLI package's seams: commands grouped by family, the indicator methods from one list,
``python -m qsync_opt.cli``, and the table output of ``indicate``."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from qsync_opt import __version__
from qsync_opt.cli import build_parser, main
from qsync_opt.core.errors import QsyncInputError
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


@pytest.mark.slow
def test_python_m_runs_the_cli() -> None:
    """``python -m qsync_opt.cli`` (the training launcher and the demo run it) is the
    ``qsync-opt`` command."""
    res = subprocess.run([sys.executable, "-m", "qsync_opt.cli", "--version"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"qsync-opt {__version__}"


def test_the_commands_are_the_families_functions() -> None:
    """Each subcommand runs its family module's function (re-exported by ``qsync_opt.cli``),
    named by the parser without importing it (:class:`~qsync_opt.cli.args.Deferred`)."""
    import qsync_opt.cli as cli
    from qsync_opt.cli import demo, info, model, planning, workloads
    from qsync_opt.cli.args import Deferred

    subs = _subcommands(build_parser())
    expected = {"models": workloads.cmd_models, "devices": info.cmd_devices,
                "schema": info.cmd_schema, "graph": model.cmd_graph,
                "estimate": model.cmd_estimate, "replay": model.cmd_replay,
                "indicate": model.cmd_indicate, "solve": planning.cmd_solve,
                "compare": planning.cmd_compare, "pareto": planning.cmd_pareto,
                "demo": demo.cmd_demo}
    for name, fn in expected.items():
        deferred = subs[name].get_default("fn")
        assert isinstance(deferred, Deferred), name
        assert deferred.resolve() is fn, name
        assert getattr(cli, fn.__name__) is fn


# ------------------------------------------ every flag's help lists the keys it takes


def _help_of(command: str, flag: str) -> str:
    """The help text of ``flag`` of ``command``, with every space removed (argparse wraps)."""
    sub = _subcommands(build_parser())[command]
    text = sub._option_string_actions[flag].help or ""
    return "".join(text.split())


def _commands_with(flag: str) -> list[str]:
    return sorted(name for name, sub in _subcommands(build_parser()).items()
                  if flag in sub._option_string_actions)


def test_every_lr_schedule_help_lists_every_key_the_parser_takes() -> None:
    """sweep's help left out step's warmup, which it accepts: every command's help comes
    from the parser's own table now."""
    from qsync_opt.strategy.schedule import _SCHEDULE_KEYS, parse_schedule

    commands = _commands_with("--lr-schedule")
    assert {"train", "sweep", "replay", "solve"} <= set(commands)
    for command in commands:
        sub = _subcommands(build_parser())[command]
        words = (sub._option_string_actions["--lr-schedule"].help or "").split()
        for kind, keys in _SCHEDULE_KEYS.items():
            # the kind's own syntax, one word: step:every=N[,gamma=G,warmup=W]
            syntax = [w for w in words if w.startswith((f"{kind}:", f"{kind}[:"))]
            assert len(syntax) == 1, (command, kind, words)
            for key in keys:
                assert f"{key}=" in syntax[0], (command, kind, key)
                # and the parser does take it
                value = "2" if key in ("every", "warmup") else "0.5"
                extra = "every=3," if kind == "step" and key != "every" else ""
                parse_schedule(f"{kind}:{extra}{key}={value}", 0.1, 10)


def test_every_sync_help_lists_every_qsr_key() -> None:
    from qsync_opt.strategy.modes import QSR_KEYS, SYNC_KINDS, parse_sync

    commands = _commands_with("--sync")
    assert {"train", "replay", "solve"} <= set(commands)
    for command in commands:
        text = _help_of(command, "--sync")
        for kind in SYNC_KINDS:
            assert kind in text, (command, kind)
        for key in QSR_KEYS:
            assert f"{key}=" in text, (command, key)
            parse_sync(f"qsr:alpha=0.1,h_base=2,{key}=3" if key == "power"
                       else "qsr:alpha=0.1,h_base=2")


def test_netsim_p_help_names_every_policy_that_uses_it() -> None:
    """--p is the bounded-loss transport's bound: fifo+bounded uses it too, the help said
    only priority+bounded."""
    from qsync_opt.netsim.traffic import POLICIES, NetConfig

    text = _help_of("netsim", "--p")
    sub = _subcommands(build_parser())["netsim"]
    assert tuple(sub._option_string_actions["--policy"].choices or ()) == tuple(POLICIES)
    for policy in POLICIES:
        uses_p = NetConfig(policy=policy, p=0.1).bounded is not None
        assert (policy in text) == uses_p, policy


def test_a_validation_message_never_shows_the_schema_path() -> None:
    """'(root)' (a check of the whole document) was the schema's word, not the user's; a
    field's message keeps its field (the config file's name) beside the flag."""
    from pydantic import BaseModel, ValidationError, field_validator, model_validator

    from qsync_opt.core.errors import describe_validation_error

    class Doc(BaseModel):
        steps: int = 1
        name: str = "x"

        @field_validator("steps")
        @classmethod
        def _steps(cls, v: int) -> int:
            if v < 1:
                raise ValueError(f"--steps must be >= 1, got {v}")
            return v

        @model_validator(mode="after")
        def _whole(self) -> Doc:
            if self.name == "bad":
                raise ValueError("--name: bad with these steps")
            return self

    cases = [({"name": "bad"}, "train: --name: bad with these steps"),
             ({"steps": 0}, "train: steps: --steps must be >= 1, got 0"),
             ({"name": 3}, "train: name: Input should be a valid string, got 3")]
    for data, expected in cases:
        with pytest.raises(ValidationError) as exc:
            Doc(**data)
        assert describe_validation_error(exc.value, "train") == expected


@pytest.mark.parametrize(("argv", "needle"), [
    (["--pipeline-stages", "2", "--sync", "qsr:alpha=0.1,h_base=2"],
     "--pipeline-stages: a pipeline has one replica of each stage"),
    (["--pipeline-stages", "2", "--micro-batches", "100", "--batch", "8"],
     "train: --micro-batches must be at most the batch (8), got 100"),
    (["--steps", "0"], "argument --steps: expected"),  # refused when parsed (limits)
    (["--lr", "-1"], "--lr"),
])
def test_train_refusals_name_the_flag_not_the_schema(tmp_path, capsys, argv, needle) -> None:
    try:
        rc = main(["train", "--model", "digits_cnn", "--out", str(tmp_path / "o"),
                   "--dry-run", *argv])
    except SystemExit as exc:  # argparse's refusal of a flag's value: one line, exit 2
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.count("\n") == 1, err
    assert "(root)" not in err, err


def test_a_config_file_refused_at_the_rank_names_no_schema_path(tmp_path, capsys) -> None:
    """The ranks read train_config.json: a whole-document check failing there (a pipeline
    under local SGD, written by hand) is one line without '(root)'."""
    import json

    from qsync_opt.job import rank as worker

    doc = {"schema_name": "TrainConfig", "schema_version": 1, "workload": "digits_cnn",
           "plan_path": str(tmp_path / "p.json"), "rank_groups": ["cpu", "cpu"], "steps": 1,
           "out_dir": str(tmp_path), "sync": "local:2",
           "pipeline": {"stages": 2, "cuts": ["fc1"], "batch": 8}}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(doc))
    assert worker.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "--pipeline-stages: a pipeline has one replica" in err, err
    assert "(root)" not in err and err.count("\n") == 1, err


def test_a_document_file_with_a_whole_document_error_names_no_schema_path(tmp_path,
                                                                          capsys) -> None:
    """The same for every command that reads a document: a cluster file whose group names
    repeat (ClusterSpec's whole-document check), through `estimate` and `replay`."""
    import json

    from qsync_opt import parse_shorthand

    doc = json.loads(parse_shorthand("t4x1").model_dump_json())
    doc["groups"] = doc["groups"] * 2
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    for command in ("estimate", "replay"):
        rc = main([command, "--model", "digits_cnn", "--cluster", str(path)])
        err = capsys.readouterr().err
        assert rc == 2 and "group names must be unique; repeated: t4" in err, err
        assert "(root)" not in err and err.count("\n") == 1, err


def test_the_comm_help_lists_every_kind_policy_scenario_and_key_the_parser_takes() -> None:
    """``--comm``'s help is prose around the syntax: every word ``parse_comm`` accepts is in
    it and in ``COMM_SYNTAX`` (the refusal's text), and each one it lists parses."""
    from qsync_opt.strategy.droppolicy import POLICIES
    from qsync_opt.strategy.modes import COMM_KINDS, COMM_SYNTAX, NET_SCENARIOS, parse_comm

    text = " ".join(_help_of("train", "--comm").split())
    network = ("p", "chunk_kib", "iterations", "buffer_kib")
    stress = ("p", "chunk_kib", "layer_bias")
    for word in [*COMM_KINDS, *POLICIES, *NET_SCENARIOS, "stress",
                 *(f"{k}=" for k in {*network, *stress})]:
        assert word in text and word in COMM_SYNTAX, word
    for kind in COMM_KINDS:
        parse_comm(kind)
    for policy in POLICIES:
        for scenario in NET_SCENARIOS:
            parse_comm(f"dlcp:p=0.1,policy={policy},scenario={scenario},chunk_kib=64,"
                       "iterations=2,buffer_kib=512")
        parse_comm(f"dlcp:p=0.1,stress,policy={policy},chunk_kib=64,layer_bias=0.5")
