"""IncrementalReplay against Replayer.simulate on both activation flows.

The greedy allocator decides on the incremental replay's time and memory, the evaluator on
simulate()'s; they must be one answer. Random plans, then random sequences of unit moves
(every op of a tie group set together, as the greedy does) and what-ifs, on several
workloads and clusters, with estimated (native-flow) tables and the same tables marked as
profiled on the runtime (``activation_flow="fp32"``, whose memory is the runtime's timeline
rather than a sum).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qsync_opt import estimate, load_cluster, trace
from qsync_opt.core.precision import Precision
from qsync_opt.problem.synthetic import synthetic_graph
from qsync_opt.replayer import Replayer

WORKLOADS = (("digits_cnn", 8), ("tiny_gpt", 4), ("resnet18", 2), ("synthetic", 0))
#: cpux1 has no context reserve, so a few bytes of difference would show in the relative test.
CLUSTERS = ("cpux1", "v100x2+t4x2", "h100x2+l4x2+t4x2")
FLOWS = ("native", "fp32")


@pytest.fixture(scope="module")
def replayers() -> dict[tuple[str, str, str], Replayer]:
    out = {}
    for model, batch in WORKLOADS:
        graph = synthetic_graph(6, seed=3, batch=16) if model == "synthetic" else trace(
            model, batch=batch)
        for shorthand in CLUSTERS:
            cluster = load_cluster(shorthand)
            costs = estimate(graph, cluster)
            for flow in FLOWS:
                table = costs.model_copy(update={"activation_flow": flow})
                out[(model, shorthand, flow)] = Replayer(graph, cluster, table)
    return out


def _units(rep: Replayer) -> list[list[str]]:
    """Choosable ops grouped as one decision (tie groups together)."""
    by: dict[str, list[str]] = {}
    for op in rep.graph.choosable_ops():
        by.setdefault(op.tie_group or f"op:{op.name}", []).append(op.name)
    return list(by.values())


def _allowed(rep: Replayer, group: int, ops: list[str]) -> list[Precision]:
    menu = rep.groups[group].menu
    common = None
    for name in ops:
        op = rep.ops[rep.index[name]]
        allowed = {p for p in op.allowed_precisions if p in menu}
        common = allowed if common is None else common & allowed
    return sorted(common or (), key=lambda p: p.value)


def _random_plan(rep: Replayer, data: st.DataObject) -> dict[str, dict[str, Precision]]:
    plan: dict[str, dict[str, Precision]] = {}
    for gi, grp in enumerate(rep.groups):
        row = {}
        for ops in _units(rep):
            p = data.draw(st.sampled_from(_allowed(rep, gi, ops)))
            row.update({name: p for name in ops})
        plan[grp.name] = row
    return plan


def _assert_same(got, full) -> None:
    assert got.iteration_ms == pytest.approx(full.iteration_ms, rel=1e-9)
    for name, g in full.groups.items():
        assert got.peak_memory_bytes[name] == pytest.approx(g.peak_memory_bytes, rel=1e-9)
        assert got.compute_ms[name] == pytest.approx(g.compute_ms, rel=1e-9)
    assert got.fits == full.fits


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_incremental_equals_simulate_on_both_flows(replayers, data) -> None:
    key = data.draw(st.sampled_from(sorted(replayers)))
    rep = replayers[key]
    assert rep.native_flow == (key[2] == "native")
    plan = _random_plan(rep, data)
    inc = rep.incremental(plan)
    _assert_same(inc.state(), rep.simulate(plan, events=False))
    units = _units(rep)
    for _ in range(data.draw(st.integers(1, 10))):
        gi = data.draw(st.integers(0, len(rep.groups) - 1))
        ops = data.draw(st.sampled_from(units))
        p = data.draw(st.sampled_from(_allowed(rep, gi, ops)))
        group = rep.groups[gi].name
        if len(ops) == 1 and data.draw(st.booleans()):
            # A what-if answers for the changed plan and leaves the replay as it was.
            before = inc.state()
            old = inc.precision(group, ops[0])
            got = inc.what_if(group, ops[0], p)
            changed = inc.plan()
            changed[group][ops[0]] = p
            _assert_same(got, rep.simulate(changed, events=False))
            assert inc.precision(group, ops[0]) == old
            after = inc.state()
            assert after.iteration_ms == pytest.approx(before.iteration_ms, rel=1e-9)
            assert after.peak_memory_bytes == before.peak_memory_bytes
        else:
            for name in ops:
                got = inc.set(group, name, p)
        _assert_same(inc.state(), rep.simulate(inc.plan(), events=False))
