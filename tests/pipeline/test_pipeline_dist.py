"""The pipeline across gloo processes equals the one-process pipeline."""

from __future__ import annotations

import functools

import pytest
import torch
from qsync_opt.models import get_workload

from qsync_opt.pipeline.stages import Pipeline, split_stages
from qsync_opt.profile.gloo import spawn_local
from qsync_opt.runtime.data import IndexedBatches
from qsync_opt.strategy.codecs import parse_compressor
from support.pipeline_jobs import job_result, run_stage_job


def _single(spec):
    wl = get_workload(spec["model"])
    data = IndexedBatches(wl, spec["seed"], spec["batch"])
    torch.manual_seed(spec["seed"])
    pipe = Pipeline(split_stages(wl.build(), cuts=spec["cuts"]),
                    act=functools.partial(parse_compressor, spec["act"], seed=spec["seed"]),
                    grad=functools.partial(parse_compressor, spec["grad"], seed=spec["seed"]),
                    feedback=spec["feedback"], n_samples=data.n_samples)
    opt = torch.optim.SGD(pipe.parameters(), lr=spec["lr"], momentum=0.9)
    losses = []
    for s in range(spec["steps"]):
        x, y, idx = data.batch(s % 3)
        opt.zero_grad(set_to_none=True)
        losses.append(pipe.train_step(wl.loss_of, x, y, micro_batches=spec["micro_batches"],
                                      idx=idx))
        opt.step()
    return pipe, losses


SPECS = [
    # BatchNorm, three processes, EF21 on both directions
    {"model": "digits_cnn", "cuts": ["conv2", "fc1"], "act": "topk:0.1", "grad": "quant:4",
     "feedback": "ef21", "seed": 1, "batch": 16, "micro_batches": 2, "steps": 3, "lr": 0.05},
    # the tied lm_head / wte across two processes, AQ-SGD on revisited samples
    {"model": "tiny_gpt", "cuts": ["transformer.h.2"], "act": "quant:8", "grad": "topk:0.3",
     "feedback": "aqsgd", "seed": 0, "batch": 4, "micro_batches": 2, "steps": 3, "lr": 0.05},
    # a stage with no parameters (relu1 alone): nothing to step, gradients still pass
    {"model": "digits_cnn", "cuts": ["relu1", "conv2"], "act": "none", "grad": "none",
     "feedback": "none", "seed": 2, "batch": 8, "micro_batches": 2, "steps": 2, "lr": 0.05},
]


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS, ids=[f"{s['model']}-{'-'.join(s['cuts'])}"
                                         for s in SPECS])
def test_gloo_pipeline_equals_the_single_process_one(spec):
    res = job_result(spawn_local(run_stage_job, len(spec["cuts"]) + 1, spec, timeout_s=600))
    pipe, losses = _single(spec)
    ranks = res["ranks"]
    assert ranks[-1]["losses"] == pytest.approx(losses, abs=1e-6)
    for r in ranks:
        ref = pipe.stages[r["rank"]].state_dict()
        assert set(r["state"]) == set(ref)
        for k, v in r["state"].items():
            assert torch.allclose(v.double(), ref[k].double(), atol=1e-6, rtol=0), k
    # bytes on the wire: each side counts what it sends; together the one-process counts
    for name, b in pipe.boundaries.items():
        act = sum(r["bytes"][name][0] for r in ranks if name in r["bytes"])
        grad = sum(r["bytes"][name][1] for r in ranks if name in r["bytes"])
        assert (act, grad) == (b.act_bytes, b.grad_bytes)
        # and the gradients' bytes are the compressor's formula, micro-batch by micro-batch
        n = b.last_shape
        assert n is not None
        numel = int(torch.Size(n).numel())
        per = parse_compressor(spec["grad"]).wire_bytes(numel, 4)
        assert grad == per * spec["micro_batches"] * spec["steps"]
