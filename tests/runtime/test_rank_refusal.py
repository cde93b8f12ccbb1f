"""A refusal inside a multi-rank ``train`` is the command's one line and exit code 2.

A link planted inside ``--out`` while the ranks run (after the launcher checked the folder)
makes the rank that writes through it refuse (qsync_opt.documents.outfolder); its peer, waiting in a
collective, then fails too, and torchrun may name that peer first. Whichever rank refuses,
with every kind of writer a rank uses (its checkpoint file, the set's folder, the commit
marker, its summary), the command prints the line a one-process run gives and exits 2,
and nothing outside ``--out`` is written.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.job import launch
from qsync_opt.runtime.rankfail import refusal, report_failure, sort_line
from support.harness import run_cli

#: What each rank runs instead of ``-m qsync_opt.job.rank``: the worker, with a link
#: planted at OUT/PATH (each of PATHS, comma-separated; the I-th to TARGET followed by I) by
#: rank RANK once it has finished step STEP (the progress update every runner calls after a
#: step: the data-parallel trainer and the pipeline's stages).
_WORKER = r'''
import os, sys
from qsync_opt.job import rank as train
from qsync_opt.runtime import metrics

RANK, STEP, PATHS, OUT, TARGET = int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:6]
update = metrics.StepProgress.update

def planting(self, step, loss):
    if step == STEP and int(os.environ["RANK"]) == RANK:
        for i, path in enumerate(PATHS.split(",")):
            where = os.path.join(OUT, path)
            os.makedirs(os.path.dirname(where), exist_ok=True)
            os.symlink(f"{TARGET}{i}", where + ".planting")
            os.replace(where + ".planting", where)
    return update(self, step, loss)

metrics.StepProgress.update = planting
sys.exit(train.main(sys.argv[6:]))
'''

#: (rank that plants, after step, path inside --out): one case per kind of writer a rank
#: uses after that, and both ranks refusing (rank 0 at the marker, rank 1 elsewhere). Left
#: out as the same writer and path check as a kept case: rank 0's checkpoint file (rank 1's
#: is kept), summary.rank0.json and summary.json (rank 0's summaries: the same writer as
#: rank 1's, and rank 0 refusing is the commit marker's case).
WRITERS = [
    (1, 3, "ckpt/step-00000004/rank1.pt"),      # a rank's checkpoint file
    (1, 3, "ckpt/step-00000004"),               # the set's folder, both ranks write into it
    (0, 3, "ckpt/step-00000004/commit.json"),   # rank 0's commit marker
    (1, 5, "summary.rank1.json"),               # rank 1's summary (rank 0 waits for it)
]


def _plant_with(monkeypatch, tmp_path: Path, rank: int, step: int, rel: str, out: Path,
                outside: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(_WORKER)

    def command(config_path: Path, nproc: int, port: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                "--master-port", str(port), str(worker), str(rank), str(step), rel,
                str(out.resolve()), str(outside), str(config_path)]

    monkeypatch.setattr(launch, "local_command", command)


def _one_line(code: int, err: str) -> str:
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1, (code, err)
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize(("rank", "step", "rel"), WRITERS, ids=[w[2] for w in WRITERS])
def test_a_link_planted_during_a_two_rank_run_is_one_refusal(tmp_path, monkeypatch, rank,
                                                              step, rel) -> None:
    """One two-rank run per writer kind (a run stops at its first refusal, so one run can
    not plant at several): the refusing rank's line and exit 2, nothing written outside."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    _plant_with(monkeypatch, tmp_path, rank, step, rel, out, outside / "x")
    code, _out, err = run_cli("train", "--model", "digits_cnn", "--cluster", "cpux2",
                              "--nproc", "2", "--steps", "6", "--checkpoint-every", "2",
                              "--backend", "gloo", "--timeout", "120", "--out", str(out))
    line = _one_line(code, err)
    assert line == (f"qsync-opt: error: --out {out.resolve()}: {out.resolve() / rel} is a "
                    "symbolic link; nothing inside an output folder is followed or written "
                    "through: remove it, or use another --out"), line
    assert list(outside.iterdir()) == []


@pytest.mark.slow
def test_a_link_planted_in_a_pipeline_run_is_one_refusal(tmp_path, monkeypatch) -> None:
    """The pipeline's stage processes write their own files: the same refusal."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    rel = "ckpt/step-00000004/rank1.pt"
    _plant_with(monkeypatch, tmp_path, 1, 3, rel, out, outside / "x")
    code, _out, err = run_cli("train", "--model", "digits_cnn", "--cluster", "cpux2",
                              "--pipeline-stages", "2", "--steps", "6", "--checkpoint-every",
                              "2", "--backend", "gloo", "--timeout", "120", "--out", str(out))
    assert f"{out.resolve() / rel} is a symbolic link" in _one_line(code, err)
    assert list(outside.iterdir()) == []


#: torchrun's report when the refusing rank (1, exit 2) is not the one it names first: its
#: peer failed in the collective it was waiting in, within the same second.
_RACE = """\
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : 2 (pid: 12)
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 11)
"""
_REFUSAL = "qsync-opt train: --out /r: /r/summary.rank1.json is a symbolic link\n"
_PEER = ("qsync-opt train: rank 0: RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error "
         "[127.0.0.1]:20152: Connection reset by peer.\n")


@pytest.mark.parametrize("order", ["refusal first", "peer first"])
def test_a_refusal_is_the_cause_whichever_rank_torchrun_names(order, capsys) -> None:
    report: dict[str, list[str]] = {"errors": [], "held": []}
    lines = [_REFUSAL, _PEER] if order == "refusal first" else [_PEER, _REFUSAL]
    for line in lines + _RACE.splitlines(keepends=True):
        assert sort_line(line, report)
    with pytest.raises(QsyncInputError) as exc:
        report_failure(1, report["held"], report, ["cpu", "cpu"])
    assert str(exc.value) == "--out /r: /r/summary.rank1.json is a symbolic link"
    assert capsys.readouterr() == ("", "")


def test_a_failure_without_a_refusal_still_names_the_rank(capsys) -> None:
    report: dict[str, list[str]] = {"errors": [], "held": []}
    for line in [_PEER, *_RACE.replace("exitcode  : 2", "exitcode  : 1").splitlines(True)]:
        sort_line(line, report)
    assert report_failure(1, report["held"], report, ["cpu", "cpu"]) == 1
    assert "rank 0 (cpu) failed first (exit code 1)" in capsys.readouterr().err


@pytest.mark.parametrize(("line", "refused"), [
    (_REFUSAL, "--out /r: /r/summary.rank1.json is a symbolic link"),
    (_PEER, None),
    ("qsync-opt train: rank 1: qsync_opt.core.errors.Other: x\n", None),
    ("qsync-opt train: model: data(8, 0) batch 1 of m.py\n", "model: data(8, 0) batch 1 of m.py"),
])
def test_which_rank_lines_are_refusals(line, refused) -> None:
    assert refusal([line]) == refused


@pytest.mark.slow
def test_a_link_over_a_name_the_run_never_reopens_is_not_followed(tmp_path,
                                                                 monkeypatch) -> None:
    """The metrics file is appended to through the descriptor opened at the start, and
    ``checkpoint.pt`` is a link the runtime only ever replaces (a one-process run makes it;
    the ranks of a torchrun do not): a link planted there while the ranks run is never
    followed, and the run ends normally. Both links in one run: neither stops it, so each
    is checked as it would be alone (nothing reaches either target)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    rels = ["metrics.rank1.jsonl", "checkpoint.pt"]
    _plant_with(monkeypatch, tmp_path, 1, 3, ",".join(rels), out, outside / "x")
    code, _out, err = run_cli("train", "--model", "digits_cnn", "--cluster", "cpux2",
                              "--nproc", "2", "--steps", "6", "--checkpoint-every", "2",
                              "--backend", "gloo", "--timeout", "120", "--out", str(out))
    assert code == 0, err
    for i, rel in enumerate(rels):  # both were planted, and both are still links
        assert os.readlink(out / rel) == str(outside / f"x{i}"), rel
    assert list(outside.iterdir()) == []
    assert (out / "ckpt" / "step-00000006" / "commit.json").is_file()
