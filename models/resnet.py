"""ResNet-18 and ResNet-50 for ImageNet (1000 classes), in plain torch.

The layer structure and attribute names are identical to
``torchvision.models.resnet`` (``conv1``, ``bn1``, ``relu``, ``maxpool``,
``layer1``..``layer4`` made of ``BasicBlock`` / ``Bottleneck`` blocks with
``conv1``/``bn1``/... and ``downsample`` as ``nn.Sequential(conv, bn)``,
``avgpool``, ``fc``), so a torchvision state dict loads unchanged.
Parameter counts: resnet18 11,689,512; resnet50 25,557,032.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BasicBlock", "Bottleneck", "ResNet", "resnet18", "resnet18_32", "resnet50"]


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """3x3 convolution with padding 1 and no bias."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """1x1 convolution with no bias."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


def init_weights(model: nn.Module) -> None:
    """torchvision's ResNet initialisation: Kaiming-normal (fan out) convolutions, BatchNorm
    at weight 1 and bias 0."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (ResNet-18/34)."""

    expansion: int = 1

    def __init__(
        self,
        inplanes: int,
        planes: int,
        stride: int = 1,
        downsample: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out = out + identity
        return self.relu(out)


class Bottleneck(nn.Module):
    """1x1 -> 3x3 -> 1x1 bottleneck block (ResNet-50+, stride on the 3x3 as in torchvision v1.5)."""

    expansion: int = 4

    def __init__(
        self,
        inplanes: int,
        planes: int,
        stride: int = 1,
        downsample: nn.Module | None = None,
    ) -> None:
        super().__init__()
        width = planes
        self.conv1 = conv1x1(inplanes, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = conv1x1(width, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out = out + identity
        return self.relu(out)


Block = type[BasicBlock] | type[Bottleneck]


class ResNet(nn.Module):
    """ImageNet ResNet with torchvision's structure and attribute names."""

    def __init__(self, block: Block, layers: list[int], num_classes: int = 1000,
                 small_input: bool = False) -> None:
        super().__init__()
        self.inplanes = 64
        if small_input:  # CIFAR-style stem for 32x32 images: 3x3 stride 1, no max-pool
            self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=3, stride=1, padding=1,
                                   bias=False)
        else:
            self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3,
                                   bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool: nn.Module = (nn.Identity() if small_input else
                                   nn.MaxPool2d(kernel_size=3, stride=2, padding=1))
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)

        init_weights(self)

    def _make_layer(self, block: Block, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample: nn.Module | None = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers: list[nn.Module] = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        for _ in range(1, blocks):
            layers.append(block(self.inplanes, planes))
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """images (B, 3, H, W) float -> logits (B, num_classes)."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


def resnet18(num_classes: int = 1000) -> ResNet:
    """ResNet-18 (BasicBlock, [2, 2, 2, 2]); 11.69 M parameters at 1000 classes."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes)


def resnet18_32(num_classes: int = 10) -> ResNet:
    """ResNet-18 for 32x32 images (CIFAR-style stem: a 3x3 stride-1 first conv, no max-pool),
    10 classes; 11.17 M parameters."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes, small_input=True)


def resnet50(num_classes: int = 1000) -> ResNet:
    """ResNet-50 (Bottleneck, [3, 4, 6, 3]); 53 Conv2d, 1 Linear, 25.56 M parameters."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes=num_classes)
