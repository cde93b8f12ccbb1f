"""Torch-native models reproducing the patterns of torchvision, timm and Swin code, for the
tracers' tests (tests/models/test_real_models.py, tests/graph/test_graph_heads.py) and the trace benchmark
(benchmarks/bench_models.py); not part of the package.

Those libraries cannot be installed beside the CPU torch pinned here, so the patterns their
models are made of are written out in plain torch, each with a builder returning
``(model, example_inputs)`` (small by default, for tests; full size by argument):

=========================  ==================================================================
builder                    pattern
=========================  ==================================================================
``mobilenet_v3_like``      depthwise convs, in-place Hardswish/ReLU right after a conv,
                           squeeze-excitation (pool, 1x1 convs, Hardsigmoid, a multiply)
``resnext_like``           grouped 3x3 convs in bottleneck blocks, in-place ReLU
``vit_mha``                a torchvision-style ViT on ``nn.MultiheadAttention`` (ViT-B/16
                           dims with ``vit_mha(full=True)``)
``timm_vit``               timm-style attention: one fused ``qkv`` Linear, then
                           ``F.scaled_dot_product_attention``
``swin_like``              Swin-like window attention whose projections are
                           ``F.linear(x, self.w, self.b)`` inside a helper function, with
                           functional ``@`` matmuls and a relative position bias
=========================  ==================================================================
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PATTERNS", "mobilenet_v3_like", "resnext_like", "swin_like", "timm_vit", "vit_mha"]


# ----------------------------------------------------------------------------- MobileNetV3


class SqueezeExcitation(nn.Module):
    """torchvision's SqueezeExcitation: pool, fc1 (1x1 conv), ReLU, fc2, Hardsigmoid, scale."""

    def __init__(self, channels: int, squeeze: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.activation = nn.ReLU(inplace=True)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.scale_activation = nn.Hardsigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return s * x


class InvertedResidual(nn.Module):
    """Expand (1x1 conv, BN, in-place Hardswish), depthwise 3x3 (BN, in-place ReLU), SE,
    project (1x1 conv, BN), residual."""

    def __init__(self, channels: int, expand: int) -> None:
        super().__init__()
        hidden = channels * expand
        self.expand = nn.Sequential(nn.Conv2d(channels, hidden, 1, bias=False),
                                    nn.BatchNorm2d(hidden), nn.Hardswish(inplace=True))
        self.depthwise = nn.Sequential(
            nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden), nn.ReLU(inplace=True))
        self.se = SqueezeExcitation(hidden, max(8, hidden // 4))
        self.project = nn.Sequential(nn.Conv2d(hidden, channels, 1, bias=False),
                                     nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.project(self.se(self.depthwise(self.expand(x))))


class MobileNetV3Like(nn.Module):
    def __init__(self, width: int, blocks: int, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, stride=2, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.Hardswish(inplace=True))
        self.blocks = nn.Sequential(*(InvertedResidual(width, 4) for _ in range(blocks)))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(width, 4 * width),
                                        nn.Hardswish(inplace=True), nn.Linear(4 * width,
                                                                              num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pool(self.blocks(self.stem(x))))


def mobilenet_v3_like(batch: int = 2, image: int = 32, width: int = 16, blocks: int = 2,
                      num_classes: int = 10, full: bool = False
                      ) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """MobileNetV3-like CNN; ``full``: 224x224, width 64, 8 blocks, 1000 classes."""
    if full:
        image, width, blocks, num_classes = 224, 64, 8, 1000
    return MobileNetV3Like(width, blocks, num_classes), (torch.randn(batch, 3, image, image),)


# ----------------------------------------------------------------------------- ResNeXt


class ResNeXtBlock(nn.Module):
    """Bottleneck with a grouped 3x3 conv (cardinality ``groups``), in-place ReLUs."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        mid = channels // 2
        self.conv1 = nn.Conv2d(channels, mid, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, padding=1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        return self.relu(self.bn3(self.conv3(y)) + x)


class ResNeXtLike(nn.Module):
    def __init__(self, width: int, blocks: int, groups: int, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        self.layer = nn.Sequential(*(ResNeXtBlock(width, groups) for _ in range(blocks)))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layer(self.stem(x))), 1))


def resnext_like(batch: int = 2, image: int = 16, width: int = 32, blocks: int = 2,
                 groups: int = 4, num_classes: int = 10, full: bool = False
                 ) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """ResNeXt-like CNN; ``full``: 224x224, width 256, 8 blocks, 32 groups, 1000 classes."""
    if full:
        image, width, blocks, groups, num_classes = 224, 256, 8, 32, 1000
    return ResNeXtLike(width, blocks, groups, num_classes), (torch.randn(batch, 3, image,
                                                                          image),)


# ----------------------------------------------------------------------------- ViT (MHA)


class MHAEncoderBlock(nn.Module):
    """torchvision's ViT EncoderBlock: pre-LN, nn.MultiheadAttention (batch_first)."""

    def __init__(self, dim: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.dropout = nn.Dropout(0.0)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp), nn.GELU(), nn.Dropout(0.0),
                                 nn.Linear(mlp, dim), nn.Dropout(0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = x + self.dropout(y)
        return x + self.mlp(self.ln_2(x))


class ViTMHA(nn.Module):
    def __init__(self, image: int, patch: int, layers: int, heads: int, dim: int, mlp: int,
                 num_classes: int) -> None:
        super().__init__()
        self.conv_proj = nn.Conv2d(3, dim, patch, stride=patch)
        seq = (image // patch) ** 2 + 1
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embedding = nn.Parameter(torch.empty(1, seq, dim).normal_(std=0.02))
        self.layers = nn.Sequential(OrderedDict(
            (f"encoder_layer_{i}", MHAEncoderBlock(dim, heads, mlp)) for i in range(layers)))
        self.ln = nn.LayerNorm(dim, eps=1e-6)
        self.heads = nn.Sequential(OrderedDict([("head", nn.Linear(dim, num_classes))]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.ln(self.layers(x + self.pos_embedding))
        return self.heads(x[:, 0])


def vit_mha(batch: int = 2, image: int = 32, patch: int = 8, layers: int = 2, heads: int = 4,
            dim: int = 64, mlp: int = 128, num_classes: int = 10, full: bool = False
            ) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """torchvision-style ViT on nn.MultiheadAttention; ``full``: ViT-B/16 (224, patch 16,
    12 layers, 12 heads, 768, MLP 3072, 1000 classes)."""
    if full:
        image, patch, layers, heads, dim, mlp, num_classes = 224, 16, 12, 12, 768, 3072, 1000
    model = ViTMHA(image, patch, layers, heads, dim, mlp, num_classes)
    return model, (torch.randn(batch, 3, image, image),)


# ----------------------------------------------------------------------------- timm ViT


class TimmAttention(nn.Module):
    """timm's Attention: fused qkv Linear, F.scaled_dot_product_attention, proj."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads
        self.head_dim = dim // heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.attn_drop = 0.0
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class TimmBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = TimmAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(OrderedDict([("fc1", nn.Linear(dim, mlp)), ("act", nn.GELU()),
                                              ("fc2", nn.Linear(mlp, dim))]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TimmViT(nn.Module):
    def __init__(self, image: int, patch: int, layers: int, heads: int, dim: int, mlp: int,
                 num_classes: int) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 1, dim))
        self.blocks = nn.Sequential(*(TimmBlock(dim, heads, mlp) for _ in range(layers)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def timm_vit(batch: int = 2, image: int = 32, patch: int = 8, layers: int = 2, heads: int = 4,
             dim: int = 64, mlp: int = 128, num_classes: int = 10, full: bool = False
             ) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """timm-style ViT (fused qkv, SDPA); ``full``: ViT-B/16 dims."""
    if full:
        image, patch, layers, heads, dim, mlp, num_classes = 224, 16, 12, 12, 768, 3072, 1000
    return TimmViT(image, patch, layers, heads, dim, mlp, num_classes), (
        torch.randn(batch, 3, image, image),)


# ----------------------------------------------------------------------------- Swin-like


def _project(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A helper function, as Swin code has: the Linear is a functional call on parameters."""
    return F.linear(x, w, b)


class WindowAttention(nn.Module):
    """Window attention with a relative position bias; projections via :func:`_project`."""

    def __init__(self, dim: int, heads: int, window: int) -> None:
        super().__init__()
        self.heads, self.window = heads, window
        self.scale = (dim // heads) ** -0.5
        self.qkv_w = nn.Parameter(torch.empty(3 * dim, dim))
        self.qkv_b = nn.Parameter(torch.zeros(3 * dim))
        self.proj_w = nn.Parameter(torch.empty(dim, dim))
        self.proj_b = nn.Parameter(torch.zeros(dim))
        self.rel_bias = nn.Parameter(torch.zeros(heads, window * window, window * window))
        for w in (self.qkv_w, self.proj_w):
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Bw, N, C = x.shape  # windows x tokens per window x channels
        qkv = _project(x, self.qkv_w, self.qkv_b).reshape(Bw, N, 3, self.heads, C // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attn = (q * self.scale) @ k.transpose(-2, -1) + self.rel_bias
        attn = attn.softmax(dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(Bw, N, C)
        return _project(out, self.proj_w, self.proj_b)


class SwinBlock(nn.Module):
    def __init__(self, dim: int, heads: int, window: int, shift: int) -> None:
        super().__init__()
        self.window, self.shift = window, shift
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, heads, window)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1_w = nn.Parameter(torch.empty(4 * dim, dim))
        self.fc1_b = nn.Parameter(torch.zeros(4 * dim))
        self.fc2_w = nn.Parameter(torch.empty(dim, 4 * dim))
        self.fc2_b = nn.Parameter(torch.zeros(dim))
        for w in (self.fc1_w, self.fc2_w):
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        w = self.window
        y = self.norm1(x)
        if self.shift:
            y = torch.roll(y, shifts=(-self.shift, -self.shift), dims=(1, 2))
        y = y.view(B, H // w, w, W // w, w, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, w * w, C)
        y = self.attn(y)
        y = y.view(B, H // w, W // w, w, w, C).permute(0, 1, 3, 2, 4, 5).reshape(B, H, W, C)
        if self.shift:
            y = torch.roll(y, shifts=(self.shift, self.shift), dims=(1, 2))
        x = x + y
        h = F.gelu(_project(self.norm2(x), self.fc1_w, self.fc1_b))
        return x + _project(h, self.fc2_w, self.fc2_b)


class SwinLike(nn.Module):
    def __init__(self, image: int, patch: int, dim: int, depth: int, heads: int, window: int,
                 num_classes: int) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.blocks = nn.Sequential(*(SwinBlock(dim, heads, window, (i % 2) * (window // 2))
                                      for i in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).permute(0, 2, 3, 1)  # B, H, W, C
        x = self.norm(self.blocks(x))
        return self.head(x.mean(dim=(1, 2)))


def swin_like(batch: int = 2, image: int = 32, patch: int = 4, dim: int = 32, depth: int = 2,
              heads: int = 2, window: int = 4, num_classes: int = 10, full: bool = False
              ) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Swin-like model of window-attention blocks (shifted every other block);
    ``full``: 224x224, patch 4, dim 96, 12 blocks, 3 heads, window 7, 1000 classes."""
    if full:
        image, patch, dim, depth, heads, window, num_classes = 224, 4, 96, 12, 3, 7, 1000
    return SwinLike(image, patch, dim, depth, heads, window, num_classes), (
        torch.randn(batch, 3, image, image),)


#: name -> builder, for tests and benchmarks.
PATTERNS = {"mobilenet_v3_like": mobilenet_v3_like, "resnext_like": resnext_like,
            "vit_mha": vit_mha, "timm_vit": timm_vit, "swin_like": swin_like}
