"""A packet-level network simulator for gradient traffic (DLCP's network half).

:mod:`.topology` builds hosts, switches and links; :mod:`.engine` runs packets through
queues with a NewReno-like or a bounded-loss transport; :mod:`.traffic` drives the
collectives (ring, parameter server, hierarchical) from bucket ready times;
:mod:`.cluster` builds a cluster's fabric and a workload's buckets and feeds the replayer;
:mod:`.ns3ref` runs the cases ns-3 can also run, for the cross-check. docs/NETSIM.md.
"""

from qsync_opt.netsim.engine import NetsimLimit, Sim
from qsync_opt.netsim.topology import FabricSpec, Topology, fabric, single_link, star
from qsync_opt.netsim.traffic import (
           PATTERNS,
           POLICIES,
           Bucket,
           IterationResult,
           NetConfig,
           simulate_iteration,
)

__all__ = ["PATTERNS", "POLICIES", "Bucket", "FabricSpec", "IterationResult", "NetConfig",
           "NetsimLimit", "Sim", "Topology", "fabric", "simulate_iteration", "single_link",
           "star"]
