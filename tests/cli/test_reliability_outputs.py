"""Output safety: nothing inside an output folder is followed, old output is never
reused, output paths are refused before any work, and a corrupt or hostile checkpoint is one
line (exit 2) that names the file, never loaded beyond tensors and plain values.

Every planted link points OUTSIDE the output folder; each test asserts the target is
untouched (bytes, folder listing) and the refusal is one line, exit 2, naming the path.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from qsync_opt.core.errors import OutputError
from qsync_opt.documents import outfolder
from qsync_opt.runtime import checkpoint as ck
from qsync_opt.runtime import config as rc
from qsync_opt.runtime.metrics import MetricsWriter, write_json
from support.harness import run_cli

SECRET = b"outside: must stay as it is\n"


def assert_one_line(code: int, err: str, *needles: str) -> str:
    assert code == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("qsync-opt: error: "), err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


@pytest.fixture
def outside(tmp_path: Path) -> dict[str, Path]:
    """A file and a folder (holding a checkpoint-like set) outside every output folder."""
    f = tmp_path / "outside.txt"
    f.write_bytes(SECRET)
    d = tmp_path / "elsewhere"
    (d / "step-00000001").mkdir(parents=True)
    (d / "step-00000001" / "rank0.pt").write_bytes(SECRET)
    (d / "step-00000001" / "commit.json").write_bytes(SECRET)
    return {"file": f, "folder": d}


def snapshot(*paths: Path) -> dict[str, bytes]:
    got = {}
    for p in paths:
        if p.is_file():
            got[str(p)] = p.read_bytes()
        else:
            for q in sorted(p.rglob("*")):
                got[str(q)] = q.read_bytes() if q.is_file() else b"<dir>"
    return got


def plant(out: Path, rel: str, outside: dict[str, Path]) -> Path:
    """A link at ``out/rel`` to the outside file (a name with a suffix) or folder."""
    link = out / rel
    link.parent.mkdir(parents=True, exist_ok=True)
    target = outside["file"] if Path(rel).suffix else outside["folder"]
    link.symlink_to(os.path.relpath(target, link.parent))
    return link


# ----------------------------------------------------------------------------- the helper


OPS = {
    "write": lambda r, p: outfolder.write_text(r, p, "x"),
    "append": lambda r, p: outfolder.append_text(r, p).close(),
    "read": lambda r, p: outfolder.read_bytes(r, p),
    "remove": lambda r, p: outfolder.remove(r, p),
    "make_folder": lambda r, p: outfolder.make_folder(r, p),
    "list": lambda r, p: outfolder.list_names(r, p),
    "check_file": lambda r, p: outfolder.check_names(r, files=[p]),
    "check_tree": lambda r, p: outfolder.check_names(r, folders=[p]),
}


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("where", ["the file", "a folder on the way"])
def test_no_operation_inside_a_folder_follows_a_link(tmp_path: Path, outside: dict[str, Path],
                                                     op: str, where: str) -> None:
    root = tmp_path / "out"
    root.mkdir()
    before = snapshot(outside["file"], outside["folder"])
    if where == "the file":
        rel = "step-00000001" if op in ("make_folder", "list", "check_tree") else "a.json"
        plant(root, rel, outside)
    else:
        plant(root, "ckpt", outside)
        rel = "ckpt/step-00000001" + ("" if op in ("make_folder", "list", "check_tree",
                                                   "remove") else "/rank0.pt")
    with pytest.raises(OutputError) as info:
        OPS[op](root, rel)
    msg = str(info.value)
    assert "symbolic link" in msg and str(root) in msg and "\n" not in msg
    assert snapshot(outside["file"], outside["folder"]) == before


def test_the_folder_given_may_be_a_link_and_fifos_are_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "given").symlink_to(real)  # --out itself a link: followed, as documented
    outfolder.write_text(tmp_path / "given", "a/b.json", "ok")
    assert (real / "a" / "b.json").read_text() == "ok"
    os.mkfifo(real / "fifo")
    for op in ("write", "append", "read"):
        with pytest.raises(OutputError, match="not a regular file"):
            OPS[op](real, "fifo")


def test_the_tools_own_link_is_replaced_never_followed(tmp_path: Path,
                                                      outside: dict[str, Path]) -> None:
    out = tmp_path / "out"
    plant(out, "checkpoint.pt", outside)
    ck.link_latest(out, out / "ckpt" / "step-00000002" / "rank0.pt")
    assert os.readlink(out / "checkpoint.pt") == "ckpt/step-00000002/rank0.pt"
    assert outside["file"].read_bytes() == SECRET


def test_an_existing_file_keeps_its_mode_and_a_failed_write_leaves_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    outfolder.write_text(out, "a.json", "old")
    os.chmod(out / "a.json", 0o640)
    outfolder.write_text(out, "a.json", "new")
    assert (out / "a.json").read_text() == "new" and (out / "a.json").stat().st_mode & 0o777 == 0o640

    def boom(fh: Any) -> None:
        fh.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OutputError, match="No space left"):
        outfolder.write(out, "a.json", boom)
    assert (out / "a.json").read_text() == "new"
    assert sorted(p.name for p in out.iterdir()) == ["a.json"]  # no temporary file left


# ----------------------------------------------------------------------------- runtime writers


def test_every_runtime_writer_and_delete_refuses_a_planted_link(
        tmp_path: Path, outside: dict[str, Path]) -> None:
    """The writers the ranks run (after the launcher's check), each with a link planted
    where it writes, appends, reads or deletes."""
    before = snapshot(outside["file"], outside["folder"])
    cases = {
        "metrics.rank0.jsonl": lambda out: MetricsWriter(out / "metrics.rank0.jsonl", 0),
        "summary.json": lambda out: write_json(out / "summary.json", {"a": 1}),
        "ckpt/step-00000002/rank0.pt": lambda out: ck.write_rank_file(
            rc.set_path(out, 2), 0, {"format": 2}),
        "ckpt/step-00000002/commit.json": lambda out: ck.commit_set(
            out, rc.set_path(out, 2), 2, 1, {}, link=False),
        "ckpt": lambda out: rc.remove_stale(out, None, 1),
    }
    for rel, fn in cases.items():
        out = tmp_path / ("run-" + rel.replace("/", "_"))
        out.mkdir()
        plant(out, rel, outside)
        with pytest.raises(OutputError, match="symbolic link"):
            fn(out)
    # a linked step folder is no set: never read, never deleted
    out = tmp_path / "run-step"
    (out / "ckpt").mkdir(parents=True)
    (out / "ckpt" / "step-00000001").symlink_to(outside["folder"] / "step-00000001")
    assert rc.step_folders(out) == [] and rc.latest_complete_set(out) is None
    rc.remove_stale(out, None, 1)
    rc.remove_other_sets(out, rc.set_path(out, 5))
    assert snapshot(outside["file"], outside["folder"]) == before


# ----------------------------------------------------------------------------- train


TRAIN_NAMES = ["train_config.json", "fp32.plan.json", "summary.json", "summary.rank0.json",
               "metrics.rank0.jsonl", "metrics.rank3.jsonl", "ckpt",
               "ckpt/step-00000002", "ckpt/step-00000002/rank0.pt",
               "ckpt/step-00000002/commit.json", "ckpt/step-00000002/.rank0.pt.1234.tmp"]


@pytest.mark.parametrize("no_resume", [False, True])
@pytest.mark.parametrize("rel", TRAIN_NAMES)
def test_train_refuses_a_link_at_every_name_it_writes(tmp_path: Path, outside: dict[str, Path],
                                                      capsys: Any, rel: str,
                                                      no_resume: bool) -> None:
    out = tmp_path / "run"
    link = plant(out, rel, outside)
    before = snapshot(outside["file"], outside["folder"])
    code, _, err = run_cli("train", "--model", "digits_cnn", "--steps", "2", "--emulate-dp",
                           "--out", str(out), *(["--no-resume"] if no_resume else []))
    assert_one_line(code, err, "--out", str(link), "symbolic link")
    assert snapshot(outside["file"], outside["folder"]) == before
    assert sorted(p.name for p in out.iterdir()) == [Path(rel).parts[0]]  # nothing written


@pytest.mark.parametrize("what", ["a file", "a link to a file", "through a file",
                                  "a dangling link"])
def test_train_and_sweep_and_demo_refuse_an_out_that_is_no_folder(
        tmp_path: Path, capsys: Any, what: str) -> None:
    f = tmp_path / "f"
    f.write_text("keep")
    out = {"a file": f, "a link to a file": tmp_path / "l", "through a file": f / "sub",
           "a dangling link": tmp_path / "d"}[what]
    if what == "a link to a file":
        out.symlink_to(f)
    if what == "a dangling link":
        out.symlink_to(tmp_path / "nowhere")
    for argv in (["train", "--model", "digits_cnn", "--steps", "2", "--emulate-dp"],
                 ["sweep", "--model", "digits_cnn", "--steps", "2", "--export"],
                 ["demo", "--no-local"]):
        code, out_text, err = run_cli(*argv, "--out", str(out))
        assert_one_line(code, err, "--out", str(out))
        assert out_text == ""  # refused before any work
    assert f.read_text() == "keep" and not (tmp_path / "nowhere").exists()


def test_an_unwritable_out_is_refused_before_any_work(tmp_path: Path, capsys: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """(Root ignores mode bits: the probe's creation is made to fail as a read-only folder.)"""
    ro = tmp_path / "ro"
    ro.mkdir()
    real_open = os.open

    def fake_open(path: Any, flags: int, *a: Any, **k: Any) -> int:
        if flags & os.O_CREAT and str(path).startswith(".qsync-probe"):
            raise OSError(30, os.strerror(30), str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", fake_open)
    for argv in (["train", "--model", "digits_cnn", "--steps", "2", "--emulate-dp"],
                 ["sweep", "--model", "digits_cnn", "--steps", "2"], ["demo", "--no-local"]):
        code, out_text, err = run_cli(*argv, "--out", str(ro))
        assert_one_line(code, err, "--out", "cannot write into it", "Read-only")
        assert out_text == ""
    assert list(ro.iterdir()) == []


def test_a_fresh_run_leaves_nothing_of_an_older_runs_outputs(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    for name in ("summary.json", "summary.rank3.json", "metrics.rank0.jsonl",
                 "metrics.rank3.jsonl", "notes.txt"):
        (out / name).write_text("old")
    (out / "checkpoint.pt").symlink_to("ckpt/step-00000009/rank0.pt")
    rc.remove_stale(out, None, 2)
    assert sorted(p.name for p in out.iterdir()) == ["metrics.rank0.jsonl", "notes.txt"]


# ----------------------------------------------------------------------------- sweep


def _sweep(out: Path, steps: int, *extra: str) -> tuple[int, str, str]:
    return run_cli("sweep", "--model", "digits_cnn", "--seeds", "0", "--fuse", "fused",
                   "--steps", str(steps), "--batch", "16", "--eval-batches", "1",
                   "--out", str(out), *extra)


@pytest.mark.parametrize("rel", ["sweep.json", "model0", "model0/ckpt",
                                 "model0/fp32.plan.json", "model0/ckpt/step-00000002",
                                 "model0/ckpt/step-00000002/rank0.pt"])
def test_sweep_refuses_a_link_at_every_name_it_writes_before_training(
        tmp_path: Path, outside: dict[str, Path], capsys: Any, rel: str) -> None:
    out = tmp_path / "S"
    link = plant(out, rel, outside)
    before = snapshot(outside["file"], outside["folder"])
    code, text, err = _sweep(out, 2, "--export")
    assert_one_line(code, err, "--out", str(link), "symbolic link")
    assert text == "" and snapshot(outside["file"], outside["folder"]) == before


@pytest.mark.slow
def test_an_export_replaces_the_earlier_export_whole(tmp_path: Path, capsys: Any) -> None:
    """An export replaces the earlier one whole (a killed export's leftover included): exports
    of 4 then 2 steps leave only the second set, and train resumes at its step 2."""
    out = tmp_path / "S"
    assert _sweep(out, 4, "--export")[0] == 0
    (out / ".model0.0badf00d.tmp" / "ckpt").mkdir(parents=True)  # a killed export's leftover
    assert _sweep(out, 2, "--export")[0] == 0
    assert [s for s, _ in rc.step_folders(out / "model0")] == [2]
    assert os.readlink(out / "model0" / "checkpoint.pt") == "ckpt/step-00000002/rank0.pt"
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary left
    code, _, err = run_cli("train", "--model", "digits_cnn", "--seed", "0", "--lr", "0.05",
                           "--steps", "3", "--out", str(out / "model0"), "--emulate-dp",
                           "--batch", "16")
    assert code == 0, err
    rows = [json.loads(x) for x in (out / "model0" / "metrics.rank0.jsonl").read_text()
            .splitlines()]
    assert [r["step"] for r in rows] == [2]  # resumed from the new export's step 2
    # a train run continued there: the export refuses, before training, naming it
    code, text, err = _sweep(out, 2, "--export")
    assert_one_line(code, err, str(out / "model0"), "train_config.json")
    assert text == "" and (out / "model0" / "train_config.json").is_file()


# ----------------------------------------------------------------------------- checkpoints


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))  # runs on load if a full unpickler loads it


def _corrupt(path: Path, how: str, marker: Path) -> None:
    good = path.read_bytes()
    if how == "pickle with code":
        doc = torch.load(path, weights_only=True)
        doc["last_loss"] = _Evil(str(marker))
        torch.save(doc, path)
    elif how == "plain pickle":
        import pickle

        path.write_bytes(pickle.dumps({"x": _Evil(str(marker))}))
    elif how == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "a list":
        torch.save([1, 2, 3], path)
    elif how == "missing keys":
        torch.save({"format": 2, "step": 1}, path)
    elif how == "wrong types":
        doc = torch.load(path, weights_only=True)
        doc["model"] = {k: "not a tensor" for k in doc["model"]}
        torch.save(doc, path)


HOW = ["pickle with code", "plain pickle", "truncated", "empty", "a list", "missing keys",
       "wrong types"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One run of each kind at step 1, copied by every case."""
    base = tmp_path_factory.mktemp("runs")
    common = ["--model", "digits_cnn", "--steps", "1", "--batch", "16", "--emulate-dp"]
    made = {"train": base / "train", "pipeline": base / "pipe", "export": base / "S"}
    assert run_cli("train", *common, "--out", str(made["train"]))[0] == 0
    code, _, err = run_cli("train", *common, "--pipeline-stages", "2", "--cluster", "cpux2",
                           "--out", str(made["pipeline"]))
    assert code == 0, err
    code, _, err = _sweep(made["export"], 1, "--export")
    assert code == 0, err
    made["export"] = made["export"] / "model0"
    return made


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("kind", ["train", "pipeline", "export"])
def test_a_corrupt_or_hostile_checkpoint_is_one_line_naming_it(
        runs: dict[str, Path], tmp_path: Path, capsys: Any, kind: str, how: str) -> None:
    out = tmp_path / "run"
    shutil.copytree(runs[kind], out, symlinks=True)
    rank0 = out / "ckpt" / "step-00000001" / "rank0.pt"
    marker = tmp_path / "the-pickle-ran"
    _corrupt(rank0, how, marker)
    extra = (["--pipeline-stages", "2", "--cluster", "cpux2"] if kind == "pipeline" else [])
    config = out / "train_config.json"
    old_config = config.read_bytes() if config.exists() else None
    code, _, err = run_cli("train", "--model", "digits_cnn", "--steps", "2", "--batch", "16",
                           "--emulate-dp", "--out", str(out), *extra)
    assert_one_line(code, err, str(rank0), "--no-resume")
    assert "weights_only" not in err and not marker.exists()
    assert (config.read_bytes() if config.exists() else None) == old_config  # nothing written
    with pytest.raises(ck.CheckpointError):
        ck.load_checkpoint(rank0, "pipeline" if kind == "pipeline" else "train")
    assert not marker.exists()


def test_a_good_checkpoint_loads_and_its_layout_is_checked(runs: dict[str, Path]) -> None:
    doc = ck.load_checkpoint(runs["train"] / "ckpt" / "step-00000001" / "rank0.pt", "train")
    assert doc["step"] == 1
    with pytest.raises(ck.CheckpointError, match="not a pipeline"):
        ck.load_checkpoint(runs["train"] / "ckpt" / "step-00000001" / "rank0.pt", "pipeline")
    with pytest.raises(ck.CheckpointError, match="cannot read"):
        ck.load_checkpoint(runs["train"] / "checkpoint.pt", "train", follow=False)


# ----------------------------------------------------------------------------- output files


def test_output_files_are_checked_before_the_work(tmp_path: Path, capsys: Any) -> None:
    f = tmp_path / "f"
    f.write_text("keep")
    folder = tmp_path / "dir"
    folder.mkdir()
    cases = [
        (["graph", "--model", "digits_cnn", "--out", str(f / "g.json")], "--out"),
        (["sweep", "--model", "digits_cnn", "--steps", "2", "--json", str(folder)], "--json"),
        (["replay", "--model", "digits_cnn", "--cluster", "cpux1", "--write-plans", str(f)],
         "--write-plans"),
        (["replay", "--model", "digits_cnn", "--cluster", "cpux1", "--trace", str(folder)],
         "--trace"),
        (["netsim", "--model", "digits_cnn", "--cluster", "cpux2", "--json", str(folder)],
         "--json"),
        (["netsim", "--model", "digits_cnn", "--cluster", "cpux2", "--png", str(f / "x.png")],
         "--png"),
        (["pareto", "--model", "digits_cnn", "--cluster", "cpux1", "--out", str(f / "x")],
         "--out"),
        (["profile", "--model", "digits_cnn", "--out", str(folder)], "--out"),
        (["solve", "--model", "digits_cnn", "--cluster", "cpux1", "--out",
          str(tmp_path / "p.json"), "--report", str(folder)], "--report"),
    ]
    for argv, flag in cases:
        code, text, err = run_cli(*argv)
        assert_one_line(code, err, flag)
        assert text == "", argv
    assert f.read_text() == "keep" and list(folder.iterdir()) == []
    assert not (tmp_path / "p.json").exists()


def test_every_output_flag_of_every_command_is_checked_before_the_work() -> None:
    """The table the CLI checks before a command runs names every flag that takes an output
    path (a new one must be added there, or this fails)."""
    from qsync_opt.cli import OUTPUT_FILES, OUTPUT_FOLDERS, build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, parser in sub.choices.items():
        takes_path = {a.dest for a in parser._actions
                      if a.dest in ("out", "png", "json", "trace", "report", "write_plans")
                      and a.nargs != 0 and a.choices is None}
        checked = set(OUTPUT_FILES.get(name, ())) | set(OUTPUT_FOLDERS.get(name, ()))
        folder_out = {"out"} if name in ("train", "sweep", "demo") else set()
        assert takes_path == checked | folder_out, name


@pytest.mark.parametrize("name", ["plan.json", "frontier.png", "local_plan.json",
                                  "cluster.json"])
def test_demo_refuses_a_link_at_a_file_it_writes_before_any_work(
        tmp_path: Path, outside: dict[str, Path], capsys: Any, name: str) -> None:
    from qsync_opt.cli.demo import DEMO_FILES

    assert name in DEMO_FILES
    out = tmp_path / "demo"
    link = plant(out, name, outside)
    code, text, err = run_cli("demo", "--out", str(out))
    assert_one_line(code, err, "--out", str(link), "symbolic link")
    assert text == "" and outside["file"].read_bytes() == SECRET


def test_replay_write_plans_never_writes_through_a_link(
        tmp_path: Path, outside: dict[str, Path], capsys: Any) -> None:
    out = tmp_path / "plans"
    link = plant(out, "uniform-highest.plan.json", outside)
    code, _, err = run_cli("replay", "--model", "digits_cnn", "--cluster", "cpux1",
                           "--write-plans", str(out))
    assert_one_line(code, err, "--write-plans", str(link), "symbolic link")
    assert outside["file"].read_bytes() == SECRET


def test_files_the_tool_names_beside_a_trace_never_follow_a_link(
        tmp_path: Path, outside: dict[str, Path], capsys: Any) -> None:
    from qsync_opt.cli.model import _write_trace

    (tmp_path / "t.fp32.json").symlink_to(outside["file"])
    with pytest.raises(OutputError, match="symbolic link"):
        _write_trace(str(tmp_path / "t.json"), "fp32", True, "{}")
    (tmp_path / "named.json").symlink_to(tmp_path / "real.json")
    _write_trace(str(tmp_path / "named.json"), "fp32", False, "{}")  # named: written through
    assert (tmp_path / "real.json").read_text() == "{}"
    assert outside["file"].read_bytes() == SECRET


@pytest.mark.slow
def test_two_gloo_ranks_refuse_a_hostile_rank1_file_before_starting(
        tmp_path: Path, capsys: Any) -> None:
    """The launcher loads every rank's file of the set (here rank 1's, which only rank 1
    would read) before torchrun starts: one line, exit 2, never rank 1's traceback."""
    out = tmp_path / "run"
    common = ["train", "--model", "digits_cnn", "--nproc", "2", "--batch", "16",
              "--out", str(out)]
    code, _, err = run_cli(*common, "--steps", "1")
    assert code == 0, err
    rank1 = out / "ckpt" / "step-00000001" / "rank1.pt"
    marker = tmp_path / "the-pickle-ran"
    _corrupt(rank1, "pickle with code", marker)
    code, text, err = run_cli(*common, "--steps", "2")
    assert_one_line(code, err, str(rank1), "(io.open)")
    assert "torchrun" not in text and not marker.exists()
