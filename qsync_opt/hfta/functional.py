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
(tests/test_hfta.py): both routes give the same outputs and gradients.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import Tensor, nn

from ..errors import QsyncInputError

__all__ = ["FuncArray"]


class FuncArray(nn.Module):
    """``B`` models run with ``vmap(functional_call)`` (module docstring)."""

    def __init__(self, models: Sequence[nn.Module], *, input_mode: str = "per_model") -> None:
        super().__init__()
        from torch.func import stack_module_state

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
        self._base = [copy.deepcopy(models[0]).to("meta")]

    def _state(self) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        return ({n: p for n, p in zip(self.names, self.params, strict=True)},
                {n: getattr(self, f"buf{i}") for i, n in enumerate(self.buffer_names)})

    def forward(self, *inputs: Tensor) -> Tensor:
        from torch.func import functional_call, vmap

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
