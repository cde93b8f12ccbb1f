"""VGG-16 with batch normalisation (``vgg16_bn``), in plain torch.

Structure and attribute names follow ``torchvision.models.vgg``:
``features`` (an ``nn.Sequential`` of Conv2d/BatchNorm2d/ReLU/MaxPool2d),
``avgpool`` (``AdaptiveAvgPool2d((7, 7))``) and ``classifier``
(Linear/ReLU/Dropout x2, then Linear to 1000 classes).
Parameter count: 138,365,992.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["VGG", "VGG16_CFG", "vgg16_bn"]

#: torchvision's configuration "D" (VGG-16): channel counts, "M" = max-pool.
VGG16_CFG: tuple[int | str, ...] = (
    64,
    64,
    "M",
    128,
    128,
    "M",
    256,
    256,
    256,
    "M",
    512,
    512,
    512,
    "M",
    512,
    512,
    512,
    "M",
)


def make_layers(cfg: tuple[int | str, ...], batch_norm: bool = True) -> nn.Sequential:
    """Build the convolutional ``features`` stack from a VGG configuration."""
    layers: list[nn.Module] = []
    in_channels = 3
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            out_channels = int(v)
            layers.append(nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1))
            if batch_norm:
                layers.append(nn.BatchNorm2d(out_channels))
            layers.append(nn.ReLU(inplace=True))
            in_channels = out_channels
    return nn.Sequential(*layers)


class VGG(nn.Module):
    """VGG classifier with torchvision's structure and attribute names."""

    def __init__(
        self, features: nn.Sequential, num_classes: int = 1000, dropout: float = 0.5
    ) -> None:
        super().__init__()
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, num_classes),
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """images (B, 3, H, W) float -> logits (B, num_classes)."""
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def vgg16_bn(num_classes: int = 1000) -> VGG:
    """VGG-16 with BatchNorm (13 Conv2d + 3 Linear); 138.37 M parameters at 1000 classes."""
    return VGG(make_layers(VGG16_CFG, batch_norm=True), num_classes=num_classes)
