"""The training data: one deterministic global batch per step, each rank's slice of it.

Each step draws one deterministic global batch (seeded by ``config.seed`` and the step) of
B = sum of every rank's ``batch_per_device``; rank r takes its contiguous slice (offset =
the batches of the ranks before it, :func:`rank_slice`): an uneven sampler. digits_cnn,
digits_resnet (both :func:`qsync_opt.models.image_split`) and tiny_gpt use their real data;
other workloads a seeded pool of synthetic samples; a user's model file with ``data()`` its
own batches (:class:`GlobalBatches`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.models import image_split
from qsync_opt.models.tiny_gpt import encode, sample_batch, stdlib_corpus, train_val_split
from qsync_opt.models.user import EVAL_SEED_OFFSET, map_tensors, named_inputs, slice_batch

__all__ = ["GlobalBatches", "IndexedBatches", "as_inputs", "batch_size_of", "rank_slice", "take", "to_device"]


class GlobalBatches:
    """Deterministic global batches (seeded by seed and step) and held-out batches.

    A batch is ``(inputs, targets)``: ``inputs`` a tuple of positional tensors or (a user's
    model with keyword inputs) a dict; ``targets`` a Tensor, or None for a user's model,
    whose batch carries its own (:mod:`qsync_opt.models.user`). A user's file with ``data()``
    gives the batches: step ``k`` is the ``k``-th batch of ``data(B, seed)`` (then of
    ``data(B, seed + 1)`` ... when it ends), evaluation the first of ``data(B, seed +
    EVAL_SEED_OFFSET)``.
    """

    def __init__(self, workload: Any, seed: int, global_batch: int) -> None:
        self.wl, self.seed, self.B = workload, seed, global_batch
        self.kind = "synthetic"
        self._stream: tuple[int, Iterator[Any]] | None = None
        if getattr(workload, "user_data", None) is not None:
            self.kind = "user"
        elif (split := image_split(workload.name)) is not None:
            xtr, ytr, xte, yte = split
            self.train: Any = ((xtr,), ytr, int(ytr.shape[0]))
            self.test: Any = ((xte,), yte, int(yte.shape[0]))
            self.kind = "digits"
        elif workload.name == "tiny_gpt":
            self.train, self.test = train_val_split(encode(stdlib_corpus(max_chars=400_000)))
            self.seq = workload.seq_len or 128
            self.kind = "text"
        else:
            n = max(4 * global_batch, 64)
            self.train = (as_inputs(workload.make_inputs(n, torch.device("cpu"))),
                          workload.make_targets(n, torch.device("cpu")), n)
            self.test = self.train

    def _gen(self, salt: int, step: int) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed * 1_000_003 + salt * 7_919 + step)
                                             & 0x7FFFFFFFFFFF)

    def _draw(self, pool: Any, gen: torch.Generator, b: int) -> tuple[Any, Tensor | None]:
        if self.kind == "text":
            xb, yb = sample_batch(pool, b, self.seq, gen)
            return (xb,), yb
        inputs, targets, n = pool
        idx = (torch.randperm(n, generator=gen)[:b] if b <= n
               else torch.randint(0, n, (b,), generator=gen))
        return take(inputs, idx), (targets[idx] if targets is not None else None)

    def batch(self, step: int) -> tuple[Any, Tensor | None]:
        if self.kind == "user":
            if self._stream is None or self._stream[0] > step:
                self._stream = (0, self.wl.batches(self.B, None, self.seed))
            pos, it = self._stream
            for _ in range(step - pos):  # a resume: the batches before it are skipped
                next(it)
            self._stream = (step + 1, it)
            return as_inputs(next(it)), None
        return self._draw(self.train, self._gen(1, step), self.B)

    def eval_batches(self, n: int) -> Iterator[tuple[Any, Tensor | None]]:
        if self.kind == "user":
            for b in self.wl.batches(self.B, n, self.seed + EVAL_SEED_OFFSET):
                yield as_inputs(b), None
            return
        for i in range(n):
            yield self._draw(self.test, self._gen(2, i), self.B)


def as_inputs(batch: Any) -> Any:
    """A user's batch as model inputs: a dict stays a dict, a Tensor is one positional
    input, a list a tuple."""
    if isinstance(batch, Tensor):
        return (batch,)
    return batch if isinstance(batch, dict) else tuple(batch)


def take(inputs: Any, idx: Tensor) -> Any:
    """Samples ``idx`` of every batched tensor (dicts and tuples kept)."""
    return map_tensors(lambda t: t[idx] if t.dim() > 0 else t, inputs)


def batch_size_of(inputs: Any) -> int:
    """Samples in a batch's inputs (dim 0 of its first batched tensor)."""
    for _, t in named_inputs(inputs):
        if isinstance(t, Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return 1


def to_device(batch: Any, device: torch.device) -> Any:
    return map_tensors(lambda t: t.to(device), batch)


def rank_slice(batch: tuple[Any, Tensor | None], offset: int, b: int
               ) -> tuple[Any, Tensor | None]:
    """Rank's contiguous samples ``offset .. offset+b`` of a global batch."""
    inputs, targets = batch
    return (slice_batch(inputs, offset, b),
            targets[offset:offset + b] if targets is not None else None)


class IndexedBatches:
    """Batches that carry each sample's index in the training set (AQ-SGD keys its
    buffers by it): ``batch(step) -> (inputs, targets, idx)``.

    The digits: the images of the training split, drawn without replacement per step.
    tiny_gpt: the training text cut into fixed windows of ``seq`` tokens (window i is
    tokens ``i*seq .. i*seq+seq``, its targets shifted by one), so a sample is the same
    tokens at every visit (the random offsets of :class:`GlobalBatches` would make every
    sample new). Deterministic in ``seed`` and the step.
    """

    def __init__(self, workload: Any, seed: int, global_batch: int) -> None:
        self.wl, self.seed, self.B = workload, seed, global_batch
        if (split := image_split(workload.name)) is not None:
            xtr, ytr, xte, yte = split
            self.train: tuple[Tensor, Tensor] = (xtr, ytr)
            self.test: tuple[Tensor, Tensor] = (xte, yte)
        elif workload.name == "tiny_gpt":
            tr, te = train_val_split(encode(stdlib_corpus(max_chars=400_000)))
            seq = workload.seq_len or 128
            self.train, self.test = self._windows(tr, seq), self._windows(te, seq)
        else:
            raise QsyncInputError(f"model: indexed batches need a workload with real data "
                                  f"(digits_cnn, digits_resnet, tiny_gpt), got {workload.name!r}")
        self.n_samples = int(self.train[1].shape[0])
        if global_batch > self.n_samples:
            raise QsyncInputError(f"batch: {global_batch} is more than the {self.n_samples} "
                                  "training samples")

    @staticmethod
    def _windows(tokens: Tensor, seq: int) -> tuple[Tensor, Tensor]:
        n = (tokens.numel() - 1) // seq
        x = tokens[: n * seq].reshape(n, seq)
        y = tokens[1: n * seq + 1].reshape(n, seq)
        return x, y

    def _gen(self, salt: int, step: int) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed * 1_000_003 + salt * 7_919 + step)
                                             & 0x7FFFFFFFFFFF)

    def batch(self, step: int) -> tuple[tuple[Tensor, ...], Tensor, Tensor]:
        idx = torch.randperm(self.n_samples, generator=self._gen(1, step))[: self.B]
        x, y = self.train
        return (x[idx],), y[idx], idx

    def eval_batches(self, n: int) -> Iterator[tuple[tuple[Tensor, ...], Tensor]]:
        """``n`` held-out batches of ``B`` (the first ``n * B`` test samples, cycled)."""
        x, y = self.test
        total = int(y.shape[0])
        for i in range(n):
            idx = torch.arange(i * self.B, (i + 1) * self.B) % total
            yield (x[idx],), y[idx]
