"""The emulated network link between a run's ranks: its figures per pair of ranks, and the
time a message of ``n`` bytes takes over it (pure; the torch side that waits is
:mod:`qsync_opt.runtime.link`).

The CPU runtime's ranks (gloo on one machine) talk at memory speed. ``train --emulate-link``
makes every message take what a link of the given figures would take, so that
communication-bound strategies can be measured here, not only predicted. Off by default.

Which figures apply between two ranks: the replayer's communication model's
(:func:`qsync_opt.costs.roofline.estimate`'s ring all-reduce). Two ranks of the same group on
the same node (``devices_per_node`` ranks of a group per node, in rank order) talk over that
group's intra-node link: its ``intra_node_bandwidth_gb_per_s`` (else its device's) and the
cluster's ``intra_node_latency_us``; any other pair (two groups, or two nodes of one group)
over the inter-node link, ``inter_node_bandwidth_gb_per_s`` and ``inter_node_latency_us``.

The time of a message, with ``B`` a bandwidth in bytes/s and ``L`` a latency in seconds:

* an all-reduce over ``n`` ranks, a ring in rank order, paced by its slowest link:
  ``2(n-1)/n * bytes / B_min + 2(n-1) * L_max`` (``B_min`` the least bandwidth of the ring's
  links, ``L_max`` their largest latency): the replayer's ``CommModel.allreduce_ms``, which
  takes the inter-node link for a cluster of several nodes and the slowest group's
  intra-node link for one node: the same figures wherever the inter-node link is the
  slowest and the farthest, as in every catalog cluster;
* a broadcast: ``bytes / B_min + (n-1) * L_max`` (``CommModel.broadcast_ms``);
* a point-to-point send: ``bytes / B + L`` of the pair's link.

The replayer also scales the bandwidth by ``Efficiencies.network`` (0.8, what NCCL rings
achieve); the emulated link delivers its figure exactly, so a prediction of an emulated run
takes :meth:`LinkSpec.comm_model`, the link's own figures.

``--emulate-link`` (:func:`parse_link`): ``cluster`` (the plan's cluster's figures) or
``bw=GB/s,latency_us=US[,intra_bw=GB/s][,intra_latency_us=US]``: ``bw`` and ``latency_us``
between groups (and nodes), ``intra_bw`` and ``intra_latency_us`` within a node of a group
(default: the same as between).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from pydantic import Field, ValidationError, model_validator

from qsync_opt.core.errors import QsyncInputError, describe_validation_error
from qsync_opt.core.limits import parse_float
from qsync_opt.costs.devices import get_device
from qsync_opt.documents.schemas import ClusterSpec, CommModel, DeviceGroup, Int, Real, Schema

__all__ = ["LINK_FLAG", "LINK_HELP", "LINK_KINDS", "LinkFigures", "LinkSpec", "allreduce_s",
           "broadcast_s", "parse_link", "resolve_link", "send_s"]

LINK_FLAG = "--emulate-link"
LINK_HELP = ("cluster (the plan's cluster's figures) or bw=GB/s,latency_us=US"
             "[,intra_bw=GB/s][,intra_latency_us=US]")
#: What a message is: a ring all-reduce, a pipelined broadcast, a point-to-point send.
LINK_KINDS = ("allreduce", "broadcast", "send")
#: Bandwidths an emulated link may have, GB/s: below 1 MB/s a step would take hours (a
#: typo), above a PB/s nothing is emulated.
MIN_BANDWIDTH_GB_PER_S = 1e-3
MAX_BANDWIDTH_GB_PER_S = 1e6
#: The largest latency, microseconds (one second a hop).
MAX_LATENCY_US = 1e6
#: The flag's keys, and which of them must be given.
_KEYS = ("bw", "latency_us", "intra_bw", "intra_latency_us")
_REQUIRED = ("bw", "latency_us")


# ----------------------------------------------------------------------------- the formulas


def allreduce_s(nbytes: int, n: int, bandwidth_gb_per_s: float, latency_us: float) -> float:
    """A ring all-reduce of ``nbytes`` over ``n`` ranks: ``2(n-1)/n * bytes / B + 2(n-1) L``
    seconds (0 for one rank)."""
    if n <= 1:
        return 0.0
    steps = 2 * (n - 1)
    return steps / n * nbytes / (bandwidth_gb_per_s * 1e9) + steps * latency_us * 1e-6


def broadcast_s(nbytes: int, n: int, bandwidth_gb_per_s: float, latency_us: float) -> float:
    """A pipelined broadcast from one rank to ``n - 1``: ``bytes / B + (n-1) L`` seconds."""
    if n <= 1:
        return 0.0
    return nbytes / (bandwidth_gb_per_s * 1e9) + (n - 1) * latency_us * 1e-6


def send_s(nbytes: int, bandwidth_gb_per_s: float, latency_us: float) -> float:
    """A point-to-point message: ``bytes / B + L`` seconds."""
    return nbytes / (bandwidth_gb_per_s * 1e9) + latency_us * 1e-6


# ----------------------------------------------------------------------------- the flag


@dataclass(frozen=True)
class LinkFigures:
    """``--emulate-link``'s text read: ``cluster`` (``figures`` None) or its figures
    (``bw``, ``latency_us``, ``intra_bw``, ``intra_latency_us``; the intra ones default to
    the others)."""

    text: str
    figures: dict[str, float] | None = None

    @property
    def from_cluster(self) -> bool:
        return self.figures is None


def _number(key: str, raw: str) -> float:
    v = parse_float(raw)  # ASCII digits, finite: never '١', 'nan', 'inf' or '1e999'
    if key.endswith("bw"):
        lo, hi, what = MIN_BANDWIDTH_GB_PER_S, MAX_BANDWIDTH_GB_PER_S, "GB/s"
        ok = v is not None and lo <= v <= hi
    else:
        lo, hi, what = 0.0, MAX_LATENCY_US, "microseconds"
        ok = v is not None and lo <= v <= hi
    if not ok or v is None:
        raise QsyncInputError(f"{LINK_FLAG}: {key} must be a number in ASCII digits from "
                              f"{lo:g} to {hi:g} ({what}), got {raw.strip()!r}")
    return v


def parse_link(text: str) -> LinkFigures:
    """``--emulate-link``'s text (:data:`LINK_HELP`); QsyncInputError names the flag."""
    if not isinstance(text, str) or not text.strip():
        raise QsyncInputError(f"{LINK_FLAG}: expected {LINK_HELP}, got {text!r}")
    s = text.strip()
    if s.lower() == "cluster":
        return LinkFigures("cluster")
    raw = s.split(",")
    items = [(k.strip().lower(), eq, v) for k, eq, v in (x.partition("=") for x in raw)]
    bad = [x for x, (k, eq, _) in zip(raw, items, strict=True) if not eq or not k]
    if bad:
        raise QsyncInputError(f"{LINK_FLAG}: {bad[0].strip()!r} is not KEY=VALUE; expected "
                              f"{LINK_HELP}")
    keys = [k for k, _, _ in items]
    unknown = [k for k in keys if k not in _KEYS]
    if unknown:
        raise QsyncInputError(f"{LINK_FLAG}: unknown key {unknown[0]!r}; expected {LINK_HELP}")
    twice = [k for k in _KEYS if keys.count(k) > 1]
    if twice:
        raise QsyncInputError(f"{LINK_FLAG}: {twice[0]} given twice")
    figures = {k: _number(k, v) for k, _, v in items}
    missing = [k for k in _REQUIRED if k not in figures]
    if missing:
        raise QsyncInputError(f"{LINK_FLAG}: {missing[0]} is missing; expected {LINK_HELP}")
    figures.setdefault("intra_bw", figures["bw"])
    figures.setdefault("intra_latency_us", figures["latency_us"])
    return LinkFigures(s, figures)


# ----------------------------------------------------------------------------- the link


class LinkSpec(Schema):
    """The emulated link of a run: the figures between every two of its ranks (module
    docstring). Recorded in the run's config (``TrainConfig.link``)."""

    source: Literal["cluster", "flag"] = Field(
        description="Where the figures come from: the plan's cluster or --emulate-link's.")
    bandwidth_gb_per_s: Real = Field(
        ge=MIN_BANDWIDTH_GB_PER_S, le=MAX_BANDWIDTH_GB_PER_S,
        description="Between groups and between nodes: per-direction bandwidth, GB/s.")
    latency_us: Real = Field(ge=0, le=MAX_LATENCY_US,
                             description="Between groups and between nodes: latency a hop, us.")
    intra_bandwidth_gb_per_s: dict[str, Real] = Field(
        description="Group -> per-direction bandwidth between two of its ranks on one node.")
    intra_latency_us: Real = Field(ge=0, le=MAX_LATENCY_US,
                                   description="Within a node: latency a hop, us.")
    rank_groups: list[str] = Field(min_length=1, description="Group of each rank, in order.")
    devices_per_node: dict[str, Int] = Field(
        description="Group -> its ranks per node (in rank order).")

    @model_validator(mode="after")
    def _check(self) -> LinkSpec:
        for g, bw in self.intra_bandwidth_gb_per_s.items():
            if not MIN_BANDWIDTH_GB_PER_S <= bw <= MAX_BANDWIDTH_GB_PER_S:
                raise ValueError(f"intra_bandwidth_gb_per_s[{g!r}] must be from "
                                 f"{MIN_BANDWIDTH_GB_PER_S:g} to {MAX_BANDWIDTH_GB_PER_S:g} "
                                 f"GB/s, got {bw!r}")
        for g, k in self.devices_per_node.items():
            if k < 1:
                raise ValueError(f"devices_per_node[{g!r}] must be at least 1, got {k}")
        for g in sorted(set(self.rank_groups)):
            if g not in self.intra_bandwidth_gb_per_s or g not in self.devices_per_node:
                raise ValueError(f"group {g!r} of rank_groups has no intra-node figures")
        return self

    # -- construction
    @classmethod
    def from_cluster(cls, cluster: ClusterSpec, groups_of_ranks: Sequence[str]) -> LinkSpec:
        """The plan's cluster's figures for ranks of these groups (module docstring)."""
        by_name = _groups_of(cluster, groups_of_ranks)
        intra = {g: float(grp.intra_node_bandwidth_gb_per_s
                          or get_device(grp.device).intra_node_bandwidth_gb_per_s)
                 for g, grp in by_name.items()}
        return cls(source="cluster", bandwidth_gb_per_s=cluster.inter_node_bandwidth_gb_per_s,
                   latency_us=cluster.inter_node_latency_us, intra_bandwidth_gb_per_s=intra,
                   intra_latency_us=cluster.intra_node_latency_us,
                   rank_groups=list(groups_of_ranks),
                   devices_per_node={g: grp.devices_per_node for g, grp in by_name.items()})

    @classmethod
    def from_figures(cls, figures: dict[str, float], cluster: ClusterSpec,
                     groups_of_ranks: Sequence[str]) -> LinkSpec:
        """``--emulate-link bw=...``'s figures, the nodes laid out as the plan's cluster's."""
        by_name = _groups_of(cluster, groups_of_ranks)
        return cls(source="flag", bandwidth_gb_per_s=figures["bw"],
                   latency_us=figures["latency_us"],
                   intra_bandwidth_gb_per_s={g: figures["intra_bw"] for g in by_name},
                   intra_latency_us=figures["intra_latency_us"],
                   rank_groups=list(groups_of_ranks),
                   devices_per_node={g: grp.devices_per_node for g, grp in by_name.items()})

    # -- the figures between ranks
    @property
    def world_size(self) -> int:
        return len(self.rank_groups)

    @cached_property
    def _nodes(self) -> list[tuple[str, int]]:
        seen: dict[str, int] = {}
        out = []
        for g in self.rank_groups:
            index = seen.get(g, 0)
            seen[g] = index + 1
            out.append((g, index // self.devices_per_node[g]))
        return out

    def node_of(self, rank: int) -> tuple[str, int]:
        """(group, node of that group) of ``rank``: a group's ranks fill its nodes in order."""
        return self._nodes[rank]

    def pair(self, a: int, b: int) -> tuple[float, float]:
        """(GB/s, us) of the link between ranks ``a`` and ``b``."""
        node = self.node_of(a)
        if node == self.node_of(b):
            return self.intra_bandwidth_gb_per_s[node[0]], self.intra_latency_us
        return self.bandwidth_gb_per_s, self.latency_us

    def ring(self, ranks: Sequence[int] | None = None) -> tuple[int, float, float]:
        """(n, GB/s of the slowest link, us of the longest) of the ring over ``ranks`` (all
        of the run's by default), in rank order."""
        rs = sorted(set(range(self.world_size) if ranks is None else ranks))
        for r in rs:
            if not 0 <= r < self.world_size:
                raise ValueError(f"rank {r} is not a rank of the link's {self.world_size}")
        if len(rs) < 2:
            return len(rs), self.bandwidth_gb_per_s, 0.0
        links = [self.pair(a, b) for a, b in zip(rs, [*rs[1:], rs[0]], strict=True)]
        return len(rs), min(bw for bw, _ in links), max(lat for _, lat in links)

    def delay_s(self, kind: str, nbytes: int, ranks: Sequence[int] | None = None) -> float:
        """Seconds a message of ``nbytes`` takes over the link: an ``allreduce`` or a
        ``broadcast`` over ``ranks`` (default all), or a ``send`` from ``ranks[0]`` to
        ``ranks[1]``."""
        if kind == "send":
            if ranks is None or len(ranks) != 2 or ranks[0] == ranks[1]:
                raise ValueError(f"a send goes between two ranks, got {ranks!r}")
            return send_s(nbytes, *self.pair(ranks[0], ranks[1]))
        n, bw, lat = self.ring(ranks)
        if kind == "allreduce":
            return allreduce_s(nbytes, n, bw, lat)
        if kind == "broadcast":
            return broadcast_s(nbytes, n, bw, lat)
        raise ValueError(f"kind: expected one of {', '.join(LINK_KINDS)}, got {kind!r}")

    def comm_model(self, ranks: Sequence[int] | None = None) -> CommModel:
        """The replayer's communication model of this link's ring (its figures exactly: no
        ring efficiency), for predicting an emulated run."""
        n, bw, lat = self.ring(ranks)
        return CommModel(world_size=max(n, 1), bandwidth_gb_per_s=bw, latency_us=lat,
                         bottleneck=f"the {self.describe()} link", source="estimated")

    def describe(self) -> str:
        """One line, e.g. ``emulated 1.25 GB/s, 50 us``: the figures of the links the ranks
        use (between groups or nodes; within a node, per group)."""
        per_node: dict[tuple[str, int], int] = {}
        for node in self._nodes:
            per_node[node] = per_node.get(node, 0) + 1
        inter = len(per_node) > 1
        seen = {g: None for (g, _), k in per_node.items() if k > 1}  # groups with intra links
        intra = bool(seen)
        out = f"{self.bandwidth_gb_per_s:g} GB/s, {self.latency_us:g} us"
        within = ", ".join(f"{self.intra_bandwidth_gb_per_s[g]:g} GB/s ({g})" for g in seen)
        within += f", {self.intra_latency_us:g} us"
        uniform = (self.intra_latency_us == self.latency_us and all(
            self.intra_bandwidth_gb_per_s[g] == self.bandwidth_gb_per_s for g in seen))
        if intra and not inter and not uniform:
            out = f"{within} within a node"
        elif intra and inter and not uniform:
            out += f" between groups and nodes; {within} within a node"
        return "emulated " + out + (" (the plan's cluster)" if self.source == "cluster" else "")


def _groups_of(cluster: ClusterSpec, groups_of_ranks: Sequence[str]) -> dict[str, DeviceGroup]:
    """The cluster's groups the ranks name, by name (QsyncInputError for one it lacks)."""
    known = {g.name: g for g in cluster.groups}
    out = {}
    for r, g in enumerate(groups_of_ranks):
        if g not in known:
            raise QsyncInputError(f"{LINK_FLAG}: rank {r}'s group {g!r} is not in the "
                                  f"cluster; its groups: {', '.join(known)}")
        out[g] = known[g]
    return out


def resolve_link(text: str | None, cluster: ClusterSpec,
                 groups_of_ranks: Sequence[str]) -> LinkSpec | None:
    """``--emulate-link``'s link for these ranks of the plan's ``cluster`` (None: no flag)."""
    if text is None:
        return None
    flag = parse_link(text)
    try:
        if flag.figures is None:
            return LinkSpec.from_cluster(cluster, groups_of_ranks)
        return LinkSpec.from_figures(flag.figures, cluster, groups_of_ranks)
    except ValidationError as exc:  # a cluster file's figures beyond the link's limits
        raise QsyncInputError(f"{LINK_FLAG} {flag.text}: the plan's cluster gives "
                              + describe_validation_error(exc)) from None
