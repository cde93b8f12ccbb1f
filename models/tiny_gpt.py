"""A character-level GPT trained on the Python standard library's own source.

The model is the :class:`~.gpt2.GPT` class from ``gpt2.py`` (same code path as
GPT-2) with a small configuration: 4 layers, d=128, 4 heads, context 128,
vocabulary :data:`VOCAB_SIZE`.

Data: :func:`stdlib_corpus` concatenates the ``.py`` files of the running
interpreter's standard library (``sysconfig.get_paths()["stdlib"]``, excluding
``site-packages``/``dist-packages``) in sorted relative-path order, so the text
is deterministic for a given Python installation and needs no download.

Vocabulary (fixed, independent of the corpus and the Python version):
id 0 is ``<unk>``, id 1 is ``"\\t"``, id 2 is ``"\\n"`` and ids 3..97 are the
printable ASCII characters ``" "`` (32) to ``"~"`` (126) in code-point order.
Every other character (including ``"\\r"`` and all non-ASCII) encodes to
``<unk>``.  :data:`VOCAB_SIZE` is 98.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
from qsync_opt.models.gpt2 import GPT, GPTConfig

__all__ = [
    "DEFAULT_MAX_CHARS",
    "TINY_GPT_CONFIG",
    "UNK_ID",
    "UNK_TOKEN",
    "VOCAB",
    "VOCAB_SIZE",
    "CharBatchSampler",
    "decode",
    "encode",
    "sample_batch",
    "stdlib_corpus",
    "tiny_gpt",
    "train_val_split",
]

UNK_TOKEN = "<unk>"
UNK_ID = 0
#: id -> token; index 0 is ``<unk>``, then tab, newline and printable ASCII 32..126.
VOCAB: tuple[str, ...] = (UNK_TOKEN, "\t", "\n") + tuple(chr(c) for c in range(32, 127))
VOCAB_SIZE = 98
#: Character that :func:`decode` writes for ``<unk>`` (one character, so lengths match).
UNK_CHAR = "\ufffd"
#: Default size of :func:`stdlib_corpus` (about 2 M characters).
DEFAULT_MAX_CHARS = 2_000_000

TINY_GPT_CONFIG = GPTConfig(
    vocab_size=VOCAB_SIZE, n_ctx=128, n_embd=128, n_layer=4, n_head=4, dropout=0.0
)

if len(VOCAB) != VOCAB_SIZE:  # pragma: no cover - guards the stated constant
    raise AssertionError(f"vocabulary has {len(VOCAB)} entries, expected {VOCAB_SIZE}")

_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def tiny_gpt() -> GPT:
    """Character-level GPT: 4 layers, d=128, 4 heads, context 128, vocab 98 (tied head)."""
    return GPT(TINY_GPT_CONFIG)


def _stdlib_py_files(root: Path) -> list[Path]:
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_corpus(max_chars: int | None = DEFAULT_MAX_CHARS, stdlib_dir: str | None = None) -> str:
    """Return the standard library's ``.py`` sources as one string.

    Files are read in sorted order of their path relative to the stdlib
    directory (``stdlib_dir``, default ``sysconfig.get_paths()["stdlib"]``),
    decoded as UTF-8 with undecodable bytes replaced, with ``"\\r\\n"``
    normalised to ``"\\n"``, and joined with ``"\\n"``.  Reading stops once
    ``max_chars`` characters are collected and the result is truncated to
    exactly ``max_chars`` (``None`` reads everything).
    """
    if max_chars is not None and max_chars <= 0:
        raise ValueError(f"max_chars must be positive, got {max_chars}")
    root = Path(stdlib_dir if stdlib_dir is not None else sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"standard library directory not found: {root}")
    parts: list[str] = []
    total = 0
    for path in _stdlib_py_files(root):
        try:
            text = path.read_bytes().decode("utf-8", errors="replace")
        except OSError:
            continue  # unreadable file (permissions, broken link): skip it
        text = text.replace("\r\n", "\n")
        parts.append(text)
        total += len(text) + 1
        if max_chars is not None and total >= max_chars:
            break
    corpus = "\n".join(parts)
    return corpus if max_chars is None else corpus[:max_chars]


def _lookup_table() -> torch.Tensor:
    table = torch.full((128,), UNK_ID, dtype=torch.int64)
    for idx, tok in enumerate(VOCAB):
        if idx != UNK_ID:
            table[ord(tok)] = idx
    return table


def encode(text: str) -> torch.Tensor:
    """Map a string to a 1-D int64 tensor of vocabulary ids (unknown chars -> ``UNK_ID``)."""
    if not text:
        return torch.empty(0, dtype=torch.int64)
    codes = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32).to(torch.int64)
    ascii_mask = codes < 128
    ids = _lookup_table()[codes.clamp(max=127)]
    return torch.where(ascii_mask, ids, torch.full_like(ids, UNK_ID))


def decode(ids: torch.Tensor | list[int]) -> str:
    """Map vocabulary ids back to text; ``<unk>`` becomes :data:`UNK_CHAR`."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return "".join(UNK_CHAR if i == UNK_ID else VOCAB[i] for i in values)


def train_val_split(
    data: torch.Tensor, val_fraction: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split an encoded corpus into a leading train part and a trailing validation part."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_train = int(data.numel() * (1.0 - val_fraction))
    return data[:n_train], data[n_train:]


def sample_batch(
    data: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``(x, y)``, both (batch_size, block_size) int64, with ``y`` = ``x`` shifted by one.

    Start offsets are drawn uniformly with ``generator`` (a CPU generator), so a
    seeded generator gives reproducible batches.  The result is on ``data``'s device.
    """
    if data.dim() != 1:
        raise ValueError(f"data must be 1-D, got shape {tuple(data.shape)}")
    if data.numel() < block_size + 1:
        raise ValueError(
            f"data has {data.numel()} tokens; need at least block_size + 1 = {block_size + 1}"
        )
    starts = torch.randint(0, data.numel() - block_size, (batch_size,), generator=generator)
    idx = (starts.unsqueeze(1) + torch.arange(block_size)).to(data.device)
    return data[idx], data[idx + 1]


class CharBatchSampler:
    """Infinite iterator of ``(x, y)`` batches from an encoded corpus with its own seeded generator."""

    def __init__(self, data: torch.Tensor, batch_size: int, block_size: int, seed: int = 0) -> None:
        self.data = data
        self.batch_size = batch_size
        self.block_size = block_size
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the next ``(x, y)`` batch, each (batch_size, block_size) int64."""
        return sample_batch(self.data, self.batch_size, self.block_size, self.generator)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.sample()
