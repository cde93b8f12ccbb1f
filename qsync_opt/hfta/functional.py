"""The torch.func route to a B-array: the second implementation, for any model.

``torch.func.stack_module_state`` stacks the ``B`` models' parameters and buffers on a
leading model axis (the layout the fused operators use, so the fused optimizers of
:mod:`.optim` drive either route), and ``torch.func.vmap`` over
``torch.func.functional_call`` runs the one model's code for all ``B``: per-model inputs
``[B, N, ...]`` (``in_dims=0``) or one replicated batch (``in_dims=None``), output
``[B, N, ...]``. BatchNorm's running statistics are stacked buffers, updated in place per
model under ``vmap``.

It needs no converter (any traceable-by-vmap model runs), and no kernel of it is chosen by
us: ``vmap`` lowers each op to its own batched form (a batched matmul for Linear, a grouped
or looped convolution for Conv2d). :mod:`.convert`'s fused operators are checked against it
(tests/hfta/test_hfta.py for the CNNs, tests/hfta/test_hfta_gpt.py for tiny_gpt): both routes give the
same outputs and gradients. The trainer takes this route for a model the converter refuses.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, stack_module_state, vmap

from qsync_opt.core.errors import QsyncInputError

__all__ = ["FuncArray"]

#: Why a model runs on this route (the converter's refusal), kept on the array.
ROUTE = "torch.func"


class FuncArray(nn.Module):
    """``B`` models run with ``vmap(functional_call)`` (module docstring)."""

    def __init__(self, models: Sequence[nn.Module], *, input_mode: str = "per_model") -> None:
        super().__init__()
        if not models:
            raise QsyncInputError("models: expected at least one")
        if input_mode not in ("per_model", "replicated"):
            raise QsyncInputError(f"input mode: expected per_model or replicated, got "
                                  f"{input_mode!r}")
        self.B = len(models)
        self.input_mode = input_mode
        params, buffers = stack_module_state(list(models))
        self.names = list(params)
        self.buffer_names = list(buffers)
        self.params = nn.ParameterList([nn.Parameter(params[n].detach().clone())
                                        for n in self.names])
        for i, n in enumerate(self.buffer_names):
            self.register_buffer(f"buf{i}", buffers[n].detach().clone())
        # a real copy (not meta): functional_call swaps in the stacked tensors, and a tied
        # parameter (tiny_gpt's lm_head and wte) must resolve to a real one
        self._template = [copy.deepcopy(models[0])]
        self._base = self._template

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> FuncArray:
        """``.to(device)`` and the like move the template too (it is no submodule), so that
        anything of it that ``functional_call`` does not swap for a stacked tensor is on the
        array's device."""
        super()._apply(fn, recurse)
        self._template[0]._apply(fn)
        return self

    def _state(self) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        return ({n: p for n, p in zip(self.names, self.params, strict=True)},
                {n: getattr(self, f"buf{i}") for i, n in enumerate(self.buffer_names)})

    def forward(self, *inputs: Tensor) -> Tensor:
        base = self._base[0]
        base.train(self.training)

        def one(p: dict[str, Tensor], b: dict[str, Tensor], *xs: Tensor) -> Tensor:
            return functional_call(base, (p, b), xs)

        params, buffers = self._state()
        dims = 0 if self.input_mode == "per_model" else None
        out: Tensor = vmap(one, in_dims=(0, 0, *([dims] * len(inputs))),
                           randomness="different")(params, buffers, *inputs)
        return out

    def export_state(self, b: int) -> dict[str, Tensor]:
        """Model ``b``'s state_dict (copies)."""
        params, buffers = self._state()
        return {n: t[b].detach().clone() for n, t in {**params, **buffers}.items()}

    def named_model_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(the parameter's name in the standalone model, its stacked ``[B, ...]`` tensor)."""
        return list(zip(self.names, self.params, strict=True))

    def export(self, b: int) -> nn.Module:
        """Model ``b`` as a standalone model of the original class (its weights copied)."""
        if not 0 <= b < self.B:
            raise QsyncInputError(f"model: expected 0 to {self.B - 1}, got {b}")
        model = copy.deepcopy(self._template[0])
        keys = set(model.state_dict())  # persistent entries (tied aliases included)
        state = {k: v for k, v in self.export_state(b).items() if k in keys}
        missing, _ = model.load_state_dict(state, strict=False)
        aliases = ({n for n, _ in model.named_parameters(remove_duplicate=False)}
                   - {n for n, _ in model.named_parameters()})
        if set(missing) - aliases:  # a tied parameter loads through its first name
            raise QsyncInputError(f"export: model {b} lacks {sorted(set(missing) - aliases)}")
        return model

    def load_models(self, models: Sequence[nn.Module]) -> None:
        """Copy ``B`` standalone models' weights and buffers into the stacks."""
        if len(models) != self.B:
            raise QsyncInputError(f"models: the array holds {self.B}, got {len(models)}")
        states = [m.state_dict() for m in models]
        params, buffers = self._state()
        with torch.no_grad():
            for n, t in {**params, **buffers}.items():
                if n in states[0]:  # non-persistent buffers (masks) are the same constants
                    t.copy_(torch.stack([sd[n].to(t.dtype) for sd in states]))
