"""Horizontally fused training arrays (HFTA): ``B`` variants of one model trained
as one job, each with its own weights, hyper-parameters and data stream.

Layouts (the fused operators' contract; every op of :mod:`.ops` says which it takes):

* channel-folded, ``[N, B*C, *spatial]``: the conv family (Conv2d as one grouped
  convolution, BatchNorm2d over ``B*C`` channels, pooling, elementwise ops), model ``b``'s
  channels at ``b*C .. b*C + C - 1``;
* model-major, ``[B, *per_model_shape]`` of any rank: the linear family (Linear as one
  batched matmul, LayerNorm, Embedding, the attention MatMul, the loss), model ``b``'s value
  at index ``b`` (``[B, N, F]`` for a head, ``[B, N, T, D]`` / ``[B, N, H, T, T]`` in a
  transformer);
* shared, no model axis: what every model computes alike (buffers such as a causal mask,
  position ids, sizes, a replicated input), broadcast against the per-model shape where it
  meets a model-major value (:mod:`.convert`).

Every fused parameter has the model axis first (``[B, ...]``: a Linear's weight is
``[B, out, in]``, a Conv2d's ``[B, out, in / groups, kh, kw]``), so the fused optimizers
(:mod:`.optim`) update all ``B`` models with one set of tensor ops and per-model
hyper-parameter arrays broadcast along it, and model ``b``'s standalone weights are the
``b``-th slice of each.

A parameter two modules share (a GPT's tied ``lm_head`` / ``wte``) is one fused tensor of
both fused ops, listed once.

Parts: :mod:`.ops` (the fused operators, ``from_modules`` / ``export``), :mod:`.optim`
(fused SGD with momentum and AdamW, fused learning-rate schedules, a per-model step mask),
:mod:`.convert` (a model's fx graph walked into a fused array), :mod:`.functional` (the
torch.func route, for any model), :mod:`.choice`, :mod:`.trainer`, :mod:`.sweep`.
"""
