"""The indicator's disk cache: the settings a table is measured with, where a table of them
is filed, and reading it back. It needs no torch, so that a cached table is found without
importing torch (:func:`qsync_opt.indicator.entry.indicate` looks here first)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.machine import cache_root
from qsync_opt.core.precision import Precision
from qsync_opt.documents.io import load
from qsync_opt.documents.schemas import IndicatorTable, ModelGraph
from qsync_opt.indicator.errormodel import check_method
from qsync_opt.indicator.tables import table_summary

if TYPE_CHECKING:  # annotations only: the cache is read without torch
    import torch

log = logging.getLogger("qsync_opt.indicator")

#: The qsync terms' default dtype, as ``str(torch.float32)`` spells it: its tables' file
#: names carry no dtype tag.
FLOAT32 = "torch.float32"

#: The error model's version: tables cached under another (int4 stochastic, int8_full's
#: per-tensor output gradient, a matmul's ``b`` re-quantized per column) are not reused.
ERROR_MODEL_VERSION = 3


def default_cache_dir() -> Path:
    return cache_root() / "indicators" / f"e{ERROR_MODEL_VERSION}"


@dataclasses.dataclass(frozen=True)
class IndicatorSettings:
    """What a table is measured with, every field in its cache key: the method, the number of
    batches and their size, the seed, gamma, the int8 rounding assumed, and the hessian and
    curv probes, the qsync terms' dtype and rows, curv's learning rate."""

    method: str
    batches: int
    batch: int
    seed: int
    gamma: float
    stochastic: bool
    hutchinson_samples: int
    term_dtype: torch.dtype | None  # None: float32 (a cache lookup made without torch)
    term_rows: int | None
    lr: float




def check_settings(s: IndicatorSettings) -> None:
    """The settings ``indicate`` refuses before anything is resolved or read: one-line
    :class:`QsyncInputError` naming the argument."""
    if not s.lr >= 0:
        raise QsyncInputError(f"lr: expected a non-negative number, got {s.lr}")
    check_method(s.method)
    if s.batches < 1:
        raise QsyncInputError(f"batches: expected a positive integer, got {s.batches}")


def cache_path(cache_name: str, graph: ModelGraph, s: IndicatorSettings,
               cache_dir: str | Path | None) -> Path:
    """Where the table of these settings is cached: keyed by the workload's
    ``cache_name`` (a user's file: its content's sha256 and function), batch, batches, method, seed, gamma, rounding, the
    method's settings and the graph's structure."""
    folder = Path(cache_dir) if cache_dir else default_cache_dir()
    dtype = str(s.term_dtype) if s.term_dtype is not None else FLOAT32
    tag = "" if dtype == FLOAT32 else f"-{dtype.split('.')[-1]}"
    tag += f"-r{s.term_rows}" if s.term_rows else ""
    tag += f"-h{s.hutchinson_samples}-lr{s.lr:g}" if s.method == "curv" else ""
    return folder / (f"{cache_name}-b{s.batch}-n{s.batches}-{s.method}-s{s.seed}-g{s.gamma:g}-"
                     f"{'sr' if s.stochastic else 'rtn'}{tag}-{graph.structure_hash()}.json")


def cached_table(path: Path, name: str, graph: ModelGraph,
                 needs: Collection[Precision] | None, method: str,
                 report: Callable[[str], None] | None) -> IndicatorTable | None:
    """The table cached at ``path`` when it has a value for every op at every precision in
    ``needs`` the op allows, recorded as the workload ``name``'s; None when there is none,
    it lacks one, or it is unreadable."""
    if not path.is_file():
        return None
    try:
        table = load(path, IndicatorTable)
        # a table cached before a precision joined the ops' menus (int4) is stale
        # for a caller that needs that precision (``needs``: default, every one)
        if all(p in table.values.get(o.name, {}) for o in graph.choosable_ops()
               if o.name not in table.unmeasured
               for p in o.allowed_precisions if needs is None or p in needs):
            log.info("indicator: reusing %s", path)
            table = table.model_copy(update={"workload": name})  # a moved file
            if report is not None:
                report(f"indicator {method}: from the cache ({path}; "
                       f"{table_summary(table)})")
            return table
        log.info("indicator: %s lacks a precision the ops allow; recomputing", path)
    except QsyncInputError as exc:
        log.warning("indicator cache %s unreadable (%s); recomputing", path, exc)
    return None
