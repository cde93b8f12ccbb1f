"""Indicators: closed forms against measured errors of real kernels, weighting, methods."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import qsync_opt.ops as ops
from qsync_opt import QsyncInputError, trace
from qsync_opt.core.precision import Precision as P
from qsync_opt.documents.schemas import IndicatorTable
from qsync_opt.indicator import (
    LADDERS,
    METHODS,
    SPECS,
    element_variance,
    enforce_monotone,
    indicate,
    scale_to_batch,
)
from qsync_opt.indicator.calls import module_bilinear
from qsync_opt.indicator.terms import OpCapture, qsync_terms

SEEDS = 400


def _predicted_fwd(bl, a, b, kind_a="int8", kind_b="int8") -> float:
    va = element_variance(a, kind_a)
    vb = element_variance(b, kind_b, per_channel=bl.b_is_weight)
    return float(bl.f(va, b.square()).sum() + bl.f(a.square(), vb).sum())


def test_int8_linear_forward_error_matches_measurement() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.relu(torch.randn(48, 64, generator=gen))  # ReLU zeros quantize exactly
    w = torch.randn(32, 64, generator=gen) * 0.1
    bl = module_bilinear(torch.nn.Linear(64, 32))
    exact = x.double() @ w.double().t()
    measured = sum(float((ops.int8_linear(x, w, seed=s).double() - exact).square().sum())
                   for s in range(SEEDS)) / SEEDS
    predicted = _predicted_fwd(bl, x, w)
    # Sampling error of the mean over 400 seeds is about 1%; second-order terms ~1e-4.
    assert predicted == pytest.approx(measured, rel=0.03)
    # The textbook s^2/6 (uniform fractions) overestimates here: half the inputs are zeros.
    s_x = float(x.abs().max()) / 127
    s_w = (w.abs().amax(1) / 127)
    textbook = (48 * float(w.square().sum()) * s_x**2 + float(x.square().sum())
                * float(s_w.square().sum())) / 6
    assert textbook > 1.2 * measured


def test_int8_conv_forward_error_matches_measurement() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 9, 9, generator=gen)
    w = torch.randn(6, 2, 3, 3, generator=gen)
    conv = torch.nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2, bias=False)
    bl = module_bilinear(conv)
    exact = F.conv2d(x.double(), w.double(), None, 2, 1, 1, 2)
    measured = sum(float((ops.int8_conv2d(x, w, None, 2, 1, 1, 2, seed=s).double() - exact)
                         .square().sum()) for s in range(SEEDS)) / SEEDS
    assert _predicted_fwd(bl, x, w) == pytest.approx(measured, rel=0.03)


def test_int8_full_backward_error_matches_measurement() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(40, 32, generator=gen)
    w = torch.randn(24, 32, generator=gen)
    # rows (tokens) 100x apart and columns (channels) 10x apart: one scale per tensor would
    # be far off; the kernels scale per row for grad_x and per channel for grad_w
    g = (torch.randn(40, 24, generator=gen) * torch.logspace(-2, 0, 40).reshape(-1, 1)
         * torch.logspace(-1, 0, 24))
    exact_gx = g.double() @ w.double()
    exact_gw = g.double().t() @ x.double()
    mx = mw = 0.0
    for s in range(SEEDS):
        xs = x.clone().requires_grad_()
        ws = w.clone().requires_grad_()
        ops.int8_linear(xs, ws, int8_backward=True, seed=s).backward(g)
        mx += float((xs.grad.double() - exact_gx).square().sum()) / SEEDS
        mw += float((ws.grad.double() - exact_gw).square().sum()) / SEEDS
    bl = module_bilinear(torch.nn.Linear(32, 24))
    k = SPECS[P.int8_full]
    assert k is not None and (k.g, k.g_w) == ("int8row", "int8gcol")
    vg_x = element_variance(g, k.g)    # per row (token) for the input gradient
    vg_w = element_variance(g, k.g_w)  # per output channel for the weight gradient
    vw = element_variance(w, "int8+col", per_channel=True)
    vx = element_variance(x, "int8")
    pred_gx = float(bl.grad_a(x.shape, w.square(), vg_x).sum()
                    + bl.grad_a(x.shape, vw, g.square()).sum())
    pred_gw = float(bl.grad_b(vx, w.shape, g.square()).sum()
                    + bl.grad_b(x.square(), w.shape, vg_w).sum())
    assert pred_gx == pytest.approx(mx, rel=0.06)
    assert pred_gw == pytest.approx(mw, rel=0.04)
    one = element_variance(g, "int8")  # the per-tensor model of before
    assert float(bl.grad_a(x.shape, w.square(), one).sum()) > 2 * float(
        bl.grad_a(x.shape, w.square(), vg_x).sum())


def test_fp16_and_bf16_forward_error_against_real_rounding() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(256, 128, generator=gen)
    w = torch.randn(96, 128, generator=gen)
    bl = module_bilinear(torch.nn.Linear(128, 96))
    exact = x.double() @ w.double().t()
    for dtype, kind in ((torch.float16, "m10"), (torch.bfloat16, "m7")):
        actual = float(((x.to(dtype).double() @ w.to(dtype).double().t()) - exact).square().sum())
        predicted = _predicted_fwd(bl, x, w, kind, kind)
        # Round-to-nearest is deterministic; the uniform-error model holds on average.
        assert predicted == pytest.approx(actual, rel=0.15), dtype


def test_element_variance_properties() -> None:
    t = torch.tensor([0.0, 1.0, -0.5, 0.25])
    v = element_variance(t, "int8")  # step 1/127: 1.0 and 0 sit on the grid
    assert v[0] == 0 and v[1] == 0 and torch.all(v >= 0)
    assert float(v.max()) <= (1 / 127) ** 2 / 4 + 1e-12
    assert float(element_variance(torch.tensor([1.0]), "m10")) == pytest.approx(2.0**-20 / 12)
    assert float(element_variance(torch.tensor([1e-6]), "m10")) == pytest.approx(2.0**-48 / 12)
    # tf32 keeps the fp32 range: 1e-6 (about 2^-20) is normal there, subnormal in fp16.
    assert float(element_variance(torch.tensor([2.0**-20]), "tf32")) == pytest.approx(2.0**-60 / 12)
    rtn = element_variance(torch.tensor([0.3, 1.0]), "int8", stochastic=False)
    assert float(rtn[0]) == pytest.approx(((round(0.3 * 127) - 0.3 * 127) / 127) ** 2, rel=1e-4)


@pytest.fixture(scope="module")
def digits_tables(tmp_path_factory) -> dict[str, IndicatorTable]:
    folder = tmp_path_factory.mktemp("ind")
    return {m: indicate("digits_cnn", batches=3, method=m, cache_dir=folder) for m in METHODS}


def test_every_method_covers_every_choosable_op(digits_tables) -> None:
    graph = trace("digits_cnn")
    for method, table in digits_tables.items():
        assert set(table.values) == {o.name for o in graph.choosable_ops()}
        for op in graph.choosable_ops():
            row = table.values[op.name]
            assert set(row) == set(op.allowed_precisions)
            assert row[P.fp32] == 0.0
            assert all(v > 0 for p, v in row.items() if p != P.fp32), (method, op.name)
        for row in table.values.values():
            for ladder in LADDERS:
                vals = [row[p] for p in ladder if p in row]
                assert vals == sorted(vals), (method, row)
        assert table.data == "real"


def test_qsync_combines_terms_with_depth_weights(digits_tables) -> None:
    table = digits_tables["qsync"]
    graph = trace("digits_cnn")
    big_l = graph.max_depth
    weights = []
    for op in graph.choosable_ops():
        vf, vb = table.terms[op.name][P.int8]
        expected = 4.0 * (big_l - op.depth) * vf + op.depth * vb
        assert table.values[op.name][P.int8] == pytest.approx(expected)
        weights.append((op.depth, op.depth / (4.0 * (big_l - op.depth))))
    # Deeper ops weigh their backward term more (relative to the forward term).
    weights.sort()
    assert [w for _, w in weights] == sorted(w for _, w in weights)
    assert weights[0][0] < weights[-1][0]


def test_deterministic_under_seed_and_cached(digits_tables, tmp_path, monkeypatch) -> None:
    for method in METHODS:
        again = indicate("digits_cnn", batches=3, method=method, cache=False)
        assert again.values == digits_tables[method].values, method
    other = indicate("digits_cnn", batches=3, method="qsync", seed=1, cache=False)
    assert other.values != digits_tables["qsync"].values
    first = indicate("digits_cnn", batches=2, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 1

    def boom(*a, **k):
        raise AssertionError("recomputed instead of reusing the cache")

    monkeypatch.setattr("qsync_opt.indicator.compute.qsync_terms", boom)
    assert indicate("digits_cnn", batches=2, cache_dir=tmp_path) == first


def test_monotone_enforcement_counts_fixes() -> None:
    row = {"op": {P.fp32: 0.0, P.fp16: 2.0, P.bf16: 1.0, P.fp8: 3.0, P.int8: 5.0,
                  P.int8_full: 4.0}}
    assert enforce_monotone(row) == 2
    assert row["op"][P.bf16] == 2.0 and row["op"][P.int8_full] == 5.0


def test_qsync_terms_are_zero_at_fp32_and_first_layer_has_no_input_gradient() -> None:
    gen = torch.Generator().manual_seed(4)
    a, b, g = (torch.randn(8, 16, generator=gen), torch.randn(4, 16, generator=gen),
               torch.randn(8, 4, generator=gen))
    bl = module_bilinear(torch.nn.Linear(16, 4))
    cap = OpCapture(a=a, b=b, y=a @ b.t(), a_needs_grad=False, g=g)
    out = qsync_terms(bl, cap, [P.fp32, P.int8], True)
    assert out[P.fp32] == (0.0, 0.0)
    with_input = qsync_terms(bl, OpCapture(a=a, b=b, y=a @ b.t(), a_needs_grad=True, g=g),
                              [P.int8], True)
    assert with_input[P.int8][1] > out[P.int8][1] > 0


def test_batch_scaling_and_errors(digits_tables) -> None:
    table = digits_tables["qsync"]
    assert scale_to_batch(table, 7) == table.values
    with pytest.raises(QsyncInputError, match="method"):
        indicate("digits_cnn", method="magic")
    with pytest.raises(QsyncInputError, match="batches"):
        indicate("digits_cnn", batches=0)


@pytest.mark.slow
def test_synthetic_data_for_catalog_workloads() -> None:
    table = indicate("resnet18", batches=1, batch=2, cache=False)
    assert table.data == "synthetic" and len(table.values) == 20
    assert "synthetic data" in table.notes[0]


def test_cli_indicate(capsys, tmp_path) -> None:
    from qsync_opt.cli import main

    out_file = tmp_path / "ind.json"
    assert main(["indicate", "--model", "digits_cnn", "--batches", "2", "--out", str(out_file),
                 "--no-cache"]) == 0
    out = capsys.readouterr().out
    assert "most sensitive" in out and "conv2" in out
    assert IndicatorTable.model_validate_json(out_file.read_text()).method == "qsync"
    with pytest.raises(SystemExit) as info:
        main(["indicate", "--model", "digits_cnn", "--batches", "0"])
    assert info.value.code == 2


def test_fast_variance_propagation_stays_close_to_the_full_one() -> None:
    full = indicate("digits_cnn", batches=2, cache=False)
    fast = indicate("digits_cnn", batches=2, cache=False, term_dtype=torch.bfloat16,
                    term_rows=16)
    for op, row in full.values.items():
        for p, v in row.items():
            if v > 0:
                assert fast.values[op][p] == pytest.approx(v, rel=0.3), (op, p)


# ----------------------------------------------------------------------------- memory

_PEAK_CHILD = r"""
import gc, json, sys
from qsync_opt.graph import trace
from qsync_opt.indicator import fast_options, indicate, indicator_memory

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

model, batch, method = sys.argv[1], int(sys.argv[2]), sys.argv[3]
graph = trace(model, batch)
est = indicator_memory(graph, method)
gc.collect()
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS: the peak from here on
base = status("VmRSS")
indicate(model, 1, method, batch=batch, graph=graph, cache=False, memory_check=False,
         **fast_options())
print(json.dumps({"estimate": est.total, "peak": status("VmHWM") - base}))
"""


@pytest.mark.parametrize("model,batch,method", [
    # a child process whose peak RSS is read: a run of seconds, for the full suite
    pytest.param("resnet18", 4, "wvar", marks=pytest.mark.slow),
    pytest.param("tiny_gpt", 8, "qsync", marks=pytest.mark.slow),  # 20-35 s on 2 cores
    # curv: 383 MB measured against 411 MB estimated; 25-55 s
    pytest.param("tiny_gpt", 8, "curv", marks=pytest.mark.slow),
])
def test_indicator_memory_estimate_is_within_a_factor_of_the_measured_peak(model, batch,
                                                                           method) -> None:
    """The child's own peak (VmHWM in /proc/self/status after resetting it, less the
    resident size before the run; ru_maxrss would count the parent's size across exec)."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _PEAK_CHILD, model, str(batch), method],
                          capture_output=True, text=True, timeout=600, check=True)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    ratio = got["peak"] / got["estimate"]
    assert 0.5 <= ratio <= 2.0, got


def test_indicator_memory_components_come_from_the_graph() -> None:
    from qsync_opt.indicator import RUNTIME_BYTES, indicator_memory

    g = trace("resnet18", 4)
    m = indicator_memory(g, "qsync")
    assert m.weights == g.param_bytes + g.buffer_bytes and m.gradients == g.param_bytes
    assert m.activations == g.saved_activation_bytes and m.runtime == RUNTIME_BYTES
    assert m.captures == sum(8 * o.output_numel for o in g.choosable_ops())
    g8 = trace("resnet18", 8)
    assert indicator_memory(g8, "qsync").activations == pytest.approx(2 * m.activations,
                                                                      rel=0.01)
    assert indicator_memory(g, "random").total == 0
    assert indicator_memory(g, "hessian").activations == 3 * m.activations
    with pytest.raises(QsyncInputError, match="method"):
        indicator_memory(g, "nope")


def test_indicate_refuses_in_one_line_when_the_model_would_not_fit(monkeypatch) -> None:
    import qsync_opt.indicator.compute as mod
    import qsync_opt.indicator.memory as memory

    def guarded(wl):
        def build():
            if torch.empty(0).device.type != "meta":  # tracing builds on the meta device
                raise AssertionError("the model was built")
            return wl.build()
        return dataclasses.replace(wl, build=build)

    # A machine with 100 MiB free; building the model would fail the test: the refusal
    # comes first, before any model is built.
    real = mod.resolve_workload
    monkeypatch.setattr(mod, "resolve_workload", lambda name: guarded(real(name)))
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 100 * 2**20)
    with pytest.raises(QsyncInputError) as exc:
        indicate("resnet18", 1, batch=4, cache=False)
    msg = str(exc.value)
    need = mod.indicator_memory(trace("resnet18", 4), "qsync")
    assert "\n" not in msg
    assert msg.startswith(f"indicator: the qsync indicator of resnet18 runs the model on this "
                          f"CPU and needs about {need.describe()}; this machine has 0.10 GiB "
                          "available")
    for choice in ("--indicator FILE", "--method random", "--indicator-batch", "fewer layers"):
        assert choice in msg
    # The random method runs no model, whatever the memory.
    table = indicate("resnet18", 1, "random", batch=4, cache=False)
    assert table.method == "random" and len(table.values) == len(
        trace("resnet18", 4).choosable_ops())


def test_indicate_shows_its_memory_and_progress(capsys, monkeypatch) -> None:
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a terminal: header and bar
    indicate("digits_cnn", 2, "wvar", batch=8, cache=False, progress=True)
    err = capsys.readouterr().err
    assert "indicator wvar: digits_cnn (" in err and "M parameters) on this CPU, about" in err
    assert "GiB available" in err and "batch 2/2" in err
    # off a terminal: no header (a refusal after it stays one line), no line per batch;
    # the report line says what was computed
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    said: list[str] = []
    indicate("digits_cnn", 2, "wvar", batch=8, cache=False, progress=True, report=said.append)
    assert capsys.readouterr().err == ""
    assert len(said) == 1 and said[0].startswith("indicator wvar: computed on this CPU in ")
    assert "2 batch(es) of 8" in said[0] and said[0].endswith("not cached")


def test_a_cached_table_without_int4_serves_callers_that_do_not_need_it(tmp_path, monkeypatch) -> None:
    """A table cached before int4 joined the ops' menus is reused for a cluster without
    int4 (build_problem passes the cluster's menus as ``needs``) and recomputed for one
    with it."""
    from qsync_opt.documents.io import load, save

    first = indicate("digits_cnn", batches=2, cache_dir=tmp_path)
    (path,) = tmp_path.glob("*.json")
    doc = load(path, IndicatorTable)
    old = doc.model_copy(update={"values": {op: {p: v for p, v in row.items() if p != P.int4}
                                            for op, row in doc.values.items()}})
    save(old, path)
    assert all(P.int4 in row for row in first.values.values())

    def boom(*a, **k):
        raise AssertionError("recomputed instead of reusing the cache")

    with monkeypatch.context() as m:
        m.setattr("qsync_opt.indicator.compute.qsync_terms", boom)
        reused = indicate("digits_cnn", batches=2, cache_dir=tmp_path,
                          needs={P.fp32, P.fp16, P.int8, P.int8_full})
        assert reused.values == old.values
    again = indicate("digits_cnn", batches=2, cache_dir=tmp_path, needs={P.fp32, P.int4})
    assert again.values == first.values
    assert indicate("digits_cnn", batches=2, cache_dir=tmp_path) == again
