"""The entry point :func:`indicate`: a built-in's table is looked up in the indicator's
cache (:mod:`.cache`) before torch is imported; on a miss :func:`.compute.indicate` (imported
then: it needs torch) resolves the workload, measures and caches."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qsync_opt.core.modelspec import is_user_model
from qsync_opt.core.precision import Precision
from qsync_opt.documents.schemas import IndicatorTable, ModelGraph
from qsync_opt.graph import trace
from qsync_opt.indicator.cache import (
    IndicatorSettings,
    cache_path,
    cached_table,
    check_settings,
)
from qsync_opt.indicator.errormodel import CURV_LR

if TYPE_CHECKING:  # annotations only: a cached table is found without torch
    import torch
    from torch import nn

    from qsync_opt.models import Workload


def indicate(
    workload: str | Workload,
    batches: int = 10,
    method: str = "qsync",
    *,
    batch: int | None = None,
    seed: int = 0,
    gamma: float = 4.0,
    stochastic: bool = True,
    model: nn.Module | None = None,
    data: Iterable[tuple[Any, Any]] | None = None,
    graph: ModelGraph | None = None,
    cache: bool = True,
    cache_dir: str | Path | None = None,
    progress: bool = False,
    hutchinson_samples: int = 2,
    term_dtype: torch.dtype | None = None,
    term_rows: int | None = None,
    memory_check: bool = True,
    needs: Collection[Precision] | None = None,
    lr: float = CURV_LR,
    report: Callable[[str], None] | None = None,
) -> IndicatorTable:
    """Omega[op][precision] for every choosable op of ``workload``, from ``batches`` batches:
    :func:`qsync_opt.indicator.compute.indicate` says what each argument does
    (``term_dtype`` None: float32). A built-in named as the registry spells it, at a given
    ``batch``, is first looked up in the cache without importing torch."""
    settings = IndicatorSettings(method, batches, batch or 0, seed, gamma, stochastic,
                                 hutchinson_samples, term_dtype, term_rows, lr)
    check_settings(settings)
    if (cache and model is None and data is None and batch is not None and batch >= 1
            and isinstance(workload, str) and not is_user_model(workload)
            and workload == workload.strip().lower().replace("-", "_")):
        g = graph or trace(workload, batch, warn=False, cache=True)  # the caller's trace warned
        found = cached_table(cache_path(workload, g, settings, cache_dir), workload, g, needs,
                             method, report)
        if found is not None:
            return found
        graph = g
    from qsync_opt.indicator import compute  # lazy: measuring imports torch

    extra = {} if term_dtype is None else {"term_dtype": term_dtype}
    return compute.indicate(workload, batches, method, batch=batch, seed=seed, gamma=gamma,
                            stochastic=stochastic, model=model, data=data, graph=graph,
                            cache=cache, cache_dir=cache_dir, progress=progress,
                            hutchinson_samples=hutchinson_samples, term_rows=term_rows,
                            memory_check=memory_check, needs=needs, lr=lr, report=report,
                            **extra)


def fast_options() -> dict[str, Any]:
    """``indicate(**fast_options())``: propagate the qsync variances in bf16 for 2 samples
    per batch (scales and variances still from whole batches) — for large models."""
    import torch  # lazy: a torch dtype, asked for only where a table is to be measured

    return {"term_dtype": torch.bfloat16, "term_rows": 2}
