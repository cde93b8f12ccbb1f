"""Synthetic graphs and perturbed costs: allocation problems of any size for tests and
benchmarks, traced by the same tracer as the real workloads (so they are valid graphs).

``synthetic_graph(n)`` is a residual MLP of ``n`` Linear layers: blocks of Linear -> ReLU,
every ``norm_every`` blocks a LayerNorm (pinned, fp32), every ``residual_every`` blocks a
residual add (promoting), and a classifier head (pinned). Widths vary per layer from a
seed, so ops differ in cost and sensitivity. ``perturb_costs`` multiplies every op cost
by an independent random factor, which breaks the roofline's regularities so exact
solvers and brute force are compared on problems with no structure to exploit.
"""

from __future__ import annotations

import random

import torch
from torch import nn

from qsync_opt.core.precision import OPT_IN
from qsync_opt.documents.schemas import CostTable, IndicatorTable, ModelGraph
from qsync_opt.graph import trace
from qsync_opt.indicator import enforce_monotone


class _Block(nn.Module):
    def __init__(self, d_in: int, d_out: int, norm: bool, residual: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.act = nn.ReLU()
        self.norm = nn.LayerNorm(d_out) if norm else None
        self.residual = residual and d_in == d_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.fc(x))
        if self.residual:
            y = y + x
        if self.norm is not None:
            y = self.norm(y)
        return y


class SyntheticMLP(nn.Module):
    def __init__(self, n_layers: int, seed: int = 0, width: int = 256, norm_every: int = 4,
                 residual_every: int = 2, classes: int = 10) -> None:
        super().__init__()
        rng = random.Random(seed)
        widths = [width] + [rng.choice((width // 2, width, width, 2 * width))
                            for _ in range(n_layers)]
        blocks = []
        for i in range(n_layers):
            d_in, d_out = widths[i], widths[i + 1]
            if (i + 1) % residual_every == 0:
                d_out = d_in
                widths[i + 1] = d_in
            blocks.append(_Block(d_in, d_out, norm=(i + 1) % norm_every == 0,
                                 residual=(i + 1) % residual_every == 0))
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(widths[-1], classes)
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def synthetic_graph(n_layers: int, *, seed: int = 0, batch: int = 32, width: int = 256,
                    norm_every: int = 4, residual_every: int = 2) -> ModelGraph:
    """The traced graph of a :class:`SyntheticMLP` with ``n_layers`` choosable Linear ops."""
    if n_layers < 1:
        raise ValueError(f"n_layers: expected a positive integer, got {n_layers}")
    with torch.device("meta"):
        model = SyntheticMLP(n_layers, seed=seed, width=width, norm_every=norm_every,
                             residual_every=residual_every)
    x = torch.empty(batch, width, device="meta")
    return trace(model, example_inputs=(x,), name=f"synthetic_mlp{n_layers}_s{seed}")


def perturb_costs(costs: CostTable, seed: int, spread: float = 3.0) -> CostTable:
    """Every op cost times an independent factor in [1/spread, spread] (log-uniform)."""
    rng = random.Random(seed)
    entries = []
    for e in costs.entries:
        f = spread ** rng.uniform(-1, 1)
        b = spread ** rng.uniform(-1, 1)
        entries.append(e.model_copy(update={"fwd_ms": e.fwd_ms * f, "bwd_ms": e.bwd_ms * b}))
    casts = [c.model_copy(update={"a_ms_per_element": c.a_ms_per_element * spread ** rng.uniform(-1, 1)})
             for c in costs.casts]
    return costs.model_copy(update={"entries": entries, "casts": casts,
                                    "notes": [*costs.notes, f"perturbed (seed {seed}, x{spread})"]})


def random_indicator(graph: ModelGraph, seed: int = 0, *,
                     opt_in: bool = False) -> IndicatorTable:
    """A monotone random indicator (a lower precision never scores below a higher one).

    The opt-in precisions (int4) get values only with ``opt_in=True``, drawn from a stream
    of their own after the others, so a table without them is what it always was.
    """
    rng = random.Random(seed)
    extra = random.Random(f"{seed}:opt-in")
    values = {}
    for o in graph.choosable_ops():
        base = rng.lognormvariate(0, 1)
        row = {}
        for p in o.allowed_precisions:
            if p in OPT_IN:
                continue
            rank = p.info.rank
            row[p] = 0.0 if p.value == "fp32" else base * (7 - rank) * rng.uniform(0.5, 1.5)
        if opt_in:
            for p in o.allowed_precisions:
                if p in OPT_IN:
                    row[p] = base * (7 - p.info.rank) * extra.uniform(0.5, 1.5)
        values[o.name] = row
    fixes = enforce_monotone(values)
    return IndicatorTable(workload=graph.workload, graph_hash=graph.structure_hash(),
                          method="random", batch_size=graph.batch_size, batches=1, seed=seed,
                          data="synthetic", values=values, monotone_fixes=fixes,
                          notes=["synthetic: random values for tests and benchmarks"])
