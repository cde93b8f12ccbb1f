"""Golden plans: the plan JSON the library makes for the README's instances, pinned.

A refactor which changes any plan (an op's precision, a batch split, an objective's last
digit, a provenance field) fails here. For each instance x solver the test solves (or
compares, for the baselines) with the Python API and a ``random_indicator(graph, seed)`` (the
real indicator needs real batches and minutes), and checks:

- the plan's JSON (``qsync_opt.documents.io.to_json``) is byte-for-byte the golden file's ``plan``
  (a plan holds no timing: the limit it records is the one asked for, the time used is
  the report's ``wall_s``);
- the SolveReport's ``status``, ``objective`` and ``mode`` are the golden file's ``report``.

Regenerate after an intended change (and review the diff of ``tests/golden/``)::

    QSYNC_REGEN_GOLDEN=1 .venv/bin/python -m pytest -p no:cacheprovider tests/planner/test_golden_plans.py

Without ``QSYNC_REGEN_GOLDEN`` a mismatch fails with the first differing keys, written as
``group / op: golden -> now`` for precisions, and as JSON paths for the rest.

Determinism (checked before these files were written: every instance solved 3 times in
one process and in 3 separate processes gave identical output; ``test_repeat_is_identical``
keeps an in-process check): HiGHS and CBC run with ``random_seed``/``randomCbcSeed`` from
``SolveOptions.seed`` (0) and their default threads; greedy and the baselines have no
randomness. CP-SAT with several workers may return a different optimum among ties; it
runs one worker when a program has at most ``SMALL_PROGRAM_VARS`` variables (the default
``threads=0``), which every program here has, so its plans are compared in full too, and
``_check_cpsat_single_worker`` fails (naming the instance) if an instance ever needs
several workers; such an instance would compare only status, objective and mode.

Nothing is stripped: identical inputs give identical plan bytes
(``test_two_solves_give_identical_bytes``). Version strings: a Plan carries none of
the library's or torch's version (only its own ``schema_version``, which is the layout
and belongs to the golden); if one is ever added it belongs in :data:`VERSION_PROVENANCE`
(an upgrade changes it, not a refactor).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
REGEN = os.environ.get("QSYNC_REGEN_GOLDEN") == "1"

#: Provenance keys naming library or dependency versions (none today; see the docstring).
VERSION_PROVENANCE: tuple[str, ...] = ()

#: (workload, cluster, ProblemOptions keywords): the README's problems.
PROBLEMS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # README, Python API: resnet50 on the QSync paper's cluster, 5% memory headroom
    "resnet50_api": ("resnet50", "v100x16+t4x16", {"memory_headroom": 0.05}),
    # README, CLI: resnet50 with the CLI's defaults (no headroom)
    "resnet50_cli": ("resnet50", "v100x16+t4x16", {}),
    # README, CLI: bert_base on A100s and T4s, --target-ms 390 / the default target
    "bert_base_390": ("bert_base", "a100x8+t4x8", {"target_ms": 390.0}),
    "bert_base": ("bert_base", "a100x8+t4x8", {}),
    # README, the three-line runtime example: this CPU and a 2x slower stand-in
    "digits_cnn": ("digits_cnn", "cpux1@48+cpu/2x1@16", {}),
}

#: The baselines and heuristics ``compare`` runs besides the exact backends.
BASELINES = ("greedy-per-ms", "uniform", "dynamic-batching", "additive-ilp", "strong-only")

#: case name -> (problem, how, solver, solve keywords). ``how``: "solve" (``solve.solve``),
#: "compare" (the row ``solve.compare`` returns for that solver), "lowest" (the README's
#: ``problem.make_plan`` of every group's lowest precisions, no solver).
CASES: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    **{f"resnet50_api-{s}": ("resnet50_api", "solve", s, {})
       for s in ("highs", "cbc", "cpsat", "greedy")},
    **{f"resnet50_api-compare-{s}": ("resnet50_api", "compare", s, {})
       for s in ("highs", *BASELINES)},
    "resnet50_cli-budget-cpsat": ("resnet50_cli", "solve", "cpsat",
                                  {"mode": "budget", "degradation_budget": 0.001}),
    "resnet50_cli-budget-highs": ("resnet50_cli", "solve", "highs",
                                  {"mode": "budget", "degradation_budget": 0.001}),
    "resnet50_cli-cpsat": ("resnet50_cli", "solve", "cpsat", {}),
    "bert_base_390-highs": ("bert_base_390", "solve", "highs", {}),
    "bert_base_390-cpsat": ("bert_base_390", "solve", "cpsat", {}),
    "digits_cnn-lowest": ("digits_cnn", "lowest", "", {}),
    "digits_cnn-highs": ("digits_cnn", "solve", "highs", {}),
    "digits_cnn-greedy": ("digits_cnn", "solve", "greedy", {}),
}
#: The joint batch split: a program per candidate split, seconds each; still run in CI.
#: ``time_limit_s`` (SolveOptions): each copy's first solve gets an equal share of what is
#: left of the limit (60 s by default: about 2.6 s each for bert_base's 23 splits), and a
#: copy stopped by it could change the plan on a slow machine; the plan does not depend on
#: the limit otherwise (the limit itself is a stripped timing field).
SLOW_CASES: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "bert_base-highs-joint": ("bert_base", "solve", "highs",
                              {"joint_split": True, "time_limit_s": 600.0}),
    "resnet50_cli-compare-highs+split": ("resnet50_cli", "compare", "highs+split",
                                         {"joint_split": True, "time_limit_s": 600.0}),
}


@pytest.fixture(autouse=True, scope="module")
def _fixed_cpu(fixed_cpu_module: Any) -> Any:
    """The ``cpu`` device of the digits_cnn instance with fixed figures
    (``golden/input.cpu.DeviceSpec.json``, conftest's ``fixed_cpu_module``): the real one is
    measured on this machine (matmul rates, MemAvailable), so its plans would differ between
    machines and between runs."""
    return fixed_cpu_module


@functools.cache
def _problem(name: str) -> Any:
    import qsync_opt as qs
    from qsync_opt.problem.program import AllocationProblem, ProblemOptions
    from qsync_opt.problem.synthetic import random_indicator

    workload, cluster_spec, options = PROBLEMS[name]
    graph = _graph(workload)
    cluster = qs.load_cluster(cluster_spec)
    return AllocationProblem(graph, cluster, qs.estimate(graph, cluster),
                             random_indicator(graph, 0), ProblemOptions(**options))


@functools.cache
def _graph(workload: str) -> Any:
    import qsync_opt as qs

    return qs.trace(workload)


def _check_cpsat_single_worker(case: str, report: Any) -> None:
    """CP-SAT's plans are compared in full only where it ran one worker (see the module
    docstring): every program of the case at most SMALL_PROGRAM_VARS variables."""
    from qsync_opt.solvers.cpsat import SMALL_PROGRAM_VARS

    assert report.n_variables <= SMALL_PROGRAM_VARS, (
        f"{case}: CP-SAT's program has {report.n_variables} variables (> "
        f"{SMALL_PROGRAM_VARS}), so it runs several workers and may return another optimum "
        "among ties: compare only its status, objective and mode")


def _record(case: str, spec: tuple[str, str, str, dict[str, Any]]) -> str:
    """The golden text of one case: the stripped plan JSON and the report's verdict."""
    from qsync_opt.solvers import SolveOptions

    from qsync_opt.documents import io
    from qsync_opt.planner.compare import compare
    from qsync_opt.planner.solve import solve

    pname, how, solver, kwargs = spec
    kwargs = dict(kwargs)
    if "time_limit_s" in kwargs:
        kwargs["options"] = SolveOptions(time_limit_s=kwargs.pop("time_limit_s"))
    problem = _problem(pname)
    if how == "lowest":
        plan = problem.make_plan({g.name: g.lowest() for g in problem.groups})
        report = None
    elif how == "solve":
        plan, report = solve(problem, solver=solver, **kwargs)
    else:
        base = solver.removesuffix("+split")
        rows = compare(problem, [base], **kwargs)
        (row,) = [r for r in rows if r.solver == solver]
        assert row.report is not None, f"{case}: {row.status}: {row.messages}"
        plan, report = row.plan, row.report  # no plan: an infeasible baseline, recorded so
    if report is not None and "cpsat" in solver:
        _check_cpsat_single_worker(case, report)
    doc = None if plan is None else json.loads(io.to_json(plan))
    for key in VERSION_PROVENANCE:
        if doc is not None:
            doc["provenance"].pop(key, None)
    verdict = None if report is None else {
        "status": report.status, "objective": report.objective, "mode": report.mode}
    return json.dumps({"case": case, "report": verdict, "plan": doc}, indent=1) + "\n"


def _first_differences(old: Any, new: Any, path: str = "", out: list[str] | None = None,
                       limit: int = 8) -> list[str]:
    """Up to ``limit`` differing leaves, precisions as ``group / op: old -> new``."""
    out = [] if out is None else out
    if len(out) >= limit:
        return out
    if isinstance(old, dict) and isinstance(new, dict):
        for k in [*old, *(k for k in new if k not in old)]:
            if k not in new or k not in old:
                out.append(f"{path}/{k}: {'missing now' if k not in new else 'new key'}")
            else:
                _first_differences(old[k], new[k], f"{path}/{k}", out, limit)
            if len(out) >= limit:
                break
        if not out and list(old) != list(new):
            out.append(f"{path}: key order {list(old)[:6]}... -> {list(new)[:6]}...")
    elif isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            _first_differences(a, b, f"{path}[{i}]", out, limit)
    elif old != new or type(old) is not type(new):
        parts = path.split("/")
        if len(parts) >= 6 and parts[2] == "groups" and parts[4] == "precisions":
            out.append(f"group {parts[3]} / op {parts[5]}: {old!r} -> {new!r}")
        else:
            out.append(f"{path}: {old!r} -> {new!r}")
    return out


def _check(case: str, spec: tuple[str, str, str, dict[str, Any]], golden_dir: Path = GOLDEN,
           regen: bool = REGEN) -> None:
    """The case's record against ``golden_dir/<case>.json`` (``regen``: rewrite it)."""
    text = _record(case, spec)
    path = golden_dir / f"{case}.json"
    if regen:
        golden_dir.mkdir(exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), (f"{path} is missing: run QSYNC_REGEN_GOLDEN=1 .venv/bin/python -m "
                           "pytest tests/planner/test_golden_plans.py")
    golden = path.read_text()
    if text != golden:
        found = _first_differences(json.loads(golden), json.loads(text), limit=200)
        ops = [d for d in found if d.startswith("group ")]  # precisions first
        diffs = ops[:8] + [d for d in found if not d.startswith("group ")][:6]
        pytest.fail(f"{case}: the plan differs from {path.name}; first "
                    "differences:\n  " + "\n  ".join(diffs or ["(formatting only: same data)"])
                    + "\nan intended change: QSYNC_REGEN_GOLDEN=1 and review tests/golden/")


@pytest.mark.parametrize("case", list(CASES))
def test_golden_plan(case: str) -> None:
    _check(case, CASES[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW_CASES))
def test_golden_plan_joint_split(case: str) -> None:
    _check(case, SLOW_CASES[case])


@pytest.mark.parametrize("case", ["resnet50_api-highs", "resnet50_api-cpsat",
                                  "resnet50_api-greedy", "digits_cnn-highs"])
def test_repeat_is_identical(case: str) -> None:
    """The same instance solved again in this process gives the same text (the golden
    files themselves were written by another process)."""
    assert _record(case, CASES[case]) == _record(case, CASES[case])


@pytest.mark.parametrize("solver", ["highs", "cpsat", "greedy"])
def test_two_solves_give_identical_bytes(solver: str) -> None:
    """Two solves of the same inputs give the same plan bytes, whatever the time each
    step took: the plan records the limit asked for (not what remained of it when the
    backend started, which differs from run to run) and no wall time (the report's)."""
    import time

    from qsync_opt.solvers import SolveOptions

    from qsync_opt.documents import io
    from qsync_opt.planner.solve import solve

    problem = _problem("digits_cnn")
    texts = []
    for pause in (0.0, 0.05):
        time.sleep(pause)  # a different start: a different time remaining
        plan, report = solve(problem, solver=solver, options=SolveOptions(time_limit_s=120))
        texts.append(io.to_json(plan))
        assert report.wall_s > 0
    assert texts[0] == texts[1]
    prov = json.loads(texts[0])["provenance"]
    assert prov["option.time_limit_s"] == 120
    assert "wall_s" not in prov


def test_digits_cnn_uses_the_fixed_cpu(_fixed_cpu: Any) -> None:
    """The CPU instance is planned on the fixed figures, not this machine's."""
    from qsync_opt.costs.devices import get_device

    problem = _problem("digits_cnn")

    assert get_device("cpu") is _fixed_cpu
    assert get_device("cpu/2").peak_tflops["fp32"] == _fixed_cpu.peak_tflops["fp32"] / 2
    assert sorted(g.device for g in problem.cluster.groups) == ["cpu", "cpu/2"]


def test_a_changed_precision_fails(tmp_path: Path) -> None:
    """The check is not vacuous: one op's precision changed in a golden file fails it,
    naming the group and op."""
    case = "digits_cnn-highs"
    doc = json.loads((GOLDEN / f"{case}.json").read_text())
    group, row = next(iter(doc["plan"]["groups"].items()))
    op = next(iter(row["precisions"]))
    row["precisions"][op] = "fp16" if row["precisions"][op] != "fp16" else "fp32"
    (tmp_path / f"{case}.json").write_text(json.dumps(doc, indent=1) + "\n")
    with pytest.raises(pytest.fail.Exception, match=f"group {group} / op {op}: "):
        _check(case, CASES[case], tmp_path, regen=False)


def test_difference_names_group_op_precision() -> None:
    """A changed precision is reported as group / op: old -> new."""
    old = {"plan": {"groups": {"t4": {"precisions": {"conv1": "fp16", "fc": "fp32"}}}}}
    new = {"plan": {"groups": {"t4": {"precisions": {"conv1": "int8", "fc": "fp32"}}}}}
    assert _first_differences(old, new) == ["group t4 / op conv1: 'fp16' -> 'int8'"]
