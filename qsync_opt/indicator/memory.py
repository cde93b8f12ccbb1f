"""What running the indicator holds in memory, and the refusal when this machine has less."""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.documents.schemas import ModelGraph, OpRole
from qsync_opt.indicator.errormodel import check_method

#: Working copies the term computations keep of the largest op's tensors (variances,
#: squares and propagated terms of its operands, output and output gradient).
TERM_COPIES = 3
#: The Hessian method's double backward keeps about this many times the activations.
HESSIAN_ACTIVATION_FACTOR = 3
#: What a model run adds besides its tensors: autograd and allocator arenas, the data
#: loading (scikit-learn for digits_cnn). Measured: 137 MB for digits_cnn, whose tensors
#: take 4 MB (VmHWM over the resident size before the run).
RUNTIME_BYTES = 128 * 2**20


@dataclass(frozen=True)
class IndicatorMemory:
    """What running ``indicate()`` on this CPU holds at its peak (bytes), from the graph
    traced at the indicator's batch: the fp32 weights and buffers, their gradients, the
    activations saved for backward, the captures the hooks keep (each choosable op's output
    and output gradient; its inputs are among the saved activations) and the working copies
    of the largest op's terms, and a fixed :data:`RUNTIME_BYTES`. No optimizer runs (nothing
    is stepped). ``random`` runs no model: all zero."""

    method: str
    batch: int
    weights: int
    gradients: int
    activations: int
    captures: int
    terms: int
    runtime: int = 0

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.activations + self.captures + self.terms
                + self.runtime)

    def describe(self) -> str:
        if not self.total:
            return f"{self.method} runs no model"
        parts = [("weights", self.weights), ("gradients", self.gradients),
                 ("activations", self.activations), ("captures", self.captures),
                 ("terms", self.terms), ("runtime", self.runtime)]
        return (f"{gib(self.total)} GiB at batch {self.batch} ("
                + ", ".join(f"{name} {gib(v)}" for name, v in parts if v) + ")")


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}" if n < 10 * 2**30 else f"{n / 2**30:.1f}"


def indicator_memory(graph: ModelGraph, method: str = "qsync") -> IndicatorMemory:
    """The memory ``indicate(method=...)`` needs for ``graph`` at ``graph.batch_size``
    (trace the graph at the indicator's batch). See :class:`IndicatorMemory`."""
    check_method(method)
    if method == "random":
        return IndicatorMemory(method, graph.batch_size, 0, 0, 0, 0, 0)
    ops = [o for o in graph.ops if o.role == OpRole.choosable]
    captures = sum(2 * 4 * o.output_numel for o in ops)
    largest = max((4 * (o.input_numel + 2 * o.output_numel + o.param_count) for o in ops),
                  default=0)
    acts = graph.saved_activation_bytes
    if method in ("hessian", "curv"):
        acts *= HESSIAN_ACTIVATION_FACTOR
    if method == "curv":  # operands and Hessian diagonals kept per op: about two captures more
        captures += sum(4 * (o.input_numel + o.param_count) * 2 for o in ops)
    return IndicatorMemory(method, graph.batch_size, weights=graph.param_bytes + graph.buffer_bytes,
                           gradients=graph.param_bytes, activations=acts, captures=captures,
                           terms=TERM_COPIES * largest if method != "wvar" else 0,
                           runtime=RUNTIME_BYTES)


def available_memory_bytes() -> int | None:
    """Memory this process can still take: MemAvailable (/proc/meminfo), lowered by a
    cgroup limit (memory.max less memory.current) and by an address-space limit
    (RLIMIT_AS less the current VmSize) where set. None where nothing can be read."""
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        cg = Path("/sys/fs/cgroup")
        limit = (cg / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((cg / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmSize:"):
                    found.append(soft - int(line.split()[1]) * 1024)
        except (OSError, ValueError, IndexError):
            found.append(soft)
    return max(0, min(found)) if found else None


def check_indicator_memory(need: IndicatorMemory, workload: str,
                           available: int | None = None) -> None:
    """Refuse (one line, QsyncInputError) when ``need`` exceeds the memory this machine has
    (``available``, default :func:`available_memory_bytes`), naming both figures and the
    cheaper choices."""
    have = available_memory_bytes() if available is None else available
    if have is None or need.total <= have:
        return
    raise QsyncInputError(
        f"indicator: the {need.method} indicator of {workload} runs the model on this CPU and "
        f"needs about {need.describe()}; this machine has {gib(have)} GiB available. "
        "Cheaper: an IndicatorTable made elsewhere (--indicator FILE; `qsync-opt indicate "
        f"--model {workload} --out FILE` on a larger machine), the random method (--method "
        "random: no model run; a control, not a measurement), a smaller indicator batch "
        "(--indicator-batch; --batch for `qsync-opt indicate`), or a model with fewer layers")
