"""The input-validation classes: every count has a stated limit checked when the
command line is parsed; nothing accepted is ignored; no exception escapes; no work is done
before a refusal, and a refusal is one line.

* Every integer and float flag of every command (netsim's included) has a bounded type
  (:mod:`qsync_opt.core.limits`), and each refuses huge, negative, non-finite, unicode-digit and
  malformed values with exit 2 and one line naming the flag.
* Spec flags carrying numbers (``--sync local:H``, ``--compress-act quant:B``,
  ``--lr-schedule``, ``--link-gbps``, ``--comm``, ``sweep --seeds/--lr/--wd``, cluster
  shorthands, ``--rank-groups``) are read in ASCII digits and checked when parsed.
* The replayer's sync model counts a billion-step run's rounds without listing them.
* replay refuses flags of the mode not chosen; solve/compare/pareto refuse an unknown
  solver or a lone ``--budget`` before anything is traced; sweep refuses bad seeds and
  unwritable outputs before it trains; train refuses before it writes anything.
* A model file: a ``loss``/``data`` that is not a function, a module without parameters, a
  detached loss, a model that cannot run its own example, a path that is no regular file.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qsync_opt import cli
from qsync_opt.cli import build_parser
from qsync_opt.core.limits import MAX_STEPS, parse_float, parse_int
from qsync_opt.strategy.modes import parse_sync, round_count, rounds
from qsync_opt.strategy.schedule import parse_schedule
from support.harness import run_cli

#: What every command needs besides the flag under test (the flag fails first anyway).
REQUIRED: dict[str, tuple[str, ...]] = {
    "graph": ("--model", "digits_cnn"), "estimate": ("--model", "digits_cnn", "--cluster",
                                                     "t4x1"),
    "replay": ("--model", "digits_cnn", "--cluster", "t4x1"),
    "netsim": ("--model", "digits_cnn", "--cluster", "t4x2"),
    "indicate": ("--model", "digits_cnn"),
    "solve": ("--model", "digits_cnn", "--cluster", "t4x1", "--out", "never.json"),
    "compare": ("--model", "digits_cnn", "--cluster", "t4x1"),
    "pareto": ("--model", "digits_cnn", "--cluster", "t4x1", "--out", "never.json"),
    "train": ("--model", "digits_cnn", "--out", "never"), "sweep": ("--model", "digits_cnn"),
    "profile": ("--model", "digits_cnn", "--out", "never.json"), "demo": (),
}
#: Values no numeric flag takes: beyond any bound, non-finite, unicode digits ('²' made a
#: ValueError traceback, '٣' and '３' read as 3), separators, fractions for counts, empty.
HOSTILE = ["1" + "0" * 30, "-" + "1" + "0" * 30, "99999999999999999999999", str(2**64),
           "nan", "NaN", "inf", "-inf", "1e999", "²", "٣", "３", "1_0", "0x10", "", " ",
           "1" * 5000]
INT_ONLY = ["1.5", "2e3"]


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _numeric_flags() -> list[tuple[str, str, Any]]:
    out = []
    for name, sp in _subparsers().items():
        for a in sp._actions:
            if a.option_strings and getattr(a.type, "bounds", None) is not None:
                out.append((name, a.option_strings[-1], a.type))
    return out


NUMERIC = _numeric_flags()


def _one_line(code: int, err: str) -> str:
    assert code == 2, err
    assert "Traceback" not in err and err.endswith("\n") and err.count("\n") == 1, err
    assert len(err.splitlines()) == 1, err
    return err.strip()


def test_every_numeric_flag_of_every_command_has_a_stated_bound() -> None:
    """No flag is typed plain ``int`` or ``float`` (train's --steps/--seed/--nproc, sweep's
    --steps/--batch/--eval-batches, profile's --repeats/--warmup/--threads were), and every
    flag whose default is a number has a bounded type."""
    assert len(NUMERIC) > 50
    for name, sp in _subparsers().items():
        for a in sp._actions:
            if not a.option_strings or a.nargs == 0:
                continue
            where = f"{name} {a.option_strings[-1]}"
            assert a.type not in (int, float), f"{where}: unbounded {a.type.__name__}"
            if isinstance(a.default, (int, float)) and not isinstance(a.default, bool):
                assert getattr(a.type, "bounds", None) is not None, f"{where}: no bound"
    for name, flag, typ in NUMERIC:
        lo, hi = typ.bounds
        assert lo is not None and hi is not None and hi <= 1e15, (name, flag)
        if typ.__name__ == "int":
            assert isinstance(lo, int) and isinstance(hi, int), (name, flag)


@pytest.fixture(scope="module")
def one_parser() -> argparse.ArgumentParser:
    """The command line's parser built once for the module: ``main`` builds the whole parser
    (every command's flags) on each call, most of what a refusal at parse time costs, and
    parsing leaves the parser as it was."""
    return build_parser()


@pytest.mark.parametrize(("command", "flag", "typ"), NUMERIC,
                         ids=[f"{c}{f}" for c, f, _ in NUMERIC])
def test_every_numeric_flag_refuses_hostile_values_in_one_line(
        command: str, flag: str, typ: Any, tmp_path: Path, monkeypatch,
        one_parser: argparse.ArgumentParser) -> None:
    """Each value: exit 2, one line naming the flag, at parse time (nothing written); the
    whole ``main`` runs, on the one parser (about 3,000 refusals)."""
    monkeypatch.setattr(cli, "build_parser", lambda: one_parser)
    monkeypatch.chdir(tmp_path)
    lo, hi = typ.bounds
    values = list(HOSTILE)
    if typ.__name__ == "int":
        values += INT_ONLY + [str(lo - 1), str(hi + 1)]
    for v in values:
        code, _, err = run_cli(command, *REQUIRED[command], f"{flag}={v}")
        line = _one_line(code, err)
        assert f"argument {flag}: expected" in line, (v, line)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("command", "flag", "value"), [
    ("replay", "--sync", "local:0"), ("replay", "--sync", "local:²"),
    ("replay", "--sync", "local:٣"), ("replay", "--sync", "local:" + "9" * 30),
    ("replay", "--sync", "qsr:alpha=nan,h_base=2"), ("replay", "--sync", "qsr:alpha=0.1,h_base=٣"),
    ("solve", "--sync", "qsr:alpha=0.1,h_base=" + "9" * 30),
    ("replay", "--lr-schedule", "step:every=٣"), ("replay", "--lr-schedule", "cosine:warmup=1e999"),
    ("replay", "--compress-act", "quant:²"), ("replay", "--compress-act", "quant:٣"),
    ("replay", "--compress-grad", "topk:٠.٥"), ("replay", "--compress-act", "topk:nan"),
    ("replay", "--link-gbps", "٣"), ("replay", "--link-gbps", "nan"), ("replay", "--link-gbps", "0"),
    ("replay", "--link-gbps", ",".join(["1"] * 65)),
    ("train", "--compress-act", "quant:²"), ("train", "--compress-grad", "quant:9"),
    ("train", "--sync", "local:0"), ("train", "--sync", "local:٣"),
    ("train", "--comm", "dlcp:p=٠.١"), ("train", "--comm", "dlcp:p=0.1,chunk_kib=1e999"),
    ("train", "--lr-schedule", "step:every=²"),
    ("sweep", "--seeds", "99999999999999999999999"), ("sweep", "--seeds", str(2**64)),
    ("sweep", "--seeds", f"-{2**64}"), ("sweep", "--seeds", "281474976710657"),
    ("sweep", "--seeds", "٣"), ("sweep", "--seeds", "0-99999"), ("sweep", "--seeds", "1_0"),
    ("sweep", "--lr", "٠.١"), ("sweep", "--lr", "nan"), ("sweep", "--wd", "-1"),
    ("sweep", "--lr", ",".join(["0.1"] * 5000)), ("sweep", "--lr-schedule", "step:every=٣"),
])
def test_spec_flags_read_ascii_numbers_in_range_when_parsed(command: str, flag: str, value: str,
                                                          tmp_path: Path, monkeypatch) -> None:
    """``--compress-act 'quant:²'`` was a ValueError traceback (replay) and a message that did
    not name the flag (train); ``--seeds 99999999999999999999999`` overflowed torch."""
    monkeypatch.chdir(tmp_path)
    extra = ("--pipeline-stages", "2") if flag in ("--compress-act", "--compress-grad",
                                                     "--link-gbps") else ()
    code, _, err = run_cli(command, *REQUIRED[command], *extra, f"{flag}={value}")
    line = _one_line(code, err)
    assert f"argument {flag}: " in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("argv", "flag"), [
    (("estimate", "--model", "digits_cnn", "--cluster", "t4x٣"), "cluster"),
    (("estimate", "--model", "digits_cnn", "--cluster", "t4x1@٣"), "cluster"),
    (("train", "--model", "digits_cnn", "--rank-groups", "٠:cpu", "--out", "never"),
     "--rank-groups"),
    (("train", "--model", "digits_cnn", "--rank-groups", f"{10**30}:cpu", "--out", "never"),
     "--rank-groups"),
])
def test_counts_inside_other_texts_are_ascii_too(argv: tuple[str, ...], flag: str,
                                                 tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    line = _one_line(*run_cli(*argv)[::2])
    assert f"{flag}: " in line, line
    assert list(tmp_path.iterdir()) == []


@given(st.text(max_size=12))
@settings(max_examples=300, deadline=None)
def test_the_number_readers_take_ascii_only(text: str) -> None:
    i, f = parse_int(text), parse_float(text)
    if i is not None:
        assert text.strip().lstrip("+-").isascii() and text.strip().lstrip("+-").isdigit()
        assert i == int(text)
    if f is not None:
        assert text.isascii() and "_" not in text and f == float(text) and f == f


# ----------------------------------------------------------------------------- rounds


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32))
def test_round_count_is_the_number_of_rounds(seed: int) -> None:
    rng = random.Random(seed)
    total = rng.randint(1, 500)
    mode = parse_sync(rng.choice([
        "ddp", f"local:{rng.randint(1, 60)}",
        f"qsr:alpha={rng.choice([0, 0.01, 0.1, 0.3, 2])},h_base={rng.randint(1, 9)},"
        f"power={rng.choice([0.5, 1, 2, 3])}"]))
    w = rng.randint(0, total - 1) if rng.random() < 0.5 else 0
    text = rng.choice([f"constant:warmup={w}", f"cosine:warmup={w},final={rng.random():.3f}",
                       f"step:every={rng.randint(1, 80)},gamma={rng.choice([0.1, 0.5, 1])},"
                       f"warmup={w}"])
    sch = parse_schedule(text, rng.choice([0.001, 0.05, 0.5]), total)
    assert round_count(mode, sch, total) == len(rounds(mode, sch, total))


@pytest.mark.parametrize("mode,schedule", [("local:1", "constant"),
                                           ("qsr:alpha=0.05,h_base=1", "cosine"),
                                           ("qsr:alpha=0.2,h_base=1", "cosine:final=0.001"),
                                           ("qsr:alpha=0.01,h_base=1", "step:every=1000")])
def test_a_run_at_the_step_limit_is_counted_not_listed(mode: str, schedule: str) -> None:
    """``replay --sync local:1 --steps 1e12`` grew to 2.5 GB listing rounds; the limit is
    now 1e9 steps, and even there the rounds are counted in O(lengths x log steps)."""
    from qsync_opt.replayer import sync_model_for

    sm = sync_model_for(mode, lr=0.05, lr_schedule=schedule, steps=MAX_STEPS)
    assert sm is not None and 1 <= sm.rounds <= MAX_STEPS and sm.steps == MAX_STEPS
    if mode == "local:1":
        assert sm.rounds == MAX_STEPS


# ----------------------------------------------------------------------------- ignored


REPLAY = ("replay", "--model", "digits_cnn", "--cluster", "cpux2")


@pytest.mark.parametrize("extra", [
    ("--sync", "local:2"), ("--sync", "ddp"), ("--steps", "5"), ("--lr", "0.1"),
    ("--lr-schedule", "cosine"), ("--comm-model", "netsim:p50"), ("--bucket-mb", "4"),
    ("--trace", "t.json"), ("--write-plans", "plans"), ("--optimizer", "adam"),
])
def test_replay_refuses_data_parallel_flags_with_a_pipeline(extra, tmp_path, monkeypatch) -> None:
    """``replay --pipeline-stages 2 --sync local:0`` exited 0, the flag unread."""
    monkeypatch.chdir(tmp_path)
    line = _one_line(*run_cli(*REPLAY, "--pipeline-stages", "2", *extra)[::2])
    assert f"{extra[0]}: not with --pipeline-stages" in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("extra", [
    ("--micro-batches", "2"), ("--compress-act", "quant:4"), ("--compress-grad", "topk:0.1"),
    ("--link-gbps", "10"), ("--latency-us", "5"), ("--cuts", "conv2"),
    ("--rank-groups", "0:cpu"),
])
def test_replay_refuses_pipeline_flags_without_one(extra, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    line = _one_line(*run_cli(*REPLAY, *extra)[::2])
    assert f"{extra[0]}: only with --pipeline-stages" in line, line


@pytest.mark.parametrize("argv,flag", [
    (("replay", "--model", "digits_cnn", "--cluster", "t4x1", "--steps", "5"), "--steps"),
    (("replay", "--model", "digits_cnn", "--cluster", "t4x1", "--sync", "ddp", "--lr", "1"),
     "--lr"),
    (("solve", *REQUIRED["solve"][:-2], "--out", "p.json", "--lr-schedule", "cosine"),
     "--lr-schedule"),
    (("solve", *REQUIRED["solve"][:-2], "--out", "p.json", "--solver", "nope"), "--solver"),
    (("solve", *REQUIRED["solve"][:-2], "--out", "p.json", "--budget", "0.1"), "--budget"),
    (("solve", *REQUIRED["solve"][:-2], "--out", "p.json", "--mode", "budget"),
     "--mode budget"),
    (("compare", *REQUIRED["compare"], "--solvers", "highs,nope"), "--solvers"),
    (("compare", *REQUIRED["compare"], "--solvers", "highs,highs"), "--solvers"),
    (("pareto", *REQUIRED["pareto"][:-2], "--out", "p.json", "--exact", "greedy"), "--exact"),
])
def test_bad_or_unused_planning_flags_are_refused_before_any_work(argv, flag, tmp_path,
                                                                  monkeypatch) -> None:
    """An unknown ``--solver`` was refused only after the trace and the indicator; a
    ``--steps`` without ``--sync`` was ignored."""
    import qsync_opt.cli.model as model_cmds
    import qsync_opt.cli.planning as planning

    def no_work(*a: Any, **k: Any) -> Any:
        raise AssertionError("traced before the refusal")

    monkeypatch.setattr(planning, "trace_args", no_work)
    monkeypatch.setattr(model_cmds, "trace_args", no_work)
    monkeypatch.chdir(tmp_path)
    line = _one_line(*run_cli(*argv)[::2])
    assert f"error: {flag}" in line, line
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- sweep, train


@pytest.fixture()
def no_training(monkeypatch) -> None:
    """The sweep's trainer raises. Patched where the sweep looks it up (its module binds the
    name at import): imported here first, so that a sweep module first imported during a test
    does not keep the trap for every later test of the process."""
    import qsync_opt.hfta.sweep as sweep
    import qsync_opt.hfta.trainer as trainer

    def boom(*a: Any, **k: Any) -> Any:
        raise AssertionError("trained before the refusal")

    monkeypatch.setattr(trainer, "ArrayTrainer", boom)
    monkeypatch.setattr(sweep, "ArrayTrainer", boom)


def test_the_training_trap_is_the_sweeps_and_is_undone(monkeypatch, no_training) -> None:
    import qsync_opt.hfta.sweep as sweep
    import qsync_opt.hfta.trainer as trainer

    with pytest.raises(AssertionError, match="trained before the refusal"):
        sweep.ArrayTrainer()
    monkeypatch.undo()
    assert sweep.ArrayTrainer is trainer.ArrayTrainer and isinstance(sweep.ArrayTrainer, type)


def test_sweep_refuses_unwritable_outputs_before_training(tmp_path, monkeypatch,
                                                          no_training) -> None:
    """``sweep --out FILE`` was refused after the training, without naming --out;
    ``--seeds 281474976710657 --export`` left a partial S/model0."""
    monkeypatch.chdir(tmp_path)
    Path("afile").write_text("x")
    Path("adir").mkdir()
    for extra, flag in ((("--out", "afile"), "--out"), (("--out", "afile/sub"), "--out"),
                        (("--json", "adir"), "--json"),
                        (("--seeds", "281474976710657", "--out", "S", "--export"), "--seeds"),
                        (("--seeds", "0-99", "--lr", ",".join(f"0.0{i}" for i in range(1, 10))
                          + ",0.1", "--wd", ",".join(str(i) for i in range(5))), "--seeds"),
                        (("--lr-schedule", "cosine:warmup=10", "--steps", "5"),
                         "--lr-schedule"),
                        (("--optimizer", "adamw", "--momentum", "0.5"), "--momentum")):
        line = _one_line(*run_cli("sweep", "--model", "digits_cnn", *extra)[::2])
        assert f"error: {flag}" in line or f"error: argument {flag}" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"]
    assert list(Path("adir").iterdir()) == []


def test_train_refuses_in_one_line_before_writing_anything(tmp_path, monkeypatch,
                                                           caplog) -> None:
    """The "plan groups with no rank" warning came before the refusal (two lines), and
    ``OUT/fp32.plan.json`` was written before it."""
    monkeypatch.chdir(tmp_path)
    for extra in (("--pipeline-stages", "20", "--rank-groups", "0:cpu,1:cpu"),
                  ("--nproc", "3", "--rank-groups", "0:cpu,1:cpu"),
                  ("--rank-groups", "0:cpu,1:nope"),
                  ("--lr-schedule", "cosine:warmup=9", "--steps", "5")):
        code, _, err = run_cli("train", "--model", "digits_cnn", "--cluster", "cpux1+cpu/2x1",
                               "--out", "run", "--emulate-dp", *extra)
        _one_line(code, err)
        assert not any(r.levelname == "WARNING" for r in caplog.records), caplog.text
        assert not Path("run").exists(), extra


# ----------------------------------------------------------------------------- model files


_BUILD = """
import torch
from torch import nn

def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(4, 8)
"""


@pytest.mark.parametrize("body,needle", [
    ("data = [1, 2]", "defines data as list"),
    ("loss = 3", "defines loss as int"),
    ("loss = 'mse'", "defines loss as str"),
    ("data = torch.randn(4, 8)", "defines data as Tensor"),
    ("def build():\n    return nn.ReLU(), torch.randn(4, 8)", "no trainable parameters"),
    ("def build():\n    m = nn.Linear(8, 4)\n    m.requires_grad_(False)\n"
     "    return m, torch.randn(4, 8)", "no trainable parameters"),
    ("def build():\n    return nn.Linear(8, 4), torch.randint(0, 5, (4, 8))",
     "fails on its own example inputs"),
    ("def build():\n    return nn.Embedding(4, 8), torch.randint(0, 9, (4, 3))",
     "fails on its own example inputs"),
])
def test_a_model_file_that_cannot_work_is_refused_in_one_line(body, needle, tmp_path,
                                                             monkeypatch) -> None:
    """``data = [1, 2]`` and ``loss = 3`` were silently replaced by the defaults; a module
    without parameters was a torch traceback; a Linear fed int64 was traced on shapes."""
    monkeypatch.chdir(tmp_path)
    Path("m.py").write_text(_BUILD + textwrap.dedent(body) + "\n")
    for command in ("graph", "indicate"):
        line = _one_line(*run_cli(command, "--model", "m.py:build", "--batches", "1")[::2]
                         if command == "indicate" else run_cli(command, "--model",
                                                              "m.py:build")[::2])
        assert needle in line, line


@pytest.mark.parametrize("loss", [
    "torch.tensor(out.sum().item())", "out.sum().detach()", "out.detach().mean()",
    "torch.zeros(())",
])
def test_a_detached_loss_is_refused_before_training(loss, tmp_path, monkeypatch) -> None:
    """A ``loss()`` returning a tensor without grad was a torch traceback in backward."""
    monkeypatch.chdir(tmp_path)
    Path("m.py").write_text(_BUILD + f"\ndef loss(out, batch):\n    return {loss}\n")
    for argv in (("train", "--model", "m.py:build", "--out", "run", "--dry-run"),
                 ("indicate", "--model", "m.py:build", "--batches", "1")):
        line = _one_line(*run_cli(*argv)[::2])
        assert "returned a tensor without grad" in line, line
    assert not Path("run").exists()


def test_a_model_path_that_is_no_regular_file_has_its_own_message(tmp_path,
                                                                  monkeypatch) -> None:
    """A ``/dev/zero`` link or a FIFO given as ``--model`` was "not found"."""
    monkeypatch.chdir(tmp_path)
    os.mkfifo("fifo.py")
    os.symlink("/dev/zero", "zero.py")
    os.symlink("fifo.py", "tofifo.py")
    Path("dir.py").mkdir()
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind("sock.py")
        for name in ("fifo.py", "zero.py", "tofifo.py", "dir.py", "sock.py"):
            for command in ("graph", "indicate"):
                line = _one_line(*run_cli(command, "--model", f"{name}:build")[::2])
                assert f"{name} is not a regular file" in line, line
    finally:
        s.close()
    line = _one_line(*run_cli("graph", "--model", "nope.py:build")[::2])
    assert "not found" in line
    os.symlink("nowhere.py", "dangling.py")
    line = _one_line(*run_cli("graph", "--model", "dangling.py:build")[::2])
    assert "not found" in line


_RANK_INPUT_ERROR = r'''
import sys
msg = "qsync-opt train: model: data(8, 0) batch 1 of m.py: input is a float32 tensor of shape [8, 9]"
print(msg, file=sys.stderr, flush=True)
print(msg, file=sys.stderr, flush=True)
print("W1205 08:33:22.719000 27343 torch/distributed/elastic/multiprocessing/api.py:1028] "
      "Sending process 1 closing signal SIGTERM", file=sys.stderr)
print("""Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : 2 (pid: 1234)
""", file=sys.stderr)
sys.exit(1)
'''


def test_a_ranks_input_error_is_the_one_line_of_the_refusal(tmp_path, monkeypatch) -> None:
    """A ``data()`` whose shape changes at batch 1 in a real two-rank run gave 51 lines
    (each rank's line, torchrun's log and traceback, the launcher's summary) and exit 1:
    now the rank's line, once, on stderr, exit 2 (as under ``--emulate-dp``). Other rank
    failures still show torchrun's report."""
    import sys

    from qsync_opt.job import launch

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launch, "local_command",
                        lambda path, n, port: [sys.executable, "-c", _RANK_INPUT_ERROR])
    code, out, err = run_cli("train", "--model", "digits_cnn", "--nproc", "2", "--steps", "2",
                             "--out", "run")
    line = _one_line(code, err)
    assert line.startswith("qsync-opt: error: model: data(8, 0) batch 1"), line
    assert "Traceback" not in out and "torch/distributed" not in out, out
    other = _RANK_INPUT_ERROR.replace("exitcode  : 2", "exitcode  : 1")
    monkeypatch.setattr(launch, "local_command",
                        lambda path, n, port: [sys.executable, "-c", other])
    code, out, err = run_cli("train", "--model", "digits_cnn", "--nproc", "2", "--steps", "2",
                             "--out", "run2")
    assert code == 1 and "Root Cause" in out and "rank 1 (cpu) failed first" in err, (out, err)


@pytest.mark.slow
def test_a_data_shape_change_in_a_two_rank_run_is_one_line(tmp_path, monkeypatch) -> None:
    """The repro itself, under torchrun (about 40 s on 2 cores)."""
    import subprocess
    import sys

    Path(tmp_path / "shape.py").write_text(_BUILD + textwrap.dedent("""
        def data(batch_size, seed):
            g = torch.Generator().manual_seed(seed)
            yield torch.randn(batch_size, 8, generator=g)
            while True:
                yield torch.randn(batch_size, 9, generator=g)
        """))
    proc = subprocess.run([sys.executable, "-m", "qsync_opt.cli", "train", "--model",
                           "shape.py:build", "--nproc", "2", "--steps", "3", "--out", "run"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = _one_line(proc.returncode, proc.stderr)
    assert "batch 1 of shape.py" in line and "Traceback" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("extra,flag", [
    (("--average-optimizer-state",), "--average-optimizer-state"),
    (("--optimizer", "adam", "--momentum", "0.5"), "--momentum"),
    (("--optimizer", "adamw", "--momentum", "0.9"), "--momentum"),
    (("--measure-memory", "5", "--steps", "5"), "--measure-memory"),
    (("--no-resume", "--resume-anyway"), "--resume-anyway"),
    (("--pipeline-stages", "2", "--compress-at-eval"), "--compress-at-eval"),
    (("--pipeline-stages", "2", "--feedback", "ef"), "--feedback"),
])
def test_train_refuses_a_setting_that_would_do_nothing(extra, flag, tmp_path,
                                                       monkeypatch) -> None:
    """``--average-optimizer-state`` under ddp was accepted silently; so were adam with a
    momentum, a memory step past the run, a feedback wrapper with nothing compressed."""
    monkeypatch.chdir(tmp_path)
    line = _one_line(*run_cli("train", "--model", "digits_cnn", "--out", "run", "--dry-run",
                              *extra)[::2])
    assert f"{flag}" in line, line
    assert not Path("run").exists()
    ok = {"--average-optimizer-state": ("--sync", "local:2", "--average-optimizer-state"),
          "--momentum": ("--momentum", "0.5")}.get(flag)
    if ok is not None:  # the same setting where it does something runs
        code, _, err = run_cli("train", "--model", "digits_cnn", "--out", "ok", "--dry-run",
                               *ok)
        assert code == 0, err


def test_a_note_never_comes_before_a_refusal(tmp_path, monkeypatch) -> None:
    """``--int4``'s "enabled on group(s)" note was written at once, so a refusal after it
    was two lines; it is written once the command has succeeded."""
    monkeypatch.chdir(tmp_path)
    base = ("--model", "digits_cnn", "--cluster", "v100x1+t4x1", "--int4")
    line = _one_line(*run_cli("replay", *base, "--pipeline-stages", "3")[::2])
    assert "--pipeline-stages 3" in line
    _one_line(*run_cli("solve", *base, "--method", "random", "--out", "p.json",
                       "--solver", "greedy", "--pin", "nosuch=fp16")[::2])
    code, _, err = run_cli("estimate", *base)
    assert code == 0 and err == "int4: enabled on group(s) t4; not on v100 (no INT4 peak)\n"


@pytest.mark.parametrize("field", ["steps", "checkpoint_every", "max_bad_steps",
                                   "eval_batches", "memory_step"])
def test_a_train_config_file_states_the_same_limits(field: str) -> None:
    """A hand-written train_config.json is the other way in: its counts are bounded too."""
    from pydantic import ValidationError

    from qsync_opt.runtime.config import TrainConfig

    doc: dict[str, Any] = {"workload": "digits_cnn", "plan_path": "p.json",
                           "rank_groups": ["cpu"], "steps": 10, "out_dir": "o"}
    doc[field] = 10**12
    with pytest.raises(ValidationError, match=r"<= (1000000000|100000)\b"):
        TrainConfig(**doc)


@pytest.mark.parametrize("space", ["\x1f", "\x1c", "\xa0", "\u2003", "\u3000", "\x85"])
def test_a_number_beside_a_non_ascii_or_control_space_is_refused(space: str) -> None:
    for text in (f"0{space}", f"{space}7", f"{space}1.5{space}"):
        assert parse_int(text) is None and parse_float(text) is None
    assert parse_int(" 7\t") == 7 and parse_float("\n1.5 ") == 1.5
