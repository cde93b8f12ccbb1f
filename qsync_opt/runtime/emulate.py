"""Slowdown emulation: equal CPUs stand in for a slower card.

On one CPU box every rank is the same CPU, so a hybrid cluster (``cpux1+cpu/2x1``) is
*emulated*: the rank of a derived device ``cpu/F`` runs its model with
:class:`SlowdownHooks`, which stretch the compute time it actually measures by ``F`` (the
device's ``DeviceSpec.slowdown``, the ``TrainConfig.slowdown`` of its group). The stretch is a
sleep, so the core is free for the other ranks, and the numbers the rank computes are
untouched: outputs and gradients are bit-identical with and without the hooks.

What is stretched, and how. Every hook call is an *event*; the time since the previous event
(minus the sleeps themselves) is compute of this model, and ``(F - 1)`` times it is owed as
sleep. Events are

* forward: the root module's forward pre-hook (starts the count), every leaf module's forward
  pre- and post-hook (so the stretch lands op by op, functional code between leaves included),
  and the root's forward post-hook (pays what is owed, so a forward takes F times as long);
* backward: a hook on every leaf module's output tensor (fires when that module's backward
  starts) and every parameter's post-accumulate-grad hook (fires when its gradient is ready,
  which is when DDP may launch its bucket's all-reduce). So the stretch lands where a slower
  card would spend it, and communication overlaps a stretched backward as it would there.

Module full-backward hooks are not used: they refuse in-place ops after the module (ResNet's
``ReLU(inplace=True)``) and fire before the first layer's weight gradient is computed. The
first backward event after a forward starts the backward count, so the loss and whatever the
caller does between forward and backward are not stretched; neither is the optimizer step.
Sleeps shorter than ``min_sleep_s`` are deferred (owed time accumulates) and an oversleep is
credited against later debt, so many tiny ops still add up to the right total.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

_IDLE, _FWD, _BWD = "idle", "forward", "backward"


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


class SlowdownHooks:
    """Stretch ``model``'s measured forward and backward compute time by ``factor``.

    ``factor`` may be changed between steps (single-process data-parallel emulation runs each
    group's micro-batch at that group's factor); 1 makes the hooks a no-op apart from their
    bookkeeping. ``measured_s`` and ``slept_s`` total the compute seen and the sleep added.
    Call :meth:`remove` to take the hooks off.
    """

    def __init__(self, model: nn.Module, factor: float, *, min_sleep_s: float = 2e-4) -> None:
        if not (factor >= 1 and math.isfinite(factor)):  # inf: a sleep that never ends
            raise ValueError(f"slowdown factor must be a finite number >= 1, got {factor}")
        self.model = model
        self.factor = float(factor)
        self.min_sleep_s = float(min_sleep_s)
        self.measured_s = 0.0
        self.slept_s = 0.0
        self._phase = _IDLE
        self._t_last = time.perf_counter()
        self._debt_s = 0.0
        self._handles: list[Any] = []
        leaves = [m for m in model.modules() if next(m.children(), None) is None]
        # Order matters where the root is itself a leaf: root pre first, root post last.
        self._handles.append(model.register_forward_pre_hook(self._root_pre))
        for m in leaves:
            self._handles.append(m.register_forward_pre_hook(self._leaf_pre))
            self._handles.append(m.register_forward_hook(self._leaf_post))
        self._handles.append(model.register_forward_hook(self._root_post))
        for p in model.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._param_ready))

    # ----------------------------------------------------------------------- public

    def remove(self) -> None:
        """Take every hook off the model (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> SlowdownHooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def reset_stats(self) -> None:
        self.measured_s = self.slept_s = 0.0

    # ----------------------------------------------------------------------- events

    def _tick(self, *, pay_all: bool = False) -> None:
        now = time.perf_counter()
        elapsed = now - self._t_last
        self.measured_s += elapsed
        self._debt_s += (self.factor - 1.0) * elapsed
        if self._debt_s >= self.min_sleep_s or (pay_all and self._debt_s > 0):
            time.sleep(self._debt_s)
            after = time.perf_counter()
            slept = after - now
            self.slept_s += slept
            self._debt_s -= slept  # an oversleep is credited against later debt
            now = after
        self._t_last = now

    def _root_pre(self, module: nn.Module, args: Any) -> None:
        self._phase = _FWD
        self._t_last = time.perf_counter()

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._phase == _FWD:
            self._tick(pay_all=True)
        self._phase = _IDLE

    def _leaf_pre(self, module: nn.Module, args: Any) -> None:
        if self._phase == _FWD:
            self._tick()

    def _leaf_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._phase == _FWD:
            self._tick()
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(self._grad_event)

    def _backward_event(self) -> None:
        if self._phase != _BWD:
            # The first backward event after a forward: start counting from here.
            self._phase = _BWD
            self._t_last = time.perf_counter()
            return
        self._tick()

    def _grad_event(self, grad: torch.Tensor) -> None:
        self._backward_event()

    def _param_ready(self, param: torch.Tensor) -> None:
        self._backward_event()


def add_slowdown(model: nn.Module, factor: float) -> SlowdownHooks | None:
    """Hooks for ``factor`` > 1 (logged as emulation), None for 1."""
    if factor == 1:
        return None
    log.info("emulating a %gx slower device: stretching measured compute time (sleep)", factor)
    return SlowdownHooks(model, factor)
