"""The classifier-head pin: the GEMM(s) after the last merge of the residual stream, or none.

A model ending in its residual stream (a backbone, a feature extractor, a bare
``nn.TransformerEncoder``, HuggingFace's ``BertModel``/``LlamaModel``) has no head: every
branch's last GEMM feeds a residual add, and stays choosable. A head after the stream (a
classifier, an LM head) is pinned, over the registry's families, the torch-native patterns,
HuggingFace models and small hand-made cases.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qsync_opt import trace
from qsync_opt.documents.schemas import ModelGraph, OpKind, OpRole
from qsync_opt.graph import HEAD_REASON
from support.patterns import PATTERNS

GEMMS = (OpKind.linear, OpKind.conv, OpKind.matmul)


def _heads(g: ModelGraph) -> list[str]:
    return [o.name for o in g.ops if o.pin_reason == HEAD_REASON]


def _gemms(g: ModelGraph) -> int:
    return sum(1 for o in g.ops if o.kind in GEMMS and o.pin_reason in (None, HEAD_REASON))


def _encoder(layers: int = 2) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


class _WithHead(nn.Module):
    def __init__(self, body: nn.Module, dim: int, classes: int = 3) -> None:
        super().__init__()
        self.body, self.head = body, nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean(dim=1))


@pytest.mark.parametrize("method", ["auto", "function_mode"])
def test_a_transformer_encoder_backbone_has_no_head(method: str) -> None:
    x = torch.randn(2, 5, 32)
    g = trace(_encoder(), example_inputs=x, method=method)
    assert _heads(g) == []
    assert len(g.choosable_ops()) == 12  # in_proj, qk, av, out_proj, linear1, linear2 x 2
    assert {"layers.1.self_attn.out_proj", "layers.1.linear2"} <= {
        o.name for o in g.choosable_ops()}
    g2 = trace(_WithHead(_encoder(), 32), example_inputs=x, method=method)
    assert _heads(g2) == ["head"] and len(g2.choosable_ops()) == 12


def test_a_head_pin_is_undone_by_pin_head_false_and_every_gemm_is_counted_once() -> None:
    x = torch.randn(2, 5, 32)
    g = trace(_WithHead(_encoder(), 32), example_inputs=x, pin_head=False)
    assert _heads(g) == [] and len(g.choosable_ops()) == 13


class _Swish(nn.Module):
    """The last GEMM's output gated by itself (no merge: both inputs come from it)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.fc = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(torch.relu(self.a(x)))
        return h * torch.sigmoid(h)


class _ResidualAtTheEnd(nn.Module):
    """A residual block after the last projection: the stream's last merge is the output."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.fc = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = torch.relu(self.proj(x))
        return r + self.fc(r)


class _Gated(nn.Module):
    """Squeeze-excitation style gate at the end: the gate's GEMM and the gated one merge."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.gate = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * torch.sigmoid(self.gate(x))


class _MaskedLogits(nn.Module):
    """A head whose logits are masked by an input (no gradient: not a merge)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.body(x))).masked_fill(mask, -1e4) * (mask.float() + 1)


class _TwoHeads(nn.Module):
    """Two heads side by side (QA's start and end, multi-task): both are heads."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.h1, self.h2 = nn.Linear(8, 8), nn.Linear(8, 2), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.body(x))
        return self.h1(h), self.h2(h)


_CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[torch.Tensor, ...]],
                        list[str]]] = {
    "swish": (_Swish, lambda: (torch.randn(2, 8),), ["fc"]),
    "residual at the end": (_ResidualAtTheEnd, lambda: (torch.randn(2, 8),), []),
    "gated": (_Gated, lambda: (torch.randn(2, 8),), []),
    "masked logits": (_MaskedLogits,
                      lambda: (torch.randn(2, 8), torch.rand(2, 4) > 0.5), ["head"]),
    "two heads": (_TwoHeads, lambda: (torch.randn(2, 8),), ["h1", "h2"]),
}


@pytest.mark.parametrize("case", sorted(_CASES))
@pytest.mark.parametrize("method", ["fx", "function_mode"])
def test_heads_of_small_patterns(case: str, method: str) -> None:
    build, inputs, want = _CASES[case]
    g = trace(build(), example_inputs=inputs(), method=method)
    assert _heads(g) == want


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_patterns_pin_their_classifier_and_their_backbones_pin_nothing(name: str) -> None:
    model, ex = PATTERNS[name]()
    g = trace(model, example_inputs=ex)
    heads = _heads(g)
    assert len(heads) == 1 and g.op(heads[0]).kind == OpKind.linear
    # The same model without its classifier (the top-level child holding it: a classifier
    # MLP goes whole): a feature extractor, every GEMM choosable.
    top = heads[0].split(".")[0]
    setattr(model, top, nn.Identity())
    g2 = trace(model, example_inputs=ex)
    assert _heads(g2) == []
    assert all(o.role == OpRole.choosable for o in g2.ops if o.kind in GEMMS)
    kept = [o.name for o in g.choosable_ops() if not o.name.startswith(top + ".")]
    assert [o.name for o in g2.choosable_ops()] == kept


@pytest.mark.parametrize("name,head", [
    ("digits_cnn", "fc2"), ("digits_resnet", "fc"), ("resnet18_32", "fc"),
    ("tiny_gpt", "lm_head"), ("vgg16_bn", "classifier.6"),
    pytest.param("resnet50", "fc", marks=pytest.mark.slow),
    pytest.param("vit_b16", "heads.head", marks=pytest.mark.slow),
    pytest.param("bert_base", "qa_outputs", marks=pytest.mark.slow),
    pytest.param("gpt2_small", "lm_head", marks=pytest.mark.slow),
])
def test_registry_families_pin_only_their_head(name: str, head: str) -> None:
    g = trace(name, batch=2)
    assert _heads(g) == [head]
    assert all(o.role == OpRole.choosable for o in g.ops
               if o.kind in GEMMS and o.name != head and o.pin_reason is None)


def _hf_models() -> dict[str, Callable[[], tuple[nn.Module, dict[str, torch.Tensor], list[str]]]]:
    transformers = pytest.importorskip("transformers")

    def bert(head: bool) -> tuple[nn.Module, dict[str, torch.Tensor], list[str]]:
        cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=64,
                                      max_position_embeddings=16, num_labels=3)
        torch.manual_seed(0)
        cls = transformers.BertForSequenceClassification if head else transformers.BertModel
        ids = torch.randint(0, 64, (2, 8))
        kw = {"input_ids": ids, "attention_mask": torch.ones(2, 8, dtype=torch.long)}
        # BertModel ends in its pooler (a Linear and tanh after the stream): that is a head
        # of the pooled output, and the classifier after it another
        return cls(cfg).eval(), kw, (["classifier"] if head else ["pooler.dense"])

    def llama(head: bool) -> tuple[nn.Module, dict[str, torch.Tensor], list[str]]:
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=64, max_position_embeddings=16)
        torch.manual_seed(0)
        cls = transformers.LlamaForCausalLM if head else transformers.LlamaModel
        return cls(cfg).eval(), {"input_ids": torch.randint(0, 64, (2, 8))}, (
            ["lm_head"] if head else [])

    return {"bert": lambda: bert(False), "bert+cls": lambda: bert(True),
            "llama": lambda: llama(False), "llama+lm": lambda: llama(True)}


@pytest.mark.parametrize("name", ["bert", "bert+cls", "llama", "llama+lm"])
def test_huggingface_backbones_keep_their_gemms_and_heads_are_pinned(name: str) -> None:
    model, kw, want = _hf_models()[name]()
    g = trace(model, example_inputs=kw)
    assert _heads(g) == want
    # every layer's attention output and MLP output projection stays choosable
    names = {o.name for o in g.choosable_ops()}
    last = "encoder.layer.1.output.dense" if name.startswith("bert") else \
        "layers.1.mlp.down_proj"
    assert any(n.endswith(last) for n in names), sorted(names)
