"""``--comm dlcp`` by default drops what the simulated network loses: the packet
simulator's lost chunks per rank (sync.netloss.dlcp_masks), cut per tensor to p, the same
on the emulated path and on two gloo ranks; fixed p is the explicit ``stress`` mode."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from qsync_opt import parse_shorthand, trace
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.job.rank import emulate
from qsync_opt.netsim.cluster import ddp_buckets, rank_cluster
from qsync_opt.problem.plan import make_plan
from qsync_opt.runtime.config import TrainConfig
from qsync_opt.runtime.faults import ENV, NO_FAULTS
from qsync_opt.strategy.droppolicy import ChunkTable, DropRecorder, clip_to_bound
from qsync_opt.strategy.modes import parse_comm
from qsync_opt.sync.replicas import net_masks
from support.harness import run_cli, run_params, run_rows

pytestmark = pytest.mark.usefixtures("runtime_quiet")

#: a congested network for two ranks: both push every bucket to one parameter server
#: through shallow (4 KiB) switch buffers
CONGESTED = "dlcp:p=0.1,scenario=incast,buffer_kib=4,chunk_kib=0.5,iterations=3"


# ----------------------------------------------------------------------------- the syntax


@pytest.mark.parametrize("bad, needle", [
    ("dlcp:p=nan", "p must be a finite number"), ("dlcp:p=2", "in [0, 0.5]"),
    ("dlcp:p=-1", "in [0, 0.5]"), ("dlcp:p=1e999", "finite number"),
    ("dlcp:p=٠.١", "ASCII digits"), ("dlcp:p=0.1,iterations=²", "ASCII digits"),
    ("dlcp:iterations=0", "iterations must be an integer in [1, 64]"),
    ("dlcp:iterations=100000000000", "[1, 64]"), ("dlcp:iterations=2.5", "integer"),
    ("dlcp:buffer_kib=0", "buffer_kib"), ("dlcp:buffer_kib=-3", "buffer_kib"),
    ("dlcp:colour=red", "'colour'"), ("dlcp:scenario=mesh", "scenario"),
    ("dlcp:stress", "stress mode needs p=P"), ("dlcp:p=0.1,stress,stress", "twice"),
    ("dlcp:p=0.1,stress,scenario=incast", "network mode"),
    ("dlcp:p=0.1,stress,iterations=3", "'iterations'"),
    ("dlcp:p=0.1,layer_bias=2", "'layer_bias'"), ("dlcp:scenario=ring,scenario=incast", "twice"),
    ("dlcp:p=0.1,stres", "key=value"),
])
def test_hostile_dlcp_texts_are_refused_in_one_line(bad: str, needle: str) -> None:
    with pytest.raises(QsyncInputError, match=re.escape(needle)) as exc:
        parse_comm(bad)
    assert "\n" not in str(exc.value)


def test_the_modes_parse_and_describe() -> None:
    net, stress = parse_comm("dlcp"), parse_comm("dlcp:p=0.1,stress")
    assert not net.stress and (net.p, net.scenario, net.iterations, net.buffer_kib) == (
        0.05, "ring", 4, 4096.0)
    assert stress.stress and stress.p == 0.1
    assert "stress" in stress.describe() and "scenario=ring" in net.describe()
    for m in (net, stress, parse_comm(CONGESTED)):
        assert parse_comm(m.describe()) == m


@pytest.mark.parametrize("comm", ["dlcp:p=nan", "dlcp:p=0.1,stress,iterations=2",
                                  "dlcp:iterations=٣", "dlcp:stress"])
def test_the_cli_refuses_them_in_one_line(tmp_path: Path, comm: str) -> None:
    code, _, err = run_cli("train", "--model", "digits_cnn", "--nproc", "2", "--steps", "2",
                           "--comm", comm, "--out", str(tmp_path / "o"))
    assert code == 2 and err.count("\n") == 1 and "--comm" in err, err


# ----------------------------------------------------------------------------- the pieces


def test_clip_keeps_each_tensor_within_its_bound_in_chunk_order() -> None:
    table = ChunkTable.build([10, 4, 7], 2)  # chunks: 2,2,2,2,2 | 2,2 | 2,2,2,1
    everything = torch.ones(table.n_chunks, dtype=torch.bool)
    got = clip_to_bound(table, everything, 0.45)
    # budgets floor(0.45 n): 4, 1, 3 -> two chunks, none, one chunk (the next does not fit)
    assert got.tolist() == [True, True, False, False, False, False, False,
                            True, False, False, False]
    assert not clip_to_bound(table, everything, 0.0).any()
    some = torch.zeros(table.n_chunks, dtype=torch.bool)
    some[[2, 10]] = True
    assert clip_to_bound(table, some, 0.5).tolist() == some.tolist()  # within the bound


def test_ddp_buckets_and_the_ranks_cluster() -> None:
    numels = [300_000, 10, 100_000, 5, 7_000_000, 3]
    bs = ddp_buckets(numels)
    names = [int(n) for b in bs for n, _, _ in b.layers]
    assert names == list(range(len(numels) - 1, -1, -1))  # every parameter once, last first
    assert bs[0].bytes >= 1 << 20 and all(b.bytes >= 1 for b in bs)
    cl = parse_shorthand("v100x4+t4x4")
    sub, device = rank_cluster(cl, ["t4", "v100", "t4"])
    assert [(g.name, g.count) for g in sub.groups] == [("v100", 1), ("t4", 2)]
    assert device == [1, 0, 2]
    with pytest.raises(QsyncInputError, match="no group 'a100'"):
        rank_cluster(cl, ["a100"])


def test_a_network_that_loses_nothing_drops_nothing() -> None:
    cl = parse_shorthand("cpux1@36+cpux1@12")
    table = ChunkTable.build([288, 32, 18432, 64, 73728, 128, 1280, 10], 128)
    for comm in ("dlcp", "dlcp:p=0.5,scenario=incast", "dlcp:scenario=oversubscribed"):
        masks = net_masks(table, parse_comm(comm), 0, cl, ["cpu", "cpu_2"])
        assert len(masks) == parse_comm(comm).iterations and all(len(m) == 2 for m in masks)
        assert not any(bool(m.any()) for it in masks for m in it), comm
        rec = DropRecorder(parse_comm(comm), [f"l{i}" for i in range(8)], table.numels, 0,
                           masks)
        assert not rec.active


def test_a_congested_network_drops_deterministically_within_the_bound() -> None:
    cl = parse_shorthand("cpux1@36+cpux1@12")
    mode = parse_comm(CONGESTED)
    table = ChunkTable.build([288, 32, 18432, 64, 73728, 128, 1280, 10], mode.chunk_elems)
    a = net_masks(table, mode, 7, cl, ["cpu", "cpu_2"])
    b = net_masks(table, mode, 7, cl, ["cpu", "cpu_2"])
    assert all(torch.equal(x, y) for p, q in zip(a, b, strict=True)
               for x, y in zip(p, q, strict=True))
    assert any(bool(m.any()) for it in a for m in it), "the case must lose packets"
    rec = DropRecorder(mode, [f"l{i}" for i in range(8)], table.numels, 7, a)
    for step in range(5):
        for rank in (0, 1):
            grads = [torch.ones(k) for k in table.numels]
            d = rec.drop(grads, step, rank)
            assert torch.equal(d, clip_to_bound(table, a[step % 3][rank], mode.p))
            assert all(int((g == 0).sum()) <= math.floor(mode.p * g.numel()) for g in grads)
        stats = rec.take()
        assert all(s["dlcp_mode"] == "network" and s["dropped_max_tensor"] <= mode.p
                   for s in stats.values())


# ----------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plans") / "uneven.json"
    make_plan(trace("digits_cnn"), parse_shorthand("cpux1@36+cpux1@12"), {}).save(path)
    return path


def _config(plan: Path, out: Path, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(workload="digits_cnn", plan_path=str(plan),
                                rank_groups=["cpu", "cpu_2"], steps=4, out_dir=str(out),
                                emulate_dp=True, eval_batches=0, lr=0.05, momentum=0.9)
    base.update(kw)
    return TrainConfig(**base)


def _expected(plan: Path, params: dict[str, torch.Tensor], comm: str, seed: int,
              step: int, rank: int) -> float:
    """The fraction of the gradient the simulated network drops for ``rank`` at ``step``
    (its buckets leaving at the replayed backward's times, as the run's)."""
    from qsync_opt.runtime.prepare import prepare

    mode = parse_comm(comm)
    table = ChunkTable.build([p.numel() for p in params.values()], mode.chunk_elems)
    setup = prepare(_config(plan, plan.parent / "unused", comm=comm, seed=seed))
    masks = net_masks(table, mode, seed, setup.plan.cluster, ["cpu", "cpu_2"], setup,
                      names=list(params))
    m = clip_to_bound(table, masks[step % len(masks)][rank], mode.p)
    return int(table.sizes[m].sum()) / table.total


def test_default_dlcp_on_a_quiet_network_is_the_plain_all_reduce(plan: Path,
                                                                 tmp_path: Path) -> None:
    emulate(_config(plan, tmp_path / "a"), faults=NO_FAULTS)
    emulate(_config(plan, tmp_path / "d", comm="dlcp"), faults=NO_FAULTS)
    pa, pd = run_params(tmp_path / "a", 0, True), run_params(tmp_path / "d", 0, True)
    assert all(torch.equal(pa[k], pd[k]) for k in pa)
    rows = run_rows(tmp_path / "d", 0) + run_rows(tmp_path / "d", 1)
    assert {r["dropped_frac"] for r in rows} == {0.0}


@pytest.mark.slow
def test_emulated_drops_are_the_simulators(plan: Path, tmp_path: Path) -> None:
    out = tmp_path / "c"
    emulate(_config(plan, out, comm=CONGESTED, seed=3), faults=NO_FAULTS)
    params = run_params(out, 0)
    dropped = []
    for r in (0, 1):
        for s, row in enumerate(run_rows(out, r)):
            assert row["dlcp_mode"] == "network" and row["dropped_max_tensor"] <= 0.1
            assert row["dropped_frac"] == pytest.approx(
                _expected(plan, params, CONGESTED, 3, s, r), abs=1e-12)
            dropped.append(row["dropped_frac"])
    assert max(dropped) > 0


def test_dlcp_buckets_leave_at_their_backward_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """The network mode's buckets are emitted as the backward produces them (the replayer's
    timeline of the plan, per group), not all at once: the first DDP bucket (the last
    layers) is ready first, each later one no earlier, the slower group's later, and the
    last at about the end of the group's backward. dlcp_masks simulates exactly those."""
    from qsync_opt.models import get_workload

    from qsync_opt.netsim import cluster as nc
    from qsync_opt.replayer import Replayer
    from qsync_opt.sync import netloss

    graph = trace("resnet18")
    named = list(get_workload("resnet18").build().named_parameters())
    names, numels = [n for n, _ in named], [p.numel() for _, p in named]
    cl = parse_shorthand("v100x1+t4x1").with_default_batch(graph.batch_size)
    buckets = ddp_buckets(numels)
    assert len(buckets) >= 2
    ready = nc.param_bucket_ready_ms(graph, cl, names, buckets)
    tl = Replayer(graph, cl, nc._estimate(graph, cl)).simulate(
        Replayer(graph, cl, nc._estimate(graph, cl)).uniform("highest"), events=False)
    for g, row in zip(cl.groups, ready, strict=True):
        gt = tl.groups[g.name]
        assert gt.forward_ms < row[0] < row[-1] and row == sorted(row)
        assert row[-1] == pytest.approx(gt.forward_ms + gt.backward_ms, rel=0.02)
    assert all(t4 > v100 for v100, t4 in zip(*ready, strict=True))
    seen: list[Any] = []
    real = netloss.run_iterations

    def spy(net: Any, bs: Any, group_ready: Any, *a: Any, **kw: Any) -> Any:
        seen.append(group_ready)
        return real(net, bs, group_ready, *a, **kw)
    monkeypatch.setattr(netloss, "run_iterations", spy)
    mode = parse_comm("dlcp:iterations=1,chunk_kib=256")
    table = ChunkTable.build(numels, mode.chunk_elems)
    cfg = nc.NetConfig(policy="priority+bounded", cell_bytes=256 << 10)
    netloss.dlcp_masks(table, cl, ["v100", "t4"], scenario="ring", cfg=cfg, iterations=1,
                       seed=0, graph=graph, names=names)
    netloss.dlcp_masks(table, cl, ["v100", "t4"], scenario="ring", cfg=cfg, iterations=1, seed=0)
    assert seen == [ready, [[0.0] * len(buckets)] * 2]
    with pytest.raises(ValueError, match="names"):
        netloss.dlcp_masks(table, cl, ["v100", "t4"], scenario="ring", cfg=cfg, iterations=1,
                           seed=0, graph=graph, names=names[:-1])


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_gloo_ranks_drop_what_the_emulation_drops(plan: Path, tmp_path: Path) -> None:
    """The DDP hook, in DDP's own buckets, drops the chunks the emulated path drops: the
    same simulated network's losses per rank and step."""
    out = tmp_path / "g"
    cmd = [sys.executable, "-m", "qsync_opt.cli", "train", "--model", "digits_cnn",
           "--plan", str(plan), "--nproc", "2", "--rank-groups", "0:cpu,1:cpu_2",
           "--out", str(out), "--backend", "gloo", "--timeout", "300", "--steps", "4",
           "--lr", "0.05", "--seed", "3", "--comm", CONGESTED]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for var in ENV.values():
        env.pop(var, None)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    emu = tmp_path / "e"
    emulate(_config(plan, emu, comm=CONGESTED, seed=3), faults=NO_FAULTS)
    for r in (0, 1):
        g, e = run_rows(out, r), run_rows(emu, r)
        assert [x["dropped_by_layer"] for x in g] == [x["dropped_by_layer"] for x in e]
        assert [x["dropped_frac"] for x in g] == [x["dropped_frac"] for x in e]
        assert all(x["dlcp_mode"] == "network" for x in g)
    assert any(x["dropped_frac"] > 0 for x in run_rows(out, 0) + run_rows(out, 1))


def test_a_network_too_large_for_the_simulator_is_refused_in_one_line(tmp_path: Path) -> None:
    """Chunks are the simulated cells: 4-byte chunks of digits_cnn's incast pass the event
    cap, refused naming chunk_kib= and a size that fits (not a traceback from the ranks)."""
    code, _, err = run_cli("train", "--model", "digits_cnn", "--nproc", "2", "--steps", "1",
                           "--emulate-dp", "--comm", "dlcp:scenario=incast,chunk_kib=0.00390625",
                           "--out", str(tmp_path / "o"), "--progress-every", "0")
    assert code == 2 and err.count("\n") == 1, err
    assert "dlcp's network" in err and "use chunk_kib=0.0078125 or more" in err, err
