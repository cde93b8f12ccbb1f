"""The command line: outputs, files, and bad input as one line with exit code 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qsync_opt import CostTable, ModelGraph, Plan, SolveReport, load
from qsync_opt.cli import main
from qsync_opt.core.precision import Precision
from support.harness import run_cli


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_exit(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # what ran before is not this command's
    return run_cli(*argv)


def test_models_and_devices(capsys) -> None:
    code, out, _ = run(capsys, "models")
    assert code == 0 and "resnet50" in out and "tiny_gpt" in out
    code, out, _ = run(capsys, "models", "--json")
    assert {m["name"] for m in json.loads(out)} >= {"resnet50", "bert_base", "digits_cnn"}
    code, out, _ = run(capsys, "devices")
    assert code == 0 and "v100" in out and "h200" in out
    # the datasheet int8 peak is shown, and the runtime's rate the estimate uses beside it
    assert "h200 int8 125.6" in out and "h100_pcie int8 96.0" in out and "R1" in out
    code, out, _ = run(capsys, "devices", "--json")
    v100 = next(d for d in json.loads(out) if d["name"] == "v100")
    assert "int8" not in v100["precisions"]


def test_schema_command(capsys) -> None:
    code, out, _ = run(capsys, "schema", "Plan")
    assert code == 0 and json.loads(out)["title"] == "Plan"


def test_graph_and_estimate_write_documents(capsys, tmp_path, repo_root: Path) -> None:
    gfile = tmp_path / "g.json"
    code, out, _ = run(capsys, "graph", "--model", "digits_cnn", "--out", str(gfile), "--ops")
    assert code == 0 and "choosable 3" in out and "fc2" in out
    graph = load(gfile, ModelGraph)
    assert graph.workload == "digits_cnn" and graph.batch_size == 64
    cfile = tmp_path / "c.json"
    cluster = repo_root / "examples" / "qsync_paper.toml"
    code, out, _ = run(capsys, "estimate", "--model", "digits_cnn", "--cluster", str(cluster),
                       "--out", str(cfile))
    assert code == 0 and "v100" in out and "t4" in out
    costs = load(cfile, CostTable)
    assert costs.graph_hash == graph.structure_hash()
    code, out, _ = run(capsys, "estimate", "--model", "digits_cnn", "--cluster", "a100x8+t4x8",
                       "--json", "--batch", "16")
    assert json.loads(out)["schema_name"] == "CostTable"


BAD_INPUTS = [
    (["graph", "--model", "resnet5"], "known:"),
    (["estimate", "--model", "digits_cnn", "--cluster", "v100x4+x9x4"], "device"),
    (["estimate", "--model", "digits_cnn", "--cluster", "v100x4+zz9x4"], "unknown device 'zz9'"),
    (["estimate", "--model", "digits_cnn", "--cluster", "nonsense"], "DEVICExCOUNT"),
    (["graph", "--model", "digits_cnn", "--batch", "0"], "--batch"),
    (["graph", "--model", "digits_cnn", "--batch", "many"], "--batch"),
    (["schema", "Nope"], "unknown schema"),
    (["estimate", "--model", "digits_cnn", "--cluster", "missing.toml"], "not found"),
    (["graph"], "--model"),
    (["frobnicate"], "invalid choice"),
]


@pytest.mark.parametrize(("argv", "needle"), BAD_INPUTS)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle) -> None:
    code, out, err = run_exit(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize(("content", "suffix", "needle"), [
    ("[[groups]]\nname = 't4'\ndevice = 't4'\ncount = 2\ninter_node_bandwidth_gb_per_s = ",
     ".toml", "not valid TOML"),
    ('inter_node_bandwidth_gb_per_s = -3.0\n[[groups]]\nname = "t4"\ndevice = "t4"\ncount = 2\n',
     ".toml", "inter_node_bandwidth_gb_per_s"),
    ('{"groups": [{"name": "a", "device": "t4", "count": 2, "speed": 1}]}', ".json",
     "groups.0.speed"),
    ('{"groups": [{"name": "a", "device": "q9", "count": 2}]}', ".json", "groups.0.device"),
    ('{"groups": []}', ".json", "groups"),
])
def test_bad_cluster_files(capsys, tmp_path, content, suffix, needle) -> None:
    f = tmp_path / f"cluster{suffix}"
    f.write_text(content)
    out_file = tmp_path / "costs.json"
    out_file.write_text("previous contents")
    code, _, err = run_exit(capsys, "estimate", "--model", "digits_cnn", "--cluster", str(f),
                            "--out", str(out_file))
    assert code == 2 and err.count("\n") == 1 and needle in err, err
    assert out_file.read_text() == "previous contents"  # nothing written is lost


def test_user_model_from_the_cli(capsys, tmp_path) -> None:
    f = tmp_path / "mine.py"
    f.write_text("import torch\nfrom torch import nn\n"
                 "def build():\n    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), "
                 "nn.Linear(8, 2)), (torch.randn(5, 4),)\n")
    code, out, _ = run(capsys, "graph", "--model", f"{f}:build", "--json")
    assert code == 0 and json.loads(out)["batch_size"] == 5


@pytest.mark.slow
def test_console_script_exit_code_and_one_line(tmp_path) -> None:
    exe = shutil.which("qsync-opt", path=str(Path(sys.executable).parent))
    assert exe, "the qsync-opt console script is installed beside the interpreter"
    bad = tmp_path / "neg.toml"
    bad.write_text('inter_node_bandwidth_gb_per_s = -1\n[[groups]]\nname="t4"\ndevice="t4"\ncount=1\n')
    proc = subprocess.run([exe, "estimate", "--model", "digits_cnn", "--cluster", str(bad)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "inter_node_bandwidth_gb_per_s" in proc.stderr


@pytest.mark.slow
@pytest.mark.xdist_group("demo_part_2")  # the session's run: made once
def test_demo_plans_and_removes_the_straggler(demo_part_2) -> None:
    """The demo with the random indicator (fast): every allocator compared, a plan written."""
    code, out, _, tmp_path = demo_part_2
    assert code == 0
    assert "part 1" not in out
    assert "resnet50" in out and "v100x16+t4x16" in out
    # The plan written (with the random indicator the joint split's: nothing in the table
    # dominates it; its T4s end 1 ms after the V100s) all but ends the V100s' wait.
    import re

    m = re.search(r"the V100s (no longer wait for the T4s|still wait (\d+) ms for the T4s); "
                  r"(\d+) ms with every card at FP32", out)
    assert m is not None and (m.group(2) is None or int(m.group(2)) < 0.01 * int(m.group(3)))
    # One definition of the straggler (the group whose iteration ends last), with its reason.
    assert "straggler at FP32 (the group whose iteration ends last): t4 ends last" in out
    for name in ("highs", "cbc", "cpsat", "greedy", "uniform", "dynamic-batching",
                 "additive-ilp", "strong-only"):
        assert f" {name} " in out
    assert load(tmp_path / "graph.json", ModelGraph).workload == "resnet50"
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.provenance["status"] == "OPTIMAL"


@pytest.mark.slow
def test_demo_runs(capsys, tmp_path, monkeypatch) -> None:
    """The demo as `make demo` runs it: the qsync indicator on synthetic batches. Part 1 trains
    each plan once (A B, not A B B A) on a profile of 2 repeats: the same steps, half the runs
    (the repeat of a run adds only the spread figure, which a single run leaves out), and
    the fewest profile rounds that still give each entry its spread."""
    import functools

    from qsync_opt.cli import walkthrough as demo

    monkeypatch.setattr(demo, "local_job", functools.partial(demo.local_job, repeats=2,
                                                             rounds=1))
    code, out, _ = run(capsys, "demo", "--out", str(tmp_path), "--steps", "20")
    assert code == 0 and "indicator: qsync" in out
    assert "the V100s no longer wait for the T4s" in out
    # Part 1, the whole job on this CPU: profile, indicator on real data, every allocator,
    # two trained ranks, predicted against measured.
    for step in ("1. traced digits_cnn", "2. profiled on this CPU in context",
                 "3. qsync indicator on 10 real", "4. every allocator", "5. training two gloo",
                 "6. predicted", "load average"):
        assert step in out
    # the plan it trains is one nothing in its table dominates, and it says which and why
    assert "   the plan to train: " in out and " highs+split " in out
    # a verdict on a quiet machine, "NOT A RESULT" (with the reason) on a loaded or noisy one
    assert ("Measured: the plan's slowest rank" in out) != ("NOT A RESULT: " in out)
    assert Plan.load(tmp_path / "local_plan.json").workload == "digits_cnn"


def test_demo_gives_no_verdict_on_a_loaded_or_noisy_machine() -> None:
    from qsync_opt.cli.walkthrough import quiet_verdict

    assert quiet_verdict(0.3, 2, 0.01, 2) is None
    loaded = quiet_verdict(6.0, 2, 0.01, 2)
    assert loaded is not None and "loaded (load average 6.00 on 2 cores" in loaded
    noisy = quiet_verdict(0.3, 2, 0.12, 2)
    assert noisy is not None and "differ by 12.0%" in noisy
    assert quiet_verdict(0.3, 2, 0.12, 1) is None  # one run of each: no spread to judge


def test_solve_writes_a_plan_and_report(capsys, tmp_path) -> None:
    plan_path, report_path = tmp_path / "plan.json", tmp_path / "report.json"
    code, out, err = run(capsys, "solve", "--model", "digits_cnn", "--cluster", "l4x1+t4x1",
                         "--method", "random", "--solver", "highs", "--target-ms", "5",
                         "--out", str(plan_path), "--report", str(report_path))
    assert code == 0, err
    plan = Plan.load(plan_path)
    report = SolveReport.load(report_path)
    assert report.status == "OPTIMAL" and plan.provenance["solver"] == "highs"
    assert "makespan" in out and "wrote" in out
    code, out, _ = run(capsys, "solve", "--model", "digits_cnn", "--cluster", "l4x1+t4x1",
                       "--method", "random", "--solver", "greedy", "--acceptance", "linear",
                       "--out", str(plan_path), "--json")
    doc = json.loads(out)
    # The default target (the L4 at fp32, no straggler) is within the T4s' reach: greedy
    # finds a plan the evaluator accepts, with the L4 held at fp32.
    assert code == 0 and doc["evaluation"]["feasible"] is True
    assert doc["evaluation"]["violations"] == [] and doc["report"]["status"] == "FEASIBLE"
    plan = Plan.load(plan_path)
    assert set(plan.groups["l4"].precisions.values()) == {Precision.fp32}


def test_lower_reference_flag_and_the_note_on_a_target_that_frees_the_strong_group(
        capsys, tmp_path) -> None:
    path = tmp_path / "p.json"
    base = ("solve", "--model", "digits_cnn", "--cluster", "l4x1+t4x1", "--method", "random",
            "--solver", "highs", "--out", str(path))
    code, out, err = run(capsys, *base)
    assert code == 0, err
    assert Plan.load(path).provenance["held_at_reference"] == "l4"
    code, out, err = run(capsys, *base, "--lower-reference")
    assert code == 0, err
    assert Plan.load(path).provenance["held_at_reference"] == ""
    # A target below the L4's own fp32 time frees it, and the output says so.
    code, out, err = run(capsys, *base, "--target-ms", "0.35")
    assert code == 0, err
    assert "note: the target 0.350 ms is below the strong group(s)'" in out
    assert "l4 may be lowered too" in out
    assert Plan.load(path).provenance["held_at_reference"] == ""


def _no_indicator(monkeypatch) -> None:
    import qsync_opt.cli.planning as cli_planning
    import qsync_opt.indicator as ind

    def refuse(*args, **kwargs):
        raise AssertionError("indicate() was called: a model ran")

    monkeypatch.setattr(ind, "indicate", refuse)
    monkeypatch.setattr(cli_planning, "indicate", refuse)  # the command's own name for it


@pytest.mark.slow
def test_gpt2_xl_on_t4s_is_explained_without_running_the_model(capsys, tmp_path,
                                                               monkeypatch) -> None:
    """The 1.56 G-parameter model on T4s: 17.95 GiB of fp32 weights, gradients and optimizer
    state before any activation, more than a T4's 15 GiB, said before any indicator runs
    (it used to run the model on this CPU first and outgrow a 24 GB machine)."""
    _no_indicator(monkeypatch)
    code, out, err = run(capsys, "solve", "--model", "gpt2_xl", "--cluster", "h100x8+t4x8",
                         "--solver", "highs", "--out", str(tmp_path / "p.json"))
    lines = err.splitlines()
    assert code == 3 and "Traceback" not in err and out == ""  # infeasible: exit 3
    assert lines[0] == ("qsync-opt: error: no plan, found before computing the qsync "
                        "indicator (no model was run)")
    assert lines[1].startswith("  t4 (t4): 17.95 GiB fixed (fp32 weights, gradients, "
                               "optimizer state, buffers, context) exceed its 15.00 GiB")
    assert any("t4 (t4): needs 33.2 GiB at its least-memory plan" in line for line in lines)
    assert not (tmp_path / "p.json").exists()


def test_memory_infeasible_split_is_explained_before_the_indicator(capsys, tmp_path,
                                                                   monkeypatch) -> None:
    """The same class at a small cost: ResNet-50 with 400 samples per T4 (no plan fits 15
    GiB) exits 3 (infeasible) with the diagnosis and runs no model; the joint split, which
    may move samples off the T4s, checks only the fixed memory and goes on to the indicator."""
    _no_indicator(monkeypatch)
    argv = ("solve", "--model", "resnet50", "--cluster", "v100x16@64+t4x16@400",
            "--solver", "highs", "--out", str(tmp_path / "p.json"))
    code, _, err = run(capsys, *argv)
    assert code == 3 and "Traceback" not in err
    assert err.splitlines()[0].endswith("found before computing the qsync indicator "
                                        "(no model was run)")
    assert "t4 (t4): needs" in err and "at its least-memory plan, has 15.0 GiB" in err
    with pytest.raises(AssertionError, match="indicate\\(\\) was called"):
        main(list(argv) + ["--joint-split"])
    capsys.readouterr()


#: The command under an address-space limit ``argv[1]`` MiB above what the process holds once
#: torch is loaded (the command line itself loads torch only when a command needs it).
_LIMITED_CHILD = r"""
import resource, sys
import torch  # noqa: F401
from qsync_opt.cli import main
for line in open("/proc/self/status"):
    if line.startswith("VmSize:"):
        size = int(line.split()[1]) * 1024
extra = int(sys.argv[1]) * 2**20
resource.setrlimit(resource.RLIMIT_AS, (size + extra, resource.getrlimit(resource.RLIMIT_AS)[1]))
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_a_small_memory_limit_gives_the_indicator_refusal_line(tmp_path) -> None:
    """Under an address-space limit 400 MiB above what the process holds (prlimit --as),
    ResNet-18's qsync indicator at batch 8 (about 0.7 GiB) is refused in one line naming
    both figures and the cheaper choices, exit 2, before any model runs."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}  # no cached indicator
    proc = subprocess.run(
        [sys.executable, "-c", _LIMITED_CHILD, "400", "solve", "--model", "resnet18",
         "--cluster", "v100x1+t4x1", "--solver", "highs", "--out", str(tmp_path / "p.json")],
        capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    line = proc.stderr.strip()
    assert line.startswith("qsync-opt: error: indicator: the qsync indicator of resnet18 runs "
                           "the model on this CPU and needs about ")
    assert "GiB at batch 8 (weights" in line and "GiB available. Cheaper:" in line
    for choice in ("--indicator FILE", "--method random", "--indicator-batch", "fewer layers"):
        assert choice in line
    assert not (tmp_path / "p.json").exists()


def test_infeasible_target_says_what_would_work(capsys, tmp_path) -> None:
    code, _, err = run(capsys, "solve", "--model", "digits_cnn", "--cluster", "l4x1+t4x1",
                       "--method", "random", "--target-ms", "0.0001",
                       "--out", str(tmp_path / "p.json"))
    assert code == 3 and "no plan" in err.splitlines()[0]
    assert "fastest makespan reachable" in err and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()


def test_compare_json_rows(capsys, tmp_path) -> None:
    out_json = tmp_path / "rows.json"
    code, out, err = run(capsys, "compare", "--model", "digits_cnn", "--cluster", "l4x1+t4x1",
                         "--method", "random", "--solvers", "highs,cpsat,greedy,uniform",
                         "--json", str(out_json), "--plans", str(tmp_path / "plans"))
    assert code == 0, err
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["solver"] for r in rows] == ["highs", "cpsat", "greedy", "uniform"]
    for r in rows:
        assert {"solver", "status", "objective", "feasible", "makespan_ms",
                "replay_makespan_ms", "samples_per_s", "wall_s"} <= set(r)
    assert (tmp_path / "plans" / "highs.plan.json").exists()


def test_compare_and_solve_plan_for_the_sync_mode(capsys, tmp_path) -> None:
    """``compare``/``solve --sync``: the figures are for that mode: under Local
    SGD the gradient all-reduce is gone and one averaging is paid per round, so the default
    target (the strong group at fp32) falls; the JSON and the printout say which mode."""
    base = ("--model", "digits_cnn", "--cluster", "l4x1+t4x1", "--method", "random",
            "--solvers", "highs,uniform")
    docs = {}
    for sync in (None, "local:16", "qsr:alpha=0.02,h_base=2"):
        extra = () if sync is None else ("--sync", sync, "--lr-schedule", "cosine",
                                         "--steps", "160")
        out_json = tmp_path / f"{sync}.json"
        code, out, err = run(capsys, "compare", *base, *extra, "--json", str(out_json))
        assert code == 0, err
        docs[sync] = json.loads(out_json.read_text())
        if sync is not None:
            assert f"sync {sync}: " in out and docs[sync]["sync"]["mode"] == sync
    assert docs[None]["sync"] is None
    assert docs["local:16"]["sync"]["rounds"] == 10
    assert docs["local:16"]["target_ms"] < docs[None]["target_ms"]
    # QSR under a cosine decay syncs more often than every 16 steps but less than DDP
    assert 10 < docs["qsr:alpha=0.02,h_base=2"]["sync"]["rounds"] < 160
    assert (docs["local:16"]["target_ms"] <= docs["qsr:alpha=0.02,h_base=2"]["target_ms"]
            < docs[None]["target_ms"])
    code, out, err = run(capsys, "solve", *base[:6], "--solver", "highs", "--sync", "local:16",
                         "--steps", "160", "--out", str(tmp_path / "p.json"))
    assert code == 0, err
    assert "sync local:16: 10 rounds in 160 steps" in out
    for bad, field in ((("--sync", "local:0"), "--sync"), (("--sync", "qsr:alpha=x"), "--sync"),
                       (("--sync", "local:4", "--steps", "0"), "--steps")):
        code, _, err = run_exit(capsys, "compare", *base, *bad)
        assert code == 2 and err.count("\n") == 1, err  # refused when parsed, by the flag's type
        assert f"error: {field}: " in err or f"error: argument {field}: " in err, err


@pytest.mark.parametrize("args,field", [
    (["--solver", "nope"], "solver"),
    (["--headroom", "2"], "--headroom"),
    (["--pin", "conv1=int9"], "pinned"),
    (["--pin", "conv1"], "pin"),
    (["--reference", "int8"], "reference"),
    (["--time-limit", "-1"], "time-limit"),
])
def test_solve_bad_input_is_one_line(capsys, tmp_path, args, field) -> None:
    code, out, err = run_exit(capsys, "solve", "--model", "digits_cnn", "--cluster",
                              "l4x1+t4x1", "--method", "random", "--out",
                              str(tmp_path / "p.json"), *args)
    assert code == 2 and err.count("\n") == 1 and field in err, err
    assert not (tmp_path / "p.json").exists()


def test_replay_uniform_plans_trace_and_plan_files(capsys, tmp_path) -> None:
    trace_file = tmp_path / "t.json"
    plans = tmp_path / "plans"
    code, out, _ = run(capsys, "replay", "--model", "digits_cnn", "--cluster", "v100x2+t4x2",
                       "--trace", str(trace_file), "--write-plans", str(plans))
    assert code == 0 and "uniform-highest" in out and "critical path" in out
    written = sorted(p.name for p in tmp_path.iterdir())
    assert any(n.startswith("t.uniform-highest") for n in written)
    trace_doc = json.loads((tmp_path / "t.uniform-highest.json").read_text())
    assert trace_doc["traceEvents"]
    plan_file = plans / "uniform-highest.plan.json"
    code, out, _ = run(capsys, "replay", "--model", "digits_cnn", "--plan", str(plan_file),
                       "--json")
    summary = json.loads(out)["plan"]
    assert set(summary["groups"]) == {"v100", "t4"} and summary["iteration_ms"] > 0


def test_replay_refuses_a_plan_precision_the_card_lacks(capsys, tmp_path) -> None:
    from qsync_opt import load_cluster, save, trace
    from qsync_opt.problem.plan import make_plan

    graph = trace("digits_cnn")
    cluster = load_cluster("v100x2+t4x2")
    plan = make_plan(graph, cluster, {"v100": {"conv2": "int8"}})
    f = save(plan, tmp_path / "p.json")
    code, _, err = run_exit(capsys, "replay", "--model", "digits_cnn", "--plan", str(f))
    assert code == 2 and err.count("\n") == 1
    assert "group v100" in err and "conv2" in err and "allowed: fp32, fp16" in err
    code, _, err = run_exit(capsys, "replay", "--model", "resnet18", "--plan", str(f))
    assert code == 2 and "not" in err and "digits_cnn" in err
