"""The packet simulator against ns-3, and the four queue + transport policies under incast.

Part 1 (``--ns3``, needs the ``ns3`` extra): ns-3 and qsync_opt.netsim run the same N-to-1
TCP incasts (NewReno, 1448-byte segments, initial window 10, every segment acked, 1 ms
minimum RTO, 10 Gb/s links, tail-drop buffers from 20 to 1000 packets) and one bottleneck
link; prints completion times side by side, their ratio, and the drops of each.

Part 2 (always): a 1-to-N parameter-server incast on a star (every sender pushes a 250 kB
bucket of ten layers to one host, which sends the sum back), for each of fifo+tcp,
fifo+bounded, priority+tcp and priority+bounded; p50/p99 of the iteration's end over seeded
iterations, drops and timeouts (RACK loss detection, the least RTO of --min-rto-ms, default
Linux's 200 ms). Simulated time: the figures do not depend on the machine's
load.

    .venv/bin/python benchmarks/bench_netsim.py [--ns3] [--seeds 30] [--min-rto-ms 200]
"""

from __future__ import annotations

import argparse
import math
import time

from qsync_opt.netsim import Sim, single_link, star
from qsync_opt.netsim.engine import DEFAULT_MIN_RTO_MS
from qsync_opt.netsim.traffic import POLICIES, Bucket, NetConfig, quantile, simulate_iteration

MSS = 1448
HEADER = 20 + 20 + 2  # TCP + IPv4 (no options) + PPP, as ns-3 puts them on a point-to-point link
WIRE = MSS + HEADER


def ours(case: dict) -> tuple[float, int]:
    """(completion ms, packets dropped) of one ns3ref case in our model."""
    if case["kind"] == "bottleneck":
        sim = Sim(single_link(case["gbps"], case["delay_us"], WIRE * case["buffer_packets"]))
        senders, dst, nbytes = [0], 1, case["bytes"]
    else:
        topo = star(case["senders"], case["gbps"], case["delay_us"], WIRE * case["buffer_packets"],
                    edge_buffer_bytes=WIRE * 10000)
        sim = Sim(topo)
        senders, dst, nbytes = list(range(case["senders"])), topo.names.index("r"), case["bytes_each"]
    done: list[float] = []
    conns = [sim.connection(h, dst, mss=MSS, header=HEADER, init_cwnd=10, min_rto_ms=1.0,
                            initial_rto_ms=1000.0, handshake=True) for h in senders]
    for c in conns:
        c.send(nbytes, on_done=done.append)
    sim.run()
    return max(done) * 1e3, sum(c.dropped for c in conns)


def ns3_part() -> None:
    from qsync_opt.netsim import ns3ref

    if not ns3ref.available():
        print(ns3ref.MISSING_MESSAGE)
        return
    cases: list[dict] = [{"kind": "bottleneck", "bytes": 10_000_000, "gbps": 1.0, "delay_us": 50.0,
                          "buffer_packets": 10000}]
    for n, q, b, d in [(8, 10000, 1_000_000, 10.0), (8, 20, 1_000_000, 10.0),
                       (8, 50, 1_000_000, 10.0), (8, 100, 1_000_000, 10.0),
                       (8, 300, 1_000_000, 10.0), (4, 20, 1_000_000, 10.0),
                       (16, 50, 1_000_000, 10.0), (16, 1000, 1_000_000, 10.0),
                       (32, 100, 500_000, 10.0), (8, 100, 1_000_000, 50.0),
                       (16, 200, 2_000_000, 25.0)]:
        cases.append({"kind": "incast", "senders": n, "bytes_each": b, "gbps": 10.0,
                      "delay_us": d, "buffer_packets": q})
    for c in cases:
        c.update(mss=MSS, min_rto_ms=1.0)
    t0 = time.perf_counter()
    theirs = ns3ref.run(cases, timeout_s=600)
    print(f"ns-3 ({time.perf_counter() - t0:.0f} s for {len(cases)} cases) against ours, "
          "completion time of the last flow:")
    print(f"  {'case':44s} {'ns-3 ms':>9s} {'ours ms':>9s} {'ours/ns-3':>9s} "
          f"{'ns-3 drops':>10s} {'our drops':>9s}")
    ratios = []
    for case, res in zip(cases, theirs, strict=True):
        t_ours, d_ours = ours(case)
        t_ns3 = res["fct_ms"] if case["kind"] == "bottleneck" else res["completion_ms"]
        if case["kind"] == "bottleneck":
            name = (f"1 flow {case['bytes'] / 1e6:g} MB, {case['gbps']:g} Gb/s, "
                    f"{case['delay_us']:g} us")
        else:
            name = (f"{case['senders']}x{case['bytes_each'] / 1e6:g} MB incast, "
                    f"{case['buffer_packets']} pkt buffer, {case['delay_us']:g} us")
        ratios.append(t_ours / t_ns3)
        print(f"  {name:44s} {t_ns3:9.3f} {t_ours:9.3f} {t_ours / t_ns3:9.3f} "
              f"{res['lost_packets']:10d} {d_ours:9d}")
    print(f"  ours/ns-3 from {min(ratios):.3f} to {max(ratios):.3f}")


def incast_part(seeds: int, min_rto_ms: float) -> None:
    print(f"\nparameter-server incast on a star, 10 Gb/s, 5 us links, one 250 kB bucket of ten "
          f"layers per sender (back layer first), 1460-byte cells, start jitter 20 us, "
          f"RACK loss detection, min RTO {min_rto_ms:g} ms, {seeds} seeded iterations:")
    bucket = Bucket(tuple((f"l{i}", 25_000, 1 - i / 9) for i in range(10)))
    print(f"  {'senders/buffer/p':18s} {'policy':17s} {'p50 ms':>8s} {'p99 ms':>8s} "
          f"{'drops/flow':>10s} {'timeouts':>8s} {'lost':>7s}")
    for n, bufp, p in [(8, 32, 0.05), (8, 64, 0.05), (16, 32, 0.05), (16, 64, 0.05),
                       (16, 128, 0.05), (16, 32, 0.1), (32, 128, 0.05)]:
        topo = star(n, 10, 5, 1500 * bufp)
        ps = topo.names.index("r")
        for policy in POLICIES:
            cfg = NetConfig(policy=policy, p=p, cell_bytes=1460, header_bytes=40,
                            start_jitter_us=20, min_rto_ms=min_rto_ms)
            runs = [simulate_iteration(topo, list(range(n)), [bucket], [[0.0]] * n, cfg,
                                       pattern="ps", ps=ps, seed=s) for s in range(seeds)]
            t = [r.comm_end_ms for r in runs]
            lost = sum(sum(r.lost_bytes.values()) for r in runs) / sum(
                sum(r.sent_bytes.values()) for r in runs)
            print(f"  {f'{n}/{bufp}/{p:g}':18s} {policy:17s} {quantile(t, 0.5):8.2f} "
                  f"{quantile(t, 0.99):8.2f} {sum(r.drops for r in runs) / seeds / (2 * n):10.1f} "
                  f"{sum(r.timeouts for r in runs):8d} {lost:7.4f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns3", action="store_true", help="part 1: the cross-check against ns-3")
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--min-rto-ms", type=float, default=DEFAULT_MIN_RTO_MS,
                    help="the transports' least RTO (default: Linux's 200 ms; 1 for a tuned "
                         "datacenter host, as the ns-3 cases use)")
    args = ap.parse_args(argv)
    if not (args.min_rto_ms > 0 and math.isfinite(args.min_rto_ms)):
        raise SystemExit(f"--min-rto-ms: expected a positive number, got {args.min_rto_ms}")
    if args.ns3:
        ns3_part()
    incast_part(args.seeds, args.min_rto_ms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
