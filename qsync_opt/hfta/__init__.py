"""Horizontally fused training arrays (HFTA): ``B`` variants of one model trained
as one job, each with its own weights, hyper-parameters and data stream.

Layouts (the fused operators' contract, :mod:`.layouts`; every fused op says which it takes):

* channel-folded, ``[N, B*C, *spatial]``: the conv family (Conv2d as one grouped
  convolution, BatchNorm2d over ``B*C`` channels, pooling, elementwise ops), model ``b``'s
  channels at ``b*C .. b*C + C - 1``;
* model-major, ``[B, *per_model_shape]`` of any rank: the linear family (Linear as one
  batched matmul, LayerNorm, Embedding, the attention MatMul, the loss), model ``b``'s value
  at index ``b`` (``[B, N, F]`` for a head, ``[B, N, T, D]`` / ``[B, N, H, T, T]`` in a
  transformer);
* shared, no model axis: what every model computes alike (buffers such as a causal mask,
  position ids, sizes, a replicated input), broadcast against the per-model shape where it
  meets a model-major value (:mod:`.translation`).

Every fused parameter has the model axis first (``[B, ...]``: a Linear's weight is
``[B, out, in]``, a Conv2d's ``[B, out, in / groups, kh, kw]``), so the fused optimizers
(:mod:`.optim`) update all ``B`` models with one set of tensor ops and per-model
hyper-parameter arrays broadcast along it, and model ``b``'s standalone weights are the
``b``-th slice of each.

A parameter two modules share (a GPT's tied ``lm_head`` / ``wte``) is one fused tensor of
both fused ops, listed once.

Parts, each one job:

* the fused operators: :mod:`.conv_ops` (Conv2d, BatchNorm2d), :mod:`.linear_ops` (Linear,
  LayerNorm, Embedding, the attention MatMul), :mod:`.stacking` (``from_modules`` /
  ``export``), :mod:`.layouts` (the moves between layouts);
* the converter: :mod:`.convert` (``fuse``), :mod:`.layout_walk` (a model's fx graph walked
  once), :mod:`.op_tables` (what the walk knows of each op), :mod:`.translation` (the rules
  its steps run), :mod:`.fused_array` (the module it builds, with per-op modes);
  :mod:`.functional` (the torch.func route, for any model);
* the optimizers: :mod:`.optim` (fused SGD with momentum and AdamW, a per-model step mask),
  :mod:`.hyperparams` (per-model hyper-parameter arrays), :mod:`.lr_schedules` (fused
  learning-rate schedules);
* the run side: :mod:`.choice` (fuse or not, measured), :mod:`.trainer` (the array's
  training step), :mod:`.sweep` (``run_sweep``), :mod:`.export` (a model as a ``train``
  run). The ``sweep`` command is :mod:`qsync_opt.cli.sweep`.
"""
