"""Per-call terms of the measuring methods: the qsync variance propagation, fisher, wvar
and hessian, from the captured operands and output gradient of one call."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from qsync_opt.core.precision import Precision
from qsync_opt.indicator.calls import Bilinear, Call
from qsync_opt.indicator.errormodel import SPECS, kind_parts, kinds_for
from qsync_opt.indicator.variances import element_variance


@dataclass
class OpCapture:
    """Operands, output and output gradient of one call of one op in one batch."""

    a: Tensor
    b: Tensor
    y: Tensor
    a_needs_grad: bool
    g: Tensor | None = None


@dataclass
class OpStats:
    """Per-op accumulators over batches: precision -> list of per-batch values."""

    fwd: dict[Precision, list[float]] = field(default_factory=dict)
    bwd: dict[Precision, list[float]] = field(default_factory=dict)
    value: dict[Precision, list[float]] = field(default_factory=dict)


def qsync_terms(bl: Bilinear, cap: OpCapture, precisions: Sequence[Precision],
                 stochastic: bool, term_dtype: torch.dtype = torch.float32,
                 term_rows: int | None = None) -> dict[Precision, tuple[float, float]]:
    """(Var_fwd, Var_bwd) per precision for one captured call.

    ``term_dtype=torch.bfloat16`` evaluates the variance propagation (not the statistics)
    in bf16: each propagated element carries ~0.4% rounding, which averages out in the sums;
    on CPUs with AMX-BF16 it halves the time of large models. ``term_rows`` propagates only
    the first rows (samples) of the batch; scales and variances still come from the whole
    tensors, so each row's terms are exact and only the average sees fewer samples.
    """
    assert cap.g is not None
    rows = slice(None) if not term_rows or cap.a.shape[0] <= term_rows else slice(0, term_rows)
    full = {"a": cap.a, "b": cap.b, "g": cap.g}
    a, y, g = cap.a[rows], cap.y[rows], cap.g[rows]
    b = cap.b if bl.b_is_weight else cap.b[rows]
    memo: dict[tuple[str, str], float] = {}
    var_cache: dict[tuple[str, str], Tensor] = {}

    def var(which: str, kind: str) -> Tensor:
        key = (which, kind)
        if key not in var_cache:
            v = element_variance(full[which], kind,
                                 per_channel=(which == "b" and bl.b_is_weight),
                                 stochastic=stochastic, channel_dim=bl.channel_dim,
                                 groups=bl.groups)
            if not (which == "b" and bl.b_is_weight):
                v = v[rows]
            var_cache[key] = v.to(term_dtype)
        return var_cache[key]

    def term(name: str, kind: str, fn: Callable[[str], Tensor]) -> float:
        total = 0.0
        for base, factor in kind_parts(kind):
            key = (name, base)
            if key not in memo:
                memo[key] = float(fn(base).to(torch.float32).sum())
            total += factor * memo[key]
        return total

    y2 = float(y.square().sum())
    ga = bl.grad_a(a.shape, b, g) if cap.a_needs_grad else None
    gb = bl.grad_b(a, b.shape, g)
    ga2 = float(ga.square().sum()) if ga is not None else 0.0
    gb2 = float(gb.square().sum())
    a2, b2, g2 = (t.square().to(term_dtype) for t in (a, b, g))
    out: dict[Precision, tuple[float, float]] = {}
    for p in precisions:
        k = kinds_for(p, bl.b_is_weight)
        if k is None:
            out[p] = (0.0, 0.0)
            continue
        fwd = term("f_a", k.a, lambda z: bl.f(var("a", z), b2)) + term(
            "f_b", k.b, lambda z: bl.f(a2, var("b", z)))
        bwd = 0.0
        if ga is not None and ga2 > 0:
            e_ga = term("ga_g", k.g, lambda z: bl.grad_a(a.shape, b2, var("g", z))) + term(
                "ga_b", k.b_bwd, lambda z: bl.grad_a(a.shape, var("b", z), g2))
            bwd += e_ga / ga2
        if gb2 > 0:
            e_gb = term("gb_a", k.a_bwd, lambda z: bl.grad_b(var("a", z), b.shape, g2)) \
                + term("gb_g", k.g_w, lambda z: bl.grad_b(a2, b.shape, var("g", z)))
            bwd += e_gb / gb2
        out[p] = (fwd / y2 if y2 > 0 else 0.0, bwd)
    return out


def fisher_terms(bl: Bilinear, cap: OpCapture, precisions: Sequence[Precision],
                  stochastic: bool) -> dict[Precision, float]:
    a, b, g = cap.a, cap.b, cap.g
    assert g is not None
    g2 = g.square()
    out: dict[Precision, float] = {}
    for p in precisions:
        k = SPECS[p]
        if k is None:
            out[p] = 0.0
            continue
        va = element_variance(a, k.a, stochastic=stochastic)
        vb = element_variance(b, k.b, per_channel=bl.b_is_weight, stochastic=stochastic)
        dy2 = bl.f(va, b.square()) + bl.f(a.square(), vb)
        out[p] = float((g2 * dy2).sum())
    return out


def wvar_terms(bl: Bilinear, cap: OpCapture, precisions: Sequence[Precision],
                stochastic: bool) -> dict[Precision, float]:
    b2 = float(cap.b.square().sum())
    out: dict[Precision, float] = {}
    for p in precisions:
        k = SPECS[p]
        out[p] = 0.0 if k is None or b2 == 0 else float(element_variance(
            cap.b, k.b, per_channel=bl.b_is_weight, stochastic=stochastic).sum()) / b2
    return out


def hessian_terms(bl: Bilinear, cap: OpCapture, precisions: Sequence[Precision],
                  stochastic: bool, trace_pair: tuple[float, float]) -> dict[Precision, float]:
    """The hessian method's value of one call per precision: the per-element Hessian traces
    (``trace_pair``: the op's weight's, its input activation's) times the expected squared
    perturbation of ``b`` (its weight, else the input trace stands for it) and of ``a``."""
    w_tr, a_tr = trace_pair
    k_b = bl.b_is_weight
    out: dict[Precision, float] = {}
    for p in precisions:
        k = SPECS[p]
        if k is None:
            out[p] = 0.0
            continue
        e_w = float(element_variance(cap.b, k.b, per_channel=k_b, stochastic=stochastic).sum())
        e_a = float(element_variance(cap.a, k.a, stochastic=stochastic).sum())
        out[p] = (w_tr if k_b else a_tr) * e_w + a_tr * e_a
    return out


def captures_of(calls: dict[str, list[Call]]) -> dict[str, list[tuple[Bilinear, OpCapture]]]:
    """Each kept call as (its form, its detached operands and output gradient); a call whose
    output got no gradient (it reaches the loss through no differentiable path, or not at
    all) has a zero one: its forward error is measured, its backward has nothing to err."""
    out: dict[str, list[tuple[Bilinear, OpCapture]]] = {}
    for name, cs in calls.items():
        for c in cs:
            y = c.y.detach().float()
            out.setdefault(name, []).append((c.bl, OpCapture(
                a=c.a.detach().float(), b=c.b.detach().float(), y=y,
                a_needs_grad=bool(c.a.requires_grad),
                g=c.g if c.g is not None else torch.zeros_like(y))))
    return out


def hutchinson_traces(loss: Tensor, calls: dict[str, list[Call]], samples: int,
                gen: torch.Generator) -> dict[str, tuple[float, float]]:
    """Per op: (Hessian trace per weight element, per input-activation element), from its
    first call: the parameter it reads and its live input."""
    targets: list[Tensor] = []
    index: list[tuple[str, str, int]] = []
    for n, cs in calls.items():
        c = cs[0]
        w = c.weight
        if w is not None and w.requires_grad:
            index.append((n, "w", len(targets)))
            targets.append(w)
        if c.a.requires_grad:
            index.append((n, "a", len(targets)))
            targets.append(c.a)
    if not targets:
        return {}
    grads = torch.autograd.grad(loss, targets, create_graph=True, allow_unused=True)
    traces = [0.0] * len(targets)
    live = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
    for _ in range(samples):
        zs = [torch.randint(0, 2, targets[i].shape, generator=gen).float() * 2 - 1 for i in live]
        hvs = torch.autograd.grad([grads[i] for i in live], [targets[i] for i in live], zs,
                                  retain_graph=True, allow_unused=True)
        for j, i in enumerate(live):
            if hvs[j] is not None:
                traces[i] += float((zs[j] * hvs[j]).sum()) / samples
    out: dict[str, tuple[float, float]] = {}
    for n, which, i in index:
        per = abs(traces[i]) / max(1, targets[i].numel())
        w_tr, a_tr = out.get(n, (0.0, 0.0))
        out[n] = (per, a_tr) if which == "w" else (w_tr, per)
    return out
