"""The ``qsync-opt profile`` command's body (the profiler is :mod:`qsync_opt.profile`); its
parser is :mod:`qsync_opt.cli.parsers.profile`."""

from __future__ import annotations

import argparse
import sys

from qsync_opt.costs.tables import merge
from qsync_opt.documents.io import save, to_json
from qsync_opt.documents.schemas import CostTable
from qsync_opt.profile.orchestrate import profile_detailed


def cmd_profile(args: argparse.Namespace) -> int:
    prof = profile_detailed(args.model, args.batch, device=args.device,
                            device_name=args.device_name, repeats=args.repeats,
                            warmup=args.warmup, threads=args.threads,
                            method=getattr(args, "method", "context"))
    table = prof.table
    if args.merge:
        table = merge([table] + [CostTable.load(x) for x in args.merge])
    save(table, args.out, what="--out")
    if getattr(args, "json", False):
        sys.stdout.write(to_json(table))
        return 0
    n_meas = sum(e.source == "measured" for e in table.entries)
    print(f"profiled {args.model} in {prof.seconds:.1f} s: {n_meas}/{len(table.entries)} "
          f"entries measured, dispatch {prof.dispatch_us:.1f} us")
    for n in table.notes[:4]:
        print(f"  {n}")
    print(f"wrote {args.out}")
    return 0
