"""Per-call dispatch of functional GEMMs, so the planner sees exactly the GEMMs the runtime
runs.

* The decomposed attention (:func:`mha_forward`, :func:`sdpa_forward`, :func:`mha_gemms`,
  :func:`base_name`, :data:`MHA_GEMMS`, :data:`SDPA_GEMMS`) lives in
  :mod:`qsync_opt.ops.attention`, below both the tracers and the runtime; it is re-exported here
  for the callers that import it from this module.
* :class:`FunctionalDispatch` (installed by :func:`~qsync_opt.runtime.apply_plan` when a plan
  names functional ops) is a ``TorchFunctionMode`` active during the root model's forward,
  with module hooks tracking the scope; it names each top-level ``F.linear`` / ``matmul`` /
  ``bmm`` / ``@`` / SDPA call with :class:`qsync_opt.graph.CallNamer` (the tracers' rule;
  counters reset per root forward) and runs it at its planned precision. Calls inside leaf
  modules (Linear, the Q* layers, ...) are theirs and never re-dispatched.
* :func:`count_calls` counts, per op name, the calls each precision saw.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.overrides import TorchFunctionMode

from qsync_opt.core.precision import Precision
from qsync_opt.ops.attention import (
    MHA_GEMMS,
    SDPA_GEMMS,
    Step,
    base_name,
    mha_forward,
    mha_gemms,
    sdpa_forward,
)
from qsync_opt.ops.gemm import (
    COUNTERS,
    QMixin,
    RuntimeStep,
    record_call,
    run_gemm,
    swappable_kind,
)
from qsync_opt.ops.kinds import is_leaf_module
from qsync_opt.ops.naming import CallNamer, gemm_call_kind

__all__ = ["FunctionalDispatch", "RuntimeStep", "Step", "base_name", "count_calls",
           "functional_op_exists", "mha_forward", "mha_gemms", "sdpa_forward", "MHA_GEMMS",
           "SDPA_GEMMS"]

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- the dispatcher


class _Mode(TorchFunctionMode):
    def __init__(self, owner: FunctionalDispatch) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Callable[..., Any], types: object,
                           args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        o = self.owner
        if o.depth > 0:
            return func(*args, **kwargs)
        kind = gemm_call_kind(func)
        if kind is None:
            return func(*args, **kwargs)
        name = o.namer.name(kind, o.scope[-1] if o.scope else "", (args, kwargs))
        o.seen.add(name)
        if kind == "sdpa":
            o.seen.update(f"{name}.{s}" for s in SDPA_GEMMS)
            subs = {s: o.precisions[f"{name}.{s}"] for s in SDPA_GEMMS
                    if f"{name}.{s}" in o.precisions}
            if all(p in (Precision.fp32, Precision.tf32) for p in subs.values()):
                for s in SDPA_GEMMS:
                    record_call(f"{name}.{s}", subs.get(s, Precision.fp32))
                return func(*args, **kwargs)
            return sdpa_forward(RuntimeStep(name, subs, o.next_seed), *args, **kwargs)
        p = o.precisions.get(name, Precision.fp32)
        record_call(name, p)
        return run_gemm(kind, func, args, kwargs, p, o.next_seed)


class FunctionalDispatch:
    """Per-call precisions for the functional GEMMs and SDPA calls of ``model``'s forward.

    ``precisions`` maps op names (as the tracers give them: :class:`qsync_opt.graph.CallNamer`;
    SDPA sub-ops ``<call>.qk`` / ``<call>.av``) to precisions; calls not named run as written
    (fp32) and are still counted. Installs hooks on ``model`` and its submodules;
    :meth:`remove` takes them off. One forward of the root resets the call counters.
    """

    def __init__(self, model: nn.Module, precisions: Mapping[str, Precision],
                 seed: int = 0) -> None:
        self.model = model
        self.precisions = dict(precisions)
        self.namer = CallNamer({})
        self.scope: list[str] = []
        self.depth = 0
        self.active = 0
        self.seed = seed & 0x7FFFFFFF
        self.mode: _Mode | None = None
        self.seen: set[str] = set()  # op names dispatched so far
        self.checked = False
        self.handles: list[Any] = []
        self.handles.append(model.register_forward_pre_hook(self._root_pre))
        self.handles.append(model.register_forward_hook(self._root_post, always_call=True))
        for name, mod in model.named_modules():
            if not name:
                continue
            if is_leaf_module(mod) or isinstance(mod, QMixin):
                self.handles.append(mod.register_forward_pre_hook(self._leaf_pre))
                self.handles.append(mod.register_forward_hook(self._leaf_post, always_call=True))
            else:
                self.handles.append(mod.register_forward_pre_hook(self._scope_pre(name)))
                self.handles.append(mod.register_forward_hook(self._scope_post,
                                                              always_call=True))

    def next_seed(self) -> int:
        self.seed = (self.seed + 1) & 0x7FFFFFFF
        return self.seed

    def _root_pre(self, mod: nn.Module, args: tuple[Any, ...]) -> None:
        if self.active == 0:
            self.namer.param_names = {id(p): n for n, p in self.model.named_parameters()}
            self.namer.reset()
            self.scope.clear()
            self.depth = 0
            self.mode = _Mode(self)
            self.mode.__enter__()
        self.active += 1

    def _root_post(self, mod: nn.Module, args: tuple[Any, ...], out: object) -> None:
        self.active -= 1
        if self.active == 0 and self.mode is not None:
            mode, self.mode = self.mode, None
            mode.__exit__(None, None, None)
            if not self.checked:
                self.checked = True
                unseen = self.unseen()
                if unseen:
                    log.warning("plan: %d planned op(s) did not run in the first forward, so "
                                "their precisions are not used: %s", len(unseen),
                                ", ".join(unseen[:5]) + (" ..." if len(unseen) > 5 else ""))

    def unseen(self) -> list[str]:
        """Planned functional ops no forward has run so far (a name the model's calls do
        not produce: the plan was made for another model, or another code path)."""
        return sorted(set(self.precisions) - self.seen)

    def _leaf_pre(self, mod: nn.Module, args: tuple[Any, ...]) -> None:
        self.depth += 1

    def _leaf_post(self, mod: nn.Module, args: tuple[Any, ...], out: object) -> None:
        self.depth -= 1

    def _scope_pre(self, name: str) -> Callable[[nn.Module, Any], None]:
        return _ScopePush(self, name)

    def _scope_post(self, mod: nn.Module, args: tuple[Any, ...], out: object) -> None:
        if self.scope:
            self.scope.pop()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class _ScopePush:
    """A scope pre-hook as an object (not a closure), so a deep copy of the model gets hooks
    that push onto the copy's dispatcher."""

    def __init__(self, owner: FunctionalDispatch, name: str) -> None:
        self.owner, self.name = owner, name

    def __call__(self, mod: nn.Module, args: tuple[Any, ...]) -> None:
        self.owner.scope.append(self.name)


def functional_op_exists(model: nn.Module, name: str) -> bool:
    """Whether ``name`` can be a functional op of ``model`` under the tracers' naming: a
    parameter's name (a call reading it), ``<module>.linear|matmul``, or
    ``<module>.sdpa.qk|av`` (each with an optional ``_N`` repeat suffix) for a module of
    ``model`` (the root: no prefix)."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    base = base_name(name)
    if base in params:
        return True
    scope, _, last = base.rpartition(".")
    if last in ("linear", "matmul"):
        return scope in modules
    if last in SDPA_GEMMS:
        scope2, _, call = scope.rpartition(".")
        return base_name(call) == "sdpa" and scope2 in modules
    return False


@contextmanager
def count_calls(model: nn.Module) -> Iterator[dict[str, dict[str, int]]]:
    """Count, per op name, the calls each precision saw while the block runs:
    ``{op: {precision: n}}``. The Q* layers and the dispatcher count what they run; GEMM
    modules left as they are count as fp32 (nn.MultiheadAttention by its sub-ops), and
    functional GEMMs outside a plan too (a dispatcher with no precisions is installed for the
    block when ``model`` has none)."""
    counts: dict[str, dict[str, int]] = {}
    COUNTERS.append(counts)
    handles: list[Any] = []

    def count_module(name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple[Any, ...], out: object) -> None:
            record_call(name, Precision.fp32)
        return hook

    def count_mha(name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            assert isinstance(mod, nn.MultiheadAttention)  # registered on those only
            qkv = list(args[:3])
            for key in ("query", "key", "value")[len(qkv):]:
                qkv.append(kwargs.get(key))
            for s in mha_gemms(mod, *qkv):
                record_call(f"{name}.{s}" if name else s, Precision.fp32)
        return hook

    for name, mod in model.named_modules():
        if isinstance(mod, QMixin):
            continue
        if isinstance(mod, nn.MultiheadAttention):
            handles.append(mod.register_forward_pre_hook(count_mha(name), with_kwargs=True))
        elif swappable_kind(mod) is not None:
            handles.append(mod.register_forward_hook(count_module(name)))
    temp = None if getattr(model, "_qsync_dispatch", None) else FunctionalDispatch(model, {})
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()
        if temp is not None:
            temp.remove()
        COUNTERS.remove(counts)
