"""The batches an indicator measures on: synthetic, or a workload's real data."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from ..errors import QsyncInputError
from ..models import Workload


def synthetic_batches(workload: Workload, batch: int, n: int, seed: int
                      ) -> Iterator[tuple[tuple[Tensor, ...], Tensor]]:
    """Inputs of the right shape and dtype: float inputs drawn N(0,1), integer inputs
    shuffled from the workload's example (so they stay in range), seeded per batch."""
    base_inputs = workload.make_inputs(batch, torch.device("cpu"))
    base_targets = workload.make_targets(batch, torch.device("cpu"))
    for i in range(n):
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        inputs = []
        for t in base_inputs:
            if t.is_floating_point():
                inputs.append(torch.randn(t.shape, generator=gen, dtype=t.dtype))
            else:
                perm = torch.randperm(t.numel(), generator=gen)
                inputs.append(t.reshape(-1)[perm].reshape(t.shape))
        perm = torch.randperm(base_targets.numel(), generator=gen)
        yield tuple(inputs), base_targets.reshape(-1)[perm].reshape(base_targets.shape)


def real_batches(workload: Workload, batch: int, n: int, seed: int
                 ) -> Iterator[tuple[tuple[Tensor, ...], Tensor]]:
    """digits_cnn, digits_resnet: scikit-learn's digits (training split,
    :func:`qsync_opt.models.image_split`); tiny_gpt: stdlib source text."""
    from ..models import image_split

    gen = torch.Generator().manual_seed(seed)
    if (split := image_split(workload.name)) is not None:
        x_tr, y_tr, _, _ = split
        for _ in range(n):
            idx = torch.randint(0, x_tr.shape[0], (batch,), generator=gen)
            yield (x_tr[idx],), y_tr[idx]
    elif workload.name == "tiny_gpt":
        from ..models.tiny_gpt import encode, sample_batch, stdlib_corpus, train_val_split

        data, _ = train_val_split(encode(stdlib_corpus(max_chars=400_000)))
        seq = workload.seq_len or 128
        for _ in range(n):
            xb, yb = sample_batch(data, batch, seq, gen)
            yield (xb,), yb
    else:
        raise QsyncInputError(f"model: {workload.name} has no real data here; use synthetic")
