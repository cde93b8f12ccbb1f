"""A Python function fx keeps as one op (``torch.fx.wrap``, as torchvision's Swin wraps
``shifted_window_attention``) while it runs GEMMs on its module's weights: ``auto`` traces
through it (the function-mode tracer), ``--tracer`` chooses, and with fx the unseen-ops
warning is printed once, names every hidden call and gives its real FLOP share."""

from __future__ import annotations

import logging
import math
import textwrap
from pathlib import Path

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from qsync_opt import trace
from qsync_opt.documents.schemas import OpKind
from qsync_opt.graph import unseen_ops
from support.harness import run_cli


def window_attention(x: torch.Tensor, qkv_w: torch.Tensor, qkv_b: torch.Tensor,
                     proj_w: torch.Tensor, proj_b: torch.Tensor, heads: int) -> torch.Tensor:
    """Like torchvision's ``shifted_window_attention``: weights in, F.linear and matmuls."""
    b, n, c = x.shape
    qkv = F.linear(x, qkv_w, qkv_b).reshape(b, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    attn = (q * (c // heads) ** -0.5).matmul(k.transpose(-2, -1)).softmax(-1)
    out = attn.matmul(v).transpose(1, 2).reshape(b, n, c)
    return F.linear(out, proj_w, proj_b)


torch.fx.wrap("window_attention")


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return window_attention(x, self.qkv.weight, self.qkv.bias, self.proj.weight,
                                self.proj.bias, self.heads)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), \
            nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class SwinLikeWrapped(nn.Module):
    """Stages of blocks of growing width (the first stage's calls hold little of the model,
    as in Swin, where a 1% threshold misses them)."""

    def __init__(self, dims: tuple[int, ...] = (8, 16, 32), depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(4, dims[0])
        self.stages = nn.ModuleList()
        self.downs = nn.ModuleList()
        for i, d in enumerate(dims):
            self.stages.append(nn.Sequential(*(Block(d, 2) for _ in range(depth))))
            self.downs.append(nn.Linear(d, dims[i + 1]) if i + 1 < len(dims) else nn.Identity())
        self.head = nn.Linear(dims[-1], 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for stage, down in zip(self.stages, self.downs, strict=True):
            x = down(stage(x))
        return self.head(x.mean(1))


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return SwinLikeWrapped(), torch.randn(2, 16, 4)


HIDDEN_CALLS = 6  # one window_attention call per block: 3 stages x 2 blocks


def test_auto_traces_through_a_wrapped_function_and_sees_every_gemm(caplog) -> None:
    model, x = _model()
    with caplog.at_level(logging.INFO, logger="qsync_opt.graph"):
        g = trace(model, example_inputs=x)
    assert g.trace_method == "function_mode"
    fm = trace(model, example_inputs=x, method="function_mode")
    assert [o.name for o in g.choosable_ops()] == [o.name for o in fm.choosable_ops()]
    names = {o.name for o in g.choosable_ops()}
    # each call's two F.linear (named by their weights) and two matmuls are choosable
    for s, d in ((0, 0), (2, 1)):
        blk = f"stages.{s}.{d}.attn"
        assert {f"{blk}.qkv.weight", f"{blk}.proj.weight", f"{blk}.matmul",
                f"{blk}.matmul_1"} <= names, sorted(names)
    assert len(g.choosable_ops()) == 6 * 6 + 1 + 2  # 6 per block, embed, 2 downs; head pinned
    assert unseen_ops(g) == []
    assert "opaque" in caplog.text and "function mode instead" in caplog.text


def test_fx_keeps_it_opaque_and_the_warning_names_every_call_with_its_real_share(caplog) -> None:
    model, x = _model()
    with caplog.at_level(logging.WARNING, logger="qsync_opt.graph"):
        g = trace(model, example_inputs=x, method="fx")
    fm = trace(model, example_inputs=x, method="function_mode")
    opaque = [o for o in g.ops if o.target.endswith("window_attention")]
    assert len(opaque) == HIDDEN_CALLS and all(o.kind == OpKind.other for o in opaque)
    assert all(o.hidden_gemms == 4 for o in opaque)
    lines = unseen_ops(g)
    assert len(lines) == HIDDEN_CALLS
    assert {o.name for o in opaque} == {line.split(" ")[0] for line in lines}
    # the real share: what the function's GEMMs do, as the function-mode graph counts them
    total = sum(o.fwd_flops for o in g.ops)
    for o in opaque:
        blk = o.name.rsplit(".", 1)[0]
        inside = sum(f.fwd_flops for f in fm.ops if f.name.startswith(blk + ".")
                     and f.kind in (OpKind.linear, OpKind.matmul))
        assert o.fwd_flops >= inside > 0
        share = f"{100 * o.fwd_flops / total:.1f}% of the forward FLOPs"
        assert any(line.startswith(o.name + " ") and share in line for line in lines)
        assert share != "0.0% of the forward FLOPs"
    assert caplog.text.count("cannot see inside") == 1


def test_a_function_reading_no_parameters_and_running_no_gemm_stays_one_op() -> None:
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(_wrapped_scale(x))

    g = trace(Plain(), example_inputs=torch.randn(2, 4))
    assert g.trace_method == "fx"
    assert [o.hidden_gemms for o in g.ops if o.kind == OpKind.other] == [0]


def _wrapped_scale(x: torch.Tensor) -> torch.Tensor:
    return x * math.pi


torch.fx.wrap("_wrapped_scale")


_FILE = '''
import sys
sys.path.insert(0, {tests!r})
from test_graph_opaque import _model


def build():
    return _model()
'''


@pytest.mark.parametrize("tracer,method", [("auto", "function_mode"), ("fx", "fx"),
                                           ("function_mode", "function_mode")])
def test_the_cli_tracer_flag(tmp_path, tracer, method, caplog) -> None:
    f = tmp_path / "swinlike.py"
    f.write_text(textwrap.dedent(_FILE.format(tests=str(Path(__file__).parent))))
    out = tmp_path / "g.json"
    with caplog.at_level(logging.WARNING, logger="qsync_opt.graph"):
        code, _, err = run_cli("graph", "--model", f"{f}:build", "--tracer", tracer,
                               "--out", str(out))
    assert code == 0, err
    assert f'"trace_method": "{method}"' in out.read_text()
    said = caplog.text + err
    assert said.count("cannot see inside") == (1 if tracer == "fx" else 0), said


@pytest.mark.parametrize("bad", ["", "FX", "fx ", "function-mode", "²", "٣", "auto,fx"])
def test_a_bad_tracer_is_refused_in_one_line(bad) -> None:
    code, out, err = run_cli("graph", "--model", "digits_cnn", "--tracer", bad)
    assert code == 2 and out == ""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) <= 2 and "--tracer" in err and "Traceback" not in err


def test_solve_with_fx_warns_once(tmp_path, caplog, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    f = tmp_path / "swinlike.py"
    f.write_text(textwrap.dedent(_FILE.format(tests=str(Path(__file__).parent))))
    with caplog.at_level(logging.WARNING, logger="qsync_opt.graph"):
        code, _, err = run_cli("solve", "--model", f"{f}:build", "--tracer", "fx",
                               "--cluster", "cpux2", "--out", str(tmp_path / "p.json"),
                               "--indicator-batches", "1", "--solver", "highs")
    assert code == 0, err
    said = caplog.text + err
    assert said.count("cannot see inside") == 1, said


@pytest.mark.slow
def test_a_plan_made_with_tracer_fx_is_accepted_where_it_is_checked(tmp_path, monkeypatch) -> None:
    from qsync_opt import Plan, load
    from qsync_opt.problem.plan import graph_for_plan

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    f = tmp_path / "swinlike.py"
    f.write_text(textwrap.dedent(_FILE.format(tests=str(Path(__file__).parent))))
    out = tmp_path / "p.json"
    code, _, err = run_cli("solve", "--model", f"{f}:build", "--tracer", "fx", "--cluster",
                           "cpux2", "--out", str(out), "--indicator-batches", "1",
                           "--solver", "highs")
    assert code == 0, err
    code, _, err = run_cli("replay", "--model", f"{f}:build", "--tracer", "fx", "--plan",
                           str(out))
    assert code == 0, err
    # train and report find the graph a plan was made on (auto, then fx) by themselves
    plan = load(out, Plan)
    graph = graph_for_plan(plan, f"{f}:build")
    assert graph.trace_method == "fx" and graph.structure_hash() == plan.graph_hash
