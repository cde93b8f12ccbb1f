"""benchmarks/bench_indicator.py's per-op refinement: seeds and held-out pieces go to the ops
whose standard error is over the goal, by what the error is made of (no models here: the
cells are drawn from known distributions)."""

from __future__ import annotations

import random
import statistics

import pytest
from helpers import load_benchmark

from qsync_opt.core.precision import Precision

B = load_benchmark("bench_indicator")

#: effect, rounding noise sd, per-piece sample sd: "loud" has a large sample part, "rough"
#: a large rounding part, the rest are quiet.
OPS = {"a": (0.0, 0.01, 0.01), "b": (1.0, 0.01, 0.01), "c": (2.0, 0.01, 0.01),
       "loud": (3.0, 0.01, 1.5), "rough": (4.0, 1.5, 0.01)}


def _measure(seed: int = 0):
    piece_effect: dict[tuple[str, int], float] = {}
    rng = random.Random(seed)

    def measure(op: str, s: int, first: int, last: int) -> list[float]:
        effect, sd_r, sd_b = OPS[op]
        out = []
        for b in range(first, last):  # a piece's sample deviation is the same for every seed
            dev = piece_effect.setdefault((op, b), rng.gauss(0.0, sd_b))
            out.append(effect + dev + rng.gauss(0.0, sd_r))
        return out

    return measure


def test_refine_reaches_the_goal_with_the_right_kind_of_sample() -> None:
    table = B.EffectTable(list(OPS), _measure(), max_pieces=None)
    for op in OPS:
        table.grow(op, 4, 8)
    uniform = table.evaluated
    stuck = B.refine(table, 0.1, log=lambda m: None)
    assert stuck == set()
    mean, se, spread, worst = table.stats()
    assert worst < 0.1
    assert all(e < 0.1 * spread for e in se)
    # the quiet ops kept their first sample; "loud" (its held-out sample) got pieces and no
    # seeds, since seeds cannot shrink that part; "rough" (per-cell rounding) got cells
    for op in ("a", "b", "c"):
        assert (table.seeds(op), table.pieces(op)) == (4, 8)
    assert table.pieces("loud") > 8
    assert table.seeds("rough") * table.pieces("rough") > 32
    # far fewer cells than giving every op the largest sample
    most = max(table.seeds(o) * table.pieces(o) for o in OPS)
    assert table.evaluated < len(OPS) * most
    assert table.evaluated > uniform
    # each op's table stays rectangular
    for op in OPS:
        assert {len(r) for r in table.cells[op]} == {table.pieces(op)}


def test_a_fixed_held_out_set_leaves_an_op_stuck_and_says_so() -> None:
    table = B.EffectTable(list(OPS), _measure(1), max_pieces=6)
    for op in OPS:
        table.grow(op, 4, 6)
    said: list[str] = []
    stuck = B.refine(table, 0.1, log=said.append)
    assert stuck == {"loud"}  # its sample part cannot shrink: no more pieces
    # ("rough"'s rounding shrinks with seeds on the same pieces)
    # called out of reach once enough seeds made the estimate of its sample part firm
    assert table.pieces("loud") == 6 and table.seeds("loud") >= B.STUCK_AFTER_SEEDS
    assert any("loud" in m and "held-out sample part" in m for m in said)
    assert all(table.pieces(op) == 6 for op in OPS)
    assert table.seeds("rough") > 4  # the rounding part still shrinks with seeds


def test_the_budget_and_the_seed_cap_stop_it() -> None:
    table = B.EffectTable(list(OPS), _measure(2), max_pieces=None)
    for op in OPS:
        table.grow(op, 4, 8)
    before = table.evaluated
    said: list[str] = []
    B.refine(table, 0.1, max_cells=10, log=said.append)
    assert table.evaluated == before  # the next round would have cost more than 10 cells
    assert any("budget" in m for m in said)
    fixed = B.EffectTable(list(OPS), _measure(2), max_pieces=6)
    for op in OPS:
        fixed.grow(op, 4, 6)
    stuck = B.refine(fixed, 0.1, max_seeds=6, log=lambda m: None)
    assert stuck == {"loud", "rough"}  # 6 seeds on 6 pieces cannot shrink rough's rounding
    assert fixed.seeds("rough") == 6  # grown to the cap, then called out of reach


def test_components_recover_the_variances() -> None:
    rng = random.Random(5)
    seed_dev = [rng.gauss(0, 2.0) for _ in range(200)]
    piece_dev = [rng.gauss(0, 3.0) for _ in range(150)]
    rows = [[seed_dev[s] + piece_dev[b] + rng.gauss(0, 1.0) for b in range(150)]
            for s in range(200)]
    v_seed, v_piece, v_cell = B.components(rows)
    # against the variances of the deviations drawn (the cells' noise averages out)
    assert abs(v_seed / statistics.variance(seed_dev) - 1) < 0.05
    assert abs(v_piece / statistics.variance(piece_dev) - 1) < 0.05
    assert abs(v_cell - 1.0) < 0.03
    # the reported standard error is the prediction at the table's own size
    table = B.EffectTable(["x"], None, max_pieces=None)
    table.cells["x"] = rows
    _, se, _, _ = table.stat("x")
    assert abs(B.predicted_se2((v_seed, v_piece, v_cell), 200, 150) - se ** 2) < 1e-9


def test_growing_pieces_keeps_the_first_cells() -> None:
    table = B.EffectTable(["a"], _measure(3), max_pieces=None)
    table.grow("a", 3, 4)
    first = [row[:] for row in table.cells["a"]]
    table.grow("a", 5, 10)
    assert [row[:4] for row in table.cells["a"][:3]] == first
    assert table.seeds("a") == 5 and table.pieces("a") == 10
    assert table.evaluated == 5 * 10


@pytest.mark.slow
def test_run_immediate_end_to_end_on_digits_cnn(monkeypatch) -> None:
    """The whole immediate-effect run on a briefly trained digits_cnn: per-op tables, the
    refinement within its budget, every indicator's correlation, the dump's fields."""
    monkeypatch.setitem(B.CONFIG, "digits_cnn", dict(B.CONFIG["digits_cnn"], pretrain=20))
    monkeypatch.setattr(B, "PREC", Precision.int4)
    out = B.run_immediate("digits_cnn", seeds=2, n_eval=6, budget_s=1.0)
    n = len(out["ops"])
    assert n == 4 and out["precision"] == "int4"
    assert len(out["seeds"]) == n and min(out["seeds"]) >= 2 and out["pieces"] == [6] * n
    assert out["n_cells"] >= 2 * 6 * n
    # the dump keeps every op's seeds x pieces table, whose means are the effects
    for i, op in enumerate(out["ops"]):
        rows = out["cells"][op]
        assert len(rows) == out["seeds"][i] and {len(r) for r in rows} == {6}
        assert abs(statistics.fmean(x for r in rows for x in r) - out["mean"][i]) < 1e-12
    assert len(out["plain"]) == 6
    assert len(out["mean"]) == len(out["se"]) == n and all(e > 0 for e in out["se"])
    assert set(out["rho"]) >= {"qsync", "curv", "hessian", "fisher", "random"}
    assert all(-1.0 <= r <= 1.0 for r in out["rho"].values())
