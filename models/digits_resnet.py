"""A CIFAR-style ResNet-8 for scikit-learn's digits upsampled to 32x32, plus its data.

The data are ``digits_cnn.load_digits_tensors()`` (1797 images of 8x8, 10 classes,
bundled with scikit-learn, nothing downloaded) upsampled bilinearly to 32x32; the
train/test split is digits_cnn's (``digits_cnn.train_test_split(x, y, seed=0)``), so
both models are scored on the same images.

Model (input (B, 1, 32, 32) float32 in [0, 1], output (B, 10) logits):

=========  =====================================================  ============
module     layers                                                 output
=========  =====================================================  ============
stem       ``conv1`` 3x3(1->16, pad 1)-``bn1``-``relu``           (B,16,32,32)
layer1     BasicBlock(16->16)                                     (B,16,32,32)
layer2     BasicBlock(16->32, stride 2), 1x1 downsample           (B,32,16,16)
layer3     BasicBlock(32->64, stride 2), 1x1 downsample           (B,64,8,8)
head       ``avgpool`` AdaptiveAvgPool2d(1)-flatten-``fc`` 64->10  (B,10)
=========  =====================================================  ============

A BasicBlock (``models.resnet.BasicBlock``) is conv3x3-BN-ReLU-conv3x3-BN plus the
identity, or ``downsample`` = ``nn.Sequential(conv1x1(stride), BN)`` where the shape
changes, then ReLU; module names are ``layer1.0.conv1``, ``layer2.0.downsample.0``, ...
Ten GEMMs: the stem conv, six block convs, two downsample convs and ``fc``.
Parameters: 77,754.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from qsync_opt.models.digits_cnn import NUM_CLASSES, load_digits_tensors
from qsync_opt.models.resnet import BasicBlock, conv1x1, conv3x3, init_weights
from torch import nn

__all__ = ["IMAGE_SIZE", "WIDTHS", "DigitsResNet", "digits_resnet", "load_digits32_tensors"]

IMAGE_SIZE = 32
#: Channels of the stem and of the three stages.
WIDTHS = (16, 32, 64)


class DigitsResNet(nn.Module):
    """ResNet-8: a 3x3 stem, three one-block stages (16, 32, 64 wide), pool and a linear head."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.inplanes = WIDTHS[0]
        self.conv1 = conv3x3(1, self.inplanes)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._make_layer(WIDTHS[0], stride=1)
        self.layer2 = self._make_layer(WIDTHS[1], stride=2)
        self.layer3 = self._make_layer(WIDTHS[2], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(WIDTHS[2], num_classes)

        init_weights(self)

    def _make_layer(self, planes: int, stride: int) -> nn.Sequential:
        """One BasicBlock; a 1x1 conv-BN downsample when the stride or width changes."""
        downsample: nn.Module | None = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes, stride),
                                       nn.BatchNorm2d(planes))
        block = BasicBlock(self.inplanes, planes, stride, downsample)
        self.inplanes = planes
        return nn.Sequential(block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """images (B, 1, 32, 32) float -> logits (B, num_classes)."""
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def digits_resnet() -> DigitsResNet:
    """Build the digits ResNet-8 (10 classes)."""
    return DigitsResNet()


def load_digits32_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """Return all 1797 digits upsampled to 32x32 as ``(x, y)``.

    ``x`` is float32 of shape (N, 1, 32, 32) in [0, 1]: ``load_digits_tensors()``'s
    8x8 images through ``F.interpolate(mode="bilinear", align_corners=False)``, clamped
    to [0, 1]; ``y`` is int64 of shape (N,) with labels 0..9 (the same order, so
    ``digits_cnn.train_test_split(x, y, seed=0)`` picks the same images).
    """
    x, y = load_digits_tensors()
    x = F.interpolate(x, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)
    return x.clamp_(0.0, 1.0), y
