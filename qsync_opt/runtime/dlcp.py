"""Bounded-loss priority gradient communication (DLCP), as one pure drop policy.

DLCP (issue 20) lets a bounded fraction of a gradient's packets be lost: the receiver stops
waiting once ``1 - p`` of the message has arrived and zero-fills the rest, and the network
drops the least important packets first. Here the packets are **chunks**: every parameter's
gradient cut, in the model's parameter order, into pieces of ``chunk_kib`` KiB (of fp32; a
parameter's last chunk is shorter). One step's message is every parameter's gradient, so the
bound is over the whole model: a rank drops at most ``floor(p * N)`` of its ``N`` gradient
elements.

Which chunks a rank drops (:func:`choose_drops`), by ``policy``:

* ``priority``: the chunks of least score ``rms(chunk) * (1 + layer_bias * (1 - pos))``
  first, where ``pos`` is the parameter's position in the model (0 for the first parameter,
  1 for the last): front layers are kept (the next forward needs them first), and within a
  layer the chunks of small magnitude go first;
* ``random``: chunks in a seeded random order (the control);
* ``unbiased``: random chunks as ``random``, and the all-reduce divides each chunk's sum by
  the number of ranks whose chunk arrived (the kept counts are all-reduced beside the
  gradient) instead of by the world: the mean of the gradients that arrived.

Chunks are dropped in that order while they fit the budget, stopping at the first that
does not: the dropped fraction never exceeds ``p``, less than one chunk of the budget is
left unused, and the order is strict (a fill that skipped a chunk too long for the rest of
the budget and took later, shorter ones would over-drop the short chunks, BatchNorm's
parameters and the biases, under every policy: the first digits_cnn study found it). The same three
functions serve the DDP hook chain (:mod:`.commhooks`), the emulated data-parallel path
(:class:`~qsync_opt.runtime.sync.EmulatedSync`) and a drop decision handed in from outside
(:func:`apply_drops` takes any mask, e.g. the network simulator's lost packets), so the three
cannot drift.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["POLICIES", "ChunkTable", "DropRecorder", "apply_drops", "choose_drops",
           "drop_generator", "kept_counts", "layer_of", "rescale"]

POLICIES = ("priority", "random", "unbiased")


@dataclass(frozen=True)
class ChunkTable:
    """The chunks of a list of gradients (the model's parameter order).

    ``numels[i]``: parameter i's elements; ``first[i]``: the index of its first chunk
    (``first[-1]`` the number of chunks); ``sizes``: every chunk's elements; ``param``:
    every chunk's parameter; ``pos``: every chunk's layer position in [0, 1]."""

    numels: tuple[int, ...]
    chunk_elems: int
    first: tuple[int, ...]
    sizes: Tensor
    param: Tensor
    pos: Tensor

    @classmethod
    def build(cls, numels: Sequence[int], chunk_elems: int) -> ChunkTable:
        if chunk_elems < 1:
            raise ValueError(f"chunk_elems: expected >= 1, got {chunk_elems}")
        first, sizes, param = [0], [], []
        n = len(numels)
        for i, k in enumerate(numels):
            full, rest = divmod(int(k), chunk_elems)
            sizes += [chunk_elems] * full + ([rest] if rest else [])
            param += [i] * (full + (1 if rest else 0))
            first.append(len(sizes))
        pidx = torch.tensor(param, dtype=torch.long)
        pos = pidx.to(torch.float64) / max(1, n - 1)
        return cls(tuple(int(k) for k in numels), chunk_elems, tuple(first),
                   torch.tensor(sizes, dtype=torch.long), pidx, pos)

    @property
    def n_chunks(self) -> int:
        return self.first[-1]

    @property
    def total(self) -> int:
        return sum(self.numels)

    def element_mask(self, i: int, dropped: Tensor) -> Tensor:
        """Parameter i's per-element mask (True: dropped) from the per-chunk ``dropped``."""
        a, b = self.first[i], self.first[i + 1]
        return dropped[a:b].repeat_interleave(self.sizes[a:b])


def drop_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """The random policies' generator of one rank's step: independent across ranks and
    steps, the same on every path and on a resume."""
    mix = (int(seed) * 0x9E3779B97F4A7C15 + int(step) * 0xBF58476D1CE4E5B9
           + int(rank) * 0x94D049BB133111EB) % (1 << 63)
    return torch.Generator().manual_seed(mix)


def choose_drops(grads: Sequence[Tensor], table: ChunkTable, p: float, policy: str,
                 generator: torch.Generator | None = None, layer_bias: float = 1.0) -> Tensor:
    """Which chunks of one rank's ``grads`` (the model's parameter order) to drop: a bool
    tensor over :attr:`ChunkTable.n_chunks` (module docstring). ``p`` in [0, 1)."""
    if not 0 <= p < 1:
        raise ValueError(f"p: expected a fraction in [0, 1), got {p}")
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {', '.join(POLICIES)}, got {policy!r}")
    n = table.n_chunks
    dropped = torch.zeros(n, dtype=torch.bool)
    budget = math.floor(p * table.total)
    if budget <= 0 or n == 0:
        return dropped
    if policy == "priority":
        sumsq = torch.cat([_chunk_sumsq(g, table.chunk_elems) for g in grads])
        rms = (sumsq / table.sizes.to(torch.float64)).sqrt()
        score = rms * (1 + layer_bias * (1 - table.pos))
        order = torch.sort(score, stable=True).indices  # ties: the model's order
    else:
        order = torch.randperm(n, generator=generator)
    # the longest prefix of that order that fits: strictly in order (a chunk is never
    # dropped before one ranked below it), less than one chunk of the budget unused
    take = int((torch.cumsum(table.sizes[order], 0) <= budget).sum())
    dropped[order[:take]] = True
    return dropped


def _chunk_sumsq(g: Tensor, chunk_elems: int) -> Tensor:
    flat = g.detach().reshape(-1).to(torch.float64)
    full = flat.numel() // chunk_elems * chunk_elems
    out = (flat[:full] ** 2).view(-1, chunk_elems).sum(1)
    if full < flat.numel():
        out = torch.cat([out, (flat[full:] ** 2).sum().reshape(1)])
    return out


def apply_drops(grads: Sequence[Tensor], table: ChunkTable, dropped: Tensor) -> list[int]:
    """Zero-fill the ``dropped`` chunks of ``grads`` in place (contiguous tensors or views of
    one flat buffer); returns the elements dropped per parameter."""
    out = []
    for i, g in enumerate(grads):
        a, b = table.first[i], table.first[i + 1]
        if not bool(dropped[a:b].any()):
            out.append(0)
            continue
        mask = table.element_mask(i, dropped)
        g.view(-1)[mask] = 0
        out.append(int(table.sizes[a:b][dropped[a:b]].sum()))
    return out


def kept_counts(table: ChunkTable, dropped: Tensor) -> Tensor:
    """1.0 per chunk that arrives, 0.0 per dropped chunk (summed over ranks: how many ranks'
    chunk arrived)."""
    return (~dropped).to(torch.float32)


def rescale(grads: Sequence[Tensor], table: ChunkTable, counts: Tensor) -> None:
    """Divide each chunk of the summed ``grads`` by its kept count (none kept: zero)."""
    inv = torch.where(counts > 0, 1.0 / counts.clamp(min=1), torch.zeros_like(counts))
    for i, g in enumerate(grads):
        a, b = table.first[i], table.first[i + 1]
        g.view(-1).mul_(inv[a:b].repeat_interleave(table.sizes[a:b]).to(g.dtype))


def layer_of(name: str) -> str:
    """The layer a parameter belongs to in the drop statistics: its module's name."""
    return name.rpartition(".")[0] or name


class DropRecorder:
    """One run's drop decisions and statistics: :func:`choose_drops` and
    :func:`apply_drops` for each rank's gradient of each step, with the fractions dropped
    kept for that step's metrics rows (``dropped_frac`` and, per layer that lost anything,
    ``dropped_by_layer``)."""

    def __init__(self, mode: Any, names: Sequence[str], numels: Sequence[int],
                 seed: int) -> None:
        self.p = float(mode.p)
        self.policy = str(mode.policy)
        self.layer_bias = float(mode.layer_bias)
        self.table = ChunkTable.build(numels, int(mode.chunk_elems))
        self.seed = int(seed)
        self.layers = [layer_of(n) for n in names]
        self.layer_total: dict[str, int] = {}
        for layer, k in zip(self.layers, numels, strict=True):
            self.layer_total[layer] = self.layer_total.get(layer, 0) + int(k)
        self.last: dict[int, dict[str, object]] = {}

    @property
    def unbiased(self) -> bool:
        return self.policy == "unbiased"

    @property
    def active(self) -> bool:
        """False when nothing can be dropped (p = 0): the plain all-reduce runs."""
        return math.floor(self.p * self.table.total) > 0

    def drop(self, grads: Sequence[Tensor], step: int, rank: int) -> Tensor:
        """Choose and zero-fill rank ``rank``'s chunks of ``step`` (grads in the model's
        parameter order); returns the per-chunk mask."""
        gen = None if self.policy == "priority" else drop_generator(self.seed, step, rank)
        dropped = choose_drops(grads, self.table, self.p, self.policy, gen, self.layer_bias)
        per = apply_drops(grads, self.table, dropped)
        by_layer: dict[str, int] = {}
        for layer, k in zip(self.layers, per, strict=True):
            if k:
                by_layer[layer] = by_layer.get(layer, 0) + k
        self.last[rank] = {
            "dropped_frac": sum(per) / max(1, self.table.total),
            "dropped_by_layer": {k: v / self.layer_total[k] for k, v in by_layer.items()}}
        return dropped

    def stage(self, grads: Sequence[Tensor], step: int, rank: int) -> Tensor | None:
        """The chain's first stage for one rank's gradient: :meth:`drop` (or, when nothing
        can be dropped, :meth:`nothing`); returns the rank's kept counts for ``unbiased``
        (to be summed over the ranks), else None."""
        if not self.active:
            self.nothing(rank)
            return None
        dropped = self.drop(grads, step, rank)
        return kept_counts(self.table, dropped) if self.unbiased else None

    def nothing(self, rank: int) -> None:
        """Rank ``rank`` dropped nothing this step (p too small for one element)."""
        self.last[rank] = {"dropped_frac": 0.0, "dropped_by_layer": {}}

    def take(self) -> dict[int, dict[str, object]]:
        out, self.last = self.last, {}
        return out
