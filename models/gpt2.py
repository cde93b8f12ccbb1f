"""GPT-2 decoder-only language model, in plain torch.

Structure and attribute names follow HuggingFace ``GPT2LMHeadModel``::

    transformer.wte, transformer.wpe, transformer.drop
    transformer.h.{i}.ln_1
    transformer.h.{i}.attn.{c_attn, qk_matmul, av_matmul, attn_dropout, c_proj, resid_dropout}
    transformer.h.{i}.ln_2
    transformer.h.{i}.mlp.{c_fc, act, c_proj, dropout}
    transformer.ln_f
    lm_head                      (weight tied to transformer.wte.weight)

Differences from HuggingFace: ``c_attn``/``c_proj``/``c_fc`` are ``nn.Linear``
(HF uses a transposed ``Conv1D``), and the attention matmuls are
:class:`~.layers.MatMul` modules.  ``c_attn`` is ONE ``nn.Linear(d, 3d)``
whose output is split into query/key/value.  Pre-LN blocks, learned absolute
positions, tanh-approximated GELU (GPT-2's ``gelu_new``), LayerNorm eps 1e-5.
The causal mask is a non-persistent boolean buffer ``causal_mask`` of shape
(1, 1, n_ctx, n_ctx) in every attention module, sliced to the sequence length
in ``forward``.

Parameter counts (tied embeddings counted once): gpt2_small 124,439,808;
gpt2_medium 354,823,168; gpt2_xl 1,557,611,200.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from qsync_opt.models.layers import MatMul
from torch import nn

__all__ = [
    "GPT",
    "GPT2_MEDIUM",
    "GPT2_SMALL",
    "GPT2_XL",
    "GPTConfig",
    "gpt2_medium",
    "gpt2_small",
    "gpt2_xl",
]


@dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of a GPT-2 style decoder."""

    vocab_size: int = 50257
    n_ctx: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    dropout: float = 0.1
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02

    @property
    def n_inner(self) -> int:
        """Width of the MLP hidden layer (4 * n_embd)."""
        return 4 * self.n_embd


GPT2_SMALL = GPTConfig(n_layer=12, n_embd=768, n_head=12)
GPT2_MEDIUM = GPTConfig(n_layer=24, n_embd=1024, n_head=16)
GPT2_XL = GPTConfig(n_layer=48, n_embd=1600, n_head=25)


class GPT2Attention(nn.Module):
    """Causal multi-head self-attention with a fused ``c_attn`` projection."""

    causal_mask: torch.Tensor  # a buffer (register_buffer)

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError("n_embd must be divisible by n_head")
        self.n_embd = config.n_embd
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.qk_matmul = MatMul()
        self.av_matmul = MatMul()
        self.attn_dropout = nn.Dropout(config.dropout)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)
        mask = torch.tril(torch.ones(config.n_ctx, config.n_ctx, dtype=torch.bool))
        self.register_buffer(
            "causal_mask", mask.view(1, 1, config.n_ctx, config.n_ctx), persistent=False
        )

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        # (B, S, H*D) -> (B, H, S, D)
        return x.unflatten(-1, (self.n_head, self.head_dim)).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq_len = x.size(1)
        qkv = self.c_attn(x).split(self.n_embd, dim=2)
        q = self._split_heads(qkv[0])
        k = self._split_heads(qkv[1])
        v = self._split_heads(qkv[2])
        scores = self.qk_matmul(q, k.transpose(-1, -2)) * self.scale
        # causal_mask[:, :, :S, :S], written with narrow so torch.fx can trace it.
        mask = self.causal_mask.narrow(2, 0, seq_len).narrow(3, 0, seq_len)
        scores = scores.masked_fill(mask.logical_not(), float("-inf"))
        probs = self.attn_dropout(torch.softmax(scores, dim=-1))
        out = self.av_matmul(probs, v).transpose(1, 2).flatten(2)  # (B, S, H*D)
        return self.resid_dropout(self.c_proj(out))


class GPT2MLP(nn.Module):
    """Position-wise feed-forward block: c_fc -> GELU(tanh) -> c_proj -> dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.n_inner)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(config.n_inner, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class GPT2Block(nn.Module):
    """Pre-LN transformer decoder block."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    """Embeddings + decoder blocks + final LayerNorm (returns hidden states)."""

    position_ids: torch.Tensor  # a buffer (register_buffer)

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_ctx, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.register_buffer(
            "position_ids", torch.arange(config.n_ctx).unsqueeze(0), persistent=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq_len = input_ids.size(1)
        # Tensor.narrow (not [:, :seq_len]) so torch.fx can trace the slice of a buffer.
        position_ids = self.position_ids.narrow(1, 0, seq_len)
        x = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT(nn.Module):
    """GPT-2 language model: ``forward(input_ids (B, S) int64) -> logits (B, S, vocab_size)``.

    ``lm_head`` is ``nn.Linear(n_embd, vocab_size, bias=False)`` whose weight
    is the same ``Parameter`` as ``transformer.wte.weight``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2: scale the residual-path projections by 1/sqrt(2 * n_layer).
        resid_std = config.initializer_range / math.sqrt(2 * config.n_layer)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=resid_std)
        self.lm_head.weight = self.transformer.wte.weight

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            if module is self.lm_head:
                return  # tied to wte below; skip the throw-away initialisation
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, S) token ids, S <= n_ctx -> (B, S, vocab_size) next-token logits."""
        return self.lm_head(self.transformer(input_ids))


def gpt2_small() -> GPT:
    """GPT-2 small: 12 layers, d=768, 12 heads; 124.4 M parameters (tied)."""
    return GPT(GPT2_SMALL)


def gpt2_medium() -> GPT:
    """GPT-2 medium: 24 layers, d=1024, 16 heads; 354.8 M parameters (tied)."""
    return GPT(GPT2_MEDIUM)


def gpt2_xl() -> GPT:
    """GPT-2 XL: 48 layers, d=1600, 25 heads; 1557.6 M parameters (tied)."""
    return GPT(GPT2_XL)
