"""Plan version 2: the strategy beside the precisions. Version-1 plans read and write byte
for byte as before and run as ddp/fp32/no pipeline; every strategy field round-trips; a
hand-edited version 2 that the runtime cannot run is refused in one line naming the field."""

from __future__ import annotations

import json

import pytest

from qsync_opt.core.errors import QsyncInputError, SchemaVersionError
from qsync_opt.costs.cluster import parse_shorthand
from qsync_opt.documents.base import parse_document, to_json
from qsync_opt.documents.jobstrategy import PipelineStrategy, Strategy, StrategyPrediction
from qsync_opt.documents.schemas import Plan
from qsync_opt.problem.plan import check_plan, make_plan
from qsync_opt.strategy.checks import check_strategy


@pytest.fixture(scope="module")
def plan_v1(digits_graph) -> Plan:
    return make_plan(digits_graph, parse_shorthand("cpux2@16+cpu/2x1@16"), {})


def _v2(plan: Plan, **strategy: object) -> Plan:
    return plan.model_copy(update={"schema_version": 2, "strategy": Strategy(**strategy)})


FULL = dict(
    sync="qsr:alpha=0.2,h_base=4", transport="fp32",
    predicted=StrategyPrediction(step_ms=12.5, compute_ms=10.0, comm_ms=2.5,
                                 bytes_per_step=1234.0, syncs_per_step=0.25,
                                 samples_per_s=3000.0, degradation=1.5,
                                 comm_model="alpha-beta ring"),
    risks=["local steps between averages: the QSR study's loss"], space="sync=ddp,qsr")


def test_a_version_1_plan_is_written_as_before_and_runs_the_defaults(plan_v1) -> None:
    text = to_json(plan_v1)
    data = json.loads(text)
    assert data["schema_version"] == 1 and "strategy" not in data
    back = parse_document(data, Plan)
    assert to_json(back) == text and back.strategy is None
    assert back.job_strategy == Strategy() and back.job_strategy.is_default


@pytest.mark.parametrize("strategy", [
    dict(sync="local:4"), dict(transport="fp16"),
    dict(transport="dlcp:p=0.05,policy=priority,chunk_kib=64,scenario=ring,iterations=4"),
    FULL,
    dict(pipeline=PipelineStrategy(stages=2, stage_groups=["cpu", "cpu_2"], cuts=["conv2"],
                                   micro_batches=4, compress_act="topk:0.1",
                                   compress_grad="quant:4,stochastic", feedback="ef")),
    dict(pipeline=PipelineStrategy(stages=3, stage_groups=["cpu", "cpu", "cpu_2"])),
])
def test_every_strategy_field_round_trips(plan_v1, digits_graph, strategy) -> None:
    plan = _v2(plan_v1, **strategy)
    data = json.loads(to_json(plan))
    assert data["schema_version"] == 2
    back = parse_document(data, Plan)
    assert back == plan and back.strategy == plan.strategy
    check_plan(back, digits_graph)  # the runtime can run it


def test_a_plan_made_in_memory_takes_the_version_of_its_content(plan_v1) -> None:
    data = plan_v1.model_dump()
    del data["schema_version"]
    assert Plan.model_validate(data).schema_version == 1
    data["strategy"] = {"sync": "local:2"}
    assert Plan.model_validate(data).schema_version == 2


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda d: d.update(schema_version=1), "a version-1 plan holds no strategy"),
    (lambda d: d.pop("strategy"), "a version-2 plan holds its strategy"),
    (lambda d: d["strategy"].update(sync=""), "sync: expected a printable"),
    (lambda d: d["strategy"].update(sync="ddp\x00"), "sync: expected a printable"),
    (lambda d: d["strategy"].update(transport="x" * 5000), "transport"),
    (lambda d: d["strategy"].update(sync=7), "sync"),
    (lambda d: d["strategy"].update(colour="red"), "colour"),
    (lambda d: d["strategy"].update(pipeline={"stages": 2, "stage_groups": ["cpu"]}),
     "2 stages need 2 groups"),
    (lambda d: d["strategy"].update(pipeline={"stages": 65, "stage_groups": ["cpu"] * 65}),
     "stages"),
    (lambda d: d["strategy"].update(pipeline={"stages": 2, "stage_groups": ["cpu", "../x"]}),
     "is not a group name"),
    (lambda d: d["strategy"].update(pipeline={"stages": 2, "stage_groups": ["cpu", "cpu_2"],
                                              "cuts": ["a", "b"]}), "2 stages need 1 cuts"),
    (lambda d: d["strategy"].update(predicted={"step_ms": float("nan")}), "step_ms"),
    (lambda d: d["strategy"].update(predicted={"step_ms": -1.0}), "step_ms"),
])
def test_a_malformed_strategy_is_one_line_naming_the_field(plan_v1, edit, needle) -> None:
    data = json.loads(to_json(_v2(plan_v1, sync="local:2")))
    edit(data)
    with pytest.raises(QsyncInputError) as err:
        parse_document(data, Plan)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_an_unknown_plan_version_is_refused_by_number(plan_v1) -> None:
    data = json.loads(to_json(plan_v1))
    for bad in (3, 0, True, 2.0, "2"):
        data["schema_version"] = bad
        with pytest.raises(SchemaVersionError, match="reads versions 1, 2"):
            parse_document(data, Plan)


@pytest.mark.parametrize(("strategy", "needle"), [
    (dict(sync="loca:2"), "strategy.sync: expected ddp, local:H"),
    (dict(sync="local:٣"), "strategy.sync"),
    (dict(sync="local:0"), "strategy.sync"),
    (dict(sync="qsr:alpha=nan,h_base=2"), "strategy.sync"),
    (dict(transport="fp8"), "strategy.transport: expected"),
    (dict(transport="dlcp:p=0.9"), "strategy.transport: dlcp's p"),
    (dict(sync="local:2", transport="fp16"), "sync local:2 with transport fp16"),
    (dict(sync="qsr:alpha=0.1,h_base=2", transport="dlcp:p=0.01"), "with transport dlcp"),
    (dict(sync="local:2", pipeline=PipelineStrategy(stages=2, stage_groups=["cpu", "cpu_2"])),
     "a pipeline has one replica of each stage"),
    (dict(pipeline=PipelineStrategy(stages=2, stage_groups=["cpu", "gpu"])),
     "group 'gpu' is not in the plan's cluster"),
    (dict(pipeline=PipelineStrategy(stages=3, stage_groups=["cpu", "cpu_2", "cpu_2"])),
     "2 stages on group 'cpu_2', which has 1 device(s)"),
    (dict(pipeline=PipelineStrategy(stages=2, stage_groups=["cpu", "cpu_2"],
                                    compress_act="topk:0")), "strategy.pipeline.compress_act"),
    (dict(pipeline=PipelineStrategy(stages=2, stage_groups=["cpu", "cpu_2"],
                                    compress_grad="quant:9")), "strategy.pipeline.compress_grad"),
])
def test_a_strategy_the_runtime_cannot_run_is_refused_by_check_plan(
        plan_v1, digits_graph, strategy, needle) -> None:
    plan = _v2(plan_v1, **strategy)  # a valid document: the rules are check_plan's
    with pytest.raises(QsyncInputError) as err:
        check_plan(plan, digits_graph)
    assert needle in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(QsyncInputError):
        check_strategy(plan.strategy, plan.cluster)


def test_the_pipeline_names_its_train_flags() -> None:
    pipe = PipelineStrategy(stages=2, stage_groups=["a", "b"], cuts=["conv2"],
                            micro_batches=4, compress_act="topk:0.1", feedback="ef")
    assert pipe.flags() == ("--pipeline-stages 2 --rank-groups 0:a,1:b --cuts conv2 "
                            "--micro-batches 4 --compress-act topk:0.1 --feedback ef")
