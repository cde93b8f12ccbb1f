"""Plans: a plan file never runs code; one validation path for every command that
reads a plan (report, replay, train and its --dry-run, check_plan); a model file
that exits or raises a BaseException gives one line.

Every command runs in-process through ``qsync_opt.cli.main`` (exit code, stdout, stderr).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qsync_opt import ModelGraph, Plan, QsyncInputError, parse_shorthand, save, trace
from qsync_opt.cli import main
from qsync_opt.documents.schemas import OpRole
from qsync_opt.graph import load_user_model
from qsync_opt.problem.plan import MAX_BATCH_PER_DEVICE, check_plan, make_plan

CLUSTER = "v100x1+t4x1"  # catalog cards: no CPU measurement, two groups


def _model_source(marker: Path, extra: str = "") -> str:
    """A user model file that, when imported, writes ``marker`` (proof that it ran)."""
    return "\n".join([
        "import pathlib",
        "import torch",
        "from torch import nn",
        f"pathlib.Path({str(marker)!r}).write_text('ran')",
        extra,
        "def build():",
        "    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), "
        "(torch.randn(5, 4),)",
        "",
    ])


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_refusal(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("qsync-opt: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.fixture()
def user_plan(tmp_path: Path) -> dict[str, Any]:
    """A model file, a plan made from it, and the marker its import writes (removed)."""
    marker = tmp_path / "ran.marker"
    src = tmp_path / "mine.py"
    src.write_text(_model_source(marker))
    graph = trace(f"{src}:build")
    plan = make_plan(graph, parse_shorthand(CLUSTER), {},
                     {"graph_batch": graph.batch_size, "graph_tie_mode": "none"})
    path = save(plan, tmp_path / "mine.plan.json")
    assert marker.exists()  # tracing it ran it, as asked
    marker.unlink()
    return {"src": src, "marker": marker, "plan": plan, "path": path, "graph": graph,
            "spec": f"{src}:build"}


def _plan_readers(plan: Path, out: Path, model: str | None = None) -> list[list[str]]:
    """Every command that reads a plan, with ``model`` as --model where it takes one."""
    m = ["--model", model] if model else []
    return [
        ["report", "--plan", plan, *m],
        ["report", "--plan", plan, "--json", "--png", out / "r.png", *m],
        ["replay", "--model", model or "digits_cnn", "--plan", plan],
        ["train", "--model", model or "digits_cnn", "--plan", plan, "--out", out / "run",
         "--dry-run"],
        ["train", "--model", model or "digits_cnn", "--plan", plan, "--out", out / "run",
         "--print-command"],
    ]


# ----------------------------------------------------------------------------- no code from data


def test_plans_record_the_model_files_hash(user_plan, digits_graph) -> None:
    digest = hashlib.sha256(user_plan["src"].read_bytes()).hexdigest()
    assert user_plan["graph"].workload_sha256 == digest
    assert user_plan["plan"].workload_sha256 == digest
    assert Plan.load(user_plan["path"]).workload_sha256 == digest
    assert digits_graph.workload_sha256 is None
    assert make_plan(digits_graph, parse_shorthand(CLUSTER), {}).workload_sha256 is None


def test_a_plan_naming_a_file_runs_nothing_without_model(user_plan, tmp_path, capsys) -> None:
    commands = _plan_readers(user_plan["path"], tmp_path)
    # (train --model FILE runs the file the user names, once its sha256 is the plan's:
    # tests/models/test_user_models.py)
    for argv in commands:
        code, _, err = run(capsys, *argv)
        assert_one_line_refusal(code, err)
        assert not user_plan["marker"].exists(), argv
        assert not (tmp_path / "r.png").exists() and not (tmp_path / "run").exists()


def test_a_plan_naming_a_file_in_the_working_directory_runs_nothing(tmp_path, capsys,
                                                                    monkeypatch) -> None:
    """The campaign's case: a plan someone sends you, naming evil.py relative to the folder
    you run in; the old code imported it from the working directory."""
    marker = tmp_path / "evil.marker"
    (tmp_path / "evil.py").write_text(_model_source(marker))
    monkeypatch.chdir(tmp_path)
    graph = trace("evil.py:build")
    marker.unlink()
    plan = make_plan(graph, parse_shorthand(CLUSTER), {})
    save(plan, tmp_path / "sent.json")
    code, _, err = run(capsys, "report", "--plan", "sent.json")
    # the plan names the file by its absolute path (plans made elsewhere stay readable)
    assert_one_line_refusal(code, err, f"'{tmp_path.resolve() / 'evil.py'}:build'", "--model")
    assert not marker.exists()


_FN = st.text(st.characters(codec="ascii", categories=("L", "N")), min_size=1, max_size=8)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(form=st.sampled_from(["{d}/m.py:{f}", "m.py:{f}", "./m.py:{f}", "{d}/../{b}/m.py:{f}",
                             "m.py:{f}:x", "{d}/m.py:build", "m.PY:{f}", " m.py:{f}",
                             "m.py:\n{f}", "{d}/m.py:{f}\x1b[2J"]),
       fn=_FN, sha=st.one_of(st.none(), st.just("0" * 64), st.just("real")),
       graph_hash=st.sampled_from(["real", "0123456789abcdef"]))
def test_no_plan_workload_string_imports_anything(user_plan, tmp_path, capsys, monkeypatch,
                                                  form, fn, sha, graph_hash) -> None:
    """Whatever a plan's workload, workload_sha256 and graph_hash say, reading it without
    --model imports nothing (here every form points at a file that would write the marker)."""
    d = user_plan["src"].parent
    (d / "m.py").write_text(_model_source(user_plan["marker"], f"def {fn}():\n    return build()"))
    monkeypatch.chdir(d)
    doc = user_plan["plan"].model_dump(mode="json")
    doc["workload"] = form.format(d=d, b=d.name, f=fn)
    if sha == "real":
        sha = hashlib.sha256((d / "m.py").read_bytes()).hexdigest()
    doc.pop("workload_sha256", None)  # a plan of an older qsync-opt has no such field
    if sha is not None:
        doc["workload_sha256"] = sha
    if graph_hash != "real":
        doc["graph_hash"] = graph_hash
    (tmp_path / "h.json").write_text(json.dumps(doc))
    for argv in (["report", "--plan", tmp_path / "h.json"],
                 ["replay", "--model", "digits_cnn", "--plan", tmp_path / "h.json"],
                 ["train", "--model", "digits_cnn", "--plan", tmp_path / "h.json", "--out",
                  tmp_path / "run", "--dry-run"]):
        code, _, err = run(capsys, *argv)
        assert_one_line_refusal(code, err)
        assert not user_plan["marker"].exists(), (doc["workload"], argv)


def test_with_that_file_as_model_the_plan_is_read(user_plan, tmp_path, capsys) -> None:
    code, out, err = run(capsys, "report", "--plan", user_plan["path"], "--model",
                         user_plan["spec"])
    assert code == 0, err
    assert "v100" in out and "t4" in out
    code, out, err = run(capsys, "replay", "--model", user_plan["spec"], "--plan",
                         user_plan["path"], "--json")
    assert code == 0, err
    assert set(json.loads(out)["plan"]["groups"]) == {"v100", "t4"}
    # The same content elsewhere is the same file: compared by hash, not by path.
    copy = tmp_path / "elsewhere" / "copy.py"
    copy.parent.mkdir()
    copy.write_bytes(user_plan["src"].read_bytes())
    code, _, err = run(capsys, "report", "--plan", user_plan["path"], "--model", f"{copy}:build")
    assert code == 0, err


def test_an_edited_model_file_is_refused_before_it_runs(user_plan, tmp_path, capsys) -> None:
    second = tmp_path / "second.marker"
    user_plan["src"].write_text(_model_source(second, "# edited"))
    for argv in _plan_readers(user_plan["path"], tmp_path, user_plan["spec"])[:3]:
        code, _, err = run(capsys, *argv)
        assert_one_line_refusal(code, err, "not the file the plan was made from")
        assert not second.exists() and not user_plan["marker"].exists(), argv


def test_a_file_plan_without_a_hash_is_refused_before_the_file_runs(user_plan, tmp_path,
                                                                      capsys) -> None:
    old = user_plan["plan"].model_copy(update={"workload_sha256": None})
    save(old, tmp_path / "old.json")
    code, _, err = run(capsys, "report", "--plan", tmp_path / "old.json", "--model",
                       user_plan["spec"])
    assert_one_line_refusal(code, err, "no workload_sha256")
    assert not user_plan["marker"].exists()


def test_a_registry_plan_with_a_file_as_model_runs_nothing(user_plan, digits_graph, tmp_path,
                                                           capsys) -> None:
    save(make_plan(digits_graph, parse_shorthand(CLUSTER), {}), tmp_path / "d.json")
    for argv in (["report", "--plan", tmp_path / "d.json", "--model", user_plan["spec"]],
                 ["replay", "--model", user_plan["spec"], "--plan", tmp_path / "d.json"]):
        code, _, err = run(capsys, *argv)
        assert_one_line_refusal(code, err, "built-in workload 'digits_cnn'")
        assert not user_plan["marker"].exists()


# ----------------------------------------------------------------------------- one validation


def _digits_plan(digits_graph: ModelGraph, edit: Any = None) -> Plan:
    plan = make_plan(digits_graph, parse_shorthand(CLUSTER), {})
    doc = plan.model_dump(mode="json")
    if edit is not None:
        edit(doc)
    return Plan.model_validate(doc)


def _pinned(graph: ModelGraph) -> str:
    return next(o.name for o in graph.ops if o.role == OpRole.pinned and o.kind.value == "linear")


def _choosable(graph: ModelGraph) -> str:
    return graph.choosable_ops()[0].name


def _cases(graph: ModelGraph) -> dict[str, tuple[Any, str]]:
    pinned, op = _pinned(graph), _choosable(graph)

    def set_op(group: str, name: str, value: str) -> Any:
        return lambda d: d["groups"][group]["precisions"].__setitem__(name, value)

    return {
        "another graph": (lambda d: d.__setitem__("graph_hash", "0123456789abcdef"),
                          "made for graph 0123456789abcdef"),
        "an op the model lacks": (set_op("t4", "no_such_op", "fp16"), "no_such_op"),
        "pinned op at int8": (set_op("t4", pinned, "int8"), f"op {pinned} is pinned"),
        "precision the card lacks": (set_op("v100", op, "int8"), "int8 is not allowed"),
        # the value as written; the schema or check_plan names the limit
        "batch too large": (lambda d: d["groups"]["t4"].__setitem__("batch_per_device", 10**12),
                            "1000000000000"),
        # found by benchmarks/campaign.py: a missing op ran at fp32 without a word
        "an op left out": (lambda d: d["groups"]["t4"]["precisions"].pop(op),
                           f"sets no precision for op {op}"),
    }


@pytest.mark.parametrize("case", ["another graph", "an op the model lacks", "pinned op at int8",
                                  "precision the card lacks", "batch too large",
                                  "an op left out"])
def test_every_plan_reading_command_refuses_a_plan_that_does_not_fit(case, digits_graph,
                                                                     tmp_path, capsys) -> None:
    edit, needle = _cases(digits_graph)[case]
    doc = make_plan(digits_graph, parse_shorthand(CLUSTER), {}).model_dump(mode="json")
    edit(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))  # as a hand-edited or hostile file would be
    for argv in _plan_readers(path, tmp_path):
        code, _, err = run(capsys, *argv)
        assert_one_line_refusal(code, err, needle)
        assert not (tmp_path / "r.png").exists() and not (tmp_path / "run").exists(), argv
    with pytest.raises(QsyncInputError) as exc:
        check_plan(Plan.load(path), digits_graph)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_check_plan_names_the_batch_limit(digits_graph) -> None:
    plan = make_plan(digits_graph, parse_shorthand(CLUSTER), {})
    big = plan.model_copy(update={"groups": {
        **plan.groups, "t4": plan.groups["t4"].model_copy(
            update={"batch_per_device": MAX_BATCH_PER_DEVICE + 1})}})
    with pytest.raises(QsyncInputError, match=f"over the limit of {MAX_BATCH_PER_DEVICE}"):
        check_plan(big, digits_graph)


def test_a_plan_that_fits_passes_every_reader(digits_graph, tmp_path, capsys) -> None:
    op = _choosable(digits_graph)
    plan = _digits_plan(digits_graph,
                        lambda d: d["groups"]["t4"]["precisions"].__setitem__(op, "int8"))
    path = save(plan, tmp_path / "ok.json")
    assert Plan.load(path) == plan
    check_plan(plan, digits_graph)
    for argv in _plan_readers(path, tmp_path):
        code, _, err = run(capsys, *argv)
        assert code == 0, (argv, err)


@pytest.mark.parametrize("call", [lambda p, g: Plan.load(p, g),
                                  lambda p, g: Plan.load(p, graph=g)],
                         ids=["positional", "keyword"])
def test_plan_load_never_returns_a_plan_it_did_not_check(call, digits_graph, tmp_path) -> None:
    """``Plan.load`` reads; ``check_plan`` checks. Handed a graph, ``Plan.load`` refuses in
    one line naming ``check_plan`` rather than return a plan it did not check, whether or
    not the plan fits."""
    fits = save(_digits_plan(digits_graph), tmp_path / "ok.json")
    edit, needle = _cases(digits_graph)["another graph"]
    bad = save(_digits_plan(digits_graph, edit), tmp_path / "bad.json")
    for path in (fits, bad):
        with pytest.raises(TypeError, match=r"qsync_opt\.problem\.plan\.check_plan\(plan, graph\)") as exc:
            call(path, digits_graph)
        assert "\n" not in str(exc.value)
    assert call(fits, None) == Plan.load(fits)  # no graph: a plain read
    with pytest.raises(QsyncInputError, match=needle):
        check_plan(Plan.load(bad), digits_graph)


def test_train_refuses_another_models_plan(digits_graph, tmp_path, capsys) -> None:
    path = save(_digits_plan(digits_graph), tmp_path / "d.json")
    code, _, err = run(capsys, "train", "--model", "resnet18", "--plan", path, "--out",
                       tmp_path / "run", "--dry-run")
    assert_one_line_refusal(code, err, "made for model 'digits_cnn', not 'resnet18'")
    assert not (tmp_path / "run").exists()


def test_control_characters_of_a_plan_are_escaped(digits_graph, tmp_path, capsys) -> None:
    path = save(_digits_plan(
        digits_graph, lambda d: d["groups"]["t4"]["precisions"].__setitem__("x\ny", "fp16")),
        tmp_path / "nl.json")
    code, _, err = run(capsys, "train", "--model", "digits_cnn", "--plan", path, "--out",
                       tmp_path / "run", "--dry-run")
    assert_one_line_refusal(code, err, "'x\\ny'")


# ----------------------------------------------------------------------------- exits in model files


_EXITS = ["sys.exit(0)", "sys.exit(3)", "sys.exit('bye')", "raise SystemExit",
          "raise GeneratorExit", "raise BaseException('two\\nlines')"]


@pytest.mark.parametrize("where", ["import", "build"])
@pytest.mark.parametrize("stmt", _EXITS)
def test_a_model_file_that_exits_is_one_line(where, stmt, tmp_path, capsys) -> None:
    body = (f"import sys\n{stmt}\n" if where == "import" else "import sys\n")
    body += "def build():\n"
    body += f"    {stmt}\n" if where == "build" else "    return None\n"
    f = tmp_path / "exits.py"
    f.write_text(body)
    code, out, err = run(capsys, "graph", "--model", f"{f}:build", "--json")
    assert_one_line_refusal(code, err, str(f))
    assert out == ""


def test_ctrl_c_in_a_model_file_still_interrupts(tmp_path) -> None:
    f = tmp_path / "ctrlc.py"
    f.write_text("def build():\n    raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        load_user_model(f"{f}:build")


def test_the_bytes_hashed_are_the_bytes_run(user_plan, tmp_path) -> None:
    """load_user_model(sha256=...) checks the content before it runs anything."""
    with pytest.raises(QsyncInputError, match="not the file the plan was made from"):
        load_user_model(user_plan["spec"], sha256="0" * 64)
    assert not user_plan["marker"].exists()
    load_user_model(user_plan["spec"], sha256=user_plan["plan"].workload_sha256)
    assert user_plan["marker"].exists()
    assert os.path.getsize(user_plan["marker"]) == 3
