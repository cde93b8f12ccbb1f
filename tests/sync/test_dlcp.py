"""Bounded-loss priority gradient communication: the one drop policy, the
emulated data-parallel path and the DDP hook chain on two gloo ranks."""

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
from hypothesis import given, settings
from hypothesis import strategies as st

from qsync_opt import parse_shorthand, trace
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.job.rank import emulate
from qsync_opt.problem.plan import make_plan
from qsync_opt.runtime.config import TrainConfig
from qsync_opt.runtime.faults import ENV, NO_FAULTS
from qsync_opt.strategy.droppolicy import (
    ChunkTable,
    DropRecorder,
    apply_drops,
    choose_drops,
    drop_generator,
    kept_counts,
    rescale,
)
from qsync_opt.strategy.modes import check_combination, parse_comm, parse_sync
from support.harness import run_cli, run_params, run_rows

# ----------------------------------------------------------------------------- the policy


def test_parse_and_describe() -> None:
    m = parse_comm("DLCP:p=0.05")
    assert (m.kind, m.p, m.policy, m.chunk_kib, m.chunk_elems) == ("dlcp", 0.05, "priority",
                                                                  64.0, 16384)
    assert not m.stress and (m.scenario, m.iterations) == ("ring", 4)
    for text in ("dlcp:p=0.1,stress,policy=unbiased,chunk_kib=4,layer_bias=0",
                 "dlcp:p=0.05,policy=random,chunk_kib=4,scenario=incast,iterations=2,"
                 "buffer_kib=16"):
        assert parse_comm(text).describe() == text and \
            parse_comm(parse_comm(text).describe()) == parse_comm(text)
    assert parse_comm("dlcp") == parse_comm("dlcp:p=0.05")  # from the network, p's default
    assert parse_comm("dlcp:stress,p=0.1").stress
    for bad, needle in (("dlcp:stress", "needs p=P"), ("dlcp:p=0.6", "in [0, 0.5]"),
                        ("dlcp:p=-0.1", "in [0, 0.5]"), ("dlcp:p=0.1,policy=best", "policy"),
                        ("dlcp:p=0.1,chunk_kib=0", "chunk_kib"), ("dlcp:p=x", "number"),
                        ("dlcp:p=0.1,stress,layer_bias=-1", "layer_bias"), ("fp16:p=1", "expected"),
                        ("dlcp:p=0.1,policy=random,policy=priority", "twice")):
        with pytest.raises(QsyncInputError, match=re.escape(needle)):
            parse_comm(bad)
    check_combination(parse_sync("ddp"), parse_comm("dlcp:p=0.1"))
    for sync in ("local:4", "qsr:alpha=0.1,h_base=2"):
        with pytest.raises(QsyncInputError, match="gradient transport"):
            check_combination(parse_sync(sync), parse_comm("dlcp:p=0.1"))


def _grads(numels: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(k, generator=g) * (1 + i) for i, k in enumerate(numels)]


@settings(max_examples=150, deadline=None)
@given(numels=st.lists(st.integers(1, 300), min_size=1, max_size=8),
       chunk=st.integers(1, 64), p=st.floats(0, 0.99),
       policy=st.sampled_from(["priority", "random", "unbiased"]), seed=st.integers(0, 99),
       cuts=st.lists(st.integers(0, 8), max_size=4))
def test_no_tensor_and_no_bucket_loses_more_than_p(numels: list[int], chunk: int, p: float,
                                                   policy: str, seed: int,
                                                   cuts: list[int]) -> None:
    """The bound is per tensor (DLCP bounds each message): every tensor, so every bucket of
    whole tensors however cut, loses at most floor(p n) of its n elements; no tensor is
    wiped; within a tensor less than one chunk of its budget is left unused."""
    table = ChunkTable.build(numels, chunk)
    assert int(table.sizes.sum()) == sum(numels) and table.n_chunks == sum(
        math.ceil(k / chunk) for k in numels)
    grads = _grads(numels, seed)
    before = [g.clone() for g in grads]
    dropped = choose_drops(grads, table, p, policy, drop_generator(seed, 3, 1))
    per = apply_drops(grads, table, dropped)
    assert sum(per) == int(table.sizes[dropped].sum())
    for k, n, (a, b) in zip(per, numels, zip(table.first, table.first[1:], strict=False),
                            strict=True):
        assert k <= math.floor(p * n) and k < n
        kept = ~dropped[a:b]
        assert k + chunk > math.floor(p * n) or not kept.any()
    edges = sorted({0, len(numels), *[min(c, len(numels)) for c in cuts]})
    for lo, hi in zip(edges, edges[1:], strict=False):  # any bucketing of whole tensors
        assert sum(per[lo:hi]) <= p * sum(numels[lo:hi]) + 1e-9
    for i, (a, b) in enumerate(zip(before, grads, strict=True)):
        mask = table.element_mask(i, dropped)
        assert torch.equal(b[mask], torch.zeros_like(b[mask]))
        assert torch.equal(b[~mask], a[~mask])  # what is kept is untouched


@settings(max_examples=80, deadline=None)
@given(layers=st.integers(1, 6), per=st.integers(1, 6), chunk=st.integers(1, 16),
       p=st.floats(0.01, 0.9), seed=st.integers(0, 99))
def test_priority_drops_in_magnitude_order_within_each_tensor(layers: int, per: int,
                                                              chunk: int, p: float,
                                                              seed: int) -> None:
    """Equal chunks: within each tensor every dropped chunk is of at most the rms of every
    kept one, and each tensor drops its whole budget's worth of chunks."""
    numels = [per * chunk] * layers
    table = ChunkTable.build(numels, chunk)
    grads = _grads(numels, seed)
    dropped = choose_drops(grads, table, p, "priority")
    for i, g in enumerate(grads):
        a, b = table.first[i], table.first[i + 1]
        rms = g.view(-1, chunk).double().pow(2).mean(1).sqrt()
        d = dropped[a:b]
        assert int(d.sum()) == math.floor(p * numels[i]) // chunk
        if d.any() and (~d).any():
            assert float(rms[d].max()) <= float(rms[~d].min())


def test_a_small_layer_is_never_wiped() -> None:
    """The bound is per tensor: over the whole gradient, p=0.5 would drop bn2 entirely (its
    chunks score least). Per tensor, each keeps at least half of itself."""
    numels = [4096, 64, 64, 4096]  # conv, bn2.weight, bn2.bias, fc
    table = ChunkTable.build(numels, 16)
    grads = [torch.ones(4096), torch.full((64,), 1e-6), torch.full((64,), 1e-6),
             torch.ones(4096)]
    for policy in ("priority", "random", "unbiased"):
        d = choose_drops(grads, table, 0.5, policy, drop_generator(0, 0, 0))
        per = apply_drops([g.clone() for g in grads], table, d)
        assert per == [2048, 32, 32, 2048], policy


def test_random_drops_do_not_favour_short_chunks() -> None:
    """Over many draws, the random policy drops each chunk of a tensor about equally often,
    its short last chunk included."""
    table = ChunkTable.build([64 + 5], 16)
    grads = [torch.ones(69)]
    counts = torch.zeros(table.n_chunks)
    for step in range(400):
        counts += choose_drops(grads, table, 0.3, "random", drop_generator(1, step, 0)).float()
    short = counts[table.sizes < 16] / 400
    long = counts[table.sizes == 16] / 400
    assert float(short.mean()) < float(long.mean()) + 0.1


def test_decisions_do_not_depend_on_the_bucket() -> None:
    """A tensor's drops are the same whether it comes alone (one DDP bucket) or with every
    other (the emulated path): the draws are per (seed, step, rank, parameter)."""
    mode = parse_comm("dlcp:p=0.3,stress,policy=random,chunk_kib=0.0078125")  # chunks of 2
    numels = [10, 6, 8]
    whole = DropRecorder(mode, ["a.w", "b.w", "c.w"], numels, seed=4)
    parts = DropRecorder(mode, ["a.w", "b.w", "c.w"], numels, seed=4)
    g1 = [torch.arange(1.0, k + 1) for k in numels]
    g2 = [g.clone() for g in g1]
    d1 = whole.drop(g1, step=2, rank=1)
    d2 = parts.drop([g2[2]], 2, 1, [2]) | parts.drop([g2[0], g2[1]], 2, 1, [0, 1])
    assert torch.equal(d1, d2) and all(torch.equal(a, b) for a, b in zip(g1, g2, strict=True))
    assert whole.take() == parts.take()


def test_front_layers_are_kept_and_small_chunks_go_first() -> None:
    # within a tensor, the chunks of least magnitude go first
    table = ChunkTable.build([8, 8], 4)
    grads = [torch.ones(8), torch.ones(8)]
    grads[1][4:] = 0.01
    d = choose_drops(grads, table, 0.5, "priority")
    assert d.tolist() == [True, False, False, True]  # ties: the tensor's order
    # random: seeded per (seed, step, rank), the same again, another for another rank
    g1 = choose_drops(grads, table, 0.5, "random", drop_generator(0, 5, 0))
    assert torch.equal(g1, choose_drops(grads, table, 0.5, "random", drop_generator(0, 5, 0)))
    others = [choose_drops(grads, table, 0.5, "random", drop_generator(0, 5, r)) for r in
              range(1, 6)]
    assert any(not torch.equal(g1, o) for o in others)
    with pytest.raises(ValueError, match="p"):
        choose_drops(grads, table, 1.0, "random")


def test_unbiased_rescale_is_the_mean_of_what_arrived() -> None:
    """Two ranks, chunks of 2: chunk 0 dropped by rank 0, chunk 1 by both, chunk 2 by none."""
    table = ChunkTable.build([6], 2)
    a, b = torch.tensor([1., 2., 3., 4., 5., 6.]), torch.tensor([10., 20., 30., 40., 50., 60.])
    da, db = torch.tensor([True, True, False]), torch.tensor([False, True, False])
    apply_drops([a], table, da)
    apply_drops([b], table, db)
    total = a + b
    rescale([total], table, kept_counts(table, da) + kept_counts(table, db))
    assert total.tolist() == [10., 20., 0., 0., 27.5, 33.]


def test_a_mask_handed_in_from_outside() -> None:
    """The simulator's lost packets come as a chunk mask: apply_drops takes any mask, and
    the recorder's statistics name the layers that lost them."""
    rec = DropRecorder(parse_comm("dlcp:p=0.5,stress,chunk_kib=0.0078125"), ["a.w", "a.b", "c.w"],
                       [4, 2, 6], seed=0)  # chunks of 2 elements
    assert rec.table.n_chunks == 6
    grads = [torch.ones(4), torch.ones(2), torch.ones(6)]
    mask = torch.tensor([False, True, True, False, False, True])
    assert apply_drops(grads, rec.table, mask) == [2, 2, 2]
    assert grads[0].tolist() == [1, 1, 0, 0] and grads[2].tolist() == [1] * 4 + [0, 0]
    d = rec.drop([torch.ones(4), torch.ones(2), torch.ones(6)], step=0, rank=1)
    stats = rec.take()[1]
    assert stats["dropped_frac"] == pytest.approx(int(d.sum()) * 2 / 12) and \
        stats["dropped_frac"] <= 0.5 and stats["dropped_max_tensor"] <= 0.5
    assert set(stats["dropped_by_layer"]) <= {"a", "c"}


# ----------------------------------------------------------------------------- emulation


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plans") / "uneven.json"
    make_plan(trace("digits_cnn"), parse_shorthand("cpux1@36+cpux1@12"), {}).save(path)
    return path


pytestmark = pytest.mark.usefixtures("runtime_quiet")


def _config(plan: Path, out: Path, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(workload="digits_cnn", plan_path=str(plan),
                                rank_groups=["cpu", "cpu_2"], steps=5, out_dir=str(out),
                                emulate_dp=True, eval_batches=0, lr=0.05, momentum=0.9)
    base.update(kw)
    return TrainConfig(**base)


def test_emulated_p0_is_the_plain_all_reduce_bit_for_bit(plan: Path, tmp_path: Path) -> None:
    emulate(_config(plan, tmp_path / "a"), faults=NO_FAULTS)
    for policy in ("priority", "unbiased"):
        out = tmp_path / policy
        emulate(_config(plan, out, comm=f"dlcp:p=0,stress,policy={policy}"), faults=NO_FAULTS)
        pa, pb = run_params(tmp_path / "a", 0, True), run_params(out, 0, True)
        assert all(torch.equal(pa[k], pb[k]) for k in pa), policy
        assert {r["dropped_frac"] for r in run_rows(out, 1)} == {0.0}


@pytest.mark.parametrize("policy", ["priority", "random", "unbiased"])
def test_emulated_drops_keep_replicas_identical(plan: Path, tmp_path: Path, policy: str) -> None:
    out = tmp_path / policy
    emulate(_config(plan, out, comm=f"dlcp:p=0.2,stress,policy={policy},chunk_kib=0.5"),
            faults=NO_FAULTS)
    p0, p1 = run_params(out, 0), run_params(out, 1)
    assert all(torch.equal(p0[k], p1[k]) for k in p0)
    ref = tmp_path / "ref"
    emulate(_config(plan, ref), faults=NO_FAULTS)
    pr = run_params(ref, 0)
    assert any(not torch.equal(p0[k], pr[k]) for k in p0)  # the drops changed the run
    for r in (0, 1):
        rows = run_rows(out, r)
        assert all(0.19 < x["dropped_frac"] <= 0.2 for x in rows)
        # per tensor, so per layer and per bucket: at most p (no layer is wiped)
        assert all(0 < f <= 0.2 for x in rows for f in x["dropped_by_layer"].values())
        assert all(x["dropped_max_tensor"] <= 0.2 for x in rows)
        extra = 4 * sum(math.ceil(p.numel() / 128) for k, p in p0.items()
                        if "running" not in k and "num_batches" not in k)
        base = run_rows(ref, r)[0]["bytes_sent"]
        assert rows[0]["bytes_sent"] == base + (extra if policy == "unbiased" else 0)


# ----------------------------------------------------------------------------- two gloo ranks

REPO = Path(__file__).resolve().parents[2]


def _gloo(plan: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "qsync_opt.cli", "train", "--model", "digits_cnn",
           "--plan", str(plan), "--nproc", "2", "--rank-groups", "0:cpu,1:cpu_2",
           "--out", str(out), "--backend", "gloo", "--timeout", "300", "--steps", "5",
           "--lr", "0.05", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), QSYNC_LOG_STATE_HASH="1")
    for var in ENV.values():
        env.pop(var, None)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_two_gloo_ranks_p0_bit_identical_and_drops_match_emulation(plan: Path,
                                                                    tmp_path: Path) -> None:
    """p = 0: the DDP hook chain's dlcp stage leaves the all-reduce bit for bit; p = 0.2:
    the replicas stay identical every step, each rank drops what the emulation drops at the
    first step (same gradients), and the runs agree within 1e-5."""
    runs = {}
    for name, comm in (("plain", "allreduce"), ("p0", "dlcp:p=0,stress"),
                       ("p20", "dlcp:p=0.2,stress,policy=unbiased,chunk_kib=0.5")):
        out = tmp_path / name
        res = _gloo(plan, out, "--comm", comm)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        runs[name] = out
    pa, pb = run_params(runs["plain"], 0, True), run_params(runs["p0"], 0, True)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    r0, r1 = run_rows(runs["p20"], 0), run_rows(runs["p20"], 1)
    assert all(a["state_sha256"] == b["state_sha256"] for a, b in zip(r0, r1, strict=True))
    emu = tmp_path / "emu"
    emulate(_config(plan, emu, comm="dlcp:p=0.2,stress,policy=unbiased,chunk_kib=0.5",
                    momentum=0.9),
            faults=NO_FAULTS)
    for r, rows in ((0, r0), (1, r1)):
        e = run_rows(emu, r)
        assert [x["dropped_by_layer"] for x in rows] == [x["dropped_by_layer"] for x in e]
        # DDP's own buckets, each tensor (so each bucket) at most p
        assert all(x["dropped_max_tensor"] <= 0.2 for x in rows)
    pg, pe = run_params(runs["p20"], 0), run_params(emu, 0)
    for k in pg:
        torch.testing.assert_close(pg[k], pe[k], rtol=1e-5, atol=1e-5, msg=k)


def test_the_cli_refuses_dlcp_with_local_sgd(tmp_path: Path) -> None:
    code, _, err = run_cli("train", "--model", "digits_cnn", "--nproc", "2", "--steps", "2",
                           "--sync", "local:4", "--comm", "dlcp:p=0.1", "--out",
                           str(tmp_path / "o"))
    assert code == 2 and err.count("\n") == 1 and "--comm dlcp" in err, err
    code, _, err = run_cli("train", "--model", "digits_cnn", "--nproc", "2", "--steps", "2",
                           "--comm", "dlcp:p=0.7", "--out", str(tmp_path / "o"))
    assert code == 2 and err.count("\n") == 1 and "--comm" in err, err
