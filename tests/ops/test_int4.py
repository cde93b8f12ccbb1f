"""INT4 end to end: the precision, its quantizer and integer GEMM, the runtime layers, the
opt-in device menus (``NAME:int4``, ``enable_int4``, ``--int4``), the cost model, a solve
that uses int4 only where it pays, plan files with and without int4, and the refusals."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn
from torch.nn.grad import conv2d_input, conv2d_weight

from qsync_opt import QsyncInputError, estimate, load_cluster, ops, trace
from qsync_opt.core.precision import BY_FIDELITY, OPT_IN, PRECISION_INFO, DType, Precision
from qsync_opt.costs.devices import CATALOG, enable_int4, get_device, int4_device
from qsync_opt.documents.io import to_json
from qsync_opt.documents.schemas import DeviceSpec, Efficiencies, Plan, json_schema
from qsync_opt.indicator import LADDERS, SPECS, element_variance, enforce_monotone
from qsync_opt.ops import reference as ref
from qsync_opt.planner.solve import build_problem, solve
from qsync_opt.problem.plan import check_plan, make_plan
from qsync_opt.problem.program import ProblemOptions
from qsync_opt.problem.synthetic import random_indicator
from qsync_opt.runtime import apply_precisions
from support.harness import run_cli

P = Precision
GOLDEN = Path(__file__).resolve().parents[1] / "golden"


# ----------------------------------------------------------------------------- vocabulary


def test_int4_precision_info_and_order() -> None:
    info = P.int4.info
    assert (info.fwd_compute, info.bwd_compute, info.takes_in, info.gives_out,
            info.saved_dtype, info.weight_dtype) == (DType.int4, DType.fp16, DType.int4,
                                                     DType.fp32, DType.int4, DType.int4)
    assert info.family == "fixed"
    assert info.rank == -1 and info.rank < PRECISION_INFO[P.int8_full].rank
    assert BY_FIDELITY[-1] == P.int4 and BY_FIDELITY[-2] == P.int8_full
    assert OPT_IN == frozenset({P.int4})
    assert DType.int4.itemsize == 1  # int8 storage, the one rule of the memory model
    # int8_full and int4 are separate ladders (one adds backward error, one forward error)
    assert (P.fp32, P.int8, P.int4) in LADDERS and (P.fp32, P.int8, P.int8_full) in LADDERS
    row = {P.fp32: 0.0, P.int8: 2.0, P.int8_full: 5.0, P.int4: 1.0}
    assert enforce_monotone({"op": row}) == 1
    assert row == {P.fp32: 0.0, P.int8: 2.0, P.int8_full: 5.0, P.int4: 2.0}


# ----------------------------------------------------------------------------- quantizer


def test_int4_quantize_nearest_is_exact_and_in_range() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(33, 17, generator=gen) * 3
    q, s = ops.quantize_int4(x, stochastic=False)
    assert q.dtype == torch.int8 and s.shape == ()
    amax = x.abs().max()
    assert float(s) == pytest.approx(float(amax) / 7, rel=1e-7)
    assert int(q.min()) >= -7 and int(q.max()) <= 7
    assert int(q.abs().max()) == 7  # the abs-max element lands on the top level
    expected = torch.clamp(torch.round(x * (7.0 / amax)), -7, 7).to(torch.int8)
    assert torch.equal(q, expected)
    err = ops.dequantize_int8(q, s) - x
    assert float(err.abs().max()) <= float(s) / 2 * (1 + 1e-6)
    # 15 levels: every representable value k*s round-trips exactly, both roundings
    levels = torch.arange(-7, 8, dtype=torch.float32) * 0.25
    for stochastic in (False, True):
        ql, sl = ops.quantize_int4(levels, stochastic=stochastic, seed=11)
        assert float(sl) == 0.25
        assert torch.equal(ql, torch.arange(-7, 8, dtype=torch.int8))
        assert torch.equal(ops.dequantize_int8(ql, sl), levels)


def test_int4_per_channel_and_per_group_scales() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(6, 10, generator=gen)
    q, s = ops.quantize_int4(w, axis=0, stochastic=False)
    assert torch.equal(s, w.abs().amax(dim=1) / 7)
    assert torch.equal(q, torch.clamp(torch.round(w * (7.0 / w.abs().amax(dim=1, keepdim=True))),
                                      -7, 7).to(torch.int8))
    x = torch.randn(5, 8, generator=gen)
    x[4] *= 100  # its own (short) group
    qg, sg = ops.quantize_int4(x, group_rows=2, stochastic=False)
    rows = x.abs().amax(dim=1)
    want = torch.stack([rows[0:2].max()] * 2 + [rows[2:4].max()] * 2 + [rows[4]]) / 7
    assert torch.equal(sg, want)
    assert torch.equal(qg, torch.clamp(torch.round(x * (7.0 / (want * 7)).reshape(-1, 1)),
                                       -7, 7).to(torch.int8))
    assert int(qg[4].abs().max()) == 7 and int(qg[:4].abs().max()) == 7


def test_int4_compiled_kernel_equals_reference_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 48, generator=gen)
    for stochastic in (False, True):
        q, s = ops.quantize_int4(x, stochastic=stochastic, seed=1234)
        inv = (7.0 / ref.channel_amax(x, per_channel=False))
        assert torch.equal(q, ref.quantize_int4(x.contiguous(), inv, stochastic, 1234))
        assert int(q.abs().max()) <= 7
    # at the clamp: amax * (7 / amax) may round above 7; stochastic rounding must not give 8
    edge = torch.full((4096,), 1.0 / 3.0)
    for seed in range(20):
        qe, _ = ops.quantize_int4(edge, stochastic=True, seed=seed)
        assert int(qe.max()) == 7 and int(qe.min()) == 7


def test_int4_stochastic_rounding_is_unbiased_with_the_indicator_variance() -> None:
    n = 200_000
    x = torch.full((n,), 2.3)
    x[0] = 7.0  # scale exactly 1: y = 2.3, q in {2, 3}
    q, s = ops.quantize_int4(x, stochastic=True, seed=7)
    assert float(s) == 1.0
    body = q[1:].to(torch.float64)
    assert set(body.unique().tolist()) == {2.0, 3.0}
    frac = float(torch.tensor(2.3, dtype=torch.float32)) - 2.0
    se = (frac * (1 - frac) / (n - 1)) ** 0.5
    assert abs(float(body.mean()) - 2.3) < 5 * se  # se = 0.001
    measured_var = float(((body - float(torch.tensor(2.3))) ** 2).mean())
    assert measured_var == pytest.approx(frac * (1 - frac), rel=0.02)
    # the indicator's error model gives exactly s^2 frac (1 - frac) per element
    v = element_variance(x, "int4", stochastic=True)
    assert float(v[1]) == pytest.approx(frac * (1 - frac), rel=1e-5)
    assert float(v[0]) == 0.0
    # round-to-nearest: s^2 e^2 with e the distance to the nearest level
    vn = element_variance(x, "int4", stochastic=False)
    assert float(vn[1]) == pytest.approx(0.3 ** 2, rel=1e-5)
    # int4 rounding on one tensor is (127/7)^2 times int8's on uniform fractions
    u = torch.rand(100_000, generator=torch.Generator().manual_seed(3)) * 2 - 1
    ratio = float(element_variance(u, "int4").mean() / element_variance(u, "int8").mean())
    assert ratio == pytest.approx((127 / 7) ** 2, rel=0.05)
    assert SPECS[P.int4] is not None and SPECS[P.int4].a == "int4n"  # type: ignore[union-attr]


# ----------------------------------------------------------------------------- GEMM


@pytest.mark.parametrize("group_rows", [0, 3], ids=["per-tensor", "per-group"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_int4_linear_forward_equals_the_integer_reference(group_rows: int,
                                                          stochastic: bool) -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 40, generator=gen)
    w = torch.randn(24, 40, generator=gen)
    b = torch.randn(24, generator=gen)
    seed = 99
    out = ops.int4_linear(x, w, b, group_rows=group_rows, stochastic=stochastic, seed=seed)
    x_seed, w_seed, _, _ = ops.int8.seeds(seed)
    qx, sx = ops.quantize_int4(x.reshape(-1, 40), stochastic=stochastic, seed=x_seed,
                               group_rows=group_rows)
    qw, sw = ops.quantize_int4(w, axis=0, stochastic=stochastic, seed=w_seed)
    assert int(qx.abs().max()) <= 7 and int(qw.abs().max()) <= 7
    acc = ref.int_mm_reference(qx, qw.t())  # exact int64
    assert torch.equal(ops.int_mm(qx, qw.t()).to(torch.int64), acc)  # int32 accumulation
    if group_rows:
        want = ref.rescale_int32_rows(acc.to(torch.int32), sx, sw, b, torch.float32)
    else:
        want = ref.rescale_int32(acc.to(torch.int32), sx, sw, b, torch.float32)
    assert torch.equal(out, want.reshape(2, 5, 24))
    exact = x @ w.t() + b
    assert float((out - exact).abs().max()) < 0.5 * float(exact.abs().max())


def test_int4_linear_backward_is_16_bit_on_the_saved_int4_operands() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 32, generator=gen, requires_grad=True)
    w = torch.randn(16, 32, generator=gen, requires_grad=True)
    g = torch.randn(6, 16, generator=gen)
    out, qx, sx, qw, sw = torch.ops.qsync.int4_linear(x, w, None, 0, True, 3, torch.bfloat16)
    out.backward(g)
    g16 = g.to(torch.bfloat16)
    w16 = ops.dequantize_int8(qw, sw, 0, torch.bfloat16)
    x16 = ops.dequantize_int8(qx, sx, None, torch.bfloat16)
    assert torch.equal(x.grad, (g16 @ w16).float())
    assert torch.equal(w.grad, (g16.t() @ x16).float())
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


def test_int4_conv2d_equals_integer_conv_and_16_bit_backward() -> None:
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 4, 7, 7, generator=gen, requires_grad=True)
    w = torch.randn(6, 4, 3, 3, generator=gen, requires_grad=True)
    b = torch.randn(6, generator=gen)
    out, qx, sx, qw, sw = torch.ops.qsync.int4_conv2d(x, w, b, [1, 1], [1, 1], [1, 1], 1,
                                                       True, 8, torch.bfloat16)
    assert int(qx.abs().max()) <= 7 and int(qw.abs().max()) <= 7
    iconv = F.conv2d(qx.double(), qw.double(), None, 1, 1)  # integer-valued, exact
    assert torch.equal(iconv, iconv.round())
    want = iconv * (sx.double() * sw.double()).reshape(1, -1, 1, 1) + b.double().reshape(1, -1, 1, 1)
    assert torch.allclose(out.double(), want, rtol=1e-6, atol=1e-5)
    g = torch.randn(out.shape, generator=gen)
    out.backward(g)
    g16 = g.to(torch.bfloat16)
    w16 = ops.dequantize_int8(qw, sw, 0, torch.bfloat16)
    x16 = ops.dequantize_int8(qx, sx, None, torch.bfloat16)
    assert torch.equal(x.grad, conv2d_input(list(x.shape), w16, g16, [1, 1], [1, 1]).float())
    assert torch.equal(w.grad, conv2d_weight(x16, list(w.shape), g16, [1, 1], [1, 1]).float())


def test_layers_at_int4_match_the_ops() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 5 * 5, 7))
    x = torch.randn(2, 3, 5, 5)
    conv, lin = model[0], model[2]
    applied = apply_precisions(model, {"0": "int4", "2": "int4"}, seed=3)
    assert applied == {"0": P.int4, "2": P.int4}
    s0, s2 = model[0].qseed + 1, model[2].qseed + 1  # the seed each layer's next call takes
    y = model(x)
    h = ops.int4_conv2d(x, conv.weight, conv.bias, 1, 1, seed=s0)
    want = ops.int4_linear(h.flatten(1), lin.weight, lin.bias, seed=s2)
    assert torch.equal(y, want)
    y.sum().backward()
    conv, lin = model[0], model[2]
    assert conv.weight.grad.dtype == torch.float32 and torch.isfinite(lin.weight.grad).all()


def _torch_int4(t: torch.Tensor, axis: int | None) -> torch.Tensor:
    """torch's own round-half-even of ``t / scale`` at the kernels' scales (amax / 7 per
    tensor or per slice along ``axis``), clamped to [-7, 7]."""
    moved = t if axis is None else t.movedim(axis, 0)
    amax = moved.abs().amax() if axis is None else moved.reshape(moved.shape[0], -1).abs().amax(1)
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    inv = 7.0 / amax
    shape = (-1,) + (1,) * (moved.dim() - 1) if axis is not None else ()
    q = torch.clamp(torch.round(moved * inv.reshape(shape)), -7, 7).to(torch.int8)
    return q if axis is None else q.movedim(0, axis)


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_int4_forward_rounds_to_nearest_by_default_as_torch_does(backend: str,
                                                                 monkeypatch) -> None:
    """Every int4 path (linear, conv, fake-quant, the layers) rounds its forward operands to
    nearest by default, equal to torch's rounding of the same scales; stochastic rounding
    only when asked."""
    from qsync_opt.ops import _build

    if backend == "reference":
        monkeypatch.setattr(ops.backends, "use_cpp", lambda t: False)
    else:
        assert _build.load_cpu()[0]
    assert ops.NUMERICS.int4_forward_stochastic is False
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(6, 32, generator=gen) * torch.logspace(-2, 1, 32)
    w = torch.randn(16, 32, generator=gen)
    _, qx, _, qw, _ = torch.ops.qsync.int4_linear(x, w, None, 0, False, 3, torch.bfloat16)
    assert torch.equal(qx, _torch_int4(x, None)) and torch.equal(qw, _torch_int4(w, 0))
    out = ops.int4_linear(x, w, seed=3)  # the default: the same as stochastic=False
    assert torch.equal(out, torch.ops.qsync.int4_linear(x, w, None, 0, False, 9,
                                                        torch.bfloat16)[0])
    assert not torch.equal(out, ops.int4_linear(x, w, seed=3, stochastic=True))
    xc = torch.randn(2, 4, 6, 6, generator=gen)
    wc = torch.randn(5, 4, 3, 3, generator=gen)
    _, qxc, _, qwc, _ = torch.ops.qsync.int4_conv2d(xc, wc, None, [1, 1], [1, 1], [1, 1], 1,
                                                     False, 2, torch.bfloat16)
    assert torch.equal(qxc, _torch_int4(xc, None)) and torch.equal(qwc, _torch_int4(wc, 0))
    assert torch.equal(ops.int4_conv2d(xc, wc, padding=1, seed=1),
                       ops.int4_conv2d(xc, wc, padding=1, seed=2))  # no seed: no noise
    fq = ops.fake_quant_int4(x, seed=5)
    amax = x.abs().amax()
    assert torch.equal(fq, (_torch_int4(x, None).float() * ref.scale_of(amax.reshape(1), 7)))
    with ops.numerics(int4_forward_stochastic=True):
        assert not torch.equal(ops.fake_quant_int4(x, seed=5), fq)


def test_int4_layers_and_indicator_follow_the_rounding() -> None:
    """The layers take the ops' default (no seed dependence at int4), and the indicator's
    int4 rows model round-to-nearest whatever its int8 ``stochastic``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(4, 8)
    a, b = (apply_precisions(m, {"0": "int4", "2": "int4"}, seed=s) and m(x)
            for m, s in ((model, 1), (__import__("copy").deepcopy(model), 2)))
    assert torch.equal(a, b)
    k = SPECS[P.int4]
    assert (k.a, k.b, k.a_bwd, k.b_bwd) == ("int4n",) * 4
    t = torch.randn(64, generator=torch.Generator().manual_seed(1))
    rtn = element_variance(t, "int4n", stochastic=True)
    assert torch.equal(rtn, element_variance(t, "int4", stochastic=False))
    assert float(rtn.sum()) < float(element_variance(t, "int4", stochastic=True).sum())


# ----------------------------------------------------------------------------- opt-in menus


def test_no_default_menu_has_int4_and_the_peaks_are_the_published_ones() -> None:
    assert all(P.int4 not in d.precisions for d in CATALOG.values())
    peaks = {n: d.peak_tflops.get(DType.int4) for n, d in CATALOG.items()}
    assert {n: v for n, v in peaks.items() if v is not None} == {"t4": 260.0, "a10": 500.0}
    t4 = get_device("t4:int4")
    assert t4.name == "t4:int4" and t4.precisions == [*CATALOG["t4"].precisions, P.int4]
    assert t4.peak_tflops == CATALOG["t4"].peak_tflops
    assert DeviceSpec.model_validate_json(t4.model_dump_json()) == t4
    for name in ("h100", "h200", "v100", "l4", "a100"):
        with pytest.raises(QsyncInputError, match="no INT4 peak"):
            get_device(f"{name}:int4")
    with pytest.raises(QsyncInputError, match="a CPU takes it from its ~CARD"):
        get_device("cpu/2:int4")
    # a DeviceSpec document listing int4 without an INT4 peak is refused by name
    doc = CATALOG["h100"].model_dump(mode="json")
    doc["precisions"].append("int4")
    with pytest.raises(ValidationError, match="precision int4 needs a peak_tflops entry for int4"):
        DeviceSpec.model_validate(doc)


def test_derived_cpu_with_int4_runs_it_at_the_int8_rate(fixed_cpu) -> None:
    spec = get_device("cpu/2~t4:int4")
    base = get_device("cpu/2~t4")
    assert spec.precisions == [*base.precisions, P.int4] and P.int4 not in base.precisions
    assert spec.peak_tflops[DType.int4] == base.peak_tflops[DType.int8]
    assert spec.slowdown == 2.0 and "no speed gain" in spec.source
    assert int4_device("cpu/2~t4") == "cpu/2~t4:int4" and int4_device("cpu") is None


def test_enable_int4_and_the_cluster_file(tmp_path: Path) -> None:
    cluster, got = enable_int4(load_cluster("h100x2+t4x4+a10x1+cpu/2~t4x1"))
    assert got == ["t4", "a10", "cpu"]
    assert [g.device for g in cluster.groups] == ["h100", "t4:int4", "a10:int4", "cpu/2~t4:int4"]
    assert enable_int4(cluster)[0] == cluster  # idempotent
    short = load_cluster("v100x2+t4:int4x2")
    assert [(g.name, g.device) for g in short.groups] == [("v100", "v100"), ("t4", "t4:int4")]
    good = tmp_path / "c.json"
    good.write_text(json.dumps({"groups": [{"name": "weak", "device": "t4:int4", "count": 2}]}))
    assert load_cluster(good).groups[0].device == "t4:int4"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"groups": [{"name": "big", "device": "h100:int4", "count": 2}]}))
    with pytest.raises(QsyncInputError, match=r"groups\.0\.device.*h100 has no INT4 peak"):
        load_cluster(bad)


# ----------------------------------------------------------------------------- cost model


def test_int4_roofline_on_t4() -> None:
    m, k, n = 4096, 1024, 1024
    graph = trace(nn.Sequential(nn.Linear(k, n, device="meta")),
                  example_inputs=(torch.empty(m, k, device="meta"),), pin_head=False)
    eff = Efficiencies()
    plain = estimate(graph, load_cluster("t4x1"))
    assert not any(e.precision == P.int4 for e in plain.entries)
    assert not any(c.dst == DType.int4 for c in plain.casts)
    costs = estimate(graph, load_cluster("t4:int4x1"))
    (c,) = [e for e in costs.entries if e.precision == P.int4]
    assert c.device == "t4:int4"
    compute_ms = 2 * m * k * n / (260e12 * eff.int8_gemm) * 1e3
    memory_ms = (m * k * 1 + m * n * 4 + k * n * 1) / (300e9 * eff.memory) * 1e3
    assert c.fwd_ms == pytest.approx(max(compute_ms, memory_ms) + 0.005, rel=1e-12)
    (i8,) = [e for e in costs.entries if e.precision == P.int8]
    assert c.bwd_ms == i8.bwd_ms  # the same fp16 backward
    cast = next(x for x in costs.casts if x.src == DType.fp32 and x.dst == DType.int4)
    assert cast.a_ms_per_element == pytest.approx(
        (4 + 1) / (300e9 * eff.memory) * 1e3 * eff.quantize_cast_factor, rel=1e-12)


# ----------------------------------------------------------------------------- solve


def _big_linear_graph():
    # A forward-heavy first layer (its input needs no gradient: backward is the weight
    # gradient alone) and a small head: int4's forward pays on the first, not on the head.
    return trace(nn.Sequential(nn.Linear(4096, 8192, device="meta"), nn.ReLU(),
                               nn.Linear(8192, 64, device="meta")),
                 example_inputs=(torch.empty(32768, 4096, device="meta"),), pin_head=False)


def _indicator(graph):
    table = random_indicator(graph, 0, opt_in=True)
    values = {"0": {P.fp32: 0.0, P.tf32: 0.5, P.fp16: 1.0, P.bf16: 1.5, P.fp8: 1.8,
                    P.int8: 2.0, P.int8_full: 3.0, P.int4: 4.0},
              "2": {P.fp32: 0.0, P.tf32: 5.0, P.fp16: 10.0, P.bf16: 15.0, P.fp8: 18.0,
                    P.int8: 20.0, P.int8_full: 30.0, P.int4: 40.0}}
    return table.model_copy(update={"values": values})


@pytest.mark.parametrize("solver", ["highs", "cpsat"])
def test_solve_uses_int4_only_where_it_pays_and_only_when_enabled(solver: str) -> None:
    graph = _big_linear_graph()
    ind = _indicator(graph)

    def plan_of(cluster: str, target: float):
        problem = build_problem(graph, cluster, indicator=ind,
                                options=ProblemOptions(target_ms=target))
        plan, report = solve(problem, solver)
        return {op: p for op, p in plan.groups["t4"].precisions.items()}, report.objective

    # a loose target: int8 is enough, int4 is not used even when offered
    assert plan_of("t4x1", 160.0) == ({"0": P.int8, "2": P.fp32}, 2.0)
    assert plan_of("t4:int4x1", 160.0) == ({"0": P.int8, "2": P.fp32}, 2.0)
    # tight: without int4 both layers must drop to fp16; with it, int4 on the big layer
    assert plan_of("t4x1", 145.0) == ({"0": P.fp16, "2": P.fp16}, 11.0)
    assert plan_of("t4:int4x1", 145.0) == ({"0": P.int4, "2": P.fp32}, 4.0)
    # tighter still: reachable only with int4
    assert plan_of("t4:int4x1", 140.0) == ({"0": P.int4, "2": P.fp32}, 4.0)
    with pytest.raises(QsyncInputError, match="INFEASIBLE"):
        plan_of("t4x1", 140.0)


def test_random_indicator_keeps_its_values_without_opt_in(digits_graph) -> None:
    plain = random_indicator(digits_graph, 3)
    with_int4 = random_indicator(digits_graph, 3, opt_in=True)
    for op, row in plain.values.items():
        assert P.int4 not in row
        assert {p: v for p, v in with_int4.values[op].items() if p != P.int4} == row
        assert with_int4.values[op][P.int4] >= row[P.int8]


# ----------------------------------------------------------------------------- plan files


def test_plan_json_round_trips_int4(digits_graph, tmp_path: Path) -> None:
    cluster = load_cluster("t4:int4x2+v100x1")
    ops_ = [o.name for o in digits_graph.choosable_ops()]
    plan = make_plan(digits_graph, cluster, {"t4": {ops_[0]: "int4", ops_[1]: "int8"}})
    path = tmp_path / "plan.json"
    path.write_text(to_json(plan))
    back = Plan.load(path)
    assert back == plan and back.groups["t4"].precisions[ops_[0]] == P.int4
    assert json.loads(path.read_text())["groups"]["t4"]["precisions"][ops_[0]] == "int4"
    check_plan(back, digits_graph)
    # the same plan on a T4 without int4 enabled is refused by op and group
    off = plan.model_copy(update={"cluster": load_cluster("t4x2+v100x1")})
    with pytest.raises(QsyncInputError, match=f"op {ops_[0]}: int4 is not allowed"):
        check_plan(off, digits_graph)


@pytest.mark.parametrize("name", sorted(p.name for p in GOLDEN.glob("*.json")
                                        if p.name.startswith(("resnet50_api-highs",
                                                              "digits_cnn-highs",
                                                              "bert_base_390-highs"))))
def test_old_plan_files_load(name: str) -> None:
    doc = json.loads((GOLDEN / name).read_text())
    plan = Plan.model_validate(doc["plan"])
    used = {p for g in plan.groups.values() for p in g.precisions.values()}
    assert P.int4 not in used and used <= set(P)
    assert to_json(plan) == to_json(Plan.model_validate_json(to_json(plan)))


def test_json_schema_lists_int4() -> None:
    text = json.dumps(json_schema("Plan"))
    assert '"int4"' in text
    assert '"int4"' in json.dumps(json_schema("DeviceSpec"))


# ----------------------------------------------------------------------------- CLI


def test_cli_refuses_int4_on_a_card_without_it(tmp_path: Path) -> None:
    code, _, err = run_cli("estimate", "--model", "digits_cnn", "--cluster", "h100:int4x1")
    assert code == 2 and err.count("\n") == 1
    assert "groups.0.device" in err and "h100 has no INT4 peak" in err
    code, _, err = run_cli("estimate", "--model", "digits_cnn", "--cluster", "h100x2", "--int4")
    assert code == 2 and err.count("\n") == 1 and "int4: no group's card has an INT4 peak" in err
    code, _, err = run_cli("solve", "--model", "digits_cnn", "--cluster", "v100x1+h100x1",
                           "--int4", "--out", str(tmp_path / "p.json"))
    assert code == 2 and err.count("\n") == 1 and "int4: no group's card has an INT4 peak" in err
    assert not (tmp_path / "p.json").exists()


def test_cli_int4_flag_says_which_groups_got_it(tmp_path: Path) -> None:
    out = tmp_path / "costs.json"
    code, _, err = run_cli("estimate", "--model", "digits_cnn", "--cluster", "v100x1+t4x1",
                           "--int4", "--out", str(out))
    assert code == 0, err
    assert "int4: enabled on group(s) t4; not on v100 (no INT4 peak)" in err
    table = json.loads(out.read_text())
    devices = Counter((e["device"], e["precision"]) for e in table["entries"])
    assert devices[("t4:int4", "int4")] == 3 and devices[("v100", "int4")] == 0


# ----------------------------------------------------------------------------- runtime


def test_emulated_data_parallel_trains_an_int4_plan_on_a_derived_cpu(tmp_path: Path) -> None:
    """``cpu/2~t4:int4`` (a CPU standing in for a T4 with int4) runs its int4 ops in the
    runtime: the emulated data-parallel path trains the plan and counts int4 calls."""
    from qsync_opt.job.rank import build_model, emulate, prepare
    from qsync_opt.runtime import count_calls
    from qsync_opt.runtime.config import TrainConfig

    cluster = load_cluster("cpux1@48+cpu/2~t4:int4x1@16")
    assert [(g.name, g.device) for g in cluster.groups] == [("cpu", "cpu"),
                                                            ("cpu_2", "cpu/2~t4:int4")]
    plan = make_plan(trace("digits_cnn"), cluster,
                     {"cpu_2": {"conv1": "int4", "conv2": "int4", "fc1": "int8"}})
    path = tmp_path / "plan.json"
    plan.save(path)
    cfg = TrainConfig(workload="digits_cnn", plan_path=str(path), rank_groups=["cpu", "cpu_2"],
                      steps=20, out_dir=str(tmp_path / "run"), emulate_dp=True,
                      eval_batches=1, timeout_s=60)
    model = build_model(prepare(cfg), 1, torch.device("cpu"))
    x = torch.randn(4, 1, 8, 8)
    with count_calls(model) as calls:
        model(x).sum().backward()
    assert calls["conv1"] == {"int4": 1} and calls["conv2"] == {"int4": 1}
    assert calls["fc1"] == {"int8": 1}
    summary = emulate(cfg)
    assert summary["steps"] == 20 and summary["skipped_steps"] == 0
    rows = [json.loads(line) for line in
            (tmp_path / "run" / "metrics.rank1.jsonl").read_text().splitlines()]
    first = sum(r["loss"] for r in rows[:4]) / 4
    last = sum(r["loss"] for r in rows[-4:]) / 4
    assert rows[0]["group"] == "cpu_2" and last < 0.8 * first
