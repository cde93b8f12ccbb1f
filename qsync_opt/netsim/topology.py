"""Topologies for the packet-level simulator: hosts, switches, directed links, routes.

Links are full duplex: :meth:`Topology.connect` adds one directed link each way. Every
directed link owns the output queue at its upstream end (bandwidth, propagation delay, a
finite buffer in bytes). Routes are all equal-cost shortest paths (hop count), so a switch
with several next hops towards a host chooses among them by flow hash (ECMP) or per packet
(spraying) -- :mod:`qsync_opt.netsim.engine` decides which.

Builders: :func:`single_link` (two hosts, one link: the analytic bottleneck case),
:func:`star` (N senders and a receiver on one switch: incast), and :func:`fabric` (a
two-level leaf/spine network, one leaf per node of a cluster).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MIN_BUFFER = 1


@dataclass(slots=True)
class Link:
    """One direction of a cable: ``src -> dst`` at ``gbps`` Gbit/s, ``delay_us`` one way,
    an output buffer of ``buffer_bytes`` at ``src``."""

    index: int
    src: int
    dst: int
    gbps: float
    delay_us: float
    buffer_bytes: int
    label: str = ""

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9 / 8


@dataclass
class Topology:
    """Nodes (hosts and switches, by index), directed links, equal-cost next hops."""

    names: list[str] = field(default_factory=list)
    is_host: list[bool] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    out: list[list[int]] = field(default_factory=list)  # node -> link indices leaving it
    _next: dict[int, list[list[int]]] = field(default_factory=dict)  # dst -> node -> links

    _index: dict[str, int] = field(default_factory=dict)  # name -> node

    def add(self, name: str, host: bool) -> int:
        if name in self._index:
            raise ValueError(f"node {name!r} defined twice")
        self._index[name] = len(self.names)
        self.names.append(name)
        self.is_host.append(host)
        self.out.append([])
        self._next.clear()
        return len(self.names) - 1

    def host(self, name: str) -> int:
        return self.add(name, True)

    def switch(self, name: str) -> int:
        return self.add(name, False)

    def connect(self, a: int, b: int, gbps: float, delay_us: float, buffer_bytes: int,
                *, gbps_back: float | None = None) -> tuple[Link, Link]:
        """A full-duplex cable: one directed link each way (same buffer size per port)."""
        if not gbps > 0 or (gbps_back is not None and not gbps_back > 0):
            raise ValueError(f"link {self.names[a]}-{self.names[b]}: gbps must be > 0")
        if not delay_us >= 0:
            raise ValueError(f"link {self.names[a]}-{self.names[b]}: delay_us must be >= 0")
        if buffer_bytes < MIN_BUFFER:
            raise ValueError(f"link {self.names[a]}-{self.names[b]}: buffer_bytes must be >= 1")
        made = []
        for s, d, g in ((a, b, gbps), (b, a, gbps if gbps_back is None else gbps_back)):
            link = Link(len(self.links), s, d, float(g), float(delay_us), int(buffer_bytes),
                        f"{self.names[s]}->{self.names[d]}")
            self.links.append(link)
            self.out[s].append(link.index)
            made.append(link)
        self._next.clear()
        return made[0], made[1]

    @property
    def hosts(self) -> list[int]:
        return [i for i, h in enumerate(self.is_host) if h]

    def next_links(self, node: int, dst: int) -> list[int]:
        """The links leaving ``node`` on some shortest path to ``dst`` (hosts forward only
        their own traffic: a path never passes through another host)."""
        table = self._next.get(dst)
        if table is None:
            table = self._routes_to(dst)
            self._next[dst] = table
        return table[node]

    def _routes_to(self, dst: int) -> list[list[int]]:
        n = len(self.names)
        dist = [-1] * n
        dist[dst] = 0
        into: list[list[int]] = [[] for _ in range(n)]
        for link in self.links:
            into[link.dst].append(link.index)
        q = deque([dst])
        while q:
            v = q.popleft()
            if self.is_host[v] and v != dst:
                continue  # no transit through hosts
            for li in into[v]:
                u = self.links[li].src
                if dist[u] < 0:
                    dist[u] = dist[v] + 1
                    q.append(u)
        table: list[list[int]] = [[] for _ in range(n)]
        for u in range(n):
            if u == dst or dist[u] < 0:
                continue
            table[u] = [li for li in self.out[u]
                        if dist[self.links[li].dst] == dist[u] - 1
                        and (not self.is_host[self.links[li].dst] or self.links[li].dst == dst)]
        return table

    def path(self, src: int, dst: int) -> list[int]:
        """One shortest path (the first next hop at each node): for base delays."""
        out, node = [], src
        while node != dst:
            hops = self.next_links(node, dst)
            if not hops:
                raise ValueError(f"no route from {self.names[src]} to {self.names[dst]}")
            out.append(hops[0])
            node = self.links[hops[0]].dst
        return out


def single_link(gbps: float, delay_us: float, buffer_bytes: int) -> Topology:
    """Hosts ``a`` and ``b`` joined by one cable: the bottleneck is the a->b link."""
    t = Topology()
    a, b = t.host("a"), t.host("b")
    t.connect(a, b, gbps, delay_us, buffer_bytes)
    return t


def star(senders: int, gbps: float, delay_us: float, buffer_bytes: int,
         *, edge_buffer_bytes: int | None = None) -> Topology:
    """``senders`` hosts and one receiver ``r`` on a switch ``sw``; every cable ``gbps`` and
    ``delay_us``. The switch's port to ``r`` (``buffer_bytes``) is the incast bottleneck;
    the other ports get ``edge_buffer_bytes`` (default: the same)."""
    if senders < 1:
        raise ValueError("senders must be >= 1")
    t = Topology()
    hosts = [t.host(f"h{i}") for i in range(senders)]
    r = t.host("r")
    sw = t.switch("sw")
    edge = buffer_bytes if edge_buffer_bytes is None else edge_buffer_bytes
    for h in hosts:
        t.connect(h, sw, gbps, delay_us, edge)
    down, up = t.connect(sw, r, gbps, delay_us, buffer_bytes)
    up.buffer_bytes = edge
    return t


@dataclass(frozen=True)
class FabricSpec:
    """A leaf/spine fabric for a cluster: one leaf (node switch) per node, ``hosts_per_leaf``
    devices on it at ``host_gbps``; each leaf has one uplink to each of ``spines`` spines at
    ``uplink_gbps``. ``extra_hosts`` (e.g. a parameter server) sit on leaf 0."""

    leaves: int
    hosts_per_leaf: int
    host_gbps: float
    host_delay_us: float
    uplink_gbps: float
    uplink_delay_us: float
    spines: int = 2
    buffer_bytes: int = 4 << 20
    extra_hosts: tuple[str, ...] = ()
    extra_gbps: float | None = None


def fabric(spec: FabricSpec) -> Topology:
    """Build :class:`FabricSpec`: hosts ``d0..`` (leaf-major order), leaves ``leaf0..``,
    spines ``spine0..``, extra hosts by name on their own leaf ``leafx`` (uplinks the same)."""
    if spec.leaves < 1 or spec.hosts_per_leaf < 1 or spec.spines < 1:
        raise ValueError("leaves, hosts_per_leaf and spines must be >= 1")
    t = Topology()
    for i in range(spec.leaves * spec.hosts_per_leaf):
        t.host(f"d{i}")
    extra = [t.host(n) for n in spec.extra_hosts]
    leaves = [t.switch(f"leaf{j}") for j in range(spec.leaves)]
    xleaf = t.switch("leafx") if extra else None
    spines = [t.switch(f"spine{s}") for s in range(spec.spines)] if (
        spec.leaves > 1 or extra) else []
    for i in range(spec.leaves * spec.hosts_per_leaf):
        t.connect(i, leaves[i // spec.hosts_per_leaf], spec.host_gbps, spec.host_delay_us,
                  spec.buffer_bytes)
    for h in extra:
        assert xleaf is not None
        t.connect(h, xleaf, spec.extra_gbps or spec.uplink_gbps * spec.spines,
                  spec.host_delay_us, spec.buffer_bytes)
    for leaf in leaves + ([xleaf] if xleaf is not None else []):
        for s in spines:
            t.connect(leaf, s, spec.uplink_gbps, spec.uplink_delay_us, spec.buffer_bytes)
    return t
