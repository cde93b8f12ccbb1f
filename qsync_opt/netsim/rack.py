"""Time-based loss detection (RACK, RFC 8985) for :class:`.engine.Connection` (the ``conn``
of these functions), per stream.

A stream is what the network keeps in order: one priority class (strict priority reorders
across classes by design) on one path. Under flow-hash routing a connection has one path, so
a stream is a class. Under spraying the sender picks each packet's path (as transports built
for spraying do, choosing a packet's path through the entropy field the fabric's ECMP hashes
on), so it knows which packets shared one and runs RACK per (class, path): within a stream
every queue is FIFO and every link's delay fixed, so a packet delivered after a later-sent
one of its stream was dropped, never merely late. More: on one path a packet is never
overtaken by a later-sent one of its own class or a lower one (each queue serves a higher
class first and one class in arrival order; the host's NIC queue is FIFO), so the delivery
of such a packet is evidence too, and :func:`delivered` credits it to every stream of the
path at its class or above. Reordering across paths (one path's queue longer, or one class
starved behind higher ones on one spine) says nothing about loss and is not used for it,
however long it lasts.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

Stream = tuple[int, int]  # (priority class, path index within its connection)


class Rack:
    """RACK's state, one record per stream: the transmissions in send order, and the
    newest-sent delivered packet's id and RTT."""

    __slots__ = ("txq", "tx", "rtt", "armed", "min_rtt", "seen", "late", "mult", "srtt", "var",
                 "max_rtt", "paths")

    def __init__(self, expect_reordering: bool = False) -> None:
        self.txq: dict[Stream, deque[tuple[int, int]]] = {}  # stream -> (tx id, seq), send order
        self.tx: dict[Stream, int] = {}  # stream -> tx id of the newest-sent delivered packet
        self.rtt: dict[Stream, float] = {}  # stream -> that delivery's RTT
        self.armed: dict[Stream, float] = {}  # stream -> when its reorder timer fires
        self.min_rtt = math.inf
        # a packet was delivered after one of its stream sent later than it (or the host is
        # configured to expect it, as Linux's tcp_reordering sysctl allows)
        self.seen = expect_reordering
        self.late = 0.0  # the most an out-of-order delivery came after its RTT alone
        self.mult = 1  # the window's steps of min_rtt / 4; one more per spurious retransmission
        self.srtt: dict[Stream, float] = {}  # stream -> its smoothed RTT and RTT variation
        self.var: dict[Stream, float] = {}  # (RFC 6298's estimator, per stream: queues differ)
        self.max_rtt: dict[Stream, float] = {}  # stream -> the longest RTT it has seen
        self.paths: dict[tuple[int, ...], int] = {}  # a sprayed route -> its path index

    def stream(self, c: int, route: tuple[int, ...] | None) -> Stream:
        """The stream of a packet of class ``c`` sent on ``route`` (None: the flow's one path)."""
        if route is None:
            return (c, 0)
        p = self.paths.get(route)
        if p is None:
            p = self.paths[route] = len(self.paths)
        return (c, p)

    def window(self, k: Stream, recovering: bool) -> float:
        """Stream ``k``'s reorder window. Before any reordering was seen, RFC 8985's: none
        while recovering, else a quarter of the least RTT (one more quarter per D-SACKed
        spurious retransmission). Once it was seen (or is expected), the largest of that,
        twice the most an out-of-order delivery came after the newer one's RTT, the stream's
        RTT spread srtt + 4 rttvar and the longest RTT the stream has seen."""
        base = self.mult * self.min_rtt / 4 if self.min_rtt < math.inf else 0.0
        if not self.seen:
            return 0.0 if recovering else base
        spread = self.srtt.get(k, 0.0) + 4.0 * self.var.get(k, 0.0)
        return max(base, 2.0 * self.late, spread, self.max_rtt.get(k, 0.0))


def delivered(conn: Any, s: int) -> bool:
    """Packet ``s`` was delivered: update its stream's newest delivery and mark lost what
    was sent before it on that stream and is overdue. True when this starts a recovery."""
    r = conn.rack
    assert r is not None
    k, now = conn.stream[s], conn.sim.now
    rtt = now - conn.sent_at[s]
    if conn.sent[s] > 1 and rtt < r.min_rtt:
        return False  # the original's ack, likely: no sample (RFC 8985 6.2 step 2)
    if conn.sent[s] == 1:
        r.min_rtt = min(r.min_rtt, rtt)
        r.max_rtt[k] = max(r.max_rtt.get(k, 0.0), rtt)
        if k in r.srtt:
            r.var[k] = 0.75 * r.var[k] + 0.25 * abs(r.srtt[k] - rtt)
            r.srtt[k] = 0.875 * r.srtt[k] + 0.125 * rtt
        else:
            r.srtt[k], r.var[k] = rtt, rtt / 2
    tid, (c, path) = conn.tx_id[s], k
    lost = False
    for hi in range(c, -1, -1):  # its stream, then the higher classes' on its path
        k2 = (hi, path)
        if tid > r.tx.get(k2, 0):
            r.tx[k2], r.rtt[k2] = tid, rtt
            if r.txq.get(k2):
                lost = mark(conn, k2) or lost
    return lost


def reordered(conn: Any, s: int) -> None:
    """The first transmission of ``s`` arrived (marked lost, given up, or not yet): when a
    packet of its stream sent after it was delivered first, that is reordering, and how late
    it came (its RTT over the newer one's) sets the window's floor."""
    r = conn.rack
    assert r is not None
    k = conn.stream[s]
    if conn.tx_id[s] < r.tx.get(k, 0):
        r.seen = True
        r.late = max(r.late, conn.sim.now - conn.sent_at[s] - r.rtt[k])


def mark(conn: Any, k: Stream) -> bool:
    """Mark lost each packet of stream ``k`` sent before its newest delivery whose RTT plus
    the reorder window has passed; arm the reorder timer for the first that has not (RFC
    8985 6.2 step 5). True when this starts a fast recovery."""
    r = conn.rack
    assert r is not None
    q = r.txq.get(k)
    newest, rtt, now = r.tx.get(k, 0), r.rtt.get(k, 0.0), conn.sim.now
    wnd = r.window(k, conn.in_prr)
    flight, lost = conn.pipe, False
    while q:
        tid, s = q[0]
        if conn.tx_id[s] != tid or conn.acked[s] or conn.lost[s]:
            q.popleft()
            continue
        if tid >= newest:
            break
        due = conn.sent_at[s] + rtt + wnd
        if now + 1e-12 < due:
            if due < r.armed.get(k, math.inf):
                r.armed[k] = due
                conn.sim.at(due, timer, conn, k, due)
            break
        q.popleft()
        conn._mark_lost(s)
        lost = True
    return lost and conn._recover(flight)


def timer(conn: Any, k: Stream, due: float) -> None:
    """Stream ``k``'s reorder timer (armed by :func:`mark` for ``due``)."""
    r = conn.rack
    assert r is not None
    if r.armed.get(k) != due:
        return  # re-armed earlier since
    del r.armed[k]
    entered = mark(conn, k)
    if conn.in_prr:
        conn._prr(0, entered)
    conn.try_send()
