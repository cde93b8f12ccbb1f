"""What may not ship in the wheel, told from a module's name and source: test code (a module
named like a test or a test helper, or one importing a test framework), and unpickling (a
call that turns bytes into arbitrary objects). Used on the package's sources and on the
built wheel's files (tests/test_wheel.py, tests/test_layout.py).
"""

from __future__ import annotations

import ast
import re
from pathlib import PurePosixPath

__all__ = ["PACKAGE_SOURCES", "find_test_code", "find_unpickling"]

#: The source folders that ship, installed as qsync_opt, qsync_opt.solvers, ...
PACKAGE_SOURCES = ("qsync_opt", "solvers", "models", "cuda")

#: Module names that are test code wherever they sit.
TEST_MODULE = re.compile(r"^(test_\w*|\w*_test|conftest|testing|harness|fixtures)\.py$")
#: Folders whose every file is test code.
TEST_FOLDERS = {"tests", "test", "testing", "support"}
#: Imported modules that only test code needs.
TEST_FRAMEWORKS = {"pytest", "hypothesis", "unittest", "_pytest", "doctest"}

#: Calls that unpickle, by the last two parts of their dotted name (``pickle.loads``) or the
#: last part alone for torch.distributed's object collectives (``dist.gather_object``).
UNPICKLING = {("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"),
              ("_pickle", "load"), ("_pickle", "loads"), ("marshal", "load"),
              ("marshal", "loads"), ("shelve", "open"), ("dill", "load"), ("dill", "loads"),
              ("cloudpickle", "load"), ("cloudpickle", "loads"), ("joblib", "load"),
              ("pandas", "read_pickle"), ("pd", "read_pickle"), ("yaml", "unsafe_load")}
OBJECT_COLLECTIVES = {"all_gather_object", "gather_object", "broadcast_object_list",
                      "scatter_object_list", "send_object_list", "recv_object_list"}


def find_test_code(path: str, source: str) -> list[str]:
    """Why the module at ``path`` (relative, ``/``-separated) with ``source`` is test code;
    empty when it is not."""
    p = PurePosixPath(path)
    out = [f"{path}: in a test folder ({part}/)" for part in p.parts[:-1]
           if part in TEST_FOLDERS]
    if TEST_MODULE.match(p.name):
        out.append(f"{path}: named like test code")
    for node in ast.walk(ast.parse(source, path)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                 else [])
        out += [f"{path}:{node.lineno}: imports {n}" for n in names
                if n.split(".")[0] in TEST_FRAMEWORKS]
    return out


def _dotted(node: ast.expr) -> list[str]:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1]


def _weights_only_true(call: ast.Call) -> bool:
    return any(k.arg == "weights_only" and isinstance(k.value, ast.Constant)
               and k.value.value is True for k in call.keywords)


def _allow_pickle(call: ast.Call) -> bool:
    return any(k.arg == "allow_pickle" and not (isinstance(k.value, ast.Constant)
                                                and k.value.value is False)
               for k in call.keywords)


def find_unpickling(path: str, source: str) -> list[str]:
    """The calls in ``source`` that unpickle: the pickle family's loads, torch.distributed's
    object collectives, ``torch.load`` without ``weights_only=True`` (written out: the
    default differs between torch versions), ``numpy.load(..., allow_pickle=...)``."""
    out = []
    for node in ast.walk(ast.parse(source, path)):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if not name:
            continue
        what = ".".join(name)
        if (tuple(name[-2:]) in UNPICKLING or name[-1] in OBJECT_COLLECTIVES
                or (name[-2:] == ["torch", "load"] and not _weights_only_true(node))
                or (name[-1] == "load" and name[:1] in (["np"], ["numpy"])
                    and _allow_pickle(node))):
            out.append(f"{path}:{node.lineno}: {what}(...)")
    return out
