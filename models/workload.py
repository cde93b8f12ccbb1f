"""The one ``Workload`` protocol: what the tracer, the indicator, the solver, the report and
the trainer ask of a model to plan and train, met alike by the built-in workloads
(:class:`qsync_opt.models.BuiltinWorkload`) and a user's model file
(:class:`qsync_opt.models.user.UserWorkload`).

Where the two kinds differ, the difference is a member of the protocol, implemented by
each kind, never a type check in the caller:

- how a model is traced (:meth:`Workload.trace_inputs`: a built-in is built on the meta
  device with meta inputs and its loss; a file's model is the one its function returned,
  on real example inputs, and its loss is the file's);
- what a trace teaches the workload (:meth:`Workload.saw_outputs`: a file's default loss is
  chosen from the outputs it saw);
- where its measured batches come from (:meth:`Workload.sample_batches`);
- what it says about itself (:meth:`Workload.usage_lines`, :attr:`Workload.init_doc`);
- how results made from it are cached (:attr:`Workload.cache_name`: a name that never
  depends on where a file lies; :attr:`Workload.code_digest`: a digest of all the code that
  builds the model, or None where that cannot be known, as for a file that may import
  others; :attr:`Workload.sha256`: the content hash a graph and its plans record).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from qsync_opt.core.modelspec import package_code_digest

if TYPE_CHECKING:  # annotations only: the code digest and the protocol need no torch
    import torch
    from torch import nn

__all__ = ["TraceInputs", "Workload", "package_code_digest"]


@dataclass
class TraceInputs:
    """What the tracer runs: ``model`` on ``inputs`` (a tuple of positional tensors, or a
    dict of keyword tensors), then ``loss_fn(outputs, targets)`` where it is not None."""

    model: nn.Module
    inputs: Any
    targets: torch.Tensor | None = None
    loss_fn: Callable[[Any, Any], Any] | None = None


@runtime_checkable
class Workload(Protocol):
    """A model to plan and train (the module docstring says where the kinds differ)."""

    @property
    def name(self) -> str:
        """What graphs and plans record: a registry name, or ``/abs/path/file.py:fn``."""
        ...

    @property
    def description(self) -> str: ...

    @property
    def default_batch(self) -> int:
        """The batch per device when none is given (a file's: its example's)."""
        ...

    @property
    def real_data(self) -> bool:
        """Whether :meth:`sample_batches` gives real data."""
        ...

    @property
    def task(self) -> str: ...

    @property
    def seq_len(self) -> int | None: ...

    @property
    def input_doc(self) -> str: ...

    @property
    def loss_doc(self) -> str: ...

    @property
    def build(self) -> Callable[[], nn.Module]:
        """Makes a fresh model (seed the RNG first for the same weights everywhere)."""
        ...

    @property
    def make_inputs(self) -> Callable[[int, torch.device], Any]:
        """``(batch, device)``: synthetic inputs of ``batch`` samples (on meta: empty meta
        tensors)."""
        ...

    @property
    def make_targets(self) -> Callable[[int, torch.device], torch.Tensor | None]:
        """``(batch, device)``: synthetic targets, or None where the batch carries its own."""
        ...

    def forward(self, model: nn.Module, inputs: Any) -> Any:
        """The model on one batch's inputs."""
        ...

    def loss_of(self, outputs: Any, inputs: Any, targets: Any) -> torch.Tensor:
        """The training loss of one batch, a scalar tensor."""
        ...

    def trace_inputs(self, batch: int, include_loss: bool) -> TraceInputs:
        """The model, inputs and loss the tracer runs at ``batch`` samples."""
        ...

    def saw_outputs(self, outputs: Any) -> None:
        """The outputs of the last trace (what a default loss is chosen from)."""
        ...

    def sample_batches(self, batch: int, n: int, seed: int) -> Iterator[tuple[Any, Any]]:
        """``n`` seeded ``(inputs, targets)`` batches for measuring: real data where the
        workload has them, else synthetic (targets None where the batch carries them)."""
        ...

    def usage_lines(self, outputs: Any = None, inputs: Any = None) -> list[str]:
        """What the workload uses that a user chose (a file's loss and data), one line
        each; none for a built-in."""
        ...

    @property
    def init_doc(self) -> str:
        """Where the weights come from, in a few words."""
        ...

    @property
    def cache_name(self) -> str:
        """The name cached results are filed under (never a file's location)."""
        ...

    @property
    def code_digest(self) -> str | None:
        """A digest of all the code that builds the model, or None where it cannot be known."""
        ...

    @property
    def sha256(self) -> str | None:
        """The content hash of the model's file, recorded in graphs and plans; None for a
        built-in."""
        ...
