"""A run's story read back from its folder (qsync_opt.runtime.story) and told
(qsync_opt.runtime.storyview): the figures of a leave-and-return run with a crash and a
re-plan exactly; an ordinary run's folder without events; events without metrics; the lines
a reader must survive (torn, foreign, NaN, huge, unicode digits) counted, never fatal; links
planted in the folder or at the figure's path refused."""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.limits import MAX_STEPS
from qsync_opt.runtime.events import EVENTS_NAME, EventLog
from qsync_opt.runtime.story import read_story
from qsync_opt.runtime.storyview import story_figure, story_lines, story_summary
from support.run_story import LEAVE_AND_RETURN_FIGURES, leave_and_return, write_rows

#: What ``report --run`` prints of support.run_story.leave_and_return (the run's path: RUN).
LEAVE_AND_RETURN_LINES = """\
run RUN: steps 0..49; 3 period(s), 2 membership change(s), 1 re-plan(s); 116 metrics row(s) in 3 rank file(s)
periods (one membership each)
  steps 0..19         start      world 3   groups v100, t4; predicted 100.0 ms/step
                      plan: the launch plan
  steps 20..39        membership world 1   groups v100; predicted 80.0 ms/step; solved in 0.004 s
                      plan: groups gone: t4; planned over v100; global batch 256 kept
  steps 40..49        membership world 3   groups t4, v100; predicted 100.0 ms/step
                      plan: the launch plan
plan changes
  step 20     membership v100, t4 -> v100 (a peer died: its collective failed); predicted 100.0 -> 80.0 ms/step; lost 3 step(s); change to first step 4.25 s
  step 35     re-plan    v100 x1.50 (v100 1.50x slower than predicted for 5 steps); predicted 80.0 -> 120.0 ms/step; solve 0.012 s
                      plan: v100: 12 ops fp32 -> fp16
  step 40     membership v100 -> v100, t4 (return of t4); predicted 120.0 -> 100.0 ms/step; lost 0 step(s); change to first step 2.50 s
slowdowns (injected)
  step 30     v100: stretch 1.00 -> 1.50
predicted vs measured, ms (medians; ratio: measured/predicted, the whole step's slowest rank, a group's compute)
  steps           group        predicted   compute      step  ratio
  0..19           (step)           100.0         -     100.0   1.00
                  v100              90.0      89.0     100.0   0.99
                  t4                95.0      97.0     100.0   1.02
  20..34          (step)            80.0         -      81.0   1.01
                  v100              80.0      81.0      81.0   1.01
  35..39          (step)           120.0         -     119.0   0.99
                  v100             118.0     119.0     119.0   1.01
  40..49          (step)           100.0         -     100.0   1.00
                  t4                95.0      95.0     100.0   1.00
                  v100              90.0      91.0     100.0   1.01
checkpoints: 5 at step(s) 10, 20, 30, 40, 50; newest ckpt/step-00000050
steps lost: 3 (3 at the change of step 20); 0 beyond the last checkpoint (step 50)
stopped at step 50: done; checkpoint ckpt/step-00000050
left out: 6 metrics row(s) outside their step's world (steps trained again, or a rank that left)"""


def _lines(run: Path) -> str:
    return "\n".join(story_lines(read_story(run))).replace(str(run), "RUN")


def test_leave_and_return_figures_exactly(tmp_path):
    story = read_story(leave_and_return(tmp_path / "run"))
    assert [(p.first, p.last, p.groups, p.world_size, p.cause) for p in story.periods] == [
        (0, 19, ("v100", "t4"), 3, "start"), (20, 39, ("v100",), 1, "membership"),
        (40, 49, ("t4", "v100"), 3, "membership")]
    assert [(p.steps_text(), p.predicted_step_ms, p.cause) for p in story.phases] == [
        ("0..19", 100.0, "start"), ("20..34", 80.0, "membership"), ("35..39", 120.0, "replan"),
        ("40..49", 100.0, "membership")]
    got = {(story.phases[f.phase].steps_text(), f.group): (f.predicted_ms, f.compute_ms,
                                                           f.step_ms)
           for f in story.figures}
    assert got == LEAVE_AND_RETURN_FIGURES
    assert story.phase_step_ms == [100.0, 81.0, 119.0, 100.0]
    # 20 rows of v100 and 40 of t4 before step 20, 15 + 5 of v100 alone, 30 after the return
    assert [f.rows for f in story.figures] == [20, 40, 15, 5, 20, 10]
    assert story.lost_steps == 3 and story.stale_rows == 6 and story.rows == 116
    assert story.end_step == 50 and story.beyond_checkpoint == 0
    assert [s for s, _ in story.checkpoints] == [10, 20, 30, 40, 50]
    assert story.missing_steps == [] and story.skipped_rows == story.skipped_events == 0


def test_leave_and_return_lines_exactly(tmp_path):
    assert _lines(leave_and_return(tmp_path / "run")) == LEAVE_AND_RETURN_LINES


def test_a_group_is_keyed_by_its_group_never_its_rank_number(tmp_path):
    """After the return rank 0 is a t4: its rows count for t4, not for v100."""
    story = read_story(leave_and_return(tmp_path / "run"))
    last = [f for f in story.figures if f.phase == 3]
    assert {f.group: f.rows for f in last} == {"t4": 20, "v100": 10}
    assert dict(story.series)["t4"][-1] == (49, 100.0)
    assert [s for s, _ in story.series["t4"]] == [*range(20), *range(40, 50)]


def test_a_world_started_where_no_checkpoint_was_recorded_is_said(tmp_path):
    """A world resumes from a committed checkpoint: one that starts elsewhere (the step
    counter went back past it, or skipped) is listed."""
    run = leave_and_return(tmp_path / "run")
    lines = (run / EVENTS_NAME).read_text().splitlines()
    kept = [ln for ln in lines
            if (json.loads(ln)["kind"], json.loads(ln)["step"]) != ("checkpoint", 40)]
    (run / EVENTS_NAME).write_text("\n".join(kept) + "\n")
    story = read_story(run)
    assert story.unanchored == [40]
    assert "worlds started where no checkpoint was recorded: step(s) 40" in story_lines(story)
    assert read_story(leave_and_return(tmp_path / "other")).unanchored == []


def test_steps_past_the_last_checkpoint_are_said(tmp_path):
    run = leave_and_return(tmp_path / "run")
    with EventLog(run) as log:  # the world goes on past step 50 and is killed at 55
        log.write("world", 50, groups=["t4", "v100"], world_size=3, plan="p",
                  predicted_step_ms=100.0, predicted_group_ms=None, resumed_from=50)
    write_rows(run, 2, "v100", range(50, 55), lambda s: (91, 9), start=50)
    story = read_story(run)
    assert story.beyond_checkpoint == 5 and story.end_step == 55
    lines = story_lines(story)
    assert ("steps lost: 3 (3 at the change of step 20); 5 trained past the last checkpoint "
            "(step 50): a resume trains them again") in lines
    assert story.periods[-1].cause == "restart"


def test_an_ordinary_run_without_events_is_one_period_from_its_metrics(tmp_path):
    for rank, compute in ((0, 10.0), (1, 30.0)):
        write_rows(tmp_path, rank, "cpu" if rank == 0 else "cpu/3", range(7),
                   lambda s, c=compute: (c + s, 40.0 - c - s))
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 7}))
    story = read_story(tmp_path)
    assert [(p.first, p.last, p.groups, p.world_size, p.cause) for p in story.periods] == [
        (0, 6, ("cpu", "cpu/3"), 2, "metrics")]
    assert [(f.group, f.compute_ms, f.step_ms, f.ratio) for f in story.figures] == [
        ("cpu", 13.0, 40.0, None), ("cpu/3", 33.0, 40.0, None)]
    lines = story_lines(story)
    assert lines[-2:] == ["steps lost: 0; no checkpoint recorded: a resume would start "
                          "again at step 0",
                          "finished: summary.json says 7 step(s) (no stop event)"]


def test_events_without_metrics_still_tell_the_timeline(tmp_path):
    with EventLog(tmp_path) as log:
        log.write("world", 0, groups=["a"], world_size=1, plan="p", predicted_step_ms=5.0,
                  predicted_group_ms={"a": 5.0}, resumed_from=None)
        log.write("checkpoint", 8, path="ckpt/step-00000008")
        log.write("stop", 8, reason="all groups gone", checkpoint="ckpt/step-00000008")
    story = read_story(tmp_path)
    assert [(p.first, p.last) for p in story.periods] == [(0, 7)]
    lines = story_lines(story)
    assert "  no metrics row: nothing measured" in lines
    assert "stopped at step 8: all groups gone; checkpoint ckpt/step-00000008" in lines
    assert story.beyond_checkpoint == 0


def test_a_world_resumed_before_another_replaces_the_steps_it_trains_again(tmp_path):
    """A world that crashed before its first checkpoint is replaced by one resumed from
    the same step; a re-plan logged in the replaced world cuts nothing of the new one."""
    with EventLog(tmp_path) as log:
        log.write("world", 0, groups=["a", "b"], world_size=2, plan="p",
                  predicted_step_ms=10.0, predicted_group_ms=None, resumed_from=None)
        log.write("world", 10, groups=["a"], world_size=1, plan="p",
                  predicted_step_ms=8.0, predicted_group_ms=None, resumed_from=10)
        log.write("replan", 12, groups=["a"], factors=[1.4], old_predicted_ms=8.0,
                  new_predicted_ms=11.0, solve_s=0.01, reason="slow")
        log.write("world", 10, groups=["a", "b"], world_size=2, plan="p",
                  predicted_step_ms=10.0, predicted_group_ms=None, resumed_from=10)
    write_rows(tmp_path, 0, "a", range(20), lambda s: (5, 5))
    write_rows(tmp_path, 1, "b", range(20), lambda s: (6, 4))
    story = read_story(tmp_path)
    assert [(p.first, p.last, p.groups) for p in story.periods] == [
        (0, 9, ("a", "b")), (10, 19, ("a", "b"))]
    assert [p.steps_text() for p in story.phases] == ["0..9", "10..19"]
    assert story.stale_rows == 0 and story.changes[0].kind == "replan"


def test_a_membership_change_without_the_old_groups_is_told(tmp_path):
    """The groups before a change may be unknown (null): told as '?', not left out."""
    with EventLog(tmp_path) as log:
        log.write("world", 5, groups=["a"], world_size=1, plan="p", predicted_step_ms=None,
                  predicted_group_ms=None, resumed_from=5)
        log.write("membership", 5, old_groups=None, new_groups=["a"], old_predicted_ms=None,
                  new_predicted_ms=None, change_to_first_step_s=None, lost_steps=0)
    write_rows(tmp_path, 0, "a", range(5, 8), lambda s: (2, 0))
    story = read_story(tmp_path)
    assert story.skipped_events == 0 and story.periods[0].cause == "resume"
    assert ("  step 5      membership ? -> a; predicted - -> - ms/step; lost 0 step(s); "
            "change to first step - s") in story_lines(story)


def test_a_replan_in_a_run_without_world_events_cuts_its_one_period(tmp_path):
    """An ordinary run re-planned online logs no world: the re-plan still cuts its period."""
    with EventLog(tmp_path) as log:  # the re-plan the log's first line
        log.write("replan", 6, groups=["cpu"], factors=[1.5], old_predicted_ms=None,
                  new_predicted_ms=30.0, solve_s=0.002, reason="slower",
                  predicted_group_ms={"cpu": 29.0})
        log.write("slowdown", 4, group="cpu", old_factor=2.0, new_factor=3.0)
    write_rows(tmp_path, 0, "cpu", range(10), lambda s: (20 if s < 4 else 31, 0))
    story = read_story(tmp_path)
    assert [(p.steps_text(), p.cause, p.predicted_step_ms) for p in story.phases] == [
        ("0..5", "metrics", None), ("6..9", "replan", 30.0)]
    assert [(f.compute_ms, f.ratio) for f in story.figures] == [(20.0, None),
                                                                 (31.0, 31.0 / 29.0)]
    assert "  step 6      re-plan    cpu x1.50 (slower); predicted - -> 30.0 ms/step; " \
           "solve 0.002 s" in story_lines(story)


def test_steps_without_a_row_are_listed_whatever_the_span(tmp_path):
    """A row at the largest step there is does not make the reader walk every step."""
    write_rows(tmp_path, 0, "a", [*range(5), 8, 9, MAX_STEPS], lambda s: (1, 1))
    story = read_story(tmp_path)
    assert story.missing_steps == [(5, 7), (10, MAX_STEPS - 1)]
    assert f"steps with no metrics row: 5..7, 10..{MAX_STEPS - 1}" in story_lines(story)


def test_thousands_of_rows_per_rank(tmp_path):
    for rank in range(4):
        write_rows(tmp_path, rank, f"g{rank % 2}", range(5000),
                   lambda s, r=rank: (10.0 + r + (s % 7), 1.0))
    story = read_story(tmp_path)
    assert story.rows == 20000 and story.periods[0].last == 4999
    # g0: ranks 0 and 2, compute 10+r+(s%7): medians of 13 and 15 -> the middle of all 10000
    assert [(f.group, f.compute_ms) for f in story.figures] == [("g0", 14.0), ("g1", 15.0)]


JUNK_METRICS = [
    '{"step": 3, "rank": 0, "group": "a", "comp',  # torn
    "[1, 2]", "not json", '{"step": 1' + "0" * 5000 + "}",  # over Python's int digits
    '{"step": "\u0663", "rank": 0, "group": "a", "compute_ms": 1, "step_ms": 2}',  # ٣
    '{"step": 3.0, "rank": 0, "group": "a", "compute_ms": 1, "step_ms": 2}',
    '{"step": true, "rank": 0, "group": "a", "compute_ms": 1, "step_ms": 2}',
    '{"step": -1, "rank": 0, "group": "a", "compute_ms": 1, "step_ms": 2}',
    f'{{"step": {MAX_STEPS + 1}, "rank": 0, "group": "a", "compute_ms": 1, "step_ms": 2}}',
    '{"step": 3, "rank": 0, "group": "a", "compute_ms": NaN, "step_ms": 2}',
    '{"step": 3, "rank": 0, "group": "a", "compute_ms": 1, "step_ms": 1e400}',
    '{"step": 3, "rank": 0, "group": "a", "compute_ms": 1e300, "step_ms": 2}',
    '{"step": 3, "rank": 0, "group": "a", "compute_ms": -1, "step_ms": 2}',
    '{"step": 3, "rank": 0, "group": "", "compute_ms": 1, "step_ms": 2}',
    '{"step": 3, "rank": 0, "group": ["a"], "compute_ms": 1, "step_ms": 2}',
    '{"step": 3, "rank": "0", "group": "a", "compute_ms": 1, "step_ms": 2}',
]


@pytest.mark.parametrize("junk", JUNK_METRICS)
def test_a_foreign_metrics_line_is_left_out_and_counted(tmp_path, junk):
    write_rows(tmp_path, 0, "a", range(6), lambda s: (1 if s < 4 else 3, 1))
    with open(tmp_path / "metrics.rank0.jsonl", "a", encoding="utf-8") as fh:
        fh.write(junk + "\n")  # the last line, as a kill leaves it, or another tool's
    story = read_story(tmp_path)
    assert story.skipped_rows == 1 and story.rows == 6
    assert story.figures[0].compute_ms == 1.0 and story.periods[0].last == 5
    assert "left out: 1 unreadable metrics line(s)" in story_lines(story)


JUNK_EVENTS = [
    '{"kind": "membership", "step": 5, "time": 1.0, "old_groups": ["a"]}',  # fields missing
    '{"kind": "membership", "step": 5, "time": 1.0, "old_groups": ["a"], "new_groups": [],'
    ' "old_predicted_ms": 1, "new_predicted_ms": 1, "change_to_first_step_s": 1,'
    ' "lost_steps": "\u0663"}',
    '{"kind": "membership", "step": 5, "time": 1.0, "old_groups": ["a"], "new_groups": [],'
    ' "old_predicted_ms": 1, "new_predicted_ms": 1, "change_to_first_step_s": 1,'
    ' "lost_steps": -3}',
    '{"kind": "replan", "step": 5, "time": 1.0, "groups": ["a"], "factors": [1, 2],'
    ' "old_predicted_ms": 1, "new_predicted_ms": 1, "solve_s": 1, "reason": "x"}',
    '{"kind": "slowdown", "step": 5, "time": NaN, "group": "a", "old_factor": 1,'
    ' "new_factor": 2}',
    '{"kind": "slowdown", "step": 5, "time": 1, "group": "a", "old_factor": Infinity,'
    ' "new_factor": 2}',
    '{"kind": "world", "step": 5, "time": 1, "groups": ["a", "a"], "world_size": 1,'
    ' "plan": "p", "predicted_step_ms": 1, "predicted_group_ms": null, "resumed_from": null}',
    '{"kind": "world", "step": 5, "time": 1, "groups": ["a"], "world_size": 0,'
    ' "plan": "p", "predicted_step_ms": 1, "predicted_group_ms": null, "resumed_from": null}',
    '{"kind": "checkpoint", "step": 5, "time": 1, "path": 7}',
    '{"kind": "checkpoint", "step": 5, "time": 1, "pa',  # torn
]


@pytest.mark.parametrize("junk", JUNK_EVENTS)
def test_a_foreign_event_is_left_out_and_counted(tmp_path, junk):
    leave_and_return(tmp_path)
    with open(tmp_path / EVENTS_NAME, "a", encoding="utf-8") as fh:
        fh.write(junk + "\n")
    story = read_story(tmp_path)
    assert story.skipped_events == 1
    assert _lines(tmp_path) == LEAVE_AND_RETURN_LINES.replace(
        "left out: ", "left out: 1 event line(s) unreadable or with a missing or bad field; ")


@pytest.mark.parametrize("name", [EVENTS_NAME, "metrics.rank1.jsonl", "summary.json"])
def test_a_link_planted_for_a_file_is_refused_not_followed(tmp_path, name):
    run = leave_and_return(tmp_path / "run")
    secret = tmp_path / "secret.txt"
    secret.write_text('{"kind": "stop", "step": 1, "time": 1}\n')
    (run / name).unlink(missing_ok=True)
    os.symlink(secret, run / name)
    with pytest.raises(QsyncInputError, match=f"--run .*{name.replace('.', '[.]')} is a "
                                              "symbolic link"):
        read_story(run)
    assert secret.read_text() == '{"kind": "stop", "step": 1, "time": 1}\n'


def test_a_link_planted_for_the_checkpoints_is_refused(tmp_path):
    write_rows(tmp_path, 0, "a", range(3), lambda s: (1, 1))
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "ckpt")
    with pytest.raises(QsyncInputError, match="--run .*: ckpt is a symbolic link"):
        read_story(tmp_path)


def test_a_fifo_planted_for_a_metrics_file_is_refused(tmp_path):
    os.mkfifo(tmp_path / "metrics.rank0.jsonl")
    with pytest.raises(QsyncInputError, match="not a regular file"):
        read_story(tmp_path)


def test_an_empty_name_is_not_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(leave_and_return(tmp_path / "run"))
    with pytest.raises(QsyncInputError, match="--run: expected a run's folder, got an empty"):
        read_story("")


@pytest.mark.parametrize("case,needle", [("missing", "no such folder"),
                                         ("file", "is a file, not a folder"),
                                         ("dangling", "a link to nothing"),
                                         ("empty", "no events.jsonl and no metrics row"),
                                         ("junk", "2 unreadable row")])
def test_a_folder_with_no_story_is_one_line(tmp_path, case, needle):
    run = tmp_path / "run"
    if case == "file":
        run.write_text("x")
    elif case == "dangling":
        os.symlink(tmp_path / "nowhere", run)
    elif case in ("empty", "junk"):
        run.mkdir()
        if case == "junk":
            (run / "metrics.rank0.jsonl").write_text("{\n[]\n")
    with pytest.raises(QsyncInputError, match=needle) as err:
        read_story(run)
    assert "\n" not in str(err.value)


def test_names_in_the_files_print_on_one_line(tmp_path):
    write_rows(tmp_path, 0, "a\x1b[2Jb\nc", range(3), lambda s: (1, 1))
    lines = story_lines(read_story(tmp_path))
    assert all("\x1b" not in line and "\n" not in line for line in lines)
    assert any("a\\x1b[2Jb\\nc" in line for line in lines)


def test_the_summary_is_strict_json(tmp_path):
    doc = story_summary(read_story(leave_and_return(tmp_path / "run")))
    text = json.dumps(doc, allow_nan=False)
    back = json.loads(text)
    assert back["lost_steps"] == 3 and back["beyond_last_checkpoint"] == 0
    assert back["changes"][0]["reasons"] == ["a peer died: its collective failed"]
    assert [p["measured_step_ms"] for p in back["phases"]] == [100.0, 81.0, 119.0, 100.0]
    assert back["phases"][1]["groups_measured"][0] == {
        "group": "v100", "predicted_ms": 80.0, "compute_ms": 81.0, "step_ms": 81.0,
        "ratio": 81.0 / 80.0, "rows": 15}


def test_the_figure_is_a_png_written_atomically(tmp_path):
    story = read_story(leave_and_return(tmp_path / "run"))
    path = story_figure(story, tmp_path / "new" / "folder" / "story.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["story.png"]  # no temporary


def test_the_figure_refuses_a_planted_link_and_a_folder(tmp_path):
    story = read_story(leave_and_return(tmp_path / "run"))
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    os.symlink(victim, tmp_path / "story.png")
    with pytest.raises(QsyncInputError, match="symbolic link"):
        story_figure(story, tmp_path / "story.png")
    assert victim.read_text() == "keep"
    (tmp_path / "dir.png").mkdir()
    with pytest.raises(QsyncInputError, match="is a folder"):
        story_figure(story, tmp_path / "dir.png")


def _damage(data: bytes, rng: random.Random) -> bytes:
    """``data`` with a few random damages: bytes changed, inserted or cut, lines swapped,
    duplicated or torn, numbers made huge, NaN or unicode digits."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        kind = rng.randrange(6)
        at = rng.randrange(len(b) + 1)
        if kind == 0 and b:
            b[min(at, len(b) - 1)] = rng.randrange(256)
        elif kind == 1:
            b[at:at] = rng.choice([b"NaN", b"1e999", b"\xd9\xa3", b"-", b"\n", b'"', b"9" * 30,
                                   b"{", b"]", b"null", b"true", b"\x00"])
        elif kind == 2:
            del b[at:at + rng.randint(1, 40)]
        else:
            lines = bytes(b).split(b"\n")
            i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
            if kind == 3:
                lines[i], lines[j] = lines[j], lines[i]
            elif kind == 4:
                lines.insert(i, lines[j])
            else:
                lines[i] = lines[i][: rng.randrange(len(lines[i]) + 1)]
            b = bytearray(b"\n".join(lines))
    return bytes(b)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    run = leave_and_return(tmp_path_factory.mktemp("template") / "run")
    return {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_any_damage_to_the_files_is_told_or_refused_in_one_line(template, seed):
    """Whatever happens to events.jsonl and the metrics files, the story is told (every line
    one line) or refused in one line naming --run; never another exception."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in template.items():
            hit = rng.random() < 0.7
            Path(tmp, name).write_bytes(_damage(data, rng) if hit else data)
        try:
            story = read_story(tmp)
        except QsyncInputError as exc:
            assert "\n" not in str(exc) and "--run" in str(exc)
            return
        lines = story_lines(story)
        assert all("\n" not in line and line.isprintable() for line in lines)
        json.dumps(story_summary(story), allow_nan=False)
