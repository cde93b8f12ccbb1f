"""Plans of one graph and cluster written once as version 1 and once per strategy as
version 2, for the tests of the commands that read a plan's strategy."""

from __future__ import annotations

from pathlib import Path

from qsync_opt.costs.cluster import parse_shorthand
from qsync_opt.documents.jobstrategy import Strategy
from qsync_opt.documents.schemas import ModelGraph
from qsync_opt.problem.plan import make_plan


def write_strategy_plans(root: Path, graph: ModelGraph, shorthand: str,
                         strategies: dict[str, Strategy]) -> dict[str, Path]:
    """``root/v1.json`` (every op fp32 on ``shorthand``) and ``root/KEY.json``, that plan as
    version 2 with ``strategies[KEY]``; their paths by key (``v1`` and each KEY)."""
    v1 = make_plan(graph, parse_shorthand(shorthand), {})
    out = {"v1": root / "v1.json"}
    v1.save(out["v1"])
    for key, strategy in strategies.items():
        out[key] = root / f"{key}.json"
        v1.model_copy(update={"schema_version": 2, "strategy": strategy}).save(out[key])
    return out
