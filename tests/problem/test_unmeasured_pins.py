"""Ops the indicator could not measure (``IndicatorTable.unmeasured``) are pinned fp32 on
every path that makes a problem from a table: the Python API (``build_problem``, a problem
made directly) and the CLI with a table given by ``--indicator``, as the CLI's computed
indicator always did. A value is never assumed, and no path refuses or lowers them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qsync_opt.core.precision import Precision
from qsync_opt.costs.cluster import parse_shorthand
from qsync_opt.documents.io import save
from qsync_opt.documents.schemas import IndicatorTable, ModelGraph
from qsync_opt.planner.solve import build_problem, solve
from qsync_opt.problem.program import AllocationProblem, ProblemOptions
from support.harness import run_cli

CLUSTER = "t4x2"


def _table(graph: ModelGraph, unmeasured: list[str]) -> IndicatorTable:
    """Every measured op cheap to lower (so a solver lowers it); the unmeasured ones with
    their fp32 row only, as ``indicate`` writes them."""
    values = {o.name: {p: (0.0 if p == Precision.fp32 else 1e-3) for p in o.allowed_precisions}
              for o in graph.choosable_ops()}
    for name in unmeasured:
        values[name] = {Precision.fp32: 0.0}
    return IndicatorTable(workload=graph.workload, graph_hash=graph.structure_hash(),
                          method="qsync", batch_size=8, batches=1, seed=0, data="none",
                          values=values, unmeasured=dict.fromkeys(unmeasured, "no value"))


def _subsets(graph: ModelGraph) -> list[list[str]]:
    names = [o.name for o in graph.choosable_ops()]
    return [names[:1], names[-1:], names[::2], names]


@pytest.mark.parametrize("which", range(4))
@pytest.mark.parametrize("path", ["build_problem", "AllocationProblem"])
def test_the_api_pins_unmeasured_ops_fp32(digits_graph, which, path) -> None:
    unmeasured = _subsets(digits_graph)[which]
    table = _table(digits_graph, unmeasured)
    if path == "build_problem":
        problem = build_problem(digits_graph, CLUSTER, indicator=table)
    else:
        cluster = parse_shorthand(CLUSTER)
        problem = build_problem(digits_graph, cluster, indicator=table)  # its costs
        problem = AllocationProblem(digits_graph, cluster, problem.costs, table)
    assert {n: problem.options.pinned[n] for n in unmeasured} == dict.fromkeys(
        unmeasured, Precision.fp32)
    assert any("without a value pinned fp32" in n for n in problem.notes)
    plan, _ = solve(problem, "highs", mode="budget", degradation_budget=1.0)
    for group in plan.groups.values():
        assert all(group.precisions[n] == Precision.fp32 for n in unmeasured)
    measured = {o.name for o in digits_graph.choosable_ops()} - set(unmeasured)
    assert not measured & set(problem.options.pinned)  # still chosen freely


def test_a_users_own_pin_wins(digits_graph) -> None:
    name = digits_graph.choosable_ops()[0].name
    options = ProblemOptions(pinned={name: Precision.fp32})
    problem = build_problem(digits_graph, CLUSTER, indicator=_table(digits_graph, [name]),
                            options=options)
    assert problem.options is options  # nothing to add
    assert not any("without a value" in n for n in problem.notes)


def test_the_cli_pins_a_given_tables_unmeasured_ops(digits_graph, tmp_path: Path) -> None:
    name = digits_graph.choosable_ops()[0].name
    path = tmp_path / "ind.json"
    save(_table(digits_graph, [name]), path)
    code, out, err = run_cli("solve", "--model", "digits_cnn", "--cluster", CLUSTER,
                             "--indicator", str(path), "--solver", "highs", "--mode", "budget",
                             "--budget", "1", "--out", str(tmp_path / "p.json"))
    assert code == 0, err
    assert f"without a value pinned fp32 ({name};" in out
    plan = json.loads((tmp_path / "p.json").read_text())
    assert all(g["precisions"][name] == "fp32" for g in plan["groups"].values())
