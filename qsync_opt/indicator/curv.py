"""The loss-aware ``curv`` method: the expected loss increase per step, in nats, from
Hutchinson probes of the loss curvature shaped by the error model's variances."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision
from qsync_opt.indicator.calls import Bilinear, CallCapture
from qsync_opt.indicator.errormodel import CURV_LR, SPECS, kind_parts
from qsync_opt.indicator.variances import element_variance


@dataclass
class CurvCall:
    """One call of one op in one batch, for ``curv``: its operands (detached), its live
    output (in the double-backward graph), and dL/dy: live (``g_live``, for Hessian-vector
    products) and detached (``g``)."""

    a: Tensor
    b: Tensor
    y: Tensor
    g: Tensor | None = None
    g_live: Tensor | None = None


def rademacher(shape: Sequence[int], gen: torch.Generator) -> Tensor:
    return torch.randint(0, 2, tuple(shape), generator=gen).float() * 2 - 1


def curv_pattern(kinds: Sequence[str]) -> tuple[tuple[str, ...], float]:
    """Precisions whose error kinds differ only by a common factor share one probe: the
    kinds' base kinds (:func:`kind_parts`) and that factor (float kinds are ``f10`` scaled by
    4^(10 - mantissa bits)); otherwise the kinds themselves and 1."""
    parts = [kind_parts(k) for k in kinds]
    if all(len(ps) == 1 for ps in parts) and len({ps[0][1] for ps in parts}) == 1:
        return tuple(ps[0][0] for ps in parts), parts[0][0][1]
    return tuple(kinds), 1.0


#: The curvature ``curv`` uses: ``gn`` (Gauss-Newton, J^T H_out J: positive semi-definite
#: for cross-entropy and squared losses, so no estimate is negative) or ``hessian`` (the full
#: Hessian; indefinite away from a minimum, e.g. at a registry init with batch norm).
CURVATURES = ("gn", "hessian")


def curv_batch(model: nn.Module, names: Sequence[str],
                loss_fn: Callable[[], tuple[Any, Tensor]],
                precisions: dict[str, Sequence[Precision]], *, samples: int,
                gen: torch.Generator, stochastic: bool = True, lr: float = CURV_LR,
                curvature: str = "gn", ran: set[str] | None = None) -> tuple[dict[str, dict[Precision, tuple[float, float]]],
                                                 str]:
    """The ``curv`` terms of one batch: per op and precision, (forward, backward) expected
    loss increase in nats (docs/ALLOCATION.md, A loss-aware indicator).

    ``loss_fn()`` runs the model and returns (its output, the scalar loss); hooks on the ops in ``names``
    keep their operands and live outputs, and one gradient with ``create_graph`` gives
    G = dL/dy. Forward: the operands' errors are independent with per-element variances
    v_A, v_B (:func:`element_variance` under :data:`SPECS`, whatever precisions those know),
    so E[dL] = 1/2 E[dy^T H_y dy] with dy = f(dA, B) + f(A, dB); each of ``samples`` probes
    draws Rademacher z_A, z_B, forms u = f(sqrt(v_A) z_A, B) + f(A, sqrt(v_B) z_B) (a
    perturbation with dy's covariance) and takes one Hessian-vector product with respect to
    this op's output: 1/2 u^T H_y u, unbiased. One probe serves every op at once: an op's
    estimate is its own part u_op^T (H u)_op (the other ops' probes are independent and
    zero-mean), so the cost does not grow with the number of ops. Backward (weights only): the SGD step
    moves the weight by -lr dG_B, so 1/2 lr^2 E[dG^T H_W dG] with Var(dG_B) = g_B(v_A', G^2) +
    g_B(A^2, v_G), probed the same way through u = f(A, sqrt(Var dG_B) z). Precisions whose
    variances differ by a common factor share a probe (:func:`curv_pattern`).

    ``curvature="gn"`` replaces H_y by the Gauss-Newton matrix J^T H_out J (J = d out / dy,
    H_out the loss Hessian in the model's output): u^T G u = (J u)^T H_out (J u), with J u
    by the double-vector-Jacobian trick; where the output is not one tensor the full
    Hessian serves. Returns the terms and the curvature used.
    """
    calls: dict[str, list[CurvCall]] = {}
    bls: dict[str, Bilinear] = {}
    with torch.enable_grad(), CallCapture(model, names, grads=False) as cap:
        output, loss = loss_fn()
    if ran is not None:
        ran.update(cap.calls)
    for n, kept in cap.calls.items():
        for call in kept:
            if call.y.requires_grad:
                bls.setdefault(n, call.bl)
                calls.setdefault(n, []).append(CurvCall(
                    a=call.a.detach().float(), b=call.b.detach().float(), y=call.y))
    if curvature not in CURVATURES:
        raise QsyncInputError(f"curvature: expected one of {', '.join(CURVATURES)}, "
                              f"got {curvature!r}")
    if curvature == "gn" and not (isinstance(output, Tensor) and output.requires_grad):
        curvature = "hessian"
    flat = [c for cs in calls.values() for c in cs]
    if not flat:
        return {}, curvature
    with torch.enable_grad():
        grads = torch.autograd.grad(loss, [c.y for c in flat], create_graph=True,
                                    allow_unused=True)
    for c, gy in zip(flat, grads, strict=True):
        if gy is not None:
            c.g = gy.detach().float()
            c.g_live = gy if gy.requires_grad else None  # None: the loss is linear in y
    del grads
    quad: Callable[[Sequence[CurvCall], Sequence[Tensor]], list[float]] = hessian_quad
    if curvature == "gn":
        with torch.enable_grad():
            g_out = torch.autograd.grad(loss, output, create_graph=True)[0]
            dummy = torch.zeros_like(output, requires_grad=True)
            # J^T w for every call at once (linear in the dummy w), built once per batch
            jt = torch.autograd.grad(output, [c.y for c in flat], dummy, create_graph=True,
                                     allow_unused=True)
        jts = {id(c): j for c, j in zip(flat, jt, strict=True)}

        def quad(cs: Sequence[CurvCall], us: Sequence[Tensor]) -> list[float]:
            return gn_quad(cs, [jts[id(c)] for c in cs], us, output, g_out, dummy)
    ops_calls = {n: [c for c in cs if c.g is not None] for n, cs in calls.items()}
    ops_calls = {n: cs for n, cs in ops_calls.items() if cs}
    terms = curv_terms(bls, ops_calls, precisions, samples, gen, stochastic, lr, quad)
    return terms, curvature


def hessian_quad(calls: Sequence[CurvCall], us: Sequence[Tensor]) -> list[float]:
    """u_c^T (H_y u)_c for each call c: one Hessian-vector product for all of them."""
    live = [(i, c, c.g_live, u) for i, (c, u) in enumerate(zip(calls, us, strict=True))
            if c.g_live is not None]
    out = [0.0] * len(calls)
    if not live:
        return out
    hvs = torch.autograd.grad([g for _, _, g, _ in live], [c.y for _, c, _, _ in live],
                              [u.to(c.y.dtype) for _, c, _, u in live], retain_graph=True,
                              allow_unused=True)
    for (i, _, _, u), hv in zip(live, hvs, strict=True):
        if hv is not None:
            out[i] = float((u * hv.detach().float()).sum())
    return out


def gn_quad(calls: Sequence[CurvCall], jt: Sequence[Tensor | None], us: Sequence[Tensor],
             output: Tensor, g_out: Tensor, dummy: Tensor) -> list[float]:
    """u_c^T (J^T H_out J u)_c for each call c: the Gauss-Newton form. J u comes from the
    vector-Jacobian products ``jt`` = J^T w (linear in a dummy w) differentiated in w, H_out
    (J u) from one Hessian-vector product of the loss in the model's output, and its pull-back
    J^T (H_out J u) to every call's output from one backward pass."""
    out = [0.0] * len(calls)
    pairs = [(i, j, u) for i, (j, u) in enumerate(zip(jt, us, strict=True))
             if j is not None and j.requires_grad]
    if not pairs or not g_out.requires_grad:  # the loss is linear in the output
        return out
    with torch.enable_grad():
        ju = torch.autograd.grad([j for _, j, _ in pairs], dummy,
                                 [u.to(j.dtype) for _, j, u in pairs], retain_graph=True)[0]
        hju = torch.autograd.grad(g_out, output, ju.detach(), retain_graph=True)[0]
        back = torch.autograd.grad(output, [calls[i].y for i, _, _ in pairs], hju.detach(),
                                   retain_graph=True, allow_unused=True)
    for (i, _, u), v in zip(pairs, back, strict=True):
        if v is not None:
            out[i] = float((u * v.detach().float()).sum())
    return out


#: Per op and precision: the probe pattern (the two operands' formats) and its factor.
_Keys = dict[str, dict[Precision, tuple[tuple[str, ...], float]]]


def _curv_keys(bls: dict[str, Bilinear], ops_calls: dict[str, list[CurvCall]],
               precisions: dict[str, Sequence[Precision]], lr: float) -> tuple[_Keys, _Keys]:
    """The forward and backward probe patterns of every op and precision (backward: only
    where the second operand is a weight and ``lr`` > 0)."""
    fwd_keys: _Keys = {}
    bwd_keys: _Keys = {}
    for n in ops_calls:
        for p in precisions[n]:
            k = SPECS[p]
            if k is None:
                continue
            fwd_keys.setdefault(n, {})[p] = curv_pattern((k.a, k.b))
            if bls[n].b_is_weight and lr > 0:
                bwd_keys.setdefault(n, {})[p] = curv_pattern((k.a_bwd, k.g_w))
    return fwd_keys, bwd_keys


def _probe_all(keys: _Keys, make: Callable[[str, tuple[str, ...]], Callable[[], list[Tensor]]],
               ops_calls: dict[str, list[CurvCall]], samples: int,
               quad: Callable[[Sequence[CurvCall], Sequence[Tensor]], list[float]]
               ) -> dict[tuple[str, tuple[str, ...]], float]:
    """Per pattern, ``samples`` probes that perturb every op using it at once; each op's
    half mean of its own part of the quadratic form."""
    got: dict[tuple[str, tuple[str, ...]], float] = {}
    for key in sorted({kf[0] for row in keys.values() for kf in row.values()}):
        users = [n for n, row in keys.items() if any(kf[0] == key for kf in row.values())]
        makers = {n: make(n, key) for n in users}
        flat = [(n, c) for n in users for c in ops_calls[n]]
        totals = dict.fromkeys(users, 0.0)
        for _ in range(samples):
            us = [u for n in users for u in makers[n]()]
            for (n, _), v in zip(flat, quad([c for _, c in flat], us), strict=True):
                totals[n] += v
        for n in users:
            got[(n, key)] = 0.5 * totals[n] / samples
    return got


def _forward_probe(bl: Bilinear, cs: list[CurvCall], key: tuple[str, ...],
                   gen: torch.Generator, stochastic: bool) -> Callable[[], list[Tensor]]:
    """Draws of each call's output change when both operands are rounded to ``key``."""
    sds = [(element_variance(c.a, key[0], stochastic=stochastic).sqrt(),
            element_variance(c.b, key[1], per_channel=bl.b_is_weight,
                             stochastic=stochastic).sqrt()) for c in cs]
    return lambda: [bl.f(sa * rademacher(c.a.shape, gen), c.b)
                    + bl.f(c.a, sb * rademacher(c.b.shape, gen))
                    for c, (sa, sb) in zip(cs, sds, strict=True)]


def _backward_probe(bl: Bilinear, cs: list[CurvCall], key: tuple[str, ...],
                    gen: torch.Generator, stochastic: bool) -> Callable[[], list[Tensor]]:
    """Draws of each call's output change under the weight-gradient error of ``key`` (one
    weight perturbation for every call)."""
    var: Tensor | None = None
    for c in cs:
        assert c.g is not None
        v = (bl.grad_b(element_variance(c.a, key[0], stochastic=stochastic),
                       c.b.shape, c.g.square())
             + bl.grad_b(c.a.square(), c.b.shape,
                         element_variance(c.g, key[1], stochastic=stochastic,
                                          channel_dim=bl.channel_dim)))
        var = v if var is None else var + v
    assert var is not None
    sd = var.sqrt()

    def draw() -> list[Tensor]:
        z = rademacher(sd.shape, gen)  # one weight perturbation, every call
        return [bl.f(c.a, sd * z) for c in cs]
    return draw


def curv_terms(bls: dict[str, Bilinear], ops_calls: dict[str, list[CurvCall]],
                precisions: dict[str, Sequence[Precision]], samples: int,
                gen: torch.Generator, stochastic: bool, lr: float,
                quad: Callable[[Sequence[CurvCall], Sequence[Tensor]], list[float]] = hessian_quad
                ) -> dict[str, dict[Precision, tuple[float, float]]]:
    """(forward, backward) nats per op and precision (see :func:`curv_batch`). Each probe
    perturbs every op that has a precision of the pattern at once; an op's estimate is its
    own part ``u_op^T (H u)_op``: the cross terms with other ops' independent probes are
    zero-mean, so it stays unbiased for one product per probe and pattern, whatever the
    number of ops."""
    fwd_keys, bwd_keys = _curv_keys(bls, ops_calls, precisions, lr)
    fwd = _probe_all(fwd_keys, lambda n, key: _forward_probe(bls[n], ops_calls[n], key, gen,
                                                             stochastic),
                     ops_calls, samples, quad)
    bwd = _probe_all(bwd_keys, lambda n, key: _backward_probe(bls[n], ops_calls[n], key, gen,
                                                              stochastic),
                     ops_calls, samples, quad) if bwd_keys else {}
    out: dict[str, dict[Precision, tuple[float, float]]] = {}
    for n in ops_calls:
        row: dict[Precision, tuple[float, float]] = {}
        for p in precisions[n]:
            if SPECS[p] is None:
                row[p] = (0.0, 0.0)
                continue
            key_f, fac_f = fwd_keys[n][p]
            vb = 0.0
            if n in bwd_keys:
                key_b, fac_b = bwd_keys[n][p]
                vb = fac_b * lr * lr * bwd[(n, key_b)]
            row[p] = (fac_f * fwd[(n, key_f)], vb)
        out[n] = row
    return out
