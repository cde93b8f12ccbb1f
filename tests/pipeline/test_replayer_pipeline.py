"""The replayer's pipeline model: GPipe's step time from stage times and boundary bytes."""

from __future__ import annotations

import pytest

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.pipeline.gpipe import pipeline_step


@pytest.mark.parametrize("stages", [1, 2, 3, 5])
@pytest.mark.parametrize("micro", [1, 2, 4, 8])
def test_no_transfer_time_is_the_gpipe_bubble_formula(stages, micro):
    f, b = 1.5, 3.25
    r = pipeline_step([f] * stages, [b] * stages, [0] * (stages - 1), [0] * (stages - 1),
                      micro_batches=micro, gbps=10)
    assert r.step_ms == pytest.approx((micro + stages - 1) * (f + b), rel=1e-12)
    assert r.transfer_ms == 0
    assert r.bubble_frac == pytest.approx((stages - 1) / (micro + stages - 1), rel=1e-12)


def test_a_transfer_bound_pipeline_is_paced_by_its_link():
    mb = 10 * 2**20  # 10 MiB a micro-batch each way, 1 Gb/s: 83.9 ms a transfer
    t = mb * 8 / 1e9 * 1e3
    r = pipeline_step([1.0, 1.0], [2.0, 2.0], [mb], [mb], micro_batches=4, gbps=1)
    # stage 0's first forward, four activations back to back on the wire, stage 1's last
    # forward and first backward, four gradients back to back, stage 0's last backward
    assert r.step_ms == pytest.approx(1.0 + 4 * t + 1.0 + 2.0 + 4 * t + 2.0, rel=1e-9)
    assert r.transfer_ms == pytest.approx(8 * t, rel=1e-12)


def test_fewer_bytes_never_take_longer_and_latency_adds_per_hop():
    sizes = [8e6, 4e6, 1e6, 1e5, 0]
    steps = [pipeline_step([3, 2, 4], [6, 5, 7], [s, s], [s, s], micro_batches=4, gbps=1).step_ms
             for s in sizes]
    assert steps == sorted(steps, reverse=True)
    base = pipeline_step([1, 1], [1, 1], [0], [0], micro_batches=1, gbps=1).step_ms
    lat = pipeline_step([1, 1], [1, 1], [0], [0], micro_batches=1, gbps=1, latency_us=500)
    assert lat.step_ms == pytest.approx(base + 2 * 0.5)  # one hop each way


@pytest.mark.parametrize(("kw", "match"), [
    ({"fwd_ms": [1, 1], "bwd_ms": [1]}, "backward"),
    ({"act_bytes": [1, 2]}, "boundaries"),
    ({"micro_batches": 0}, "micro-batches"),
    ({"gbps": 0}, "gbps"),
    ({"fwd_ms": [-1, 1]}, ">= 0")])
def test_bad_input_is_refused_by_name(kw, match):
    args = {"fwd_ms": [1, 1], "bwd_ms": [1, 1], "act_bytes": [1], "grad_bytes": [1],
            "micro_batches": 2, "gbps": 1} | kw
    with pytest.raises(QsyncInputError, match=match):
        pipeline_step(args.pop("fwd_ms"), args.pop("bwd_ms"), args.pop("act_bytes"),
                      args.pop("grad_bytes"), **args)
