"""Every choosable op gets a measured value from every indicator method: functional GEMMs
(SDPA's qk/av, functional matmuls and linears), nn.MultiheadAttention's sub-ops, repeated
calls of one module. An op the method cannot measure has no value (never a default zero),
is listed in the table's ``unmeasured`` with a reason, and the CLI pins it and says so."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qsync_opt import trace
from qsync_opt.core.precision import Precision
from qsync_opt.documents.schemas import IndicatorTable, ModelGraph
from qsync_opt.indicator import METHODS, indicate
from qsync_opt.indicator.calls import CallCapture

_FUNCTIONAL = '''
import math
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.qkv_w = nn.Parameter(torch.randn(3 * d, d) / math.sqrt(d))
        self.proj = nn.Linear(d, d)
        self.mix = nn.Parameter(torch.randn(d, d) / math.sqrt(d))

    def forward(self, x):
        q, k, v = F.linear(x, self.qkv_w).chunk(3, dim=-1)
        a = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1))
        h = x + self.proj(a.squeeze(1))
        s = torch.matmul(h, h.transpose(-2, -1)).softmax(-1)  # a functional matmul
        h = h + torch.bmm(s, h) @ self.mix                     # bmm, then @ on a parameter
        return h + self.proj(h)                               # the module called again


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.block = Block()
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.block(self.emb(x))
        h = h + self.mha(h, h, h, need_weights=False)[0]
        return self.head(h.mean(1))


def build():
    torch.manual_seed(0)
    return Net(), torch.randn(4, 6, 8)
'''


def _write(tmp_path: Path, text: str, name: str = "fn_model.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return f"{path}:build"


def _check_every_op_measured(graph: ModelGraph, table: IndicatorTable) -> None:
    names = [o.name for o in graph.choosable_ops()]
    assert table.unmeasured == {}
    assert set(table.values) == set(names)
    for o in graph.choosable_ops():
        row = table.values[o.name]
        assert set(row) == set(o.allowed_precisions)
        if table.method == "curv":  # one Hutchinson probe may be clamped at 0: its terms
            assert table.terms is not None and table.terms[o.name][Precision.int8] != [0, 0]
        else:
            assert row[Precision.int8] > 0, (o.name, row)


@pytest.mark.parametrize("method", [m for m in METHODS if m != "random"])
def test_functional_gemms_get_measured_values_from_every_method(tmp_path, method) -> None:
    spec = _write(tmp_path, _FUNCTIONAL)
    graph = trace(spec)
    names = {o.name for o in graph.choosable_ops()}
    # the functional ops are choosable in the graph, under the tracers' names
    assert {"block.qkv_w", "block.sdpa.qk", "block.sdpa.av", "block.matmul", "block.matmul_1",
            "block.mix", "block.proj", "block.proj_1", "mha.in_proj", "mha.qk", "mha.av",
            "mha.out_proj"} <= names
    table = indicate(spec, 2, method, batch=4, cache=False, hutchinson_samples=1)
    _check_every_op_measured(graph, table)
    if method == "qsync":
        # the two calls of one module are two measurements, not one average and one zero
        assert table.values["block.proj"] != table.values["block.proj_1"]


def test_the_capture_names_calls_as_the_tracers_do(tmp_path) -> None:
    from qsync_opt.models.user import load_user_workload

    wl = load_user_workload(_write(tmp_path, _FUNCTIONAL))
    graph = trace(wl)
    names = [o.name for o in graph.choosable_ops()]
    model = wl.build()
    with CallCapture(model, names) as cap:
        wl.forward(model, wl.make_inputs(4, "cpu"))
    assert sorted(cap.calls) == sorted(names)
    assert all(len(cs) == 1 for cs in cap.calls.values())
    assert cap.calls["block.proj_1"][0].weight is model.block.proj.weight


def _hf_file(tmp_path: Path, kind: str) -> str:
    pytest.importorskip("transformers")
    body = {
        "bert": '''
            cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                num_attention_heads=4, intermediate_size=64, max_position_embeddings=16,
                attn_implementation="sdpa")
            model = transformers.BertModel(cfg)
        ''',
        "bert_eager": '''
            cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                num_attention_heads=4, intermediate_size=64, max_position_embeddings=16,
                attn_implementation="eager")
            model = transformers.BertModel(cfg)
        ''',
        "llama": '''
            cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                max_position_embeddings=16)
            model = transformers.LlamaForCausalLM(cfg)
        ''',
    }[kind]
    text = ("import torch\nimport transformers\n\n\ndef build():\n    torch.manual_seed(0)\n"
            + textwrap.indent(textwrap.dedent(body).strip(), "    ")
            + "\n    return model, {'input_ids': torch.randint(0, 64, (2, 8))}\n")
    path = tmp_path / f"hf_{kind}.py"
    path.write_text(text)
    return f"{path}:build"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bert", "bert_eager", "llama"])
@pytest.mark.parametrize("method", ["qsync", "hessian", "curv"])
def test_huggingface_attention_ops_are_measured(tmp_path, kind, method) -> None:
    spec = _hf_file(tmp_path, kind)
    graph = trace(spec)
    attn = [o.name for o in graph.choosable_ops() if o.kind.value == "matmul"]
    assert len(attn) >= 4, attn  # qk and av of two layers
    table = indicate(spec, 1, method, cache=False, hutchinson_samples=1)
    missing = set(table.unmeasured)
    assert missing <= {o.name for o in graph.choosable_ops() if "rotary" in o.name}, missing
    for n in attn:
        if n in missing:
            continue
        if method == "curv":  # one probe may be clamped at 0; its terms are measured
            assert table.terms is not None and table.terms[n][Precision.int8] != [0, 0]
        else:
            assert table.values[n][Precision.int8] > 0, (n, table.values[n])


def test_an_op_no_batch_runs_is_unmeasured_not_zero(tmp_path, capsys) -> None:
    spec = _write(tmp_path, '''
        import torch
        from torch import nn


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
                self.rare = nn.Linear(4, 4)

            def forward(self, x):
                if x.shape[0] == 3:  # the example's batch: the trace takes this path
                    x = self.rare(x)
                return self.b(torch.relu(self.a(x)))


        def build():
            torch.manual_seed(0)
            return Net(), torch.randn(3, 4)
    ''', "rare.py")
    graph = trace(spec)
    assert "rare" in {o.name for o in graph.choosable_ops()}
    table = indicate(spec, 1, "qsync", batch=2, cache=False, graph=graph)
    assert table.values["rare"] == {Precision.fp32: 0.0} and "rare" in table.unmeasured
    assert "did not" in table.unmeasured["rare"] or "no call" in table.unmeasured["rare"]
    assert table.values["a"][Precision.int8] > 0


def test_functional_matmul_forms_match_the_calls() -> None:
    from qsync_opt.indicator.calls import functional_form

    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    for func, args, want in [
        (torch.matmul, (a, b), a @ b),
        (torch.bmm, (a, b), torch.bmm(a, b)),
        (torch.Tensor.__rmatmul__, (b, a), a @ b),
        (torch.einsum, ("bij,bjk->bik", a, b), a @ b),
        (torch.einsum, ("bij,bjk->bik", [a, b]), a @ b),
    ]:
        form = functional_form("matmul", func, args, {})
        assert form is not None
        x, y, bl = form
        assert torch.allclose(bl.f(x, y), want, atol=1e-6)
    inp = torch.randn(2, 3, 5)
    form = functional_form("matmul", torch.baddbmm, (inp, a, b), {"alpha": 2.0})
    assert form is not None and torch.allclose(form[2].f(form[0], form[1]), 2 * (a @ b))
    w = torch.randn(6, 4)
    form = functional_form("linear", F.linear, (a, w), {})
    assert form is not None and torch.allclose(form[2].f(form[0], form[1]), a @ w.t())
    assert functional_form("matmul", torch.matmul, (torch.ones(2, 2, dtype=torch.long),
                                                    torch.ones(2, 2, dtype=torch.long)), {}) \
        is None
    _ = nn  # keeps the import used in the file's model text
