"""Bounded-loss priority gradient communication (DLCP), as one pure drop policy.

DLCP lets a bounded fraction of a gradient's packets be lost: the receiver stops
a tensor once ``1 - p`` of it has arrived and zero-fills the rest, and the network drops the
least important packets first. Here the packets are **chunks**: every parameter's gradient
cut, in the model's parameter order, into pieces of ``chunk_kib`` KiB (of fp32; a
parameter's last chunk is shorter). The bound is **per tensor**, as DLCP bounds each
message: a rank drops at most ``floor(p * n)`` of each parameter's ``n`` gradient elements,
so every DDP bucket (any set of whole tensors) loses at most a fraction ``p`` and no layer
is ever wiped (a bound over the whole gradient would let a small layer lose all of it).
The decisions for one tensor depend on that tensor alone (the random policies draw from a
generator of (seed, step, rank, parameter)), so DDP's buckets, however torch lays them
out, and the emulated path drop the same chunks.

Which chunks of a tensor a rank drops (:func:`choose_drops`), by ``policy``:

* ``priority``: the chunks of least score ``rms(chunk) * (1 + layer_bias * (1 - pos))``
  first (``pos``: the parameter's position in the model, 0 the first; within one tensor the
  layer term is a constant, so the chunks of small magnitude go first);
* ``random``: chunks in a seeded random order (the control);
* ``unbiased``: random chunks as ``random``, and the all-reduce divides each chunk's sum by
  the number of ranks whose chunk arrived (the kept counts are all-reduced beside the
  gradient) instead of by the world: the mean of the gradients that arrived.

Chunks are dropped in that order while they fit the tensor's budget, stopping at the first
that does not: the dropped fraction never exceeds ``p``, less than one chunk of the budget
is left unused, and the order is strict (a fill that skipped a chunk too long for the rest of
the budget and took later, shorter ones would over-drop short chunks). The same functions
serve the DDP hook chain (:mod:`qsync_opt.sync.hooks`), the emulated data-parallel path
(:class:`~qsync_opt.sync.replicas.EmulatedSync`) and a drop decision handed in from outside
(:func:`apply_drops` takes any mask, e.g. the network simulator's lost packets), so they
cannot drift.

Where the drops come from (``--comm dlcp``'s two modes, :mod:`qsync_opt.strategy.modes`): by default the
packet simulator's losses for the run's cluster (``masks``: per simulated iteration, per
rank, the chunks the network lost of that rank's messages), each tensor's cut to its bound
by :func:`clip_to_bound`, step ``s`` taking iteration ``s mod len(masks)``; in the
``stress`` mode, :func:`choose_drops` every step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from qsync_opt.strategy.modes import POLICIES

__all__ = ["POLICIES", "ChunkTable", "DropRecorder", "apply_drops", "choose_drops", "chunk_index",
           "clip_to_bound",
           "drop_generator", "kept_counts", "layer_of", "rescale"]


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


def drop_generator(seed: int, step: int, rank: int, param: int = 0) -> torch.Generator:
    """The random policies' generator of one rank's step for one parameter: independent
    across ranks, steps and parameters, the same on every path and on a resume."""
    mix = (int(seed) * 0x9E3779B97F4A7C15 + int(step) * 0xBF58476D1CE4E5B9
           + int(rank) * 0x94D049BB133111EB + int(param) * 0xD6E8FEB86659FD93) % (1 << 63)
    return torch.Generator().manual_seed(mix)


Generators = torch.Generator | Callable[[int], torch.Generator] | None


def choose_drops(grads: Sequence[Tensor], table: ChunkTable, p: float, policy: str,
                 generator: Generators = None, layer_bias: float = 1.0,
                 indices: Sequence[int] | None = None) -> Tensor:
    """Which chunks of one rank's ``grads`` to drop: a bool tensor over
    :attr:`ChunkTable.n_chunks` (module docstring), at most ``floor(p * n)`` elements of each
    tensor. ``grads`` are the parameters ``indices`` (default: all, the model's order);
    ``generator``: one generator for every tensor in turn, or ``f(parameter index)`` (the
    runtime's, so that a tensor's draw does not depend on its bucket). ``p`` in [0, 1)."""
    if not 0 <= p < 1:
        raise ValueError(f"p: expected a fraction in [0, 1), got {p}")
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {', '.join(POLICIES)}, got {policy!r}")
    idx = list(range(len(table.numels))) if indices is None else list(indices)
    if len(idx) != len(grads):
        raise ValueError(f"grads: expected {len(idx)} tensors, got {len(grads)}")
    dropped = torch.zeros(table.n_chunks, dtype=torch.bool)
    for i, g in zip(idx, grads, strict=True):
        budget = math.floor(p * table.numels[i])
        a, b = table.first[i], table.first[i + 1]
        if budget <= 0 or a == b:
            continue
        sizes = table.sizes[a:b]
        if policy == "priority":
            rms = (_chunk_sumsq(g, table.chunk_elems) / sizes.to(torch.float64)).sqrt()
            score = rms * (1 + layer_bias * (1 - table.pos[a:b]))
            order = torch.sort(score, stable=True).indices  # ties: the tensor's order
        else:
            gen = generator(i) if callable(generator) else generator
            order = torch.randperm(b - a, generator=gen)
        # the longest prefix of that order that fits: strictly in order (a chunk is never
        # dropped before one ranked below it), less than one chunk of the budget unused
        take = int((torch.cumsum(sizes[order], 0) <= budget).sum())
        dropped[a + order[:take]] = True
    return dropped


def _chunk_sumsq(g: Tensor, chunk_elems: int) -> Tensor:
    flat = g.detach().reshape(-1).to(torch.float64)
    full = flat.numel() // chunk_elems * chunk_elems
    out = (flat[:full] ** 2).view(-1, chunk_elems).sum(1)
    if full < flat.numel():
        out = torch.cat([out, (flat[full:] ** 2).sum().reshape(1)])
    return out


def apply_drops(grads: Sequence[Tensor], table: ChunkTable, dropped: Tensor,
                indices: Sequence[int] | None = None) -> list[int]:
    """Zero-fill the ``dropped`` chunks of ``grads`` (the parameters ``indices``, default
    all) in place (contiguous tensors or views of one flat buffer); returns the elements
    dropped per tensor."""
    out = []
    idx = range(len(grads)) if indices is None else indices
    for i, g in zip(idx, grads, strict=True):
        a, b = table.first[i], table.first[i + 1]
        if not bool(dropped[a:b].any()):
            out.append(0)
            continue
        mask = table.element_mask(i, dropped)
        g.view(-1)[mask] = 0
        out.append(int(table.sizes[a:b][dropped[a:b]].sum()))
    return out


def clip_to_bound(table: ChunkTable, dropped: Tensor, p: float) -> Tensor:
    """``dropped`` (a per-chunk mask handed in, e.g. the network simulator's) with each
    tensor's dropped chunks kept in chunk order while they fit its budget of
    ``floor(p * n)`` elements, stopping at the first that does not (as
    :func:`choose_drops`): no tensor loses more than ``p``."""
    out = torch.zeros(table.n_chunks, dtype=torch.bool)
    for i, n in enumerate(table.numels):
        a, b = table.first[i], table.first[i + 1]
        budget = math.floor(p * n)
        if budget <= 0 or a == b or not bool(dropped[a:b].any()):
            continue
        which = torch.nonzero(dropped[a:b]).reshape(-1)
        take = int((torch.cumsum(table.sizes[a:b][which], 0) <= budget).sum())
        out[a + which[:take]] = True
    return out


def chunk_index(table: ChunkTable, indices: Sequence[int]) -> Tensor:
    """The chunks of the parameters ``indices``, in that order (a bucket's slice of a
    per-chunk tensor)."""
    parts = [torch.arange(table.first[i], table.first[i + 1]) for i in indices]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def kept_counts(table: ChunkTable, dropped: Tensor) -> Tensor:
    """1.0 per chunk that arrives, 0.0 per dropped chunk (summed over ranks: how many ranks'
    chunk arrived)."""
    return (~dropped).to(torch.float32)


def rescale(grads: Sequence[Tensor], table: ChunkTable, counts: Tensor,
            indices: Sequence[int] | None = None) -> None:
    """Divide each chunk of the summed ``grads`` (the parameters ``indices``, default all)
    by its kept count in ``counts`` (over all chunks; none kept: zero)."""
    inv = torch.where(counts > 0, 1.0 / counts.clamp(min=1), torch.zeros_like(counts))
    idx = range(len(grads)) if indices is None else indices
    for i, g in zip(idx, grads, strict=True):
        a, b = table.first[i], table.first[i + 1]
        g.view(-1).mul_(inv[a:b].repeat_interleave(table.sizes[a:b]).to(g.dtype))


def layer_of(name: str) -> str:
    """The layer a parameter belongs to in the drop statistics: its module's name."""
    return name.rpartition(".")[0] or name


class DropRecorder:
    """One run's drop decisions and statistics: :func:`choose_drops` and
    :func:`apply_drops` for each rank's tensors of each step (one call per DDP bucket, or
    one for the whole gradient), with the fractions dropped kept for that step's metrics
    rows (``dlcp_mode``: ``network`` or ``stress``; ``dropped_frac``;
    ``dropped_max_tensor``, the most of any one tensor, at most p; per layer that lost
    anything, ``dropped_by_layer``). ``masks`` (per iteration, per rank, a
    per-chunk mask, e.g. the simulated network's): the drops of step ``s`` are iteration
    ``s mod len(masks)``'s, each tensor's cut to ``p`` (:func:`clip_to_bound`), instead of
    :func:`choose_drops`' fixed fraction."""

    def __init__(self, mode: Any, names: Sequence[str], numels: Sequence[int],
                 seed: int, masks: Sequence[Sequence[Tensor]] | None = None) -> None:
        self.p = float(mode.p)
        self.policy = str(mode.policy)
        self.layer_bias = float(mode.layer_bias)
        self.table = ChunkTable.build(numels, int(mode.chunk_elems))
        self.seed = int(seed)
        self.layers = [layer_of(n) for n in names]
        self.layer_total: dict[str, int] = {}
        for layer, k in zip(self.layers, numels, strict=True):
            self.layer_total[layer] = self.layer_total.get(layer, 0) + int(k)
        # rank -> the step's drops so far: elements per tensor index
        self.acc: dict[int, dict[int, int]] = {}
        self.masks = None if masks is None else [
            [clip_to_bound(self.table, m, self.p) for m in ranks] for ranks in masks]

    @property
    def unbiased(self) -> bool:
        return self.policy == "unbiased"

    @property
    def active(self) -> bool:
        """False when nothing can be dropped (p too small for one element of any tensor):
        the plain all-reduce runs; from the network: when it lost nothing)."""
        if self.masks is not None:
            return any(bool(m.any()) for ranks in self.masks for m in ranks)
        return any(math.floor(self.p * k) > 0 for k in self.table.numels)

    def drop(self, grads: Sequence[Tensor], step: int, rank: int,
             indices: Sequence[int] | None = None) -> Tensor:
        """Choose and zero-fill rank ``rank``'s chunks of ``step`` for the tensors
        ``indices`` (default all; grads in that order); returns the per-chunk mask."""
        idx = list(range(len(self.table.numels))) if indices is None else list(indices)
        if self.masks is not None:
            dropped = self.masks[step % len(self.masks)][rank]
        else:
            gen = None if self.policy == "priority" else (
                lambda i: drop_generator(self.seed, step, rank, i))
            dropped = choose_drops(grads, self.table, self.p, self.policy, gen,
                                   self.layer_bias, indices=idx)
        per = apply_drops(grads, self.table, dropped, idx)
        acc = self.acc.setdefault(rank, {})
        for i, k in zip(idx, per, strict=True):
            acc[i] = acc.get(i, 0) + k
        return dropped

    def stage(self, grads: Sequence[Tensor], step: int, rank: int,
              indices: Sequence[int] | None = None) -> Tensor | None:
        """The chain's first stage for one rank's tensors ``indices`` (default all):
        :meth:`drop` (or, when nothing can be dropped, :meth:`nothing`); returns the rank's
        kept counts over every chunk for ``unbiased`` (to be summed over the ranks), else
        None."""
        if not self.active:
            self.nothing(rank)
            return None
        dropped = self.drop(grads, step, rank, indices)
        return kept_counts(self.table, dropped) if self.unbiased else None

    def nothing(self, rank: int) -> None:
        """Rank ``rank`` dropped nothing this step (p too small for one element)."""
        self.acc.setdefault(rank, {})

    def take(self) -> dict[int, dict[str, object]]:
        """Each rank's statistics of the step just run (and a fresh step)."""
        out: dict[int, dict[str, object]] = {}
        numels = self.table.numels
        for rank, acc in self.acc.items():
            by_layer: dict[str, int] = {}
            for i, k in acc.items():
                if k:
                    by_layer[self.layers[i]] = by_layer.get(self.layers[i], 0) + k
            out[rank] = {
                "dlcp_mode": "stress" if self.masks is None else "network",
                "dropped_frac": sum(acc.values()) / max(1, self.table.total),
                "dropped_max_tensor": max((k / numels[i] for i, k in acc.items()),
                                          default=0.0),
                "dropped_by_layer": {k: v / self.layer_total[k] for k, v in by_layer.items()}}
        self.acc = {}
        return out
