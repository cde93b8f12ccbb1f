"""The planner's side of ``train --replan auto``, and the rank entry that has it.

The training packages never import the planner, so the re-plan reaches the step loop from
here: :func:`make_replanner` builds the run's :class:`~qsync_opt.planner.replan.ReplanCache`
(on rank 0, once, saved in the run's folder as :data:`CACHE_NAME`), and
``python -m qsync_opt.cli.replanning CONFIG.json`` is :func:`qsync_opt.job.rank.main` with it
(the worker ``qsync-opt train`` launches under torchrun when ``--replan auto``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from qsync_opt.documents.schemas import Plan
from qsync_opt.job.rank import main
from qsync_opt.planner.replan import ReplanCache
from qsync_opt.runtime.config import TrainConfig

__all__ = ["CACHE_NAME", "make_replanner"]

#: The cache's name in the run's folder.
CACHE_NAME = "replan_cache.json"


def make_replanner(config: TrainConfig, plan: Plan) -> ReplanCache:
    """The run's re-plan cache: the problem of ``plan``'s cluster built once (the indicator
    ``--replan-indicator`` names, else the plan's method computed on this CPU and cached),
    saved as ``out_dir/replan_cache.json``, and warmed up (:meth:`~qsync_opt.planner.replan.ReplanCache.warm`)."""
    online = config.online
    cache = ReplanCache.build(plan, config.workload,
                              indicator=online.indicator if online is not None else None)
    cache.save(Path(config.out_dir) / CACHE_NAME)
    # what the re-plans derive is made now, before the run, not in a re-plan's time
    cache.warm()
    return cache


if __name__ == "__main__":
    sys.exit(main(replanner=make_replanner))
