"""The pure rules of the sync modes: learning-rate schedules, sync-mode specs and QSR's round rule."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.strategy.modes import (
    COMM_KINDS,
    COMPATIBLE,
    CommMode,
    SyncMode,
    check_combination,
    parse_comm,
    parse_sync,
    qsr_period,
    round_length,
    rounds,
    sync_steps,
)
from qsync_opt.strategy.schedule import LRSchedule, parse_schedule

# ----------------------------------------------------------------------------- schedules


def test_constant_schedule_is_constant_after_warmup():
    s = parse_schedule("constant:warmup=4", 0.1, 20)
    assert [s.lr_at(i) for i in range(4)] == pytest.approx([0.025, 0.05, 0.075, 0.1])
    assert all(s.lr_at(i) == 0.1 for i in range(4, 20))


def test_cosine_schedule_ends_at_final_and_decreases():
    s = parse_schedule("cosine:warmup=5,final=0.1", 1.0, 106)
    assert s.lr_at(4) == pytest.approx(1.0)       # the warm-up's last step reaches lr
    assert s.lr_at(5) == pytest.approx(1.0)       # the cosine starts at lr
    assert s.lr_at(55) == pytest.approx(0.55)     # half way: the mean of lr and final
    assert s.lr_at(105) == pytest.approx(0.1)     # the last step: final * lr
    after = [s.lr_at(i) for i in range(5, 106)]
    assert all(a >= b for a, b in zip(after, after[1:], strict=False))


def test_step_schedule_decays_every_n():
    s = parse_schedule("step:every=10,gamma=0.5", 0.8, 40)
    assert [s.lr_at(i) for i in (0, 9, 10, 19, 20, 39)] == pytest.approx(
        [0.8, 0.8, 0.4, 0.4, 0.2, 0.1])


def test_schedule_describe_round_trips():
    for text in ("constant", "constant:warmup=3", "cosine:warmup=2,final=0.05",
                 "step:every=7,gamma=0.3,warmup=1"):
        s = parse_schedule(text, 0.1, 50)
        assert parse_schedule(s.describe(), 0.1, 50) == s


@pytest.mark.parametrize("text, needle", [
    ("linear", "expected constant"), ("cosine:warmup", "key=value"),
    ("cosine:warmup=1.5", "integer"), ("cosine:final=2", "final must be in [0, 1]"),
    ("step", "every=N"), ("cosine:warmup=50", "below the run's 50 steps"),
    ("cosine:warm=3", "takes warmup, final"), ("step:every=3,gamma=0", "gamma"),
    ("cosine:final=nan", "finite"), ("cosine:warmup=1,warmup=2", "twice"),
])
def test_bad_schedules_name_the_field(text, needle):
    with pytest.raises(QsyncInputError, match="lr_schedule") as e:
        parse_schedule(text, 0.1, 50)
    assert needle in str(e.value)


# ----------------------------------------------------------------------------- specs


def test_parse_sync_modes():
    assert parse_sync("ddp") == SyncMode()
    assert parse_sync("local:8") == SyncMode("local", 8)
    assert parse_sync("qsr:alpha=0.2,h_base=4") == SyncMode("qsr", 4, 0.2, 2.0)
    assert parse_sync(" QSR:h_base=2,alpha=0.1,power=3 ") == SyncMode("qsr", 2, 0.1, 3.0)
    for m in (SyncMode(), SyncMode("local", 3), SyncMode("qsr", 4, 0.25, 2.0),
              SyncMode("qsr", 4, 0.25, 1.5)):
        assert parse_sync(m.describe()) == m


@pytest.mark.parametrize("text", ["", "ddp:2", "local", "local:0", "local:2.5", "local:x",
                                  "qsr", "qsr:alpha=0.1", "qsr:h_base=2", "qsr:alpha=-1,h_base=2",
                                  "qsr:alpha=0.1,h_base=0", "qsr:alpha=0.1,h_base=2,power=0",
                                  "qsr:alpha=0.1,h_base=2,beta=1", "sgd"])
def test_bad_sync_specs_are_refused_in_one_line(text):
    with pytest.raises(QsyncInputError, match=r"^sync: ") as e:
        parse_sync(text)
    assert "\n" not in str(e.value)


def test_comm_and_the_combination_table():
    assert parse_comm("FP16") == CommMode("fp16")
    with pytest.raises(QsyncInputError, match="^comm: expected allreduce, fp16, dlcp.* or dlcp:p=P,stress"):
        parse_comm("topk")
    for (s, c), ok in COMPATIBLE.items():
        mode = parse_sync({"ddp": "ddp", "local": "local:2",
                           "qsr": "qsr:alpha=0.1,h_base=2"}[s])
        if ok:
            check_combination(mode, CommMode(c))
        else:
            with pytest.raises(QsyncInputError, match="--sync .* with --comm"):
                check_combination(mode, CommMode(c))


def test_the_cli_page_table_is_the_combination_table():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "CLI.md").read_text()
    lines = [x for x in text.splitlines() if x.startswith("| `--sync` \\ `--comm`")]
    assert len(lines) == 1
    rows = text.split(lines[0], 1)[1].splitlines()[2:5]
    heads = [c.strip().strip("`").split(":")[0] for c in lines[0].split("|")[2:-1]]
    assert heads == list(COMM_KINDS)
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        sync = cells[0].strip("`").split(":")[0]
        for comm, cell in zip(heads, cells[1:], strict=True):
            assert cell.startswith("yes") == COMPATIBLE[(sync, comm)], (sync, comm)


# ----------------------------------------------------------------------------- QSR's rule


def test_qsr_threshold_and_floor():
    assert qsr_period(0.1, 0.2, 2) == 4                # (0.2 / 0.1)^2 = 4
    assert qsr_period(0.02, 0.2, 2) == 100             # an exact square in floating point
    assert qsr_period(0.2, 0.2, 2) == 2                # below H0: H0
    assert qsr_period(0.1, 0.3, 1) == 9
    assert qsr_period(0.1, 0.25, 1) == 6               # floor(6.25)
    assert qsr_period(0.1, 0.2, 2, power=3) == 8
    assert qsr_period(0.1, 0.0, 5) == 5                # alpha 0: constant H0
    assert qsr_period(1e-300, 1.0, 2) == 1 << 40       # capped, never an overflow


def test_qsr_warmup_runs_at_h_base():
    sched = parse_schedule("cosine:warmup=10", 0.01, 200)
    mode = parse_sync("qsr:alpha=0.1,h_base=3")
    rs = rounds(mode, sched, 200)
    assert all(h == 3 for s, h in rs if s < 10)
    # step 9 still warms up (H0, the round reaching past the warm-up); step 12 reads lr ~0.01
    assert rs[:5] == [(0, 3), (3, 3), (6, 3), (9, 3), (12, 100)]


def test_rounds_cover_the_run_and_end_with_a_sync():
    sched = parse_schedule("cosine", 0.05, 97)
    for mode in (parse_sync("ddp"), parse_sync("local:10"), parse_sync("qsr:alpha=0.2,h_base=4")):
        rs = rounds(mode, sched, 97)
        assert rs[0][0] == 0
        assert all(a + h == b for (a, h), (b, _) in zip(rs, rs[1:], strict=False))
        assert rs[-1][0] + rs[-1][1] == 97
        assert sync_steps(mode, sched, 97)[-1] == 96
    assert sync_steps(parse_sync("local:10"), sched, 97)[-2:] == [89, 96]  # the cut last round
    assert len(rounds(parse_sync("ddp"), sched, 97)) == 97


def test_qsr_never_past_the_remaining_steps():
    sched = parse_schedule("constant", 1e-4, 50)
    mode = parse_sync("qsr:alpha=1,h_base=2")            # H = 10^8
    assert rounds(mode, sched, 50) == [(0, 50)]
    assert round_length(mode, sched, 30, 50) == 20
    assert round_length(mode, sched, 50, 50) == 0


def test_qsr_rounds_fewer_than_constant_h_base():
    sched = parse_schedule("cosine:warmup=5", 0.1, 300)
    qsr = len(rounds(parse_sync("qsr:alpha=0.2,h_base=2"), sched, 300))
    const = len(rounds(parse_sync("local:2"), sched, 300))
    assert qsr < const < 300


@settings(max_examples=200, deadline=None)
@given(lr=st.floats(1e-6, 10.0), shrink=st.floats(0.01, 1.0), alpha=st.floats(0.0, 5.0),
       h0=st.integers(1, 64), power=st.sampled_from([1.0, 2.0, 3.0]))
def test_qsr_monotone_in_decreasing_lr(lr, shrink, alpha, h0, power):
    """A smaller learning rate never gives a shorter round, and never one below H0."""
    hi = qsr_period(lr, alpha, h0, power)
    lo = qsr_period(lr * shrink, alpha, h0, power)
    assert h0 <= hi <= lo
    if alpha == 0:
        assert hi == lo == h0
    else:
        x = (alpha / lr) ** power
        assert hi == max(h0, math.floor(x)) or abs(x - round(x)) < 1e-6 * max(1.0, x)


def test_lr_schedule_rejects_bad_base():
    with pytest.raises(QsyncInputError, match="^lr: "):
        LRSchedule("constant", 0.0, 10)
