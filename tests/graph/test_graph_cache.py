"""The cache of traced graphs (qsync_opt.graph.cache): a hit is the graph a fresh trace
gives, any change of what a graph depends on misses, and a broken, hostile or linked file in
the cache folder is never trusted nor written through."""

from __future__ import annotations

import ast
import json
import os
import textwrap
from pathlib import Path

import pytest
import qsync_opt.models as models
import torch
from qsync_opt.models import BuiltinWorkload

from qsync_opt.documents.io import to_json
from qsync_opt.graph import cache as graph_cache
from qsync_opt.graph import trace, tracing

MODEL = "digits_cnn"


@pytest.fixture
def folder(monkeypatch, tmp_path) -> Path:
    """The graph cache folder, under a fresh XDG_CACHE_HOME."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "qsync-opt" / graph_cache.FOLDER


@pytest.fixture
def traces(monkeypatch) -> list[int]:
    """Counts the traces run (a built-in's model built for the tracer)."""
    seen: list[int] = []
    real = BuiltinWorkload.trace_inputs

    def counting(self, batch, include_loss):
        seen.append(batch)
        return real(self, batch, include_loss)

    monkeypatch.setattr(BuiltinWorkload, "trace_inputs", counting)
    return seen


def _files(folder: Path) -> list[Path]:
    return sorted(folder.iterdir()) if folder.is_dir() else []


def test_a_hit_is_the_fresh_graph_and_runs_no_trace(folder, traces) -> None:
    first = trace(MODEL, 16, cache=True)
    assert traces == [16] and len(_files(folder)) == 1
    again = trace(MODEL, 16, cache=True)
    assert traces == [16]  # read, not traced
    fresh = trace(MODEL, 16)  # no cache: traced
    assert again == first == fresh and to_json(again) == to_json(fresh)
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]  # atomic: no leftovers


@pytest.mark.parametrize("change", [
    {"batch": 8}, {"pin_head": False}, {"tie": "blocks"}, {"method": "function_mode"},
    {"include_loss": False}, {"name": "other"}, {"unpin": ("fc2",)},
])
def test_any_change_of_batch_or_tracer_settings_misses(folder, traces, change) -> None:
    base = {"batch": 16}
    trace(MODEL, cache=True, **base)
    graph = trace(MODEL, cache=True, **{**base, **change})
    assert len(traces) == 2 and len(_files(folder)) == 2
    assert graph == trace(MODEL, **{**base, **change})


def test_a_change_of_the_code_or_the_versions_misses(folder, traces, monkeypatch) -> None:
    trace(MODEL, 16, cache=True)
    # a model edited: the digest as the registry and the cache-first lookup read it
    monkeypatch.setattr(models, "package_code_digest", lambda: "0" * 16)
    monkeypatch.setattr(tracing, "package_code_digest", lambda: "0" * 16)
    trace(MODEL, 16, cache=True)
    monkeypatch.setattr(graph_cache, "_package_version", lambda: "99.0")
    trace(MODEL, 16, cache=True)
    monkeypatch.setattr(graph_cache, "torch_version", lambda: "0.0.1")
    trace(MODEL, 16, cache=True)
    assert len(traces) == 4  # each a miss
    assert len(_files(folder)) == 3  # the first code's file deleted when the code changed


def test_a_workload_made_or_changed_outside_the_package_is_never_cached(folder, monkeypatch
                                                                          ) -> None:
    import dataclasses

    wl = models.get_workload(MODEL)
    elsewhere = dataclasses.replace(wl, build=lambda: wl.build())  # its code: this file's
    renamed = dataclasses.replace(wl, name="mine")  # the package's code, not registered
    for other in (elsewhere, renamed):
        assert other.code_digest is None
        trace(other, 16, cache=True)
    monkeypatch.setitem(models.WORKLOADS, MODEL, elsewhere)  # registered, code elsewhere
    assert elsewhere.code_digest is None
    trace(MODEL, 16, cache=True)
    assert _files(folder) == []


def test_graphs_made_by_other_code_are_deleted_when_the_workload_is_traced_again(
        folder, monkeypatch, tmp_path) -> None:
    trace(MODEL, 16, cache=True)
    trace(MODEL, 8, cache=True)
    trace("resnet18_32", 2, cache=True)  # another workload (a name with MODEL's letters too)
    old = {p.name for p in _files(folder)}
    victim = tmp_path / "victim.json"
    victim.write_text("keep")
    link = folder / f"{MODEL}-00000000-b1-{'0' * 24}.json"  # named like an old file
    link.symlink_to(victim)
    monkeypatch.setattr(models, "package_code_digest", lambda: "f" * 16)  # the code changed
    monkeypatch.setattr(tracing, "package_code_digest", lambda: "f" * 16)
    trace(MODEL, 16, cache=True)
    now = {p.name for p in _files(folder)}
    kept = {n for n in old if n.startswith("resnet18_32-")}
    assert len(kept) == 1 and kept <= now  # another workload's files wait for its next trace
    (new,) = now - kept - {link.name}
    assert new.startswith(f"{MODEL}-ffffffff-b16-")
    assert link.is_symlink() and victim.read_text() == "keep"  # a link is never deleted


def test_the_code_digest_covers_every_source_of_the_package_and_its_models() -> None:
    from qsync_opt.models.workload import package_code_digest

    digest = package_code_digest()
    assert len(digest) == 16 and digest == models.get_workload(MODEL).code_digest
    package_code_digest.cache_clear()
    assert package_code_digest() == digest  # deterministic across reads


def _only_file(folder: Path) -> Path:
    (path,) = _files(folder)
    return path


@pytest.mark.parametrize("content", [
    b"", b"{", b"\xff\xfe not utf-8", b"[" * 100_000 + b"]" * 100_000, b"null", b"[]",
    b'{"key": null, "graph": {}}',
])
def test_a_corrupt_cache_file_is_traced_again_and_replaced(folder, traces, content) -> None:
    good = trace(MODEL, 16, cache=True)
    path = _only_file(folder)
    path.write_bytes(content)
    assert trace(MODEL, 16, cache=True) == good and len(traces) == 2
    assert json.loads(path.read_text())["graph"]["workload"] == MODEL  # rewritten whole


def test_a_file_holding_another_key_or_an_invalid_graph_is_not_trusted(folder, traces) -> None:
    good = trace(MODEL, 16, cache=True)
    path = _only_file(folder)
    stored = json.loads(path.read_text())
    forged = {**stored, "key": {**stored["key"], "batch": 99}}  # a graph filed under its name
    path.write_text(json.dumps(forged))
    assert trace(MODEL, 16, cache=True) == good and len(traces) == 2
    stored["graph"]["batch_size"] = -1  # the right key, a graph that does not validate
    path.write_text(json.dumps(stored))
    assert trace(MODEL, 16, cache=True) == good and len(traces) == 3


def test_a_link_planted_in_the_cache_folder_is_neither_followed_nor_written_through(
        folder, traces, tmp_path) -> None:
    good = trace(MODEL, 16, cache=True)
    path = _only_file(folder)
    victim = tmp_path / "victim.json"
    victim.write_text(path.read_text())  # a valid cache file elsewhere, which it must not read
    path.unlink()
    path.symlink_to(victim)
    before = victim.read_bytes()
    assert trace(MODEL, 16, cache=True) == good and len(traces) == 2
    assert victim.read_bytes() == before  # never written through the link
    assert path.is_symlink()  # left as found, not replaced behind the user's back


def test_a_cache_folder_that_is_a_link_is_not_used(folder, traces, tmp_path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    folder.parent.mkdir(parents=True)
    folder.symlink_to(elsewhere, target_is_directory=True)
    good = trace(MODEL, 16, cache=True)
    assert trace(MODEL, 16, cache=True) == good and len(traces) == 2  # never a hit
    assert list(elsewhere.iterdir()) == []  # nothing written there


def test_an_unwritable_cache_costs_only_the_next_trace(folder, traces) -> None:
    folder.parent.mkdir(parents=True)
    folder.write_text("a file where the folder goes")
    good = trace(MODEL, 16, cache=True)
    assert trace(MODEL, 16, cache=True) == good and len(traces) == 2


def test_a_user_file_is_never_cached(folder, tmp_path) -> None:
    f = tmp_path / "mine.py"
    f.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def build():
            return nn.Sequential(nn.Linear(4, 3)), torch.randn(2, 4)
    """))
    graph = trace(f"{f}:build", cache=True)
    assert graph.workload_sha256 and _files(folder) == []


def test_the_cli_traces_a_built_in_once(folder, traces, tmp_path) -> None:
    from support.harness import run_cli

    for _ in range(2):
        code, _, err = run_cli("graph", "--model", MODEL, "--batch", "16", "--out",
                               str(tmp_path / "g.json"))
        assert code == 0, err
    assert traces == [16]
    assert (tmp_path / "g.json").read_text() == to_json(trace(MODEL, 16))


def test_the_cache_file_name_is_safe_for_any_workload_name() -> None:
    key = graph_cache.cache_key("../../etc/passwd\n", "0" * 16, 1, {})
    name = graph_cache.cache_file(key)
    assert os.sep not in name and "\n" not in name and name.endswith(".json")


def test_a_cache_that_cannot_be_written_prints_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A write that fails (a file-size limit, a full disk) costs only the next trace: the
    command's output is what it would be without a cache."""
    gc = graph_cache

    def refuse(*_a: object, **_k: object) -> None:
        raise OSError(27, "File too large")
    monkeypatch.setattr(gc.outfolder, "write_text", refuse)
    key = gc.cache_key("digits_cnn", "0" * 64, 8, {})
    gc.store(key, trace("digits_cnn", batch=8))
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_the_key_names_torch_without_importing_it() -> None:
    """The key holds torch's installed version (the same string as ``torch.__version__``),
    and neither the cache nor the workload protocol (the code digest) imports torch at the
    top, so that a cached graph can be found without importing torch."""
    assert graph_cache.cache_key("digits_cnn", "0" * 64, 8, {})["torch"] == torch.__version__
    for rel in ("qsync_opt/graph/cache.py", "models/workload.py"):
        tree = ast.parse((Path(__file__).resolve().parents[2] / rel).read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not [m for m in names if m.split(".")[0] == "torch"], rel


def test_a_builtin_at_its_default_batch_is_found_without_the_registry(folder, traces,
                                                                      monkeypatch) -> None:
    """Traced at its default batch, a built-in's record of that batch lets the next lookup
    at no batch find the graph without resolving the name (the registry imports torch)."""
    import qsync_opt.models.resolve as resolve

    first = trace(MODEL, cache=True)
    assert first.batch_size == models.get_workload(MODEL).default_batch

    def no_registry(name):
        raise AssertionError("the registry was read")

    monkeypatch.setattr(resolve, "get_workload", no_registry)
    assert trace(MODEL, cache=True) == first
    assert trace(MODEL, first.batch_size, cache=True) == first
    assert len(traces) == 1
    assert len([p for p in _files(folder) if "-bdefault-" in p.name]) == 1
