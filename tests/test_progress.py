"""qsync_opt.progress: a bar only once its step has run its delay, only when enabled."""

from __future__ import annotations

import io

from qsync_opt.progress import Progress


def test_disabled_bar_writes_nothing():
    out = io.StringIO()
    with Progress("x", total=3, enabled=False, delay_s=0, stream=out) as bar:
        for _ in range(3):
            bar.advance()
    assert out.getvalue() == ""


def test_short_step_writes_nothing():
    out = io.StringIO()
    with Progress("x", total=3, enabled=True, delay_s=3600, stream=out) as bar:
        bar.advance()
    assert out.getvalue() == ""


def test_bar_draws_counts_and_ends_its_line():
    out = io.StringIO()
    with Progress("joint split", total=4, enabled=True, delay_s=0, stream=out) as bar:
        bar.update(2, note="1 solved")
        bar.update(4)
    text = out.getvalue()
    assert text.startswith("\rjoint split: [")
    assert "2/4" in text and "4/4" in text and "1 solved" in text
    assert text.endswith("\n") and text.count("\n") == 1


def test_count_without_total():
    bar = Progress("scan", enabled=True, delay_s=0, stream=io.StringIO())
    bar.update(7)
    assert bar.line().startswith("scan: 7 ")
