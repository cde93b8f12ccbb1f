"""A small CNN for scikit-learn's 8x8 handwritten digits, plus its data.

The data set is ``sklearn.datasets.load_digits`` (1797 images, 10 classes),
which ships inside scikit-learn, so nothing is downloaded.

Model: conv(1->32, 3, pad 1)-BN-ReLU-conv(32->64, 3, pad 1)-BN-ReLU-maxpool(2)
-flatten-Linear(1024, 128)-ReLU-Linear(128, 10); input (B, 1, 8, 8) float32
in [0, 1], output (B, 10) logits.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import nn

__all__ = [
    "NUM_CLASSES",
    "DigitsCNN",
    "digits_cnn",
    "load_digits_tensors",
    "train_test_split",
]

NUM_CLASSES = 10
IMAGE_SIZE = 8


class DigitsCNN(nn.Module):
    """Two conv-BN-ReLU layers, a 2x2 max-pool and a two-layer classifier."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(32)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(64)
        self.relu2 = nn.ReLU()
        self.maxpool = nn.MaxPool2d(kernel_size=2, stride=2)
        self.fc1 = nn.Linear(64 * 4 * 4, 128)
        self.relu3 = nn.ReLU()
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """images (B, 1, 8, 8) float -> logits (B, num_classes)."""
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(x)))
        x = torch.flatten(self.maxpool(x), 1)
        return self.fc2(self.relu3(self.fc1(x)))


def digits_cnn() -> DigitsCNN:
    """Build the digits CNN (10 classes)."""
    return DigitsCNN()


def _digits_csv() -> Path | None:
    """scikit-learn's bundled ``datasets/data/digits.csv.gz``, found without importing
    scikit-learn (whose import costs about a second in every process that loads the
    digits, every training rank among them); None where it is not there."""
    spec = importlib.util.find_spec("sklearn")  # locates the package, runs none of it
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    return None


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images (N, 8, 8) float64 in 0..16, labels (N,) int): the file
    ``sklearn.datasets.load_digits`` reads, parsed as it parses it; through scikit-learn
    itself where the file is not found."""
    path = _digits_csv()
    if path is None:
        from sklearn.datasets import (
            load_digits,  # local import: only this helper needs scikit-learn
        )

        bunch = load_digits()
        return bunch.images, bunch.target
    with gzip.open(path, mode="rt", encoding="utf-8") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].reshape(-1, IMAGE_SIZE, IMAGE_SIZE), data[:, -1].astype(int, copy=False)


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """Return all 1797 digits as ``(x, y)``.

    ``x`` is float32 of shape (N, 1, 8, 8) scaled from 0..16 to [0, 1];
    ``y`` is int64 of shape (N,) with labels 0..9. The data are
    ``sklearn.datasets.load_digits``'s (bundled with scikit-learn, no download), read
    from its file without importing scikit-learn.
    """
    images, target = _digits_arrays()
    x = (
        torch.as_tensor(images, dtype=torch.float32).reshape(-1, 1, IMAGE_SIZE, IMAGE_SIZE)
        / 16.0
    )
    y = torch.as_tensor(target, dtype=torch.int64)
    return x, y


def train_test_split(
    x: torch.Tensor, y: torch.Tensor, test_fraction: float = 0.2, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deterministic shuffled split; returns ``(x_train, y_train, x_test, y_test)``.

    The permutation comes from a CPU ``torch.Generator`` seeded with ``seed``,
    so the same seed gives the same split on every machine.  The test set has
    ``round(N * test_fraction)`` samples.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y differ in length: {x.shape[0]} vs {y.shape[0]}")
    n = x.shape[0]
    n_test = round(n * test_fraction)
    generator = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=generator).to(x.device)
    test_idx, train_idx = perm[:n_test], perm[n_test:]
    return x[train_idx], y[train_idx], x[test_idx], y[test_idx]
