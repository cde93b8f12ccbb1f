"""A user's own model file through every command (qsync_opt.models.user).

Files are written to tmp_path and run from another working directory than theirs; HF
BERT-for-QA is built from a small config with random weights (no downloads).
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.costs.cluster import parse_shorthand
from qsync_opt.documents.io import save
from qsync_opt.documents.schemas import OpRole, Plan
from qsync_opt.graph import load_user_workload, trace
from qsync_opt.problem.plan import check_plan, make_plan
from support.harness import run_cli

CLUSTER = "a100x1+t4x1"

POSITIONAL = """
import pathlib
import torch
from torch import nn
pathlib.Path(__file__).with_suffix(".imported").write_text("x")
def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 3))
    return model, (torch.randn(8, 6),)
"""

DICT_IO = """
import torch
from torch import nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.fc = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)
    def forward(self, input_ids, mask=None):
        h = self.emb(input_ids) * mask.unsqueeze(-1)
        h = torch.relu(self.fc(h)).mean(1)
        return {"scores": self.out(h), "hidden": h}
def build():
    torch.manual_seed(0)
    return Net(), {"input_ids": torch.randint(0, 40, (4, 7)),
                   "mask": torch.ones(4, 7)}
CALLS = []
def loss(outputs, batch):
    CALLS.append(1)
    return torch.nn.functional.cross_entropy(outputs["scores"], batch["input_ids"][:, 0] % 4)
def data(batch_size, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        yield {"input_ids": torch.randint(0, 40, (batch_size, 7), generator=g),
               "mask": (torch.rand(batch_size, 7, generator=g) > 0.2).float()}
"""

BERT = """
import torch
import transformers
def build():
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64,
                                  max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.BertForQuestionAnswering(cfg)
    b, s = 4, 12
    mask = torch.ones(b, s, dtype=torch.long)
    mask[:, -3:] = 0
    types = torch.zeros(b, s, dtype=torch.long)
    types[:, s // 2:] = 1
    return model, {"input_ids": torch.randint(0, 64, (b, s)), "token_type_ids": types,
                   "attention_mask": mask, "start_positions": torch.randint(0, s, (b,)),
                   "end_positions": torch.randint(0, s, (b,))}
"""


def _write(folder: Path, name: str, source: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    f = folder / name
    f.write_text(textwrap.dedent(source))
    return f


def _ok(*argv: Any) -> str:
    code, out, err = run_cli(*map(str, argv))
    assert code == 0, (argv, out, err)
    return out


def _refused(*argv: Any) -> str:
    code, out, err = run_cli(*map(str, argv))
    assert code == 2, (argv, code, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _mixed_plan(graph: Any, out: Path) -> Path:
    """A plan with int8 and bf16 Linears on the weak group, bf16 on the strong one."""
    names = [o.name for o in graph.choosable_ops()]
    assert len(names) >= 2
    plan = make_plan(graph, parse_shorthand(CLUSTER), {
        "a100": {n: "bf16" for n in names[::2]},
        "t4": {n: ("int8" if i % 2 else "fp16") for i, n in enumerate(names)}})
    return save(plan, out)


def _losses(run_dir: Path, rank: int = 0) -> list[float]:
    lines = (run_dir / f"metrics.rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(x)["loss"] for x in lines]


# ----------------------------------------------------------------------------- tracing


def test_keyword_inputs_reach_the_model_and_name_the_graph_inputs() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> Any:
            h = self.a(x) * scale
            return {"logits": self.b(h)}

    for method in ("fx", "function_mode"):
        g = trace(Net(), example_inputs={"x": torch.randn(3, 4), "scale": torch.ones(3, 4)},
                  method=method)
        assert [(i.name, i.shape) for i in g.inputs] == [("x", [3, 4]), ("scale", [3, 4])]
        assert g.op("a").role == OpRole.choosable and g.batch_size == 3


def test_bert_with_an_attention_mask_traces_on_real_tensors(tmp_path) -> None:
    pytest.importorskip("transformers")
    f = _write(tmp_path, "bert.py", BERT)
    g = trace(f"{f}:build")
    assert g.trace_method == "function_mode_real"  # BERT reads the mask's values
    assert [i.name for i in g.inputs] == ["input_ids", "token_type_ids", "attention_mask",
                                          "start_positions", "end_positions"]
    assert len(g.choosable_ops()) >= 12  # 6 Linears per layer (SDPA's matmuls: part A)
    assert g.workload == f"{f.resolve()}:build" and g.workload_sha256


def test_a_user_file_at_another_batch_is_traced_on_synthetic_inputs(tmp_path) -> None:
    f = _write(tmp_path, "d.py", DICT_IO)
    wl = load_user_workload(f"{f}:build")
    g = trace(wl, 3)
    assert g.batch_size == 3 and [i.shape for i in g.inputs] == [[3, 7], [3, 7]]
    x = wl.make_inputs(50, "cpu", seed=1)
    assert x["input_ids"].dtype == torch.int64 and x["input_ids"].shape == (50, 7)
    assert 0 <= int(x["input_ids"].min()) and int(x["input_ids"].max()) <= 39
    assert torch.equal(x["mask"], torch.ones(50, 7))  # std 0: the example's constant
    assert torch.equal(wl.make_inputs(5, "cpu", 2)["input_ids"],
                       wl.make_inputs(5, "cpu", 2)["input_ids"])  # seeded


def test_default_losses_for_dataclass_dict_and_tensor_outputs(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    from qsync_opt.models.user import default_loss, default_loss_kind

    out = transformers.modeling_outputs.QuestionAnsweringModelOutput(
        start_logits=torch.randn(2, 5), end_logits=torch.randn(2, 5))
    batch = {"input_ids": torch.zeros(2, 5), "start_positions": torch.tensor([1, 2]),
             "end_positions": torch.tensor([3, 4])}
    assert default_loss_kind(out, batch) == "qa"
    ref = (nn.functional.cross_entropy(out.start_logits, batch["start_positions"])
           + nn.functional.cross_entropy(out.end_logits, batch["end_positions"])) / 2
    assert torch.allclose(default_loss(out, batch), ref)
    with_loss = transformers.modeling_outputs.SequenceClassifierOutput(
        loss=torch.tensor(1.5), logits=torch.randn(2, 3))
    assert default_loss(with_loss, batch) == 1.5
    logits = torch.randn(4, 3)
    labelled = {"x": torch.randn(4, 2), "labels": torch.tensor([0, 1, 2, 0])}
    assert torch.allclose(default_loss({"logits": logits}, labelled),
                          nn.functional.cross_entropy(logits, labelled["labels"]))
    # No labels: synthetic class ids, a sample's always the same (keyed by its content).
    x = torch.randn(4, 2)
    a = default_loss((logits,), (x,))
    assert torch.isfinite(a) and a == default_loss(logits, (x.clone(),))
    assert default_loss_kind(logits, (x,)) == "synthetic"


# ----------------------------------------------------------------------------- every command


def test_every_command_on_a_user_file_from_other_folders(tmp_path, monkeypatch) -> None:
    src = _write(tmp_path / "src", "mine.py", POSITIONAL)
    marker = src.with_suffix(".imported")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    spec = "../src/mine.py:build"
    out = _ok("graph", "--model", spec, "--out", "g.json")
    assert "loss: default: cross-entropy of the logits against synthetic class targets" in out
    assert "data: synthetic batches" in out
    assert json.loads(Path("g.json").read_text())["workload"] == f"{src.resolve()}:build"
    _ok("estimate", "--model", spec, "--cluster", CLUSTER)
    out = _ok("indicate", "--model", spec, "--batches", "2", "--batch", "4")
    assert "synthetic data, 2 batches of 4" in out and "loss: default" in out
    _ok("solve", "--model", spec, "--cluster", CLUSTER, "--indicator-batches", "2",
        "--out", "p.json")  # the indicator computed as for built-ins
    plan = Plan.load("p.json")
    assert plan.workload == f"{src.resolve()}:build" and plan.workload_sha256
    _ok("compare", "--model", spec, "--cluster", CLUSTER, "--indicator-batches", "2",
        "--solvers", "greedy,uniform")
    _ok("pareto", "--model", spec, "--cluster", CLUSTER, "--indicator-batches", "2",
        "--points", "2", "--no-split", "--out", "front.json")
    out = _ok("train", "--model", spec, "--plan", "p.json", "--emulate-dp", "--steps", "3",
              "--out", "run")
    assert "trained 3 steps on 2 rank(s)" in out and "loss: default" in out
    assert all(math.isfinite(v) for v in _losses(work / "run"))
    # Another folder: the plan names the file by its absolute path.
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.chdir(other)
    _ok("report", "--plan", "../work/p.json", "--model", "../src/mine.py:build")
    marker.unlink()
    out = _ok("report", "--plan", "../work/p.json", "--graph", "../work/g.json")
    assert "a100" in out
    assert not marker.exists()  # the traced graph is reused: the file was not imported
    _ok("train", "--model", f"{src}:build", "--plan", "../work/p.json", "--steps", "1",
        "--out", "dry", "--dry-run")


def test_report_graph_refuses_another_graph(tmp_path, monkeypatch) -> None:
    src = _write(tmp_path, "mine.py", POSITIONAL)
    g8, g4 = trace(f"{src}:build"), trace(f"{src}:build", 4)
    save(g4, tmp_path / "g4.json")
    plan = save(make_plan(g8, parse_shorthand(CLUSTER), {}), tmp_path / "p.json")
    err = _refused("report", "--plan", plan, "--graph", tmp_path / "g4.json")
    assert "plan batch 8, graph batch 4" in err


def test_the_files_data_and_loss_are_used(tmp_path, monkeypatch) -> None:
    _write(tmp_path / "src", "d.py", DICT_IO)
    monkeypatch.chdir(tmp_path)
    spec = "src/d.py:build"
    out = _ok("indicate", "--model", spec, "--batches", "2")
    assert "real data, 2 batches of 4" in out
    assert "loss: loss(outputs, batch) from d.py" in out
    assert "data: data(batch_size, seed) from d.py" in out
    g = trace(spec)
    assert [o.name for o in g.choosable_ops()] == ["fc"]  # the head "out" is pinned
    plan = save(make_plan(g, parse_shorthand(CLUSTER), {"t4": {"fc": "int8"}}),
                tmp_path / "p.json")
    out = _ok("train", "--model", spec, "--plan", plan, "--emulate-dp", "--steps", "4",
              "--out", "run")
    assert "loss: loss(outputs, batch) from d.py" in out and "data: data(" in out
    assert all(math.isfinite(v) for v in _losses(tmp_path / "run"))


# ----------------------------------------------------------------------------- HF BERT


@pytest.fixture()
def bert_plan(tmp_path) -> dict[str, Any]:
    pytest.importorskip("transformers")
    src = _write(tmp_path / "src", "bert.py", BERT)
    work = tmp_path / "work"
    work.mkdir()
    code, out, err = run_cli("solve", "--model", str(src) + ":build", "--cluster", CLUSTER,
                             "--indicator-batches", "1", "--out", str(work / "solved.json"))
    assert code == 0, err  # no --indicator: computed on the user's file
    graph = trace(f"{src}:build")
    return {"src": src, "work": work, "plan": _mixed_plan(graph, work / "mixed.json")}


def test_bert_qa_trains_under_a_mixed_plan_with_falling_loss(bert_plan, monkeypatch) -> None:
    monkeypatch.chdir(bert_plan["work"])
    out = _ok("train", "--model", "../src/bert.py:build", "--plan", "mixed.json",
              "--emulate-dp", "--steps", "3", "--lr", "0.05", "--out", "run")
    assert "loss: the model's own loss (outputs.loss)" in out
    losses = _losses(bert_plan["work"] / "run")
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0], losses
    plan = Plan.load("mixed.json")
    assert {p.value for p in plan.groups["t4"].precisions.values()} == {"int8", "fp16"}


@pytest.mark.slow
def test_bert_qa_trains_on_two_ranks_with_torchrun(bert_plan, monkeypatch) -> None:
    monkeypatch.chdir(bert_plan["work"])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = _ok("train", "--model", "../src/bert.py:build", "--plan", "mixed.json",
              "--nproc", "2", "--steps", "3", "--out", "run2", "--timeout", "60")
    assert "trained 3 steps on 2 rank(s)" in out
    losses = _losses(bert_plan["work"] / "run2")
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert len(_losses(bert_plan["work"] / "run2", 1)) == 3  # rank 1 (t4, int8) stepped too


# ----------------------------------------------------------------------------- bad files


BAD_FILES = {
    "no build": ("import torch\n", "has no function 'build'"),
    "build raises": ("def build():\n    raise ValueError('boom')\n", "raised ValueError: boom"),
    "wrong return": ("def build():\n    return 3\n", "must return (nn.Module, example_inputs)"),
    "inputs not tensors": ("import torch\ndef build():\n    return torch.nn.Linear(2, 2), "
                           "{'x': [1, 2]}\n", "example_inputs['x']: expected a tensor"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_files_are_refused_in_one_line_before_anything_starts(case, tmp_path,
                                                                  monkeypatch) -> None:
    source, needle = BAD_FILES[case]
    f = _write(tmp_path, "bad.py", source)
    monkeypatch.chdir(tmp_path)
    for argv in (["graph", "--model", f"{f}:build"],
                 ["indicate", "--model", f"{f}:build", "--batches", "1"],
                 ["solve", "--model", f"{f}:build", "--cluster", CLUSTER, "--out", "p.json"]):
        assert needle in _refused(*argv)
    assert not (tmp_path / "p.json").exists()


def _good_then_bad(tmp_path: Path, extra: str) -> tuple[Path, Path]:
    """A file that plans fine, then the same model with a bad data() or loss() and a plan
    made from it (so train reaches its checks)."""
    f = _write(tmp_path, "m.py", POSITIONAL + extra)
    graph = trace(f"{f}:build")
    plan = save(make_plan(graph, parse_shorthand(CLUSTER), {}), tmp_path / "p.json")
    return f, plan


@pytest.mark.parametrize("extra, needle", [
    ("def data(batch_size, seed):\n    yield (torch.randn(batch_size, 5),)\n",
     "input 0 is a float32 tensor of shape [16, 5], expected a float32 tensor of shape [16, 6]"),
    ("def data(batch_size, seed):\n    yield {'x': torch.randn(batch_size, 6)}\n",
     "is a dict, not a tuple like the example inputs"),
    ("def loss(outputs, batch):\n    return outputs.sum(1)\n",
     "loss(outputs, batch) of m.py returned a float32 tensor of shape [2], not a scalar"),
    ("def loss(outputs, batch):\n    raise KeyError('labels')\n",
     "loss(outputs, batch) of m.py raised KeyError"),
])
def test_bad_data_or_loss_refused_before_train_starts(extra, needle, tmp_path,
                                                      monkeypatch) -> None:
    f, plan = _good_then_bad(tmp_path, extra)
    monkeypatch.chdir(tmp_path)
    for argv in (["train", "--model", f"{f}:build", "--plan", plan, "--out", "run",
                  "--emulate-dp", "--steps", "2"],
                 ["train", "--model", f"{f}:build", "--plan", plan, "--out", "run",
                  "--nproc", "2", "--steps", "2"]):
        assert needle in _refused(*argv)
        assert not (tmp_path / "run").exists()  # nothing written, no torchrun
    assert needle.split(" of m.py")[0] in _refused("indicate", "--model", f"{f}:build",
                                                   "--batches", "1", "--batch", "16")


def test_train_refuses_a_changed_file_before_running_it(tmp_path, monkeypatch) -> None:
    f, plan = _good_then_bad(tmp_path, "")
    f.write_text(f.read_text() + "\n# changed\n")
    marker = f.with_suffix(".imported")
    marker.unlink()
    err = _refused("train", "--model", f"{f}:build", "--plan", plan, "--out",
                   tmp_path / "run", "--emulate-dp")
    assert "not the file the plan was made from" in err and not marker.exists()


# ----------------------------------------------------------------------------- batch message


def test_a_graph_at_another_batch_is_named_as_such(tmp_path) -> None:
    from qsync_opt.runtime import apply_plan

    f = _write(tmp_path, "mine.py", POSITIONAL)
    plan = make_plan(trace(f"{f}:build"), parse_shorthand(CLUSTER), {})
    other = trace(f"{f}:build", 2)
    with pytest.raises(QsyncInputError, match=r"the batch differs \(plan batch 8, graph "
                                              r"batch 2\)"):
        check_plan(plan, other)
    model = load_user_workload(f"{f}:build").model
    with pytest.raises(QsyncInputError, match="plan batch 8, graph batch 2"):
        apply_plan(model, plan, "t4", graph=other)


def test_examples_as_a_tensor_a_list_or_a_dict_are_one_protocol(tmp_path) -> None:
    for ex in ("torch.randn(3, 6)", "[torch.randn(3, 6)]", "{'input': torch.randn(3, 6)}"):
        src = ("import torch\nfrom torch import nn\nclass M(nn.Module):\n"
               "    def __init__(self):\n        super().__init__()\n"
               "        self.l = nn.Linear(6, 4)\n        self.h = nn.Linear(4, 2)\n"
               "    def forward(self, input):\n        return self.h(self.l(input))\n"
               f"def build():\n    return M(), {ex}\n")
        f = _write(tmp_path, f"e{abs(hash(ex))}.py", src)
        wl = load_user_workload(f"{f}:build")
        assert trace(wl).batch_size == 3
        b = next(iter(wl.batches(5, 1, 0)))
        out = wl.forward(wl.model, b if isinstance(b, dict) else (
            (b,) if isinstance(b, torch.Tensor) else tuple(b)))
        assert out.shape == (5, 2)
        assert wl.check(5).startswith("loss: default")
