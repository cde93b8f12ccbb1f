"""The packet simulator (qsync_opt.netsim): analytic cases exactly, policies equal without
congestion, spraying against hash collisions, bounded loss under incast, the bound p, the
event cap, determinism, and the loss handed to the runtime's DLCP drop mask."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.netsim import (
    Bucket,
    FabricSpec,
    NetConfig,
    NetsimLimit,
    Sim,
    fabric,
    simulate_iteration,
    single_link,
    star,
)
from qsync_opt.netsim.cluster import (
    cluster_network,
    params_bucket,
    parse_comm_model,
    run_iterations,
)
from qsync_opt.netsim.traffic import summarise
from qsync_opt.strategy.droppolicy import ChunkTable, apply_drops
from qsync_opt.sync.netloss import drop_mask

BIG = 1 << 40  # a buffer that never fills
HUGE_WINDOW = 10**9


def _wire(nbytes: int, mss: int, header: int) -> tuple[int, int, int]:
    """(packets, wire bytes, last packet's wire bytes) of one message."""
    n = -(-nbytes // mss)
    return n, nbytes + n * header, nbytes - (n - 1) * mss + header


@pytest.mark.parametrize("nbytes,mss,header", [(100_000, 1000, 0), (123_457, 1448, 52),
                                               (1, 1448, 40), (5 << 20, 64 << 10, 40)])
@pytest.mark.parametrize("gbps,delay_us", [(10.0, 5.0), (1.0, 50.0), (100.0, 0.0)])
def test_one_bottleneck_link_is_serialisation_plus_delay(nbytes, mss, header, gbps, delay_us):
    sim = Sim(single_link(gbps, delay_us, BIG))
    done = []
    sim.connection(0, 1, mss=mss, header=header, init_cwnd=HUGE_WINDOW).send(
        nbytes, on_done=done.append)
    sim.run()
    _, wire, _ = _wire(nbytes, mss, header)
    expect = wire * 8 / (gbps * 1e9) + delay_us * 1e-6
    assert done == [pytest.approx(expect, rel=1e-12, abs=1e-15)]


@pytest.mark.parametrize("senders", [1, 2, 5, 16])
def test_incast_completion_is_the_bottleneck_formula(senders):
    """N senders, B bytes each, through one switch port: the port is busy from the first
    packets' arrival until every wire byte has left it."""
    gbps, d_us, mss, header, nbytes = 10.0, 3.0, 1460, 40, 50 * 1460
    topo = star(senders, gbps, d_us, BIG)
    sim = Sim(topo)
    r = topo.names.index("r")
    done = []
    for h in range(senders):
        sim.connection(h, r, mss=mss, header=header, init_cwnd=HUGE_WINDOW).send(
            nbytes, on_done=done.append)
    sim.run()
    n, wire, last = _wire(nbytes, mss, header)
    rate = gbps * 1e9 / 8
    first = (mss + header) / rate
    expect = first + senders * wire / rate + 2 * d_us * 1e-6
    assert max(done) == pytest.approx(expect, rel=1e-12)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_ring_all_reduce_on_a_star_is_2_n_minus_1_steps(n):
    gbps, d_us, mss, header = 10.0, 2.0, 1000, 0
    size = 40_000 * n  # n equal chunks of whole packets
    topo = star(n - 1, gbps, d_us, BIG)  # n hosts: h0..h(n-2) and r
    ranks = [i for i, h in enumerate(topo.is_host) if h]
    cfg = NetConfig(cell_bytes=mss, header_bytes=header, init_cwnd=HUGE_WINDOW)
    res = simulate_iteration(topo, ranks, [Bucket((("w", size, 0.0),))], [[0.0]] * n, cfg)
    rate = gbps * 1e9 / 8
    step = (size / n) / rate + mss / rate + 2 * d_us * 1e-6
    assert res.bucket_end_ms[0] == pytest.approx(2 * (n - 1) * step * 1e3, rel=1e-12)
    assert res.drops == 0 and res.retransmits == 0 and not res.lost_bytes


def _mixed_bucket() -> Bucket:
    return Bucket(tuple((f"l{i}", 30_000 + 1000 * i, i / 9) for i in range(10)))


@pytest.mark.parametrize("pattern", ["ring", "ps", "hierarchical"])
def test_without_congestion_every_policy_is_the_same(pattern):
    topo = fabric(FabricSpec(leaves=2, hosts_per_leaf=2, host_gbps=10, host_delay_us=1,
                             uplink_gbps=40, uplink_delay_us=2, spines=1, buffer_bytes=BIG,
                             extra_hosts=("ps",)))
    ranks = [0, 1, 2, 3]
    ps = topo.names.index("ps")
    bucket = _mixed_bucket()
    ready = [[0.0]] * 4 if pattern != "ring" else [[0.0], [0.01], [0.02], [0.03]]
    ends = set()
    for policy in ("fifo+tcp", "priority+bounded"):
        for routing in ("hash", "spray"):
            cfg = NetConfig(policy=policy, routing=routing, p=0.1, cell_bytes=1460)
            res = simulate_iteration(topo, ranks, [bucket], ready, cfg, pattern=pattern, ps=ps,
                                     nodes=[[0, 1], [2, 3]])
            assert res.drops == 0 and res.timeouts == 0 and not res.lost_bytes
            ends.add(round(res.bucket_end_ms[0], 12))
    assert len(ends) == 1


def test_spraying_lowers_the_busiest_uplink_against_hash_collisions():
    """Four flows from leaf 0 to leaf 1 over four spines: flow hashing puts several on one
    uplink for most salts; spraying splits every flow over all of them."""
    spec = FabricSpec(leaves=2, hosts_per_leaf=4, host_gbps=10, host_delay_us=1,
                      uplink_gbps=10, uplink_delay_us=1, spines=4, buffer_bytes=BIG)
    topo = fabric(spec)
    uplinks = [li.index for li in topo.links if topo.names[li.src] == "leaf0"
               and topo.names[li.dst].startswith("spine")]
    worse = 0
    peaks = {"hash": [], "spray": []}
    for seed in range(10):
        peak = {}
        for routing in ("hash", "spray"):
            sim = Sim(topo, routing=routing, seed=seed)
            for h in range(4):
                sim.connection(h, 4 + h, mss=1460, header=40).send(400 * 1460)
            sim.run()
            peak[routing] = max(sim.stats[li].bytes for li in uplinks)
        total = 4 * 400 * 1500
        assert peak["spray"] < 0.3 * total  # about a quarter on each
        worse += peak["hash"] > peak["spray"]
        for k, v in peak.items():
            peaks[k].append(v)
    # four flows hashed onto four paths land one each with probability 4!/4^4 = 9%
    assert worse >= 8
    assert sum(peaks["spray"]) < 0.7 * sum(peaks["hash"])


def _incast(policy: str, seeds: int = 40, p: float = 0.05):
    n = 16
    topo = star(n, 10, 5, 1500 * 32)
    r = topo.names.index("r")
    cfg = NetConfig(policy=policy, p=p, cell_bytes=1460, header_bytes=40, start_jitter_us=20)
    # DDP's wire order: the back layers (position 1, lowest priority) first
    bucket = Bucket(tuple((f"l{i}", 25_000, 1 - i / 9) for i in range(10)))
    return [simulate_iteration(topo, list(range(n)), [bucket], [[0.0]] * n, cfg, pattern="ps",
                               ps=r, seed=s) for s in range(seeds)]


def test_under_incast_priority_drops_fall_on_the_back_layers():
    """Strict-priority push-out takes its loss from the lowest classes: the back layer (l0,
    sent first, lowest priority) loses more than the front layer (l9). Whether this cuts the
    p99 against FIFO + TCP is a measurement, not a property: docs/NETSIM.md reports it."""
    tcp, dlcp = _incast("fifo+tcp", seeds=10), _incast("priority+bounded", seeds=10)
    assert sum(r.drops for r in tcp) > 0 and sum(r.timeouts for r in tcp) > 0  # congested
    assert summarise(tcp)["lost_fraction"] == 0.0  # TCP retransmits everything
    assert 0.0 < summarise(dlcp)["lost_fraction"] <= 0.05
    lost = {name: sum(r.lost_bytes.get(name, 0) for r in dlcp) for name in ("l0", "l9")}
    assert lost["l0"] > lost["l9"]


def _one_drop(bounded: float | None, drop: int | None, n: int = 20) -> tuple[float, Any]:
    """One n-packet message over one link; the first transmission of packet ``drop`` is lost."""
    sim = Sim(single_link(10, 5, BIG))
    conn = sim.connection(0, 1, mss=1460, header=40, init_cwnd=HUGE_WINDOW, bounded=bounded)
    enqueue = sim.enqueue

    def lossy(li: int, pkt: Any) -> None:
        if pkt.seq == drop and conn.sent[pkt.seq] == 1 and sim.topo.is_host[sim.topo.links[li].src]:
            sim._drop(li, pkt)
            return
        enqueue(li, pkt)
    sim.enqueue = lossy  # type: ignore[method-assign]
    done: list[float] = []
    msg = conn.send(n * 1460, on_done=done.append)
    sim.run()
    return done[0], (conn, msg)


def test_a_lost_packet_costs_tcp_a_retransmission_and_bounded_loss_nothing():
    clean, _ = _one_drop(None, None)
    tcp, (c_tcp, m_tcp) = _one_drop(None, 10)
    bounded, (c_b, m_b) = _one_drop(0.1, 10)
    assert c_tcp.retransmits == 1 and c_tcp.timeouts == 0 and m_tcp.missing == []
    # the retransmission leaves when the third later packet's ack is back: one RTT after 13
    assert tcp > clean + 1e-6
    # bounded: packet 10 is given up once found lost (no retransmission), zero-filled, and
    # the message completes when the sender's notice reaches the receiver: before TCP's
    assert c_b.retransmits == 0 and m_b.missing == [10]
    assert clean < bounded < tcp


@pytest.mark.parametrize("p", [0.01, 0.05, 0.2])
def test_the_bounded_transport_never_loses_more_than_p_of_a_message(p):
    n = 8
    topo = star(n, 10, 5, 1500 * 8)
    r = topo.names.index("r")
    cfg = NetConfig(policy="priority+bounded", p=p, cell_bytes=1460, start_jitter_us=10)
    sim_runs = 0
    for seed in range(5):
        sim = Sim(topo, queue="priority", seed=seed)
        msgs = []
        for h in range(n):
            c = sim.connection(h, r, mss=cfg.cell_bytes, header=40, bounded=p)
            msgs.append(c.send(200 * 1460, prio=lambda i, k: i * 8 // k))
        sim.run()
        sim_runs += 1
        for m in msgs:
            assert m.done_s is not None
            assert len(m.missing) <= math.floor(p * m.n + 1e-9)
            assert m.given_up <= m.budget
    assert sim_runs == 5


def test_same_seed_same_iteration_and_spray_depends_on_the_seed():
    spec = FabricSpec(leaves=2, hosts_per_leaf=4, host_gbps=10, host_delay_us=1,
                      uplink_gbps=5, uplink_delay_us=1, spines=2, buffer_bytes=64 * 1500)
    topo = fabric(spec)
    cfg = NetConfig(routing="spray", cell_bytes=1460, jitter=0.05)
    ranks = [0, 4, 1, 5, 2, 6, 3, 7]  # interleaved: every hop crosses the fabric
    ready = [[0.1, 0.3]] * 8
    buckets = [_mixed_bucket(), _mixed_bucket()]
    a = simulate_iteration(topo, ranks, buckets, ready, cfg, seed=3)
    b = simulate_iteration(topo, ranks, buckets, ready, cfg, seed=3)
    c = simulate_iteration(topo, ranks, buckets, ready, cfg, seed=4)
    assert a.bucket_end_ms == b.bucket_end_ms and a.link_bytes == b.link_bytes
    assert a.events == b.events
    assert a.bucket_end_ms != c.bucket_end_ms


def test_the_event_cap_names_the_cell_size():
    topo = single_link(10, 1, BIG)
    sim = Sim(topo, max_events=100, cell_bytes=1460)
    sim.connection(0, 1, mss=1460).send(1 << 20)
    with pytest.raises(NetsimLimit, match="1460 bytes.*cell size"):
        sim.run()


def test_a_cluster_run_refuses_before_simulating_when_cells_are_too_small():
    from qsync_opt.costs.cluster import load_cluster

    cl = load_cluster("v100x16+t4x16")
    net = cluster_network(cl, "ring")
    bucket = Bucket((("w", 100 << 20, 0.0),))
    cfg = NetConfig(cell_bytes=1460, max_events=1_000_000)
    with pytest.raises(NetsimLimit, match=r"to \d+ KiB or max_events"):
        run_iterations(net, [bucket], [[0.0], [0.0]], cfg, pattern="ring", iterations=1)


def test_cluster_fabric_shapes():
    from qsync_opt.costs.cluster import load_cluster

    cl = load_cluster("v100x16+t4x16")
    ring = cluster_network(cl, "ring")
    over = cluster_network(cl, "oversubscribed")
    inc = cluster_network(cl, "incast")
    assert len(ring.ranks) == 32 and len(ring.nodes) == 4 and ring.ps is None
    assert sorted(over.ranks) == sorted(ring.ranks) and over.ranks != ring.ranks
    # interleaved: consecutive ranks sit on different nodes
    node_of = {h: i for i, hs in enumerate(over.nodes) for h in hs}
    assert all(node_of[over.ranks[i]] != node_of[over.ranks[i + 1]] for i in range(31))
    assert inc.ps is not None and inc.topo.names[inc.ps] == "ps"


def test_the_simulators_loss_is_the_runtimes_drop_mask():
    """The loss of one message, handed in: the chunks the lost packets carried are the ones
    apply_drops zero-fills, element for element (cells the size of the runtime's chunks)."""
    numels = [4096, 1024, 8192, 2048]
    chunk = 256
    table = ChunkTable.build(numels, chunk)
    bucket = params_bucket(numels)
    n = 16
    topo = star(n, 10, 5, 1040 * 4)
    r = topo.names.index("r")
    cfg = NetConfig(policy="priority+bounded", p=0.2, cell_bytes=chunk * 4, header_bytes=16)
    res = simulate_iteration(topo, list(range(n)), [bucket], [[0.0]] * n, cfg, pattern="ps",
                             ps=r, seed=1)
    lost = [(off, size) for k, off, size in res.lost_ranges]
    assert lost, "the case must lose packets"
    mask = drop_mask(table, bucket, lost)
    grads = [torch.ones(k) for k in numels]
    per_param = apply_drops(grads, table, mask)
    assert sum(per_param) * 4 == sum(size for _, size in lost_unique(lost))
    # layer names of the bucket are parameter indices: the per-layer loss agrees
    for i, k in enumerate(per_param):
        assert res.lost_bytes.get(str(i), 0) >= k * 4


def lost_unique(lost):
    return sorted(set(lost))


def test_comm_model_texts():
    assert parse_comm_model(None).kind == "analytic"
    s = parse_comm_model("netsim:p99,scenario=incast,policy=priority+bounded,iterations=7,"
                         "cell_kib=64,p=0.1")
    assert (s.quantile, s.scenario, s.iterations, s.config.cell_bytes, s.config.p) == (
        0.99, "incast", 7, 64 << 10, 0.1)
    assert s.config.bounded == 0.1
    for bad, what in [("netsim:p90", "expected"), ("netsim:p50,scenario=mesh", "scenario"),
                      ("netsim:p50,iterations=0", "iterations"), ("netsim:p50,foo=1", "foo"),
                      ("netsim:p50,p=0.9", "p:"), ("netsim:p50,cell_kib", "KEY=VALUE")]:
        with pytest.raises(QsyncInputError, match=what):
            parse_comm_model(bad)


def test_netsim_cli_prints_writes_json_and_png(tmp_path, capsys):
    import json

    from qsync_opt.cli import main

    out, png = tmp_path / "n.json", tmp_path / "n.png"
    rc = main(["netsim", "--model", "digits_cnn", "--cluster", "v100x4+t4x4", "--scenario",
               "incast", "--iterations", "3", "--cell-kib", "4", "--json", str(out),
               "--png", str(png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "p50" in text and "p99" in text and "busiest links" in text
    doc = json.loads(out.read_text())
    assert doc["iterations"] == 3 and doc["pattern"] == "ps"
    assert doc["comm_end_ms"]["p50"] <= doc["comm_end_ms"]["p99"]
    assert doc["loss_per_layer"] and doc["links"]
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv,what", [
    (["--cluster", "v100x1"], "at least two devices"),
    (["--cluster", "v100x2", "--pattern", "ps"], "incast"),
    (["--cluster", "v100x2", "--cell-kib", "0"], "cell-kib"),
])
def test_netsim_cli_refuses_in_one_line(argv, what, capsys):
    from qsync_opt.cli import main

    with pytest.raises(SystemExit) as exc:
        rc = main(["netsim", "--model", "digits_cnn", "--iterations", "1", *argv])
        raise SystemExit(rc)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert what in err and "\n" not in err


def test_the_replayer_takes_bucket_times_from_the_simulator():
    from qsync_opt.costs.cluster import load_cluster
    from qsync_opt.costs.roofline import estimate
    from qsync_opt.graph import trace
    from qsync_opt.netsim.cluster import bucket_times_ms, with_netsim_comm
    from qsync_opt.replayer import Replayer

    g = trace("digits_cnn")
    cl = load_cluster("v100x4+t4x4").with_default_batch(g.batch_size)
    costs = estimate(g, cl)
    p50 = parse_comm_model("netsim:p50,iterations=5,cell_kib=4,scenario=incast")
    p99 = parse_comm_model("netsim:p99,iterations=5,cell_kib=4,scenario=incast")
    t50 = with_netsim_comm(g, cl, costs, p50)
    t99 = with_netsim_comm(g, cl, costs, p99)
    assert [b.allreduce_ms for b in t50.buckets] == bucket_times_ms(g, cl, costs, p50)
    assert all(a <= b for a, b in zip([b.allreduce_ms for b in t50.buckets],
                                      [b.allreduce_ms for b in t99.buckets], strict=True))
    assert "packet simulator" in t50.notes[-1]
    plan = Replayer(g, cl, costs).uniform("highest")
    base = Replayer(g, cl, costs).simulate(plan)
    net = Replayer(g, cl, t99).simulate(plan)
    # the incast scenario's parameter server is slower than the analytic ring here
    assert net.iteration_ms > base.iteration_ms
    assert net.bucket_ready_ms == base.bucket_ready_ms


def _lossless_fabric(uplink_gbps: float):
    spec = FabricSpec(leaves=2, hosts_per_leaf=4, host_gbps=10, host_delay_us=1,
                      uplink_gbps=uplink_gbps, uplink_delay_us=1, spines=2, buffer_bytes=BIG)
    return fabric(spec), [0, 4, 1, 5, 2, 6, 3, 7]  # interleaved: every hop crosses the fabric


def _totals(topo, ranks, cfg: NetConfig, seeds: int = 3) -> tuple[int, int, int, int]:
    drops = retx = lost = timeouts = 0
    for seed in range(seeds):
        r = simulate_iteration(topo, ranks, [_mixed_bucket(), _mixed_bucket()],
                               [[0.1, 0.3]] * 8, cfg, seed=seed)
        drops, retx = drops + r.drops, retx + r.retransmits
        lost, timeouts = lost + sum(r.lost_bytes.values()), timeouts + r.timeouts
    return drops, retx, lost, timeouts


ALL_POLICIES = ["fifo+tcp", "priority+bounded", "fifo+bounded", "priority+tcp"]


# both routings at the tighter uplink, where the queues come closest to their buffers (a
# looser one is the same class of network: congested, never full)
@pytest.mark.parametrize("routing,uplink_gbps", [("hash", 2.0), ("spray", 2.0)])
def test_a_network_that_drops_nothing_gives_up_and_retransmits_nothing(routing, uplink_gbps):
    """Congested uplinks, buffers that never fill: no drop, so nothing may be retransmitted,
    timed out or given up, under every policy. Under spraying the packets of a connection
    reorder across paths, and strict priority starves a class on one path for as long as
    the higher classes keep it busy; the sender's RACK runs per (class, path) and so never
    takes either for loss."""
    topo, ranks = _lossless_fabric(uplink_gbps)
    for policy in ALL_POLICIES:
        cfg = NetConfig(policy=policy, routing=routing, cell_bytes=1460, jitter=0.05)
        assert _totals(topo, ranks, cfg) == (0, 0, 0, 0), policy


def _scenario_totals(scenario: str, buffer_bytes: int, cfg: NetConfig) -> tuple[int, int, float, int]:
    from qsync_opt.costs.cluster import load_cluster
    from qsync_opt.netsim.cluster import SCENARIO_PATTERN

    net = cluster_network(load_cluster("v100x8+t4x8"), scenario, buffer_bytes=buffer_bytes)
    buckets = [_mixed_bucket(), _mixed_bucket()]
    ready = [[0.05, 0.1], [0.0, 0.2]]  # per group: the T4s' backward ends later
    runs = run_iterations(net, buckets, ready, cfg, pattern=SCENARIO_PATTERN[scenario],
                          iterations=2, seed=3)
    s = summarise(runs)
    return s["drops"], s["retransmits"], s["lost_fraction"], s["timeouts"]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["ring", "incast", "oversubscribed"])
def test_every_policy_and_routing_loses_nothing_without_drops_and_recovers_with_them(scenario):
    """The class, on the cluster fabric: every scenario x policy x routing. With buffers
    that never fill: no drop, no retransmission, no timeout, nothing given up. With small
    buffers: drops, and every one found (retransmitted, or given up within the bound p):
    the iteration completes (run_iterations raises otherwise) and TCP gives nothing up."""
    for policy in ALL_POLICIES:
        for routing in ("hash", "spray"):
            cfg = NetConfig(policy=policy, routing=routing, cell_bytes=4096, p=0.05)
            assert _scenario_totals(scenario, BIG, cfg) == (0, 0, 0.0, 0), (policy, routing)
            drops, retx, lost, _ = _scenario_totals(scenario, 16 << 10, cfg)
            assert drops > 0, (policy, routing)
            assert retx + lost > 0 and lost <= 0.05, (policy, routing)
            if cfg.bounded is None:
                assert lost == 0.0 and retx >= drops, (policy, routing)


def test_duplicate_thresholds_take_spraying_reordering_for_loss():
    """The control: the same lossless network under dupthresh (ns-3's rule) retransmits
    and gives up gradient that was never lost; RACK does neither under FIFO."""
    topo, ranks = _lossless_fabric(5.0)
    for policy in ("fifo+tcp", "fifo+bounded"):
        old = _totals(topo, ranks, NetConfig(policy=policy, routing="spray", cell_bytes=1460,
                                             jitter=0.05, detect="dupthresh"))
        new = _totals(topo, ranks, NetConfig(policy=policy, routing="spray", cell_bytes=1460,
                                             jitter=0.05))
        assert old[0] == 0 and old[1] + old[2] > 0
        assert new == (0, 0, 0, 0)


def test_the_minimum_rto_is_linuxs_and_stated():
    from qsync_opt.netsim.engine import DEFAULT_MIN_RTO_MS

    assert DEFAULT_MIN_RTO_MS == 200.0 and NetConfig().min_rto_ms == DEFAULT_MIN_RTO_MS
    sim = Sim(single_link(10, 1, BIG))
    assert sim.connection(0, 1, mss=1460).min_rto == pytest.approx(0.2)
    with pytest.raises(ValueError, match="detect"):
        NetConfig(detect="sometimes")


def test_topology_names_are_indexed():
    """Adding a node looks its name up in a dict (was a list scan: quadratic in nodes)."""
    from qsync_opt.netsim import Topology

    t = Topology()
    for i in range(20_000):
        t.host(f"h{i}")
    assert len(t.names) == 20_000
    with pytest.raises(ValueError, match="defined twice"):
        t.switch("h19999")


@pytest.mark.parametrize("argv,needle", [
    (["netsim", "--model", "digits_cnn", "--cluster", "cpux2", "--max-events", "10"],
     "--cell-kib 2048 or more, or raise --max-events"),
    (["netsim", "--model", "digits_cnn", "--cluster", "h100x1000"], "raise --max-events"),
    (["netsim", "--model", "digits_cnn", "--cluster", "h100x100000"], "at most 4,096 devices"),
    (["netsim", "--model", "digits_cnn", "--cluster", "h100x4097", "--iterations", "1"],
     "at most 4,096 devices"),
    (["replay", "--model", "digits_cnn", "--cluster", "h100x1000", "--comm-model",
      "netsim:p50"], "comm-model: netsim: an iteration needs"),
    (["replay", "--model", "digits_cnn", "--cluster", "h100x9000", "--comm-model",
      "netsim:p99,policy=fifo+bounded"], "comm-model: cluster: the packet simulator"),
    (["solve", "--model", "digits_cnn", "--cluster", "h100x1000", "--comm-model",
      "netsim:p50", "--out", "{tmp}/p.json"], "use cell_kib=1024 or more"),
    (["replay", "--model", "digits_cnn", "--cluster", "cpux2", "--pipeline-stages", "2",
      "--comm-model", "netsim:p50,iterations=0"], "comm-model: iterations"),
    (["replay", "--model", "digits_cnn", "--cluster", "cpux2", "--pipeline-stages", "2",
      "--comm-model", "netsim:p50"], "--comm-model: not with --pipeline-stages"),
])
def test_simulator_limits_are_one_line_exit_2(argv, needle, tmp_path, capsys):
    from qsync_opt.cli import main

    rc = main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_the_ns3_leafspine_case_is_checked() -> None:
    from qsync_opt.netsim.ns3ref import _normalize

    good = {"kind": "leafspine", "hosts_per_leaf": 2, "bytes_each": 1000, "host_gbps": 1.0,
            "uplink_gbps": 1.0, "delay_us": 1.0, "buffer_packets": 10}
    out = _normalize(good, 0)
    assert out["spray"] is True and out["run"] == 1
    for bad, needle in [({"spray": 1}, "spray"), ({"run": 0}, "run"),
                        ({"hosts_per_leaf": 65}, "64 hosts"), ({"uplink_gbps": 0}, "uplink_gbps"),
                        ({"colour": 1}, "unknown")]:
        with pytest.raises(ValueError, match=needle):
            _normalize({**good, **bad}, 0)
