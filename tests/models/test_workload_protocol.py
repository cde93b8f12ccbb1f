"""One Workload protocol for built-in models and user files: both meet it, where they differ
is a member each implements, and no module of the package checks for the user kind."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest
import torch
from qsync_opt.models import BuiltinWorkload, Workload, get_workload
from qsync_opt.models.user import UserWorkload

from qsync_opt.graph import resolve_workload

ROOT = Path(__file__).resolve().parents[2]
FILE = """
import torch
from torch import nn

def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3)), torch.randn(2, 4)
"""


@pytest.fixture
def user(tmp_path) -> UserWorkload:
    f = tmp_path / "mine.py"
    f.write_text(textwrap.dedent(FILE))
    wl = resolve_workload(f"{f}:build")
    assert isinstance(wl, UserWorkload)
    return wl


def test_both_kinds_meet_the_one_protocol(user) -> None:
    builtin = resolve_workload("digits_cnn")
    assert isinstance(builtin, BuiltinWorkload)
    for wl in (builtin, user):
        assert isinstance(wl, Workload)


def test_where_the_kinds_differ_each_says_so_itself(user, tmp_path) -> None:
    builtin = get_workload("digits_cnn")
    assert builtin.usage_lines() == [] and builtin.init_doc == "registry init"
    assert builtin.sha256 is None and builtin.code_digest is not None
    assert builtin.cache_name == "digits_cnn"
    assert [ln.split(":")[0] for ln in user.usage_lines()] == ["loss", "data"]
    assert user.init_doc == "build() of mine.py" and user.code_digest is None
    assert str(tmp_path) not in user.cache_name and user.sha256[:16] in user.cache_name


def test_sample_batches_pair_inputs_with_targets_or_none(user) -> None:
    (inputs, targets), = list(get_workload("resnet18_32").sample_batches(2, 1, 0))
    assert inputs[0].shape == (2, 3, 32, 32) and targets.shape == (2,)
    (x, none), = list(user.sample_batches(3, 1, 0))
    assert x.shape == (3, 4) and none is None


def test_trace_inputs_a_built_in_on_meta_a_file_on_its_real_example(user) -> None:
    setup = get_workload("digits_cnn").trace_inputs(4, include_loss=True)
    assert all(t.is_meta for t in setup.inputs) and setup.loss_fn is not None
    assert next(setup.model.parameters()).is_meta
    own = user.trace_inputs(user.default_batch, include_loss=True)
    assert own.model is user.model and own.loss_fn is None
    assert torch.equal(own.inputs, user.example)
    user.saw_outputs("seen")
    assert user.example_outputs == "seen"


def _isinstance_user_checks(text: str, label: str) -> list[str]:
    tree = ast.parse(text)
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2
                and "UserWorkload" in ast.unparse(node.args[1])):
            found.append(f"{label}:{node.lineno}")
    return found


def test_no_module_of_the_package_checks_for_the_user_kind() -> None:
    found = [hit for folder in ("qsync_opt", "models", "solvers", "cuda")
             for path in sorted((ROOT / folder).rglob("*.py"))
             for hit in _isinstance_user_checks(path.read_text(encoding="utf-8"),
                                                str(path.relative_to(ROOT)))]
    assert found == []


def test_the_scan_sees_such_a_check() -> None:
    text = "def f(wl):\n    return isinstance(wl, (int, user_model.UserWorkload))\n"
    assert _isinstance_user_checks(text, "probe.py") == ["probe.py:2"]
