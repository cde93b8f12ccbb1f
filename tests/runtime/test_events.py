"""The run's event log: rows written with their kind's fields, read back, torn lines skipped."""

from __future__ import annotations

import json
import os

import pytest

from qsync_opt.core.errors import OutputError
from qsync_opt.runtime.events import EVENTS_NAME, FIELDS, EventLog, read_events


def _fields(kind: str) -> dict[str, object]:
    return {f: 1 for f in FIELDS[kind]}


def test_every_kind_round_trips(tmp_path):
    with EventLog(tmp_path) as log:
        for i, kind in enumerate(FIELDS):
            log.write(kind, i, **_fields(kind))
    rows = read_events(tmp_path)
    assert [r["kind"] for r in rows] == list(FIELDS)
    assert [r["step"] for r in rows] == list(range(len(FIELDS)))
    assert all(isinstance(r["time"], float) for r in rows)


def test_unknown_kind_or_missing_field_is_refused(tmp_path):
    log = EventLog(tmp_path)
    with pytest.raises(ValueError, match="event kind"):
        log.write("reboot", 0)
    with pytest.raises(ValueError, match="missing field"):
        log.write("checkpoint", 0)
    assert read_events(tmp_path) == []


def test_non_finite_values_are_written_as_null(tmp_path):
    EventLog(tmp_path).write("slowdown", 3, group="t4", old_factor=float("nan"),
                             new_factor=float("inf"))
    row = read_events(tmp_path)[0]
    assert row["old_factor"] is None and row["new_factor"] is None


@pytest.mark.parametrize("junk", ['{"kind": "checkpoint", "step": 1, "time"',  # torn
                                  '[1, 2]', '{"kind": "nope", "step": 1, "time": 1}',
                                  '{"kind": "checkpoint", "step": "١", "time": 1}',
                                  '{"kind": "checkpoint", "step": true, "time": 1}',
                                  '\udcff not json', '[' * 100000,
                                  '{"kind": "checkpoint", "step": 1' + '0' * 5000 + '}'])
def test_foreign_or_torn_lines_are_skipped(tmp_path, junk):
    EventLog(tmp_path).write("checkpoint", 5, path="ckpt/step_5")
    with open(tmp_path / EVENTS_NAME, "a", encoding="utf-8", errors="surrogateescape") as fh:
        fh.write(junk + "\n")
    EventLog(tmp_path).write("checkpoint", 6, path="ckpt/step_6")
    assert [r["step"] for r in read_events(tmp_path)] == [5, 6]


def test_a_planted_link_is_refused_not_followed(tmp_path):
    target = tmp_path / "elsewhere.txt"
    target.write_text("keep\n")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(target, run / EVENTS_NAME)
    with pytest.raises(OutputError, match="symbolic link"):
        EventLog(run).write("checkpoint", 1, path="x")
    with pytest.raises(OutputError):
        read_events(run)
    assert target.read_text() == "keep\n"


def test_no_file_reads_as_no_events(tmp_path):
    assert read_events(tmp_path / "missing") == []
    assert json.dumps(read_events(tmp_path)) == "[]"
