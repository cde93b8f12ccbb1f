"""Schemas: round trips, refusals, versions, and hypothesis-generated bad input."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from qsync_opt import (
    ClusterSpec,
    CostTable,
    DeviceSpec,
    IndicatorTable,
    ModelGraph,
    Plan,
    QsyncInputError,
    SchemaVersionError,
    SolveReport,
    estimate,
    get_device,
    load,
    load_cluster,
    save,
)
from qsync_opt.core.precision import Precision
from qsync_opt.documents.io import parse_document
from qsync_opt.documents.schemas import SCHEMAS, GroupPlan, json_schema, schema_names


def _docs(digits_graph: ModelGraph) -> list[Any]:
    cluster = load_cluster("v100x2+t4x2")
    costs = estimate(digits_graph, cluster)
    ch = [o.name for o in digits_graph.choosable_ops()]
    plan = Plan(
        workload="digits_cnn", graph_hash=digits_graph.structure_hash(), cluster=cluster,
        groups={
            "v100": GroupPlan(batch_per_device=64, precisions={n: Precision.fp16 for n in ch}),
            "t4": GroupPlan(batch_per_device=32, precisions={n: Precision.int8 for n in ch}),
        },
        provenance={"solver": "hand", "objective": 0.5},
    )
    indicator = IndicatorTable(
        workload="digits_cnn", graph_hash=digits_graph.structure_hash(), method="qsync",
        batch_size=64, batches=10, seed=0, gamma=4.0, data="real",
        values={n: {Precision.fp32: 0.0, Precision.int8: 1.5} for n in ch},
    )
    report = SolveReport(solver="cpsat", status="OPTIMAL", mode="min degradation",
                         objective=1.0, bound=1.0, gap=0.0, options={"threads": 2})
    return [get_device("t4"), cluster, digits_graph, costs, plan, indicator, report]


def test_every_document_round_trips(digits_graph: ModelGraph, tmp_path) -> None:
    for doc in _docs(digits_graph):
        path = save(doc, tmp_path / f"{doc.SCHEMA_NAME}.json")
        data = json.loads(path.read_text())
        assert data["schema_name"] == doc.SCHEMA_NAME and data["schema_version"] == 1
        assert load(path, type(doc)) == doc
        assert type(doc).model_validate_json(doc.model_dump_json()) == doc


def test_frozen_and_extra_fields_refused(digits_graph: ModelGraph) -> None:
    with pytest.raises(ValidationError):
        digits_graph.batch_size = 3  # type: ignore[misc]
    data = digits_graph.model_dump(mode="json")
    data["surprise"] = 1
    with pytest.raises(QsyncInputError, match="surprise"):
        parse_document(data, ModelGraph)
    data = digits_graph.model_dump(mode="json")
    data["ops"][0]["flops"] = 1  # a misspelled field inside an op
    with pytest.raises(QsyncInputError, match=r"ops\.0\.flops"):
        parse_document(data, ModelGraph)


def test_unknown_version_and_wrong_kind_refused(digits_graph: ModelGraph, tmp_path) -> None:
    data = digits_graph.model_dump(mode="json")
    data["schema_version"] = 2
    with pytest.raises(SchemaVersionError, match="reads version 1"):
        parse_document(data, ModelGraph)
    with pytest.raises(ValidationError, match="reads version 1"):
        ModelGraph.model_validate(data)
    path = save(load_cluster("t4x2"), tmp_path / "c.json")
    with pytest.raises(SchemaVersionError, match="expected 'ModelGraph'"):
        load(path, ModelGraph)


def test_plan_groups_must_match_cluster(digits_graph: ModelGraph) -> None:
    plan = _docs(digits_graph)[4]
    data = plan.model_dump(mode="json")
    del data["groups"]["t4"]
    with pytest.raises(QsyncInputError, match="do not match"):
        parse_document(data, Plan)


def test_graph_edges_must_reference_ops_in_order(digits_graph: ModelGraph) -> None:
    data = digits_graph.model_dump(mode="json")
    data["edges"][0]["dst"] = "ghost"
    with pytest.raises(QsyncInputError, match="unknown op 'ghost'"):
        parse_document(data, ModelGraph)
    data = digits_graph.model_dump(mode="json")
    e = data["edges"][0]
    e["src"], e["dst"] = e["dst"], e["src"]
    with pytest.raises(QsyncInputError, match="topological"):
        parse_document(data, ModelGraph)


def test_indicator_values_non_negative(digits_graph: ModelGraph) -> None:
    data = _docs(digits_graph)[5].model_dump(mode="json")
    first = next(iter(data["values"]))
    data["values"][first]["int8"] = -1.0
    with pytest.raises(QsyncInputError, match="must be >= 0"):
        parse_document(data, IndicatorTable)


def test_json_schema_for_every_name() -> None:
    for name in schema_names():
        schema = json_schema(name)
        assert schema["type"] == "object" and schema["additionalProperties"] is False
    graph_schema = json_schema("ModelGraph")
    assert graph_schema["properties"]["schema_name"]["const"] == "ModelGraph"
    assert set(SCHEMAS) >= {"DeviceSpec", "ClusterSpec", "ModelGraph", "CostTable",
                            "IndicatorTable", "Plan", "SolveReport"}
    with pytest.raises(QsyncInputError, match="known: "):
        json_schema("Nope")


# ------------------------------------------------------------------ hypothesis: bad input

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):
            out += _paths(v, (*prefix, i))
    return out


def _mutate(doc: dict[str, Any], path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    doc = copy.deepcopy(doc)
    cur: Any = doc
    for key in path[:-1]:
        cur = cur[key]
    cur[path[-1]] = value
    return doc


@pytest.fixture(scope="module")
def valid_docs(digits_graph: ModelGraph) -> list[tuple[type, dict[str, Any]]]:
    return [(type(d), d.model_dump(mode="json")) for d in _docs(digits_graph)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_documents_fail_cleanly(valid_docs, data) -> None:
    cls, doc = data.draw(st.sampled_from(valid_docs))
    path = data.draw(st.sampled_from(_paths(doc)))
    value = data.draw(json_values)
    bad = _mutate(doc, path, value)
    try:
        parsed = parse_document(bad, cls)
    except QsyncInputError as exc:
        assert str(exc) and "\n" not in str(exc)
    else:
        # Accepted: then it must be a valid document that round-trips.
        assert type(parsed).model_validate_json(parsed.model_dump_json()) == parsed


@settings(max_examples=100, deadline=None)
@given(
    count=st.integers(-5, 40), per_node=st.integers(-2, 16),
    bw=st.floats(allow_nan=True, allow_infinity=True), device=st.text(max_size=10)
    | st.sampled_from(["t4", "v100", "a100", "h100", "cpu"]),
)
def test_cluster_fields_validate(count, per_node, bw, device) -> None:
    data = {"groups": [{"name": "g", "device": device, "count": count,
                        "devices_per_node": per_node}],
            "inter_node_bandwidth_gb_per_s": bw}
    try:
        spec = parse_document(data, ClusterSpec)
    except QsyncInputError as exc:
        msg = str(exc)
        assert any(f in msg for f in ("count", "devices_per_node", "inter_node_bandwidth",
                                      "device"))
    else:
        assert spec.groups[0].count >= 1 and spec.inter_node_bandwidth_gb_per_s > 0
        assert spec.groups[0].devices_per_node >= 1


def test_negative_bandwidth_names_the_field() -> None:
    with pytest.raises(QsyncInputError, match="inter_node_bandwidth_gb_per_s"):
        parse_document({"groups": [{"name": "a", "device": "t4", "count": 1}],
                        "inter_node_bandwidth_gb_per_s": -1}, ClusterSpec)


def test_device_and_cost_docs_refuse_bad_numbers() -> None:
    t4 = get_device("t4").model_dump(mode="json")
    t4["memory_bandwidth_gb_per_s"] = 0
    with pytest.raises(QsyncInputError, match="memory_bandwidth_gb_per_s"):
        parse_document(t4, DeviceSpec)
    with pytest.raises(QsyncInputError, match="status"):
        parse_document({"solver": "x", "status": "GREAT", "mode": "m"}, SolveReport)
    with pytest.raises(QsyncInputError):
        parse_document([], CostTable)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_solve_report_reads_back_equal_whatever_its_floats(value) -> None:
    """A report's non-finite objective, bound, gap or option is written as null: in memory
    it is None already, so a report read back equals the one written; a time taken is
    never non-finite (hypothesis found build_s=inf accepted and then unreadable)."""
    report = SolveReport(solver="highs", status="FEASIBLE", mode="m", objective=value,
                         bound=value, gap=value, options={"x": value},
                         rounds=[{"target_ms": value, "n": 1}])
    assert report.objective is None and report.bound is None and report.gap is None
    assert report.options == {"x": None} and report.rounds == [{"target_ms": None, "n": 1}]
    assert SolveReport.model_validate_json(report.model_dump_json()) == report
    for field in ("build_s", "solve_s", "wall_s"):
        with pytest.raises(QsyncInputError, match=field):
            parse_document({"solver": "x", "status": "OPTIMAL", "mode": "m", field: value},
                           SolveReport)
