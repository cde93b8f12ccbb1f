"""Vision Transformer ViT-B/16 for 224x224 ImageNet (1000 classes), in plain torch.

Structure and attribute names follow ``torchvision.models.vit_b_16``::

    conv_proj                                     Conv2d(3, 768, kernel 16, stride 16)
    class_token                                   Parameter (1, 1, 768)
    encoder.pos_embedding                         Parameter (1, 197, 768)
    encoder.dropout
    encoder.layers.encoder_layer_{i}.ln_1
    encoder.layers.encoder_layer_{i}.self_attention.{in_proj, qk_matmul, av_matmul, dropout, out_proj}
    encoder.layers.encoder_layer_{i}.dropout
    encoder.layers.encoder_layer_{i}.ln_2
    encoder.layers.encoder_layer_{i}.mlp          Sequential(0 Linear, 1 GELU, 2 Dropout, 3 Linear, 4 Dropout)
    encoder.ln
    heads.head                                    Linear(768, 1000) on the class token

Attention design choice: torchvision uses ``nn.MultiheadAttention``, whose
fused ``in_proj_weight`` (3d x d) and ``out_proj`` are not plain modules per
matmul.  Here the fused input projection is ONE ``nn.Linear(768, 3*768)``
named ``in_proj`` (same parameter count and layout as ``in_proj_weight`` /
``in_proj_bias``: rows [q; k; v]), the two attention matmuls are
:class:`~.layers.MatMul` modules, and ``out_proj`` is an ``nn.Linear``.
So each block has 4 ``nn.Linear`` (in_proj, out_proj, mlp.0, mlp.3) and 2
``MatMul``.  Pre-LN blocks, exact GELU, LayerNorm eps 1e-6.
Parameter count: 86,567,656 (identical to torchvision).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch
from qsync_opt.models.layers import MatMul
from torch import nn

__all__ = ["ViTConfig", "VisionTransformer", "vit_b16"]


@dataclass(frozen=True)
class ViTConfig:
    """Hyper-parameters of a Vision Transformer."""

    image_size: int = 224
    patch_size: int = 16
    num_layers: int = 12
    num_heads: int = 12
    hidden_dim: int = 768
    mlp_dim: int = 3072
    num_classes: int = 1000
    dropout: float = 0.0
    attention_dropout: float = 0.0
    layer_norm_eps: float = 1e-6

    @property
    def seq_length(self) -> int:
        """Number of tokens: patches plus the class token."""
        return (self.image_size // self.patch_size) ** 2 + 1


class ViTSelfAttention(nn.Module):
    """Multi-head self-attention with a fused ``in_proj`` Linear and MatMul modules."""

    def __init__(self, hidden_dim: int, num_heads: int, attention_dropout: float) -> None:
        super().__init__()
        if hidden_dim % num_heads != 0:
            raise ValueError("hidden_dim must be divisible by num_heads")
        self.hidden_dim = hidden_dim
        self.num_heads = num_heads
        self.head_dim = hidden_dim // num_heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.in_proj = nn.Linear(hidden_dim, 3 * hidden_dim)
        self.qk_matmul = MatMul()
        self.av_matmul = MatMul()
        self.dropout = nn.Dropout(attention_dropout)
        self.out_proj = nn.Linear(hidden_dim, hidden_dim)
        # nn.MultiheadAttention's initialisation.
        nn.init.xavier_uniform_(self.in_proj.weight)
        nn.init.zeros_(self.in_proj.bias)
        nn.init.zeros_(self.out_proj.bias)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        # (B, S, H*D) -> (B, H, S, D)
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.in_proj(x).split(self.hidden_dim, dim=2)
        q = self._split_heads(qkv[0])
        k = self._split_heads(qkv[1])
        v = self._split_heads(qkv[2])
        scores = self.qk_matmul(q, k.transpose(-1, -2)) * self.scale
        probs = self.dropout(torch.softmax(scores, dim=-1))
        out = self.av_matmul(probs, v).transpose(1, 2).flatten(2)
        return self.out_proj(out)


class EncoderBlock(nn.Module):
    """Pre-LN transformer encoder block (torchvision ``EncoderBlock`` naming)."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_dim, eps=config.layer_norm_eps)
        self.self_attention = ViTSelfAttention(
            config.hidden_dim, config.num_heads, config.attention_dropout
        )
        self.dropout = nn.Dropout(config.dropout)
        self.ln_2 = nn.LayerNorm(config.hidden_dim, eps=config.layer_norm_eps)
        self.mlp = nn.Sequential(
            nn.Linear(config.hidden_dim, config.mlp_dim),
            nn.GELU(),
            nn.Dropout(config.dropout),
            nn.Linear(config.mlp_dim, config.hidden_dim),
            nn.Dropout(config.dropout),
        )
        for m in self.mlp.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.normal_(m.bias, std=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dropout(self.self_attention(self.ln_1(x))) + x
        return y + self.mlp(self.ln_2(y))


class Encoder(nn.Module):
    """Position embedding + stack of encoder blocks + final LayerNorm."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(
            torch.empty(1, config.seq_length, config.hidden_dim).normal_(std=0.02)
        )
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.Sequential(
            OrderedDict(
                (f"encoder_layer_{i}", EncoderBlock(config)) for i in range(config.num_layers)
            )
        )
        self.ln = nn.LayerNorm(config.hidden_dim, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.layers(self.dropout(x + self.pos_embedding)))


class VisionTransformer(nn.Module):
    """ViT classifier: ``forward(images (B, 3, 224, 224)) -> logits (B, num_classes)``."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        if config.image_size % config.patch_size != 0:
            raise ValueError("image_size must be divisible by patch_size")
        self.config = config
        self.conv_proj = nn.Conv2d(
            3,
            config.hidden_dim,
            kernel_size=config.patch_size,
            stride=config.patch_size,
        )
        self.class_token = nn.Parameter(torch.zeros(1, 1, config.hidden_dim))
        self.encoder = Encoder(config)
        head = nn.Linear(config.hidden_dim, config.num_classes)
        self.heads = nn.Sequential(OrderedDict([("head", head)]))

        fan_in = (
            self.conv_proj.in_channels
            * self.conv_proj.kernel_size[0]
            * self.conv_proj.kernel_size[1]
        )
        nn.init.trunc_normal_(self.conv_proj.weight, std=math.sqrt(1 / fan_in))
        if self.conv_proj.bias is not None:
            nn.init.zeros_(self.conv_proj.bias)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """images (B, 3, 224, 224) float -> logits (B, num_classes)."""
        x = self.conv_proj(x)  # (B, D, H/p, W/p)
        x = x.flatten(2).transpose(1, 2)  # (B, N, D)
        class_token = self.class_token.expand(x.shape[0], -1, -1)
        x = torch.cat([class_token, x], dim=1)
        x = self.encoder(x)
        return self.heads(x[:, 0])


def vit_b16(num_classes: int = 1000) -> VisionTransformer:
    """ViT-B/16: 224x224, patch 16, 12 layers, d=768, 12 heads, MLP 3072; 86.57 M parameters."""
    return VisionTransformer(ViTConfig(num_classes=num_classes))
