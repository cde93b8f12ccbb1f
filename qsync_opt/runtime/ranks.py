"""Which group each rank runs: ``--rank-groups`` parsed and checked against a plan, or the
plan's default of one rank per device. The launcher and the pipeline replay both read it;
it needs no torch."""

from __future__ import annotations

import logging
import re

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.documents.schemas import Plan
from qsync_opt.runtime.config import rank_groups_example

__all__ = ["resolve_ranks"]

log = logging.getLogger("qsync_opt.job.launch")  # the launcher's warnings keep its logger's name


def _parse_rank_groups(text: str) -> list[str]:
    pairs: dict[int, str] = {}
    for item in (x.strip() for x in text.split(",")):
        m = re.fullmatch(r"([0-9]{1,7}):([A-Za-z_][A-Za-z0-9_\-]*)", item)  # ASCII digits
        if not m:
            raise QsyncInputError(
                f"--rank-groups: {item!r} is not RANK:GROUP (e.g. 0:v100,1:t4)")
        rank = int(m[1])
        if rank in pairs:
            raise QsyncInputError(f"--rank-groups: rank {rank} is given twice")
        pairs[rank] = m[2]
    missing = [r for r in range(len(pairs)) if r not in pairs]
    if missing:
        raise QsyncInputError(
            f"--rank-groups: ranks must be 0..{len(pairs) - 1}; missing {missing[0]}")
    return [pairs[r] for r in range(len(pairs))]


def _default_rank_groups(plan: Plan, nproc: int | None) -> list[str]:
    ranks = [g.name for g in plan.cluster.groups for _ in range(g.count)]
    if nproc is None or nproc == len(ranks):
        return ranks
    layout = ", ".join(f"{g.name} x{g.count}" for g in plan.cluster.groups)
    example = rank_groups_example([g.name for g in plan.cluster.groups],
                                  min(nproc, len(plan.cluster.groups)))
    raise QsyncInputError(
        f"--nproc {nproc}: the plan's cluster has {len(ranks)} devices ({layout}), one rank "
        f"each by default; pass --nproc {len(ranks)}, or say which group each rank runs with "
        f"--rank-groups (e.g. {example})")


def resolve_ranks(plan: Plan, nproc: int | None, rank_groups: str | None,
                  warnings: list[str] | None = None) -> list[str]:
    """Group name of every rank, checked against the plan (QsyncInputError when wrong).
    A warning goes into ``warnings`` when given (printed after every check), else the log."""
    if nproc is not None and nproc < 1:
        raise QsyncInputError(f"--nproc: expected a positive integer, got {nproc}")
    if rank_groups is None:
        return _default_rank_groups(plan, nproc)
    ranks = _parse_rank_groups(rank_groups)
    known = [g.name for g in plan.cluster.groups]
    for i, name in enumerate(ranks):
        if name not in known:
            raise QsyncInputError(
                f"--rank-groups: rank {i}'s group {name!r} is not in the plan; its groups: "
                f"{', '.join(known)}")
    if nproc is not None and nproc != len(ranks):
        raise QsyncInputError(
            f"--nproc {nproc} does not match --rank-groups, which names {len(ranks)} ranks")
    unused = [g for g in known if g not in ranks]
    if unused:
        text = f"plan groups with no rank (not trained): {', '.join(unused)}"
        if warnings is None:
            log.warning(text)
        else:
            warnings.append(text)
    return ranks
