"""The emulated link's pure part: the formulas by hand, the figures between ranks as the
replayer's communication model prices them, and ``--emulate-link``'s text, hostile inputs
included (one line naming the flag)."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.costs.cluster import load_cluster
from qsync_opt.costs.link import (
    LinkSpec,
    allreduce_s,
    broadcast_s,
    parse_link,
    resolve_link,
    send_s,
)
from qsync_opt.costs.roofline import estimate
from qsync_opt.documents.schemas import Efficiencies
from qsync_opt.graph import trace


def test_the_formulas_by_hand() -> None:
    # 1 MB over two ranks at 1.25 GB/s, 50 us: 2(1)/2 * 1e6 / 1.25e9 = 0.8 ms, 2 hops 0.1 ms
    assert allreduce_s(1_000_000, 2, 1.25, 50) == pytest.approx(0.0009, abs=1e-15)
    # four ranks: 2*3/4 * 1e6 / 1e9 = 1.5 ms, 6 hops of 10 us = 0.06 ms
    assert allreduce_s(1_000_000, 4, 1.0, 10) == pytest.approx(0.00156, abs=1e-15)
    assert allreduce_s(1_000_000, 1, 1.0, 10) == 0.0  # one rank sends nothing
    # a broadcast to three others: the bytes once, 3 hops
    assert broadcast_s(2_000_000, 4, 2.0, 5) == pytest.approx(0.001 + 15e-6, abs=1e-15)
    assert send_s(500_000, 0.5, 100) == pytest.approx(0.001 + 1e-4, abs=1e-15)
    assert send_s(0, 0.5, 100) == pytest.approx(1e-4)  # latency alone


def _two_groups() -> LinkSpec:
    # two groups of two ranks, each group on one node: intra 10 GB/s, 5 us; between 1, 50
    return resolve_link("bw=1,latency_us=50,intra_bw=10,intra_latency_us=5",
                        load_cluster("cpux2+cpu/2x2"), ["cpu", "cpu", "cpu_2", "cpu_2"])


def test_pairs_and_rings_take_the_figures_of_their_links() -> None:
    link = _two_groups()
    assert link.pair(0, 1) == (10, 5) and link.pair(2, 3) == (10, 5)
    assert link.pair(1, 2) == (1, 50) and link.pair(0, 3) == (1, 50)
    assert link.ring([0, 1]) == (2, 10, 5)            # within a node
    assert link.ring() == (4, 1, 50)                  # crosses groups: the slowest link
    # a send over each kind of link, and an all-reduce of the whole ring
    assert link.delay_s("send", 10**6, [0, 1]) == pytest.approx(1e-4 + 5e-6)
    assert link.delay_s("send", 10**6, [3, 0]) == pytest.approx(1e-3 + 5e-5)
    assert link.delay_s("allreduce", 10**6) == pytest.approx(1.5e-3 + 6 * 5e-5)
    assert link.delay_s("broadcast", 10**6, [0, 1]) == pytest.approx(1e-4 + 5e-6)
    for bad in ([0], [0, 0], [0, 1, 2]):
        with pytest.raises(ValueError, match="two ranks"):
            link.delay_s("send", 1, bad)
    with pytest.raises(ValueError, match="not a rank"):
        link.delay_s("allreduce", 1, [0, 9])
    with pytest.raises(ValueError, match="kind"):
        link.delay_s("gather", 1)


def test_a_group_spread_over_nodes_crosses_the_inter_node_link() -> None:
    cluster = load_cluster("cpux4").model_copy(deep=True)
    group = cluster.groups[0].model_copy(update={"devices_per_node": 2})
    cluster = cluster.model_copy(update={"groups": [group]})
    link = LinkSpec.from_cluster(cluster, ["cpu"] * 4)
    assert [link.node_of(r) for r in range(4)] == [("cpu", 0), ("cpu", 0), ("cpu", 1),
                                                  ("cpu", 1)]
    assert link.pair(0, 1)[1] == cluster.intra_node_latency_us
    assert link.pair(1, 2) == (cluster.inter_node_bandwidth_gb_per_s,
                               cluster.inter_node_latency_us)


@pytest.mark.parametrize("shorthand", ["v100x16+t4x16", "cpux2", "cpux1+cpu/2x1",
                                       "a100x8+t4x8"])
def test_the_cluster_link_is_the_replayers_comm_model(shorthand: str) -> None:
    """The figures the emulated link takes from a cluster are those the replayer prices the
    whole cluster's all-reduce with (at a ring efficiency of 1: the emulated link delivers
    its figure)."""
    cluster = load_cluster(shorthand)
    ranks = [g.name for g in cluster.groups for _ in range(g.count)]
    link = LinkSpec.from_cluster(cluster, ranks)
    ours = link.comm_model()
    theirs = estimate(trace("digits_cnn"), cluster,
                      efficiencies=Efficiencies(network=1.0)).comm
    assert (ours.world_size, ours.bandwidth_gb_per_s, ours.latency_us) == (
        theirs.world_size, theirs.bandwidth_gb_per_s, theirs.latency_us)
    for nbytes in (32, 10**6, 10**8):
        assert link.delay_s("allreduce", nbytes) * 1e3 == pytest.approx(
            theirs.allreduce_ms(nbytes), rel=1e-12)
        assert link.delay_s("broadcast", nbytes) * 1e3 == pytest.approx(
            theirs.broadcast_ms(nbytes), rel=1e-12)


def test_descriptions_say_emulated() -> None:
    cpu2 = load_cluster("cpux2")
    assert resolve_link("bw=1.25,latency_us=50", cpu2, ["cpu", "cpu"]).describe() == \
        "emulated 1.25 GB/s, 50 us"
    assert resolve_link("cluster", load_cluster("cpux1+cpu/2x1"), ["cpu", "cpu_2"]
                        ).describe() == "emulated 12.5 GB/s, 10 us (the plan's cluster)"
    text = _two_groups().describe()
    assert text == ("emulated 1 GB/s, 50 us between groups and nodes; 10 GB/s (cpu), "
                    "10 GB/s (cpu_2), 5 us within a node")
    within = resolve_link("cluster", cpu2, ["cpu", "cpu"]).describe()
    assert within.startswith("emulated ") and within.endswith(
        "(cpu), 5 us within a node (the plan's cluster)")


def test_the_flag_reads_cluster_and_figures() -> None:
    assert parse_link(" Cluster ").from_cluster
    f = parse_link("bw=1.25, latency_us=50")
    assert f.figures == {"bw": 1.25, "latency_us": 50.0, "intra_bw": 1.25,
                         "intra_latency_us": 50.0}
    f = parse_link("latency_us=0,bw=2e1,intra_bw=100,intra_latency_us=1.5")
    assert f.figures == {"bw": 20.0, "latency_us": 0.0, "intra_bw": 100.0,
                         "intra_latency_us": 1.5}


@pytest.mark.parametrize("text, says", [
    ("", "expected cluster"),
    ("   ", "expected cluster"),
    ("fast", "is not KEY=VALUE"),
    ("bw=1", "latency_us is missing"),
    ("latency_us=5", "bw is missing"),
    ("bw=0,latency_us=5", "bw must be a number"),
    ("bw=-1,latency_us=5", "bw must be a number"),
    ("bw=nan,latency_us=5", "bw must be a number"),
    ("bw=inf,latency_us=5", "bw must be a number"),
    ("bw=1e999,latency_us=5", "bw must be a number"),
    ("bw=1e300,latency_us=5", "bw must be a number"),
    ("bw=1e-9,latency_us=5", "bw must be a number"),
    ("bw=١,latency_us=5", "bw must be a number"),
    ("bw=１,latency_us=5", "bw must be a number"),
    ("bw=1_0,latency_us=5", "bw must be a number"),
    ("bw=1,latency_us=-1", "latency_us must be a number"),
    ("bw=1,latency_us=nan", "latency_us must be a number"),
    ("bw=1,latency_us=1e7", "latency_us must be a number"),
    ("bw=1,latency_us=5,intra_bw=0", "intra_bw must be a number"),
    ("bw=1,latency_us=5,intra_latency_us=inf", "intra_latency_us must be a number"),
    ("bw=1,latency_us=5,speed=3", "unknown key 'speed'"),
    ("bw=1,bw=2,latency_us=5", "bw given twice"),
    ("bw=1,,latency_us=5", "is not KEY=VALUE"),
    ("=1", "is not KEY=VALUE"),
])
def test_hostile_flag_text_is_one_line_naming_the_flag(text: str, says: str) -> None:
    with pytest.raises(QsyncInputError) as err:
        parse_link(text)
    msg = str(err.value)
    assert msg.startswith("--emulate-link: ") and says in msg and "\n" not in msg


def test_a_rank_of_a_group_the_cluster_lacks_is_refused() -> None:
    with pytest.raises(QsyncInputError, match="^--emulate-link: rank 1's group 't4'"):
        resolve_link("cluster", load_cluster("cpux2"), ["cpu", "t4"])


def test_a_cluster_beyond_the_links_limits_is_refused_in_one_line() -> None:
    cluster = load_cluster("cpux1+cpu/2x1").model_copy(
        update={"inter_node_bandwidth_gb_per_s": 1e-6})
    with pytest.raises(QsyncInputError) as err:
        resolve_link("cluster", cluster, ["cpu", "cpu_2"])
    assert str(err.value).startswith("--emulate-link cluster: the plan's cluster gives ")
    assert "bandwidth_gb_per_s" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("field, value", [
    ("bandwidth_gb_per_s", math.nan), ("bandwidth_gb_per_s", -1.0),
    ("bandwidth_gb_per_s", math.inf), ("latency_us", -5.0), ("intra_latency_us", 1e9)])
def test_a_hand_edited_link_is_refused(field: str, value: float) -> None:
    doc = _two_groups().model_dump(mode="json")
    doc[field] = value
    with pytest.raises(ValidationError, match=field):
        LinkSpec.model_validate(doc)


def test_a_hand_edited_link_without_a_groups_figures_is_refused() -> None:
    doc = _two_groups().model_dump(mode="json")
    doc["intra_bandwidth_gb_per_s"] = {"cpu": 10.0, "cpu_2": 0.0}
    with pytest.raises(ValidationError, match="intra_bandwidth_gb_per_s"):
        LinkSpec.model_validate(doc)
    doc = _two_groups().model_dump(mode="json")
    del doc["devices_per_node"]["cpu_2"]
    with pytest.raises(ValidationError, match="no intra-node figures"):
        LinkSpec.model_validate(doc)
