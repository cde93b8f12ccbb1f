"""The packet-level event loop: queues, forwarding, and two transports.

Every packet ("cell") is one event per hop: it waits in its link's output queue, is
serialised at the link's rate, and arrives ``delay_us`` later at the next node, which
forwards it on a shortest path (ECMP by flow hash, or the path its sender drew for it:
spraying) or delivers it.

Queues (:class:`Sim` ``queue=``): ``"fifo"`` -- one drop-tail queue per port; ``"priority"``
-- strict priority over ``classes`` classes (0 is the highest), and when the buffer is full
an arriving packet pushes out the newest packet of the lowest class below its own (it is
dropped itself when nothing lower is queued); a host's own NIC queue stays FIFO (the
transport's order: priority is the switches'). Buffers are bytes of waiting packets (the one
being serialised is not counted, as ns-3's device queues count). A host's own NIC queue
never drops: a sender's kernel holds what its window lets out (back-pressure), and the
retransmission timer does not run while a connection has packets still in that queue (they
have not left the host; Linux's TCP small queues keep this queue short for the same
reason).

Transports (:class:`Connection`): one persistent connection per (src, dst) pair carries
successive messages (a ring step, a bucket push) in sequence-number order, NewReno-like:
slow start from ``init_cwnd`` packets, congestion avoidance (+1/cwnd per ack), every packet
acked (selective acks, no delayed acks). Loss detection (``detect``):

- ``"rack"`` (default): time-based, as Linux's RACK (RFC 8985), per stream -- one priority
  class on one path (:mod:`.rack`: on one path a packet is never overtaken by a later-sent
  one of its class or a lower one, so only such a delivery is evidence; a sprayed packet's
  path is drawn by its sender, which so knows it): a packet is lost when such a later-sent
  packet has been delivered and it has been out longer than that delivery's RTT plus the
  reorder window (:meth:`.rack.Rack.window`); a reorder timer marks what becomes overdue
  between acks. A lost retransmission is found the same way.
  No tail loss probe: a lost tail waits for the RTO.
- ``"dupthresh"``: a packet is lost when ``dupthresh`` packets above it are acked (RFC 6675;
  ns-3's TCP, kept for the cross-check): it assumes one path keeps order, so under spraying
  it takes reordering for loss.

Either way a packet is also lost when nothing is acked for a retransmission timeout (RTO =
max(min_rto, srtt + 4 rttvar), doubling on each timeout, window back to 1); ``min_rto``
defaults to Linux's 200 ms (:data:`DEFAULT_MIN_RTO_MS`). On loss: fast retransmit, ssthresh
= half the packets in flight, once per window. As ns-3's TCP does by default: the first two
duplicate acks each let one new packet out beyond the window (limited transmit, RFC 3042),
fast recovery paces its sending by proportional rate reduction (PRR with slow-start
reduction bound, RFC 6937) and the window does not grow until the recovery point is acked.
Acks are not queued: each returns after the reverse path's propagation and its own
serialisation (``ack_bytes``; acks are 3% of a 1500-byte packet and the reverse direction of
a gradient pattern's busiest link carries other data, a stated approximation).
``bounded=p``: DLCP's bounded-loss transport -- a packet found lost is given up (not
retransmitted) while its message's given-up count is below ``floor(p n)`` of its ``n``
packets, retransmitted after that; the sender's notice that it gave a packet up reaches the
receiver one base one-way delay later. The receiver completes the message once every packet
has arrived or been given up, zero-filling what was given up: only what the sender's loss
detection found lost is ever given up, so a network that drops nothing gives up nothing
(with a detection that tolerates the routing's reordering). Without loss the two transports
are the same; congestion control is the same in both, so the comparison isolates waiting
and retransmission.

Deterministic: randomness (spraying, ECMP salt) comes from the ``seed``; ties in time run
in scheduling order. ``max_events`` caps the loop with a message naming the cell size.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qsync_opt.netsim import rack as rackmod
from qsync_opt.netsim.rack import Rack, Stream
from qsync_opt.netsim.topology import Topology

QUEUES = ("fifo", "priority")
ROUTING = ("hash", "spray")
DEFAULT_MAX_EVENTS = 5_000_000
DETECT = ("rack", "dupthresh")
#: the minimum retransmission timeout (ms): Linux's TCP_RTO_MIN (HZ/5 = 200 ms), the stock
#: figure of the hosts a cluster runs (a route's ``rto_min`` can lower it; docs/NETSIM.md)
DEFAULT_MIN_RTO_MS = 200.0


class NetsimLimit(RuntimeError):
    """The event cap was reached (or would be): raise the cell size or the cap. ``core``:
    what was exceeded; ``cell_kib``: the least cell size (KiB) that fits, where known. The
    command line says it in its own flags (:func:`.cluster.limit_message`)."""

    def __init__(self, core: str, cell_kib: int | None = None) -> None:
        super().__init__(f"{core}; raise the cell size (fewer, larger packets)"
                         + (f" to {cell_kib} KiB" if cell_kib else "") + " or max_events")
        self.core, self.cell_kib = core, cell_kib


class Pkt:
    __slots__ = ("conn", "seq", "size", "prio", "dst", "route", "hop")

    def __init__(self, conn: Connection, seq: int, size: int, prio: int, dst: int,
                 route: tuple[int, ...] | None = None) -> None:
        self.conn, self.seq, self.size, self.prio, self.dst = conn, seq, size, prio, dst
        self.route, self.hop = route, 0  # a sprayed packet's links, chosen by its sender


@dataclass
class LinkStats:
    bytes: int = 0
    packets: int = 0
    drops: int = 0
    busy_s: float = 0.0
    bins: dict[int, int] = field(default_factory=dict)  # time bin -> bytes sent


class _Port:
    __slots__ = ("queues", "qbytes", "busy", "host")

    def __init__(self, classes: int, host: bool) -> None:
        self.queues: list[deque[Pkt]] = [deque() for _ in range(classes)]
        self.qbytes = 0
        self.busy = False
        self.host = host


def _mix(*xs: int) -> int:
    """A fixed 64-bit mix (Python's hash() is salted for str; ints are not, but be explicit)."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h ^= (x + 0x9E3779B97F4A7C15 + ((h << 6) & 0xFFFFFFFFFFFFFFFF) + (h >> 2))
        h = (h * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h


class Sim:
    """One simulation over a :class:`~qsync_opt.netsim.topology.Topology` (module docstring)."""

    def __init__(self, topo: Topology, *, queue: str = "fifo", routing: str = "hash",
                 seed: int = 0, classes: int = 8, bin_us: float | None = 100.0,
                 max_events: int = DEFAULT_MAX_EVENTS, cell_bytes: int | None = None) -> None:
        if queue not in QUEUES:
            raise ValueError(f"queue: expected one of {', '.join(QUEUES)}, got {queue!r}")
        if routing not in ROUTING:
            raise ValueError(f"routing: expected one of {', '.join(ROUTING)}, got {routing!r}")
        self.topo = topo
        self.queue = queue
        self.routing = routing
        self.classes = classes if queue == "priority" else 1
        self.rng = random.Random(_mix(seed, 1))
        self.salt = _mix(seed, 2)
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._n = 0
        self.events = 0
        self.max_events = int(max_events)
        self.cell_bytes = cell_bytes
        self.bin_s = bin_us * 1e-6 if bin_us else 0.0  # 0: no per-bin load kept
        self.ports = [_Port(self.classes, topo.is_host[link.src]) for link in topo.links]
        self.stats = [LinkStats() for _ in topo.links]
        self._rate = [link.bytes_per_s for link in topo.links]
        self._delay = [link.delay_us * 1e-6 for link in topo.links]
        self._buf = [link.buffer_bytes for link in topo.links]
        self._dst = [link.dst for link in topo.links]
        self.connections: dict[tuple[int, int], Connection] = {}

    # ------------------------------------------------------------------ the loop
    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        self._n += 1
        heapq.heappush(self._heap, (t, self._n, fn, args))

    def run(self) -> None:
        heap = self._heap
        pop = heapq.heappop
        while heap:
            t, _, fn, args = pop(heap)
            self.now = t
            self.events += 1
            if self.events > self.max_events:
                cell = f" (cell {self.cell_bytes} bytes)" if self.cell_bytes else ""
                raise NetsimLimit(f"netsim: more than {self.max_events} events{cell}")
            fn(*args)

    # ------------------------------------------------------------------ queues
    def enqueue(self, li: int, pkt: Pkt) -> None:
        port = self.ports[li]
        if not port.busy:
            port.busy = True
            self.at(self.now + pkt.size / self._rate[li], self._tx_done, li, pkt)
            return
        prio = pkt.prio if self.classes > 1 and not port.host else 0
        if not port.host and port.qbytes + pkt.size > self._buf[li]:
            if self.classes > 1:
                # push out the newest packets of the lowest classes below this one
                for c in range(self.classes - 1, prio, -1):
                    q = port.queues[c]
                    while q and port.qbytes + pkt.size > self._buf[li]:
                        victim = q.pop()
                        port.qbytes -= victim.size
                        self._drop(li, victim)
                    if port.qbytes + pkt.size <= self._buf[li]:
                        break
            if port.qbytes + pkt.size > self._buf[li]:
                self._drop(li, pkt)
                return
        port.queues[prio].append(pkt)
        port.qbytes += pkt.size
        if port.host:
            pkt.conn.local += 1

    def _drop(self, li: int, pkt: Pkt) -> None:
        self.stats[li].drops += 1
        pkt.conn.dropped += 1

    def _tx_done(self, li: int, pkt: Pkt) -> None:
        st = self.stats[li]
        st.bytes += pkt.size
        st.packets += 1
        dur = pkt.size / self._rate[li]
        st.busy_s += dur
        if self.bin_s:
            b = int(self.now / self.bin_s)
            st.bins[b] = st.bins.get(b, 0) + pkt.size
        self.at(self.now + self._delay[li], self._arrive, self._dst[li], pkt)
        port = self.ports[li]
        for q in port.queues:
            if q:
                nxt = q.popleft()
                port.qbytes -= nxt.size
                if port.host:
                    conn = nxt.conn
                    conn.local -= 1
                    if conn.local == 0:  # its queue at its own NIC drained: the RTO runs from here
                        conn.last_progress = max(conn.last_progress, self.now)
                self.at(self.now + nxt.size / self._rate[li], self._tx_done, li, nxt)
                return
        port.busy = False

    def _arrive(self, node: int, pkt: Pkt) -> None:
        if node == pkt.dst:
            pkt.conn.on_data(pkt)
            return
        self.enqueue(self.choose(node, pkt), pkt)

    def choose(self, node: int, pkt: Pkt) -> int:
        if pkt.route is not None:
            pkt.hop += 1
            return pkt.route[pkt.hop - 1]
        hops = self.topo.next_links(node, pkt.dst)
        if len(hops) == 1:
            return hops[0]
        if not hops:
            raise ValueError(f"no route from {self.topo.names[node]} to "
                             f"{self.topo.names[pkt.dst]}")
        return hops[_mix(self.salt, pkt.conn.flow_key, node) % len(hops)]

    def spray_route(self, src: int, dst: int) -> tuple[int, ...]:
        """A sprayed packet's links from ``src`` to ``dst``: at every node with several
        shortest-path next hops, one drawn uniformly (by its sender, which so knows it)."""
        out, node = [], src
        while node != dst:
            hops = self.topo.next_links(node, dst)
            if not hops:
                raise ValueError(f"no route from {self.topo.names[src]} to "
                                 f"{self.topo.names[dst]}")
            li = hops[0] if len(hops) == 1 else hops[self.rng.randrange(len(hops))]
            out.append(li)
            node = self._dst[li]
        return tuple(out)

    # ------------------------------------------------------------------ helpers
    def connection(self, src: int, dst: int, **kw: Any) -> Connection:
        """The persistent connection ``src -> dst`` (created on first use with ``kw``)."""
        key = (src, dst)
        conn = self.connections.get(key)
        if conn is None:
            conn = Connection(self, src, dst, **kw)
            self.connections[key] = conn
        return conn

    def base_delay(self, path: list[int], nbytes: int) -> float:
        """Propagation plus serialisation of ``nbytes`` at every hop of ``path`` (seconds)."""
        return sum(self._delay[li] + nbytes / self._rate[li] for li in path)

    def utilisation(self, li: int, span_s: float) -> float:
        return self.stats[li].busy_s / span_s if span_s > 0 else 0.0


@dataclass
class Message:
    """Packets ``first .. first + n - 1`` of a connection; complete when each has arrived
    or been given up by the sender (bounded: a packet its loss detection found lost)."""

    first: int
    n: int
    budget: int
    on_done: Callable[[float], None] | None
    tag: Any = None
    received: int = 0
    given_up: int = 0  # by the sender
    told: int = 0  # given-up notices the receiver has
    tail: bool = False  # its last packet has arrived
    done_s: float | None = None
    acked_done: bool = False
    missing: list[int] = field(default_factory=list)  # packets not there at completion


class Connection:
    """A persistent NewReno-like connection, optionally bounded-loss (module docstring)."""

    def __init__(self, sim: Sim, src: int, dst: int, *, mss: int, header: int = 40,
                 init_cwnd: int = 10, min_rto_ms: float = DEFAULT_MIN_RTO_MS,
                 initial_rto_ms: float | None = None, dupthresh: int = 3,
                 bounded: float | None = None, ack_bytes: int = 40, flow_key: int | None = None,
                 handshake: bool = False, detect: str = "rack",
                 expect_reordering: bool = False) -> None:
        if mss < 1:
            raise ValueError("mss must be >= 1 byte")
        if detect not in DETECT:
            raise ValueError(f"detect: expected one of {', '.join(DETECT)}, got {detect!r}")
        self.sim, self.src, self.dst = sim, src, dst
        self.mss, self.header = int(mss), int(header)
        self.bounded = bounded
        self.flow_key = _mix(src, dst) if flow_key is None else flow_key
        self.cwnd = float(init_cwnd)
        self.ssthresh = math.inf
        self.min_rto = min_rto_ms * 1e-3
        self.dupthresh = dupthresh
        back = sim.topo.path(dst, src)
        self.ack_delay = sim.base_delay(back, ack_bytes)
        self.one_way = sim.base_delay(sim.topo.path(src, dst), header)
        base_rtt = self.one_way + self.ack_delay
        self.base_rtt = base_rtt
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.rto = (initial_rto_ms * 1e-3 if initial_rto_ms is not None
                    else max(self.min_rto, 3 * base_rtt))
        if handshake:  # the SYN exchange is the first RTT sample (as ns-3 takes it)
            self.srtt, self.rttvar = base_rtt, base_rtt / 2
            self.rto = max(self.min_rto, self.srtt + 4 * self.rttvar)
        # per packet
        self.size: list[int] = []
        self.prio: list[int] = []
        self.msg: list[Message] = []
        self.sent: list[int] = []
        self.stream: list[Stream] = []  # RACK's stream of the latest transmission
        self.sent_at: list[float] = []
        self.acked: list[bool] = []
        self.lost: list[bool] = []
        self.got: list[bool] = []
        self.next_new = 0
        self.snd_una = 0
        # loss detection per priority class (strict priority reorders across classes, not
        # within one): each class's packets in sequence order, the highest acked position
        # in each, and how far each has been scanned
        self.cpos: list[int] = []
        self.cseq: dict[int, list[int]] = {}
        self.chigh: dict[int, int] = {}
        self.cscan: dict[int, int] = {}
        self.pipe = 0
        self.retx: deque[int] = deque()
        self.recovery_point = -1
        # fast recovery by PRR (RFC 6937): in it, what was delivered and sent since it began,
        # and the flight when it began; duplicate acks since snd_una last moved
        self.in_prr = False
        self.prr_delivered = 0
        self.prr_out = 0
        self.recover_fs = 0
        self.dupacks = 0
        # lost retransmissions: each outstanding retransmission counts the acks of packets of
        # its class sent after it; ``dupthresh`` of them and it is lost again (time order)
        self.tx_count = 0
        self.tx_id: list[int] = []
        self.rtx_out: dict[int, int] = {}
        # time-based loss detection (RACK-style, RFC 8985), per priority class
        self.detect = detect
        self.rack = Rack(expect_reordering) if detect == "rack" else None
        self.last_progress = 0.0
        self.timer_armed = False
        self.ready_at = sim.now + (base_rtt if handshake else 0.0)
        self.local = 0  # its packets waiting in its own host's NIC queue
        self.dropped = 0
        self.retransmits = 0
        self.timeouts = 0
        self.messages: list[Message] = []

    # ------------------------------------------------------------------ sender
    def send(self, nbytes: int, *, prio: list[int] | Callable[[int, int], int] | None = None,
             on_done: Callable[[float], None] | None = None, tag: Any = None) -> Message:
        """Queue a message of ``nbytes`` payload bytes (at least one packet). ``prio``: a
        class per packet, or ``f(i, n)`` for packet ``i`` of ``n``."""
        n = max(1, -(-int(nbytes) // self.mss))
        p = self.bounded or 0.0
        msg = Message(first=len(self.size), n=n, budget=int(math.floor(p * n + 1e-9)),
                      on_done=on_done, tag=tag)
        last = int(nbytes) - (n - 1) * self.mss
        for i in range(n):
            payload = self.mss if i < n - 1 else max(1, last)
            self.size.append(payload + self.header)
            c = 0 if prio is None else prio(i, n) if callable(prio) else prio[i]
            c = c if self.sim.classes > 1 else 0
            self.prio.append(c)
            seqs = self.cseq.setdefault(c, [])
            self.cpos.append(len(seqs))
            seqs.append(len(self.msg))
            self.msg.append(msg)
        k = n
        self.sent += [0] * k
        self.stream += [(0, 0)] * k
        self.tx_id += [0] * k
        self.sent_at += [0.0] * k
        self.acked += [False] * k
        self.lost += [False] * k
        self.got += [False] * k
        self.messages.append(msg)
        if self.sim.now < self.ready_at:
            self.sim.at(self.ready_at, self.try_send)
        else:
            self.try_send()
        return msg

    def try_send(self) -> None:
        if self.sim.now < self.ready_at:
            return
        # limited transmit: one new packet per duplicate ack, for the first two
        extra = 0 if self.in_prr or self.snd_una <= self.recovery_point else min(self.dupacks, 2)
        while self.pipe < self.cwnd + extra:
            if self.retx:
                s = self.retx.popleft()
                if self.acked[s] or not self.lost[s]:
                    continue
                self.retransmits += 1
                self._transmit(s)
            elif self.next_new < len(self.size):
                s = self.next_new
                self.next_new += 1
                if self.acked[s]:  # its message completed before it was sent
                    continue
                self._transmit(s)
            else:
                break

    def _transmit(self, s: int) -> None:
        sim = self.sim
        self.sent[s] += 1
        self.sent_at[s] = sim.now
        self.tx_count += 1
        self.tx_id[s] = self.tx_count
        if self.sent[s] > 1:
            self.rtx_out[s] = 0
        route = sim.spray_route(self.src, self.dst) if sim.routing == "spray" else None
        if self.rack is not None:
            k = self.stream[s] = self.rack.stream(self.prio[s], route)
            self.rack.txq.setdefault(k, deque()).append((self.tx_count, s))
        self.lost[s] = False
        if self.in_prr:
            self.prr_out += 1
        if self.pipe == 0:
            self.last_progress = sim.now  # the timer measures from the first packet out
        self.pipe += 1
        pkt = Pkt(self, s, self.size[s], self.prio[s], self.dst, route)
        sim.enqueue(sim.choose(self.src, pkt), pkt)
        if not self.timer_armed:
            self.timer_armed = True
            self.last_progress = sim.now
            sim.at(sim.now + self.rto, self._timer)

    # ------------------------------------------------------------------ receiver
    def on_data(self, pkt: Pkt) -> None:
        s = pkt.seq
        if not self.got[s]:
            self.got[s] = True
            m = self.msg[s]
            m.received += 1
            if s == m.first + m.n - 1:
                m.tail = True
            self._check_done(m)
            self.sim.at(self.sim.now + self.ack_delay, self._on_ack, s)
        else:  # a duplicate: its ack carries a D-SACK (RFC 2883), a spurious retransmission
            self.sim.at(self.sim.now + self.ack_delay, self._on_ack, s, True)

    def _check_done(self, m: Message) -> None:
        if m.done_s is None and m.received + m.told >= m.n:
            m.done_s = self.sim.now
            if m.received < m.n:
                m.missing = [q for q in range(m.first, m.first + m.n) if not self.got[q]]
            if m.on_done is not None:
                m.on_done(self.sim.now)

    def _told(self, m: Message) -> None:
        m.told += 1
        self._check_done(m)

    # ------------------------------------------------------------------ acks, loss
    def _ack_one(self, s: int) -> None:
        self.acked[s] = True
        if not self.lost[s] and self.sent[s] > 0:
            self.pipe -= 1

    def _on_ack(self, s: int, dsack: bool = False) -> None:
        sim = self.sim
        m = self.msg[s]
        if self.rack is not None:
            if dsack:
                self.rack.mult += 1  # a spurious retransmission: widen the reorder window
            elif self.sent[s] == 1:
                rackmod.reordered(self, s)
        if m.done_s is not None and not m.acked_done:
            # the receiver has all it needs: the sender stops the rest of the message
            m.acked_done = True
            for q in range(m.first, m.first + m.n):
                if not self.acked[q] and q != s:
                    self._ack_one(q)
        if self.acked[s]:
            self._advance()
            self.try_send()
            return
        self._ack_one(s)
        if self.sent[s] == 1:
            sample = sim.now - self.sent_at[s]
            if self.srtt is None:
                self.srtt, self.rttvar = sample, sample / 2
            else:
                self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - sample)
                self.srtt = 0.875 * self.srtt + 0.125 * sample
            self.rto = max(self.min_rto, self.srtt + 4 * self.rttvar)
        self.last_progress = sim.now
        una = self.snd_una
        self._advance()
        self.dupacks = self.dupacks + 1 if self.snd_una == una else 0
        if self.in_prr and self.snd_una > self.recovery_point:
            self.in_prr = False  # recovery ends: the window is ssthresh (RFC 6937)
            self.cwnd = self.ssthresh
        if self.snd_una > self.recovery_point:  # no growth while recovering
            if self.cwnd < self.ssthresh:
                self.cwnd += 1.0
            else:
                self.cwnd += 1.0 / self.cwnd
        if self.rack is not None:
            entered = rackmod.delivered(self, s)
        else:
            c = self.prio[s]
            if self.cpos[s] > self.chigh.get(c, -1):
                self.chigh[c] = self.cpos[s]
            entered = self._detect(c)
            if self.rtx_out:
                entered = self._detect_retx(s) or entered
        if self.in_prr:
            self._prr(1, entered)
        self.try_send()

    def _prr(self, delivered: int, entered: bool) -> None:
        """The window for this ack in fast recovery: proportional rate reduction while the
        flight is above ssthresh, the slow-start reduction bound below it (RFC 6937)."""
        self.prr_delivered += delivered
        if self.pipe > self.ssthresh:
            sndcnt = (math.ceil(self.prr_delivered * self.ssthresh / max(self.recover_fs, 1))
                      - self.prr_out)
        else:
            sndcnt = min(math.ceil(self.ssthresh) - self.pipe,
                         max(self.prr_delivered - self.prr_out, delivered) + 1)
        if entered:
            sndcnt = max(sndcnt, 1)  # the fast retransmission itself
        self.cwnd = float(self.pipe + max(sndcnt, 0))

    def _advance(self) -> None:
        while self.snd_una < len(self.acked) and self.acked[self.snd_una]:
            self.snd_una += 1

    def _detect(self, c: int) -> bool:
        """A first transmission is lost when ``dupthresh`` later packets of its class are
        acked (within a class the network keeps the order on one path). True when this
        starts a fast recovery."""
        seqs = self.cseq[c]
        start = self.cscan.get(c, 0)
        stop = self.chigh.get(c, -1) - self.dupthresh + 1
        flight = self.pipe
        losses = False
        for i in range(start, stop):
            s = seqs[i]
            if not self.acked[s] and not self.lost[s] and self.sent[s] == 1:
                self._mark_lost(s)
                losses = True
        if stop > start:
            self.cscan[c] = stop
        return losses and self._recover(flight)

    def _detect_retx(self, s: int) -> bool:
        """Count the ack of ``s`` against every outstanding retransmission of its class sent
        before it (strict priority reorders across classes, not within one);
        one with ``dupthresh`` such acks is lost again. True when this starts a recovery."""
        self.rtx_out.pop(s, None)
        lost = False
        for r in list(self.rtx_out):
            if self.acked[r]:
                del self.rtx_out[r]
            elif self.tx_id[s] > self.tx_id[r] and self.prio[s] == self.prio[r]:
                self.rtx_out[r] += 1
                if self.rtx_out[r] >= self.dupthresh:
                    del self.rtx_out[r]
                    if not self.lost[r]:
                        self._mark_lost(r)
                        lost = True
        return lost and self._recover(self.pipe)

    def _recover(self, flight: int) -> bool:
        """Enter fast recovery (once per window): True when this starts one."""
        if self.snd_una <= self.recovery_point:
            return False
        self.ssthresh = max(flight / 2.0, 2.0)
        self.cwnd = self.ssthresh
        self.recovery_point = self.next_new - 1
        self.in_prr = True
        self.prr_delivered = self.prr_out = 0
        self.recover_fs = flight
        return True

    def _mark_lost(self, s: int) -> None:
        self.lost[s] = True
        self.pipe -= 1
        m = self.msg[s]
        if self.bounded and m.given_up < m.budget and not self.got[s]:
            m.given_up += 1
            self.acked[s] = True  # given up: the sender will not wait for it
            self.sim.at(self.sim.now + self.one_way, self._told, m)
            return
        self.retx.append(s)

    def _timer(self) -> None:
        sim = self.sim
        outstanding = self.pipe > 0
        if not outstanding:
            self.timer_armed = False
            return
        due = self.last_progress + self.rto
        if self.local:  # what has not left the host is not timed (the kernel holds it)
            due = max(due, sim.now + self.rto)
        if sim.now + 1e-12 < due:
            sim.at(due, self._timer)
            return
        self.timeouts += 1
        self.ssthresh = max(self.pipe / 2.0, 2.0)
        self.cwnd = 1.0
        self.in_prr = False
        self.dupacks = 0
        for s in range(self.snd_una, self.next_new):
            if not self.acked[s] and not self.lost[s] and self.sent[s] > 0:
                self._mark_lost(s)
        self.recovery_point = self.next_new - 1
        self.rto = min(self.rto * 2, 60.0)
        self.last_progress = sim.now
        sim.at(sim.now + self.rto, self._timer)
        self.try_send()
