"""Per-packet spraying against ns-3's per-packet random ECMP (qsync_opt.netsim.ns3leafspine):
K flows across a two-leaf, two-spine fabric, each packet's spine drawn at random, in ns-3
(``Ipv4GlobalRouting::RandomEcmpRouting``, NewReno with SACK and the three-duplicate-ack
rule) and on our simulator with ``routing="spray"`` under ns-3's rule (``dupthresh``) and
under ours (RACK per class and path). Completion time of the last flow, retransmissions,
drops and timeouts per seeded run (ns-3's RNG run r; our seed r), then the means.
Simulated time: the figures do not depend on this machine's load. Needs ns-3's bindings.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_ns3_spray.py --runs 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from qsync_opt.netsim import ns3ref
from qsync_opt.netsim.ns3leafspine import MSS, ours


def cases(runs: int, buffers: list[int], k: int, nbytes: int) -> list[dict[str, Any]]:
    base = dict(kind="leafspine", hosts_per_leaf=k, bytes_each=nbytes, host_gbps=10.0,
                uplink_gbps=10.0, delay_us=5.0, mss=MSS, min_rto_ms=200.0, spray=True)
    return [{**base, "buffer_packets": b, "run": r} for b in buffers for r in range(1, runs + 1)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--buffers", default="10000,100", help="switch queues (packets)")
    ap.add_argument("--hosts-per-leaf", type=int, default=4)
    ap.add_argument("--bytes", type=int, default=1_000_000, help="per flow")
    args = ap.parse_args(argv)
    try:
        buffers = [int(b) for b in args.buffers.split(",")]
    except ValueError:
        raise SystemExit(f"--buffers: expected comma-separated packet counts, got "
                         f"{args.buffers!r}") from None
    for flag, v, hi in (("--runs", args.runs, 100), ("--hosts-per-leaf", args.hosts_per_leaf, 64),
                        ("--bytes", args.bytes, 1 << 30), *(("--buffers", b, 10**6) for b in buffers)):
        if not 1 <= v <= hi:
            raise SystemExit(f"{flag}: expected an integer in [1, {hi}], got {v}")
    if not ns3ref.available():
        raise SystemExit(ns3ref.MISSING_MESSAGE)
    cs = cases(args.runs, buffers, args.hosts_per_leaf, args.bytes)
    theirs = ns3ref.run(cs, timeout_s=1800)
    k = args.hosts_per_leaf
    print(f"{k} flows of {args.bytes:,} bytes leaf 0 -> leaf 1, hosts and uplinks 10 Gb/s, "
          f"5 us per cable, 2 spines, min RTO 200 ms, mss {MSS}; per run: completion ms / "
          "retransmissions / drops / timeouts")
    rows: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for c, t in zip(cs, theirs, strict=True):
        t = {**t, "timeouts": None}
        mine = {d: ours(c, "spray", d, c["run"]) for d in ("dupthresh", "rack")}
        cells = [("ns-3", t), ("ours dupthresh", mine["dupthresh"]), ("ours rack", mine["rack"])]
        line = f"  buffer {c['buffer_packets']:5d} run {c['run']}:"
        for name, r in cells:
            rows.setdefault((c["buffer_packets"], name), []).append(r)
            to = "-" if r["timeouts"] is None else r["timeouts"]
            line += (f"  {name} {r['completion_ms']:.3f} / {r['retx_packets']} / "
                     f"{r['lost_packets']} / {to}")
        print(line, flush=True)
    print("means over the runs:")
    for (buf, name), rs in rows.items():
        ref = statistics.fmean(r["completion_ms"] for r in rows[(buf, "ns-3")])
        m = statistics.fmean(r["completion_ms"] for r in rs)
        print(f"  buffer {buf:5d} {name:15s} completion {m:.3f} ms ({m / ref - 1:+.1%} vs ns-3), "
              f"retransmissions {statistics.fmean(r['retx_packets'] for r in rs):.1f}, "
              f"drops {statistics.fmean(r['lost_packets'] for r in rs):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
