"""The least solver work any exact joint-split search needs on one instance, against what
the search does.

With a fixed target the groups of a candidate split do not interact: its least objective
is the sum of its groups' optima. A candidate other than the best is left unsolved only
when a lower bound on it exceeds the best objective; the cheap bound of a group is its LP
relaxation, the exact one its optimum (a group program solved by the MIP solver). Here
every candidate's groups are relaxed and solved alone (HiGHS, as the search runs them),
and printed per candidate: its objective against the best, each group's LP bound, optimum
and MIP CPU seconds, and the cheapest set of its group MIPs that any exact search must run
(the best candidate: all of its groups that need a solver; another: the fewest MIP CPU
seconds whose optima, with the LP bounds of its other groups, lift it above the best; none
when the LP bounds already do). The sum is a floor on the MIP time of any search that
prunes with these bounds (the given split's own solve, which the search runs first, comes
on top). Then the joint split itself runs once and its search line is printed.

The instance is the command line's (``solve``'s problem building, the indicator from its
cache, as ``benchmarks/bench_cli_plan.py`` times it). CPU seconds, ``time.process_time()``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_joint_floor.py [--model resnet50] [--cluster v100x16+t4x16]
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from dataclasses import dataclass

from qsync_opt.solvers import SolveOptions
from qsync_opt.solvers.backends import get_backend
from qsync_opt.solvers.driver import solve_group_alone
from qsync_opt.solvers.memo import clear_part_memo
from qsync_opt.solvers.parts import least_part, part_objective
from qsync_opt.solvers.relaxation import relaxation_bound

from qsync_opt.cli import build_parser
from qsync_opt.cli.planning import _build_problem
from qsync_opt.planner.joint import split_cluster
from qsync_opt.planner.solve import solve
from qsync_opt.planner.splits import batch_splits
from qsync_opt.problem.program import AllocationProblem, ProblemOptions


@dataclass
class GroupFacts:
    """One group of one candidate: its LP bound and optimum (None: no plan), the CPU
    seconds of its MIP, and whether it needs a solver at all."""

    name: str
    batch: int
    lp: float | None
    opt: float | None
    mip_s: float
    trivial: bool


def group_facts(sub: AllocationProblem, opts: SolveOptions) -> list[GroupFacts]:
    """Every group of the candidate ``sub`` relaxed and, unless trivial, solved alone."""
    backend = get_backend("highs")
    out = []
    for gi, g in enumerate(sub.groups):
        _, lp = relaxation_bound(sub, [gi], opts)
        if least_part(sub, [gi]) is not None:
            out.append(GroupFacts(g.name, g.batch, lp, lp, 0.0, True))
            continue
        t0 = time.process_time()
        res, _ = solve_group_alone(backend, sub, gi, opts)
        mip_s = time.process_time() - t0
        opt = (part_objective(sub, [gi], res.assignment)
               if res is not None and res.assignment is not None else None)
        out.append(GroupFacts(g.name, g.batch, lp, opt, mip_s, False))
    return out


def needed(facts: list[GroupFacts], objective: float | None, best: float) -> list[int]:
    """The cheapest set of the candidate's group MIPs an exact search must run."""
    hard = [i for i, f in enumerate(facts) if not f.trivial]
    if objective is not None and objective <= best * (1 + 1e-9):
        return hard
    if any(f.lp is None for f in facts) or sum(f.lp or 0.0 for f in facts) > best:
        return []
    chosen: list[int] | None = None
    for k in range(1, len(hard) + 1):
        for subset in itertools.combinations(hard, k):
            # a group without a plan proves the candidate has none: an infinite bound
            low = sum(math.inf if i in subset and f.opt is None
                      else (f.opt if i in subset else f.lp) or 0.0
                      for i, f in enumerate(facts))
            cost = sum(facts[i].mip_s for i in subset)
            if low > best and (chosen is None
                               or cost < sum(facts[i].mip_s for i in chosen)):
                chosen = list(subset)
    return hard if chosen is None else chosen


def _fmt(v: float | None) -> str:
    return "none" if v is None else f"{v:.5g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--cluster", default="v100x16+t4x16")
    args = ap.parse_args()
    cli = build_parser().parse_args(["solve", "--model", args.model, "--cluster", args.cluster,
                                     "--solver", "highs", "--joint-split",
                                     "--out", "unused.plan.json"])  # (nothing is written)
    problem = _build_problem(cli, "fixed", [])
    fixed = ProblemOptions(**{**problem.options.to_json(), "target_ms": problem.target_ms,
                              "strong_groups": None})
    opts = SolveOptions(time_limit_s=600.0)
    rows = []
    for split in batch_splits(problem, None, 64):
        sub = problem.with_cluster(split_cluster(problem, split), fixed).retarget(
            problem.target_ms, source="floor")
        facts = group_facts(sub, opts)
        total = (None if any(f.opt is None for f in facts)
                 else sum(f.opt or 0.0 for f in facts))
        rows.append((split, facts, total))
    best = min(t for _, _, t in rows if t is not None)
    need_s, need_n = 0.0, 0
    for split, facts, total in rows:
        must = needed(facts, total, best)
        need_s += sum(facts[i].mip_s for i in must)
        need_n += len(must)
        rel = "" if total is None else f" ({(total / best - 1) * 100:+.2f}%)"
        print(", ".join(f"{k}={v}" for k, v in split.items()) + f": objective {_fmt(total)}"
              + rel + "; " + "; ".join(
                  f"{f.name}@{f.batch} lp {_fmt(f.lp)} opt {_fmt(f.opt)}"
                  + ("" if f.trivial else f" {f.mip_s:.2f} s") for f in facts)
              + "; must solve: " + (", ".join(f"{facts[i].name}@{facts[i].batch}"
                                              for i in must) or "nothing"))
    print(f"best objective {best:.7g}; group MIPs any exact search must run (the given split's "
          f"own solve aside): {need_n}, {need_s:.2f} CPU s")
    fresh = _build_problem(cli, "fixed", [])
    clear_part_memo()
    t0 = time.process_time()
    _, report = solve(fresh, "highs", joint_split=True)
    print(f"the joint split: {time.process_time() - t0:.2f} CPU s; "
          + next(m for m in report.messages if m.startswith("joint batch split: ")))


if __name__ == "__main__":
    main()
