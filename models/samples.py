"""Batches a built-in workload is measured on: its real data where it has them (the digits
images, tiny_gpt's text), else synthetic inputs of the right shape and dtype."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from qsync_opt.models import digits_cnn, digits_resnet
from qsync_opt.models.digits_cnn import train_test_split
from qsync_opt.models.tiny_gpt import encode, sample_batch, stdlib_corpus, train_val_split
from qsync_opt.models.workload import Workload
from torch import Tensor

from qsync_opt.core.errors import QsyncInputError

__all__ = ["image_split", "real_batches", "synthetic_batches"]

#: The real-data image workloads and the loader of all their images ``(x, y)``.
_IMAGE_LOADERS: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {
    "digits_cnn": digits_cnn.load_digits_tensors,
    "digits_resnet": digits_resnet.load_digits32_tensors,
}


def image_split(
    name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The real-data train/test split ``(x_train, y_train, x_test, y_test)`` of an image
    workload, or None for a workload without real images (tiny_gpt's data are text).

    digits_cnn (8x8) and digits_resnet (upsampled to 32x32) share one split,
    ``digits_cnn.train_test_split(x, y, seed=0)``: 1438 training and 359 test images,
    the same images for both.
    """
    loader = _IMAGE_LOADERS.get(name)
    if loader is None:
        return None
    x, y = loader()
    return train_test_split(x, y, seed=0)


def synthetic_batches(workload: Workload, batch: int, n: int, seed: int
                      ) -> Iterator[tuple[tuple[Tensor, ...], Tensor]]:
    """Inputs of the right shape and dtype: float inputs drawn N(0,1), integer inputs
    shuffled from the workload's example (so they stay in range), seeded per batch."""
    base_inputs = workload.make_inputs(batch, torch.device("cpu"))
    base_targets = workload.make_targets(batch, torch.device("cpu"))
    assert base_targets is not None, "synthetic_batches: a workload with its own targets"
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
    :func:`image_split`); tiny_gpt: stdlib source text."""
    gen = torch.Generator().manual_seed(seed)
    if (split := image_split(workload.name)) is not None:
        x_tr, y_tr, _, _ = split
        for _ in range(n):
            idx = torch.randint(0, x_tr.shape[0], (batch,), generator=gen)
            yield (x_tr[idx],), y_tr[idx]
    elif workload.name == "tiny_gpt":
        data, _ = train_val_split(encode(stdlib_corpus(max_chars=400_000)))
        seq = workload.seq_len or 128
        for _ in range(n):
            xb, yb = sample_batch(data, batch, seq, gen)
            yield (xb,), yb
    else:
        raise QsyncInputError(f"model: {workload.name} has no real data here; use synthetic")
