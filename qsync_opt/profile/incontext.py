"""In-context timing: every choosable op timed inside whole training steps of the model.

Timed alone, an op does not cost what it costs inside the model (a view is free in the model,
a memory-bound elementwise op is cheaper with its input still in cache, a 1-element op is all
dispatch). So the profiler's default method measures *inside* real steps of the model, on
qsync-opt's own runtime layers, at **uniform** precisions only:

1. For each precision ``p`` the device runs, the model is built with every choosable op at
   ``p`` (ops that do not allow ``p`` stay fp32), as :func:`~qsync_opt.runtime.apply_plan`
   would. Steps of forward, loss and backward run in rounds that alternate the precisions (so
   a drift of the machine touches them all alike); each round times one step *with* module
   hooks and one *without*.
2. With hooks (forward pre/post, full backward pre/post on the choosable modules) a step is a
   sequence of timestamps. Its intervals are attributed by execution order: the op's own
   interval (pre to post) is the op; the interval from an op's post to the next event is the
   *segment after* the op (the views, activations, norms and adds it feeds, until the next
   choosable op); before the first choosable op is the head, after the loss until the first
   backward event the tail. Each step's intervals add up to the step.
3. The hooks cost time; each interval at ``p`` is scaled by (median step without hooks) /
   (median step with hooks), forward and backward separately, so the uniform step at ``p``
   is reproduced exactly by construction.

The CostTable entry of a choosable op at ``p`` is its own interval plus the change its
precision makes to the segment after it (segment at ``p`` minus segment at fp32): the
marginal cost of choosing ``p`` for that op. Every other op gets the fp32 head, segment and
tail time, split among them in proportion to their isolated timings. A plan's prediction is
then a sum of entries, none of which came from running that plan: only uniform plans run.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qsync_opt.core.precision import Precision
from qsync_opt.documents.schemas import ModelGraph, OpRole
from qsync_opt.models import BuiltinWorkload, compute_loss
from qsync_opt.ops.layers import apply_precisions

HEAD = "<head>"
TAIL = "<tail>"


@dataclass
class UniformRun:
    """One uniform precision's in-context measurements (ms, after the hook correction)."""

    precision: Precision
    assignment: dict[str, Precision]  # module -> precision, as applied
    step_fwd_ms: float  # median forward + loss without hooks
    step_bwd_ms: float  # median backward without hooks
    hook_scale: tuple[float, float]  # (fwd, bwd) without-hooks / with-hooks
    samples: int = 0  # steps timed (with hooks, and as many without)
    optimizer_ms: float = 0.0  # median SGD (momentum) step after the steps without hooks
    op_fwd: dict[str, float] = field(default_factory=dict)
    op_bwd: dict[str, float] = field(default_factory=dict)
    seg_fwd: dict[str, float] = field(default_factory=dict)  # key: op name, HEAD
    seg_bwd: dict[str, float] = field(default_factory=dict)  # key: op name, TAIL
    spread: dict[str, tuple[float, float]] = field(default_factory=dict)


def module_calls(graph: ModelGraph) -> dict[str, list[str]]:
    """Choosable module name -> the graph ops of its calls, in graph order."""
    out: dict[str, list[str]] = {}
    for op in graph.ops:
        if op.role != OpRole.choosable:
            continue
        out.setdefault(op.module_name, []).append(op.name)
    return out


def uniform_assignment(graph: ModelGraph, p: Precision) -> dict[str, Precision]:
    """Module -> ``p`` where every call of the module allows it, else fp32."""
    allowed = {o.name: set(o.allowed_precisions) for o in graph.ops}
    return {mod: (p if all(p in allowed[o] for o in ops) else Precision.fp32)
            for mod, ops in module_calls(graph).items()}


class _Recorder:
    """Module hooks appending (kind, op, time) events; kinds fpre/fpost/bpre/bpost."""

    def __init__(self, model: nn.Module, calls: dict[str, list[str]],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock  # on a GPU: synchronise, then read the time
        self.events: list[tuple[str, str, float]] = []
        self.calls = calls
        self.count: dict[str, int] = {}
        self.bcount: dict[str, int] = {}
        self.last_bpre: dict[str, str] = {}
        #: ops whose inputs need no gradient: their backward hooks fire early (see intervals)
        self.early: set[str] = set()
        self.handles: list[Any] = []
        modules = dict(model.named_modules())
        for name in calls:
            m = modules[name]
            self.handles += [
                m.register_forward_pre_hook(self._fpre(name)),
                m.register_forward_hook(self._fpost(name)),
                m.register_full_backward_pre_hook(self._bpre(name)),
                m.register_full_backward_hook(self._bpost(name)),
            ]

    def _op(self, name: str, k: int) -> str:
        ops = self.calls[name]
        return ops[min(k, len(ops) - 1)]

    def _fpre(self, name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple[Any, ...]) -> None:
            k = self.count.get(name, 0)
            op = self._op(name, k)
            if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                self.early.add(op)
            self.events.append(("fpre", op, self.clock()))
        return hook

    def _fpost(self, name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple[Any, ...], out: object) -> None:
            t = self.clock()
            k = self.count.get(name, 0)
            self.count[name] = k + 1
            self.events.append(("fpost", self._op(name, k), t))
        return hook

    def _bpre(self, name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, grad_out: Any) -> None:
            t = self.clock()
            k = self.bcount.get(name, 0)
            self.bcount[name] = k + 1
            n = len(self.calls[name])
            op = self._op(name, max(n - 1 - k, 0))
            self.last_bpre[name] = op
            self.events.append(("bpre", op, t))
        return hook

    def _bpost(self, name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, grad_in: Any, grad_out: Any) -> None:
            self.events.append(("bpost", self.last_bpre.get(name, name), self.clock()))
        return hook

    def reset(self) -> None:
        self.events.clear()
        self.count.clear()
        self.bcount.clear()
        self.last_bpre.clear()
        self.early.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def intervals(events: Sequence[tuple[str, str, float]], t_start: float, t_fend: float,
              t_bend: float, early: frozenset[str] | set[str] = frozenset()) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]]:
    """Attribute one step's time to ops and segments by execution order.

    Forward: (fpre op) -> next event is ("op", op); (fpost op) -> next is ("seg", op); the
    start -> first event is ("seg", HEAD). Backward: from the end of forward to the first
    event is ("seg", TAIL); (bpre op) -> next is ("op", op); (bpost op) -> next is ("seg",
    op). An op in ``early`` (its inputs need no gradient) fires its backward hooks together,
    before its backward runs: its bpost is ignored, so the time after it still goes to the op.
    """
    fwd: dict[tuple[str, str], float] = {}
    bwd: dict[tuple[str, str], float] = {}
    seq = [("start", HEAD, t_start)] + [e for e in events if e[0] in ("fpre", "fpost")] + [
        ("end", "", t_fend)]
    for (kind, op, t), nxt in zip(seq, seq[1:], strict=False):
        key = ("op", op) if kind == "fpre" else ("seg", op)
        fwd[key] = fwd.get(key, 0.0) + (nxt[2] - t)
    bseq = [e for e in events if e[0] in ("bpre", "bpost")]
    cur = ("seg", TAIL)
    t = t_fend
    for kind, op, te in bseq:
        if kind == "bpost" and op in early:
            continue
        bwd[cur] = bwd.get(cur, 0.0) + (te - t)
        t = te
        cur = ("op", op) if kind == "bpre" else ("seg", op)
    bwd[cur] = bwd.get(cur, 0.0) + (t_bend - t)
    return fwd, bwd


#: One hooked step's time split by :func:`intervals`: (forward, backward) ->
#: {("op" | "seg", name): seconds}.
_Split = tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]]
#: One plain step: (forward + loss, backward, optimizer) seconds.
_Plain = tuple[float, float, float]


def _sample_steps(models: dict[Precision, nn.Module],
                  step: Callable[[nn.Module], tuple[float, float, float, float]],
                  calls: dict[str, list[str]], precisions: Sequence[Precision], repeats: int,
                  warmup: int, budget_s: float, clock: Callable[[], float]
                  ) -> tuple[dict[Precision, list[_Plain]], dict[Precision, list[_Split]]]:
    """Round-robin over the precisions: per round one step without hooks and one with, until
    each has its samples (after its warm-up; within ``budget_s`` once it has 3)."""
    plain: dict[Precision, list[_Plain]] = {p: [] for p in precisions}
    hooked: dict[Precision, list[_Split]] = {p: [] for p in precisions}
    with warnings.catch_warnings():
        # "Full backward hook is firing when gradients are computed with respect to module
        # outputs since no inputs require gradients": handled by intervals().
        warnings.simplefilter("ignore", UserWarning)
        warm = dict.fromkeys(precisions, warmup)
        spent = dict.fromkeys(precisions, 0.0)

        def wants(p: Precision) -> bool:
            n = len(plain[p])
            return warm[p] > 0 or (n < repeats and not (n >= 3 and spent[p] > budget_s))

        while any(wants(p) for p in precisions):
            for p in precisions:
                if not wants(p):
                    continue
                m = models[p]
                t0, t1, t2, t3 = step(m)
                rec = _Recorder(m, calls, clock)
                t0h, t1h, t2h, _ = step(m)
                rec.remove()
                if warm[p] > 0:
                    warm[p] = 0 if t2 - t0 > 1.0 else warm[p] - 1
                    continue
                spent[p] += (t2 - t0) + (t2h - t0h)
                plain[p].append((t1 - t0, t2 - t1, t3 - t2))
                hooked[p].append(intervals(rec.events, t0h, t1h, t2h, rec.early))
    return plain, hooked


def _summarise(p: Precision, assignment: dict[str, Precision], plain: list[_Plain],
               hooked: list[_Split]) -> UniformRun:
    """One precision's medians: the step without hooks, and each op's and segment's share,
    normalised to the hooked step and scaled by the hook correction."""
    sf = statistics.median(x[0] for x in plain) * 1e3
    sb = statistics.median(x[1] for x in plain) * 1e3
    hf = statistics.median(sum(f.values()) for f, _ in hooked) * 1e3
    hb = statistics.median(sum(b.values()) for _, b in hooked) * 1e3
    scale = (sf / hf if hf > 0 else 1.0, sb / hb if hb > 0 else 1.0)
    run = UniformRun(precision=p, assignment=assignment, step_fwd_ms=sf, step_bwd_ms=sb,
                     hook_scale=scale, samples=len(plain),
                     optimizer_ms=statistics.median(x[2] for x in plain) * 1e3)
    keys_f = set().union(*(f.keys() for f, _ in hooked))
    keys_b = set().union(*(b.keys() for _, b in hooked))
    meds_f = {k: statistics.median(f.get(k, 0.0) for f, _ in hooked) for k in keys_f}
    meds_b = {k: statistics.median(b.get(k, 0.0) for _, b in hooked) for k in keys_b}
    # Medians of parts need not add up to the median of the whole: normalise so they do
    # (then the hook correction makes the uniform step exact).
    nf = hf / sum(meds_f.values()) / 1e3 if meds_f else 1.0
    nb = hb / sum(meds_b.values()) / 1e3 if meds_b else 1.0
    for (kind, op), v in meds_f.items():
        (run.op_fwd if kind == "op" else run.seg_fwd)[op] = v * 1e3 * nf * scale[0]
    for (kind, op), v in meds_b.items():
        (run.op_bwd if kind == "op" else run.seg_bwd)[op] = v * 1e3 * nb * scale[1]
    for kind_op in keys_f:
        if kind_op[0] == "op":
            fs = [f.get(kind_op, 0.0) for f, _ in hooked]
            bs = [b.get(kind_op, 0.0) for _, b in hooked]
            run.spread[kind_op[1]] = (_iqr(fs), _iqr(bs))
    return run


def run_uniform(
    build: Callable[[dict[str, Precision]], nn.Module],
    step: Callable[[nn.Module], tuple[float, float, float, float]],
    graph: ModelGraph,
    precisions: Sequence[Precision],
    repeats: int,
    warmup: int,
    budget_s: float = 20.0,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[Precision, UniformRun]:
    """Measure every uniform precision in context (see the module docstring).

    ``build(assignment)`` returns a fresh model with the runtime layers applied;
    ``step(model)`` clears the gradients, runs forward, loss, backward and the optimizer
    step and returns (t_start, t_fend, t_bend, t_opt_end) from ``time.perf_counter``, so
    the timed steps sit in the same context as training steps. A precision
    whose steps are slow (fp16 on a CPU without fp16 GEMMs runs 10-20x slower) gets one
    warm-up round when its first step takes over a second, and stops after ``budget_s``
    seconds of rounds once it has 3 samples.
    """
    calls = module_calls(graph)
    models = {}
    assigns = {}
    for p in precisions:
        assigns[p] = uniform_assignment(graph, p)
        models[p] = build(assigns[p])
    plain, hooked = _sample_steps(models, step, calls, precisions, repeats, warmup, budget_s,
                                  clock)
    return {p: _summarise(p, assigns[p], plain[p], hooked[p]) for p in precisions}


def _iqr(xs: Sequence[float]) -> float:
    med = statistics.median(xs)
    if len(xs) >= 4:
        q = statistics.quantiles(xs, n=4)
        return (q[2] - q[0]) / med if med > 0 else 0.0
    return (max(xs) - min(xs)) / med if med > 0 else 0.0


def model_builder(base: nn.Module) -> Callable[[dict[str, Precision]], nn.Module]:
    """``build(assignment)``: a deep copy of ``base`` with the runtime layers applied."""
    def build(assignment: dict[str, Precision]) -> nn.Module:
        m = copy.deepcopy(base)
        apply_precisions(m, assignment, seed=0)
        return m.train()

    return build


def stepper(workload: BuiltinWorkload, batch: int, device: torch.device
            ) -> Callable[[nn.Module], tuple[float, float, float, float]]:
    """``step(model)``: a training step on fixed inputs (gradients set to None, forward +
    loss, backward, an SGD momentum step as the runtime's default); its four timestamps."""
    inputs = workload.make_inputs(batch, device)
    targets = workload.make_targets(batch, device)
    sync = device.type == "cuda"

    def now() -> float:
        if sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    opts: dict[int, torch.optim.Optimizer] = {}

    def step(model: nn.Module) -> tuple[float, float, float, float]:
        opt = opts.get(id(model))
        if opt is None:
            opt = opts[id(model)] = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        opt.zero_grad(set_to_none=True)
        t0 = now()
        loss = compute_loss(workload, model(*inputs), targets)
        t1 = now()
        loss.backward()
        t2 = now()
        opt.step()
        t3 = now()
        return t0, t1, t2, t3

    return step
