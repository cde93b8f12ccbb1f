"""Time-based loss detection's state (RACK, RFC 8985) for :class:`.engine.Connection`."""

from __future__ import annotations

import math
from collections import deque


class Rack:
    """Time-based loss detection's state (RACK, RFC 8985), one record per priority class:
    the transmissions in send order, and the newest-sent delivered packet's id and RTT."""

    __slots__ = ("txq", "tx", "rtt", "armed", "min_rtt", "seen", "late", "mult", "srtt", "var", "max_rtt")

    def __init__(self, expect_reordering: bool = False) -> None:
        self.txq: dict[int, deque[tuple[int, int]]] = {}  # class -> (tx id, seq), send order
        self.tx: dict[int, int] = {}  # class -> tx id of the newest-sent delivered packet
        self.rtt: dict[int, float] = {}  # class -> that delivery's RTT
        self.armed: dict[int, float] = {}  # class -> when its reorder timer fires
        self.min_rtt = math.inf
        # a packet was delivered after one sent later than it (or the host is configured to
        # expect it: behind a spraying fabric, as Linux's tcp_reordering sysctl allows)
        self.seen = expect_reordering
        self.late = 0.0  # the most an out-of-order delivery came after its RTT alone
        self.mult = 1  # the window's steps of min_rtt / 4; one more per spurious retransmission
        self.srtt: dict[int, float] = {}  # class -> its smoothed RTT and RTT variation (RFC
        self.var: dict[int, float] = {}  # 6298's estimator, per class: the queues differ)
        self.max_rtt: dict[int, float] = {}  # class -> the longest RTT it has seen

    def window(self, c: int, recovering: bool) -> float:
        """Class ``c``'s reorder window. Before any reordering was seen, RFC 8985's: none
        while recovering, else a quarter of the least RTT (one more quarter per D-SACKed
        spurious retransmission). Once it was seen (or is expected), the largest of that,
        twice the most an out-of-order delivery came after the newer one's RTT, the class's
        RTT spread srtt + 4 rttvar and the longest RTT the class has seen."""
        base = self.mult * self.min_rtt / 4 if self.min_rtt < math.inf else 0.0
        if not self.seen:
            return 0.0 if recovering else base
        spread = self.srtt.get(c, 0.0) + 4.0 * self.var.get(c, 0.0)
        return max(base, 2.0 * self.late, spread, self.max_rtt.get(c, 0.0))
