"""What the tests run things through and compare results with.

- :func:`run_cli` runs the ``qsync-opt`` command line in this process and returns its exit
  code, stdout and stderr (an argparse error's ``SystemExit`` becomes its code).
- :func:`assert_same_tree` asserts two checkpoint-like trees (dicts, lists, tensors, plain
  values) are equal bit for bit, naming the first place they differ.
- :func:`count_calls` counts, by name, the calls of chosen torch functions inside a block
  (how the fused operators' tests show one kernel call for all B models).
- :func:`run_params` and :func:`run_rows` read a training run's latest checkpoint and its
  metrics; :func:`max_abs_diff` is the largest difference between two state dicts.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from qsync_opt.cli import main
from qsync_opt.runtime import checkpoint as ck

__all__ = ["assert_same_tree", "count_calls", "max_abs_diff", "run_cli", "run_params",
           "run_rows"]


def count_calls(functions: dict[Any, str]) -> Any:
    """A context manager (a ``TorchFunctionMode``) whose ``counts`` (a Counter) counts the
    calls of ``functions`` (function -> name) made inside it; calls nested inside a counted
    one are not seen, so a fused kernel's own internals do not count."""
    class CountCalls(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: Counter[str] = Counter()

        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: dict[str, Any] | None = None) -> Any:
            name = functions.get(func)
            if name is not None:
                self.counts[name] += 1
            return func(*args, **(kwargs or {}))

    return CountCalls()


def run_cli(*argv: str) -> tuple[int, str, str]:
    """``qsync-opt ARGV...`` in process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse usage errors
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return code, out.getvalue(), err.getvalue()


def assert_same_tree(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` equal bit for bit: tensors by dtype and ``torch.equal``, containers
    by keys/length and type, other values by ``==`` (so NaN-free plain values)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def run_params(out: Any, rank: int, buffers: bool = False) -> dict[str, Any]:
    """The model tensors of a training run's latest checkpoint of ``rank`` (``out``: its
    folder); without ``buffers``, BatchNorm's running statistics and counters left out."""
    path = ck.latest_checkpoint(out, rank)
    assert path is not None, f"no checkpoint of rank {rank} in {out}"
    doc = ck.load_checkpoint(path)
    return {k: v for k, v in doc["model"].items()
            if buffers or ("running" not in k and "num_batches" not in k)}


def max_abs_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest absolute difference, in float64, over ``a``'s entries (``b`` may hold
    more; an entry of ``a`` missing from ``b`` is a KeyError naming it)."""
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def run_rows(out: Any, rank: int) -> list[dict[str, Any]]:
    """The metrics rows of a training run's ``rank``."""
    text = (Path(out) / f"metrics.rank{rank}.jsonl").read_text()
    return [json.loads(x) for x in text.splitlines()]
