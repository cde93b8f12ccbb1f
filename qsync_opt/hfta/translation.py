"""The translation rules: a standalone model's op run on a fused array's values, for all
``B`` models at once (:mod:`qsync_opt.hfta.convert` describes what each rule does).

The layout walk (:mod:`qsync_opt.hfta.layout_walk`) records each op as a step naming its
rule, the call and its arguments, with the walk's values as :class:`Ref`; at run time
:func:`resolve` puts the values in (a model-major one wrapped in :class:`Major`, so the
rule sees which operands have the model axis) and the rule in :data:`RULES` runs the call:
dims shifted past the model axis, sizes read per model, shared operands broadcast or given
to every model, a batched matmul.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.hfta.layouts import expand_shared, with_singletons
from qsync_opt.hfta.op_tables import DIM_ARGS, EVERY_DIM, REQUIRED, SELF_SHAPED_OPS

__all__ = ["Major", "OpCall", "RULES", "Ref", "Rule", "batched_matmul", "resolve", "resolve_call",
           "unwrap"]

#: A call of the standalone model's code: the function, or a method by its name.
OpCall = Callable[..., object] | str


class Ref(str):
    """A reference to a value of the walk (a node name), as opposed to a string constant."""


class Major:
    """A model-major tensor handed to a translation rule (the rules see which operands have
    the model axis)."""

    __slots__ = ("t",)

    def __init__(self, t: Tensor) -> None:
        self.t = t


#: A translation rule: ``(B, the call, the op's name, its arguments, its keyword
#: arguments)`` with the walk's values put in, to the call's result for all ``B`` models.
Rule = Callable[[int, OpCall, str, Sequence[object], Mapping[str, object]], object]


def _major(v: object, op: str) -> Tensor:
    """The tensor of model-major operand ``v`` (the walk hands the rules one)."""
    if not isinstance(v, Major):
        raise QsyncInputError(f"hfta: {op}: expected a model-major operand, got "
                              f"{type(v).__name__}")
    return v.t


def _wrap(v: object, who: str) -> object:
    """A model-major value (a tensor, or a tuple or list of them) as :class:`Major`."""
    if isinstance(v, (tuple, list)):
        return type(v)(_wrap(t, who) for t in v)
    if not isinstance(v, Tensor):
        raise QsyncInputError(f"hfta: {who}: expected a model-major tensor, got "
                              f"{type(v).__name__}")
    return Major(v)


def resolve(env: Mapping[str, object], a: object,
            majors: frozenset[str] = frozenset()) -> object:
    """``a`` with its references resolved; the model-major ones wrapped in :class:`Major`."""
    if isinstance(a, Ref):
        v = env[a]
        return _wrap(v, a) if a in majors else v
    if isinstance(a, (tuple, list)):
        return type(a)(resolve(env, x, majors) for x in a)
    if isinstance(a, dict):
        return {k: resolve(env, v, majors) for k, v in a.items()}
    if isinstance(a, slice):
        return slice(resolve(env, a.start, majors), resolve(env, a.stop, majors),
                     resolve(env, a.step, majors))
    return a


def resolve_call(env: Mapping[str, object], args: Sequence[object],
                 kwargs: Mapping[str, object], majors: frozenset[str],
                 ) -> tuple[tuple[object, ...], dict[str, object]]:
    """A step's arguments and keyword arguments, resolved (:func:`resolve`)."""
    return (tuple(resolve(env, a, majors) for a in args),
            {k: resolve(env, v, majors) for k, v in kwargs.items()})


def unwrap(a: object) -> object:
    """``a`` with every :class:`Major` replaced by its tensor."""
    if isinstance(a, Major):
        return a.t
    if isinstance(a, (tuple, list)):
        return type(a)(unwrap(x) for x in a)
    if isinstance(a, dict):
        return {k: unwrap(v) for k, v in a.items()}
    if isinstance(a, slice):
        return slice(unwrap(a.start), unwrap(a.stop), unwrap(a.step))
    return a


def _unwrap_all(args: Sequence[object]) -> list[object]:
    return [unwrap(a) for a in args]


def _unwrap_kw(kwargs: Mapping[str, object]) -> dict[str, object]:
    return {k: unwrap(v) for k, v in kwargs.items()}


def _invoke(call: OpCall, args: Sequence[object], kwargs: Mapping[str, object]) -> object:
    if isinstance(call, str):
        return getattr(args[0], call)(*args[1:], **kwargs)
    return call(*args, **kwargs)


def _shift(d: object, op: str) -> Any:
    """A dim of the per-model value as a dim of the model-major one."""
    if isinstance(d, bool) or d is None:
        return d
    if isinstance(d, int):
        return d + 1 if d >= 0 else d
    if isinstance(d, (tuple, list)):
        return type(d)(_shift(x, op) for x in d)
    raise QsyncInputError(f"hfta: {op}: dim {d!r}: expected an int or a tuple of ints")


def _rule_shared(B: int, call: OpCall, op: str, args: Sequence[object],
                 kwargs: Mapping[str, object]) -> object:
    """The call as written (no operand has the model axis, or the result keeps the layout
    of the first operand)."""
    return _invoke(call, _unwrap_all(args), _unwrap_kw(kwargs))


def _rule_broadcast(B: int, call: OpCall, op: str, args: Sequence[object],
                    kwargs: Mapping[str, object]) -> object:
    leaves: list[Major | Tensor] = []

    def collect(v: object) -> None:
        if isinstance(v, (tuple, list)):
            for x in v:
                collect(x)
        elif isinstance(v, (Major, Tensor)):
            leaves.append(v)

    collect(args)
    collect(kwargs)  # a mapping: not looked into (the rank is the positional operands')
    rank = max([v.t.dim() - 1 if isinstance(v, Major) else v.dim() for v in leaves],
               default=0)

    def align(v: object) -> object:
        if isinstance(v, Major):
            return with_singletons(v.t, rank - (v.t.dim() - 1))
        if isinstance(v, (tuple, list)):
            return type(v)(align(x) for x in v)
        return v

    new_args = [align(a) for a in args]
    if op in SELF_SHAPED_OPS and args and isinstance(args[0], Tensor):  # a shared first operand
        new_args[0] = expand_shared(args[0], B, op)
    return _invoke(call, new_args, {k: align(v) for k, v in kwargs.items()})


def _rule_dims(B: int, call: OpCall, op: str, args: Sequence[object],
               kwargs: Mapping[str, object]) -> object:
    x = _major(args[0], op)
    new_args = list(args)
    new_kwargs = dict(kwargs)
    for pos, kw, default in DIM_ARGS[op]:
        given = new_kwargs.get(kw, new_args[pos] if pos < len(new_args) else None)
        if given is None:
            if default is REQUIRED:
                raise QsyncInputError(f"hfta: {op} of a model-major value needs its {kw} "
                                      "argument")
            if default is EVERY_DIM:
                return _every_dim(x, op, new_kwargs)
            given = default
        if kw in new_kwargs or pos >= len(new_args):
            new_kwargs[kw] = _shift(given, op)
        else:
            new_args[pos] = _shift(given, op)
    return _invoke(call, _unwrap_all(new_args), _unwrap_kw(new_kwargs))


def _every_dim(x: Tensor, op: str, kwargs: dict[str, object]) -> object:
    """``size()``, ``squeeze()``, ``sum()`` / ``mean()`` without a dim: over the per-model
    dims only."""
    dims = tuple(range(1, x.dim()))
    kwargs.pop("dim", None)
    if op == "size":
        return torch.Size(x.shape[1:])
    if op == "squeeze":
        ones = tuple(d for d in dims if x.shape[d] == 1)
        return x.squeeze(ones) if ones else x
    extra = _unwrap_kw(kwargs)
    if not dims:  # a per-model scalar: nothing to reduce (torch reads dim=() as "all")
        dtype = extra.get("dtype")
        if dtype is None:
            return x.clone()
        if not isinstance(dtype, torch.dtype):
            raise QsyncInputError(f"hfta: {op}: dtype {dtype!r}: expected a torch dtype")
        return x.to(dtype)
    out: Tensor = getattr(x, op)(dim=dims, **extra)
    return out


def _sizes(rest: Sequence[object], kwargs: Mapping[str, object],
           *names: str) -> tuple[Any, ...]:
    """The sizes a call gives (ints; or a dtype for ``view``): as one sequence or each an
    argument, or by keyword."""
    for n in names:
        if n in kwargs:
            given = kwargs[n]
            if not isinstance(given, (tuple, list, torch.Size)):
                raise QsyncInputError(f"hfta: {n}={given!r}: expected a sequence of sizes")
            return tuple(given)
    if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        return tuple(rest[0])
    return tuple(rest)


def _rule_view(B: int, call: OpCall, op: str, args: Sequence[object],
               kwargs: Mapping[str, object]) -> object:
    x, rest = _major(args[0], op), _unwrap_all(args[1:])
    sizes = _sizes(rest, _unwrap_kw(kwargs), "shape", "size")
    if len(sizes) == 1 and isinstance(sizes[0], torch.dtype):
        return x.view(sizes[0])
    return x.reshape(x.shape[0], *sizes)


def _rule_expand(B: int, call: OpCall, op: str, args: Sequence[object],
                 kwargs: Mapping[str, object]) -> object:
    x, rest = _major(args[0], op), _unwrap_all(args[1:])
    sizes = _sizes(rest, _unwrap_kw(kwargs), "size", "sizes", "repeats", "dims")
    if op == "permute":
        return x.permute(0, *_shift(tuple(sizes), op))
    x = with_singletons(x, len(sizes) - (x.dim() - 1))  # new leading per-model dims
    if op == "repeat":
        return x.repeat(1, *sizes)
    return x.expand(x.shape[0], *sizes)


def _rule_as(B: int, call: OpCall, op: str, args: Sequence[object],
             kwargs: Mapping[str, object]) -> object:
    x, other = args[0], args[1]
    if isinstance(other, Major):
        shape = other.t.shape[1:]
    elif isinstance(other, Tensor):
        shape = other.shape
    else:
        raise QsyncInputError(f"hfta: {op}: expected a tensor to take the shape of, got "
                              f"{type(other).__name__}")
    if op == "expand_as":
        if isinstance(x, Major):
            t = with_singletons(x.t, len(shape) - (x.t.dim() - 1))
            return t.expand(t.shape[0], *shape)
        return _expand_to(x, B, shape, op)
    t = _major(x, op)
    return t.reshape(t.shape[0], *shape)


def _expand_to(x: object, B: int, shape: torch.Size, op: str) -> Tensor:
    """Shared ``x`` expanded to ``[B, *shape]``."""
    if not isinstance(x, Tensor):
        raise QsyncInputError(f"hfta: {op}: expected a tensor, got {type(x).__name__}")
    return x.expand(B, *shape)


def _rule_getitem(B: int, call: OpCall, op: str, args: Sequence[object],
                  kwargs: Mapping[str, object]) -> object:
    base, idx = _major(args[0], op), unwrap(args[1])
    parts = idx if isinstance(idx, tuple) else (idx,)
    if sum(isinstance(p, (Tensor, list)) for p in parts) > 1:
        raise QsyncInputError("hfta: indexing a model-major value with more than one tensor "
                              "index has no fused form")
    return base[(slice(None), *parts)]


def _rule_attr(B: int, call: OpCall, op: str, args: Sequence[object],
               kwargs: Mapping[str, object]) -> object:
    x = _major(args[0], op)
    what = str(args[1]) if op == "getattr" else op
    if what == "shape":
        return torch.Size(x.shape[1:])
    if what in ("ndim", "dim", "ndimension"):
        return x.dim() - 1
    if what in ("numel", "nelement"):
        return x[0].numel() if x.shape[0] else 0
    return getattr(x, what)


def _rule_cat(B: int, call: OpCall, op: str, args: Sequence[object],
              kwargs: Mapping[str, object]) -> object:
    given = args[0]
    if not isinstance(given, (tuple, list)):
        raise QsyncInputError(f"hfta: {op}: expected a sequence of tensors, got "
                              f"{type(given).__name__}")
    seq = [v.t if isinstance(v, Major) else expand_shared(v, B, op) for v in given]
    rest = list(args[1:])
    new_kwargs = dict(kwargs)
    if "dim" in new_kwargs:
        new_kwargs["dim"] = _shift(new_kwargs["dim"], op)
    elif rest:
        rest[0] = _shift(rest[0], op)
    else:
        new_kwargs["dim"] = 1
    return _invoke(call, [seq, *_unwrap_all(rest)], _unwrap_kw(new_kwargs))


def _operand(v: object, op: str) -> Tensor:
    """A matmul operand's tensor (model-major or shared)."""
    t = unwrap(v)
    if not isinstance(t, Tensor):
        raise QsyncInputError(f"hfta: {op}: expected a tensor operand, got {type(t).__name__}")
    return t


def _rule_matmul(B: int, call: OpCall, op: str, args: Sequence[object],
                 kwargs: Mapping[str, object]) -> object:
    a = args[0]
    b = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2"))
    return batched_matmul(_operand(a, op), isinstance(a, Major), _operand(b, op),
                          isinstance(b, Major), B, torch.matmul)


def batched_matmul(a: Tensor, a_major: bool, b: Tensor, b_major: bool, B: int,
                   mm: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """``torch.matmul`` of the per-model operands, for all ``B`` models with one ``mm`` of
    two model-major operands of one rank (at least 3): a shared operand is given to every
    model (a view), a 1-D one gets the matrix dim torch's matmul would give it (removed from
    the result after), the lower-rank operand gets singleton batch dims after the model
    axis (torch broadcasts batch dims right-aligned)."""
    ra, rb = a.dim() - a_major, b.dim() - b_major
    if ra < 1 or rb < 1:
        raise QsyncInputError("hfta: matmul: both operands need at least one dim per model")
    if not a_major:
        a = expand_shared(a, B, "matmul")
    if not b_major:
        b = expand_shared(b, B, "matmul")
    if ra == 1:
        a = a.unsqueeze(-2)
    if rb == 1:
        b = b.unsqueeze(-1)
    rank = max(a.dim(), b.dim())
    out = mm(with_singletons(a, rank - a.dim()), with_singletons(b, rank - b.dim()))
    if ra == 1:
        out = out.squeeze(-2)
    if rb == 1:
        out = out.squeeze(-1)
    return out



RULES: dict[str, Rule] = {
    "shared": _rule_shared, "broadcast": _rule_broadcast, "dims": _rule_dims,
    "view": _rule_view, "expand": _rule_expand, "as": _rule_as, "getitem": _rule_getitem,
    "attr": _rule_attr, "cat": _rule_cat, "matmul": _rule_matmul}
