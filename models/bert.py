"""BERT-base for extractive question answering (SQuAD style), in plain torch.

Structure and attribute names follow HuggingFace ``BertForQuestionAnswering``
(without a pooler)::

    bert.embeddings.{word_embeddings, position_embeddings, token_type_embeddings, LayerNorm, dropout}
    bert.encoder.layer.{i}.attention.self.{query, key, value, qk_matmul, av_matmul, dropout}
    bert.encoder.layer.{i}.attention.output.{dense, LayerNorm, dropout}
    bert.encoder.layer.{i}.intermediate.{dense, intermediate_act_fn}
    bert.encoder.layer.{i}.output.{dense, LayerNorm, dropout}
    qa_outputs

Each encoder layer holds exactly 6 ``nn.Linear`` (query, key, value,
attention output dense, intermediate dense, output dense) and 2
:class:`~.layers.MatMul` (``qk_matmul`` for ``Q @ K^T``, ``av_matmul`` for
``P @ V``); BERT-base therefore has 72 encoder ``nn.Linear`` + ``qa_outputs``
and 24 ``MatMul``.  Post-LN residual blocks, exact (erf) GELU, LayerNorm eps
1e-12.  There is no attention-mask argument: every token is attended to, which
keeps the model symbolically traceable with ``torch.fx``.
Parameter count (bert_base with the 2-way QA head): 108,893,186.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from qsync_opt.models.layers import MatMul
from torch import nn

__all__ = ["BertConfig", "BertForQuestionAnswering", "bert_base"]


@dataclass(frozen=True)
class BertConfig:
    """Hyper-parameters of a BERT encoder."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02


class BertEmbeddings(nn.Module):
    """Sum of word, position and token-type embeddings, then LayerNorm and dropout."""

    position_ids: torch.Tensor  # a buffer (register_buffer)

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.register_buffer(
            "position_ids",
            torch.arange(config.max_position_embeddings).unsqueeze(0),
            persistent=False,
        )

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        seq_len = input_ids.size(1)
        # Tensor.narrow (not [:, :seq_len]) so torch.fx can trace the slice of a buffer.
        position_ids = self.position_ids.narrow(1, 0, seq_len)
        embeddings = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(position_ids)
            + self.token_type_embeddings(token_type_ids)
        )
        return self.dropout(self.LayerNorm(embeddings))


class BertSelfAttention(nn.Module):
    """Multi-head self-attention with separate query/key/value projections."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        if config.hidden_size % config.num_attention_heads != 0:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = config.hidden_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.qk_matmul = MatMul()
        self.av_matmul = MatMul()
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        self.scale = 1.0 / math.sqrt(self.attention_head_size)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        # (B, S, H*D) -> (B, H, S, D)
        return x.unflatten(-1, (self.num_attention_heads, self.attention_head_size)).transpose(1, 2)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q = self._split_heads(self.query(hidden_states))
        k = self._split_heads(self.key(hidden_states))
        v = self._split_heads(self.value(hidden_states))
        scores = self.qk_matmul(q, k.transpose(-1, -2)) * self.scale
        probs = self.dropout(torch.softmax(scores, dim=-1))
        context = self.av_matmul(probs, v)  # (B, H, S, D)
        return context.transpose(1, 2).flatten(2)  # (B, S, H*D)


class BertSelfOutput(nn.Module):
    """Attention output projection, dropout, residual add and post-LayerNorm."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        hidden_states = self.dropout(self.dense(hidden_states))
        return self.LayerNorm(hidden_states + input_tensor)


class BertAttention(nn.Module):
    """Self-attention (``self``) followed by its output block (``output``)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(hidden_states), hidden_states)


class BertIntermediate(nn.Module):
    """FFN up-projection with GELU."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = nn.GELU()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.intermediate_act_fn(self.dense(hidden_states))


class BertOutput(nn.Module):
    """FFN down-projection, dropout, residual add and post-LayerNorm."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        hidden_states = self.dropout(self.dense(hidden_states))
        return self.LayerNorm(hidden_states + input_tensor)


class BertLayer(nn.Module):
    """One post-LN transformer encoder layer."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        attention_output = self.attention(hidden_states)
        return self.output(self.intermediate(attention_output), attention_output)


class BertEncoder(nn.Module):
    """Stack of :class:`BertLayer` in ``layer`` (an ``nn.ModuleList``)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states)
        return hidden_states


class BertModel(nn.Module):
    """BERT embeddings + encoder (no pooler)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embeddings(input_ids, token_type_ids))


class BertForQuestionAnswering(nn.Module):
    """BERT with a span-prediction head.

    ``forward(input_ids, token_type_ids)`` takes two (B, S) int64 tensors and
    returns one (B, S, 2) logits tensor: ``[..., 0]`` are start logits and
    ``[..., 1]`` end logits (not split inside ``forward``).
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        """(B, S) token ids and (B, S) segment ids -> (B, S, 2) start/end logits."""
        return self.qa_outputs(self.bert(input_ids, token_type_ids))


def bert_base() -> BertForQuestionAnswering:
    """BERT-base (12 layers, hidden 768, 12 heads, FFN 3072) with a 2-way QA head."""
    return BertForQuestionAnswering(BertConfig())
