"""A user's own model file as a workload: ``--model PATH.py:FUNCTION`` through every command.

The file protocol (the file is *run*: imported, then its functions called; pass only a file
you trust):

``FUNCTION()`` (required, e.g. ``build``)
    returns ``(model, example_inputs)``: an ``nn.Module`` and its inputs for one batch, as
    a Tensor, a tuple/list of Tensors (positional arguments) or a dict of Tensors (keyword
    arguments, HuggingFace style: ``input_ids``, ``attention_mask``, ``token_type_ids``,
    ``labels``, ``start_positions``, ...). Dim 0 of every tensor is the batch dimension (a
    0-dim tensor is passed as it is). Called again, under the same seed, on every rank that
    trains the model.
``loss(outputs, batch)`` (optional, same file)
    the training loss, a scalar Tensor; ``batch`` has the structure of ``example_inputs``.
    When the file has none, the default is, in this order: the model's own loss
    (``outputs.loss`` / ``outputs["loss"]``, which HuggingFace computes when labels are among
    the inputs); for ``start_logits``/``end_logits`` outputs with ``start_positions`` and
    ``end_positions`` in the batch, the mean of the two cross-entropies; otherwise the logits
    (a Tensor output, ``.logits`` / ``["logits"]``, or the first tensor of a tuple or dict)
    with cross-entropy against ``labels`` in the batch, or, when the batch has none, against
    synthetic class targets drawn per sample from a seed that is the sample's content hash
    (so a sample always has the same target, on every rank). Which one is used is said in one
    line (:meth:`UserWorkload.loss_line`). HuggingFace ``ModelOutput`` dataclasses (dict
    subclasses), plain dicts, tuples and lists all work.
``data(batch_size, seed)`` (optional, same file)
    an iterable of batches shaped like ``example_inputs`` at ``batch_size`` (same keys or
    positions, dtypes and trailing dims), used by ``indicate`` and ``train`` instead of
    synthetic batches. Checked batch by batch; a batch of another shape is refused in one line.

Synthetic batches (no ``data()``): of any batch size, shaped like the example inputs,
seeded: integer tensors drawn uniformly in the example tensor's [min, max] (token ids, 0/1
masks and positions keep their ranges; bool stays bool), floating ones from the example's
mean and standard deviation.

:class:`UserWorkload` gives the file the interface of a registry :class:`~qsync_opt.models.
Workload` (``name``, ``build``, ``make_inputs``, ``make_targets``, ``forward``, ``loss_of``,
``default_batch``, ``task``, ``real_data``), so the tracer, the indicator, the solver, the
report and the trainer treat both alike. Its ``name`` is the file's absolute path and the
function (``/abs/path/mine.py:build``); graphs and plans record it and the file's sha256.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from qsync_opt.models.workload import TraceInputs
from torch import Tensor, nn

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.modelspec import model_file_path, read_model_file

__all__ = ["TASK_USER", "UserWorkload", "call_model", "load_user_workload", "split_inputs"]

#: ``Workload.task`` of a user's model: the loss is the file's or a default (module docstring).
TASK_USER = "user"
#: Seed offset of the held-out batches a trainer evaluates on (``data(B, seed + this)``).
EVAL_SEED_OFFSET = 1_000_003


#: A batch's inputs as a model file gives them: one tensor, a tuple or list of tensors (the
#: positional arguments) or a dict of tensors (the keyword arguments).
Inputs = Tensor | Sequence[Tensor] | Mapping[str, Tensor]
#: The example inputs of a model file, as kept (:func:`_normalise_example`).
Example = Tensor | tuple[Tensor, ...] | dict[str, Tensor]


def _one_line(text: str) -> str:
    return text if text.isprintable() else repr(text)


def split_inputs(inputs: Inputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(positional, keyword) arguments of a batch: a dict is keywords, a Tensor one
    positional argument, a tuple/list positional arguments."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, Tensor):
        return (inputs,), {}
    return tuple(inputs), {}


def call_model(model: nn.Module, inputs: Inputs) -> Any:
    """``model(*inputs)`` or ``model(**inputs)`` (see :func:`split_inputs`)."""
    args, kwargs = split_inputs(inputs)
    return model(*args, **kwargs)


def map_tensors(fn: Callable[[Tensor], Tensor], batch: object) -> Any:
    """``batch`` with ``fn`` applied to each tensor (dicts, tuples, lists kept; None kept)."""
    if isinstance(batch, Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {k: map_tensors(fn, v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(fn, v) for v in batch)
    return batch


def slice_batch(batch: object, start: int, size: int) -> Any:
    """Samples ``start .. start+size`` of every tensor with a batch dimension."""
    return map_tensors(lambda t: t[start:start + size] if t.dim() > 0 else t, batch)


def _describe(t: object) -> str:
    if isinstance(t, Tensor):
        return f"a {str(t.dtype).removeprefix('torch.')} tensor of shape {list(t.shape)}"
    return f"a {type(t).__name__}"


def named_inputs(inputs: Inputs) -> list[tuple[str, Any]]:
    """A batch's inputs as (name, value): a mapping's keys, ``input`` for one tensor, else
    ``input i`` by position."""
    if isinstance(inputs, Mapping):
        return [(str(k), v) for k, v in inputs.items()]
    if isinstance(inputs, Tensor):
        return [("input", inputs)]
    return [(f"input {i}", v) for i, v in enumerate(inputs)]


def _normalise_example(spec: str, ex: object) -> Example:
    if isinstance(ex, Tensor):
        return ex
    if isinstance(ex, Mapping):
        if not ex:
            raise QsyncInputError(f"model: {_one_line(spec)} example_inputs: an empty dict")
        bad = [k for k, v in ex.items() if not isinstance(k, str) or not isinstance(v, Tensor)]
        if bad:
            k = bad[0]
            raise QsyncInputError(
                f"model: {_one_line(spec)} example_inputs[{_one_line(repr(k))}]: expected a "
                f"tensor under a string key, got {_describe(ex[k])}")
        return dict(ex)
    if isinstance(ex, (tuple, list)):
        if not ex:
            raise QsyncInputError(f"model: {_one_line(spec)} example_inputs: expected at "
                                  f"least one tensor")
        for i, v in enumerate(ex):
            if not isinstance(v, Tensor):
                raise QsyncInputError(f"model: {_one_line(spec)} example_inputs[{i}]: "
                                      f"expected a tensor, got {_describe(v)}")
        return tuple(ex)
    raise QsyncInputError(f"model: {_one_line(spec)} example_inputs must be tensors (a "
                          f"Tensor, a tuple/list or a dict of them), got {_describe(ex)}")


def _batch_of(example: Inputs) -> int:
    for _, t in named_inputs(example):
        if t.dim() > 0:
            return int(t.shape[0])
    return 1


# ----------------------------------------------------------------------------- loss defaults


def _get(outputs: object, key: str) -> Any:
    if isinstance(outputs, Mapping):
        return outputs.get(key)
    if isinstance(outputs, (Tensor, tuple, list)):
        return None
    return getattr(outputs, key, None)


def _needs_grad(outputs: object) -> bool:
    """True when autograd records and some output tensor requires grad: a loss of these
    outputs must then require grad too."""
    if not torch.is_grad_enabled():
        return False
    if isinstance(outputs, Tensor):
        return outputs.requires_grad
    if isinstance(outputs, Mapping):
        return any(_needs_grad(v) for v in outputs.values())
    if isinstance(outputs, (tuple, list)):
        return any(_needs_grad(v) for v in outputs)
    return False


def _first_tensor(outputs: object) -> Tensor | None:
    if isinstance(outputs, Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        values: Iterable[Any] = outputs.values()
    elif isinstance(outputs, (tuple, list)):
        values = outputs
    else:
        return None
    for v in values:
        t = _first_tensor(v)
        if t is not None:
            return t
    return None


def _logits(outputs: object) -> Tensor | None:
    if isinstance(outputs, Tensor):
        return outputs
    t = _get(outputs, "logits")
    return t if isinstance(t, Tensor) else _first_tensor(outputs)


def sample_seeds(batch: Inputs) -> list[int]:
    """One seed per sample: a hash of the sample's content in every batched tensor."""
    tensors = [t for _, t in named_inputs(batch) if isinstance(t, Tensor) and t.dim() > 0]
    n = int(tensors[0].shape[0]) if tensors else 0
    cpu = [t.detach().cpu().contiguous() for t in tensors]
    seeds = []
    for i in range(n):
        h = hashlib.sha256()
        for t in cpu:
            row = t[i]
            h.update(row.reshape(-1).view(torch.uint8).numpy().tobytes() if row.numel() else b"")
        seeds.append(int.from_bytes(h.digest()[:7], "little"))
    return seeds


def synthetic_targets(logits: Tensor, batch: Inputs) -> Tensor:
    """Class ids for ``logits`` (shape ``logits.shape[:-1]``, in ``[0, logits.shape[-1])``),
    each sample's drawn from its content hash (:func:`sample_seeds`)."""
    classes = int(logits.shape[-1])
    rows = []
    for s in sample_seeds(batch)[: int(logits.shape[0])]:
        gen = torch.Generator().manual_seed(s)
        rows.append(torch.randint(0, classes, tuple(logits.shape[1:-1]), generator=gen))
    if not rows:
        return torch.zeros(tuple(logits.shape[:-1]), dtype=torch.int64, device=logits.device)
    return torch.stack(rows).to(logits.device)


def _ce(logits: Tensor, labels: Tensor) -> Tensor:
    if logits.dim() == labels.dim() + 1 and tuple(logits.shape[:-1]) == tuple(labels.shape):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               labels.reshape(-1).long())
    raise QsyncInputError(
        f"loss: the default cross-entropy needs logits of shape labels.shape + [classes]; got "
        f"logits {list(logits.shape)} and labels {list(labels.shape)}: give the file a "
        f"loss(outputs, batch)")


def default_loss_kind(outputs: object, batch: object) -> str:
    """Which default :func:`default_loss` takes for these outputs and batch: ``model``,
    ``qa``, ``labels`` or ``synthetic``."""
    own = _get(outputs, "loss")
    if isinstance(own, Tensor):
        return "model"
    if (isinstance(batch, Mapping) and isinstance(_get(outputs, "start_logits"), Tensor)
            and isinstance(_get(outputs, "end_logits"), Tensor)
            and isinstance(batch.get("start_positions"), Tensor)
            and isinstance(batch.get("end_positions"), Tensor)):
        return "qa"
    if isinstance(batch, Mapping) and isinstance(batch.get("labels"), Tensor):
        return "labels"
    return "synthetic"


def default_loss(outputs: Any, batch: Any) -> Tensor:
    """The loss of a file without ``loss()`` (see the module docstring)."""
    kind = default_loss_kind(outputs, batch)
    if kind == "model":
        return _get(outputs, "loss")
    if kind == "qa":
        return (_ce(_get(outputs, "start_logits"), batch["start_positions"])
                + _ce(_get(outputs, "end_logits"), batch["end_positions"])) / 2
    logits = _logits(outputs)
    if logits is None or not logits.is_floating_point() or logits.dim() < 1:
        raise QsyncInputError(
            f"loss: the model's outputs ({type(outputs).__name__}) hold no loss and no "
            f"floating-point logits: give the file a loss(outputs, batch)")
    if kind == "labels":
        return _ce(logits, batch["labels"])
    if logits.dim() < 2:
        raise QsyncInputError(
            f"loss: the logits have shape {list(logits.shape)}, not (batch, ..., classes), "
            f"and the batch has no labels: give the file a loss(outputs, batch)")
    return _ce(logits, synthetic_targets(logits, batch))


_LOSS_LINES = {
    "model": "the model's own loss (outputs.loss)",
    "qa": "default: (cross-entropy(start_logits, start_positions) + cross-entropy("
          "end_logits, end_positions)) / 2",
    "labels": "default: cross-entropy of the logits against batch['labels']",
    "synthetic": "default: cross-entropy of the logits against synthetic class targets "
                 "(seeded per sample by its content; the batch has no labels)",
}


# ----------------------------------------------------------------------------- the workload


class UserWorkload:
    """A model file as a workload (see the module docstring); made by
    :func:`load_user_workload`, which runs the file."""

    real_data: bool
    task = TASK_USER
    seq_len = None
    loss = "user"

    def __init__(self, path: Path, fn_name: str, module: ModuleType, sha256: str,
                 model: nn.Module, example: Example) -> None:
        self.path = path
        self.fn_name = fn_name
        self.name = f"{path}:{fn_name}"
        self.sha256 = sha256
        self.module = module
        self.model = model  # the model of the first build() (the one traced)
        self.example = example
        self.default_batch = _batch_of(example)
        user_loss = _hook(module, "loss", path, "loss(outputs, batch)")
        self.user_loss: Callable[[Any, Any], Any] | None = user_loss
        user_data = _hook(module, "data", path, "data(batch_size, seed)")
        self.user_data: Callable[[int, int], Any] | None = user_data
        self.real_data = self.user_data is not None
        self.description = f"your model {path.name}:{fn_name}"
        self.input_doc = ", ".join(f"{k} {_describe(t)}" for k, t in named_inputs(example))
        self.loss_doc = ("loss(outputs, batch) of the file" if self.user_loss is not None
                         else "the default loss (qsync_opt.models.user)")
        #: outputs of the last trace (meta or real tensors): what loss_line() describes
        self.example_outputs: Any = None
        self._built = 0

    # -- building
    def build(self) -> nn.Module:
        """A fresh model: the file's function called again (seed the RNG first for the
        same weights everywhere)."""
        result = _call(self.name, self.module, self.fn_name)
        model, ex = _check_result(self.name, result)
        _check_like(self, _normalise_example(self.name, ex), self.default_batch,
                    f"{self.fn_name}() called again returned example_inputs that")
        return model

    # -- batches
    def make_inputs(self, batch: int, device: torch.device | str = "cpu", seed: int = 0) -> Any:
        """A synthetic batch of ``batch`` samples shaped like the example (module docstring);
        on the meta device, empty meta tensors."""
        meta = torch.device(device).type == "meta"
        gen = torch.Generator().manual_seed(seed)

        def one(t: Tensor) -> Tensor:
            shape = (batch, *t.shape[1:]) if t.dim() > 0 else tuple(t.shape)
            if meta:
                return torch.empty(shape, dtype=t.dtype, device="meta")
            if t.dim() == 0:
                return t.detach().clone().to(device)
            x = t.detach().cpu()
            if t.dtype == torch.bool:
                lo, hi = (int(x.long().min()), int(x.long().max())) if x.numel() else (0, 1)
                out = torch.randint(lo, hi + 1, shape, generator=gen).bool()
            elif not t.is_floating_point() and not t.is_complex():
                lo, hi = (int(x.min()), int(x.max())) if x.numel() else (0, 0)
                out = torch.randint(lo, hi + 1, shape, generator=gen, dtype=torch.int64).to(t.dtype)
            else:
                xf = x.double()
                mean = float(xf.mean()) if x.numel() else 0.0
                std = float(xf.std()) if x.numel() > 1 else 0.0
                out = (torch.randn(shape, generator=gen, dtype=torch.float64) * std + mean
                       ).to(t.dtype)
            return out.to(device)

        return map_tensors(one, self.example)

    def make_targets(self, batch: int, device: torch.device | str = "cpu") -> None:
        """None: a user's batch carries its own targets (the loss reads them from it)."""
        return None

    def batches(self, batch: int, n: int | None, seed: int) -> Iterator[Any]:
        """``n`` batches (None: without end) of ``batch`` samples: the file's ``data()`` when
        it has one (each batch checked against the example), else synthetic ones."""
        i = 0
        if self.user_data is None:
            while n is None or i < n:
                yield self.make_inputs(batch, "cpu", seed * 1000 + i)
                i += 1
            return
        epoch = 0
        while n is None or i < n:
            got = False
            for b in self._data_iter(batch, seed + epoch):
                self.check_batch(b, batch, f"data({batch}, {seed + epoch}) batch {i}")
                got = True
                yield b
                i += 1
                if n is not None and i >= n:
                    return
            if not got:
                raise QsyncInputError(f"model: data({batch}, {seed + epoch}) of "
                                      f"{self.path.name} yielded no batch")
            epoch += 1

    def _data_iter(self, batch: int, seed: int) -> Iterator[Any]:
        assert self.user_data is not None
        try:
            it = iter(self.user_data(batch, seed))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            raise QsyncInputError(f"model: data({batch}, {seed}) of {self.path.name} raised "
                                  f"{exc.__class__.__name__}: {_one_line(str(exc))}") from None
        while True:
            try:
                b = next(it)
            except StopIteration:
                return
            except KeyboardInterrupt:
                raise
            except BaseException as exc:
                raise QsyncInputError(
                    f"model: data({batch}, {seed}) of {self.path.name} raised "
                    f"{exc.__class__.__name__}: {_one_line(str(exc))}") from None
            yield b

    def check_batch(self, batch: object, size: int, where: str) -> None:
        """Refuse (one line) a batch not shaped like the example at ``size`` samples."""
        _check_like(self, batch, size, f"{where} of {self.path.name}")

    # -- forward and loss
    def forward(self, model: nn.Module, inputs: Inputs) -> Any:
        return call_model(model, inputs)

    def loss_of(self, outputs: Any, inputs: Any, targets: Any = None) -> Tensor:
        """The loss (the file's ``loss()`` or the default), a scalar; refused in one line
        when it is not one."""
        if self.user_loss is not None:
            batch = inputs[0] if isinstance(self.example, Tensor) and isinstance(
                inputs, tuple) else inputs
            try:
                value = self.user_loss(outputs, batch)
            except KeyboardInterrupt:
                raise
            except QsyncInputError:
                raise
            except BaseException as exc:
                raise QsyncInputError(f"loss: loss(outputs, batch) of {self.path.name} raised "
                                      f"{exc.__class__.__name__}: {_one_line(str(exc))}"
                                      ) from None
            where = f"loss(outputs, batch) of {self.path.name}"
        else:
            value = default_loss(outputs, inputs)
            where = f"the default loss ({default_loss_kind(outputs, inputs)})"
        if not isinstance(value, Tensor) or value.numel() != 1 or not value.is_floating_point():
            raise QsyncInputError(f"loss: {where} returned {_describe(value)}, not a scalar "
                                  f"floating-point tensor")
        if not value.requires_grad and _needs_grad(outputs):
            raise QsyncInputError(f"loss: {where} returned a tensor without grad (detached "
                                  f"from the model's outputs: .item(), .detach(), "
                                  f"torch.tensor(...)); training cannot step on it")
        return value.reshape(())

    def loss_line(self, outputs: object = None, batch: object = None) -> str:
        """One line saying which loss is used (for these outputs and this batch; default: the
        last trace's outputs and the example)."""
        if self.user_loss is not None:
            return f"loss: loss(outputs, batch) from {self.path.name}"
        outputs = self.example_outputs if outputs is None else outputs
        batch = self.example if batch is None else batch
        if outputs is None:
            return "loss: the default loss (qsync_opt.models.user), chosen from the outputs"
        return f"loss: {_LOSS_LINES[default_loss_kind(outputs, batch)]}"

    def data_line(self) -> str:
        return (f"data: data(batch_size, seed) from {self.path.name}" if self.user_data
                else "data: synthetic batches shaped like the example inputs (seeded)")

    # -- the rest of the Workload protocol (qsync_opt.models.workload)
    def trace_inputs(self, batch: int, include_loss: bool) -> TraceInputs:
        """The model of the first ``FUNCTION()`` call on real inputs: the example at its
        batch, else synthetic ones shaped like it; no separate loss (a file's loss reads
        its batch, which the tracer does not hold)."""
        inputs = self.example if batch == self.default_batch else self.make_inputs(batch, "cpu")
        return TraceInputs(self.model, inputs)

    def saw_outputs(self, outputs: object) -> None:
        """Kept: :meth:`loss_line` says which default loss these outputs choose."""
        self.example_outputs = outputs

    def sample_batches(self, batch: int, n: int, seed: int) -> Iterator[tuple[Any, None]]:
        """:meth:`batches`, each paired with None: the loss reads its targets from it."""
        return ((x, None) for x in self.batches(batch, n, seed))

    def usage_lines(self, outputs: object = None, inputs: object = None) -> list[str]:
        """The loss and the data the file uses (:meth:`loss_line`, :meth:`data_line`)."""
        return [self.loss_line(outputs, inputs), self.data_line()]

    @property
    def init_doc(self) -> str:
        return f"{self.fn_name}() of {self.path.name}"

    @property
    def cache_name(self) -> str:
        """The function and the file's content hash, never its path."""
        return f"user-{self.fn_name}-{self.sha256[:16]}"

    @property
    def code_digest(self) -> str | None:
        """None: the file may import other files, whose changes its hash does not see."""
        return None

    def check(self, batch: int, seed: int = 0) -> str:
        """Before a run: one batch of ``batch`` samples (``data()`` or synthetic) checked
        against the example, and the model's forward and loss on two of its samples (eval
        mode) checked to give a scalar that requires grad. Returns :meth:`loss_line`."""
        b = next(iter(self.batches(batch, 1, seed)))
        small = slice_batch(b, 0, min(2, batch))
        model = self.model
        was = model.training
        model.eval()
        try:
            with torch.enable_grad():
                try:
                    out = self.forward(model, small)
                except KeyboardInterrupt:
                    raise
                except BaseException as exc:
                    raise QsyncInputError(
                        f"model: {self.name} failed on a batch shaped like its example "
                        f"inputs: {exc.__class__.__name__}: {_one_line(str(exc))}") from None
                self.loss_of(out, small)
        finally:
            model.train(was)
        return self.loss_line(out, small)


def _hook(module: ModuleType, name: str, path: Path, form: str) -> Any:
    """The file's optional ``loss`` / ``data``: a function, or absent (None). Anything else
    under that name is refused in one line, never silently replaced by the default."""
    value = getattr(module, name, None)
    if value is None or callable(value):
        return value
    raise QsyncInputError(f"model: {_one_line(path.name)} defines {name} as "
                          f"{type(value).__name__} {_one_line(repr(value))[:40]}, not a "
                          f"function {form}: make it one, or remove it for the default")


def _check_like(wl: UserWorkload, batch: object, size: int, where: str) -> None:
    ex = wl.example
    if isinstance(ex, Tensor) and isinstance(batch, (tuple, list)) and len(batch) == 1:
        batch = batch[0]
    if isinstance(ex, Mapping) != isinstance(batch, Mapping) or (
            isinstance(ex, Tensor) != isinstance(batch, Tensor)) or not isinstance(
            batch, (Mapping, Tensor, tuple, list)):
        like = "a dict" if isinstance(ex, Mapping) else "a tensor" if isinstance(
            ex, Tensor) else "a tuple"
        raise QsyncInputError(f"model: {where} is {_describe(batch)}, not {like} like the "
                              f"example inputs")
    got, want = dict(named_inputs(batch)), dict(named_inputs(ex))
    if list(got) != list(want) and set(got) != set(want):
        raise QsyncInputError(f"model: {where} has inputs {', '.join(got) or 'none'}; the "
                              f"example inputs have {', '.join(want)}")
    for k, t in want.items():
        v = got[k]
        exp = [size, *t.shape[1:]] if t.dim() > 0 else list(t.shape)
        if not isinstance(v, Tensor) or v.dtype != t.dtype or list(v.shape) != exp:
            raise QsyncInputError(
                f"model: {where}: {k} is {_describe(v)}, expected a "
                f"{str(t.dtype).removeprefix('torch.')} tensor of shape {exp} (the example's, "
                f"at batch {size})")


def _call(spec: str, module: ModuleType, fn_name: str) -> Any:
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise QsyncInputError(f"model: {_one_line(spec.rpartition(':')[0])} has no function "
                              f"{fn_name!r}")
    try:
        return fn()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        raise QsyncInputError(f"model: {_one_line(spec)} raised {exc.__class__.__name__}: "
                              f"{_one_line(str(exc))}") from None


def _check_result(spec: str, result: object) -> tuple[nn.Module, Any]:
    if not isinstance(result, tuple) or len(result) != 2 or not isinstance(result[0], nn.Module):
        raise QsyncInputError(f"model: {_one_line(spec)} must return (nn.Module, "
                              f"example_inputs), not {_describe(result)}")
    if not any(p.requires_grad for p in result[0].parameters()):
        raise QsyncInputError(f"model: {_one_line(spec)} returned a module with no trainable "
                              f"parameters ({type(result[0]).__name__}): nothing to plan or "
                              f"train")
    return result[0], result[1]


def load_user_workload(spec: str, sha256: str | None = None) -> UserWorkload:
    """Import ``spec``'s file (this RUNS it) and call its function once.

    With ``sha256``, the file's content must have that hash, checked before anything runs;
    the bytes hashed are the bytes executed (the file is read once). Refused in one line:
    no such file or function, an import or a call that raises (anything but Ctrl-C, a
    ``sys.exit`` too), a result that is not ``(nn.Module, example_inputs)`` or example inputs
    that are not tensors.
    """
    path, fn_name = model_file_path(spec)
    shown = _one_line(str(path))
    source = read_model_file(path)
    digest = hashlib.sha256(source).hexdigest()
    if sha256 is not None and digest != sha256:
        raise QsyncInputError(
            f"model: {shown} is not the file the plan was made from (its sha256 is "
            f"{digest[:16]}..., the plan's workload_sha256 {_one_line(sha256)[:16]}...); "
            f"nothing was run")
    resolved = path.resolve()
    mod_name = f"qsync_user_model_{abs(hash(str(resolved)))}"
    module = ModuleType(mod_name)
    module.__file__ = str(path)
    sys.modules[mod_name] = module
    try:
        code = compile(source, str(path), "exec")
        exec(code, module.__dict__)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        sys.modules.pop(mod_name, None)
        raise QsyncInputError(f"model: importing {shown} failed: {exc.__class__.__name__}: "
                              f"{_one_line(str(exc))}") from None
    model, ex = _check_result(spec, _call(spec, module, fn_name))
    example = _normalise_example(spec, ex)
    _check_runs(spec, model, example)
    return UserWorkload(resolved, fn_name, module, digest, model, example)


def _check_runs(spec: str, model: nn.Module, example: Inputs) -> None:
    """The model's forward on two samples of its own example inputs (eval mode, no grad,
    the RNG state kept): a model that cannot run them (an ``nn.Linear`` fed int64) is refused
    in one line, not traced on shapes alone."""
    small = slice_batch(example, 0, min(2, _batch_of(example)))
    was = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            call_model(model, small)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        raise QsyncInputError(f"model: {_one_line(spec)} fails on its own example inputs: "
                              f"{exc.__class__.__name__}: {_one_line(str(exc))}") from None
    finally:
        model.train(was)
