"""qsync-opt report: the plan figure, the summary lines, the CLI command and its refusals."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from qsync_opt import ModelGraph, Plan, QsyncInputError, estimate, parse_shorthand, save
from qsync_opt.cli.parsers.report import add_report_parser
from qsync_opt.cli.report import cmd_report
from qsync_opt.core.precision import Precision
from qsync_opt.documents.schemas import OpRole
from qsync_opt.planner.figure import (
    heatmap_matrix,
    load_report_inputs,
    plan_figure,
    plan_summary_lines,
    precision_counts,
    report_summary,
    sparse_ticks,
    straggler_reason,
    time_parts,
)
from qsync_opt.problem.plan import make_plan
from qsync_opt.problem.program import AllocationProblem, ProblemOptions
from qsync_opt.problem.synthetic import random_indicator
from qsync_opt.replayer import GroupTimeline, Replayer, Timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _plan(graph: ModelGraph, shorthand: str) -> Plan:
    """First group at its lowest precisions, the others at their reference: a mixed plan."""
    cluster = parse_shorthand(shorthand)
    prob = AllocationProblem(graph, cluster, estimate(graph, cluster), random_indicator(graph),
                             ProblemOptions(lower_reference=True))  # the strong group lowered too
    assignment = {gm.name: (gm.lowest() if k == 0 else list(gm.reference))
                  for k, gm in enumerate(prob.groups)}
    return prob.make_plan(assignment, {"solver": "test", "status": "FEASIBLE"})


def _timeline(plan: Plan, graph: ModelGraph):
    return Replayer(graph, plan.cluster, estimate(graph, plan.cluster)).simulate(plan)


def _namespace(plan: Path, png: Path | None = None, json_: bool = False,
               costs: Path | None = None) -> argparse.Namespace:
    return argparse.Namespace(plan=str(plan), png=str(png) if png else None,
                              costs=str(costs) if costs else None, json=json_)


@pytest.fixture(scope="module")
def two_group(digits_graph: ModelGraph) -> Plan:
    return _plan(digits_graph, "l4x1+t4x1")


@pytest.fixture(scope="module")
def three_group(resnet50_graph: ModelGraph) -> Plan:
    return _plan(resnet50_graph, "v100x16+t4x16+a100_40gbx4")


@pytest.mark.parametrize("which", ["two_group", "three_group"])
def test_figure_written_atomically_and_covers_every_op(which: str, request: pytest.FixtureRequest,
                                                       tmp_path: Path) -> None:
    plan: Plan = request.getfixturevalue(which)
    graph: ModelGraph = request.getfixturevalue(
        "digits_graph" if which == "two_group" else "resnet50_graph")
    timeline = _timeline(plan, graph)
    out = tmp_path / "figs" / "plan.png"
    drawn = plan_figure(plan, graph, timeline, out)

    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    assert drawn.path == out
    assert os.listdir(out.parent) == ["plan.png"]  # no temporary file left behind

    choosable = [o.name for o in graph.ops if o.role == OpRole.choosable]
    assert drawn.ops == choosable
    assert drawn.groups == [g.name for g in plan.cluster.groups] == list(timeline.groups)
    assert len(drawn.groups) == (2 if which == "two_group" else 3)
    for g, row in zip(drawn.groups, drawn.matrix, strict=True):
        assert row == [plan.groups[g].precisions[op].value for op in choosable]
    # Legend: exactly the precisions drawn, most exact first.
    used = {p for row in drawn.matrix for p in row}
    assert set(drawn.legend) == used and len(used) >= 2
    ranks = [Precision(p).info.rank for p in drawn.legend]
    assert ranks == sorted(ranks, reverse=True)
    assert drawn.tick_ops[0] == 0 and drawn.tick_ops[-1] == len(choosable) - 1
    assert len(drawn.tick_ops) <= 40


def test_time_parts_add_up_to_each_groups_end(three_group: Plan,
                                               resnet50_graph: ModelGraph) -> None:
    timeline = _timeline(three_group, resnet50_graph)
    for g in timeline.groups.values():
        parts = time_parts(g)
        assert all(v >= 0 for v in parts.values())
        assert sum(parts.values()) == pytest.approx(g.end_ms, rel=1e-9)
    assert max(g.end_ms for g in timeline.groups.values()) == pytest.approx(timeline.iteration_ms)


def test_sparse_ticks() -> None:
    assert sparse_ticks(0) == []
    assert sparse_ticks(3) == [0, 1, 2]
    for n in (41, 53, 96, 200, 1001):
        t = sparse_ticks(n)
        assert t[0] == 0 and t[-1] == n - 1 and len(t) <= 40
        assert t == sorted(set(t))


def test_summary_lines_name_every_group(three_group: Plan, resnet50_graph: ModelGraph) -> None:
    timeline = _timeline(three_group, resnet50_graph)
    lines = plan_summary_lines(three_group, timeline)
    assert len(lines) == 1 + 3 + 1
    assert "resnet50" in lines[0] and "solver test (FEASIBLE)" in lines[0]
    assert f"straggler {timeline.straggler}" in lines[0]
    assert lines[-1].startswith(f"  straggler (the group whose iteration ends last): "
                                f"{timeline.straggler} ends last")
    for name, line in zip(three_group.groups, lines[1:4], strict=True):
        assert line.lstrip().startswith(name)
        assert "compute" in line and "casts" in line and "idle" in line and "GiB" in line
    n_ops = len(resnet50_graph.choosable_ops())
    for name, line in zip(three_group.groups, lines[1:4], strict=True):
        counts = precision_counts(three_group, name)
        assert sum(counts.values()) == n_ops
        assert ", ".join(f"{n} {p}" for p, n in counts.items()) in line


def test_cli_report_png_and_summary(two_group: Plan, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    plan_path = tmp_path / "plan.json"
    save(two_group, plan_path)
    parser = argparse.ArgumentParser()
    add_report_parser(parser.add_subparsers(dest="command"))
    png = tmp_path / "out" / "r.png"
    args = parser.parse_args(["report", "--plan", str(plan_path), "--png", str(png)])
    assert args.fn(args) == 0
    out = capsys.readouterr().out
    assert f"wrote {png}" in out
    for name in two_group.groups:
        assert f"  {name} (" in out
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert os.listdir(png.parent) == ["r.png"]

    assert cmd_report(_namespace(plan_path, json_=True)) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["groups"]) == set(two_group.groups)
    assert doc["workload"] == "digits_cnn" and doc["png"] is None
    tl = load_report_inputs(plan_path).timeline
    assert doc["iteration_ms"] == pytest.approx(tl.iteration_ms, rel=1e-12)
    assert doc["iteration_ms"] == pytest.approx(max(g["end_ms"] for g in doc["groups"].values()))
    assert sum(doc["groups"]["l4"]["precision_counts"].values()) == 3


def test_old_plan_without_trace_provenance_is_read(two_group: Plan, tmp_path: Path) -> None:
    old = two_group.model_copy(update={"provenance": {}})
    save(old, tmp_path / "old.json")
    inputs = load_report_inputs(tmp_path / "old.json")
    assert inputs.graph.structure_hash() == old.graph_hash
    assert set(inputs.timeline.groups) == set(old.groups)


def test_plan_of_another_graph_is_refused(two_group: Plan, digits_graph: ModelGraph,
                                          resnet50_graph: ModelGraph, tmp_path: Path) -> None:
    other = two_group.model_copy(update={"graph_hash": "0123456789abcdef"})
    save(other, tmp_path / "other.json")
    with pytest.raises(QsyncInputError, match=r"^plan: made for graph 0123456789abcdef") as exc:
        cmd_report(_namespace(tmp_path / "other.json", png=tmp_path / "x.png"))
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "x.png").exists()
    # Drawing a plan against the wrong graph is refused too, naming the ops that differ.
    timeline = _timeline(two_group, digits_graph)
    with pytest.raises(QsyncInputError, match=r"^plan: .*ops the graph lacks: conv2, fc1"):
        plan_figure(two_group, resnet50_graph, timeline, tmp_path / "y.png")
    with pytest.raises(QsyncInputError, match=r"^plan: made for graph"):
        heatmap_matrix(two_group, resnet50_graph)
    assert sorted(os.listdir(tmp_path)) == ["other.json"]


def test_bad_files_are_refused_naming_the_field(two_group: Plan, three_group: Plan,
                                                tmp_path: Path) -> None:
    with pytest.raises(QsyncInputError, match=r"^plan: .*missing\.json: file not found$"):
        cmd_report(_namespace(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(QsyncInputError, match=r"^plan: .*not valid JSON"):
        cmd_report(_namespace(tmp_path / "bad.json"))
    save(two_group, tmp_path / "plan.json")
    with pytest.raises(QsyncInputError, match=r"^costs: .*file not found"):
        cmd_report(_namespace(tmp_path / "plan.json", costs=tmp_path / "nope.json"))
    wrong = three_group.model_copy(update={"workload": "nope_model"})
    save(wrong, tmp_path / "wrong.json")
    with pytest.raises(QsyncInputError, match=r"^plan: workload 'nope_model': model: unknown"):
        cmd_report(_namespace(tmp_path / "wrong.json"))
    bad_batch = two_group.model_copy(update={"provenance": {"graph_batch": "64"}})
    save(bad_batch, tmp_path / "bb.json")
    with pytest.raises(QsyncInputError, match=r"^plan: provenance\.graph_batch"):
        cmd_report(_namespace(tmp_path / "bb.json"))


def test_costs_of_another_graph_are_refused(two_group: Plan, resnet50_graph: ModelGraph,
                                            tmp_path: Path) -> None:
    save(two_group, tmp_path / "plan.json")
    save(estimate(resnet50_graph, two_group.cluster), tmp_path / "costs.json")
    with pytest.raises(QsyncInputError, match=r"^costs: made for graph"):
        cmd_report(_namespace(tmp_path / "plan.json", costs=tmp_path / "costs.json"))


def test_failed_write_leaves_no_temp_file(two_group: Plan, digits_graph: ModelGraph,
                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    timeline = _timeline(two_group, digits_graph)
    target = tmp_path / "keep.png"
    target.write_bytes(b"old")

    def boom(src: str, dst: str) -> None:
        raise PermissionError("read-only")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(QsyncInputError, match=r"^png: cannot write .*keep\.png"):
        plan_figure(two_group, digits_graph, timeline, target)
    assert os.listdir(tmp_path) == ["keep.png"] and target.read_bytes() == b"old"


# ----------------------------------------------------------------------------- straggler


def test_the_straggler_ends_last_even_with_less_compute(resnet50_graph: ModelGraph,
                                                        tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    """ResNet-50, the V100s at fp32 and the T4s at fp16: the V100s compute longer, both then
    wait for the all-reduce, and the T4s' optimizer step is the slower one, so the T4s end
    the iteration: they are the straggler in the timeline, the report's lines and its JSON
    (the report used to name the V100s, the group with the most compute)."""
    cluster = parse_shorthand("v100x16+t4x16")
    rep = Replayer(resnet50_graph, cluster, estimate(resnet50_graph, cluster))
    high = rep.uniform("highest")
    t4 = {op: Precision.fp16 for op in high["t4"]}
    plan = make_plan(resnet50_graph, cluster, {"v100": high["v100"], "t4": t4},
                     {"solver": "test", "status": "FEASIBLE"})
    tl = rep.simulate(plan)
    v, t = tl.groups["v100"], tl.groups["t4"]
    assert v.compute_ms > t.compute_ms  # the most compute ...
    assert t.end_ms > v.end_ms and t.end_ms == pytest.approx(tl.iteration_ms)  # ... ends first
    assert t.optimizer_ms > v.optimizer_ms
    assert tl.straggler == "t4" and tl.summary()["straggler"] == "t4"
    lines = plan_summary_lines(plan, tl)
    assert ", straggler t4," in lines[0]
    reason = straggler_reason(tl)
    assert reason is not None and lines[-1].endswith(reason)
    assert reason.startswith(f"t4 ends last at {t.end_ms:.4g} ms")
    assert f"its optimizer step takes {t.optimizer_ms - v.optimizer_ms:.3g} ms longer" in reason
    assert f"it computes {v.compute_ms - t.compute_ms:.3g} ms less than v100" in reason
    doc = report_summary(plan, tl)
    assert doc["straggler"] == "t4" and doc["straggler_reason"] == reason
    # The command, from the plan file alone.
    save(plan, tmp_path / "plan.json")
    assert cmd_report(_namespace(tmp_path / "plan.json")) == 0
    out = capsys.readouterr().out
    assert ", straggler t4," in out and reason in out


def _group(name: str, compute: float, end: float, optimizer: float) -> GroupTimeline:
    return GroupTimeline(name=name, device="t4", batch_per_device=1, forward_ms=compute / 3,
                         backward_ms=2 * compute / 3, cast_ms=0.0, n_casts=0,
                         optimizer_ms=optimizer, end_ms=end, exposed_comm_ms=0.0,
                         straggler_wait_ms=0.0, memory={}, peak_memory_bytes=0,
                         capacity_bytes=1)


def test_straggler_ties_and_a_backward_past_the_all_reduce() -> None:
    """Groups that end together: the one with more compute is named. A group whose backward
    ends after the all-reduce is the straggler for its compute, and the reason says so."""
    tied = Timeline(iteration_ms=10.0, groups={"a": _group("a", 5.0, 10.0, 2.0),
                                               "b": _group("b", 7.0, 10.0, 2.0)},
                    bucket_start_ms=[7.0], bucket_end_ms=[8.0], critical_path=[])
    assert tied.straggler == "b"
    assert straggler_reason(tied) == "b and a end together at 10 ms"
    late = Timeline(iteration_ms=13.0, groups={"a": _group("a", 12.0, 13.0, 1.0),
                                               "b": _group("b", 7.0, 10.0, 2.0)},
                    bucket_start_ms=[7.0], bucket_end_ms=[8.0], critical_path=[])
    assert late.straggler == "a"
    assert straggler_reason(late) == (
        "a ends last at 13 ms, 3 ms after b: it starts its optimizer step 4 ms after b (its "
        "backward ends past the all-reduce), its optimizer step takes 1 ms less than b's")
    solo = Timeline(iteration_ms=3.0, groups={"a": _group("a", 2.0, 3.0, 1.0)},
                    bucket_start_ms=[], bucket_end_ms=[], critical_path=[])
    assert solo.straggler == "a" and straggler_reason(solo) is None
