"""A model cut into sequential stages, with compressed boundaries between them.

:func:`split_stages` (:mod:`qsync_opt.pipeline.cuts`: a cut at a named scope of the traced
graph, or balanced from per-op costs) says which stage each traced node is in.

Each stage is its own module (its own copy of its parameters). A parameter two stages use
(tiny_gpt ties ``lm_head.weight`` to ``transformer.wte.weight``) is held by both, and its
gradient is summed between them after backward (:meth:`Pipeline.sync_tied_grads`: the
all-reduce between the stages that hold it), so the copies step identically.

A :class:`Boundary` is one tensor crossing between two stages, as an autograd function:
forward sends the activation through its compressor (sender codec, then receiver codec,
:mod:`qsync_opt.strategy.codecs`), backward sends its gradient through another. Bytes are
counted per direction. In eval mode the activation is compressed only with
``compress_at_eval`` (by the compressor alone: no feedback state is read or changed);
gradients never flow at eval.

:meth:`Pipeline.train_step` runs a GPipe schedule in one process: the batch in ``M``
micro-batches, every micro-batch's forward through all stages, then their backwards in
reverse order, each micro-batch's loss weighted by its share of the batch (so with identity
boundaries the gradient is the whole batch's, up to the order of sums; BatchNorm sees
micro-batch statistics, as in any GPipe pipeline). The multi-process pipeline runs the same
stages and boundaries with the codec halves on either side of a send/recv.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.fx.passes.split_module import split_module

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.pipeline.cuts import (
    BALANCE_SLACK,
    StageSplit,
    op_costs_from_table,
    plan_op_costs,
    split_stages,
    stage_costs,
    trace_model,
)
from qsync_opt.strategy.codecs import Codec, Compressor, Identity, make_codec

__all__ = ["BALANCE_SLACK", "Boundary", "Pipeline", "StageSplit", "micro_sizes",
           "op_costs_from_table", "plan_op_costs", "split_stages", "split_top", "stage_costs",
           "trace_model"]


class _BoundaryFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, b: Boundary, slot: int, idx: Tensor | None) -> Tensor:
        ctx.b, ctx.slot = b, slot
        return b.send_activation(x, slot, idx)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None]:
        return ctx.b.send_gradient(g, ctx.slot), None, None, None


class Boundary:
    """One tensor crossing from stage ``src`` to stage ``dst`` (module docstring)."""

    def __init__(self, name: str, src: int, dst: int, act: tuple[Codec, Codec],
                 grad: tuple[Codec, Codec], act_comp: Compressor) -> None:
        self.name, self.src, self.dst = name, src, dst
        self.act_send, self.act_recv = act
        self.grad_send, self.grad_recv = grad
        self.act_comp = act_comp  # the compressor alone, for eval
        self.act_bytes = 0
        self.grad_bytes = 0
        self.act_raw = 0
        self.grad_raw = 0
        self.compress_at_eval = False
        self.training = True
        self.last_shape: tuple[int, ...] | None = None  # of the last tensor that crossed

    def send_activation(self, x: Tensor, slot: int, idx: Tensor | None) -> Tensor:
        if not self.training:
            if not self.compress_at_eval:
                return x
            p = self.act_comp.compress(x)
            return self.act_comp.decompress(p)
        p = self.act_send.encode(x, idx, slot)
        self.act_bytes += p.nbytes
        self.act_raw += x.numel() * x.element_size()
        y = self.act_recv.decode(p, idx, slot)
        return y.clone() if y is x else y

    def send_gradient(self, g: Tensor, slot: int) -> Tensor:
        p = self.grad_send.encode(g, None, slot)
        self.grad_bytes += p.nbytes
        self.grad_raw += g.numel() * g.element_size()
        y = self.grad_recv.decode(p, None, slot)
        return y.clone() if y is g else y

    def __call__(self, x: Any, slot: int, idx: Tensor | None) -> Any:
        if not isinstance(x, Tensor) or not x.is_floating_point():
            return x  # integer tensors and Python values cross as they are
        self.last_shape = tuple(x.shape)
        if self.training:
            # An activation that needs no gradient (a stage with no parameters before it)
            # still gets one sent back: across processes the receiver cannot tell, so the
            # one-process pipeline sends (and counts) the same bytes.
            if not x.requires_grad:
                x = x.detach().requires_grad_()
            return _BoundaryFn.apply(x, self, slot, idx)
        with torch.no_grad():
            return self.send_activation(x, slot, idx)

    def state_dict(self) -> dict[str, Any]:
        return {k: c.state_dict() for k, c in (("act_send", self.act_send),
                                                ("act_recv", self.act_recv),
                                                ("grad_send", self.grad_send),
                                                ("grad_recv", self.grad_recv))} | {
            "bytes": [self.act_bytes, self.grad_bytes, self.act_raw, self.grad_raw],
            "act_comp": self.act_comp.state_dict()}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        for k in ("act_send", "act_recv", "grad_send", "grad_recv"):
            getattr(self, k).load_state_dict(s[k])
        self.act_bytes, self.grad_bytes, self.act_raw, self.grad_raw = s["bytes"]
        self.act_comp.load_state_dict(s["act_comp"])


CompressorFactory = Callable[[], Compressor]


def split_top(split: StageSplit) -> tuple[fx.GraphModule, dict[str, str], dict[str, Tensor]]:
    """torch's ``split_module`` of the split (the stages share the model's parameters, no
    copy), its qualified-name map and the buffers read outside every stage (constants),
    with the checks that the stages can be built: every stage holds an op, and no parameter
    is read outside every stage. :class:`Pipeline` builds on it; the launcher calls it
    alone to refuse a cut before any rank starts."""
    gm = split.gm
    qualnames: dict[str, str] = {}
    top = split_module(gm, gm, lambda n: split.stage_of[n.name], qualname_map=qualnames,
                       keep_original_order=True)
    consts: dict[str, Tensor] = {}
    for n in top.graph.nodes:
        if n.op == "get_attr":  # a buffer read outside every stage: a constant input
            value = operator.attrgetter(str(n.target))(top)
            if isinstance(value, nn.Parameter) and value.requires_grad:
                raise QsyncInputError(f"stages: parameter {n.target!r} is read outside "
                                      "every stage; cut elsewhere")
            consts[n.name] = value.detach().clone()
    empty = [k for k in range(split.n_stages) if not hasattr(top, f"submod_{k}")]
    if empty:
        k = empty[0]
        where = f"from {split.cuts[k - 1]!r}" if k else "the first"
        raise QsyncInputError(f"stages: stage {k} ({where}) holds no op; cut elsewhere")
    return top, qualnames, consts


class Pipeline(nn.Module):
    """The stages of a :class:`StageSplit` and the boundaries between them, in one process.

    ``act`` / ``grad``: factories of the activation and gradient compressors (one fresh
    compressor per codec, so no state is shared by accident); ``feedback``: ``none``,
    ``ef``, ``ef21`` or ``aqsgd`` (AQ-SGD wraps the activations only -- it is defined on a
    sample's activation across visits -- and the gradients go through the compressor with
    no feedback; it needs ``n_samples``)."""

    def __init__(self, split: StageSplit, *, act: CompressorFactory = Identity,
                 grad: CompressorFactory = Identity, feedback: str = "none",
                 n_samples: int | None = None) -> None:
        super().__init__()
        top, qualnames, self.consts = split_top(split)
        originals = [getattr(top, f"submod_{k}") for k in range(split.n_stages)]
        holders: dict[int, list[tuple[int, str]]] = {}
        for k, m in enumerate(originals):
            for name, p in m.named_parameters(remove_duplicate=False):
                holders.setdefault(id(p), []).append((k, name))
        self.stages = nn.ModuleList([copy.deepcopy(m) for m in originals])
        #: per stage, its parameters' names in the original model
        self.original_names: list[dict[str, str]] = []
        for k, m in enumerate(self.stages):
            names = {}
            for name, _ in m.named_parameters(remove_duplicate=False):
                head, _, leaf = name.rpartition(".")
                orig = qualnames.get(f"submod_{k}.{head}", head.replace("_", "."))
                names[name] = f"{orig}.{leaf}" if orig else leaf
            self.original_names.append(names)
        #: parameters held by more than one stage: [(stage, name), ...] per tie
        self.ties = [h for h in holders.values() if len({k for k, _ in h}) > 1]
        self.split = split
        self.feedback = feedback
        self.plan_nodes = self._schedule(top)
        self.boundaries: dict[str, Boundary] = {}
        for name, src, dst in self._crossings():
            act_fb = feedback
            grad_fb = "none" if feedback == "aqsgd" else feedback
            self.boundaries[name] = Boundary(
                name, src, dst,
                (make_codec(act(), act_fb, n_samples=n_samples),
                 make_codec(act(), act_fb, n_samples=n_samples)),
                (make_codec(grad(), grad_fb), make_codec(grad(), grad_fb)), act())
        self.micro_losses: list[float] = []

    @staticmethod
    def _schedule(top: fx.GraphModule) -> list[fx.Node]:
        return list(top.graph.nodes)

    def producer(self, node: fx.Node) -> int | None:
        """The stage whose output ``node`` is (through getitem), None for an input."""
        while node.op == "call_function" and node.target is operator.getitem:
            node = node.args[0]  # type: ignore[assignment]
        if node.op == "call_module":
            return int(str(node.target).removeprefix("submod_"))
        return None

    def _crossings(self) -> list[tuple[str, int, int]]:
        out = []
        for n in self.plan_nodes:
            if n.op != "call_module":
                continue
            dst = int(str(n.target).removeprefix("submod_"))
            for a in n.all_input_nodes:
                src = self.producer(a)
                if src is not None and src != dst:
                    out.append((f"{a.name}->{dst}", src, dst))
        return out

    def set_compress_at_eval(self, on: bool) -> None:
        for b in self.boundaries.values():
            b.compress_at_eval = on

    def train(self, mode: bool = True) -> Pipeline:
        super().train(mode)
        for b in getattr(self, "boundaries", {}).values():
            b.training = mode
        return self

    def run(self, inputs: Sequence[Any], slot: int = 0, idx: Tensor | None = None) -> Any:
        """One micro-batch through every stage, boundaries applied."""
        env: dict[str, Any] = {}
        it = iter(inputs)
        result: Any = None
        for n in self.plan_nodes:
            if n.op == "placeholder":
                env[n.name] = next(it)
            elif n.op == "call_module":
                k = int(str(n.target).removeprefix("submod_"))
                args = []
                for a in n.args:
                    v = env[a.name] if isinstance(a, fx.Node) else a
                    if isinstance(a, fx.Node):
                        src = self.producer(a)
                        if src is not None and src != k:
                            v = self.boundaries[f"{a.name}->{k}"](v, slot, idx)
                    args.append(v)
                env[n.name] = self.stages[k](*args)
            elif n.op == "call_function" and n.target is operator.getitem:
                env[n.name] = env[n.args[0].name][n.args[1]]  # type: ignore[union-attr,index]
            elif n.op == "get_attr":
                env[n.name] = self.consts[n.name]
            elif n.op == "output":
                result = fx.node.map_arg(n.args[0], lambda a: env[a.name])
            else:  # pragma: no cover - split_module's top graph has only these
                raise RuntimeError(f"unexpected node {n.op} in the pipeline's top graph")
        return result

    def forward(self, *inputs: Any) -> Any:
        return self.run(inputs)

    def sync_tied_grads(self) -> None:
        """Sum each tied parameter's gradient over the stages that hold it."""
        for tie in self.ties:
            params = [self.stages[k].get_parameter(name) for k, name in tie]
            grads = [p.grad for p in params if p.grad is not None]
            if not grads:
                continue
            total = grads[0].clone()
            for g in grads[1:]:
                total += g
            for p in params:
                p.grad = total.clone()

    def train_step(self, loss_of: Callable[..., Tensor],
                   inputs: Sequence[Tensor], targets: Tensor, *, micro_batches: int = 1,
                   idx: Tensor | None = None) -> float:
        """Forward and backward of one batch in ``micro_batches`` (GPipe); the gradients
        are left in the stages' parameters, tied ones summed. Returns the batch's loss."""
        b = int(targets.shape[0])
        if not 1 <= micro_batches <= b:
            raise QsyncInputError(f"micro-batches: expected 1 to the batch ({b}), got "
                                  f"{micro_batches}")
        parts = [torch.tensor_split(t, micro_batches) for t in inputs]
        tparts = torch.tensor_split(targets, micro_batches)
        iparts = torch.tensor_split(idx, micro_batches) if idx is not None else None
        losses = []
        for m in range(micro_batches):
            mb_in = [p[m] for p in parts]
            out = self.run(mb_in, m, iparts[m] if iparts is not None else None)
            share = tparts[m].shape[0] / b
            losses.append(loss_of(out, mb_in, tparts[m]) * share)
        for m in reversed(range(micro_batches)):
            losses[m].backward()
        self.sync_tied_grads()
        self.micro_losses = [float(x.detach()) for x in losses]
        return float(sum(x.detach() for x in losses))

    def full_state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs of the pipeline: the stages' parameters and
        buffers and every boundary's codec state (feedback buffers, RNGs, byte counters)."""
        return {"stages": self.stages.state_dict(), "codecs": self.codec_state()}

    def load_full_state_dict(self, state: dict[str, Any]) -> None:
        self.stages.load_state_dict(state["stages"])
        self.load_codec_state(state["codecs"])

    def codec_state(self) -> dict[str, Any]:
        return {name: b.state_dict() for name, b in self.boundaries.items()}

    def load_codec_state(self, state: dict[str, Any]) -> None:
        if set(state) != set(self.boundaries):
            raise QsyncInputError("checkpoint: its boundaries are not this pipeline's")
        for name, s in state.items():
            self.boundaries[name].load_state_dict(s)

    def boundary_sample_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per boundary, one sample's shape of the last tensor that crossed (run a forward
        first): what AQ-SGD's per-sample buffers hold, known before any is allocated."""
        return {k: b.last_shape[1:] for k, b in self.boundaries.items()
                if b.last_shape is not None}

    def wire_bytes(self) -> tuple[int, int]:
        """Activation and gradient bytes sent so far, over every boundary."""
        return (sum(b.act_bytes for b in self.boundaries.values()),
                sum(b.grad_bytes for b in self.boundaries.values()))


def micro_sizes(batch: int, micro: int) -> list[int]:
    """The sizes of the ``micro`` micro-batches a batch of ``batch`` samples splits into
    (as :meth:`Pipeline.train_step` splits it)."""
    return [int(t.numel()) for t in torch.tensor_split(torch.arange(batch), micro)]
