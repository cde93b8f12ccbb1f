"""The parser of ``netsim`` (its body: :mod:`qsync_opt.cli.netsim`)."""

from __future__ import annotations

import argparse
from typing import Any

from qsync_opt.cli.args import SEED, Deferred, finite_float, model_args, positive_int
from qsync_opt.costs.cluster import SHORTHAND_HELP
from qsync_opt.netsim.traffic import POLICIES as NETSIM_POLICIES
from qsync_opt.netsim.traffic import SCENARIOS as NETSIM_SCENARIOS

#: The netsim policies whose transport is bounded-loss: the ones ``--p`` applies to.
BOUNDED_POLICIES = [k for k, (_, transport) in NETSIM_POLICIES.items() if transport == "bounded"]


def add_netsim_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``netsim`` (its body: :func:`~qsync_opt.cli.netsim.cmd_netsim`)."""
    sp = sub.add_parser("netsim", help="simulate an iteration's gradient traffic packet by packet",
                        description="simulate an iteration's gradient traffic packet by packet")
    sp.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                    help="write the summary JSON to FILE (stdout without FILE)")
    model_args(sp)
    sp.add_argument("--cluster", required=True, help=f"cluster file or {SHORTHAND_HELP}")
    sp.add_argument("--plan", help="Plan JSON whose compute timeline emits the buckets "
                    "(default: every group at its highest precision)")
    sp.add_argument("--scenario", choices=list(NETSIM_SCENARIOS), default="ring")
    sp.add_argument("--pattern", choices=["ring", "ps", "hierarchical"], default=None,
                    help="the collective (default: the scenario's)")
    sp.add_argument("--policy", choices=list(NETSIM_POLICIES), default="fifo+tcp")
    sp.add_argument("--routing", choices=["hash", "spray"], default="hash")
    sp.add_argument("--p", type=finite_float(0, 0.5), default=0.05,
                    help=f"{' and '.join(BOUNDED_POLICIES)}: the loss bound per message "
                         "(default 0.05)")
    sp.add_argument("--iterations", type=positive_int(100_000), default=100)
    sp.add_argument("--cell-kib", type=positive_int(1 << 20), default=256,
                    help="packet (cell) payload in KiB (default 256: larger cells, fewer events)")
    sp.add_argument("--buffer-kib", type=positive_int(1 << 30), default=4096,
                    help="switch port buffer in KiB (default 4096)")
    sp.add_argument("--jitter", type=finite_float(0, 1), default=0.01,
                    help="relative noise of each rank's ready times per iteration")
    sp.add_argument("--min-rto-ms", type=finite_float(0, 1e5, lo_open=True), default=200.0,
                    help="the least retransmission timeout (default 200: Linux's TCP_RTO_MIN)")
    sp.add_argument("--detect", choices=["rack", "dupthresh"], default="rack",
                    help="loss detection: rack (time-based, tolerates reordering; default) or "
                         "dupthresh (3 later packets acked: ns-3's, takes reordering for loss)")
    sp.add_argument("--seed", type=SEED, default=0)
    sp.add_argument("--max-events", type=positive_int(10**9), default=5_000_000)
    sp.add_argument("--png", help="draw the busiest links' load over time (first iteration)")
    sp.set_defaults(fn=Deferred("qsync_opt.cli.netsim", "cmd_netsim"))
    return sp
