"""Graph extraction: counts, FLOPs, pins, names, saved bytes, fallbacks, user models."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections import Counter

import pytest
import torch
from qsync_opt.models import get_workload
from torch import nn

from qsync_opt import ModelGraph, QsyncInputError, TraceError, trace
from qsync_opt.core.precision import Precision
from qsync_opt.documents.schemas import OpKind, OpRole
from qsync_opt.graph import HEAD_REASON


def test_resnet50_convs_choosable_and_fc_pinned(resnet50_graph: ModelGraph) -> None:
    g = resnet50_graph
    convs = [o for o in g.ops if o.kind == OpKind.conv]
    assert len(convs) == 53
    assert all(o.role == OpRole.choosable for o in convs)
    assert len(g.choosable_ops()) == 53
    fc = g.op("fc")
    assert fc.kind == OpKind.linear and fc.role == OpRole.pinned
    assert fc.pin_reason == HEAD_REASON
    assert fc.allowed_precisions == [Precision.fp32]


def test_resnet50_flops_per_image(resnet50_graph: ModelGraph) -> None:
    # ResNet-50 is about 4.1 G multiply-accumulates per 224x224 image (8.2 GFLOPs counting a
    # multiply-add as two, the schema's convention).
    g = resnet50_graph
    gemm = sum(o.fwd_flops for o in g.ops if o.kind in (OpKind.conv, OpKind.linear))
    macs_per_image = gemm / 2 / g.batch_size
    assert macs_per_image == pytest.approx(4.1e9, rel=0.05)
    assert g.total_fwd_flops / g.batch_size == pytest.approx(8.2e9, rel=0.05)
    assert "2 FLOPs" in g.flop_convention


def test_conv_flops_hand_computed(resnet50_graph: ModelGraph) -> None:
    conv1 = resnet50_graph.op("conv1")  # 7x7, 3->64, stride 2, 224 -> 112
    assert conv1.output_shapes == [[128, 64, 112, 112]]
    assert conv1.fwd_flops == 2 * 128 * 64 * 112 * 112 * (3 * 7 * 7)
    # The first layer needs no input gradient: only the weight-gradient GEMM runs backward.
    assert conv1.needs_input_grad is False
    assert conv1.bwd_flops == conv1.fwd_flops
    l1 = resnet50_graph.op("layer1.0.conv1")
    assert l1.needs_input_grad and l1.bwd_flops == 2 * l1.fwd_flops


def test_bert_encoder_linears_and_matmuls_choosable(bert_graph: ModelGraph) -> None:
    ch = bert_graph.choosable_ops()
    kinds = Counter(o.kind for o in ch)
    assert kinds[OpKind.linear] == 72
    assert kinds[OpKind.matmul] == 24
    assert len(ch) == 96
    assert all(".encoder.layer." in o.name for o in ch)
    assert bert_graph.op("qa_outputs").role == OpRole.pinned
    # Norms, softmax and the loss run in fp32 as autocast runs them.
    for o in bert_graph.ops:
        if o.kind in (OpKind.norm, OpKind.softmax, OpKind.loss, OpKind.embedding):
            assert o.role == OpRole.pinned and o.pin_reason
    assert any(o.kind == OpKind.loss for o in bert_graph.ops)


def test_op_names_are_module_names() -> None:
    wl = get_workload("resnet18")
    with torch.device("meta"):
        model = wl.build()
    modules = dict(model.named_modules())
    g = trace("resnet18", batch=2)
    module_ops = [o for o in g.ops if o.target.startswith("torch.nn.modules")]
    assert module_ops
    for o in module_ops:
        # A module called several times (torchvision's ReLU, thrice per block) gives one op
        # per call: its FQN, then FQN_1, FQN_2.
        base = o.name if o.name in modules else o.name.rsplit("_", 1)[0]
        assert base in modules, o.name
    assert {"layer1.0.relu", "layer1.0.relu_1"} <= {o.name for o in g.ops}
    # Function ops carry their module scope: the residual add of layer1.0.
    assert "layer1.0.add" in {o.name for o in g.ops}


def test_roles_of_pass_through_and_promote(resnet50_graph: ModelGraph) -> None:
    g = resnet50_graph
    assert g.op("relu").role == OpRole.pass_through
    assert g.op("maxpool").role == OpRole.pass_through
    add = g.op("layer1.0.add")
    assert add.role == OpRole.promote and len(add.input_shapes) == 2
    # batch_norm runs in its input's dtype under autocast; layer_norm is pinned to fp32.
    assert g.op("bn1").role == OpRole.pass_through


def test_layer_norm_is_pinned_batch_norm_is_not(bert_graph: ModelGraph) -> None:
    ln = bert_graph.op("bert.embeddings.LayerNorm")
    assert ln.role == OpRole.pinned and "autocast" in (ln.pin_reason or "")


def test_topological_order_depth_and_edges(resnet50_graph: ModelGraph) -> None:
    g = resnet50_graph
    order = {o.name: i for i, o in enumerate(g.ops)}
    depth = {o.name: o.depth for o in g.ops}
    for e in g.edges:
        assert order[e.src] < order[e.dst]
        assert depth[e.src] <= depth[e.dst]
        assert e.bytes == e.numel * 4  # fp32 activations
    assert g.max_depth == max(depth.values())
    assert g.op("conv1").depth == 1
    # 53 convs + 53 BNs + fc + loss along the longest path would exceed the real depth:
    # the deepest path runs through 16 bottlenecks of 3 conv+bn pairs plus the stem.
    assert g.max_depth == 2 + 16 * 6 + 2


def test_saved_bytes_measured_on_a_small_mlp() -> None:
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4), nn.Linear(4, 2))
    g = trace(model, example_inputs=(torch.randn(5, 16),))
    first, relu, second, head = g.ops
    assert first.saved_bytes == 5 * 16 * 4  # its input, for the weight gradient
    assert relu.saved_bytes == 5 * 8 * 4  # its output
    # The second linear saves the relu's output again: same storage, counted once.
    assert second.saved_bytes == 5 * 8 * 4 and second.saved_shared_bytes == 5 * 8 * 4
    assert head.role == OpRole.pinned and head.name == "3"
    assert g.saved_activation_bytes == 5 * 16 * 4 + 5 * 8 * 4 + 5 * 4 * 4
    assert g.param_count == sum(p.numel() for p in model.parameters())
    assert g.trace_method == "fx"


def test_user_module_on_cpu_is_left_untouched() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))
    before = [p.detach().clone() for p in model.parameters()]
    g = trace(model, example_inputs=(torch.randn(2, 4),))
    assert g.batch_size == 2 and len(g.ops) == 3
    for p, b in zip(model.parameters(), before, strict=True):
        assert p.device.type == "cpu" and torch.equal(p, b)


def test_unpin_head_and_unpin_errors() -> None:
    g = trace("digits_cnn", pin_head=False)
    assert g.op("fc2").role == OpRole.choosable
    g = trace("digits_cnn", unpin=["fc2"])
    assert g.op("fc2").role == OpRole.choosable
    with pytest.raises(QsyncInputError, match="no op named nope"):
        trace("digits_cnn", unpin=["nope"])


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if h.shape[0] > 1:  # Python control flow on a shape: symbolic tracing fails here
            h = h + self.fc2(h)
        return self.head(h)


def test_fallback_tracer_when_fx_fails() -> None:
    g = trace(_DataDependent(), example_inputs=(torch.randn(8, 16),))
    assert g.trace_method == "function_mode"
    names = [o.name for o in g.ops]
    assert names == ["fc1", "relu", "fc2", "add", "head"]
    assert {(e.src, e.dst) for e in g.edges} == {
        ("fc1", "relu"), ("relu", "fc2"), ("relu", "add"), ("fc2", "add"), ("add", "head")}
    assert g.op("fc2").saved_shared_bytes == 8 * 32 * 4
    assert g.op("head").role == OpRole.pinned
    with pytest.raises(TraceError):
        trace(_DataDependent(), example_inputs=(torch.randn(8, 16),), method="fx")


def test_fallback_agrees_with_fx_on_a_traceable_model() -> None:
    a = trace("digits_cnn", method="fx")
    b = trace("digits_cnn", method="function_mode")
    key = lambda g: [(o.name, o.kind, o.role, o.fwd_flops, o.saved_bytes) for o in g.ops]  # noqa: E731
    fx_ops = {o.name for o in a.ops}
    assert [k for k in key(b) if k[0] in fx_ops] == [k for k in key(a) if k[0] in {o.name for o in b.ops}]
    assert [o.name for o in b.ops] == [o.name for o in a.ops]
    assert len(b.choosable_ops()) == len(a.choosable_ops()) == 3


class _Broken(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this model always fails\nsecond line")


def test_untraceable_model_says_why_in_one_line() -> None:
    with pytest.raises(TraceError) as info:
        trace(_Broken(), example_inputs=(torch.randn(2, 2),))
    msg = str(info.value)
    assert "\n" not in msg and "this model always fails" in msg and "torch.fx" in msg


def test_shared_module_calls_are_tied() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.head = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.fc(self.fc(x)))

    g = trace(Twice(), example_inputs=(torch.randn(3, 8),))
    assert g.op("fc").tie_group == g.op("fc_1").tie_group == "module:fc"


def test_tie_modes(bert_graph: ModelGraph) -> None:
    assert all(o.tie_group is None for o in bert_graph.ops)
    sib = trace("bert_base", batch=1, tie="siblings")
    q, k, v = (sib.op(f"bert.encoder.layer.3.attention.self.{n}") for n in ("query", "key", "value"))
    assert q.tie_group is not None and q.tie_group == k.tie_group == v.tie_group
    assert sib.op("bert.encoder.layer.3.attention.output.dense").tie_group is None
    blocks = trace("bert_base", batch=1, tie="blocks")
    groups = Counter(o.tie_group for o in blocks.choosable_ops())
    assert len(groups) == 8 and set(groups.values()) == {12}  # 8 op slots x 12 layers
    with pytest.raises(QsyncInputError, match="tie"):
        trace("digits_cnn", tie="everything")


def test_batch_override_and_linear_scaling() -> None:
    a = trace("resnet18", batch=2)
    b = trace("resnet18", batch=4)
    assert a.batch_size == 2 and b.batch_size == 4
    assert b.total_fwd_flops == 2 * a.total_fwd_flops
    # Saved activations double, all but BatchNorm's per-channel mean and rstd.
    assert b.saved_activation_bytes == pytest.approx(2 * a.saved_activation_bytes, rel=1e-3)
    assert b.saved_activation_bytes != 2 * a.saved_activation_bytes
    with pytest.raises(QsyncInputError, match="batch"):
        trace("resnet18", batch=0)


def test_unknown_model_lists_known_names() -> None:
    with pytest.raises(QsyncInputError, match="resnet50"):
        trace("resnet5")


def test_user_model_file(tmp_path) -> None:
    f = tmp_path / "mine.py"
    f.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        def build():
            return nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 2)), (torch.randn(3, 6),)
        def bad():
            return 42
    """))
    g = trace(f"{f}:build")
    assert [o.name for o in g.ops] == ["0", "1", "2"] and g.batch_size == 3
    with pytest.raises(QsyncInputError, match="must return"):
        trace(f"{f}:bad")
    with pytest.raises(QsyncInputError, match="no function"):
        trace(f"{f}:missing")
    with pytest.raises(QsyncInputError, match="not found"):
        trace(f"{tmp_path / 'nofile.py'}:build")


def test_graph_json_round_trip(digits_graph: ModelGraph) -> None:
    text = digits_graph.model_dump_json()
    again = ModelGraph.model_validate_json(text)
    assert again == digits_graph
    assert again.structure_hash() == digits_graph.structure_hash()
    assert json.loads(text)["schema_name"] == "ModelGraph"


#: Appended to a child's code: its own peak resident size, read inside it at its end
#: (VmHWM). Not ``ru_maxrss``: across fork and exec it keeps the parent's resident size (a
#: 2 GB pytest process gives a trivial child 1.9 GB), so it would measure the test runner.
_PEAK_RSS_TAIL = """
import re as _re
with open("/proc/self/status") as _fh:
    print("PEAK_RSS_BYTES", int(_re.search(r"^VmHWM:\\s+(\\d+) kB$", _fh.read(), _re.M)[1]) << 10)
"""


def run_child_peak_rss(code: str) -> tuple[list[str], int]:
    """Run ``code`` in a fresh interpreter: (its stdout lines, its own peak RSS in bytes)."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code) + _PEAK_RSS_TAIL],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    *lines, last = proc.stdout.splitlines()
    tag, value = last.split()
    assert tag == "PEAK_RSS_BYTES", last
    return lines, int(value)


def test_child_peak_rss_is_the_childs_own_not_its_parents() -> None:
    # This process holds 512 MiB more while it starts a child that allocates nothing.
    big = bytearray(512 << 20)
    big[::4096] = b"\x01" * (len(big) // 4096)  # touch every page: resident
    try:
        lines, peak = run_child_peak_rss(
            "import resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10)")
    finally:
        del big
    assert int(lines[0]) >= 512 << 20  # the pitfall: ru_maxrss counts the parent's pages
    assert peak < 64 << 20  # a bare interpreter's own peak is about 10 MiB


@pytest.mark.slow
def test_meta_trace_allocates_no_parameter_memory() -> None:
    # gpt2_xl holds 1.56 G parameters: 6.2 GB if they were real. Traced on meta, the whole
    # process (python + torch) stays far below that.
    lines, peak = run_child_peak_rss("""
        from qsync_opt import trace
        print(trace("gpt2_xl").param_count)
    """)
    assert int(lines[-1]) == 1_557_611_200
    assert peak < 1.5e9, peak


def test_a_name_used_again_gets_a_suffix_in_order_of_use() -> None:
    """One rule for both tracers and the call namer: base, base_1, base_2..."""
    from qsync_opt.ops.naming import CallNamer, UniqueNames

    unique = UniqueNames()
    assert [unique(n) for n in ("relu", "relu", "fc", "relu")] == ["relu", "relu_1", "fc",
                                                                   "relu_2"]
    unique.reset()
    assert unique("relu") == "relu"
    namer = CallNamer({})
    assert [namer.name("matmul", "attn") for _ in range(3)] == [
        "attn.matmul", "attn.matmul_1", "attn.matmul_2"]
    namer.reset()
    assert namer.name("matmul", "attn") == "attn.matmul"
