"""Replayer: simulate one mixed-precision hybrid data-parallel iteration.

QSync's predictor of time and memory (docs/PAPERS.md, QSync replayer paragraph). For every device
group of the cluster (all devices of a group run the same plan, so one represents it):

* **Dtype flow** (the neighbourhood-aware cost mapper). A choosable op at precision ``p``
  takes in ``p.takes_in`` and gives out ``p.gives_out``; pinned ops take and give fp32;
  pass-through ops (relu, dropout, pooling, reshapes) carry their input's dtype; promoting
  ops (add, cat) run in the widest float input dtype, as autocast promotes (fp16 with bf16
  gives fp32). Only floating edges carry dtypes.
* **Casts.** Where an edge's producer gives out a dtype its consumer does not take in, a
  cast of that tensor runs before the consumer's forward (a quantization, with its abs-max
  pass, when the target is int8, int4 or fp8). In backward the consumer's input gradient has its
  backward dtype and is cast back to the producer's dtype when they differ. Every
  low-precision op casts its FP32 master weight once per iteration and casts its weight
  gradient back to FP32; int8_full and fp8 ops quantize their incoming output gradient.
  Choosable ops reading the model input cast it from fp32.
* **Compute.** One compute stream per device: forward in topological order, backward in
  reverse, each op at its CostTable entry for that device, per-device batch and precision.
* **Communication** behind :class:`SyncModel`. :class:`AllReduceSync` is DDP: FP32 gradient
  buckets in reverse order of first use, each a ring all-reduce over the whole cluster that
  starts when the slowest group has the bucket ready and the previous bucket is done. The
  iteration ends, per group, when its backward and all buckets are done and its optimizer
  step has run; the iteration time is the latest group's end.
* **Memory** per device: FP32 weights, FP32 gradients, optimizer state, low-precision weight
  copies, activations saved for backward at their chosen dtypes (a low-precision op saves
  its own cast copy; without a cast it shares its producer's tensor), the largest single op's
  working set, and a context reserve.

The rules of the first three points and of memory are :mod:`qsync_opt.costs.rules` (the problem
compiler and the diagnosis read the same ones); this package is the event loop around them:

* :mod:`qsync_opt.replayer.syncmodel`: the sync models (:class:`SyncModel`, :class:`AllReduceSync`, and
  :class:`PeriodicSync` for Local SGD / QSR, communication paid once per round);
* :mod:`.timeline`: what an iteration reports (:class:`Timeline`, :class:`GroupTimeline`,
  :class:`Event`, the chrome trace);
* :mod:`.prepared`: the inputs checked, buckets indexed, rules built, plans validated;
* :mod:`.loop`: :class:`Replayer`, whose :meth:`Replayer.simulate` is the event loop that
  builds every event (the oracle, and the source of traces), and :func:`simulate`;
* :mod:`.incremental`: :class:`IncrementalReplay` keeps per-op forward/backward items in
  Fenwick trees, so changing one op's precision re-costs only the op, the ops its output
  dtype flows through and their consumers, and re-schedules the few buckets: the greedy
  allocator's "what if" in well under a millisecond. Tests hold the two equal.
"""

from qsync_opt.costs.rules import DEFAULT_CONTEXT_BYTES, GRAD_DTYPE, MiB, widest
from qsync_opt.replayer.incremental import Change, IncrementalReplay
from qsync_opt.replayer.loop import Replayer, simulate
from qsync_opt.replayer.prepared import PreparedReplay
from qsync_opt.replayer.syncmodel import (
           AllReduceSync,
           PeriodicSync,
           SyncModel,
           SyncSchedule,
           sync_model_for,
)
from qsync_opt.replayer.timeline import Event, GroupTimeline, Timeline

__all__ = ["DEFAULT_CONTEXT_BYTES", "GRAD_DTYPE", "AllReduceSync", "Change", "Event",
           "GroupTimeline", "IncrementalReplay", "MiB", "PeriodicSync", "PreparedReplay",
           "Replayer", "SyncModel", "SyncSchedule", "Timeline", "simulate", "sync_model_for",
           "widest"]
