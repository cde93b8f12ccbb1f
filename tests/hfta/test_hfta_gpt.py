"""GPT-style transformers as fused arrays (qsync_opt.hfta.convert): tiny_gpt and other
models/gpt2.py configurations convert to the fused operators and equal B standalone models
(forward and every gradient, both input modes, fused / serial / mixed / separate), one kernel
call per op for all B, the tied lm_head / wte weight one fused tensor, the translated shape
ops, the refusals, the torch.func route, and `sweep --model tiny_gpt` (plans included)."""

from __future__ import annotations

import contextlib
import copy
import io
import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from qsync_opt.models.bert import BertConfig, BertForQuestionAnswering
from qsync_opt.models.gpt2 import GPT, GPTConfig
from torch import Tensor, nn

from qsync_opt.cli import main
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.hfta.convert import fuse
from qsync_opt.hfta.functional import FuncArray
from qsync_opt.hfta.fused_array import FusedArray
from qsync_opt.hfta.linear_ops import FusedEmbedding, FusedLayerNorm, FusedLinear, FusedMatMul
from qsync_opt.hfta.optim import FusedAdamW
from qsync_opt.hfta.trainer import ArrayTrainer, SweepSpec, Variant
from qsync_opt.ops.layers import QMatMul
from qsync_opt.runtime import apply_precisions
from support.harness import count_calls, max_abs_diff, run_cli, run_params

B = 3
TOL = 1e-10
F64 = torch.float64
SMALL = GPTConfig(vocab_size=98, n_ctx=16, n_embd=32, n_layer=2, n_head=4, dropout=0.0)
#: another size: one layer, two heads, a dropout (compared in eval mode)
OTHER = GPTConfig(vocab_size=50, n_ctx=8, n_embd=24, n_layer=1, n_head=2, dropout=0.1)


#: one torch thread, as the ranks run (conftest)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _gpts(cfg: GPTConfig, count: int = B) -> list[GPT]:
    out = []
    for s in range(count):
        torch.manual_seed(s)
        out.append(GPT(cfg).double())
    return out


def _ids(cfg: GPTConfig, input_mode: str, n: int = 2, t: int = 7) -> Tensor:
    g = torch.Generator().manual_seed(123)
    shape = (B, n, t) if input_mode == "per_model" else (n, t)
    return torch.randint(0, cfg.vocab_size, shape, generator=g)


def _own(x: Tensor, b: int, input_mode: str) -> Tensor:
    return x[b] if input_mode == "per_model" else x


def _check_array(arr: FusedArray, ref: Sequence[nn.Module], inputs: Sequence[Tensor],
                 input_mode: str, tol: float = TOL) -> Tensor:
    """Forward and backward (a random-weighted sum) of the array against each standalone
    model on its own inputs; every fused parameter's slice b holds model b's gradient."""
    out = arr(*inputs)
    w = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(7))
    (out * w).sum().backward()
    outs = []
    for b, m in enumerate(ref):
        y = m(*[_own(x, b, input_mode) for x in inputs])
        (y * w[b]).sum().backward()
        outs.append(y)
    assert out.shape == torch.stack(outs).shape
    assert (out - torch.stack(outs)).abs().max().item() <= tol
    fused = dict(arr.named_model_parameters())
    for b, m in enumerate(ref):
        names = [n for n, _ in m.named_parameters()]
        assert sorted(names) == sorted(fused), "each standalone parameter once"
        for name, p in m.named_parameters():
            g = fused[name].grad
            assert g is not None and p.grad is not None, name
            assert (g[b] - p.grad).abs().max().item() <= tol, (name, b)
    return out


# ----------------------------------------------------------------------------- equality


@pytest.mark.parametrize("input_mode", ["per_model", "replicated"])
@pytest.mark.parametrize("mode", ["fused", "serial", "mixed", "separate"])
def test_gpt_array_equals_separate_models(mode: str, input_mode: str) -> None:
    """tiny_gpt's code (a small GPTConfig): outputs and every parameter's gradient slice
    equal 3 standalone GPTs in float64, fully fused, fully serial, mixed (every other op
    serial: the tied lm_head serial, wte fused) and separate."""
    ref = _gpts(SMALL)
    arr = fuse(_gpts(SMALL), input_mode=input_mode)
    assert isinstance(arr.fused["transformer__h__0__attn__c_attn"], FusedLinear)
    if mode == "serial":
        for op in arr.op_names:
            arr.set_mode(op, "serial")
    elif mode == "mixed":
        for i, op in enumerate(arr.op_names):
            if i % 2 or op == "lm_head":
                arr.set_mode(op, "serial")
        assert arr.mode_of("lm_head") == "serial" and arr.mode_of("transformer.wte") == "fused"
    elif mode == "separate":
        arr.separate = True
    _check_array(arr, ref, [_ids(SMALL, input_mode)], input_mode)


@pytest.mark.parametrize("input_mode", ["per_model", "replicated"])
def test_other_gpt_sizes_and_eval_mode_dropout(input_mode: str) -> None:
    """Another GPTConfig (one layer, two heads, dropout 0.1, a sequence shorter than n_ctx):
    in eval mode (dropout off) the array equals the standalone models."""
    ref = [m.eval() for m in _gpts(OTHER)]
    arr = fuse(_gpts(OTHER), input_mode=input_mode).eval()
    _check_array(arr, ref, [_ids(OTHER, input_mode, n=3, t=5)], input_mode)
    arr.train()  # in training each model draws its own dropout masks: the models differ
    out = arr(_ids(OTHER, input_mode, n=3, t=5))
    assert not torch.equal(out[0], out[1]) and torch.isfinite(out).all()


def test_bert_style_encoder_with_two_inputs_equals_separate_models() -> None:
    """models/bert.py (post-LN, separate q/k/v, two id inputs, position ids from a buffer):
    the same translation places it."""
    cfg = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=32, max_position_embeddings=12,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

    def berts() -> list[nn.Module]:
        out = []
        for s in range(B):
            torch.manual_seed(s)
            out.append(BertForQuestionAnswering(cfg).double())
        return out

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 40, (B, 2, 6), generator=g)
    types = torch.randint(0, 2, (B, 2, 6), generator=g)
    _check_array(fuse(berts()), berts(), [ids, types], "per_model")


class _ShapeOps(nn.Module):
    """A conv trunk read by size/view (channel-folded -> model-major), then shape ops of
    every kind on model-major values mixed with shared buffers and constants."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 4 * 4, 8)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(4, 5)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.register_buffer("mask", torch.tensor([True, False] * 4))
        self.register_buffer("table", torch.linspace(-1.0, 1.0, 16).view(2, 1, 8))

    def forward(self, x: Tensor) -> Tensor:
        h = F.max_pool2d(torch.relu(self.conv(x)), 1)     # channel-folded
        h = h.view(h.size(0), -1)                          # read model-major
        h = self.ln(self.fc(h)) * self.scale               # [N, 8] * shared [8]
        h = torch.where(self.mask, h, -h)                  # a shared mask
        wide = (h + self.table).sum(0)                     # shared of higher rank: [2, N, 8]
        a = h.unsqueeze(1).expand(-1, 3, -1).permute(0, 2, 1).contiguous()  # [N, 8, 3]
        s = a.sum(dim=-1) + a.mean(2) + wide               # [N, 8]
        c = torch.cat([s, h], dim=1).reshape(-1, 4, 4)     # [N, 4, 4]
        first, rest = c.split([1, 3], dim=1)               # tuple of model-major values
        c = torch.stack([first.squeeze(1), rest.mean(1)], 1)  # [N, 2, 4]
        c = c[:, :, 1:].transpose(1, 2)                    # [N, 3, 2]
        d = torch.matmul(c, torch.ones(2, dtype=c.dtype))  # a 1-D shared operand: [N, 3]
        e = torch.matmul(d.unsqueeze(1), c)                # [N, 1, 3] @ [N, 3, 2]
        v = torch.matmul(d[0], c[0])                       # 1-D @ 2-D, both per model: [2]
        n, k = c.shape[0], c.size(-1)
        y = self.head(torch.cat([e.view(n, k) + v, d[:, :2]], -1)).repeat(1, 2)  # [N, 10]
        return y + d.mean() + e.flatten().sum()            # per-model scalars broadcast


@pytest.mark.parametrize("input_mode", ["per_model", "replicated"])
def test_shape_ops_on_model_major_values_match_the_standalone_model(input_mode: str) -> None:
    def nets() -> list[nn.Module]:
        out = []
        for s in range(B):
            torch.manual_seed(s)
            out.append(_ShapeOps().double())
        return out

    g = torch.Generator().manual_seed(9)
    x = torch.randn((B, 5, 2, 4, 4) if input_mode == "per_model" else (5, 2, 4, 4),
                    dtype=F64, generator=g)
    _check_array(fuse(nets(), input_mode=input_mode), nets(), [x], input_mode)


# ----------------------------------------------------------------------------- one call


_KERNELS: dict[Any, str] = {torch.baddbmm: "baddbmm", torch.bmm: "bmm",
                            F.embedding: "embedding", F.layer_norm: "layer_norm",
                            torch.matmul: "matmul", F.linear: "linear"}


def CountKernels() -> Any:  # noqa: N802 (used as a class: ``with CountKernels() as m``)
    return count_calls(_KERNELS)


def test_fused_mode_runs_one_kernel_call_per_op_for_all_models() -> None:
    """Every Linear one batched GEMM (the bias-free lm_head a bmm), both embeddings one
    lookup each, every LayerNorm one call, every attention matmul one batched matmul, for all
    B models; serial runs B calls of each."""
    arr = fuse(_gpts(SMALL))
    n = SMALL.n_layer
    ids = _ids(SMALL, "per_model")
    with CountKernels() as mode:
        arr(ids)
    assert mode.counts == Counter({"baddbmm": 4 * n, "bmm": 1, "embedding": 2,
                                   "layer_norm": 2 * n + 1, "matmul": 2 * n})
    for op in arr.op_names:
        arr.set_mode(op, "serial")
    with CountKernels() as mode:
        arr(ids)
    assert mode.counts == Counter({"linear": B * (4 * n + 1), "embedding": 2 * B,
                                   "layer_norm": B * (2 * n + 1), "matmul": 2 * n})


def test_fused_ops_take_inputs_of_any_rank() -> None:
    """Embedding of shared ids [1, T] (position ids) -> [B, 1, T, D] and of per-model ids
    [B] (one id each) -> [B, D]; Linear and LayerNorm on [B, N, H, T, D]: each one kernel
    call, each equal to the standalone modules."""
    torch.manual_seed(6)
    embs = [nn.Embedding(9, 4, dtype=F64) for _ in range(B)]
    lins = [nn.Linear(4, 3, dtype=F64) for _ in range(B)]
    lns = [nn.LayerNorm(4, dtype=F64) for _ in range(B)]
    for m in lns:
        with torch.no_grad():
            m.weight.normal_()
            m.bias.normal_()
    emb = FusedEmbedding.from_modules(embs)
    pos = torch.arange(6).unsqueeze(0)
    with CountKernels() as mode:
        out = emb(pos, replicated=True)
        one = emb(torch.tensor([1, 2, 3]), replicated=False)
    assert mode.counts == Counter({"embedding": 2})
    assert torch.equal(out, torch.stack([m(pos) for m in embs])) and out.shape == (B, 1, 6, 4)
    assert torch.equal(one, torch.stack([m(torch.tensor(b + 1)) for b, m in enumerate(embs)]))
    x = torch.randn(B, 2, 3, 5, 4, dtype=F64)
    pairs: list[tuple[list[Any], nn.Module]] = [(lins, FusedLinear.from_modules(lins)),
                                               (lns, FusedLayerNorm.from_modules(lns))]
    for mods, fused in pairs:
        with CountKernels() as mode:
            y = fused(x)
        assert sum(mode.counts.values()) == 1
        ref = torch.stack([m(x[b]) for b, m in enumerate(mods)])
        assert (y - ref).abs().max().item() <= TOL


# ----------------------------------------------------------------------------- tied weights


def test_the_tied_weight_is_one_fused_tensor_its_gradient_the_sum_of_both_uses() -> None:
    ref = _gpts(SMALL)
    arr = fuse(_gpts(SMALL))
    wte, head = arr.fused["transformer__wte"], arr.fused["lm_head"]
    assert isinstance(wte, FusedEmbedding) and isinstance(head, FusedLinear)
    assert head.weight is wte.weight and wte.weight.shape == (B, SMALL.vocab_size,
                                                              SMALL.n_embd)
    named = arr.named_model_parameters()
    assert "lm_head.weight" not in dict(named) and "transformer.wte.weight" in dict(named)
    assert len({id(p) for _, p in named}) == len(named) == len(list(arr.parameters()))
    ids = _ids(SMALL, "per_model")
    _check_array(arr, ref, [ids], "per_model")  # the slices equal wte.weight.grad
    # the standalone model untied: the two uses' gradients, whose sum the fused tensor holds
    for b, m in enumerate(_gpts(SMALL)):
        m.lm_head.weight = nn.Parameter(m.transformer.wte.weight.detach().clone())
        y = m(ids[b])
        w = torch.randn(arr(ids).shape, dtype=F64, generator=torch.Generator().manual_seed(7))
        (y * w[b]).sum().backward()
        emb, lin = m.transformer.wte.weight.grad, m.lm_head.weight.grad
        assert emb.abs().sum() > 0 and lin.abs().sum() > 0
        assert (wte.weight.grad[b] - (emb + lin)).abs().max().item() <= TOL
    # the fused optimizer sees the tensor once and steps it once
    opt = FusedAdamW(list(arr.parameters()), B, lr=1e-2)
    before = wte.weight.detach().clone()
    opt.step()
    assert head.weight is wte.weight and not torch.equal(before, wte.weight)


@pytest.mark.parametrize("input_mode", ["per_model", "replicated"])
def test_export_gives_a_tied_gpt_equal_to_the_arrays_model(input_mode: str) -> None:
    ref = _gpts(SMALL)
    arr = fuse(_gpts(SMALL), input_mode=input_mode)
    ids = _ids(SMALL, input_mode)
    out = arr(ids)
    for b in range(B):
        m = arr.export(b)
        assert type(m) is GPT
        assert m.lm_head.weight is m.transformer.wte.weight
        assert torch.equal(m(_own(ids, b, input_mode)), out[b])
        sd = m.state_dict()
        for k, v in ref[b].state_dict().items():
            assert torch.equal(sd[k], v), k
    arr.load_models(list(reversed(ref)))
    assert torch.equal(arr.export(0).lm_head.weight, ref[-1].transformer.wte.weight)


def test_fused_route_equals_torch_func_route() -> None:
    arr = fuse(_gpts(SMALL))
    fa = FuncArray(_gpts(SMALL))
    ids = _ids(SMALL, "per_model")
    o1, o2 = arr(ids), fa(ids)
    assert (o1 - o2).abs().max().item() <= TOL
    w = torch.randn(o1.shape, dtype=F64, generator=torch.Generator().manual_seed(3))
    (o1 * w).sum().backward()
    (o2 * w).sum().backward()
    fused = dict(arr.named_model_parameters())
    assert set(fused) == set(fa.names)
    for name, p in zip(fa.names, fa.params, strict=True):
        assert (p.grad - fused[name].grad).abs().max().item() <= TOL, name


# ----------------------------------------------------------------------------- MatMul


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "int8", "int8_full", "int4",
                                       "fp8"])
def test_fused_matmul_equals_runtime_qmatmuls(precision: str) -> None:
    """At every precision the fused attention matmul equals B runtime QMatMuls (16 bit: one
    call; integer / fp8: each model's own scale and, from the counter, its own seed)."""
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(B, 2, 3, 5, 4, generator=g), torch.randn(B, 2, 3, 4, 6, generator=g)
    qs = [nn.Sequential(QMatMul()) for _ in range(B)]
    for i, q in enumerate(qs):
        apply_precisions(q, {"0": precision})
        q[0].qseed = 20 + i
    fused = FusedMatMul.from_modules([q[0] for q in qs])
    assert fused.precision == Precision(precision)
    fused.qseed = 20
    with CountKernels() as mode:
        out = fused(a, b)
    assert torch.equal(out, torch.stack([q[0](a[i], b[i]) for i, q in enumerate(qs)]))
    one_call = precision in ("fp32", "fp16", "bf16")
    assert mode.counts["matmul"] == (1 if one_call else B)
    with pytest.raises(QsyncInputError, match="FusedMatMul: expected two model-major"):
        fused(a[0], b[0])


# ----------------------------------------------------------------------------- refusals


class _ParamOutside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.pos = nn.Parameter(torch.zeros(4))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x + self.pos)


class _Conv1d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


class _Einsum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        return torch.einsum("ni,nj->nij", h, h).flatten(1)


class _SharedNoise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        return h + torch.randn(h.shape[-1])


class _OwnBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("noise", torch.randn(4))  # differs with the seed

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x) + self.noise


class _IndexByModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        return h[h > 0]


@pytest.mark.parametrize(("cls", "needle"), [
    (_ParamOutside, "'pos' is a parameter read outside a module"),
    (_Conv1d, "module 'conv' \\(Conv1d\\) has no fused form"),
    (_Einsum, "function einsum \\(einsum\\) has no fused form"),
    (_SharedNoise, "randn .* draws random numbers for a value shared by all models"),
    (_OwnBuffer, "buffer 'noise' differs between model 0 and model 1"),
    (_IndexByModel, "getitem .* indexes with a model-major value"),
])
def test_an_op_the_walk_cannot_place_is_refused_by_name(cls: type[nn.Module],
                                                         needle: str) -> None:
    models = []
    for s in range(2):
        torch.manual_seed(s)
        models.append(cls())
    with pytest.raises(QsyncInputError, match=f"hfta: .*{needle}"):
        fuse(models)


# ----------------------------------------------------------------------------- trainer, CLI


@pytest.mark.parametrize("route", ["fused", "torch.func"])
@pytest.mark.slow
def test_sweep_model_equals_its_train_run(tmp_path, monkeypatch, route: str) -> None:
    """tiny_gpt trains on the fused operators (the trainer picks the route itself) or, with
    the converter's refusal forced, on the torch.func route (stack_module_state + vmap):
    either way model s after 3 AdamW steps, exported, equals `train --seed s --nproc 1`
    (float32 reordering only), its lm_head tied to wte (the tie is what both routes must
    get right)."""
    if route == "torch.func":
        def refuse(models: Any, **kw: Any) -> Any:
            raise QsyncInputError("hfta: refused for this test")

        monkeypatch.setattr("qsync_opt.hfta.trainer.fuse", refuse)
    spec = SweepSpec("tiny_gpt", [Variant(s, 1e-3, 0.0) for s in (0, 1)], steps=3, batch=4,
                     optimizer="adamw")
    tr = ArrayTrainer(spec)
    assert tr.route == route
    if route == "fused":
        assert tr.route_reason == "" and isinstance(tr.array, FusedArray)
    else:
        assert "hfta" in tr.route_reason and isinstance(tr.array, FuncArray)
    tr.train()
    out = tmp_path / "t1"
    code, _, err = run_cli("train", "--model", "tiny_gpt", "--seed", "1", "--lr", "1e-3",
                           "--optimizer", "adamw", "--batch", "4", "--steps", "3", "--out",
                           str(out), "--emulate-dp")
    assert code == 0, err
    ref = run_params(out, 0, buffers=True)
    exported = tr.export(1)
    assert exported.lm_head.weight is exported.transformer.wte.weight
    mine = exported.state_dict()
    assert max_abs_diff({k: v for k, v in mine.items() if k in ref}, ref) <= 1e-5
    rows = tr.evaluate()
    assert all(r["eval_loss"] is not None and r["eval_accuracy"] is None for r in rows)
    if route == "torch.func":
        with pytest.raises(QsyncInputError, match="torch.func route"):
            ArrayTrainer(SweepSpec("tiny_gpt", [Variant(0, 1e-3, 0.0)], steps=1, batch=2,
                                   precisions={"transformer.h.0.mlp.c_fc": "int8"}))


def _sweep(tmp_path, name: str, *extra: str) -> tuple[dict[str, Any], str]:
    out = tmp_path / name
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["sweep", "--model", "tiny_gpt", "--seeds", "0-1", "--steps", "2",
                     "--batch", "4", "--eval-batches", "1", "--out", str(out), *extra]) == 0
    return json.loads((out / "sweep.json").read_text()), buf.getvalue()


@pytest.mark.parametrize(("fuse_mode", "inputs"), [("serial", "per_model"),
                                                 ("measure", "per_model"),
                                                 ("fused", "replicated")])
@pytest.mark.slow
def test_sweep_tiny_gpt_runs_on_the_fused_route(tmp_path, fuse_mode: str, inputs: str) -> None:
    doc, text = _sweep(tmp_path, fuse_mode, "--fuse", fuse_mode, "--inputs", inputs, "--export")
    assert doc["route"] == "fused" and "route: torch.func" not in text
    assert doc["input_mode"] == inputs
    assert len(doc["models"]) == 2 and len(doc["exported"]) == 2
    assert all(r["final_loss"] == r["final_loss"] for r in doc["models"])  # finite
    if fuse_mode == "measure":
        assert "lm_head" in doc["fuse"]["ops"] and "transformer.wte" in doc["fuse"]["ops"]


@pytest.mark.slow
def test_exported_tiny_gpt_resumes_in_train(tmp_path) -> None:
    """`sweep --export` writes model 1 (its tied weight and AdamW state, the moments of both
    uses) as a checkpoint set that `train` resumes: 2 steps in the sweep and 1 in train equal
    3 steps of train."""
    common = ["--lr", "1e-3", "--optimizer", "adamw", "--batch", "4"]
    doc, _ = _sweep(tmp_path, "resume", *common, "--fuse", "fused", "--export")
    run = tmp_path / "resume" / "model1"
    assert doc["exported"][1] == str(run)
    straight = tmp_path / "straight"
    for out in (run, straight):
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["train", "--model", "tiny_gpt", "--seed", "1", *common, "--steps", "3",
                         "--out", str(out), "--emulate-dp"]) == 0
    assert json.loads((run / "summary.json").read_text())["resumed_from_step"] == 2
    a, b = (run_params(o, 0, buffers=True) for o in (run, straight))
    assert max_abs_diff(b, a) <= 1e-5


def test_sweep_tiny_gpt_with_a_plan(tmp_path) -> None:
    """--plan/--group: the group's precisions reach the fused Linear ops and the attention
    matmuls (a line says where they went), and the array trains."""
    from qsync_opt.costs.cluster import parse_shorthand
    from qsync_opt.graph import trace
    from qsync_opt.problem.plan import make_plan

    lower = {"transformer.h.0.mlp.c_fc": "int8", "transformer.h.1.attn.qk_matmul": "fp16",
             "transformer.h.2.attn.av_matmul": "int8", "transformer.h.3.attn.c_proj": "fp16"}
    plan = make_plan(trace("tiny_gpt", 4), parse_shorthand("v100x1+t4x1"), {"t4": lower},
                     provenance={"solver": "test"})
    path = tmp_path / "p.json"
    plan.save(path)
    doc, text = _sweep(tmp_path, "plan", "--plan", str(path), "--group", "t4", "--fuse", "fused")
    assert doc["route"] == "fused" and doc["group"] == "t4"
    applied = doc["plan_ops"]["applied"]
    assert {op: applied[op] for op in lower} == lower and doc["plan_ops"]["unplaced"] == []
    planned = plan.groups["t4"].precisions
    assert len(applied) == len(planned)
    n_mm = sum("matmul" in op for op in planned)
    assert f"plan: group t4's precisions on {len(planned)} ops of the array ({n_mm} attention " \
           "matmuls among them); below fp32: " in text
    tr = ArrayTrainer(SweepSpec("tiny_gpt", [Variant(0, 1e-3, 0.0), Variant(1, 1e-3, 0.0)],
                                steps=1, batch=2, precisions=lower))
    assert tr.array.fused["transformer__h__0__mlp__c_fc"].precision == Precision.int8
    assert tr.array.matmuls["transformer__h__1__attn__qk_matmul"].precision == Precision.fp16
    assert tr.array.matmuls["transformer__h__0__attn__qk_matmul"].precision == Precision.fp32
    tr.train()
    assert all(x == x for x in tr.last_loss)


def test_a_deep_copy_of_the_array_stays_tied() -> None:
    arr = fuse(_gpts(SMALL))
    again = copy.deepcopy(arr)
    assert again.fused["lm_head"].weight is again.fused["transformer__wte"].weight
    assert again.fused["lm_head"].weight is not arr.fused["lm_head"].weight
    ids = _ids(SMALL, "per_model")
    assert torch.equal(again(ids), arr(ids))
