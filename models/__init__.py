"""Benchmark workloads for qsync-opt, written in plain torch.

Each workload is a model builder plus everything needed to run one training
step on synthetic data of the right shape: example inputs, example targets,
the loss and a default per-device batch size.  Models:

==============  ===================================================  ==========
name            model                                                parameters
==============  ===================================================  ==========
resnet18        ResNet-18, ImageNet 224x224, 1000 classes            11.69 M
resnet18_32     ResNet-18, 32x32 inputs (CIFAR-style stem), 10 cls   11.17 M
resnet50        ResNet-50, ImageNet 224x224, 1000 classes            25.56 M
vgg16_bn        VGG-16 with BatchNorm, ImageNet, 1000 classes        138.37 M
bert_base       BERT-base, SQuAD-style span QA, sequence 384         108.89 M
gpt2_small      GPT-2 small LM, sequence 1024                        124.44 M
gpt2_medium     GPT-2 medium LM, sequence 1024                       354.82 M
gpt2_xl         GPT-2 XL LM, sequence 1024                           1557.61 M
vit_b16         ViT-B/16, ImageNet 224x224, 1000 classes             86.57 M
digits_cnn      small CNN, scikit-learn 8x8 digits (real data)       0.15 M
digits_resnet   ResNet-8, the digits upsampled to 32x32 (real data)  0.08 M
tiny_gpt        char-level GPT on the stdlib's source (real data)    0.82 M
==============  ===================================================  ==========

Attention matmuls (``Q @ K^T`` and ``P @ V``) are :class:`MatMul` modules so
that they have names; every model is traceable with ``torch.fx`` both by
``symbolic_trace`` and by a tracer that keeps ``MatMul`` as a leaf, and builds
under ``with torch.device("meta"):``.

``models.digits_cnn``, ``models.digits_resnet`` and ``models.tiny_gpt`` are the
submodules (with the real-data helpers); their builders are ``digits_cnn.digits_cnn``,
``digits_resnet.digits_resnet`` and ``tiny_gpt.tiny_gpt`` (or
``get_workload(name).build``). :func:`image_split` gives the train/test split of the
real-data image workloads (digits_cnn, digits_resnet: the same images).  The other builders
(``resnet18``, ``resnet50``, ``vgg16_bn``, ``bert_base``, ``gpt2_small``,
``gpt2_medium``, ``gpt2_xl``, ``vit_b16``) are re-exported here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# Submodules with the real-data helpers; builders: digits_cnn.digits_cnn,
# digits_resnet.digits_resnet, tiny_gpt.tiny_gpt.
from qsync_opt.models import digits_cnn, digits_resnet, tiny_gpt
from qsync_opt.models.bert import BertConfig, BertForQuestionAnswering, bert_base
from qsync_opt.models.digits_cnn import DigitsCNN, load_digits_tensors, train_test_split
from qsync_opt.models.digits_resnet import DigitsResNet
from qsync_opt.models.gpt2 import GPT, GPTConfig, gpt2_medium, gpt2_small, gpt2_xl
from qsync_opt.models.layers import MatMul
from qsync_opt.models.resnet import ResNet, resnet18, resnet18_32, resnet50
from qsync_opt.models.samples import image_split, real_batches, synthetic_batches
from qsync_opt.models.tiny_gpt import VOCAB_SIZE as TINY_GPT_VOCAB_SIZE
from qsync_opt.models.vgg import VGG, vgg16_bn
from qsync_opt.models.vit import VisionTransformer, ViTConfig, vit_b16
from qsync_opt.models.workload import TraceInputs, Workload, package_code_digest
from torch import nn

__all__ = [
    "GPT",
    "VGG",
    "WORKLOADS",
    "BertConfig",
    "BertForQuestionAnswering",
    "BuiltinWorkload",
    "DigitsCNN",
    "DigitsResNet",
    "GPTConfig",
    "MatMul",
    "ResNet",
    "TraceInputs",
    "UnknownWorkloadError",
    "ViTConfig",
    "VisionTransformer",
    "Workload",
    "bert_base",
    "compute_loss",
    "digits_cnn",
    "digits_resnet",
    "get_workload",
    "gpt2_medium",
    "gpt2_small",
    "gpt2_xl",
    "image_split",
    "list_workloads",
    "load_digits_tensors",
    "resnet18",
    "resnet18_32",
    "resnet50",
    "tiny_gpt",
    "train_test_split",
    "vgg16_bn",
    "vit_b16",
]

#: Values of :attr:`Workload.task`; they decide how :func:`compute_loss` reshapes.
TASK_CLASSIFICATION = "classification"
TASK_QUESTION_ANSWERING = "question_answering"
TASK_CAUSAL_LM = "causal_lm"

_INPUT_SEED = 0
_TARGET_SEED = 1


@dataclass(frozen=True)
class BuiltinWorkload:
    """One built-in workload: it meets the :class:`Workload` protocol (its module says where
    the kinds differ).

    Attributes:
        name: registry key.
        description: one-line human description.
        build: builds the model on the current default device; wrap the call
            in ``with torch.device("meta"):`` to build without allocating.
        make_inputs: ``(batch, device) -> tuple of input tensors``; synthetic
            data of the right shape and dtype (seeded CPU generator, then moved
            to ``device``); on the meta device, uninitialised meta tensors.
        make_targets: ``(batch, device) -> target tensor`` for the loss, same
            conventions as ``make_inputs``.
        loss: loss function name; ``"cross_entropy"`` for every workload.
        default_batch: default batch size per device.
        input_doc: shapes and dtypes of the inputs, e.g.
            ``"images (B,3,224,224) float32"``.
        real_data: whether the module also ships a real data set for it.
        loss_doc: exactly what :func:`compute_loss` computes.
        task: ``"classification"``, ``"question_answering"`` or
            ``"causal_lm"``; selects the reshaping in :func:`compute_loss`.
        seq_len: sequence length of the example inputs (None for images).
    """

    name: str
    description: str
    build: Callable[[], nn.Module]
    make_inputs: Callable[[int, torch.device], tuple[torch.Tensor, ...]]
    make_targets: Callable[[int, torch.device], torch.Tensor]
    loss: str
    default_batch: int
    input_doc: str
    real_data: bool
    loss_doc: str = ""
    task: str = TASK_CLASSIFICATION
    seq_len: int | None = None

    def forward(self, model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The model on one batch's inputs (``model(*inputs)``)."""
        return model(*inputs)

    def loss_of(self, outputs: torch.Tensor, inputs: tuple[torch.Tensor, ...],
                targets: torch.Tensor) -> torch.Tensor:
        """The training loss of one batch: :func:`compute_loss` (``inputs`` unused; a
        user's model file reads its targets from them)."""
        return compute_loss(self, outputs, targets)

    def trace_inputs(self, batch: int, include_loss: bool) -> TraceInputs:
        """The model built on the meta device (no memory), meta inputs, and with
        ``include_loss`` meta targets and :func:`compute_loss`."""
        meta = torch.device("meta")
        with meta:
            model = self.build()
        inputs = tuple(self.make_inputs(batch, meta))
        if not include_loss:
            return TraceInputs(model, inputs)
        return TraceInputs(model, inputs, self.make_targets(batch, meta),
                           lambda out, tgt: compute_loss(self, out, tgt))

    def saw_outputs(self, outputs: Any) -> None:
        """Nothing: a built-in's loss does not depend on its outputs."""

    def sample_batches(self, batch: int, n: int, seed: int
                       ) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
        """Its real data where it ships them, else synthetic batches."""
        if self.real_data:
            return real_batches(self, batch, n, seed)
        return synthetic_batches(self, batch, n, seed)

    def usage_lines(self, outputs: Any = None, inputs: Any = None) -> list[str]:
        """None: a built-in's loss and data are its documentation's."""
        return []

    @property
    def init_doc(self) -> str:
        return "registry init"

    @property
    def cache_name(self) -> str:
        return self.name

    @property
    def code_digest(self) -> str | None:
        """The package's sources (:func:`package_code_digest`) for a registered workload whose
        functions are the package's; None for one made or changed elsewhere (its code may lie
        outside the package)."""
        ours = all(getattr(getattr(f, "func", f), "__module__", "").startswith(__name__)
                   for f in (self.build, self.make_inputs, self.make_targets))
        return package_code_digest() if ours and WORKLOADS.get(self.name) is self else None

    @property
    def sha256(self) -> str | None:
        return None


class UnknownWorkloadError(KeyError, ValueError):
    """Raised by :func:`get_workload` for a name that is not registered.

    It is both a ``KeyError`` and a ``ValueError``; ``str()`` gives the plain
    message (no extra quotes).
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


# --------------------------------------------------------------------------- #
# Synthetic example inputs and targets.
# --------------------------------------------------------------------------- #


def _is_meta(device: torch.device | str) -> bool:
    return torch.device(device).type == "meta"


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def _randint(
    high: int, shape: tuple[int, ...], device: torch.device | str, seed: int
) -> torch.Tensor:
    if _is_meta(device):
        return torch.empty(shape, dtype=torch.int64, device="meta")
    return torch.randint(0, high, shape, generator=_generator(seed), dtype=torch.int64).to(device)


def _image_inputs(
    batch: int, device: torch.device | str, *, channels: int, size: int, uniform: bool
) -> tuple[torch.Tensor, ...]:
    shape = (batch, channels, size, size)
    if _is_meta(device):
        return (torch.empty(shape, dtype=torch.float32, device="meta"),)
    gen = _generator(_INPUT_SEED)
    x = torch.rand(shape, generator=gen) if uniform else torch.randn(shape, generator=gen)
    return (x.to(device),)


def _class_targets(batch: int, device: torch.device | str, *, num_classes: int) -> torch.Tensor:
    return _randint(num_classes, (batch,), device, _TARGET_SEED)


def _token_inputs(
    batch: int, device: torch.device | str, *, vocab_size: int, seq_len: int
) -> tuple[torch.Tensor, ...]:
    return (_randint(vocab_size, (batch, seq_len), device, _INPUT_SEED),)


def _token_targets(
    batch: int, device: torch.device | str, *, vocab_size: int, seq_len: int
) -> torch.Tensor:
    return _randint(vocab_size, (batch, seq_len), device, _TARGET_SEED)


def _qa_inputs(
    batch: int, device: torch.device | str, *, vocab_size: int, seq_len: int
) -> tuple[torch.Tensor, ...]:
    input_ids = _randint(vocab_size, (batch, seq_len), device, _INPUT_SEED)
    if _is_meta(device):
        return input_ids, torch.empty((batch, seq_len), dtype=torch.int64, device="meta")
    # Segment A (question) is the first quarter of the sequence, segment B (context) the rest.
    token_type_ids = torch.zeros((batch, seq_len), dtype=torch.int64)
    token_type_ids[:, seq_len // 4 :] = 1
    return input_ids, token_type_ids.to(device)


def _qa_targets(batch: int, device: torch.device | str, *, seq_len: int) -> torch.Tensor:
    if _is_meta(device):
        return torch.empty((batch, 2), dtype=torch.int64, device="meta")
    positions = torch.randint(
        0, seq_len, (batch, 2), generator=_generator(_TARGET_SEED), dtype=torch.int64
    )
    return positions.sort(dim=1).values.to(device)  # start <= end


# --------------------------------------------------------------------------- #
# Registry.
# --------------------------------------------------------------------------- #

_IMAGENET_INPUT_DOC = "images (B,3,224,224) float32"
_CLASSIFICATION_LOSS_DOC = (
    "F.cross_entropy(logits (B,C), targets (B,) int64 class ids), mean over the batch"
)
_LM_LOSS_DOC = (
    "F.cross_entropy(logits.flatten(0, 1) (B*S,V), targets.flatten() (B*S,) int64 next-token ids), "
    "mean over all B*S tokens"
)
_QA_LOSS_DOC = (
    "targets (B,2) int64 = [start, end] token positions; "
    "F.cross_entropy(logits.transpose(1, 2).flatten(0, 1) (B*2,S), targets.flatten() (B*2,)), mean over the "
    "2B rows, which equals HuggingFace's (start_loss + end_loss) / 2"
)

_BERT_SEQ = 384
_GPT2_SEQ = 1024
_GPT2_VOCAB = 50257
_BERT_VOCAB = 30522
_TINY_GPT_SEQ = 128


def _imagenet_workload(
    name: str, description: str, build: Callable[[], nn.Module], batch: int
) -> BuiltinWorkload:
    return BuiltinWorkload(
        name=name,
        description=description,
        build=build,
        make_inputs=functools.partial(_image_inputs, channels=3, size=224, uniform=False),
        make_targets=functools.partial(_class_targets, num_classes=1000),
        loss="cross_entropy",
        default_batch=batch,
        input_doc=_IMAGENET_INPUT_DOC,
        real_data=False,
        loss_doc=_CLASSIFICATION_LOSS_DOC,
        task=TASK_CLASSIFICATION,
    )


def _gpt2_workload(
    name: str, description: str, build: Callable[[], nn.Module], batch: int
) -> BuiltinWorkload:
    return BuiltinWorkload(
        name=name,
        description=description,
        build=build,
        make_inputs=functools.partial(_token_inputs, vocab_size=_GPT2_VOCAB, seq_len=_GPT2_SEQ),
        make_targets=functools.partial(_token_targets, vocab_size=_GPT2_VOCAB, seq_len=_GPT2_SEQ),
        loss="cross_entropy",
        default_batch=batch,
        input_doc=f"input_ids (B,{_GPT2_SEQ}) int64 in [0,{_GPT2_VOCAB})",
        real_data=False,
        loss_doc=_LM_LOSS_DOC,
        task=TASK_CAUSAL_LM,
        seq_len=_GPT2_SEQ,
    )


WORKLOADS: dict[str, BuiltinWorkload] = {
    w.name: w
    for w in (
        _imagenet_workload(
            "resnet18",
            "ResNet-18 ImageNet classifier (torchvision layout)",
            resnet18,
            128,
        ),
        BuiltinWorkload(
            name="resnet18_32",
            description="ResNet-18 for 32x32 images, 10 classes (CIFAR-style stem; "
                        "synthetic data)",
            build=resnet18_32,
            make_inputs=functools.partial(_image_inputs, channels=3, size=32, uniform=False),
            make_targets=functools.partial(_class_targets, num_classes=10),
            loss="cross_entropy",
            default_batch=64,
            input_doc="images (B,3,32,32) float32",
            real_data=False,
            loss_doc=_CLASSIFICATION_LOSS_DOC,
            task=TASK_CLASSIFICATION,
        ),
        _imagenet_workload(
            "resnet50",
            "ResNet-50 ImageNet classifier (torchvision layout)",
            resnet50,
            128,
        ),
        _imagenet_workload(
            "vgg16_bn",
            "VGG-16 with BatchNorm ImageNet classifier (torchvision layout)",
            vgg16_bn,
            64,
        ),
        BuiltinWorkload(
            name="bert_base",
            description="BERT-base extractive question answering (SQuAD style, HuggingFace layout, no pooler)",
            build=bert_base,
            make_inputs=functools.partial(_qa_inputs, vocab_size=_BERT_VOCAB, seq_len=_BERT_SEQ),
            make_targets=functools.partial(_qa_targets, seq_len=_BERT_SEQ),
            loss="cross_entropy",
            default_batch=12,
            input_doc=(
                f"input_ids (B,{_BERT_SEQ}) int64 in [0,{_BERT_VOCAB}), "
                f"token_type_ids (B,{_BERT_SEQ}) int64 in {{0,1}}"
            ),
            real_data=False,
            loss_doc=_QA_LOSS_DOC,
            task=TASK_QUESTION_ANSWERING,
            seq_len=_BERT_SEQ,
        ),
        _gpt2_workload(
            "gpt2_small",
            "GPT-2 small (124M) causal language model, tied lm_head",
            gpt2_small,
            8,
        ),
        _gpt2_workload(
            "gpt2_medium",
            "GPT-2 medium (355M) causal language model, tied lm_head",
            gpt2_medium,
            4,
        ),
        _gpt2_workload(
            "gpt2_xl", "GPT-2 XL (1.5B) causal language model, tied lm_head", gpt2_xl, 1
        ),
        _imagenet_workload(
            "vit_b16", "ViT-B/16 ImageNet classifier (torchvision layout)", vit_b16, 64
        ),
        BuiltinWorkload(
            name="digits_cnn",
            description="small CNN on scikit-learn's 8x8 handwritten digits (real data: load_digits_tensors)",
            build=digits_cnn.digits_cnn,
            make_inputs=functools.partial(_image_inputs, channels=1, size=8, uniform=True),
            make_targets=functools.partial(_class_targets, num_classes=10),
            loss="cross_entropy",
            default_batch=64,
            input_doc="images (B,1,8,8) float32 in [0,1]",
            real_data=True,
            loss_doc=_CLASSIFICATION_LOSS_DOC,
            task=TASK_CLASSIFICATION,
        ),
        BuiltinWorkload(
            name="digits_resnet",
            description=(
                "CIFAR-style ResNet-8 on scikit-learn's digits upsampled to 32x32 "
                "(real data: digits_resnet.load_digits32_tensors)"
            ),
            build=digits_resnet.digits_resnet,
            make_inputs=functools.partial(_image_inputs, channels=1, size=32, uniform=True),
            make_targets=functools.partial(_class_targets, num_classes=10),
            loss="cross_entropy",
            default_batch=64,
            input_doc="images (B,1,32,32) float32 in [0,1]",
            real_data=True,
            loss_doc=_CLASSIFICATION_LOSS_DOC,
            task=TASK_CLASSIFICATION,
        ),
        BuiltinWorkload(
            name="tiny_gpt",
            description="character-level GPT (4 layers, d=128) on the Python stdlib's source (real data: tiny_gpt)",
            build=tiny_gpt.tiny_gpt,
            make_inputs=functools.partial(
                _token_inputs, vocab_size=TINY_GPT_VOCAB_SIZE, seq_len=_TINY_GPT_SEQ
            ),
            make_targets=functools.partial(
                _token_targets, vocab_size=TINY_GPT_VOCAB_SIZE, seq_len=_TINY_GPT_SEQ
            ),
            loss="cross_entropy",
            default_batch=32,
            input_doc=f"input_ids (B,{_TINY_GPT_SEQ}) int64 in [0,{TINY_GPT_VOCAB_SIZE})",
            real_data=True,
            loss_doc=_LM_LOSS_DOC,
            task=TASK_CAUSAL_LM,
            seq_len=_TINY_GPT_SEQ,
        ),
    )
}


def list_workloads() -> list[str]:
    """Names of all registered workloads, sorted."""
    return sorted(WORKLOADS)


def get_workload(name: str) -> BuiltinWorkload:
    """Look up a workload by name (case-insensitive, ``-`` accepted for ``_``).

    Raises:
        UnknownWorkloadError: the name is not registered; the message lists the
            known names sorted, e.g. ``"unknown model 'resnet5'; known: bert_base, ..."``.
    """
    key = name.strip().lower().replace("-", "_") if isinstance(name, str) else name
    try:
        return WORKLOADS[key]
    except (KeyError, TypeError):
        raise UnknownWorkloadError(
            f"unknown model {name!r}; known: {', '.join(list_workloads())}"
        ) from None


def compute_loss(
    workload: BuiltinWorkload | str, output: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """Apply the workload's loss to the model output (see ``Workload.loss_doc``).

    * classification: ``F.cross_entropy(output (B,C), targets (B,))``.
    * question answering: output (B,S,2), targets (B,2) = [start, end];
      ``F.cross_entropy(output.transpose(1, 2).flatten(0, 1), targets.flatten())``.
    * causal LM: output (B,S,V), targets (B,S);
      ``F.cross_entropy(output.flatten(0, 1), targets.flatten())``.

    Only tensor methods and ``F.cross_entropy`` are used and the branch depends
    only on the (Python) workload, so it can be called while tracing with
    ``torch.fx`` (``output``/``targets`` may be proxies).
    """
    wl = get_workload(workload) if isinstance(workload, str) else workload
    if wl.loss != "cross_entropy":
        raise ValueError(f"unsupported loss {wl.loss!r} for workload {wl.name!r}")
    if wl.task == TASK_CLASSIFICATION:
        return F.cross_entropy(output, targets)
    if wl.task == TASK_QUESTION_ANSWERING:
        return F.cross_entropy(output.transpose(1, 2).flatten(0, 1), targets.flatten())
    if wl.task == TASK_CAUSAL_LM:
        return F.cross_entropy(output.flatten(0, 1), targets.flatten())
    raise ValueError(f"unsupported task {wl.task!r} for workload {wl.name!r}")
