"""Real models end to end: every GEMM a model runs is an op the planner sees, and the runtime
runs exactly those ops at their planned precisions.

Covers HuggingFace GPT-2 / BERT (from configs, random weights, no downloads), the
torch-native patterns of torchvision / timm / Swin code (tests/support/patterns.py),
nn.MultiheadAttention in its variants, F.scaled_dot_product_attention and functional linears.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qsync_opt import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.documents.schemas import ModelGraph, OpKind, OpRole
from qsync_opt.graph import is_conv1d_like, trace, unseen_ops
from qsync_opt.ops.dispatch import mha_forward, sdpa_forward
from qsync_opt.runtime import apply_plan, apply_precisions, count_calls
from support.patterns import PATTERNS, vit_mha

GEMM_KINDS = (OpKind.linear, OpKind.matmul, OpKind.conv)
MIX = [Precision.int8, Precision.bf16, Precision.fp16, Precision.fp32, Precision.fp8,
       Precision.int8_full]


def _choosable(g: ModelGraph) -> list[str]:
    return [o.name for o in g.ops if o.role == OpRole.choosable]


def _gemm_flops(g: ModelGraph) -> int:
    return sum(o.fwd_flops for o in g.ops if o.kind in GEMM_KINDS)


def _mixed(g: ModelGraph) -> dict[str, Precision]:
    """int8 / bf16 / fp16 / fp32 / fp8 / int8_full spread over the choosable ops (each op
    gets one its menu allows)."""
    out: dict[str, Precision] = {}
    tied: dict[str, Precision] = {}
    for i, o in enumerate(o for o in g.ops if o.role == OpRole.choosable):
        menu = [p for p in MIX if p in o.allowed_precisions]
        out[o.name] = menu[i % len(menu)]
        if o.tie_group:  # one decision per tie group (a module called twice)
            out[o.name] = tied.setdefault(o.tie_group, out[o.name])
    return out


def _run(model: nn.Module, inputs: tuple[Any, ...]) -> torch.Tensor:
    out = model(*inputs)
    return out.logits if hasattr(out, "logits") else out


def _check_counts(g: ModelGraph, plan: dict[str, Precision], counts: dict[str, dict[str, int]],
                  calls: int = 1) -> None:
    """Every planned op ran ``calls`` times at exactly its precision; every other GEMM of the
    graph at fp32; nothing ran that the graph does not have."""
    gemms = [o.name for o in g.ops if o.kind in GEMM_KINDS]
    wrong = {n: (plan.get(n, Precision.fp32).value, counts.get(n)) for n in gemms
             if counts.get(n) != {plan.get(n, Precision.fp32).value: calls}}
    assert not wrong, wrong
    assert set(counts) <= set(gemms), set(counts) - set(gemms)


def _gpt2(n_layer: int = 2, **kw: Any) -> Any:
    transformers = pytest.importorskip("transformers")
    cfg = dict(n_layer=n_layer, n_embd=64, n_head=4, n_positions=64, vocab_size=128,
               bos_token_id=0, eos_token_id=0)
    cfg.update(kw)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg))


# ----------------------------------------------------------------------------- full-size counts


def test_hf_gpt2_small_has_the_builtin_gpt2_small_gemms_and_flops() -> None:
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    ids = torch.zeros(1, 1024, dtype=torch.long, device="meta")
    hf = trace(model, example_inputs=(ids,))
    ours = trace("gpt2_small", batch=1)
    assert len(_choosable(hf)) == len(_choosable(ours)) == 72
    assert abs(_gemm_flops(hf) / _gemm_flops(ours) - 1) < 0.02
    total = [sum(o.fwd_flops for o in g.ops) for g in (hf, ours)]
    assert abs(total[0] / total[1] - 1) < 0.02
    assert hf.param_count == ours.param_count
    kinds = {o.name: o.kind for o in hf.ops}
    assert kinds["transformer.h.0.attn.c_attn"] == OpKind.linear  # transformers' Conv1D
    c_fc = next(o for o in hf.ops if o.name == "transformer.h.0.mlp.c_fc")
    assert c_fc.weight_shape == [3072, 768]  # reported as Linear's (out, in)
    assert kinds["transformer.h.0.attn.sdpa.qk"] == kinds["transformer.h.0.attn.sdpa.av"] \
        == OpKind.matmul
    assert unseen_ops(hf) == []


def test_a_vit_on_multihead_attention_has_vit_b16s_ops() -> None:
    with torch.device("meta"):
        model, (x,) = vit_mha(batch=1, full=True)
    g = trace(model, example_inputs=(x,))
    ours = trace("vit_b16", batch=1)
    assert len(_choosable(g)) == len(_choosable(ours)) == 73
    assert abs(_gemm_flops(g) / _gemm_flops(ours) - 1) < 0.02
    assert g.param_count == ours.param_count
    names = set(_choosable(g))
    blk = "layers.encoder_layer_3.self_attention"
    assert {f"{blk}.in_proj", f"{blk}.qk", f"{blk}.av", f"{blk}.out_proj"} <= names
    assert unseen_ops(g) == []


# ----------------------------------------------------------------------------- patterns


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_patterns_are_fully_seen_and_both_tracers_name_them_alike(name: str) -> None:
    model, ex = PATTERNS[name]()
    fx = trace(model, example_inputs=ex, method="fx")
    fm = trace(model, example_inputs=ex, method="function_mode")
    assert _choosable(fx) == _choosable(fm)
    assert [o.name for o in fx.ops if o.kind in GEMM_KINDS] == \
        [o.name for o in fm.ops if o.kind in GEMM_KINDS]
    assert _gemm_flops(fx) == _gemm_flops(fm)
    assert unseen_ops(fx) == unseen_ops(fm) == []
    n_convs = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    n_lin = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert len([o for o in fm.ops if o.kind in GEMM_KINDS]) >= n_convs + n_lin


def test_functional_linears_are_named_by_their_parameter_and_matmuls_by_scope() -> None:
    model, ex = PATTERNS["swin_like"]()
    g = trace(model, example_inputs=ex, method="function_mode")
    by = {o.name: o for o in g.ops}
    qkv = by["blocks.1.attn.qkv_w"]
    assert qkv.kind == OpKind.linear and qkv.role == OpRole.choosable
    assert qkv.weight_shape == [96, 32] and qkv.param_count == 96 * 32 + 96
    assert by["blocks.1.attn.matmul"].kind == by["blocks.1.attn.matmul_1"].kind == OpKind.matmul
    assert by["blocks.0.fc2_w"].fwd_flops == 2 * 2 * 8 * 8 * 32 * 128


def test_sdpa_sub_ops_carry_flops_bytes_and_measured_saved_activations() -> None:
    class Attn(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    B, H, L, S, E = 2, 3, 5, 5, 8
    q, k, v = (torch.randn(B, H, n, E, requires_grad=True) for n in (L, S, S))
    for method in ("fx", "function_mode"):
        g = trace(Attn(), example_inputs=(q, k, v), method=method, pin_head=False)
        by = {o.name: o for o in g.ops}
        qk, av, sm = by["sdpa.qk"], by["sdpa.av"], by["sdpa.softmax"]
        assert qk.role == av.role == OpRole.choosable and sm.role == OpRole.pinned
        assert qk.fwd_flops == av.fwd_flops == 2 * B * H * L * S * E
        assert qk.saved_bytes == 2 * B * H * L * E * 4  # q and k^T, as the runtime saves them
        assert sm.saved_bytes == B * H * L * S * 4  # the probabilities
        assert qk.fwd_bytes > 0 and ("sdpa.qk", "sdpa.scale") in {(e.src, e.dst) for e in g.edges}


@pytest.mark.parametrize("kw", [
    {}, {"is_causal": True}, {"scale": 0.3}, {"mask": "bool"}, {"mask": "float"},
])
def test_sdpa_decomposition_computes_what_sdpa_does(kw: dict[str, Any]) -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8)
    args = dict(kw)
    mask = args.pop("mask", None)
    if mask == "bool":
        args["attn_mask"] = torch.rand(4, 6) > 0.3
        args["attn_mask"][:, 0] = True
    elif mask == "float":
        args["attn_mask"] = torch.randn(2, 1, 4, 6)
    ref = F.scaled_dot_product_attention(q, k, v, **args)
    got = sdpa_forward(lambda s, kind, fn, *a, **k2: fn(*a, **k2), q, k, v, **args)
    assert torch.allclose(got, ref, atol=1e-5)


# ----------------------------------------------------------------------------- MHA variants


def _identity_step(suffix: str, kind: OpKind, fn: Callable[..., Any], *a: Any, **k: Any) -> Any:
    return fn(*a, **k)


_MHA_CASES = {
    "self batch_first no weights": dict(batch_first=True, need_weights=False),
    "self seq-first weights": dict(batch_first=False, need_weights=True),
    "self per-head weights": dict(batch_first=True, need_weights=True, average=False),
    "bool attn mask + padding": dict(batch_first=True, attn_mask="bool", kpm=True),
    "float attn mask": dict(batch_first=False, attn_mask="float"),
    "causal": dict(batch_first=True, attn_mask="causal", is_causal=True, need_weights=False),
    "cross, key is value": dict(batch_first=True, cross="kv"),
    "cross, three inputs": dict(batch_first=False, cross="qkv"),
    "kdim/vdim differ": dict(batch_first=True, cross="qkv", kdim=6, vdim=10),
    "unbatched": dict(batch_first=True, unbatched=True),
}


def _mha_case(case: dict[str, Any]) -> tuple[nn.MultiheadAttention, tuple[Any, ...],
                                             dict[str, Any]]:
    torch.manual_seed(0)
    E, B, L, S = 16, 3, 5, 7
    bf = case.get("batch_first", True)
    mha = nn.MultiheadAttention(E, 4, batch_first=bf, kdim=case.get("kdim"),
                                vdim=case.get("vdim"))

    def x(n: int, d: int = E) -> torch.Tensor:
        if case.get("unbatched"):
            return torch.randn(n, d)
        return torch.randn(B, n, d) if bf else torch.randn(n, B, d)

    q = x(L)
    cross = case.get("cross")
    if cross is None:
        k = v = q
        S = L
    elif cross == "kv":
        k = v = x(S)
    else:
        k, v = x(S, case.get("kdim") or E), x(S, case.get("vdim") or E)
    kw: dict[str, Any] = {"need_weights": case.get("need_weights", True)}
    if "average" in case:
        kw["average_attn_weights"] = case["average"]
    if case.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(L, S) > 0.7
    elif case.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(B * 4, L, S)
    elif case.get("attn_mask") == "causal":
        kw["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(L)
        kw["is_causal"] = True
    if case.get("kpm"):
        pad = torch.zeros(B, S, dtype=torch.bool)
        pad[0, -2:] = True
        kw["key_padding_mask"] = pad
    return mha, (q, k, v), kw


@pytest.mark.parametrize("case", sorted(_MHA_CASES))
def test_multihead_attention_decomposes_exactly_and_runs_its_plan(case: str) -> None:
    mha, qkv, kw = _mha_case(_MHA_CASES[case])
    ref_out, ref_w = mha(*qkv, **kw)
    out, w = mha_forward(_identity_step, mha, *qkv, **kw)
    assert torch.allclose(out, ref_out, atol=1e-5)
    assert (w is None) == (ref_w is None) and (w is None or torch.allclose(w, ref_w, atol=1e-6))

    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = mha
            self.masks = [n for n, t in kw.items() if isinstance(t, torch.Tensor)]
            for n in self.masks:  # buffers: the tracers run them on meta with the model
                self.register_buffer(n, kw[n])

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            args = {**kw, **{n: getattr(self, n) for n in self.masks}}
            return self.attn(q, k, v, **args)[0]

    model = Wrap()
    q, k, v = qkv
    ex = (q, k, v)
    g = trace(model, example_inputs=ex, method="function_mode", pin_head=False)
    fx = trace(model, example_inputs=ex, method="fx", pin_head=False)
    assert _choosable(fx) == _choosable(g)
    assert [o.fwd_flops for o in fx.ops if o.kind in GEMM_KINDS] == \
        [o.fwd_flops for o in g.ops if o.kind in GEMM_KINDS]
    names = _choosable(g)
    assert names[-3:] == ["attn.qk", "attn.av", "attn.out_proj"]
    assert names[0] in ("attn.in_proj", "attn.q_proj")
    assert not [o for o in g.ops if o.kind == OpKind.other]
    plan = {n: p for n, p in zip(names, [Precision.int8, Precision.bf16, Precision.fp16,
                                         Precision.int8_full, Precision.bf16], strict=False)}
    apply_precisions(model, plan, seed=3)
    with count_calls(model) as counts:
        got = model(*ex)
        got.sum().backward()
    _check_counts(g, plan, counts)
    assert ((got - ref_out).norm() / ref_out.norm()) < 0.1
    assert all(p.grad is not None for p in mha.parameters())


def test_an_all_fp32_multihead_attention_takes_torchs_own_path() -> None:
    mha, qkv, kw = _mha_case(_MHA_CASES["self batch_first no weights"])
    holder = nn.Sequential(mha)
    ref = mha(*qkv, **kw)[0]
    apply_precisions(holder, {"0.in_proj": "fp32", "0.qk": "fp32"})
    with count_calls(holder) as counts:
        out = holder[0](*qkv, **kw)[0]
    assert torch.equal(out, ref)
    assert counts == {f"0.{s}": {"fp32": 1} for s in ("in_proj", "qk", "av", "out_proj")}


# ----------------------------------------------------------------------------- plans applied


def _apply_mixed(model: nn.Module, ex: tuple[Any, ...], method: str = "auto"
                 ) -> tuple[ModelGraph, dict[str, Precision]]:
    from qsync_opt import load_cluster
    from qsync_opt.problem.plan import make_plan

    g = trace(model, example_inputs=ex, method=method)
    plan = _mixed(g)
    doc = make_plan(g, load_cluster("h100x1"), {"h100": plan})
    apply_plan(model, doc, "h100", graph=g, seed=1)
    return g, plan


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_a_mixed_plan_runs_every_op_at_its_precision_and_no_other(name: str) -> None:
    torch.manual_seed(0)
    model, ex = PATTERNS[name]()
    ref = model(*ex).detach()
    g, plan = _apply_mixed(model, ex)
    assert {p for p in plan.values()} >= {Precision.int8, Precision.bf16, Precision.fp16,
                                          Precision.fp32}
    with count_calls(model) as counts:
        out = model(*ex)
        out.sum().backward()
        model(*ex)  # a second forward: the same names again (counters reset per forward)
    _check_counts(g, plan, counts, calls=2)
    assert ((out - ref).norm() / ref.norm()) < 0.15
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


def test_a_mixed_plan_on_hf_gpt2_runs_every_op_at_its_precision() -> None:
    torch.manual_seed(0)
    model = _gpt2()
    ids = torch.randint(0, 128, (2, 16))
    model.eval()
    ref = _run(model, (ids,)).detach()
    g, plan = _apply_mixed(model, (ids,))
    assert len(_choosable(g)) == 12
    with count_calls(model) as counts:
        out = _run(model, (ids,))
        out.sum().backward()
    _check_counts(g, plan, counts)
    assert ((out - ref).norm() / ref.norm()) < 0.1
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


def test_hf_bert_sdpa_attention_is_seen_and_dispatched() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                  intermediate_size=128, vocab_size=128)
    model = transformers.BertForQuestionAnswering(cfg)
    ids = torch.randint(0, 128, (2, 12))
    g = trace(model, example_inputs=(ids,))
    names = _choosable(g)
    assert len(names) == 2 * 8  # q, k, v, qk, av, output.dense, intermediate, output
    assert "bert.encoder.layer.1.attention.self.sdpa.qk" in names
    plan = {n: Precision.bf16 if "sdpa" in n else Precision.int8 for n in names}
    apply_precisions(model, plan)
    with count_calls(model) as counts:
        out = model(ids)
        (out.start_logits.sum() + out.end_logits.sum()).backward()
    _check_counts(g, plan, counts)


def test_apply_refuses_a_plan_naming_an_op_the_model_lacks() -> None:
    from qsync_opt import load_cluster
    from qsync_opt.problem.plan import make_plan

    model, ex = PATTERNS["swin_like"]()
    g = trace(model, example_inputs=ex)
    doc = make_plan(g, load_cluster("h100x1"), {})
    for bad in ("blocks.0.attn.nope_w", "blocks.9.attn.matmul", "blocks.0.attn.qkv_w.qk",
                "blocks.0.attn.matmul.qk", "blocks.0.norm1.sdpa_x.av"):
        doc.groups["h100"].precisions[bad] = Precision.int8
        with pytest.raises(QsyncInputError, match=f"lacks the planned ops {bad}"):
            apply_plan(model, doc, "h100")
        del doc.groups["h100"].precisions[bad]
    vit, vex = vit_mha()
    with pytest.raises(QsyncInputError, match="no module named 'layers.encoder_layer_0"
                                              ".self_attention.kk'"):
        apply_precisions(vit, {"layers.encoder_layer_0.self_attention.kk": "int8"})


def test_a_planned_functional_op_no_forward_runs_is_named_in_a_warning(caplog) -> None:
    # Names are checked against the model's structure when the plan is applied; a call
    # that could exist there but never runs (no SDPA in this scope) is found by the first
    # forward.
    model, ex = PATTERNS["swin_like"]()
    apply_precisions(model, {"blocks.0.attn.sdpa.qk": "int8", "blocks.0.attn.matmul": "bf16"})
    with caplog.at_level(logging.WARNING, logger="qsync_opt.ops.dispatch"):
        model(*ex)
        model(*ex)
    assert caplog.text.count("did not run") == 1
    assert "1 planned op(s)" in caplog.text and "blocks.0.attn.sdpa.qk" in caplog.text


def test_a_deep_copy_of_an_applied_model_dispatches_on_its_own() -> None:
    import copy

    model, ex = PATTERNS["swin_like"]()
    g = trace(model, example_inputs=ex)
    plan = _mixed(g)
    apply_precisions(model, plan)
    twin = copy.deepcopy(model)
    with count_calls(twin) as counts:
        twin(*ex)
    _check_counts(g, plan, counts)


def test_ops_inside_swapped_layers_are_not_dispatched_again() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(self.lin(x), self.w) @ self.w

    model = Model()
    x = torch.randn(3, 8)
    g = trace(model, example_inputs=(x,), method="function_mode", pin_head=False)
    assert _choosable(g) == ["lin", "w", "w_1"]
    plan = {"lin": Precision.int8, "w": Precision.bf16, "w_1": Precision.fp16}
    apply_precisions(model, plan)
    with count_calls(model) as counts:
        model(x)
    assert counts == {"lin": {"int8": 1}, "w": {"bf16": 1}, "w_1": {"fp16": 1}}
    apply_precisions(model, {"lin": Precision.int8})  # a new plan replaces the dispatcher
    with count_calls(model) as counts:
        model(x)
    assert counts == {"lin": {"int8": 1}, "w": {"fp32": 1}, "w_1": {"fp32": 1}}


# ----------------------------------------------------------------------------- new layers


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D, as it is written there (weight (nx, nf))."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


_LAYERS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
    "Conv1D (HF)": lambda: (Conv1D(12, 20), torch.randn(3, 5, 20)),
    "Conv1d": lambda: (nn.Conv1d(6, 8, 3, padding=1), torch.randn(2, 6, 11)),
    "Conv1d same, grouped": lambda: (nn.Conv1d(6, 6, 3, padding="same", groups=3),
                                     torch.randn(2, 6, 9)),
    "MultiheadAttention": lambda: (nn.MultiheadAttention(16, 2, batch_first=True),
                                   torch.randn(2, 5, 16)),
}
_BOUNDS = {Precision.bf16: 0.03, Precision.fp16: 0.01, Precision.int8: 0.08,
           Precision.int8_full: 0.08, Precision.fp8: 0.15}


@pytest.mark.parametrize("precision", sorted(_BOUNDS, key=lambda p: p.value))
@pytest.mark.parametrize("layer", sorted(_LAYERS))
def test_new_layers_stay_close_to_fp32_and_pass_gradients(layer: str,
                                                           precision: Precision) -> None:
    torch.manual_seed(0)
    mod, x = _LAYERS[layer]()
    mha = isinstance(mod, nn.MultiheadAttention)
    holder = nn.Sequential(mod)

    def run() -> torch.Tensor:
        return mod(x, x, x, need_weights=False)[0] if mha else mod(x)

    ref = run().detach()
    plan = ({f"0.{s}": precision for s in ("in_proj", "qk", "av", "out_proj")} if mha
            else {"0": precision})
    if precision == Precision.fp8 and "Conv1d" in layer:
        return  # no fp8 convolutions (CONV_PRECISIONS)
    apply_precisions(holder, plan)
    with count_calls(holder) as counts:
        out = run()
        out.sum().backward()
    assert counts == {n: {precision.value: 1} for n in plan}
    assert ((out - ref).norm() / ref.norm()).item() < _BOUNDS[precision]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in mod.parameters())
    assert out.dtype == torch.float32 and mod.state_dict().keys() == _LAYERS[layer]()[0]\
        .state_dict().keys()


def test_conv1d_like_is_found_by_duck_typing() -> None:
    assert is_conv1d_like(Conv1D(4, 3))
    odd = Conv1D(4, 3)
    odd.nf = 5  # weight (3, 4) but nf 5: not the transposed Linear it claims
    assert not is_conv1d_like(odd)
    g = trace(nn.Sequential(Conv1D(4, 3), nn.ReLU()), example_inputs=(torch.randn(2, 3),))
    op = g.ops[0]
    assert op.kind == OpKind.linear and op.weight_shape == [4, 3] and op.fwd_flops == 2 * 8 * 3


# ----------------------------------------------------------------------------- the warning


def test_other_ops_holding_over_one_percent_are_named_in_a_warning(caplog) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Bilinear(8, 8, 8), nn.Linear(8, 2))

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.m[0](x)
            return self.m[2](self.m[1](h, h))

    with caplog.at_level(logging.WARNING, logger="qsync_opt.graph"):
        g = trace(Two(), example_inputs=(torch.randn(4, 8),))
    lines = unseen_ops(g)
    assert len(lines) == 1 and lines[0].startswith("m.1 (torch.nn.modules.linear.Bilinear)")
    assert "m.1 (torch.nn.modules.linear.Bilinear)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qsync_opt.graph"):
        trace(PATTERNS["timm_vit"]()[0], example_inputs=PATTERNS["timm_vit"]()[1])
    assert "cannot see inside" not in caplog.text


def test_cli_graph_names_the_ops_it_cannot_see_inside(tmp_path: Any) -> None:
    from support.harness import run_cli

    f = tmp_path / "opaque.py"
    f.write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Opaque(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.w = nn.Parameter(torch.randn(64, 64))\n"
        "    def forward(self, x):\n        return torch.tensordot(x, self.w, dims=([1], [0]))\n\n"
        "def build():\n"
        "    return nn.Sequential(nn.Linear(64, 64), Opaque(), nn.Linear(64, 10)), torch.randn(8, 64)\n")
    code, out, _ = run_cli("graph", "--model", f"{f}:build")
    assert code == 0
    unseen = [line for line in out.splitlines() if line.strip().startswith("unseen")]
    assert len(unseen) == 1 and "1.tensordot" in unseen[0] and "of the parameters" in unseen[0]
    code, out, _ = run_cli("graph", "--model", "digits_cnn")
    assert code == 0 and "unseen" not in out


def test_gemms_the_runtime_cannot_lower_are_pinned_not_offered() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c3 = nn.Conv3d(2, 2, 1)
            self.w = nn.Parameter(torch.randn(2, 2, 1, 1))
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = F.conv2d(self.c3(x).flatten(1, 2), self.w.repeat(1, 2, 1, 1))
            return self.lin(y.mean(dim=(2, 3)))

    g = trace(M(), example_inputs=(torch.randn(1, 2, 2, 3, 3),), pin_head=False)
    by = {o.name: o for o in g.ops}
    assert by["c3"].role == OpRole.pinned and "Conv3d" in by["c3"].pin_reason
    conv = next(o for o in g.ops if o.kind == OpKind.conv and o.name != "c3")
    assert conv.role == OpRole.pinned and "functional convolution" in conv.pin_reason
    assert _choosable(g) == ["lin"]


def test_torch_transformer_encoder_is_traced_through_and_runs_its_plan() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                          nn.Linear(32, 5))
    x = torch.randn(2, 6, 32)
    ref = model(x).detach()
    g, plan = _apply_mixed(model, (x,))
    names = _choosable(g)
    assert len(names) == 2 * 6 and "0.layers.1.self_attn.qk" in names
    assert unseen_ops(g) == []
    with count_calls(model) as counts:
        out = model(x)
        out.sum().backward()
    _check_counts(g, plan, counts)
    assert ((out - ref).norm() / ref.norm()) < 0.15


def test_a_module_called_twice_runs_both_planned_calls_at_its_precision() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.head = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.lin(torch.relu(self.lin(x))))

    model = Twice()
    x = torch.randn(3, 8)
    g, plan = _apply_mixed(model, (x,))  # the planned ops lin and lin_1 are one layer
    assert _choosable(g) == ["lin", "lin_1"] and plan["lin"] == plan["lin_1"]
    with count_calls(model) as counts:
        model(x)
    assert counts == {"lin": {plan["lin"].value: 2}, "head": {"fp32": 1}}
    with pytest.raises(QsyncInputError, match="lin_1: a repeated call of module lin"):
        apply_precisions(model, {"lin": "int8", "lin_1": "bf16"})


@pytest.mark.parametrize("which", ["mha", "sdpa"])
def test_the_graph_saves_what_the_decomposed_attention_saves(which: str) -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True, dropout=0.1)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = mha

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if which == "mha":
                return self.attn(x, x, x, need_weights=False)[0]
            q = x.unflatten(-1, (4, 4)).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)

    model = M().train()
    x = torch.randn(2, 5, 16, requires_grad=True)
    g = trace(model, example_inputs=(x,), method="function_mode", pin_head=False)
    assert {"attn.qk", "attn.av"} <= set(_choosable(g)) or {"sdpa.qk", "sdpa.av"} <= set(
        _choosable(g))
    graph_bytes = sum(o.saved_bytes - o.saved_shared_bytes for o in g.ops)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr != x.untyped_storage().data_ptr():
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if which == "mha":
            mha_forward(_identity_step, mha, x, x, x, need_weights=False)
        else:
            q = x.unflatten(-1, (4, 4)).transpose(1, 2)
            sdpa_forward(_identity_step, q, q, q, dropout_p=0.1, is_causal=True)
    assert graph_bytes == sum(seen.values())
