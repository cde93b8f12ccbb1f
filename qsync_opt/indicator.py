"""Indicators: each choosable op's degradation Omega[op][precision], measured from real batches.

The ``qsync`` method (QSync's bi-directional indicator, PAPERS.md) in qsync-opt's form.

**Error model.** Every choosable op computes a bilinear form ``Y = f(A, B)``: ``F.linear(A,
W)``, ``F.conv2d(A, W)`` or ``A @ B`` (attention). Running it at a lower precision replaces
A, B and, in backward, the output gradient G by ``A + dA`` etc. with independent zero-mean
errors of per-element variance ``v``:

* int8 with stochastic rounding on a grid of step ``s`` (per tensor for activations and
  gradients, per output channel for weights): an element at fraction ``r = frac(x/s)`` of a
  step rounds up with probability ``r``, so its error has variance ``s^2 r (1 - r)`` --
  exactly, per element (averaged over uniform fractions that is the familiar ``s^2/6``; an
  element on the grid, such as a ReLU zero, has none). Round-to-nearest: ``(round(x/s)-x/s)^2
  s^2``.
* floating formats (tf32/fp16 with 10 mantissa bits, bf16 with 7, fp8 e4m3 with 3 and e5m2
  with 2, fp8 scaled per tensor to its largest finite value): round-to-nearest-even leaves
  an error uniform within half a unit in the last place, ``ulp(x)^2 / 12`` with ``ulp(x) =
  2^(max(floor(log2|x|), e_min) - mantissa_bits)``, so fp16's subnormals (below 2^-14) are
  modelled. fp16 gradients are modelled under dynamic loss scaling (largest gradient at
  2^14), as fp16 training runs them; unscaled, attention-score gradients underflow.

For a bilinear ``f`` and independent errors, each output element is a sum of products of
distinct element pairs, so the expected squared error is again ``f`` applied to variances and
squares -- exactly, for linear layers, convolutions and matmuls alike::

    E||f(A+dA, B+dB) - f(A, B)||^2 = sum f(v_A, B^2) + sum f(A^2, v_B) + sum f(v_A, v_B)

and the backward terms follow the same way through the vector-Jacobian products ``g_A(G, B)
= dL/dA`` and ``g_B(A, G) = dL/dB``, which are bilinear too::

    E||d gA||^2 = sum g_A(v_G, B^2) + sum g_A(G^2, v_B')      (B' = B as used in backward)
    E||d gB||^2 = sum g_B(v_A', G^2) + sum g_B(A^2, v_G)

The third (second-order) terms are dropped: they are smaller than the others by the product
of two relative steps (< 1e-4 for int8). For ``Y = X W^T`` with per-tensor steps the forward
expression reduces to docs/PAPERS.md's ``(M ||W||^2 s_x^2 + N ||X||^2 s_w^2) / 6`` when fractions
are uniform; the tests hold it against the measured error of the ops library's real int8
and 16-bit kernels.

**Combining.** ``Var_fwd = E||dY||^2 / ||Y||^2`` and ``Var_bwd = E||d gA||^2 / ||gA||^2 +
E||d gB||^2 / ||gB||^2`` are relative (QSync's code adds raw magnitudes, which makes forward
terms of activations and backward terms of gradients incommensurable; relative errors are
comparable across ops and do not drift with the batch). Then, with the op's depth ``d`` and
the graph's depth ``L`` (graph.py)::

    Omega = gamma * (L - d) * Var_fwd + d * Var_bwd          (gamma = 4 by default)

forward noise passes through the ``L - d`` ops after the op, gradient noise through the
``d`` before it. Values are averaged over the batches; because both terms are relative, the
table holds for other batch sizes too (``scale_to_batch`` says so and changes nothing).

The loss-aware ``curv`` method (docs/ALLOCATION.md, A loss-aware indicator) turns the same
error model into the expected loss increase per step, in nats: 1/2 E[dy^T H dy] with dy the
op's output error and H the loss's Gauss-Newton curvature in the op's output (Hutchinson
probes shaped by the operands' variances, so the output errors' correlations are kept), plus
1/2 lr^2 E[dG^T H_W dG] for the weight-gradient error under SGD (``_curv_batch``).

Other methods, for comparison: ``wvar`` (relative weight quantization error E||dW||^2 /
||W||^2), ``hessian`` (HAWQ: a Hutchinson estimate of the loss Hessian trace per parameter,
for the weight and for the op's input activation, times the expected squared perturbation),
``fisher`` (sum over output elements of G^2 times E[dY^2]) and ``random`` (a seeded draw per op
times a fixed per-format factor: the control). Every table is made monotone within a family
(fp32 <= tf32 <= fp16 <= bf16 <= fp8; int8 <= int8_full; int8 <= int4: int8_full and int4
are not ordered, one adds backward error, the other forward error), and the fixes are
counted in its notes.

**int4.** The same derivation as int8 with 7 levels a side instead of 127: the scale is
``s = amax / 7`` (per output channel for weights, per tensor for activations), the values
are clamped to [-7, 7] (15 levels), and the rounding error of an element at ``y = x / s``
has variance ``s^2 e^2`` (``e`` the distance to the nearest level): int4 rounds to nearest
(``ops.NUMERICS``, kind ``int4n``), whatever ``stochastic`` says of int8. For uniform
fractions that is ``s^2 / 12``, so an int4 rounding is about ``(127/7)^2 / 2 ~ 165`` times a
stochastic int8 one on the same tensor. int4's backward is fp16 on the saved int4
operands, as int8's.

**int8_full's output gradient** is quantized twice (``ops.NUMERICS.grad_scale``): one scale
per row (token / output position: ``int8row``) for the input gradient, one per output
channel (``int8gcol``) for the weight gradient; ``_Kinds.g_b`` carries the second. An
attention or functional matmul at int8_full runs the same two quantizations of its output
gradient (per row for ``a``'s gradient, per last-axis channel for ``b``'s), and uses its
activation ``b`` in backward at its forward scale (:func:`kinds_for`).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .errors import QsyncInputError
from .graph import resolve_workload, trace
from .indicator_calls import Bilinear, Call, CallCapture, module_bilinear
from .io import load, save
from .machine import cache_root
from .models import Workload
from .precision import Precision
from .progress import LOG_EVERY_S, duration
from .schemas import IndicatorTable, ModelGraph, OpRole
from .user_model import UserWorkload

log = logging.getLogger(__name__)

#: The indicator methods, the one list (``qsync-opt indicate/solve/compare/pareto/demo
#: --method`` offer these choices): the default first.
METHODS = ("qsync", "wvar", "hessian", "fisher", "random", "curv")
#: Ladders within a family, most exact first: Omega must not decrease along them.
LADDERS = ((Precision.fp32, Precision.tf32, Precision.fp16, Precision.bf16, Precision.fp8),
           (Precision.fp32, Precision.int8, Precision.int8_full),
           (Precision.fp32, Precision.int8, Precision.int4))
#: kind -> (mantissa bits, smallest normal exponent, per-tensor scale target or None).
#: ``fp16g`` is an fp16 gradient under dynamic loss scaling: the scaler keeps the largest
#: gradient near 2^14, so small gradients do not underflow (as they would unscaled).
FLOAT_KINDS = {"m10": (10, -14, None), "tf32": (10, -126, None), "fp16g": (10, -14, 2.0**14),
               "m7": (7, -126, None), "e4m3": (3, -6, 448.0), "e5m2": (2, -14, 57344.0),
               "f10": (10, -100_000, None)}


def check_method(method: str) -> None:
    """Refuse a method that is not one of :data:`METHODS` (a :class:`QsyncInputError`)."""
    if method not in METHODS:
        raise QsyncInputError(f"method: expected one of {', '.join(METHODS)}, got {method!r}")


def _parts(kind: str) -> list[tuple[str, float]]:
    """How the variance propagation evaluates a kind: base kinds and their factors.

    A float format's relative error depends only on its mantissa in its normal range, so
    every float kind is one evaluation at 10 mantissa bits without an exponent floor
    (``f10``) scaled by 4^(10 - m). Exact for elements in the format's normal range;
    subnormal ones (fp16 below 2^-14, rare in activations; gradients are loss-scaled) are
    given the normal relative error. int8+col is the sum of its two roundings.
    """
    if kind in FLOAT_KINDS:
        return [("f10", 4.0 ** (10 - FLOAT_KINDS[kind][0]))]
    if kind == "int8+col":
        return [("int8", 1.0), ("int8col", 1.0)]
    return [(kind, 1.0)]


@dataclass(frozen=True)
class _Kinds:
    """Error kinds of A and B forward, G, and A and B as used in backward."""

    a: str
    b: str
    g: str
    a_bwd: str
    b_bwd: str
    g_b: str = ""  # G as the weight gradient uses it, when not as ``g`` (int8_full)

    @property
    def g_w(self) -> str:
        return self.g_b or self.g


SPECS: dict[Precision, _Kinds | None] = {
    Precision.fp32: None,
    Precision.tf32: _Kinds("tf32", "tf32", "tf32", "tf32", "tf32"),
    Precision.fp16: _Kinds("m10", "m10", "fp16g", "m10", "m10"),
    Precision.bf16: _Kinds("m7", "m7", "m7", "m7", "m7"),
    Precision.int8: _Kinds("int8", "int8", "fp16g", "int8", "int8"),
    # int8_full's output gradient: one scale per row (token / output position) for the
    # input gradient, one per output channel for the weight gradient (ops.NUMERICS)
    Precision.int8_full: _Kinds("int8", "int8", "int8row", "int8", "int8+col", "int8gcol"),
    Precision.fp8: _Kinds("e4m3", "e4m3", "e5m2", "e4m3", "e4m3"),
    # int4 rounds to nearest (ops.NUMERICS), whatever the int8 rounding
    Precision.int4: _Kinds("int4n", "int4n", "fp16g", "int4n", "int4n"),
}


def kinds_for(p: Precision, b_is_weight: bool) -> _Kinds | None:
    """The error kinds of precision ``p`` on an op whose ``b`` is a weight or not. int8_full
    re-quantizes a weight per input column for the input gradient (its forward scales are
    per output channel, which do not factor out of ``G @ W``); a matmul's activation ``b``
    has one scale, which does, so its backward uses it as the forward did
    (:func:`qsync_opt.runtime.gemm.int8_full_gemm`)."""
    k = SPECS[p]
    if k is None or b_is_weight or k.b_bwd != "int8+col":
        return k
    return dataclasses.replace(k, b_bwd="int8")


#: Random method: a per-format factor (about the relative variance of one rounding).
_NOMINAL = {Precision.tf32: 2.0**-22, Precision.fp16: 2.0**-22, Precision.bf16: 2.0**-16,
            Precision.fp8: 2.0**-8, Precision.int8: (1 / 127) ** 2,
            Precision.int8_full: 2 * (1 / 127) ** 2, Precision.int4: (1 / 7) ** 2}


# ----------------------------------------------------------------------------- variances


def element_variance(t: Tensor, kind: str, *, per_channel: bool = False,
                     stochastic: bool = True, channel_dim: int = -1, groups: int = 1) -> Tensor:
    """Per-element error variance of representing ``t`` in ``kind`` (see module docstring).

    ``per_channel``: int8 scales per slice along axis 0 (weights); ``int8+col`` adds the
    re-quantization per input column that int8_full's backward applies to the weight: one
    scale per column of the weight viewed ``[out, -1]`` (a conv's ``(in, kh, kw)``), within
    each of ``groups`` groups of output channels, as the kernels' input-gradient GEMM takes
    it. ``int4n``: int4 rounded to nearest. An output gradient's ``int8row`` (one scale per
    position across the channels at ``channel_dim``: per token) and ``int8gcol`` (one per
    channel) are int8_full's two quantizations of it.
    """
    x = t.detach().to(torch.float32)
    if kind in ("int8row", "int8gcol"):
        cd = channel_dim % max(x.dim(), 1)
        if kind == "int8gcol" or x.dim() < 2:
            return _int_variance(x, cd if x.dim() else None, stochastic, 127)
        moved = x.movedim(cd, -1)
        v = _int_variance(moved.reshape(-1, moved.shape[-1]), 0, stochastic, 127)
        return v.reshape(moved.shape).movedim(-1, cd)
    if kind in ("int4", "int4n"):
        return _int_variance(x, 0 if per_channel else None,
                             stochastic and kind == "int4", INT4_QMAX)
    if kind == "int8col":
        return _column_variance(x, groups, stochastic)
    if kind in ("int8", "int8+col"):
        v = _int8_variance(x, 0 if per_channel else None, stochastic)
        if kind == "int8+col":
            v = v + _column_variance(x, groups, stochastic)
        return v
    mbits, emin, fmax = FLOAT_KINDS[kind]
    scale = 1.0
    if fmax is not None:
        amax = float(x.abs().max()) if x.numel() else 0.0
        scale = fmax / amax if amax > 0 else 1.0
    xs = x.abs() * scale
    exp = torch.floor(torch.log2(torch.where(xs > 0, xs, torch.ones_like(xs))))
    exp = torch.clamp(exp, min=float(emin))
    ulp = torch.exp2(exp - mbits)
    v = ulp * ulp / 12.0 / (scale * scale)
    return torch.where(xs > 0, v, torch.zeros_like(v))


#: Largest int4 level: symmetric [-7, 7], as int8 uses [-127, 127].
INT4_QMAX = 7


def _int8_variance(x: Tensor, axis: int | None, stochastic: bool) -> Tensor:
    return _int_variance(x, axis, stochastic, 127)


def _column_variance(w: Tensor, groups: int, stochastic: bool) -> Tensor:
    """int8 rounding variance of weight ``w`` [out, ...] with one scale per column of its
    ``[out, -1]`` view within each group of ``out / groups`` rows (int8_full's re-quantized
    weight); a 1-D ``w``: per element."""
    if w.dim() < 2:
        return _int8_variance(w, 0, stochastic)
    g = groups if groups > 0 and w.shape[0] % groups == 0 else 1
    cols = w.reshape(g, w.shape[0] // g, -1).permute(0, 2, 1)  # [g, cols, out/g]
    v = _int8_variance(cols.reshape(-1, cols.shape[2]), 0, stochastic)  # one per (g, col)
    return v.reshape(cols.shape).permute(0, 2, 1).reshape(w.shape)


def _int_variance(x: Tensor, axis: int | None, stochastic: bool, qmax: int) -> Tensor:
    """Per-element rounding variance of symmetric ``qmax``-level quantization (scale
    ``amax / qmax`` per tensor or per slice along ``axis``)."""
    if axis is None:
        amax = x.abs().amax() if x.numel() else x.new_tensor(0.0)
        shape: Sequence[int] = ()
    else:
        dims = [d for d in range(x.dim()) if d != axis]
        amax = x.abs().amax(dim=dims, keepdim=True)
        shape = amax.shape
    amax = torch.where(amax > 0, amax, torch.ones_like(amax)).reshape(shape)
    s = amax / torch.full_like(amax, float(qmax))  # true division on a GPU too
    y = x / s
    if stochastic:
        r = y - torch.floor(y)
        return s * s * r * (1.0 - r)
    e = torch.round(y) - y
    return s * s * e * e


# ----------------------------------------------------------------------------- bilinear ops


_Bilinear = Bilinear


def _bilinear(mod: nn.Module) -> _Bilinear | None:
    return module_bilinear(mod)


@dataclass
class _Capture:
    """Operands, output and output gradient of one call of one op in one batch."""

    a: Tensor
    b: Tensor
    y: Tensor
    a_needs_grad: bool
    g: Tensor | None = None


@dataclass
class _OpStats:
    """Per-op accumulators over batches: precision -> list of per-batch values."""

    fwd: dict[Precision, list[float]] = field(default_factory=dict)
    bwd: dict[Precision, list[float]] = field(default_factory=dict)
    value: dict[Precision, list[float]] = field(default_factory=dict)


def _qsync_terms(bl: _Bilinear, cap: _Capture, precisions: Sequence[Precision],
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
        for base, factor in _parts(kind):
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


def _fisher_terms(bl: _Bilinear, cap: _Capture, precisions: Sequence[Precision],
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


def _wvar_terms(bl: _Bilinear, cap: _Capture, precisions: Sequence[Precision],
                stochastic: bool) -> dict[Precision, float]:
    b2 = float(cap.b.square().sum())
    out: dict[Precision, float] = {}
    for p in precisions:
        k = SPECS[p]
        out[p] = 0.0 if k is None or b2 == 0 else float(element_variance(
            cap.b, k.b, per_channel=bl.b_is_weight, stochastic=stochastic).sum()) / b2
    return out


# ----------------------------------------------------------------------------- data


def synthetic_batches(workload: Workload, batch: int, n: int, seed: int
                      ) -> Iterator[tuple[tuple[Tensor, ...], Tensor]]:
    """Inputs of the right shape and dtype: float inputs drawn N(0,1), integer inputs
    shuffled from the workload's example (so they stay in range), seeded per batch."""
    base_inputs = workload.make_inputs(batch, torch.device("cpu"))
    base_targets = workload.make_targets(batch, torch.device("cpu"))
    for i in range(n):
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        inputs = []
        for t in base_inputs:
            if t.is_floating_point():
                inputs.append(torch.randn(t.shape, generator=gen, dtype=t.dtype))
            else:
                perm = torch.randperm(t.numel(), generator=gen)
                inputs.append(t.reshape(-1)[perm].reshape(t.shape))
        perm = torch.randperm(base_targets.numel(), generator=gen)
        yield tuple(inputs), base_targets.reshape(-1)[perm].reshape(base_targets.shape)


def real_batches(workload: Workload, batch: int, n: int, seed: int
                 ) -> Iterator[tuple[tuple[Tensor, ...], Tensor]]:
    """digits_cnn, digits_resnet: scikit-learn's digits (training split,
    :func:`qsync_opt.models.image_split`); tiny_gpt: stdlib source text."""
    from .models import image_split

    gen = torch.Generator().manual_seed(seed)
    if (split := image_split(workload.name)) is not None:
        x_tr, y_tr, _, _ = split
        for _ in range(n):
            idx = torch.randint(0, x_tr.shape[0], (batch,), generator=gen)
            yield (x_tr[idx],), y_tr[idx]
    elif workload.name == "tiny_gpt":
        from .models.tiny_gpt import encode, sample_batch, stdlib_corpus, train_val_split

        data, _ = train_val_split(encode(stdlib_corpus(max_chars=400_000)))
        seq = workload.seq_len or 128
        for _ in range(n):
            xb, yb = sample_batch(data, batch, seq, gen)
            yield (xb,), yb
    else:
        raise QsyncInputError(f"model: {workload.name} has no real data here; use synthetic")


# ----------------------------------------------------------------------------- driver


def _captures(calls: dict[str, list[Call]]) -> dict[str, list[tuple[_Bilinear, _Capture]]]:
    """Each kept call as (its form, its detached operands and output gradient); a call whose
    output got no gradient (it reaches the loss through no differentiable path, or not at
    all) has a zero one: its forward error is measured, its backward has nothing to err."""
    out: dict[str, list[tuple[_Bilinear, _Capture]]] = {}
    for name, cs in calls.items():
        for c in cs:
            y = c.y.detach().float()
            out.setdefault(name, []).append((c.bl, _Capture(
                a=c.a.detach().float(), b=c.b.detach().float(), y=y,
                a_needs_grad=bool(c.a.requires_grad),
                g=c.g if c.g is not None else torch.zeros_like(y))))
    return out


def _hutchinson(loss: Tensor, calls: dict[str, list[Call]], samples: int,
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


# ----------------------------------------------------------------------------- curv


#: The ``curv`` method's default SGD learning rate for its backward (update) term: the
#: accuracy study's SGD rate (benchmarks/bench_accuracy.py, digits_cnn). ``lr=0`` drops it.
CURV_LR = 0.05


@dataclass
class _CurvCall:
    """One call of one op in one batch, for ``curv``: its operands (detached), its live
    output (in the double-backward graph), and dL/dy: live (``g_live``, for Hessian-vector
    products) and detached (``g``)."""

    a: Tensor
    b: Tensor
    y: Tensor
    g: Tensor | None = None
    g_live: Tensor | None = None


def _rademacher(shape: Sequence[int], gen: torch.Generator) -> Tensor:
    return torch.randint(0, 2, tuple(shape), generator=gen).float() * 2 - 1


def _curv_pattern(kinds: Sequence[str]) -> tuple[tuple[str, ...], float]:
    """Precisions whose error kinds differ only by a common factor share one probe: the
    kinds' base kinds (:func:`_parts`) and that factor (float kinds are ``f10`` scaled by
    4^(10 - mantissa bits)); otherwise the kinds themselves and 1."""
    parts = [_parts(k) for k in kinds]
    if all(len(ps) == 1 for ps in parts) and len({ps[0][1] for ps in parts}) == 1:
        return tuple(ps[0][0] for ps in parts), parts[0][0][1]
    return tuple(kinds), 1.0


#: The curvature ``curv`` uses: ``gn`` (Gauss-Newton, J^T H_out J: positive semi-definite
#: for cross-entropy and squared losses, so no estimate is negative) or ``hessian`` (the full
#: Hessian; indefinite away from a minimum, e.g. at a registry init with batch norm).
CURVATURES = ("gn", "hessian")


def _curv_batch(model: nn.Module, names: Sequence[str],
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
    variances differ by a common factor share a probe (:func:`_curv_pattern`).

    ``curvature="gn"`` replaces H_y by the Gauss-Newton matrix J^T H_out J (J = d out / dy,
    H_out the loss Hessian in the model's output): u^T G u = (J u)^T H_out (J u), with J u
    by the double-vector-Jacobian trick; where the output is not one tensor the full
    Hessian serves. Returns the terms and the curvature used.
    """
    calls: dict[str, list[_CurvCall]] = {}
    bls: dict[str, _Bilinear] = {}
    with torch.enable_grad(), CallCapture(model, names, grads=False) as cap:
        output, loss = loss_fn()
    if ran is not None:
        ran.update(cap.calls)
    for n, kept in cap.calls.items():
        for call in kept:
            if call.y.requires_grad:
                bls.setdefault(n, call.bl)
                calls.setdefault(n, []).append(_CurvCall(
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
    quad: Callable[[Sequence[_CurvCall], Sequence[Tensor]], list[float]] = _quad
    if curvature == "gn":
        with torch.enable_grad():
            g_out = torch.autograd.grad(loss, output, create_graph=True)[0]
            dummy = torch.zeros_like(output, requires_grad=True)
            # J^T w for every call at once (linear in the dummy w), built once per batch
            jt = torch.autograd.grad(output, [c.y for c in flat], dummy, create_graph=True,
                                     allow_unused=True)
        jts = {id(c): j for c, j in zip(flat, jt, strict=True)}

        def quad(cs: Sequence[_CurvCall], us: Sequence[Tensor]) -> list[float]:
            return _quad_gn(cs, [jts[id(c)] for c in cs], us, output, g_out, dummy)
    ops_calls = {n: [c for c in cs if c.g is not None] for n, cs in calls.items()}
    ops_calls = {n: cs for n, cs in ops_calls.items() if cs}
    terms = _curv_terms(bls, ops_calls, precisions, samples, gen, stochastic, lr, quad)
    return terms, curvature


def _quad(calls: Sequence[_CurvCall], us: Sequence[Tensor]) -> list[float]:
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


def _quad_gn(calls: Sequence[_CurvCall], jt: Sequence[Tensor | None], us: Sequence[Tensor],
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


def _curv_terms(bls: dict[str, _Bilinear], ops_calls: dict[str, list[_CurvCall]],
                precisions: dict[str, Sequence[Precision]], samples: int,
                gen: torch.Generator, stochastic: bool, lr: float,
                quad: Callable[[Sequence[_CurvCall], Sequence[Tensor]], list[float]] = _quad
                ) -> dict[str, dict[Precision, tuple[float, float]]]:
    """(forward, backward) nats per op and precision (see :func:`_curv_batch`). Each probe
    perturbs every op that has a precision of the pattern at once; an op's estimate is its
    own part ``u_op^T (H u)_op``: the cross terms with other ops' independent probes are
    zero-mean, so it stays unbiased for one product per probe and pattern, whatever the
    number of ops."""
    fwd_keys: dict[str, dict[Precision, tuple[tuple[str, ...], float]]] = {}
    bwd_keys: dict[str, dict[Precision, tuple[tuple[str, ...], float]]] = {}
    for n in ops_calls:
        for p in precisions[n]:
            k = SPECS[p]
            if k is None:
                continue
            fwd_keys.setdefault(n, {})[p] = _curv_pattern((k.a, k.b))
            if bls[n].b_is_weight and lr > 0:
                bwd_keys.setdefault(n, {})[p] = _curv_pattern((k.a_bwd, k.g_w))

    def probe_all(keys: dict[str, dict[Precision, tuple[tuple[str, ...], float]]],
                  make: Callable[[str, tuple[str, ...]], Callable[[], list[Tensor]]]
                  ) -> dict[tuple[str, tuple[str, ...]], float]:
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

    def forward_probe(n: str, key: tuple[str, ...]) -> Callable[[], list[Tensor]]:
        bl, cs = bls[n], ops_calls[n]
        sds = [(element_variance(c.a, key[0], stochastic=stochastic).sqrt(),
                element_variance(c.b, key[1], per_channel=bl.b_is_weight,
                                 stochastic=stochastic).sqrt()) for c in cs]
        return lambda: [bl.f(sa * _rademacher(c.a.shape, gen), c.b)
                        + bl.f(c.a, sb * _rademacher(c.b.shape, gen))
                        for c, (sa, sb) in zip(cs, sds, strict=True)]

    def backward_probe(n: str, key: tuple[str, ...]) -> Callable[[], list[Tensor]]:
        bl, cs = bls[n], ops_calls[n]
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
            z = _rademacher(sd.shape, gen)  # one weight perturbation, every call
            return [bl.f(c.a, sd * z) for c in cs]
        return draw

    fwd = probe_all(fwd_keys, forward_probe)
    bwd = probe_all(bwd_keys, backward_probe) if bwd_keys else {}
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


#: Off a terminal, the indicator's progress is a line at most this often (seconds): the
#: interval every progress line of the tool keeps (qsync_opt.progress).
PROGRESS_EVERY_S = LOG_EVERY_S


class _Progress:
    """Batches done: redrawn in place on a terminal; off one (a log, nohup, a batch
    scheduler), a plain line every :data:`PROGRESS_EVERY_S` seconds with the time left."""

    def __init__(self, enabled: bool, method: str, n: int) -> None:
        self.enabled, self.method, self.n = enabled, method, n
        self.tty = sys.stderr.isatty()
        self.t0 = self.last = time.perf_counter()

    def __call__(self, i: int) -> None:
        if not self.enabled:
            return
        if self.tty:
            sys.stderr.write(f"\rindicator {self.method}: batch {i}/{self.n}")
            if i == self.n:
                sys.stderr.write("\n")
        else:
            now = time.perf_counter()
            if now - self.last < PROGRESS_EVERY_S or i == self.n:
                return
            self.last = now
            left = (now - self.t0) / i * (self.n - i)
            sys.stderr.write(f"indicator {self.method}: batch {i}/{self.n}, "
                             f"{duration(now - self.t0)}, about {duration(left)} left\n")
        sys.stderr.flush()


#: Working copies the term computations keep of the largest op's tensors (variances,
#: squares and propagated terms of its operands, output and output gradient).
TERM_COPIES = 3
#: The Hessian method's double backward keeps about this many times the activations.
HESSIAN_ACTIVATION_FACTOR = 3
#: What a model run adds besides its tensors: autograd and allocator arenas, the data
#: loading (scikit-learn for digits_cnn). Measured: 137 MB for digits_cnn, whose tensors
#: take 4 MB (VmHWM over the resident size before the run).
RUNTIME_BYTES = 128 * 2**20


@dataclass(frozen=True)
class IndicatorMemory:
    """What running ``indicate()`` on this CPU holds at its peak (bytes), from the graph
    traced at the indicator's batch: the fp32 weights and buffers, their gradients, the
    activations saved for backward, the captures the hooks keep (each choosable op's output
    and output gradient; its inputs are among the saved activations) and the working copies
    of the largest op's terms, and a fixed :data:`RUNTIME_BYTES`. No optimizer runs (nothing
    is stepped). ``random`` runs no model: all zero."""

    method: str
    batch: int
    weights: int
    gradients: int
    activations: int
    captures: int
    terms: int
    runtime: int = 0

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.activations + self.captures + self.terms
                + self.runtime)

    def describe(self) -> str:
        if not self.total:
            return f"{self.method} runs no model"
        parts = [("weights", self.weights), ("gradients", self.gradients),
                 ("activations", self.activations), ("captures", self.captures),
                 ("terms", self.terms), ("runtime", self.runtime)]
        return (f"{_gib(self.total)} GiB at batch {self.batch} ("
                + ", ".join(f"{name} {_gib(v)}" for name, v in parts if v) + ")")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}" if n < 10 * 2**30 else f"{n / 2**30:.1f}"


def indicator_memory(graph: ModelGraph, method: str = "qsync") -> IndicatorMemory:
    """The memory ``indicate(method=...)`` needs for ``graph`` at ``graph.batch_size``
    (trace the graph at the indicator's batch). See :class:`IndicatorMemory`."""
    check_method(method)
    if method == "random":
        return IndicatorMemory(method, graph.batch_size, 0, 0, 0, 0, 0)
    ops = [o for o in graph.ops if o.role == OpRole.choosable]
    captures = sum(2 * 4 * o.output_numel for o in ops)
    largest = max((4 * (o.input_numel + 2 * o.output_numel + o.param_count) for o in ops),
                  default=0)
    acts = graph.saved_activation_bytes
    if method in ("hessian", "curv"):
        acts *= HESSIAN_ACTIVATION_FACTOR
    if method == "curv":  # operands and Hessian diagonals kept per op: about two captures more
        captures += sum(4 * (o.input_numel + o.param_count) * 2 for o in ops)
    return IndicatorMemory(method, graph.batch_size, weights=graph.param_bytes + graph.buffer_bytes,
                           gradients=graph.param_bytes, activations=acts, captures=captures,
                           terms=TERM_COPIES * largest if method != "wvar" else 0,
                           runtime=RUNTIME_BYTES)


def placeholder_indicator(graph: ModelGraph) -> IndicatorTable:
    """Zeros for every choosable op and precision: a problem built with it has the real
    problem's time and memory (they need no indicator), for checks made before computing
    one. Not an indicator: every plan scores 0."""
    values = {o.name: {p: 0.0 for p in o.allowed_precisions} for o in graph.choosable_ops()}
    return IndicatorTable(workload=graph.workload, graph_hash=graph.structure_hash(),
                          method="placeholder", batch_size=graph.batch_size, batches=1, seed=0,
                          data="none", values=values,
                          notes=["placeholder: zeros, for checks that need no indicator"])


def available_memory_bytes() -> int | None:
    """Memory this process can still take: MemAvailable (/proc/meminfo), lowered by a
    cgroup limit (memory.max less memory.current) and by an address-space limit
    (RLIMIT_AS less the current VmSize) where set. None where nothing can be read."""
    import resource

    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        cg = Path("/sys/fs/cgroup")
        limit = (cg / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((cg / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmSize:"):
                    found.append(soft - int(line.split()[1]) * 1024)
        except (OSError, ValueError, IndexError):
            found.append(soft)
    return max(0, min(found)) if found else None


def check_indicator_memory(need: IndicatorMemory, workload: str,
                           available: int | None = None) -> None:
    """Refuse (one line, QsyncInputError) when ``need`` exceeds the memory this machine has
    (``available``, default :func:`available_memory_bytes`), naming both figures and the
    cheaper choices."""
    have = available_memory_bytes() if available is None else available
    if have is None or need.total <= have:
        return
    raise QsyncInputError(
        f"indicator: the {need.method} indicator of {workload} runs the model on this CPU and "
        f"needs about {need.describe()}; this machine has {_gib(have)} GiB available. "
        "Cheaper: an IndicatorTable made elsewhere (--indicator FILE; `qsync-opt indicate "
        f"--model {workload} --out FILE` on a larger machine), the random method (--method "
        "random: no model run; a control, not a measurement), a smaller indicator batch "
        "(--indicator-batch; --batch for `qsync-opt indicate`), or a model with fewer layers")


def fast_options() -> dict[str, Any]:
    """``indicate(**fast_options())``: propagate the qsync variances in bf16 for 2 samples
    per batch (scales and variances still from whole batches) — for large models."""
    return {"term_dtype": torch.bfloat16, "term_rows": 2}


#: The error model's version: tables cached under another (int4 stochastic, int8_full's
#: per-tensor output gradient, a matmul's ``b`` re-quantized per column) are not reused.
ERROR_MODEL_VERSION = 3


def default_cache_dir() -> Path:
    return cache_root() / "indicators" / f"e{ERROR_MODEL_VERSION}"


def indicate(
    workload: str | Workload,
    batches: int = 10,
    method: str = "qsync",
    *,
    batch: int | None = None,
    seed: int = 0,
    gamma: float = 4.0,
    stochastic: bool = True,
    model: nn.Module | None = None,
    data: Iterable[tuple[tuple[Tensor, ...], Tensor]] | None = None,
    graph: ModelGraph | None = None,
    cache: bool = True,
    cache_dir: str | Path | None = None,
    progress: bool = False,
    hutchinson_samples: int = 2,
    term_dtype: torch.dtype = torch.float32,
    term_rows: int | None = None,
    memory_check: bool = True,
    needs: Collection[Precision] | None = None,
    lr: float = CURV_LR,
    report: Callable[[str], None] | None = None,
) -> IndicatorTable:
    """Omega[op][precision] for every choosable op of ``workload``, from ``batches`` batches.

    ``workload``: a registry name or workload, or a user's model (``PATH.py:FUNCTION``,
    which is run, or a :class:`~qsync_opt.user_model.UserWorkload`): its ``build()`` under
    the seed, its ``loss()`` or the default loss, its ``data()`` or synthetic batches shaped
    like its example inputs, at any ``batch`` (the notes say which loss and data were used).
    The model is the workload's (seeded init) unless ``model`` is given (e.g. a trained
    one); data are the workload's real data where it has them (digits_cnn, digits_resnet,
    tiny_gpt, a file's ``data()``), else synthetic, unless ``data`` yields ``(inputs, targets)``.
    Results are cached on disk when neither ``model`` nor ``data`` is given, keyed by the
    workload (a user's file: its content's sha256 and function, never its path), the graph's
    structure, batch, batches, method, seed, gamma, rounding and the method's settings. A cached
    table is reused when it has a value for every op at every precision in ``needs`` that
    the op allows (``None``: every precision the op allows; e.g. a table made before int4
    joined the menus serves every cluster without int4).

    Before it builds and runs a model, it estimates the memory that takes
    (:func:`indicator_memory`) and refuses with one line when this machine has less
    (``memory_check=False`` skips that); ``random`` runs no model.

    ``report``: called with one line saying where the table came from (the cache, or
    computed, in how many seconds) and what it holds. ``progress``: a line per batch on a
    terminal, else one every :data:`PROGRESS_EVERY_S` seconds.

    ``curv``: the expected loss increase per step in nats, from ``hutchinson_samples``
    Hessian probes per batch; ``lr`` is the SGD rate of its backward (update) term (0 drops
    it; in the cache key).
    """
    if not lr >= 0:
        raise QsyncInputError(f"lr: expected a non-negative number, got {lr}")
    check_method(method)
    if batches < 1:
        raise QsyncInputError(f"batches: expected a positive integer, got {batches}")
    wl = resolve_workload(workload) if isinstance(workload, str) else workload
    if not isinstance(wl, (Workload, UserWorkload)):
        raise QsyncInputError("model: indicate() takes a registry name, a PATH.py:FUNCTION "
                              f"file or a workload object, not {type(wl).__name__}")
    b = batch if batch is not None else wl.default_batch
    if b < 1:
        raise QsyncInputError(f"batch: expected a positive integer, got {b}")
    graph = graph or trace(wl, b, warn=False)  # the caller's own trace warned already
    t_start = time.perf_counter()
    # a user's file is cached by its content hash (and function), never by its path
    cacheable = cache and model is None and data is None
    path = None
    if cacheable:
        folder = Path(cache_dir) if cache_dir else default_cache_dir()
        tag = "" if term_dtype == torch.float32 else f"-{str(term_dtype).split('.')[-1]}"
        tag += f"-r{term_rows}" if term_rows else ""
        tag += f"-h{hutchinson_samples}-lr{lr:g}" if method == "curv" else ""
        key = (f"user-{wl.fn_name}-{wl.sha256[:16]}" if isinstance(wl, UserWorkload)
               else wl.name)
        path = folder / (f"{key}-b{b}-n{batches}-{method}-s{seed}-g{gamma:g}-"
                         f"{'sr' if stochastic else 'rtn'}{tag}-{graph.structure_hash()}.json")
        if path.is_file():
            try:
                table = load(path, IndicatorTable)
                # a table cached before a precision joined the ops' menus (int4) is stale
                # for a caller that needs that precision (``needs``: default, every one)
                if all(p in table.values.get(o.name, {}) for o in graph.choosable_ops()
                       if o.name not in table.unmeasured
                       for p in o.allowed_precisions if needs is None or p in needs):
                    log.info("indicator: reusing %s", path)
                    table = table.model_copy(update={"workload": wl.name})  # a moved file
                    if report is not None:
                        report(f"indicator {method}: from the cache ({path}; "
                               f"{_summary(table)})")
                    return table
                log.info("indicator: %s lacks a precision the ops allow; recomputing", path)
            except QsyncInputError as exc:
                log.warning("indicator cache %s unreadable (%s); recomputing", path, exc)
    torch.manual_seed(seed)
    ops = [o for o in graph.ops if o.role == OpRole.choosable]
    names = [o.name for o in ops]
    if method != "random":
        need = indicator_memory(graph, method)
        if model is not None:  # its weights are already in memory
            need = dataclasses.replace(need, weights=0)
        if memory_check:
            check_indicator_memory(need, wl.name)
        if progress and sys.stderr.isatty():  # off a terminal: the summary line says it
            have = available_memory_bytes()
            sys.stderr.write(f"indicator {method}: {wl.name} ({graph.param_count / 1e6:.1f} M "
                             f"parameters) on this CPU, about {need.describe()}"
                             + (f" of {_gib(have)} GiB available" if have is not None else "")
                             + "\n")
        if model is None:
            model = wl.build()
        model = model.float().train()
    # (inputs, targets): a registry model's tensors; a user's file's batches are whatever its
    # data() yields (its loss reads the targets from them), paired with None
    stream: Iterable[tuple[Any, Any]]
    data_kind = "given"
    if data is not None:
        stream = data
    elif isinstance(wl, UserWorkload):
        stream = ((x, None) for x in wl.batches(b, batches, seed))
        data_kind = "real" if wl.real_data else "synthetic"
    elif wl.real_data:
        stream, data_kind = real_batches(wl, b, batches, seed), "real"
    else:
        stream, data_kind = synthetic_batches(wl, b, batches, seed), "synthetic"
    user_lines: list[str] = []
    ran: set[str] = set()  # ops a call of which was captured, in any batch
    stats = {n: _OpStats() for n in names}
    gen = torch.Generator().manual_seed(seed)
    rng_values = {n: torch.rand((), generator=gen).item() for n in names}
    seen = 0
    tick = _Progress(progress, method, batches)
    curvatures: set[str] = set()
    if method != "random":
        assert model is not None
        for i, (inputs, targets) in enumerate(stream):
            if i >= batches:
                break
            if method == "curv":
                def run(_in: Any = inputs, _t: Any = targets, _i: int = i,
                        _lines: list[str] = user_lines) -> tuple[Any, Tensor]:
                    out = wl.forward(model, _in)
                    loss = wl.loss_of(out, _in, _t)
                    if _i == 0 and isinstance(wl, UserWorkload):
                        _lines[:] = [wl.loss_line(out, _in), wl.data_line()]
                    return out, loss

                model.zero_grad(set_to_none=True)
                allowed: dict[str, Sequence[Precision]] = {
                    o.name: list(o.allowed_precisions) for o in ops}
                got, used = _curv_batch(model, names, run, allowed, samples=hutchinson_samples,
                                        gen=gen, stochastic=stochastic, lr=lr, ran=ran)
                curvatures.add(used)
                for n, terms_c in got.items():
                    for p, (vf, vb) in terms_c.items():
                        stats[n].fwd.setdefault(p, []).append(vf)
                        stats[n].bwd.setdefault(p, []).append(vb)
                seen += 1
                tick(seen)
                continue
            model.zero_grad(set_to_none=True)
            with CallCapture(model, names) as capture:
                out = wl.forward(model, inputs)
                loss = wl.loss_of(out, inputs, targets)
            if i == 0 and isinstance(wl, UserWorkload):
                user_lines = [wl.loss_line(out, inputs), wl.data_line()]
            if method == "hessian":
                traces = _hutchinson(loss, capture.calls, hutchinson_samples, gen)
            else:
                loss.backward()
            caps = _captures(capture.calls)
            ran.update(caps)
            for op in ops:
                precisions = list(op.allowed_precisions)
                for bl, cap in caps.get(op.name, []):
                    if method == "qsync":
                        terms_p = _qsync_terms(bl, cap, precisions, stochastic, term_dtype,
                                               term_rows)
                        for p, (vf, vb) in terms_p.items():
                            stats[op.name].fwd.setdefault(p, []).append(vf)
                            stats[op.name].bwd.setdefault(p, []).append(vb)
                    elif method == "fisher":
                        for p, v in _fisher_terms(bl, cap, precisions, stochastic).items():
                            stats[op.name].value.setdefault(p, []).append(v)
                    elif method == "wvar":
                        for p, v in _wvar_terms(bl, cap, precisions, stochastic).items():
                            stats[op.name].value.setdefault(p, []).append(v)
                    else:  # hessian
                        w_tr, a_tr = traces.get(op.name, (0.0, 0.0))
                        k_b = bl.b_is_weight
                        for p in precisions:
                            k = SPECS[p]
                            if k is None:
                                stats[op.name].value.setdefault(p, []).append(0.0)
                                continue
                            e_w = float(element_variance(cap.b, k.b, per_channel=k_b,
                                                         stochastic=stochastic).sum())
                            e_a = float(element_variance(cap.a, k.a,
                                                         stochastic=stochastic).sum())
                            stats[op.name].value.setdefault(p, []).append(
                                (w_tr if k_b else a_tr) * e_w + a_tr * e_a)
            seen += 1
            tick(seen)
        model.zero_grad(set_to_none=True)
    values: dict[str, dict[Precision, float]] = {}
    terms: dict[str, dict[Precision, list[float]]] = {}
    clamped = 0
    L = graph.max_depth
    unmeasured = {} if method == "random" else {
        n: (UNMEASURED_GRAD if n in ran else UNMEASURED_RAN) for n in names
        if not (stats[n].fwd or stats[n].value)}
    for op in ops:
        if op.name in unmeasured:  # fp32 only (0 by definition), never a default at another
            values[op.name] = {Precision.fp32: 0.0}  # precision: the caller pins it fp32
            continue
        row: dict[Precision, float] = {}
        st = stats[op.name]
        for p in op.allowed_precisions:
            if method == "random":
                row[p] = 0.0 if p == Precision.fp32 else rng_values[op.name] * _NOMINAL[p]
            elif method == "qsync":
                vf = _mean(st.fwd.get(p, []))
                vb = _mean(st.bwd.get(p, []))
                row[p] = gamma * (L - op.depth) * vf + op.depth * vb
                terms.setdefault(op.name, {})[p] = [vf, vb]
            elif method == "curv":
                vf = _mean(st.fwd.get(p, []))
                vb = _mean(st.bwd.get(p, []))
                terms.setdefault(op.name, {})[p] = [vf, vb]
                if vf + vb < 0:  # Hutchinson noise, or a loss concave along this op
                    clamped += 1
                row[p] = max(0.0, vf + vb)
            else:
                row[p] = _mean(st.value.get(p, []))
        values[op.name] = row
    fixes = enforce_monotone(values)
    init = f"{wl.fn_name}() of {wl.path.name}" if isinstance(wl, UserWorkload) else "registry init"
    notes = [f"{data_kind} data, {seen if method != 'random' else 0} batches of {b}; model: "
             f"{'given' if data_kind == 'given' else init + ', seed ' + str(seed)}",
             f"monotonicity: {fixes} value(s) raised to their higher-precision neighbour"]
    if method == "curv":
        curv = " and ".join(sorted(curvatures)) or "gn"
        notes.insert(0, "values: the expected increase of the batch-mean loss in one training "
                     "step, in nats, to second order: 1/2 E[dy^T H dy] for the op's output "
                     "error dy under the error model (forward), plus 1/2 lr^2 E[dG^T H_W dG] "
                     f"for its weight-gradient error dG under SGD lr {lr:g} (backward); H: "
                     f"{'Gauss-Newton' if curv == 'gn' else curv} curvature, "
                     f"{hutchinson_samples} Hutchinson probe(s) per batch and precision "
                     "pattern; terms: [forward, backward] nats, before clamping")
        notes.append(f"negative estimates clamped to 0: {clamped} value(s)")
    notes += user_lines
    if unmeasured:
        notes.append(f"{len(unmeasured)} choosable op(s) not measured (no value; pin them "
                     f"fp32): {', '.join(sorted(unmeasured)[:5])}"
                     + (" ..." if len(unmeasured) > 5 else ""))
    table = IndicatorTable(
        workload=wl.name, graph_hash=graph.structure_hash(), method=method, batch_size=b,
        batches=max(1, seen) if method != "random" else batches, seed=seed,
        gamma=gamma if method == "qsync" else None, data=data_kind, values=values,
        stochastic=stochastic, notes=notes, monotone_fixes=fixes,
        terms=terms if method in ("qsync", "curv") else None, unmeasured=unmeasured,
    )
    if path is not None:
        save(table, path)
    if report is not None:
        report(f"indicator {method}: computed on this CPU in "
               f"{time.perf_counter() - t_start:.1f} s ({_summary(table)}); "
               + (f"cached in {path}" if path is not None else "not cached"))
    return table


def _summary(table: IndicatorTable) -> str:
    """What a table holds, in a few words: ops, batches, data, unmeasured ops."""
    text = (f"{len(table.values)} ops, {table.batches} batch(es) of {table.batch_size}, "
            f"{table.data} data")
    if table.unmeasured:
        text += f", {len(table.unmeasured)} op(s) unmeasured"
    return text


def cover(table: IndicatorTable, graph: ModelGraph) -> IndicatorTable:
    """``table`` for ``graph`` (traced at another batch, say): a choosable op of ``graph``
    the table has no row for (the trace at the table's batch took another path) joins its
    ``unmeasured``, with an fp32 row only, so it is pinned rather than lowered for free."""
    lacking = [o.name for o in graph.choosable_ops() if o.name not in table.values]
    if not lacking:
        return table
    why = (f"no indicator value: not in the model's graph at the indicator's batch "
           f"{table.batch_size} (its trace there took another path)")
    return table.model_copy(update={
        "values": {**table.values, **{n: {Precision.fp32: 0.0} for n in lacking}},
        "unmeasured": {**table.unmeasured, **dict.fromkeys(lacking, why)}})


#: Why an op has no indicator value (:attr:`IndicatorTable.unmeasured`); the CLI pins such
#: ops fp32 and prints the reason.
UNMEASURED_RAN = ("no indicator value: no call of it ran in the measured batches' forward "
                  "(a code path the trace took and the batches did not)")
UNMEASURED_GRAD = ("no indicator value: its output carries no gradient, so the loss "
                   "curvature in it cannot be measured")


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def enforce_monotone(values: dict[str, dict[Precision, float]]) -> int:
    """Raise any value below a more exact precision's in its family; return how many."""
    fixes = 0
    for row in values.values():
        for ladder in LADDERS:
            best = 0.0
            for p in ladder:
                if p not in row:
                    continue
                if row[p] < best:
                    row[p] = best
                    fixes += 1
                best = row[p]
    return fixes


def scale_to_batch(table: IndicatorTable, batch: int) -> dict[str, dict[Precision, float]]:
    """Omega for another per-device batch. The qsync form is relative (errors over signal
    energy, both proportional to the batch), so it carries over unchanged."""
    if batch < 1:
        raise QsyncInputError(f"batch: expected a positive integer, got {batch}")
    return {op: dict(row) for op, row in table.values.items()}


def rank_table(table: IndicatorTable, precision: Precision = Precision.int8
               ) -> list[tuple[str, float]]:
    """Ops by their value at ``precision`` (or their least exact one), most sensitive first."""
    out = []
    for op, row in table.values.items():
        p = precision if precision in row else min(row, key=lambda q: q.info.rank)
        out.append((op, row[p]))
    return sorted(out, key=lambda kv: -kv[1])

