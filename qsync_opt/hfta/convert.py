"""A workload's model as a B-array: ``B`` standalone models fused into one module.

:func:`fuse` traces the first model with ``torch.fx`` (torch.nn leaf modules, and the
attention :class:`~qsync_opt.models.layers.MatMul`) and walks its graph once, giving every
value a layout (:mod:`qsync_opt.hfta`):

* ``C``, channel-folded ``[N, B*C, H, W]``: through a conv trunk (Conv2d, BatchNorm2d,
  pooling and elementwise ops run on it unchanged);
* ``M``, model-major ``[B, *per_model_shape]`` of any rank: the model axis first, model
  ``b``'s value at index ``b`` (the linear head ``[B, N, F]``, a transformer's
  ``[B, N, T, D]`` hidden states, its ``[B, N, H, T, T]`` attention scores, the tuple of
  model-major chunks ``split`` gives);
* ``S``, shared by all models, no model axis: buffers read outside a module (a causal mask,
  position ids: equal in every model, else refused), what is computed from them alone
  (``narrow``, ``arange``, ``logical_not``), sizes, the replicated input.

Each op with parameters becomes its fused operator built from the ``B`` models' own modules
(:mod:`.conv_ops`, :mod:`.linear_ops`): Conv2d, BatchNorm2d (``C``), Linear, LayerNorm (``M``,
any rank), Embedding (ids ``M`` ``[B, *S]`` or shared ``[*S]``, both giving ``[B, *S, D]``);
an attention ``MatMul`` becomes :class:`~.linear_ops.FusedMatMul` (no parameters; it carries
a plan's precision). A tensor parameter two modules share (GPT's ``lm_head.weight`` is ``transformer.wte.weight``)
is one fused ``[B, ...]`` Parameter of both fused ops, so both uses' gradients add as in the
standalone model, and :meth:`FusedArray.export` ties it again. Stateless modules (ReLU,
GELU, pooling, dropout, identity) run unchanged on either layout; ``torch.flatten(x, 1)`` (or
``nn.Flatten``) of a channel-folded tensor becomes :func:`~.layouts.conv_to_linear`.

Shape-aware ops on a model-major value are translated: dims given as non-negative ints
shift by one past the model axis (transpose, permute, split / chunk / unbind, flatten,
unflatten, narrow, select, squeeze / unsqueeze, softmax / log_softmax, cumsum, movedim,
sum / mean, cat / stack), negative dims stay; ``x.size(d)`` / ``x.shape`` / ``x.dim()`` read
the per-model sizes; ``view`` / ``reshape`` / ``expand`` / ``repeat`` get the model axis
prepended; indexing keeps it. Elementwise ops, ``masked_fill``, ``torch.where`` and
``scaled_dot_product_attention`` broadcast as the standalone model does: a shared tensor
right-aligned against the per-model shape, and a model-major value of lower per-model rank
than the others (or than a shared operand) gets singleton dims after its model axis.
``torch.matmul`` / ``@`` / ``bmm`` / MatMul of model-major values is a batched matmul. A
channel-folded value read by any other op is viewed model-major first
(:func:`~.layouts.unfold`). An op the walk cannot place (an unknown module, a function it has
no translation for, a parameter read outside a module, a buffer that differs between the
models, indexing by a per-model tensor, random numbers drawn for a shared value) is
refused, naming it; the torch.func route (:mod:`.functional`) runs any model.

Inputs: ``per_model`` (each model its own stream: ``[B, N, ...]``, model-major) or
``replicated`` (one ``[N, ...]`` batch for all ``B``, a shared value: copied into each
model's channels for a conv, broadcast for a Linear, looked up by every model's table for an
Embedding; the models then differ only in weights and hyper-parameters, not in data, so
they are not separate runs of a seed sweep); the output is ``[B, N, ...]``.

The fused array (:class:`~.fused_array.FusedArray`) runs every op with parameters ``fused``
or ``serial`` and the whole model ``separate``, and gives model ``b`` back
(:meth:`~.fused_array.FusedArray.export`). The parts: :mod:`.layout_walk` (the walk),
:mod:`.op_tables` (what it knows of each op), :mod:`.translation` (the rules its steps run),
:mod:`.layouts` (the moves between layouts), :mod:`.fused_array` (the module it builds).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx as fx
from torch import nn

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.hfta.fused_array import FusedArray
from qsync_opt.hfta.layout_walk import LayoutWalk
from qsync_opt.models.layers import MatMul

__all__ = ["INPUT_MODES", "fuse"]

INPUT_MODES = ("per_model", "replicated")


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, MatMul):  # a named attention matmul: a plan gives it a precision
            return True
        return (type(m).__module__.startswith("torch.nn")
                and not isinstance(m, (nn.Sequential, nn.ModuleList, nn.ModuleDict)))


def fuse(models: Sequence[nn.Module], *, input_mode: str = "per_model") -> FusedArray:
    """Fuse ``B`` standalone models of one architecture into a :class:`FusedArray`."""
    if input_mode not in INPUT_MODES:
        raise QsyncInputError(f"input mode: expected per_model or replicated, got "
                              f"{input_mode!r}")
    if not models:
        raise QsyncInputError("models: expected at least one")
    classes = {type(m) for m in models}
    if len(classes) != 1:
        raise QsyncInputError(f"models: one architecture, got {sorted(c.__name__ for c in classes)}")
    template = models[0]
    graph = _Tracer().trace(template)
    walk = LayoutWalk(models, input_mode)
    for n in graph.nodes:
        walk.node(n)
    return FusedArray(walk.B, template, walk.steps, walk.fused, walk.shared, input_mode,
                      matmuls=walk.matmuls, consts=walk.consts, shared_ids=walk.shared_ids,
                      ties=list(walk.ties.values()))
