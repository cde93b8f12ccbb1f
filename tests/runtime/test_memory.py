"""Peak tensor memory of a CPU step: exact on known allocations, deterministic on a model."""

from __future__ import annotations

import torch
from torch import nn

from qsync_opt.runtime import apply_precisions
from qsync_opt.runtime.memory import (
    count_tensor_bytes,
    mark,
    measure_plan_memory,
    measure_step_memory,
    track_memory,
)

MiB = 1 << 20


def _bytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def test_toy_peak_is_exact() -> None:
    kept: list[torch.Tensor] = []

    def step() -> None:
        a, _b = _bytes(MiB), _bytes(MiB)
        del a
        mark("freed a")
        c = _bytes(3 * MiB)  # live now: b and c
        kept.append(c)

    model = nn.Linear(4, 4)  # 80 bytes of parameters
    m = measure_step_memory(model, step)
    assert m.baseline_bytes == 80 == m.baseline["parameters"]
    assert m.peak_bytes == 80 + 4 * MiB
    assert m.marks["freed a"] == 80 + MiB
    assert m.end_bytes == 80 + 3 * MiB  # b freed when step returned, c kept
    assert m.peak_phase == "freed a"
    assert m.n_allocations == 3


def test_frees_inside_kernels_and_repeated_regions_are_counted() -> None:
    # Many small allocations and frees in one region, against a running sum kept here.
    live: list[torch.Tensor] = []
    cur = peak = 0
    with track_memory() as tr:
        for i in range(300):
            if live and i % 3 == 2:
                t = live.pop(i % len(live))
                cur -= t.untyped_storage().nbytes()
                del t
            else:
                n = (i * 7919) % 5000 + 1
                live.append(_bytes(n))
                cur += n
            peak = max(peak, cur)
    assert tr.trace.peak_delta_bytes == peak
    assert tr.trace.end_delta_bytes == cur
    # A second region frees blocks the first one allocated: they are older than it and
    # not watched, so they are left out (and reported), not subtracted.
    with track_memory() as tr2:
        live.clear()
    assert tr2.trace.end_delta_bytes == 0
    assert tr2.trace.ignored_free_bytes == cur


def test_a_baseline_tensor_freed_in_the_step_is_subtracted_when_freed() -> None:
    pre = [_bytes(2 * MiB)]

    def step() -> None:
        a = _bytes(MiB)  # 3 MiB live
        pre.clear()  # 1 MiB
        c = _bytes(3 * MiB)  # 4 MiB: the peak
        del a, c

    m = measure_step_memory(nn.Linear(4, 4), step, extra=pre)
    assert m.baseline["extra"] == 2 * MiB
    assert m.peak_bytes == 80 + 4 * MiB
    assert m.preexisting_freed_bytes == 2 * MiB
    assert m.end_bytes == 80


def test_count_tensor_bytes_counts_a_storage_once() -> None:
    t = torch.zeros(256)
    assert count_tensor_bytes([t, t.view(16, 16), t[:10], None, 3]) == 1024


def test_bf16_linear_keeps_its_16_bit_copies() -> None:
    # What the replayer's fp32 activation flow must count: a bf16 layer saves bf16 copies
    # of its input and weight; its fp32 input is not saved, its output comes back in fp32.
    model = nn.Sequential(nn.Linear(64, 32, bias=False))
    apply_precisions(model, {"0": "bf16"})
    x = torch.randn(16, 64, requires_grad=True)
    out: list[torch.Tensor] = []

    def step() -> None:
        out.append(model(x))

    m = measure_step_memory(model, step, extra=(x,))
    assert m.end_bytes - m.baseline_bytes == 16 * 64 * 2 + 32 * 64 * 2 + 16 * 32 * 4


def test_model_step_is_deterministic_and_counts_the_state() -> None:
    runs = [measure_plan_memory("digits_cnn", None, 16) for _ in range(2)]
    a, b = runs
    assert a == b
    params = a.baseline["parameters"]
    assert a.baseline["optimizer_state"] == params  # SGD momentum, after the warm-up
    assert a.peak_bytes >= 2 * params  # parameters and their gradients at least
    assert a.end_bytes == a.baseline_bytes + params  # the new gradients, nothing else
    assert a.baseline_bytes < a.marks["forward"] <= a.peak_bytes
    assert a.preexisting_freed_bytes == 0
    assert a.peak_op


def test_replayer_predicts_the_runtime_peak_within_5_percent() -> None:
    """The fp32-flow memory model (what the runtime's layers allocate, as a timeline) against
    the exact measurement, digits_cnn, uniform and mixed plans."""
    import pytest

    from qsync_opt import estimate, parse_shorthand, trace
    from qsync_opt.core.precision import Precision
    from qsync_opt.problem.program import AllocationProblem, ProblemOptions
    from qsync_opt.problem.synthetic import random_indicator
    from qsync_opt.runtime.memory import measure_plan_memory

    g = trace("digits_cnn", 32)
    cl = parse_shorthand("cpux1@32")
    costs = estimate(g, cl).model_copy(update={"activation_flow": "fp32"})
    # One group is the strong group: let it take the mixed plans (not held at fp32).
    prob = AllocationProblem(g, cl, costs, random_indicator(g),
                             ProblemOptions(lower_reference=True))
    gm = prob.groups[0]
    ps = (Precision.fp32, Precision.bf16, Precision.int8)
    plans = [[c.index(p) if p in c else c.index(Precision.fp32) for c in gm.choices] for p in ps]
    plans.append([c.index(ps[i % 3]) for i, c in enumerate(gm.choices)])
    for a in plans:
        plan = prob.make_plan({"cpu": a})
        grp = prob.replayer.simulate(plan, events=False).groups["cpu"]
        assert grp.peak_memory_bytes == sum(grp.memory.values())
        measured = measure_plan_memory("digits_cnn", plan, 32).peak_bytes
        assert grp.peak_memory_bytes == pytest.approx(measured, rel=0.05), a
        # The solvers' linear memory model is a conservative bound of the timeline peak.
        assert gm.memory_bytes(a) >= grp.peak_memory_bytes
