"""What both tracers share: the raw op record, the saved-tensor recorder, meta
copies of parameters and inputs, and the decomposed attention run as steps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qsync_opt.documents.schemas import OpKind
from qsync_opt.ops.attention import mha_forward, sdpa_forward
from qsync_opt.ops.naming import tensors_of


@dataclass
class RawOp:
    """What a tracer learned about one op before the shared post-processing."""

    name: str
    kind: OpKind
    target: str
    module: nn.Module | None
    inputs: list[tuple[str, torch.Tensor]]  # (producer op, the tensor it gave this op)
    input_tensors: list[torch.Tensor]  # activation inputs (meta)
    outputs: list[torch.Tensor]
    params: list[torch.Tensor]  # parameters the op reads
    saved: list[torch.Tensor] = field(default_factory=list)
    is_loss_part: bool = False
    tie_key: Any = None  # ops with one key share one decision (default: their module)
    opaque: bool = False  # a Python function fx kept as one op (torch.fx.wrap)
    hidden_gemms: int = 0  # GEMM calls run inside an opaque op
    hidden_flops: int = 0  # the FLOPs those calls and the rest inside it did


class SavedRecorder:
    """saved_tensors_hooks that attribute every saved tensor to the op running now."""

    def __init__(self) -> None:
        self.current: list[torch.Tensor] | None = None
        self.keep: list[torch.Tensor] = []  # keeps storages alive so ids are not reused

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.current is not None:
            self.current.append(t)
            self.keep.append(t)
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def storage_id(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


def meta_like(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return out.requires_grad_(t.requires_grad) if t.is_floating_point() else out


class Expansion:
    """The step function (``step(suffix, kind, fn, *args)``) a decomposed attention
    (:func:`qsync_opt.ops.attention.mha_forward` / ``sdpa_forward``) runs under while
    tracing: each step runs under the saved-tensor recorder and becomes a raw op named
    ``<base>.<suffix>``, linked to its producers by tensor identity. The runtime runs the
    very same decomposition, so the graph's FLOPs and memory are those the runtime spends."""

    def __init__(self, base: str, target: str, rec: SavedRecorder, raw: list[RawOp],
                 producer: dict[int, str], unique: Callable[[str], str],
                 param_storages: set[int], alive: list[Any], is_loss: bool,
                 tie: int | None = None) -> None:
        self.base, self.target, self.rec, self.raw = base, target, rec, raw
        self.producer, self.unique, self.param_storages = producer, unique, param_storages
        self.alive, self.is_loss, self.tie = alive, is_loss, tie
        self.last: str | None = None

    def __call__(self, suffix: str, kind: OpKind, fn: Callable[..., Any], *args: Any,
                 **kwargs: Any) -> Any:
        self.rec.current = []
        try:
            with self.rec.hooks():
                value = fn(*args, **kwargs)
        finally:
            saved, self.rec.current = self.rec.current, None
        outs = tensors_of(value)
        if not outs:
            return value
        flat = tensors_of((args, kwargs))
        params = [t for t in flat if storage_id(t) in self.param_storages]
        ins = [t for t in flat if storage_id(t) not in self.param_storages]
        name = self.unique(f"{self.base}.{suffix}" if self.base else suffix)
        self.raw.append(RawOp(
            name=name, kind=kind, target=f"{self.target}.{suffix}", module=None,
            inputs=[(self.producer[id(t)], t) for t in ins if id(t) in self.producer],
            input_tensors=ins, outputs=outs, params=params, saved=saved,
            is_loss_part=self.is_loss,
            tie_key=(self.tie, suffix) if self.tie is not None else None,
        ))
        for t in outs:
            self.producer[id(t)] = name
        self.alive.append(value)
        self.last = name
        return value


def expand_mha(step: Expansion, mod: nn.MultiheadAttention, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
    return mha_forward(step, mod, *args, **kwargs)


def expand_sdpa(step: Expansion, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return sdpa_forward(step, *args, **kwargs)


def meta_param_names(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[int, str]:
    """id(meta copy of a parameter) -> the parameter's name as ``model.named_parameters()``
    gives it (a tied parameter: its first name), as the runtime dispatcher names it."""
    first: dict[int, str] = {}
    for n, p in model.named_parameters():
        first.setdefault(id(p), n)
    out: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if n in state:
            out.setdefault(id(state[n]), first[id(p)])
    return out


def once_per_tensor(like: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``like`` (meta or real copies of the example inputs) applied once per tensor: one
    tensor given twice stays one tensor (so ``attn(x, x, x)`` with the same input is traced
    as self-attention, as it runs)."""
    memo: dict[int, torch.Tensor] = {}

    def copy(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            memo[id(t)] = like(t)
        return memo[id(t)]

    return copy


def real_like(t: torch.Tensor) -> torch.Tensor:
    out = t.detach().clone()
    return out.requires_grad_(t.requires_grad) if t.is_floating_point() else out


def meta_state(root: nn.Module) -> dict[str, torch.Tensor]:
    """Meta copies of every parameter and buffer; tied tensors stay tied."""
    by_id: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    named = list(root.named_parameters(remove_duplicate=False)) + list(
        root.named_buffers(remove_duplicate=False)
    )
    for name, t in named:
        if id(t) not in by_id:
            by_id[id(t)] = meta_like(t)
        state[name] = by_id[id(t)]
    return state
