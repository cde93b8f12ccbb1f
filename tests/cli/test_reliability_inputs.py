"""Bad input and failed writes: one line, exit 2, no traceback, no file changed.

Classes of input, each refused at its root: documents nested too deeply; a non-finite number
in any numeric field of any document (and in any float flag); numeric flags out of range;
booleans and strings where a count or a version goes; sizes beyond the named limits (groups,
devices, batch, ops) including the 600,000-group file that used to hang; control characters
in echoed text; every write failure of the writing commands. And the files: the mode of the
file replaced is kept, a symbolic link is written through.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qsync_opt.core.errors import QsyncInputError, one_line
from qsync_opt.costs.cluster import load_cluster, load_cluster_file, parse_shorthand
from qsync_opt.costs.roofline import estimate
from qsync_opt.documents import io as qio
from qsync_opt.documents.schemas import (
    MAX_BATCH,
    MAX_DEVICES,
    MAX_GROUPS,
    MAX_OPS,
    ClusterSpec,
    CostTable,
    IndicatorTable,
    ModelGraph,
    Plan,
)
from qsync_opt.problem.plan import make_plan
from qsync_opt.problem.synthetic import random_indicator
from support.harness import run_cli

FAST = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


def run_exit(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # what ran before is not this command's
    return run_cli(*argv)


def assert_one_line(code: int, err: str) -> str:
    assert code == 2, err
    assert "Traceback" not in err and err.endswith("\n") and err.count("\n") == 1, err
    assert len(err.splitlines()) == 1, err  # no \r, \x0b, \u2028... splitting it either
    return err.strip()


def refusal(fn: Any, *args: Any) -> str:
    with pytest.raises(QsyncInputError) as info:
        fn(*args)
    msg = str(info.value)
    assert msg.isprintable(), msg
    return msg


def parse_json_doc(text: str, cls: type) -> Any:
    return qio.parse_document(qio.parse_text(text, "JSON", "doc.json"), cls, "doc.json")


# ----------------------------------------------------------------------------- documents


@pytest.fixture(scope="module")
def documents(digits_graph: ModelGraph) -> dict[str, tuple[type, dict[str, Any]]]:
    """One valid document of each kind a command reads, as parsed JSON."""
    cluster = parse_shorthand("v100x2+t4x2@16")
    cluster = cluster.model_copy(update={"groups": [
        cluster.groups[0].model_copy(update={"intra_node_bandwidth_gb_per_s": 100.0}),
        cluster.groups[1]]})
    costs = estimate(digits_graph, cluster)
    plan = make_plan(digits_graph, cluster, {}, {"objective": 0.5, "graph_batch": 64})
    docs = {"cluster": (ClusterSpec, cluster), "costs": (CostTable, costs), "plan": (Plan, plan),
            "indicator": (IndicatorTable, random_indicator(digits_graph)),
            "graph": (ModelGraph, digits_graph)}
    return {k: (cls, json.loads(doc.model_dump_json())) for k, (cls, doc) in docs.items()}


def numeric_paths(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(doc, bool):
        return []
    if isinstance(doc, (int, float)):
        return [path] if path[-1] != "schema_version" else []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) \
        else ()
    return [p for k, v in items for p in numeric_paths(v, (*path, k))]


def replaced(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    doc = json.loads(json.dumps(doc))
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return doc


def dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(k) for k in path)


@FAST
@given(data=st.data())
def test_any_non_finite_number_in_any_document_is_refused_naming_the_field(
        documents: dict[str, tuple[type, dict[str, Any]]], data: st.DataObject) -> None:
    """Infinity, -Infinity and NaN (as JSON writes them, or 1e999) in any numeric field of a
    cluster, costs, plan, indicator or graph document: refused, one line, naming the field
    by its dotted path (the cost of Infinity reached the CP-SAT scaling as a traceback; an
    Infinity bandwidth or latency was accepted)."""
    kind = data.draw(st.sampled_from(sorted(documents)), label="kind")
    cls, doc = documents[kind]
    path = data.draw(st.sampled_from(numeric_paths(doc)), label="path")
    spelling = data.draw(st.sampled_from(["Infinity", "-Infinity", "NaN", "1e999", "-1e999"]))
    text = json.dumps(replaced(doc, path, "@@")).replace('"@@"', spelling)
    msg = refusal(parse_json_doc, text, cls)
    assert dotted(path) in msg and ("finite" in msg or "number" in msg), msg


def _toml(cluster: dict[str, Any], bad: tuple[tuple[Any, ...], str] | None) -> str:
    def value(v: Any, path: tuple[Any, ...]) -> str:
        return bad[1] if bad is not None and bad[0] == path else json.dumps(v)

    lines = [f"{k} = {value(v, (k,))}" for k, v in cluster.items()
             if k != "groups" and v is not None]
    for i, g in enumerate(cluster["groups"]):
        lines.append("[[groups]]")
        lines += [f"{k} = {value(v, ('groups', i, k))}" for k, v in g.items() if v is not None]
    return "\n".join(lines) + "\n"


@FAST
@given(data=st.data())
def test_any_non_finite_number_in_a_toml_cluster_is_refused_naming_the_field(
        documents: dict[str, tuple[type, dict[str, Any]]], tmp_path: Path,
        data: st.DataObject) -> None:
    _, doc = documents["cluster"]
    path = data.draw(st.sampled_from(numeric_paths(doc)), label="path")
    spelling = data.draw(st.sampled_from(["inf", "-inf", "+inf", "nan", "-nan"]))
    f = tmp_path / "c.toml"
    f.write_text(_toml(doc, (path, spelling)))
    msg = refusal(load_cluster_file, f)
    assert dotted(path) in msg and "finite" in msg, msg
    f.write_text(_toml(doc, None))
    assert load_cluster_file(f).groups[0].intra_node_bandwidth_gb_per_s == 100.0


def test_a_non_finite_bandwidth_is_one_line_from_the_cli(capsys: pytest.CaptureFixture[str],
                                                         tmp_path: Path) -> None:
    f = tmp_path / "c.json"
    f.write_text('{"groups": [{"name": "t4", "device": "t4", "count": 2}], '
                 '"inter_node_bandwidth_gb_per_s": Infinity}')
    code, _, err = run_exit(capsys, "estimate", "--model", "digits_cnn", "--cluster", str(f))
    assert "inter_node_bandwidth_gb_per_s: Input should be a finite number" in \
        assert_one_line(code, err)


@pytest.mark.parametrize("version", [True, False, 1.0, None, "1", 0, 3, 2.0])
def test_schema_version_is_exactly_the_integer(version: Any,
                                               documents: dict[str, Any]) -> None:
    """``schema_version: true`` was read as version 1 (a bool is an int in Python), ``0``
    and ``false`` as "absent"."""
    for cls, doc in documents.values():
        text = json.dumps({**doc, "schema_version": version})
        msg = refusal(parse_json_doc, text, cls)
        assert f"schema_version {json.dumps(version) if version is not None else 'null'}" \
            in msg.replace("'1'", '"1"'), msg
        with pytest.raises(ValueError, match="schema_version"):
            cls.model_validate({**doc, "schema_version": version})
    cls, doc = documents["cluster"]
    with pytest.raises(QsyncInputError, match="schema_name"):
        parse_json_doc(json.dumps({**doc, "schema_name": None}), cls)


@pytest.mark.parametrize("field,value", [
    ("count", True), ("count", "2"), ("devices_per_node", False), ("batch_per_device", "16"),
    ("intra_node_bandwidth_gb_per_s", True), ("intra_node_bandwidth_gb_per_s", "100"),
])
def test_counts_and_numbers_refuse_booleans_and_strings(field: str, value: Any) -> None:
    doc = {"groups": [{"name": "t4", "device": "t4", "count": 2, field: value}]}
    msg = refusal(parse_json_doc, json.dumps(doc), ClusterSpec)
    assert f"groups.0.{field}" in msg and "expected" in msg, msg


# ----------------------------------------------------------------------------- nesting


def _nested(depth: int, kind: str) -> str:
    if kind == "array":
        return "[" * depth + "]" * depth
    return '{"a": ' * depth + "1" + "}" * depth


@FAST
@given(depth=st.integers(qio.MAX_DEPTH + 1, 50_000), kind=st.sampled_from(["array", "object"]),
       where=st.sampled_from(["groups", "root", "provenance"]))
def test_deeply_nested_json_is_refused_in_one_line(depth: int, kind: str, where: str) -> None:
    """A RecursionError traceback before: json's decoder recurses once per level."""
    inner = _nested(depth - 1, kind)
    text = {"root": _nested(depth, kind), "groups": '{"groups": ' + inner + "}",
            "provenance": '{"provenance": ' + inner + "}"}[where]
    msg = refusal(parse_json_doc, text, Plan)
    assert f"nested deeper than {qio.MAX_DEPTH} levels" in msg, msg


@FAST
@given(depth=st.integers(qio.MAX_DEPTH + 1, 20_000), kind=st.sampled_from(["array", "table"]))
def test_deeply_nested_toml_is_refused_in_one_line(tmp_path: Path, depth: int,
                                                   kind: str) -> None:
    f = tmp_path / "deep.toml"
    body = "[" * depth + "]" * depth if kind == "array" else "{a = " * depth + "1" + "}" * depth
    f.write_text(f"name = 'x'\nextra = {body}\n")
    msg = refusal(load_cluster_file, f)
    assert f"nested deeper than {qio.MAX_DEPTH} levels" in msg, msg


def test_a_deep_plan_is_one_line_from_report(capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
    f = tmp_path / "deep.json"
    f.write_text('{"groups": ' + _nested(100_000, "array") + "}")
    code, _, err = run_exit(capsys, "report", "--plan", str(f))
    assert "nested deeper than" in assert_one_line(code, err)


# ----------------------------------------------------------------------------- sizes


@pytest.mark.slow
def test_sizes_beyond_the_limits_are_refused_with_the_limit_named(
        documents: dict[str, tuple[type, dict[str, Any]]]) -> None:
    cls, cluster = documents["cluster"]
    many = replaced(cluster, ("groups", 0, "count"), 10**30)  # 10^30 devices was accepted
    msg = refusal(parse_json_doc, json.dumps(many), cls)
    assert "groups.0.count" in msg and f"{MAX_DEVICES}" in msg, msg
    world = replaced(replaced(cluster, ("groups", 0, "count"), MAX_DEVICES),
                     ("groups", 1, "count"), MAX_DEVICES)
    assert f"more than the {MAX_DEVICES}" in refusal(parse_json_doc, json.dumps(world), cls)
    big = replaced(cluster, ("groups", 1, "batch_per_device"), 10**25)
    assert f"{MAX_BATCH}" in refusal(parse_json_doc, json.dumps(big), cls)
    pcls, plan = documents["plan"]
    for group in plan["groups"]:  # a plan batch of 10^12 reached train as a traceback
        bad = replaced(plan, ("groups", group, "batch_per_device"), 10**12)
        msg = refusal(parse_json_doc, json.dumps(bad), pcls)
        assert f"groups.{group}.batch_per_device" in msg and f"{MAX_BATCH}" in msg, msg
    gcls, graph = documents["graph"]
    msg = refusal(parse_json_doc, json.dumps({**graph, "ops": [graph["ops"][0]] * (MAX_OPS + 1)}),
                  gcls)
    assert f"more than the {MAX_OPS}" in msg, msg
    groups = [{"name": f"g{i}", "device": "t4", "count": 1} for i in range(MAX_GROUPS + 1)]
    msg = refusal(parse_json_doc, json.dumps({"groups": groups}), cls)
    assert f"more than the {MAX_GROUPS}" in msg, msg
    dup = [{"name": f"g{i % 3}", "device": "t4", "count": 1} for i in range(MAX_GROUPS)]
    assert "repeated: g0, g1, g2" in refusal(parse_json_doc, json.dumps({"groups": dup}), cls)


@pytest.mark.parametrize("shorthand,expected", [
    ("t4x" + "1" + "0" * 30, f"count 1{'0' * 30} is more than the limit {MAX_DEVICES}"),
    ("t4x1@" + "9" * 25, f"batch {'9' * 25} is more than the limit {MAX_BATCH}"),
    ("t4x" + "7" * 5000, f"is more than the limit {MAX_DEVICES}"),  # int() refuses 4300 digits
    ("t4x2+" * MAX_GROUPS + "t4x2", f"more than the {MAX_GROUPS}"),
    ("t4x0000000000000000000002", None),
])
def test_shorthand_sizes(shorthand: str, expected: str | None) -> None:
    if expected is None:
        assert parse_shorthand(shorthand).groups[0].count == 2
        return
    assert expected in refusal(parse_shorthand, shorthand)


def test_a_5000_digit_number_in_a_file_is_one_line(tmp_path: Path) -> None:
    for suffix in ("json", "toml"):
        f = tmp_path / f"c.{suffix}"
        f.write_text('{"groups": [{"name": "t4", "device": "t4", "count": ' + "9" * 5000 + "}]}"
                     if suffix == "json" else "[[groups]]\nname = 't4'\ncount = " + "9" * 5000)
        assert "not valid" in refusal(load_cluster_file, f)


_GROUPS_CHILD = textwrap.dedent("""
    import json, sys
    from qsync_opt.costs.cluster import load_cluster_file
    from qsync_opt.core.errors import QsyncInputError
    try:
        load_cluster_file(sys.argv[1])
    except QsyncInputError as exc:
        print(exc)
""")


@pytest.mark.slow
def test_a_cluster_of_600000_groups_is_refused_not_hung(tmp_path: Path) -> None:
    """It hung in a quadratic duplicate-name check (hours); refused at once now."""
    f = tmp_path / "many.json"
    f.write_text(json.dumps({"groups": [{"name": f"g{i}", "device": "t4", "count": 1}
                                        for i in range(600_000)]}))
    proc = subprocess.run([sys.executable, "-c", _GROUPS_CHILD, str(f)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"600000 groups, more than the {MAX_GROUPS}" in proc.stdout


# ----------------------------------------------------------------------------- flags

_SOLVE = ("solve", "--model", "digits_cnn", "--cluster", "l4x1+t4x1", "--method", "random")
_FLOAT_FLAGS = {
    "--target-ms": _SOLVE, "--gap": _SOLVE, "--headroom": _SOLVE, "--time-limit": _SOLVE,
    "--budget": _SOLVE,
    "--bucket-mb": ("replay", "--model", "digits_cnn", "--cluster", "l4x1+t4x1"),
    "--gamma": ("indicate", "--model", "digits_cnn"),
}


@pytest.mark.parametrize("flag", sorted(_FLOAT_FLAGS))
@pytest.mark.parametrize("spelling", ["inf", "-inf", "+inf", "nan", "NaN", "Infinity",
                                      "-Infinity", "1e999"])
def test_a_non_finite_float_flag_is_refused_naming_the_flag(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, flag: str, spelling: str) -> None:
    """``--target-ms inf`` reached the CP-SAT scaling as a traceback; ``--gap nan`` was
    reported as a solver limit; ``--bucket-mb nan`` crashed."""
    out = tmp_path / "p.json"
    argv = [*_FLOAT_FLAGS[flag], f"{flag}={spelling}"]  # "-inf" alone reads as an option
    if argv[0] in ("solve", "pareto"):
        argv += ["--out", str(out)]
    code, _, err = run_exit(capsys, *argv)
    line = assert_one_line(code, err)
    assert f"argument {flag}: expected a" in line and repr(spelling) in line, line
    assert not out.exists()


@pytest.mark.parametrize("argv,flag,value", [
    (_SOLVE, "--gap", "-1"), (_SOLVE, "--gap", "1.5"), (_SOLVE, "--batch-multiple", "0"),
    (_SOLVE, "--threads", "-4"), (_SOLVE, "--headroom", "1"), (_SOLVE, "--headroom", "-0.1"),
    (_SOLVE, "--time-limit", "0"), (_SOLVE, "--seed", "-1"), (_SOLVE, "--seed", "9" * 30),
    (_SOLVE, "--refine", "-1"), (_SOLVE, "--indicator-batch", "0"),
    (_SOLVE, "--indicator-batches", "0"), (_SOLVE, "--batch", "1" + "0" * 24),
    (_SOLVE, "--target-ms", "0"), (_SOLVE, "--budget", "-1"), (_SOLVE, "--threads", "1.5"),
    (("replay", "--model", "digits_cnn", "--cluster", "l4x1+t4x1"), "--bucket-mb", "0"),
    (("replay", "--model", "digits_cnn", "--cluster", "l4x1+t4x1"), "--bucket-mb", "-5"),
    (("pareto", *_SOLVE[1:]), "--points", "1"),
    (("indicate", "--model", "digits_cnn"), "--top", "0"),
    (("indicate", "--model", "digits_cnn"), "--batches", "0"),
    (("graph", "--model", "digits_cnn"), "--batch", "9" * 25),
    (("demo",), "--steps", "0"),
])
def test_a_numeric_flag_out_of_range_is_refused_with_the_range(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: tuple[str, ...], flag: str,
        value: str) -> None:
    """``--gap -1``, ``--batch-multiple 0``, ``--bucket-mb 0`` (silently the default) and
    ``--threads -4`` were accepted; a batch of 25 digits was a traceback."""
    out = tmp_path / "p.json"
    full = [*argv, f"{flag}={value}"]
    if argv[0] in ("solve", "pareto"):
        full += ["--out", str(out)]
    code, _, err = run_exit(capsys, *full)
    line = assert_one_line(code, err)
    assert f"argument {flag}: expected " in line and f"got {value!r}" in line, line
    assert not out.exists()


# ----------------------------------------------------------------------------- one line

_CONTROL = st.text(st.characters(codec="utf-8", categories=["Cc", "Zl", "Zp", "Cf"]),
                   min_size=1, max_size=4)
_TEXT = st.text(max_size=20)


@given(before=_TEXT, ctl=_CONTROL, after=_TEXT)
def test_one_line_escapes_every_control_character(before: str, ctl: str, after: str) -> None:
    text = before + ctl + after
    shown = one_line(text)
    assert shown.isprintable() and len(shown.splitlines()) <= 1
    assert one_line(before) == before if before.isprintable() else True


@FAST
@given(before=st.text(st.characters(codec="ascii", categories=["L", "N"]), max_size=8),
       ctl=_CONTROL)
def test_the_cli_prints_any_message_on_one_line(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch,
                                                before: str, ctl: str) -> None:
    """A newline in an op name or a hash was printed raw: the message spanned lines."""
    import qsync_opt.cli.workloads as workloads  # the body of ``models``

    def bad(args: Any) -> int:
        raise QsyncInputError(f"plan: op {before}{ctl}x is not in the graph")

    monkeypatch.setattr(workloads, "cmd_models", bad)
    code, _, err = run_exit(capsys, "models")
    line = assert_one_line(code, err)
    assert line.isprintable() and line.startswith(f"qsync-opt: error: plan: op {before}")


@FAST
@given(ctl=st.text(st.characters(codec="utf-8", categories=["Cc", "Zl", "Zp"],
                                 exclude_characters="\x00/"), min_size=1, max_size=3))
def test_a_path_with_control_characters_is_echoed_escaped(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, ctl: str) -> None:
    code, _, err = run_exit(capsys, "report", "--plan", str(tmp_path / f"a{ctl}b.json"))
    line = assert_one_line(code, err)
    assert line.isprintable() and "file not found" in line, line


def test_a_derived_cpu_is_echoed_as_written(tmp_path: Path) -> None:
    """``cpu/2:0.000001g`` was echoed as ``cpu/2:1e-06g``, a value the user never wrote (its
    canonical spelling, which then failed to parse itself). Derived names are now written
    positionally, so the name reads back and is kept as written."""
    c = parse_shorthand("t4x1+CPU/2:0.000001gx1")
    assert c.groups[1].device == "cpu/2:0.000001g"
    f = tmp_path / "c.toml"
    f.write_text("[[groups]]\nname = 'c'\ndevice = 'cpu/2:0.000001g'\ncount = 1\n")
    assert load_cluster_file(f).groups[0].device == "cpu/2:0.000001g"
    assert parse_shorthand("cpu/2:0.001gx1").groups[0].device == "cpu/2:0.001g"
    msg = refusal(parse_shorthand, "t4x1+cpu/2:0.000001qx1")  # a bad one still echoes as written
    assert "0.000001q" in msg and "e-06" not in msg, msg


# ----------------------------------------------------------------------------- writes


@pytest.fixture()
def umask022() -> Any:
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_a_replaced_file_keeps_its_mode_and_a_new_one_gets_the_umask(
        tmp_path: Path, umask022: None) -> None:
    """Outputs were written 0600 even when replacing a 0644 file."""
    for mode in (0o644, 0o640, 0o600, 0o664):
        f = tmp_path / f"f{mode:o}.json"
        f.write_text("old")
        f.chmod(mode)
        qio.atomic_write_text(f, "new")
        assert f.read_text() == "new" and _mode(f) == mode
    qio.atomic_write_text(tmp_path / "new.json", "x")
    assert _mode(tmp_path / "new.json") == 0o644
    os.umask(0o077)
    qio.atomic_write_text(tmp_path / "private.json", "x")
    assert _mode(tmp_path / "private.json") == 0o600
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_symlinked_output_is_written_through(tmp_path: Path, umask022: None) -> None:
    """A symlinked --out was replaced by a regular file."""
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    target = real_dir / "plan.json"
    target.write_text("old")
    target.chmod(0o640)
    link = tmp_path / "link.json"
    link.symlink_to(os.path.relpath(target, tmp_path))
    chain = tmp_path / "chain.json"
    chain.symlink_to(link)
    qio.atomic_write_text(chain, "new")
    assert chain.is_symlink() and link.is_symlink() and target.read_text() == "new"
    assert _mode(target) == 0o640
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(real_dir / "made.json")
    qio.atomic_write_text(dangling, "made")
    assert dangling.is_symlink() and (real_dir / "made.json").read_text() == "made"
    assert sorted(p.name for p in real_dir.iterdir()) == ["made.json", "plan.json"]


def test_report_and_frontier_pngs_use_the_one_writer(tmp_path: Path, umask022: None) -> None:
    from qsync_opt.planner.figure import _atomic_write_bytes
    from qsync_opt.planner.frontier import plot_frontier

    target = tmp_path / "fig.png"
    target.write_bytes(b"old")
    target.chmod(0o644)
    link = tmp_path / "link.png"
    link.symlink_to(target)
    _atomic_write_bytes(link, b"png")
    assert link.is_symlink() and target.read_bytes() == b"png" and _mode(target) == 0o644
    plot_frontier([], link)
    assert link.is_symlink() and target.read_bytes().startswith(b"\x89PNG")
    assert _mode(target) == 0o644
    with pytest.raises(QsyncInputError, match=r"^--png: cannot write .*folder\.png"):
        (tmp_path / "folder.png").mkdir()
        plot_frontier([], tmp_path / "folder.png", what="--png")


def test_a_device_or_fifo_is_written_into_not_replaced(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        qio.atomic_write_text(fifo, "through")
        assert os.read(reader, 100) == b"through"
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    qio.atomic_write_text(os.devnull, "nothing")
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_a_library_write_failure_raises_the_oserror_and_leaves_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    with pytest.raises(IsADirectoryError):
        qio.atomic_write_text(folder, "x")

    def boom(fh: Any) -> None:
        fh.write(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    (tmp_path / "keep.json").write_text("old")
    with pytest.raises(QsyncInputError, match=r"^--out: cannot write .*keep\.json "
                                              r"\(No space left on device\)$"):
        qio.atomic_write(tmp_path / "keep.json", boom, what="--out")
    assert (tmp_path / "keep.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.json", "out"]


def _snapshot(folder: Path) -> dict[str, bytes | None]:
    return {p.name: (p.read_bytes() if p.is_file() else None) for p in folder.iterdir()}


def _fail_in(folder: Path, monkeypatch: pytest.MonkeyPatch, error: int, at: str) -> None:
    """Make the writes into ``folder`` fail like a read-only folder (EROFS when creating the
    temporary file) or a full disk (ENOSPC at fsync): works as root too."""
    real_open, real_fsync = os.open, os.fsync

    def fake_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if at == "open" and flags & os.O_CREAT and str(path).startswith(str(folder)):
            raise OSError(error, os.strerror(error), str(path))
        return real_open(path, flags, *args, **kwargs)

    def fake_fsync(fd: int) -> None:
        if at == "fsync":
            raise OSError(error, os.strerror(error))
        real_fsync(fd)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "fsync", fake_fsync)


@pytest.mark.parametrize("error,at", [(errno.EROFS, "open"), (errno.ENOSPC, "fsync"),
                                      (errno.EFBIG, "fsync"), (errno.EACCES, "open")])
def test_every_write_failure_of_replay_is_one_line_and_changes_nothing(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        error: int, at: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "t.json").write_text("old trace")
    before = _snapshot(out)
    _fail_in(out, monkeypatch, error, at)
    code, _, err = run_exit(capsys, "replay", "--model", "digits_cnn", "--cluster", "l4x1",
                            "--trace", str(out / "t.json"))
    line = assert_one_line(code, err)
    assert line.startswith(f"qsync-opt: error: --trace: cannot write {out / 't.json'} "
                           f"({os.strerror(error)})"), line
    assert _snapshot(out) == before


def test_solve_out_a_folder_and_report_unwritable_are_one_line(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "plan.json"
    folder.mkdir()
    argv = [*_SOLVE, "--solver", "greedy", "--acceptance", "linear"]
    code, _, err = run_exit(capsys, *argv, "--out", str(folder))
    assert "--out: cannot write" in assert_one_line(code, err) and "Is a directory" in err
    assert folder.is_dir() and list(folder.iterdir()) == []
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "report.json").write_text("old report")
    _fail_in(ro, monkeypatch, errno.EROFS, "open")
    code, _, err = run_exit(capsys, *argv, "--out", str(tmp_path / "p.json"),
                            "--report", str(ro / "report.json"))
    assert "--report: cannot write" in assert_one_line(code, err)
    assert _snapshot(ro) == {"report.json": b"old report"}


def test_report_png_failure_names_the_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                          digits_graph: ModelGraph) -> None:
    plan = make_plan(digits_graph, parse_shorthand("v100x1+t4x1"), {})
    qio.save(plan, tmp_path / "plan.json")
    (tmp_path / "fig.png").mkdir()
    code, _, err = run_exit(capsys, "report", "--plan", str(tmp_path / "plan.json"), "--png",
                            str(tmp_path / "fig.png"))
    assert assert_one_line(code, err).startswith("qsync-opt: error: --png: cannot write")


def test_graph_out_keeps_the_mode_and_writes_through_a_link(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, umask022: None) -> None:
    target = tmp_path / "g.json"
    target.write_text("old")
    target.chmod(0o644)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    code, _, err = run_exit(capsys, "graph", "--model", "digits_cnn", "--out", str(link))
    assert code == 0, err
    assert link.is_symlink() and _mode(target) == 0o644
    assert qio.load(target, ModelGraph).workload == "digits_cnn"


_FSIZE_CHILD = textwrap.dedent("""
    import resource, sys
    from qsync_opt.cli import main
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
    sys.exit(main(sys.argv[2:]))
""")


@pytest.mark.slow
def test_the_file_size_limit_is_one_line_not_a_signal(tmp_path: Path) -> None:
    """Past RLIMIT_FSIZE the kernel sends SIGXFSZ, whose default kills the process mid-write
    (exit -25, nothing said); the CLI ignores it, so the write fails with EFBIG, reported."""
    trace = tmp_path / "t.json"
    trace.write_text("old trace")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1",
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-c", _FSIZE_CHILD, "2000", "replay", "--model", "digits_cnn",
         "--cluster", "v100x1+t4x1", "--trace", str(trace)],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    line = assert_one_line(proc.returncode, proc.stderr)
    assert "--trace: cannot write" in line and "File too large" in line, line
    assert trace.read_text() == "old trace"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == ["t.json"]


def test_a_shorthand_that_is_no_path_is_still_a_shorthand() -> None:
    """``Path.is_file`` raises on a name longer than a path may be."""
    assert "not DEVICExCOUNT" in refusal(load_cluster, "x" * 5000)


@pytest.mark.parametrize("field,value", [("steps", True), ("seed", "3"), ("lr", True),
                                         ("timeout_s", "60"), ("slowdown", {"t4": True})])
def test_a_train_config_refuses_booleans_and_strings_as_numbers(field, value) -> None:
    """``steps: true`` was a 1-step run: TrainConfig's numbers are the schemas' Int/Real."""
    from pydantic import ValidationError

    from qsync_opt.runtime.config import TrainConfig

    base = {"workload": "digits_cnn", "plan_path": "p.json", "rank_groups": ["a"],
            "steps": 2, "out_dir": "o"}
    TrainConfig.model_validate(base)
    with pytest.raises(ValidationError, match=field):
        TrainConfig.model_validate({**base, field: value})


@pytest.mark.parametrize("x", [2, 0.5, 1e-6, 0.000123, 3.0, 1.25, 40])
def test_a_derived_device_name_is_written_positionally_and_reads_back(x) -> None:
    from qsync_opt.core.device_names import number_text
    from qsync_opt.costs.devices import get_device

    text = number_text(x)
    assert "e" not in text.lower() and float(text) == x
    assert get_device(f"cpu/2:{text}g").name == f"cpu/2:{text}g"
    if x >= 1:
        assert get_device(f"cpu/{text}").name == f"cpu/{text}"
