"""The loss-aware ``curv`` indicator: its second-order prediction against measured loss
changes on quadratic toys, its Hutchinson estimate against exact curvature, its ordering,
and the indicate/CLI paths (docs/ALLOCATION.md, A loss-aware indicator)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qsync_opt.ops as ops
from qsync_opt.core.precision import Precision as P
from qsync_opt.documents.schemas import IndicatorTable
from qsync_opt.indicator import (
    LADDERS,
    METHODS,
    SPECS,
    element_variance,
    indicate,
)
from qsync_opt.indicator.curv import curv_batch

B, K, N = 64, 32, 16


def _toy(w: Tensor_t, name: str = "lin") -> nn.Module:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = w.clone()
    model = nn.Sequential()
    model.add_module(name, lin)
    return model


Tensor_t = torch.Tensor


def _quadratic(t: Tensor_t, a: Tensor_t):
    """L(y) = 1/2 (1/B) sum_n (y_n - t_n)^T A (y_n - t_n), in float64."""
    def loss(y: Tensor_t) -> Tensor_t:
        r = y.double() - t.double()
        return 0.5 * ((r @ a.double()) * r).sum() / y.shape[0]
    return loss


def _predict(model: nn.Module, x: Tensor_t, loss, precisions, *, samples: int = 64,
             lr: float = 0.0, curvature: str = "gn", seed: int = 1, names=("lin",)):
    def run():
        y = model(x)
        return y, loss(y).float()
    terms, used = curv_batch(model, list(names), run, {n: precisions for n in names},
                              samples=samples, gen=torch.Generator().manual_seed(seed), lr=lr,
                              curvature=curvature)
    assert used == curvature
    return terms


def _closed_form(x: Tensor_t, w: Tensor_t, a: Tensor_t, kind: str) -> float:
    """E[dL] exactly, for L quadratic in y = x W^T and independent operand errors:
    1/2 (1/B) [sum v_x (W^T A W)_kk + sum A_ii v_W[i,k] x[n,k]^2]."""
    vx = element_variance(x, kind)
    vw = element_variance(w, kind, per_channel=True)
    waw = (w.t() @ a @ w).diag()
    return 0.5 / x.shape[0] * (float((vx * waw).sum())
                               + float((a.diag()[:, None] * vw * x.square().sum(0)).sum()))


def _dense_toy(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, K, generator=gen)
    w = torch.randn(N, K, generator=gen) / K**0.5
    q, _ = torch.linalg.qr(torch.randn(N, N, generator=gen))
    a = q @ torch.diag(torch.linspace(0.5, 4.0, N)) @ q.t()  # SPD, dense
    t = x @ w.t() + 0.5 * torch.randn(B, N, generator=gen)  # residuals: a first-order term
    return x, w, a, t


@pytest.mark.slow
def test_quadratic_toy_prediction_matches_the_real_int8_kernel() -> None:
    x, w, a, t = _dense_toy()
    loss = _quadratic(t, a)
    predicted = _predict(_toy(w), x, loss, [P.int8])["lin"][P.int8][0]
    # the probes estimate the closed form (64 probes over 1024 outputs: well under 1%)
    assert abs(predicted / _closed_form(x, w, a, "int8") - 1) < 0.01
    base = float(loss(x @ w.t()))
    seeds = 10_000
    d = torch.tensor([float(loss(ops.int8_linear(x, w, seed=s))) - base for s in range(seeds)])
    measured, se = float(d.mean()), float(d.std()) / seeds**0.5
    # the first-order term r^T A dy averages out but dominates the spread: 10k seeds give a
    # standard error of 2.4% of the mean (measured 0.003585 +- 0.000087, predicted 0.003756;
    # 40k seeds measured 0.003749 +- 0.000044)
    assert se < 0.03 * measured
    assert abs(predicted / measured - 1) < 0.10
    # at the loss minimum in y (t = y) only the second-order term is left: 300 seeds suffice
    at_min = _quadratic(x @ w.t(), a)
    d0 = torch.tensor([float(at_min(ops.int8_linear(x, w, seed=s))) for s in range(300)])
    assert float(d0.std()) / 300**0.5 < 0.01 * float(d0.mean())
    assert abs(predicted / float(d0.mean()) - 1) < 0.03


def test_quadratic_toy_with_varied_curvature_weights_each_element() -> None:
    """A diagonal-dominant A whose entries span 100x, with the large-curvature outputs also
    the large-variance ones (their weight rows are larger): the element weighting matters."""
    gen = torch.Generator().manual_seed(3)
    d = torch.logspace(-1, 1, N)
    off = 0.02 * torch.randn(N, N, generator=gen)
    a = torch.diag(d) + (off + off.t()) / 2
    assert torch.linalg.eigvalsh(a).min() > 0
    x = torch.randn(B, K, generator=gen)
    w = torch.randn(N, K, generator=gen) * d.sqrt()[:, None] / K**0.5
    t = x @ w.t() + 0.3 * torch.randn(B, N, generator=gen)
    loss = _quadratic(t, a)
    base = float(loss(x @ w.t()))
    model = _toy(w)
    for p, kind in ((P.int8, "int8"), (P.bf16, "m7")):
        predicted = _predict(model, x, loss, [p])["lin"][p][0]
        # Gaussian operand errors of the error model's variances, in antithetic pairs (the
        # first-order term cancels within a pair; each pair is still an unbiased sample)
        sx = element_variance(x, kind).sqrt()
        sw = element_variance(w, kind, per_channel=True).sqrt()
        g = torch.Generator().manual_seed(7)
        pairs = 2000
        vals = []
        for _ in range(pairs):
            dx, dw = sx * torch.randn(x.shape, generator=g), sw * torch.randn(w.shape, generator=g)
            up = float(loss((x + dx) @ (w + dw).t())) - base
            down = float(loss((x - dx) @ (w - dw).t())) - base
            vals.append((up + down) / 2)
        m = torch.tensor(vals)
        measured, se = float(m.mean()), float(m.std()) / pairs**0.5
        assert se < 0.02 * measured, p
        assert abs(predicted / measured - 1) < 0.10, (p, predicted, measured)
        # weighting every element by the mean curvature instead misses by far more than 10%
        sigma2 = (element_variance(x, kind) @ w.t().square()
                  + x.square() @ element_variance(w, kind, per_channel=True).t())
        flat = 0.5 / B * float(a.diag().mean()) * float(sigma2.sum())
        assert abs(flat / measured - 1) > 0.4, (p, flat, measured)


def _small_net(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    b, k, n, c = 4, 6, 5, 3
    x = torch.randn(b, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    head = torch.randn(c, n, generator=gen)
    labels = torch.randint(0, c, (b,), generator=gen)
    return x, w, head, labels


def test_hutchinson_estimate_against_the_exact_curvature() -> None:
    """On a tanh + linear + cross-entropy net, the exact Hessian and Gauss-Newton matrices in
    the op's output y give the exact E[dL] = 1/2 tr(H Cov(u)); the estimate with n probes
    has variance Var(z^T C z)/4n with C = M^T H M (u = M z), 2 (||C||_F^2 - sum C_ii^2)
    for Rademacher z: it must fall within 4 standard deviations, which are under 6% of it
    (400 probes for Gauss-Newton, 1200 for the indefinite full Hessian)."""
    x, w, head, labels = _small_net()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
            self.lin.weight.data = w.clone()

        def forward(self, inp: Tensor_t) -> Tensor_t:
            return torch.tanh(self.lin(inp)) @ head.t()

    def ce(out: Tensor_t) -> Tensor_t:
        return F.cross_entropy(out, labels)

    y0 = x @ w.t()
    ny = y0.numel()
    h_full = torch.autograd.functional.hessian(
        lambda y: ce(torch.tanh(y.reshape(y0.shape)) @ head.t()), y0.reshape(-1))
    out0 = torch.tanh(y0) @ head.t()
    jac = torch.autograd.functional.jacobian(
        lambda y: (torch.tanh(y.reshape(y0.shape)) @ head.t()).reshape(-1), y0.reshape(-1))
    h_out = torch.autograd.functional.hessian(lambda o: ce(o.reshape(out0.shape)),
                                              out0.reshape(-1))
    h_gn = jac.t() @ h_out @ jac
    # u = M z: M's columns are dy/dx * sqrt(v_x) and dy/dW * sqrt(v_W)
    sx = element_variance(x, "int8").sqrt().reshape(-1)
    sw = element_variance(w, "int8", per_channel=True).sqrt().reshape(-1)
    jx, jw = torch.autograd.functional.jacobian(lambda a, b: (a @ b.t()).reshape(-1), (x, w))
    m = torch.cat([jx.reshape(ny, -1) * sx, jw.reshape(ny, -1) * sw], 1)
    net = Net()
    # the full Hessian is indefinite here (tanh): its estimate spreads more, so more probes
    for curvature, h, probes in (("gn", h_gn, 400), ("hessian", h_full, 1200)):
        c = m.t() @ h @ m
        exact = 0.5 * float(c.trace())
        sd = 0.5 * (2 * float(c.square().sum() - c.diag().square().sum()) / probes) ** 0.5
        assert sd < 0.06 * abs(exact), curvature
        est = _predict(net, x, ce, [P.int8], samples=probes, curvature=curvature)["lin"][P.int8][0]
        assert abs(est - exact) < 4 * sd, (curvature, est, exact, sd)
    assert not torch.allclose(h_gn, h_full)  # tanh's curvature: the two really differ


def _every_precision() -> list[P]:
    return list(SPECS)  # every precision the error model knows


def test_more_curved_op_gets_the_larger_value_and_values_are_monotone() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(B, K, generator=gen)
    w = torch.randn(N, K, generator=gen) / K**0.5
    t = torch.randn(B, N, generator=gen)

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.flat = nn.Linear(K, N, bias=False)
            self.curved = nn.Linear(K, N, bias=False)
            self.flat.weight.data = w.clone()
            self.curved.weight.data = w.clone()

        def forward(self, inp: Tensor_t) -> Tensor_t:
            return torch.cat([self.flat(inp), self.curved(inp)], 1)

    def loss(out: Tensor_t) -> Tensor_t:  # 3x the curvature in the second op's output
        r1, r2 = out[:, :N] - t, out[:, N:] - t
        return 0.5 * (r1.square().sum() + 3.0 * r2.square().sum()) / B

    precisions = _every_precision()
    terms = _predict(Two(), x, loss, precisions, samples=32, lr=0.05,
                     names=("flat", "curved"))
    for p in precisions:
        f_flat, f_curved = terms["flat"][p][0], terms["curved"][p][0]
        if p == P.fp32:
            assert terms["flat"][p] == terms["curved"][p] == (0.0, 0.0)
            continue
        assert f_curved > f_flat > 0, p
        assert abs(f_curved / f_flat - 3.0) < 0.3, p  # equal output variances, 3x curvature
        assert terms["curved"][p][1] > terms["flat"][p][1] > 0, p  # and in the update term
    for name in ("flat", "curved"):
        total = {p: sum(terms[name][p]) for p in precisions}
        for ladder in LADDERS:
            vals = [total[p] for p in ladder if p in total]
            assert vals == sorted(vals), (name, ladder, vals)
        # int8_full's int8 gradients: a larger update term than int8's fp16 ones
        assert terms[name][P.int8_full][1] > terms[name][P.int8][1]
        assert terms[name][P.int8_full][0] == terms[name][P.int8][0]


def test_indicate_curv_on_digits_runs_caches_and_reloads(tmp_path, monkeypatch) -> None:
    assert METHODS[0] == "qsync" and "curv" in METHODS
    table = indicate("digits_cnn", batches=1, method="curv", cache_dir=tmp_path)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and "-curv-" in files[0].name
    again = IndicatorTable.model_validate_json(files[0].read_text())
    assert again == table and table.method == "curv" and table.gamma is None
    assert "nats" in table.notes[0] and "Gauss-Newton" in table.notes[0]
    assert table.terms is not None
    for op, row in table.values.items():
        assert row[P.fp32] == 0.0
        assert all(v > 0 for p, v in row.items() if p != P.fp32), (op, row)
        for p, v in row.items():
            assert v == max(0.0, sum(table.terms[op][p]))

    def boom(*a, **k):
        raise AssertionError("recomputed instead of reusing the cache")

    monkeypatch.setattr("qsync_opt.indicator.compute.curv_batch", boom)
    assert indicate("digits_cnn", batches=1, method="curv", cache_dir=tmp_path) == table
    # another learning rate is another table
    monkeypatch.undo()
    other = indicate("digits_cnn", batches=1, method="curv", cache_dir=tmp_path, lr=0.0)
    assert len(list(tmp_path.glob("*.json"))) == 2
    assert all(v[1] == 0.0 for row in other.terms.values() for v in row.values())


def test_cli_indicate_and_solve_with_curv(capsys, tmp_path, monkeypatch) -> None:
    from qsync_opt.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out_file = tmp_path / "ind.json"
    assert main(["indicate", "--model", "digits_cnn", "--method", "curv", "--batches", "1",
                 "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "indicator curv of digits_cnn" in out and "nats" in out
    assert IndicatorTable.model_validate_json(out_file.read_text()).method == "curv"
    plan = tmp_path / "plan.json"
    assert main(["solve", "--model", "digits_cnn", "--cluster", "cpux1+cpu/2x1", "--method",
                 "curv", "--indicator-batches", "1", "--out", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "curv" in out and "nats" in out
    assert plan.is_file()

