"""The emulated link in the sync modes, on a gloo process group of this process (one rank;
the link spans two, so every collective is charged a two-rank ring): the DDP hook charges
each bucket its payload's real bytes (fp16 half of fp32's) and changes no gradient; the
blocking collectives (statistics, buffers, Local SGD's averaging) are charged theirs; the
measured comm time is at least the emulated delay; without a link nothing is charged."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from qsync_opt.costs.cluster import load_cluster
from qsync_opt.costs.link import LinkSpec, allreduce_s, broadcast_s, resolve_link
from qsync_opt.runtime.config import TrainConfig
from qsync_opt.runtime.link import LinkClock, link_fields
from qsync_opt.sync.hooks import HookState, chain_hook
from qsync_opt.sync.replicas import CommMeter, DDPSync, LocalSGDSync, make_sync

BW, LAT = 0.01, 1000.0  # GB/s, us: a 1 MB bucket takes 0.1 s plus 2 ms


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _spec() -> LinkSpec:
    return resolve_link(f"bw={BW},latency_us={LAT:g}", load_cluster("cpux2"), ["cpu", "cpu"])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(60, 50), nn.BatchNorm1d(50), nn.ReLU(), nn.Linear(50, 5))


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _grads(comm: str, link: LinkClock | None) -> tuple[list[torch.Tensor], CommMeter]:
    ddp = DDP(_model())
    meter = CommMeter()
    ddp.register_comm_hook(HookState(1, comm, meter, link=link), chain_hook)
    torch.manual_seed(1)
    ddp(torch.randn(8, 60)).square().sum().backward()
    return [p.grad.clone() for p in ddp.parameters()], meter


@pytest.mark.usefixtures("one_rank_group")
def test_the_hook_charges_each_bucket_its_payloads_real_bytes() -> None:
    numel = sum(p.numel() for p in _model().parameters())  # one bucket (under 1 MiB)
    charged = {}
    for comm, per in (("allreduce", 4), ("fp16", 2)):
        plain, _ = _grads(comm, None)
        link = LinkClock(_spec(), 0)
        slowed, meter = _grads(comm, link)
        assert all(torch.equal(a, b) for a, b in zip(plain, slowed, strict=True))
        ms, nbytes = meter.take()
        assert nbytes == numel * per
        charged[comm] = link.take_ms()
        assert charged[comm] == _ms(allreduce_s(nbytes, 2, BW, LAT))
        assert ms >= charged[comm]  # the bucket's measured interval holds the delay
    # fp16: the bandwidth term halves, the two hops stay
    hops = _ms(2 * LAT * 1e-6)
    assert charged["fp16"] - hops == pytest.approx((charged["allreduce"] - hops) / 2,
                                                   abs=2e-3)


def _config(tmp_path: Path, link: LinkSpec | None, **kw: Any) -> TrainConfig:
    return TrainConfig(workload="digits_cnn", plan_path=str(tmp_path / "plan.json"),
                       rank_groups=["cpu", "cpu"], steps=4, out_dir=str(tmp_path), link=link,
                       **kw)


@pytest.mark.usefixtures("one_rank_group")
def test_ddp_charges_every_collective_of_a_step(tmp_path: Path) -> None:
    sync = make_sync(_config(tmp_path, _spec()), 2, torch.device("cpu"), emulated=False)
    assert isinstance(sync, DDPSync) and sync.link is not None
    model = sync.wrap(_model())
    model(torch.randn(8, 60)).square().sum().backward()
    stats = torch.zeros(4, dtype=torch.float64)
    sync.sum_stats(stats)
    sync.sync_buffers([model.module])
    grads = sum(p.numel() * 4 for p in model.parameters())
    bn = model.module[1]
    floats = (bn.running_mean.numel() + bn.running_var.numel()) * 4
    expect = (allreduce_s(grads, 2, BW, LAT) + allreduce_s(32, 2, BW, LAT)
              + broadcast_s(floats, 2, BW, LAT) + broadcast_s(8, 2, BW, LAT))
    info = sync.step_info(0)
    fields = link_fields(sync.link)
    assert fields == {"link": "emulated 0.01 GB/s, 1000 us", "link_ms": _ms(expect)}
    assert info["comm_ms"] >= fields["link_ms"]


@pytest.mark.usefixtures("one_rank_group")
def test_local_sgd_charges_its_averaging_and_statistics(tmp_path: Path) -> None:
    sync = make_sync(_config(tmp_path, _spec(), sync="local:2"), 2, torch.device("cpu"),
                     emulated=False)
    assert isinstance(sync, LocalSGDSync) and sync.link is not None
    model = _model()
    sync.attach([1.0], [torch.optim.SGD(model.parameters(), lr=0.1)])
    flat = 4 * (sum(p.numel() for p in model.parameters())
                + sum(b.numel() for b in model.buffers()))
    for step in range(2):
        sync.before_backward(step, [model])
        sync.sum_stats(torch.zeros(4, dtype=torch.float64))
        sync.after_step(step, [model], False)
        info = sync.step_info(step)
        ms = sync.link.take_ms()
        if step == 0:  # between syncs nothing crosses the link
            assert ms == 0.0 and not info["synced"]
        else:
            assert ms == _ms(allreduce_s(flat, 2, BW, LAT) + allreduce_s(32, 2, BW, LAT))
            assert info["synced"] and info["comm_ms"] >= ms


@pytest.mark.usefixtures("one_rank_group")
def test_without_a_link_nothing_is_charged(tmp_path: Path) -> None:
    sync = make_sync(_config(tmp_path, None), 2, torch.device("cpu"), emulated=False)
    assert sync.link is None and link_fields(sync.link) == {}
    model = sync.wrap(_model())
    assert sync.hook_state.link is None
    model(torch.randn(8, 60)).square().sum().backward()


@pytest.mark.usefixtures("one_rank_group")
def test_dlcp_unbiased_pays_its_counts_and_its_bucket(tmp_path: Path) -> None:
    config = _config(tmp_path, _spec(), comm="dlcp:p=0.05,stress,policy=unbiased")
    sync = make_sync(config, 2, torch.device("cpu"), emulated=False)
    assert isinstance(sync, DDPSync) and sync.link is not None
    model = sync.wrap(_model())
    sync.before_backward(0, [model])
    model(torch.randn(8, 60)).square().sum().backward()
    payload = sum(p.numel() * 4 for p in model.parameters())
    _, nbytes = sync.meter.take()
    counts = nbytes - payload  # the kept counts, all-reduced before the bucket
    assert counts > 0
    assert sync.link.take_ms() == _ms(allreduce_s(counts, 2, BW, LAT)
                                      + allreduce_s(payload, 2, BW, LAT))
