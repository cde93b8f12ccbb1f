"""Peak memory measured inside `qsync-opt train`'s own ranks (--measure-memory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import qsync_opt as qs
from qsync_opt.costs.cluster import parse_shorthand
from qsync_opt.problem.program import AllocationProblem, ProblemOptions
from qsync_opt.problem.synthetic import random_indicator
from support.harness import run_cli


def _plan_and_prediction(tmp: Path, name: str, batch: int, precision: str) -> tuple[Path, int]:
    g = qs.trace(name, batch)
    cl = parse_shorthand(f"cpux2@{batch}")
    costs = qs.estimate(g, cl).model_copy(update={"activation_flow": "fp32"})
    prob = AllocationProblem(g, cl, costs, random_indicator(g),
                             ProblemOptions(lower_reference=True))
    gm = prob.groups[0]
    p = qs.Precision(precision)
    plan = prob.make_plan({"cpu": [c.index(p) if p in c else c.index(qs.Precision.fp32)
                                   for c in gm.choices]})
    assert any(v == p for v in plan.groups["cpu"].precisions.values())  # really that precision
    path = tmp / f"{precision}.plan.json"
    plan.save(path)
    pred = prob.replayer.simulate(plan, events=False).groups["cpu"].peak_memory_bytes
    return path, pred


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_two_ranks_measure_their_own_peak(tmp_path: Path, precision: str) -> None:
    plan, pred = _plan_and_prediction(tmp_path, "digits_cnn", 32, precision)
    out = tmp_path / "run"
    res = subprocess.run(
        [sys.executable, "-m", "qsync_opt.cli", "train", "--model", "digits_cnn", "--plan",
         str(plan), "--nproc", "2", "--steps", "4", "--out", str(out), "--measure-memory", "2",
         "--timeout", "300"],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    g = qs.trace("digits_cnn", 32)
    for r in (0, 1):
        mem = json.loads((out / f"summary.rank{r}.json").read_text())["memory"]
        assert mem["step"] == 2
        # DDP's flat buckets: one FP32 copy of the gradients, from DDP's own record
        assert mem["ddp_bucket_bytes"] == g.param_bytes
        assert mem["baseline_bytes"] >= 3 * g.param_bytes  # weights, grads, momentum, buckets
        # the replayer's fp32-flow model of the runtime, against the rank's own exact peak
        assert abs(pred - mem["peak_bytes"]) / mem["peak_bytes"] < 0.05, (pred, mem)
        rows = [json.loads(x) for x in (out / f"metrics.rank{r}.jsonl").read_text().splitlines()]
        assert [x["step"] for x in rows] == [0, 1, 2, 3]  # the measured step is a real step


def test_measure_memory_refuses_negative_step(tmp_path: Path) -> None:
    plan, _ = _plan_and_prediction(tmp_path, "digits_cnn", 32, "fp32")
    code, _, err = run_cli("train", "--model", "digits_cnn", "--plan", str(plan), "--nproc", "2",
                           "--steps", "4", "--out", str(tmp_path / "o"), "--measure-memory",
                           "-1", "--dry-run")
    assert code == 2
    assert "--measure-memory" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_the_measured_step_keeps_its_checkpoint(tmp_path: Path) -> None:
    """The measured step is a step like any other: the checkpoint due after it is written
    (a kill at the next step resumes from there)."""
    import torch

    plan, _ = _plan_and_prediction(tmp_path, "digits_cnn", 32, "fp32")
    out = tmp_path / "o"
    res = subprocess.run(
        [sys.executable, "-m", "qsync_opt.cli", "train", "--model", "digits_cnn", "--plan",
         str(plan), "--nproc", "1", "--rank-groups", "0:cpu", "--steps", "5", "--out", str(out),
         "--checkpoint-every", "3", "--measure-memory", "2", "--timeout", "300"],
        capture_output=True, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "QSYNC_TEST_DIE_AT_STEP": "0:4"})
    assert res.returncode != 0  # killed at step 4, after the checkpoint of step 3
    ck = torch.load(out / "checkpoint.pt", weights_only=False)
    assert int(ck["step"]) == 3


def test_the_finite_check_allocates_no_copy_of_the_gradients() -> None:
    """At a small batch the rank's peak was the finite check (isfinite made a float and a
    bool copy of each gradient); it is reductions only now, and still exact."""
    import torch

    from qsync_opt.job.rank import grads_finite
    from qsync_opt.runtime.memory import measure_step_memory

    model = torch.nn.Linear(512, 512)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    m = measure_step_memory(model, lambda: grads_finite(model))
    assert m.peak_bytes - m.baseline_bytes < 4096  # a few scalars, not 1 MiB of copies
    assert grads_finite(model)
    for bad in (float("nan"), float("inf"), -float("inf")):
        model.weight.grad[3, 7] = bad
        assert not grads_finite(model)
        model.weight.grad[3, 7] = 0.0
