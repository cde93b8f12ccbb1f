"""The quality risks a strategy takes, said plainly with what this project measured for
them (docs/BENCHMARKS.md's sections, their logs under benchmarks/results/), never a number
it did not measure.

The precision plan's own risk is the indicator's degradation (the solver's objective);
synchronisation periods, gradient transports and pipeline compressors have no quality
model here, so the user's ``--allow`` is the budget, and these lines say what it buys.
"""

from __future__ import annotations

from qsync_opt.strategy.modes import parse_sync, parse_transport
from qsync_opt.strategy.space import Candidate

__all__ = ["strategy_risks"]

#: What the Local SGD / QSR study measured (BENCHMARKS "Local SGD and QSR", qsr.log).
LOCAL_STUDY = ("the project's Local SGD/QSR study (docs/BENCHMARKS.md, Local SGD and QSR: "
               "digits_cnn 300 steps, 5 paired seeds) measured held-out loss minus DDP's "
               "0.0050 +- 0.0135 nats at local:2, 0.0040 +- 0.0157 at local:4 and "
               "0.0066 +- 0.0139 under QSR (margin 0.02: QSR not shown non-inferior); on "
               "tiny_gpt the spread (+- 0.14 to 0.20 nats) was larger than any effect")
#: What the DLCP quality study measured (BENCHMARKS "DLCP", dlcp_digits_cnn_2026-12-05.log).
DLCP_STUDY = ("the project's DLCP study (docs/BENCHMARKS.md, DLCP: digits_cnn, 2 ranks, 5 "
              "paired seeds) found no bound from 1% to 30% and no policy distinguishable "
              "from the plain all-reduce; tiny_gpt was last measured under an older bound")
#: fp16 gradients: no study of this project.
FP16_NOTE = ("gradients rounded to fp16 on the wire (divided by the world size first, as "
             "torch's fp16 compression hook does): an underflow of small gradients is "
             "possible; this project has not measured its effect on quality")


def strategy_risks(cand: Candidate) -> list[str]:
    """One line per risk the candidate takes beyond the precision plan's (empty for ddp
    over fp32 without a pipeline)."""
    out = []
    sync = parse_sync(cand.sync)
    if sync.kind == "local":
        out.append(f"local:{sync.period}: each rank takes {sync.period} optimizer steps on "
                   f"its own gradients between parameter averages; " + LOCAL_STUDY)
    elif sync.kind == "qsr":
        out.append(f"{sync.describe()}: rounds that grow as the learning rate decays "
                   "(QSR's rule); " + LOCAL_STUDY)
    if cand.stages > 1:
        out.append(f"pipeline of {cand.stages} stages: one replica, each step in "
                   "micro-batches (BatchNorm's statistics are a micro-batch's); the "
                   "project's pipeline study (docs/BENCHMARKS.md, Compressed pipelines) "
                   "measured the compressors, not the micro-batching, against one process")
    comm = parse_transport(cand.transport)
    if comm.kind == "fp16":
        out.append("fp16 transport: " + FP16_NOTE)
    elif comm.kind == "dlcp":
        out.append(f"dlcp transport: up to {comm.p:.0%} of each gradient tensor may be lost "
                   "where the network drops it (bounded loss); " + DLCP_STUDY)
    return out
