"""The ns-3 reference's leaf/spine case with per-packet random ECMP (the spray reference),
and the same case on our simulator.

``{"kind": "leafspine", "hosts_per_leaf": K, "bytes_each", "host_gbps", "uplink_gbps",
"delay_us", "buffer_packets", "mss"=1448, "min_rto_ms"=1.0, "spray"=true, "run"=1}``
(:func:`qsync_opt.netsim.ns3ref.run`): 2K hosts, K on each of two leaves, each leaf with one
uplink to each of two spines; every cable ``delay_us``, host cables ``host_gbps``, uplinks
``uplink_gbps``. Flow i goes from host i (leaf 0) to host K + i (leaf 1), all starting at
t = 0, so every packet crosses a spine. Every switch device queue holds ``buffer_packets``,
the hosts' own 10000 (never full). ``spray``: ns-3's ``Ipv4GlobalRouting::RandomEcmpRouting``
(every router draws each packet's next hop uniformly among the equal-cost ones: at a leaf,
the spine); without it ns-3's global routing takes the first route (one spine for every
flow: not a hash). ``run``: ns-3's RNG run (``RngSeedManager::SetRun``; seed 1), which the
random ECMP draws from. TCP and links as the other kinds (ns3ref's docstring). Result: as
``incast`` (``fct_ms`` per flow, ``completion_ms``, ``retx_packets``, ``lost_packets``...).

:func:`ours` runs the same case on :mod:`qsync_opt.netsim` (the same fabric by
:func:`~qsync_opt.netsim.topology.fabric`, 42-byte headers as ns-3's segments, the
handshake modelled, ns-3's 1 s initial RTO), with our ``spray`` or ``hash`` routing and
either loss detection (``rack``, ours; ``dupthresh``, ns-3's rule).
"""

from __future__ import annotations

from typing import Any

from qsync_opt.netsim.engine import Sim
from qsync_opt.netsim.topology import FabricSpec, fabric

#: payload and per-segment header bytes of ns-3's segments here (TCP 20 + IPv4 20 + PPP 2)
MSS, HEADER = 1448, 42


def ours(case: dict[str, Any], routing: str, detect: str, seed: int) -> dict[str, Any]:
    """``case`` (a ``leafspine`` case) on our simulator: completion (ms, the last flow's),
    retransmissions, drops and timeouts summed over the flows."""
    mss = int(case.get("mss", MSS))
    k, wire = int(case["hosts_per_leaf"]), mss + HEADER
    topo = fabric(FabricSpec(leaves=2, hosts_per_leaf=k, host_gbps=case["host_gbps"],
                             host_delay_us=case["delay_us"], uplink_gbps=case["uplink_gbps"],
                             uplink_delay_us=case["delay_us"], spines=2,
                             buffer_bytes=wire * int(case["buffer_packets"])))
    sim = Sim(topo, routing=routing, seed=seed)
    done: list[float] = []
    conns = [sim.connection(i, k + i, mss=mss, header=HEADER, init_cwnd=10,
                            min_rto_ms=float(case.get("min_rto_ms", 1.0)), initial_rto_ms=1000.0,
                            handshake=True, detect=detect) for i in range(k)]
    for c in conns:
        c.send(int(case["bytes_each"]), on_done=done.append)
    sim.run()
    return {"completion_ms": max(done) * 1e3, "retx_packets": sum(c.retransmits for c in conns),
            "lost_packets": sum(c.dropped for c in conns),
            "timeouts": sum(c.timeouts for c in conns)}


LEAFSPINE_CPP = r"""
namespace qsync_ns3ref {
using namespace ns3;

std::string RunLeafSpine(uint32_t k, uint64_t bytesEach, double hostGbps, double upGbps,
                         double delayUs, uint32_t buffer, uint32_t mss, double minRtoMs,
                         double stopS, bool spray, uint32_t run) {
    Reset();
    RngSeedManager::SetRun(run);
    Configure(mss, minRtoMs);
    Config::SetDefault("ns3::Ipv4GlobalRouting::RandomEcmpRouting", BooleanValue(spray));
    g_mss = mss;
    NodeContainer hosts;
    hosts.Create(2 * k);
    NodeContainer leaves;
    leaves.Create(2);
    NodeContainer spines;
    spines.Create(2);
    NodeContainer all(hosts, leaves, spines);
    PointToPointHelper hp, up;
    SetupLink(hp, hostGbps, delayUs, mss);
    SetupLink(up, upGbps, delayUs, mss);
    std::vector<NetDeviceContainer> links;
    std::vector<NetDeviceContainer> hostLinks;
    for (uint32_t i = 0; i < 2 * k; ++i) {
        NetDeviceContainer d = hp.Install(hosts.Get(i), leaves.Get(i / k));
        SetQueuePackets(d.Get(0), 10000);
        SetQueuePackets(d.Get(1), buffer);
        hostLinks.push_back(d);
        links.push_back(d);
    }
    for (uint32_t l = 0; l < 2; ++l) {
        for (uint32_t s = 0; s < 2; ++s) {
            NetDeviceContainer d = up.Install(leaves.Get(l), spines.Get(s));
            SetQueuePackets(d.Get(0), buffer);
            SetQueuePackets(d.Get(1), buffer);
            links.push_back(d);
        }
    }
    InternetStackHelper inet;
    inet.Install(all);
    Ipv4AddressHelper addr;
    std::vector<Ipv4InterfaceContainer> ifs;
    for (uint32_t i = 0; i < links.size(); ++i) {
        std::ostringstream net;
        net << "10." << (1 + i / 256) << "." << (i % 256) << ".0";
        addr.SetBase(Ipv4Address(net.str().c_str()), Ipv4Mask("255.255.255.0"));
        ifs.push_back(addr.Assign(links[i]));
    }
    return RunFlows(all, k, [&] {
        for (uint32_t i = 0; i < k; ++i) {
            AddFlow(i, hosts.Get(i), hostLinks[i].Get(0), hosts.Get(k + i),
                    ifs[k + i].GetAddress(0), bytesEach);
        }
    }, stopS, true);
}

}  // namespace qsync_ns3ref
"""
