"""The parser of ``profile`` (its body: :mod:`qsync_opt.cli.profile`)."""

from __future__ import annotations

import argparse
from typing import Any

from qsync_opt.cli.args import Deferred
from qsync_opt.core.limits import int_range, positive_int
from qsync_opt.documents.schemas import MAX_BATCH
from qsync_opt.profile.settings import DEFAULT_REPEATS, DEFAULT_WARMUP

#: The command's help description: the first line of :mod:`qsync_opt.profile`'s docstring.
DESCRIPTION = (
    "The profiler: a CostTable measured on the local device, in the estimator's exact shape.")


def add_profile_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``profile`` (its body: :func:`~qsync_opt.cli.profile.cmd_profile`)."""
    p = sub.add_parser("profile", help="measure a CostTable on this machine",
                       description=DESCRIPTION)
    p.add_argument("--model", required=True, help="workload (qsync-opt models)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--device-name", default=None,
                   help="catalog key of this device (default: cpu, or matched from the GPU name)")
    p.add_argument("--batch", type=positive_int(MAX_BATCH), default=None, help="per-device batch (default: the "
                   "workload's)")
    p.add_argument("--repeats", type=positive_int(10_000), default=DEFAULT_REPEATS)
    p.add_argument("--warmup", type=int_range(0, 10_000), default=DEFAULT_WARMUP)
    p.add_argument("--method", choices=["context", "isolated"], default="context",
                   help="context (default): choosable ops timed inside whole steps of uniform "
                        "plans; isolated: every op alone on random inputs")
    p.add_argument("--threads", type=positive_int(1024), default=None,
                   help="torch intra-op threads while measuring (default: torch's; use the "
                        "count training will run with)")
    p.add_argument("--out", required=True, help="CostTable JSON to write")
    p.add_argument("--merge", nargs="*", default=[], metavar="COSTS",
                   help="profiles of other machines to merge into --out")
    p.add_argument("--json", action="store_true", help="print the table on stdout")
    p.set_defaults(fn=Deferred("qsync_opt.cli.profile", "cmd_profile"))
    return p
