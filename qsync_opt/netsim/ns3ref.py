"""ns-3 reference runner: the same small TCP scenarios as :mod:`qsync_opt.netsim`, run in ns-3.

Our own packet-level simulator is cross-checked against these numbers (target: within 10%).
ns-3 is optional: ``pip install ns3`` (or the project's extra ``pip install -e .[netsim]``,
which pins ns3==3.44.post0). Its Python bindings go through cppyy and ``from ns import ns``
takes 15-30 s, so :func:`run` starts ONE child process (``python -m qsync_opt.netsim.ns3ref``)
for a whole list of cases. The child JIT-compiles a small C++ driver (``_CPP`` below) through
cppyy, so the simulation itself and every trace callback run in C++ (no Python callbacks).
Each case is its own simulation: ``Simulator::Destroy()`` and ``Ipv4AddressGenerator::Reset()``
between cases; every ``Config::SetDefault`` below is set again for each case.

Cases (times in the results are milliseconds, floats; ``null`` where not reached)
--------------------------------------------------------------------------------
``{"kind": "bottleneck", "bytes", "gbps", "delay_us", "buffer_packets", "mss"=1448,
"min_rto_ms"=1.0}``: node 0 -- node 1, one point-to-point link, ``gbps`` each way, one-way
propagation delay ``delay_us``. One BulkSend flow (MaxBytes=bytes) from node 0 to a PacketSink
on node 1, both applications start at t=0. The only buffer that can drop is node 0's device
queue (``buffer_packets``); node 1's device queue (ACKs) is 10000 packets.
Result: ``fct_ms`` (last payload byte delivered to the sink minus the application start, 0),
``first_data_ms`` (when the first data segment -- not the SYN -- starts serialising on the
sender's device: the handshake cost), ``lost_packets`` (``queue_drops + tc_drops``),
``tx_packets`` (data segments the sender put on the wire, retransmissions included),
``retx_packets`` (data segments sent again below the highest sequence already sent),
``rx_bytes`` (payload bytes at the sink; equals ``bytes``), ``queue_drops``, ``tc_drops``,
``drops_by_node`` (node 0 = sender, 1 = receiver), ``wire_bytes_full_segment`` (PPP frame size
of a full-MSS segment, measured), ``syn_wire_bytes`` (the SYN's frame size, measured),
``removed_queue_disc``, ``completed`` (every byte delivered before ``stop_s``) and ``wall_s``. Note that the bottleneck
queue here is the sender's own device: ns-3 drops there locally (``tc_drops``, see below) and
TCP is not told (no TSQ / local-congestion feedback as in Linux); it finds out from dupACKs.

``{"kind": "incast", "senders": N, "bytes_each", "gbps", "delay_us", "buffer_packets",
"mss"=1448, "min_rto_ms"=1.0}``: N sender hosts, each on its own link (gbps, delay_us) to one
router; the router -> receiver link (same gbps and delay_us) is the bottleneck and the router's
device on it has a queue of ``buffer_packets``; every other device queue (senders, router's
sender-facing devices, receiver) is 10000 packets and never drops. Global routing
(``Ipv4GlobalRoutingHelper::PopulateRoutingTables``). All N flows start at t=0, flow i to a
PacketSink on port 5000+i of the receiver.
Result: ``fct_ms`` (list, sender order), ``completion_ms`` (max), ``first_data_ms`` (list),
``lost_packets``, ``queue_drops``, ``tc_drops``, ``drops_by_node`` (nodes 0..N-1 = senders,
N = router, N+1 = receiver), ``tx_packets``, ``retx_packets`` (totals), ``rx_bytes`` (total),
``wire_bytes_full_segment``, ``syn_wire_bytes``, ``removed_queue_disc``, ``completed``,
``wall_s``. Slow start
overshoots: 8 x 1 MB into 1000 packets already loses ~1000 packets; 4 x 250 kB (692 packets)
does not.

``{"kind": "leafspine", ...}``: two leaves, two spines, per-packet random ECMP
(:mod:`qsync_opt.netsim.ns3leafspine` documents it).

Every kind accepts ``"stop_s"`` (simulated-time safety limit, default 100 s); the simulation
also stops as soon as every sink has received all its bytes, so no FIN/TIME_WAIT is simulated
and drops/transmissions after the last delivery are not counted.

ns-3 configuration (ns-3.44; every value set explicitly per case unless marked "default")
-------------------------------------------------------------------------------------------
TCP (``Config::SetDefault``):

- ``ns3::TcpL4Protocol::SocketType`` = ``ns3::TcpNewReno`` (ns-3's default is TcpCubic).
  ns-3's NewReno slow start adds one segment to cwnd per ACK that acknowledges new data;
  congestion avoidance adds segment^2/cwnd per such ACK.
- ``ns3::TcpSocket::SegmentSize`` = mss (payload bytes per segment; ns-3 sends no MSS option).
- ``ns3::TcpSocket::InitialCwnd`` = 10 segments.
- ``ns3::TcpSocket::DelAckCount`` = 1 (every data segment is ACKed at once; ns-3 default 2).
- ``ns3::TcpSocket::SndBufSize`` = ``ns3::TcpSocket::RcvBufSize`` = 2**29 bytes (512 MiB;
  2**29 still fits the 14-bit window-scale limit); the window is never socket-limited.
- ``ns3::TcpSocketBase::Timestamp`` = false, so a data segment carries no TCP option:
  a full segment is mss + 20 (TCP) + 20 (IPv4) + 2 (PPP) bytes on the wire = **1490 bytes for
  mss=1448** (``wire_bytes_full_segment`` reports what was measured). Pure ACKs are 42 bytes,
  plus SACK blocks (2 + 8 per block, padded to 4) while the receiver holds out-of-order data.
- ``ns3::TcpSocketBase::Sack``: left at ns-3's default, **true** (SACK on; SACK-permitted is
  negotiated in the SYN/SYN-ACK, loss recovery uses the SACK scoreboard).
- ``ns3::TcpSocketBase::WindowScaling``: default, true.
- ``ns3::TcpSocketBase::MinRto`` = min_rto_ms.
- ``ns3::TcpSocketBase::ClockGranularity`` = 1 ms (its default, set explicitly):
  RTO = max(MinRto, SRTT + max(ClockGranularity, 4*RTTVAR)), doubled per back-off.
- ``ns3::RttEstimator::InitialEstimation``: default 1 s (only the SYN's RTO before any sample;
  ``ns3::TcpSocket::ConnTimeout`` default 3 s is the SYN retransmission timeout).
- ``ns3::TcpSocket::InitialSlowStartThreshold``: default, 4294967295 (UINT32_MAX: unbounded;
  slow start lasts until the first loss).
- ``ns3::TcpL4Protocol::RecoveryType``: default, ``ns3::TcpPrrRecovery`` (RFC 6937
  proportional rate reduction during fast recovery; ssthresh = max(2*mss, flight/2) on entry,
  NewReno's GetSsThresh).
- ``ns3::TcpSocketBase::ReTxThreshold``: default 3 dupACKs; ``LimitedTransmit``: default
  true; ``ns3::TcpSocket::TcpNoDelay``: default true (no Nagle); pacing: default off;
  ECN: default off.
- BulkSend ``SendSize`` = 65536 (how much the application writes per call; TCP cuts it into
  mss segments), ``MaxBytes`` = bytes; PacketSink ``Protocol`` = ``ns3::TcpSocketFactory``.

Links and queues:

- ``ns3::PointToPointNetDevice::DataRate`` = gbps * 1e9 bit/s; ``ns3::PointToPointChannel::Delay``
  = delay_us (rounded to 1 ns); ``InterframeGap``: default 0; ``Mtu`` = max(1500, mss + 40)
  (default 1500).
- Device queue: ``ns3::DropTailQueue<Packet>``. The point-to-point helper's default is a
  DropTailQueue of ``MaxSize`` 100 packets; here the type is set with
  ``PointToPointHelper::SetQueue`` and every device's ``MaxSize`` is set explicitly (in
  packets) as described per case. The packet being serialised has already left the queue, so
  a device holds up to MaxSize + 1 packets.
- Traffic-control layer: ``Ipv4AddressHelper::Assign`` installs ns-3's default root queue disc
  (FqCoDel) on every device; it is REMOVED with ``TrafficControlHelper::Uninstall`` right
  after, on every device (the driver checks that no root queue disc is left). IP then hands
  packets straight to the device, and the device DropTail queue is the only buffer. ns-3 stops
  the device's transmit queue (flow control via NetDeviceQueueInterface) once it is full, and a
  packet offered to a stopped queue is dropped by the traffic-control layer itself: those are
  ``tc_drops``; ``queue_drops`` are drops inside the DropTail queue (normally 0 for that
  reason). Either way: tail drop at MaxSize packets. Drop counts are from trace sources
  (``TrafficControlLayer::TcDrop`` and each device queue's ``Drop``), on all nodes. Results
  name the queue disc that was removed (``removed_queue_disc``).

Handshake: the SYN (50 bytes on the wire: 20 IP + 28 TCP with the window-scale and
SACK-permitted options + 2 PPP; the SYN-ACK is the same size) leaves at t=0; the receiver
answers at once; the sender then sends the pure handshake ACK (42 bytes) and, right behind it on
the same device, the first data segment. So ``first_data_ms`` = 2 * (one-way path delay) +
serialisation of SYN + SYN-ACK on every hop + serialisation of the 42-byte ACK on the sender's
link (measured: 0.101136 ms on 1 Gb/s / 50 us; 0.040194 ms for the first incast sender on
10 Gb/s / 10 us, two hops each way; later senders' SYNs queue behind it at the router).
Our simulator can either start its flows at ``first_data_ms`` or model the handshake itself.
The SYNs cross the bottleneck queue too: with many more senders than ``buffer_packets``
(e.g. 300 senders into 5 packets) SYNs are dropped and retried only after seconds
(``ConnTimeout``), so such flows finish seconds late or not before ``stop_s``
(``completed`` false, their ``fct_ms`` null).

Cost: the import is 13-19 s, the JIT of the driver ~3 s; most cases then take well under 1 s,
but a large burst loss is slow inside ns-3 (10 MB at 1 Gb/s into a 1000-packet sender queue:
1010 drops, ~22 s of wall time).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from qsync_opt.netsim.ns3leafspine import LEAFSPINE_CPP

MISSING_MESSAGE = (
    "ns-3's Python bindings are not installed: `pip install ns3` "
    "(or the project's extra: `pip install -e .[netsim]`)"
)

_DEFAULT_MSS = 1448
_DEFAULT_MIN_RTO_MS = 1.0
_DEFAULT_STOP_S = 100.0
_MAX_SENDERS = 249 * 256  # sender links use 10.(1 + i // 256).(i % 256).0/24
_TAIL_CHARS = 4000

_REQUIRED = {
    "bottleneck": ("bytes", "gbps", "delay_us", "buffer_packets"),
    "incast": ("senders", "bytes_each", "gbps", "delay_us", "buffer_packets"),
    "leafspine": ("hosts_per_leaf", "bytes_each", "host_gbps", "uplink_gbps", "delay_us",
                  "buffer_packets"),
}
_INT_KEYS = ("bytes", "bytes_each", "senders", "buffer_packets", "mss", "hosts_per_leaf", "run")
_OPTIONAL: dict[str, Any] = {"mss": _DEFAULT_MSS, "min_rto_ms": _DEFAULT_MIN_RTO_MS, "stop_s": _DEFAULT_STOP_S}
#: the leaf/spine kind's own optional keys: per-packet random ECMP (ns-3's
#: Ipv4GlobalRouting::RandomEcmpRouting) or not, and ns-3's RNG run number
_LEAFSPINE_OPTIONAL: dict[str, Any] = {"spray": True, "run": 1}


def available() -> bool:
    """True when ns-3's Python bindings (the ``ns3`` wheel: packages ``ns`` and ``ns3.ns``,
    plus cppyy) are installed. Nothing is imported: ``find_spec`` on top-level names only."""
    try:
        ns_stub = importlib.util.find_spec("ns")
        ns3_pkg = importlib.util.find_spec("ns3")
        cppyy = importlib.util.find_spec("cppyy")
    except (ImportError, ValueError):
        return False
    if ns_stub is None or ns3_pkg is None or cppyy is None:
        return False
    locations = list(ns3_pkg.submodule_search_locations or [])
    return any((Path(loc) / "ns" / "__init__.py").is_file() for loc in locations)


def _normalize(case: dict[str, Any], index: int) -> dict[str, Any]:
    if not isinstance(case, dict):
        raise TypeError(f"ns3ref case {index}: expected a dict, got {type(case).__name__}")
    kind = case.get("kind")
    if kind not in _REQUIRED:
        raise ValueError(f"ns3ref case {index}: kind must be one of {sorted(_REQUIRED)}, got {kind!r}")
    optional = {**_OPTIONAL, **(_LEAFSPINE_OPTIONAL if kind == "leafspine" else {})}
    known = {"kind", *_REQUIRED[kind], *optional}
    unknown = sorted(set(case) - known)
    if unknown:
        raise ValueError(f"ns3ref case {index} ({kind}): unknown keys {unknown}")
    missing = [k for k in _REQUIRED[kind] if k not in case]
    if missing:
        raise ValueError(f"ns3ref case {index} ({kind}): missing keys {missing}")
    out: dict[str, Any] = {"kind": kind}
    for key in (*_REQUIRED[kind], *optional):
        value: Any = case[key] if key in case else optional[key]
        if key == "spray":
            if not isinstance(value, bool):
                raise ValueError(f"ns3ref case {index}: spray must be true or false, got {value!r}")
            out[key] = value
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if key in _INT_KEYS:
            if not number or not math.isfinite(value) or value != int(value) or value < 1:
                raise ValueError(f"ns3ref case {index}: {key} must be a positive int, got {value!r}")
            out[key] = int(value)
        else:
            positive = key in ("gbps", "stop_s", "host_gbps", "uplink_gbps")
            if not number or not math.isfinite(value) or value < 0 or (positive and value == 0):
                raise ValueError(f"ns3ref case {index}: {key} must be "
                                 f"{'positive' if positive else '>= 0'}, got {value!r}")
            out[key] = float(value)
    if out["mss"] > 65495:
        raise ValueError(f"ns3ref case {index}: mss {out['mss']} too large")
    if kind == "leafspine" and out["hosts_per_leaf"] > 64:
        raise ValueError(f"ns3ref case {index}: at most 64 hosts per leaf")
    if kind == "incast" and out["senders"] > _MAX_SENDERS:
        raise ValueError(f"ns3ref case {index}: at most {_MAX_SENDERS} senders")
    return out


def _tail(text: str | bytes | None) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return text[-_TAIL_CHARS:]


def run_with_stats(
    cases: list[dict[str, Any]], timeout_s: float = 900
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Like :func:`run`, and also return the child's stats: ``import_s`` (``from ns import ns``),
    ``compile_s`` (JIT of the C++ driver), ``total_s`` and ``ns3_defaults`` (ns-3's built-in
    values of the attributes this module documents, read before anything is set). Each result
    also carries ``wall_s``, the wall time of its own simulation."""
    if not available():
        raise RuntimeError(MISSING_MESSAGE)
    normalized = [_normalize(c, i) for i, c in enumerate(cases)]
    if not normalized:
        return [], {}
    env = dict(os.environ)
    # the child imports qsync_opt from wherever this process did
    pkg_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), pkg_root) if p)
    with tempfile.TemporaryDirectory(prefix="qsync_ns3ref_") as tmp:
        out_path = Path(tmp) / "result.json"
        payload = json.dumps({"cases": normalized, "out": str(out_path)})
        cmd = [sys.executable, "-m", "qsync_opt.netsim.ns3ref"]
        try:
            # cwd: the ns-3 loader globs the working directory recursively for shared
            # libraries; an empty directory keeps the import fast and unambiguous.
            proc = subprocess.run(cmd, input=payload, capture_output=True, text=True,
                                  timeout=timeout_s, cwd=tmp, env=env)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(
                f"ns-3 reference run timed out after {timeout_s:g} s ({len(normalized)} cases); "
                f"child stderr tail:\n{_tail(exc.stderr)}\nchild stdout tail:\n{_tail(exc.stdout)}"
            ) from None
        if proc.returncode != 0 or not out_path.is_file():
            raise RuntimeError(
                f"ns-3 reference child failed (exit status {proc.returncode}"
                f"{'' if out_path.is_file() else ', no result file'}); child stderr tail:\n"
                f"{_tail(proc.stderr)}\nchild stdout tail:\n{_tail(proc.stdout)}"
            )
        data = json.loads(out_path.read_text())
    results = data["results"]
    if len(results) != len(normalized):
        raise RuntimeError(f"ns-3 reference child returned {len(results)} results for "
                           f"{len(normalized)} cases")
    return results, data["stats"]


def run(cases: list[dict[str, Any]], timeout_s: float = 900) -> list[dict[str, Any]]:
    """Simulate every case in ns-3 (one child process, a fresh simulation per case) and return
    one result dict per case, in order (see the module docstring for the keys)."""
    return run_with_stats(cases, timeout_s)[0]


# --------------------------------------------------------------------------------------------
# The child: C++ driver compiled by cppyy's JIT after `from ns import ns`.

_CPP = r"""
#include <sstream>
#include <iomanip>
#include <vector>
#include <string>
#include <functional>

namespace qsync_ns3ref {
using namespace ns3;

struct FlowState {
    uint64_t target = 0;
    uint64_t rx = 0;
    double doneMs = -1.0;
    double firstDataMs = -1.0;
    uint64_t txData = 0;
    uint64_t retx = 0;
    bool anySent = false;
    SequenceNumber32 highSeq;
};

static std::vector<FlowState> g_flows;
static uint64_t g_queueDrops = 0;
static uint64_t g_tcDrops = 0;
static std::vector<uint64_t> g_dropsByNode;
static size_t g_done = 0;
static uint32_t g_mss = 0;
static uint32_t g_wireFull = 0;
static uint32_t g_wireSyn = 0;
static std::string g_err;
static std::string g_removedQdisc;

static void Check(bool ok, const char* what) {
    if (!ok && g_err.empty()) g_err = what;
}


static double NowMs() { return Simulator::Now().ToDouble(Time::MS); }

static void OnQueueDrop(uint32_t node, Ptr<const Packet>) { ++g_queueDrops; ++g_dropsByNode[node]; }
static void OnTcDrop(uint32_t node, Ptr<const Packet>) { ++g_tcDrops; ++g_dropsByNode[node]; }

static void OnSinkRx(uint32_t i, Ptr<const Packet> p, const Address&) {
    FlowState& f = g_flows[i];
    f.rx += p->GetSize();
    if (f.doneMs < 0 && f.rx >= f.target) {
        f.doneMs = NowMs();
        if (++g_done == g_flows.size()) {
            Simulator::Stop();
        }
    }
}

// PhyTxBegin on a sender's own device: the frame (PPP header included) starts serialising.
static void OnSenderPhyTx(uint32_t i, Ptr<const Packet> frame) {
    Ptr<Packet> q = frame->Copy();
    PppHeader ppp;
    q->RemoveHeader(ppp);
    if (ppp.GetProtocol() != 0x0021) return;  // not IPv4
    Ipv4Header ip;
    q->RemoveHeader(ip);
    if (ip.GetProtocol() != 6) return;  // not TCP
    TcpHeader tcp;
    q->RemoveHeader(tcp);
    uint32_t payload = q->GetSize();
    if ((tcp.GetFlags() & TcpHeader::SYN) && g_wireSyn == 0) g_wireSyn = frame->GetSize();
    if (payload == 0) return;  // SYN, pure ACK, FIN
    FlowState& f = g_flows[i];
    if (f.firstDataMs < 0) f.firstDataMs = NowMs();
    ++f.txData;
    SequenceNumber32 seq = tcp.GetSequenceNumber();
    SequenceNumber32 end = seq + payload;
    if (f.anySent && seq < f.highSeq) ++f.retx;
    if (!f.anySent || end > f.highSeq) f.highSeq = end;
    f.anySent = true;
    if (payload == g_mss && g_wireFull == 0) g_wireFull = frame->GetSize();
}

static std::string AttrDefault(const std::string& tidName, const std::string& attr) {
    TypeId tid = TypeId::LookupByName(tidName);
    TypeId::AttributeInformation info;
    if (!tid.LookupAttributeByName(attr, &info)) return "<none>";
    return info.initialValue->SerializeToString(info.checker);
}

std::string Defaults() {
    const char* pairs[][2] = {
        {"ns3::TcpL4Protocol", "SocketType"},
        {"ns3::TcpL4Protocol", "RecoveryType"},
        {"ns3::TcpL4Protocol", "RttEstimatorType"},
        {"ns3::TcpSocket", "SegmentSize"},
        {"ns3::TcpSocket", "InitialCwnd"},
        {"ns3::TcpSocket", "DelAckCount"},
        {"ns3::TcpSocket", "DelAckTimeout"},
        {"ns3::TcpSocket", "SndBufSize"},
        {"ns3::TcpSocket", "RcvBufSize"},
        {"ns3::TcpSocket", "InitialSlowStartThreshold"},
        {"ns3::TcpSocket", "TcpNoDelay"},
        {"ns3::TcpSocket", "ConnTimeout"},
        {"ns3::TcpSocket", "DataRetries"},
        {"ns3::TcpSocketBase", "Sack"},
        {"ns3::TcpSocketBase", "Timestamp"},
        {"ns3::TcpSocketBase", "WindowScaling"},
        {"ns3::TcpSocketBase", "MinRto"},
        {"ns3::TcpSocketBase", "ClockGranularity"},
        {"ns3::TcpSocketBase", "ReTxThreshold"},
        {"ns3::TcpSocketBase", "LimitedTransmit"},
        {"ns3::TcpSocketBase", "UseEcn"},
        {"ns3::TcpSocketState", "EnablePacing"},
        {"ns3::RttEstimator", "InitialEstimation"},
        {"ns3::PointToPointNetDevice", "Mtu"},
        {"ns3::PointToPointNetDevice", "InterframeGap"},
        {"ns3::PointToPointNetDevice", "DataRate"},
        {"ns3::DropTailQueue<Packet>", "MaxSize"},
        {"ns3::BulkSendApplication", "SendSize"},
    };
    std::ostringstream os;
    os << "{";
    bool first = true;
    for (auto& kv : pairs) {
        if (!first) os << ",";
        first = false;
        os << "\"" << kv[0] << "::" << kv[1] << "\":\"" << AttrDefault(kv[0], kv[1]) << "\"";
    }
    os << "}";
    return os.str();
}

static void Configure(uint32_t mss, double minRtoMs) {
    Config::SetDefault("ns3::TcpL4Protocol::SocketType", TypeIdValue(TcpNewReno::GetTypeId()));
    Config::SetDefault("ns3::TcpSocket::SegmentSize", UintegerValue(mss));
    Config::SetDefault("ns3::TcpSocket::InitialCwnd", UintegerValue(10));
    Config::SetDefault("ns3::TcpSocket::DelAckCount", UintegerValue(1));
    Config::SetDefault("ns3::TcpSocket::SndBufSize", UintegerValue(1u << 29));
    Config::SetDefault("ns3::TcpSocket::RcvBufSize", UintegerValue(1u << 29));
    Config::SetDefault("ns3::TcpSocketBase::Timestamp", BooleanValue(false));
    Config::SetDefault("ns3::TcpSocketBase::MinRto",
                       TimeValue(NanoSeconds((int64_t)std::llround(minRtoMs * 1e6))));
    Config::SetDefault("ns3::TcpSocketBase::ClockGranularity", TimeValue(MilliSeconds(1)));
}

static void Reset() {
    g_flows.clear();
    g_queueDrops = 0;
    g_tcDrops = 0;
    g_dropsByNode.clear();
    g_done = 0;
    g_wireFull = 0;
    g_wireSyn = 0;
    g_err.clear();
    g_removedQdisc.clear();
    Ipv4AddressGenerator::Reset();
    RngSeedManager::SetSeed(1);
    RngSeedManager::SetRun(1);
}

static void SetupLink(PointToPointHelper& p2p, double gbps, double delayUs, uint32_t mss) {
    p2p.SetDeviceAttribute("DataRate", DataRateValue(DataRate((uint64_t)std::llround(gbps * 1e9))));
    p2p.SetDeviceAttribute("Mtu", UintegerValue(std::max<uint32_t>(1500, mss + 40)));
    p2p.SetChannelAttribute("Delay", TimeValue(NanoSeconds((int64_t)std::llround(delayUs * 1e3))));
    p2p.SetQueue("ns3::DropTailQueue<Packet>");
}

static void SetQueuePackets(Ptr<NetDevice> dev, uint32_t packets) {
    Ptr<PointToPointNetDevice> p2p = DynamicCast<PointToPointNetDevice>(dev);
    p2p->GetQueue()->SetMaxSize(QueueSize(QueueSizeUnit::PACKETS, packets));
    uint32_t node = dev->GetNode()->GetId();
    if (g_dropsByNode.size() <= node) g_dropsByNode.resize(node + 1, 0);
    Check(p2p->GetQueue()->TraceConnectWithoutContext("Drop", MakeBoundCallback(&OnQueueDrop, node)),
          "cannot connect Queue Drop trace");
}

// After addresses are assigned: drop the root queue discs, hook the TC drop trace.
static std::string StripQueueDiscs(NodeContainer nodes) {
    for (uint32_t n = 0; n < nodes.GetN(); ++n) {
        Ptr<Node> node = nodes.Get(n);
        Ptr<TrafficControlLayer> tc = node->GetObject<TrafficControlLayer>();
        for (uint32_t d = 0; d < node->GetNDevices(); ++d) {
            Ptr<NetDevice> dev = node->GetDevice(d);
            if (!DynamicCast<PointToPointNetDevice>(dev)) continue;
            if (Ptr<QueueDisc> qd = tc->GetRootQueueDiscOnDevice(dev)) {
                if (g_removedQdisc.empty()) g_removedQdisc = qd->GetInstanceTypeId().GetName();
                TrafficControlHelper tch;
                tch.Uninstall(dev);
            }
            if (tc->GetRootQueueDiscOnDevice(dev)) return "root queue disc still installed";
        }
        if (g_dropsByNode.size() <= node->GetId()) g_dropsByNode.resize(node->GetId() + 1, 0);
        Check(tc->TraceConnectWithoutContext("TcDrop", MakeBoundCallback(&OnTcDrop, node->GetId())),
              "cannot connect TrafficControlLayer TcDrop trace");
    }
    return "";
}

static void AddFlow(uint32_t i, Ptr<Node> src, Ptr<NetDevice> srcDev, Ptr<Node> dst,
                    Ipv4Address dstAddr, uint64_t bytes) {
    FlowState f;
    f.target = bytes;
    g_flows[i] = f;
    uint16_t port = 5000 + i;
    PacketSinkHelper sinkHelper("ns3::TcpSocketFactory",
                                InetSocketAddress(Ipv4Address::GetAny(), port));
    ApplicationContainer sink = sinkHelper.Install(dst);
    sink.Start(Seconds(0));
    Check(sink.Get(0)->TraceConnectWithoutContext("Rx", MakeBoundCallback(&OnSinkRx, i)),
          "cannot connect PacketSink Rx trace");
    BulkSendHelper bulk("ns3::TcpSocketFactory", InetSocketAddress(dstAddr, port));
    bulk.SetAttribute("MaxBytes", UintegerValue(bytes));
    bulk.SetAttribute("SendSize", UintegerValue(65536));
    ApplicationContainer app = bulk.Install(src);
    app.Start(Seconds(0));
    Check(srcDev->TraceConnectWithoutContext("PhyTxBegin", MakeBoundCallback(&OnSenderPhyTx, i)),
          "cannot connect PhyTxBegin trace");
}

static void Num(std::ostringstream& os, double v) {
    if (v < 0) os << "null"; else os << v;
}

static std::string Finish(bool list) {
    std::ostringstream os;
    os << std::setprecision(17) << "{";
    uint64_t rx = 0, tx = 0, retx = 0;
    double completion = 0;
    bool completed = true;
    for (auto& f : g_flows) {
        rx += f.rx; tx += f.txData; retx += f.retx;
        if (f.doneMs < 0) completed = false; else completion = std::max(completion, f.doneMs);
    }
    if (list) {
        os << "\"fct_ms\":[";
        for (size_t i = 0; i < g_flows.size(); ++i) { if (i) os << ","; Num(os, g_flows[i].doneMs); }
        os << "],\"completion_ms\":"; Num(os, completed ? completion : -1.0);
        os << ",\"first_data_ms\":[";
        for (size_t i = 0; i < g_flows.size(); ++i) { if (i) os << ","; Num(os, g_flows[i].firstDataMs); }
        os << "]";
    } else {
        os << "\"fct_ms\":"; Num(os, g_flows[0].doneMs);
        os << ",\"first_data_ms\":"; Num(os, g_flows[0].firstDataMs);
    }
    os << ",\"lost_packets\":" << (g_queueDrops + g_tcDrops)
       << ",\"queue_drops\":" << g_queueDrops << ",\"tc_drops\":" << g_tcDrops
       << ",\"drops_by_node\":[";
    for (size_t i = 0; i < g_dropsByNode.size(); ++i) { if (i) os << ","; os << g_dropsByNode[i]; }
    os << "]"
       << ",\"tx_packets\":" << tx << ",\"retx_packets\":" << retx
       << ",\"rx_bytes\":" << rx << ",\"wire_bytes_full_segment\":";
    if (g_wireFull) os << g_wireFull; else os << "null";
    os << ",\"syn_wire_bytes\":";
    if (g_wireSyn) os << g_wireSyn; else os << "null";
    os << ",\"removed_queue_disc\":";
    if (g_removedQdisc.empty()) os << "null"; else os << "\"" << g_removedQdisc << "\"";
    os << ",\"completed\":" << (completed ? "true" : "false") << "}";
    return os.str();
}

// The common tail of every case: the queue discs stripped, the routes built, the ``n``
// flows ``addFlows`` registers run until ``stopS``, and the results (``list``: per flow).
std::string RunFlows(NodeContainer nodes, uint32_t n, const std::function<void()>& addFlows,
                     double stopS, bool list) {
    std::string err = StripQueueDiscs(nodes);
    if (!err.empty()) { Simulator::Destroy(); return "{\"error\":\"" + err + "\"}"; }
    Ipv4GlobalRoutingHelper::PopulateRoutingTables();
    g_flows.resize(n);
    addFlows();
    if (!g_err.empty()) { Simulator::Destroy(); return "{\"error\":\"" + g_err + "\"}"; }
    Simulator::Stop(Seconds(stopS));
    Simulator::Run();
    std::string out = Finish(list);
    Simulator::Destroy();
    return out;
}

std::string RunBottleneck(uint64_t bytes, double gbps, double delayUs, uint32_t buffer,
                          uint32_t mss, double minRtoMs, double stopS) {
    Reset();
    Configure(mss, minRtoMs);
    g_mss = mss;
    NodeContainer nodes;
    nodes.Create(2);
    PointToPointHelper p2p;
    SetupLink(p2p, gbps, delayUs, mss);
    NetDeviceContainer devs = p2p.Install(nodes.Get(0), nodes.Get(1));
    SetQueuePackets(devs.Get(0), buffer);
    SetQueuePackets(devs.Get(1), 10000);
    InternetStackHelper inet;
    inet.Install(nodes);
    Ipv4AddressHelper addr;
    addr.SetBase("10.1.1.0", "255.255.255.0");
    Ipv4InterfaceContainer ifs = addr.Assign(devs);
    return RunFlows(nodes, 1, [&] {
        AddFlow(0, nodes.Get(0), devs.Get(0), nodes.Get(1), ifs.GetAddress(1), bytes);
    }, stopS, false);
}

std::string RunIncast(uint32_t senders, uint64_t bytesEach, double gbps, double delayUs,
                      uint32_t buffer, uint32_t mss, double minRtoMs, double stopS) {
    Reset();
    Configure(mss, minRtoMs);
    g_mss = mss;
    NodeContainer hosts;
    hosts.Create(senders);
    NodeContainer router;
    router.Create(1);
    NodeContainer receiver;
    receiver.Create(1);
    NodeContainer all(hosts, router, receiver);
    PointToPointHelper p2p;
    SetupLink(p2p, gbps, delayUs, mss);
    std::vector<NetDeviceContainer> senderLinks;
    for (uint32_t i = 0; i < senders; ++i) {
        NetDeviceContainer d = p2p.Install(hosts.Get(i), router.Get(0));
        SetQueuePackets(d.Get(0), 10000);
        SetQueuePackets(d.Get(1), 10000);
        senderLinks.push_back(d);
    }
    NetDeviceContainer bott = p2p.Install(router.Get(0), receiver.Get(0));
    SetQueuePackets(bott.Get(0), buffer);
    SetQueuePackets(bott.Get(1), 10000);
    InternetStackHelper inet;
    inet.Install(all);
    Ipv4AddressHelper addr;
    for (uint32_t i = 0; i < senders; ++i) {
        std::ostringstream net;
        net << "10." << (1 + i / 256) << "." << (i % 256) << ".0";
        addr.SetBase(Ipv4Address(net.str().c_str()), Ipv4Mask("255.255.255.0"));
        addr.Assign(senderLinks[i]);
    }
    addr.SetBase("10.250.0.0", "255.255.255.0");
    Ipv4InterfaceContainer bifs = addr.Assign(bott);
    return RunFlows(all, senders, [&] {
        for (uint32_t i = 0; i < senders; ++i) {
            AddFlow(i, hosts.Get(i), senderLinks[i].Get(0), receiver.Get(0),
                    bifs.GetAddress(1), bytesEach);
        }
    }, stopS, true);
}

}  // namespace qsync_ns3ref
"""


def _child_main() -> int:
    payload = json.loads(sys.stdin.read())
    cases = payload["cases"]
    t0 = time.perf_counter()
    # `from ns import ns`: loads every ns-3 library and module header into cppyy
    importlib.import_module("ns")
    cppyy = importlib.import_module("cppyy")
    t1 = time.perf_counter()
    cppyy.cppdef(_CPP + LEAFSPINE_CPP)  # one unit: the leaf/spine case uses _CPP's helpers
    drv = cppyy.gbl.qsync_ns3ref
    defaults = json.loads(str(drv.Defaults()))
    t2 = time.perf_counter()
    results = []
    for case in cases:
        start = time.perf_counter()
        if case["kind"] == "bottleneck":
            raw = drv.RunBottleneck(case["bytes"], case["gbps"], case["delay_us"],
                                    case["buffer_packets"], case["mss"], case["min_rto_ms"],
                                    case["stop_s"])
        elif case["kind"] == "incast":
            raw = drv.RunIncast(case["senders"], case["bytes_each"], case["gbps"],
                                case["delay_us"], case["buffer_packets"], case["mss"],
                                case["min_rto_ms"], case["stop_s"])
        else:
            raw = drv.RunLeafSpine(case["hosts_per_leaf"], case["bytes_each"],
                                   case["host_gbps"], case["uplink_gbps"], case["delay_us"],
                                   case["buffer_packets"], case["mss"], case["min_rto_ms"],
                                   case["stop_s"], bool(case["spray"]), case["run"])
        result = json.loads(str(raw))
        if "error" in result:
            raise RuntimeError(f"ns-3 driver: {result['error']} (case {case})")
        result["wall_s"] = time.perf_counter() - start
        results.append(result)
    stats = {"import_s": t1 - t0, "compile_s": t2 - t1, "total_s": time.perf_counter() - t0,
             "ns3_defaults": defaults}
    tmp_out = payload["out"] + ".part"
    with open(tmp_out, "w") as fh:
        json.dump({"results": results, "stats": stats}, fh)
    os.replace(tmp_out, payload["out"])
    return 0


if __name__ == "__main__":
    sys.exit(_child_main())
