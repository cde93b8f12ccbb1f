"""The indicator's error model: each precision's error kinds per operand and the
per-element variance of each kind.

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
1/2 lr^2 E[dG^T H_W dG] for the weight-gradient error under SGD (``curv_batch``).

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
channel (``int8gcol``) for the weight gradient; ``Kinds.g_b`` carries the second. An
attention or functional matmul at int8_full runs the same two quantizations of its output
gradient (per row for ``a``'s gradient, per last-axis channel for ``b``'s), and uses its
activation ``b`` in backward at its forward scale (:func:`kinds_for`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import Precision

#: The indicator methods, the one list (``qsync-opt indicate/solve/compare/pareto/demo
#: --method`` offer these choices): the default first.
METHODS = ("qsync", "wvar", "hessian", "fisher", "random", "curv")
#: The ``curv`` method's default SGD learning rate for its backward (update) term: the
#: accuracy study's SGD rate (benchmarks/bench_accuracy.py, digits_cnn). ``lr=0`` drops it.
CURV_LR = 0.05
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


def kind_parts(kind: str) -> list[tuple[str, float]]:
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
class Kinds:
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


SPECS: dict[Precision, Kinds | None] = {
    Precision.fp32: None,
    Precision.tf32: Kinds("tf32", "tf32", "tf32", "tf32", "tf32"),
    Precision.fp16: Kinds("m10", "m10", "fp16g", "m10", "m10"),
    Precision.bf16: Kinds("m7", "m7", "m7", "m7", "m7"),
    Precision.int8: Kinds("int8", "int8", "fp16g", "int8", "int8"),
    # int8_full's output gradient: one scale per row (token / output position) for the
    # input gradient, one per output channel for the weight gradient (ops.NUMERICS)
    Precision.int8_full: Kinds("int8", "int8", "int8row", "int8", "int8+col", "int8gcol"),
    Precision.fp8: Kinds("e4m3", "e4m3", "e5m2", "e4m3", "e4m3"),
    # int4 rounds to nearest (ops.NUMERICS), whatever the int8 rounding
    Precision.int4: Kinds("int4n", "int4n", "fp16g", "int4n", "int4n"),
}


def kinds_for(p: Precision, b_is_weight: bool) -> Kinds | None:
    """The error kinds of precision ``p`` on an op whose ``b`` is a weight or not. int8_full
    re-quantizes a weight per input column for the input gradient (its forward scales are
    per output channel, which do not factor out of ``G @ W``); a matmul's activation ``b``
    has one scale, which does, so its backward uses it as the forward did
    (:func:`qsync_opt.ops.gemm.int8_full_gemm`)."""
    k = SPECS[p]
    if k is None or b_is_weight or k.b_bwd != "int8+col":
        return k
    return dataclasses.replace(k, b_bwd="int8")


#: Random method: a per-format factor (about the relative variance of one rounding).
NOMINAL = {Precision.tf32: 2.0**-22, Precision.fp16: 2.0**-22, Precision.bf16: 2.0**-16,
            Precision.fp8: 2.0**-8, Precision.int8: (1 / 127) ** 2,
            Precision.int8_full: 2 * (1 / 127) ** 2, Precision.int4: (1 / 7) ** 2}


#: Largest int4 level: symmetric [-7, 7], as int8 uses [-127, 127].
INT4_QMAX = 7
