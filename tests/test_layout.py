"""Package layout: models/, solvers/ and cuda/ ship only as qsync_opt.models/.solvers/.cuda.

The source folders sit at the repository root but are mapped into the ``qsync_opt``
namespace by ``[tool.setuptools] package-dir``; a bare ``import models`` would only work from
a checkout's root and would break (or pick up someone else's ``models``) once installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import qsync_opt.cuda

from support.product import find_test_code, find_unpickling

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ["qsync_opt", "solvers", "models", "cuda", "tests", "benchmarks"]
BARE_IMPORT = re.compile(r"^\s*(from|import) (models|solvers)(\.|\s|$)", re.MULTILINE)


def _python_files() -> list[Path]:
    files: list[Path] = []
    for folder in SCANNED:
        base = ROOT / folder
        if base.is_dir():
            files.extend(p for p in base.rglob("*.py") if "__pycache__" not in p.parts)
    return sorted(files)


def test_regex_catches_what_it_should() -> None:
    # The scanner itself: bare imports match, namespaced and relative ones do not.
    for bad in ["import models", "from models import x", "  from solvers.x import y",
                "import solvers\n", "from models.resnet import resnet18"]:
        assert BARE_IMPORT.search(bad), bad
    for ok in ["from qsync_opt.models import x", "from . import models", "import modelsx",
               "from .solvers import y", "# import models", "x = 'from models'"]:
        assert not BARE_IMPORT.search(ok), ok


def test_no_bare_models_or_solvers_imports() -> None:
    files = _python_files()
    assert any(p.parent.name == "models" for p in files)  # the scan sees the sources
    offenders = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        for m in BARE_IMPORT.finditer(text):
            line = text[: m.start()].count("\n") + 1
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0).strip()}")
    assert offenders == []


_PROBE = """
import importlib, importlib.util, json
out = {"models": importlib.util.find_spec("models") is not None,
       "solvers": importlib.util.find_spec("solvers") is not None}
for name in ("qsync_opt.models", "qsync_opt.solvers", "qsync_opt.cuda"):
    mod = importlib.import_module(name)
    out[name] = mod.__name__
from qsync_opt.models import list_workloads
from qsync_opt.solvers import registry
out["workloads"] = len(list_workloads())
out["registry"] = isinstance(registry(), dict)
print(json.dumps(out))
"""


def test_only_namespaced_packages_import_outside_the_checkout(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["models"] is False
    assert out["solvers"] is False
    assert out["qsync_opt.models"] == "qsync_opt.models"
    assert out["qsync_opt.solvers"] == "qsync_opt.solvers"
    assert out["qsync_opt.cuda"] == "qsync_opt.cuda"
    assert out["workloads"] == 12
    assert out["registry"] is True


def test_cuda_source_dir() -> None:
    src = qsync_opt.cuda.source_dir()
    assert src.is_dir()
    assert src.is_absolute()
    assert (src / "__init__.py").is_file()
    assert src == Path(qsync_opt.cuda.__file__).resolve().parent


def test_package_dir_mapping_in_pyproject() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"] == {
        "qsync_opt": "qsync_opt",
        "qsync_opt.solvers": "solvers",
        "qsync_opt.models": "models",
        "qsync_opt.cuda": "cuda",
    }
    assert set(cfg["package-dir"]) <= set(cfg["packages"])
    for package in cfg["packages"]:
        # A package is mapped itself, or sits in the folder of the package it is under.
        parts = package.split(".")
        for cut in range(len(parts), 0, -1):
            base = ".".join(parts[:cut])
            if base in cfg["package-dir"]:
                folder = ROOT / cfg["package-dir"][base] / "/".join(parts[cut:])
                break
        assert (folder / "__init__.py").is_file(), package
    assert (ROOT / "qsync_opt" / "py.typed").is_file()


def _copy_sources(dst: Path) -> None:
    """What a build reads: pyproject, the README it names, and each package folder."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    shutil.copy2(ROOT / "pyproject.toml", dst / "pyproject.toml")
    readme = project["project"].get("readme")
    if isinstance(readme, str) and (ROOT / readme).is_file():
        shutil.copy2(ROOT / readme, dst / readme)
    for folder in set(project["tool"]["setuptools"]["package-dir"].values()):
        shutil.copytree(ROOT / folder, dst / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))


@pytest.mark.slow
def test_wheel_contents(tmp_path: Path) -> None:
    # --no-build-isolation builds with this venv's setuptools. Its own bdist_wheel
    # (setuptools >= 70.1) replaces the separate `wheel` package, which then is not
    # importable on its own (only from setuptools/_vendor once setuptools is imported).
    # (`make setup` installs both; under CI=true a venv without them fails, never skips)
    skip = pytest.fail if os.environ.get("CI") == "true" else pytest.skip
    if importlib.util.find_spec("setuptools") is None:
        skip("setuptools is not importable in this venv; cannot build without isolation")
    if (importlib.util.find_spec("wheel") is None
            and importlib.util.find_spec("setuptools.command.bdist_wheel") is None):
        skip("neither `wheel` nor setuptools' bdist_wheel is importable in this venv")
    # Build from a copy so the in-tree build/ and *.egg-info never touch the checkout.
    src = tmp_path / "src"
    src.mkdir()
    _copy_sources(src)
    out = tmp_path / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (whl,) = out.glob("qsync_opt-*.whl")
    with zipfile.ZipFile(whl) as zf:
        entries = zf.namelist()
    for needed in ("qsync_opt/models/resnet.py", "qsync_opt/solvers/__init__.py",
                   "qsync_opt/cuda/__init__.py", "qsync_opt/py.typed",
                   "qsync_opt/models/tiny_gpt.py", "qsync_opt/__init__.py",
                   "qsync_opt/ops/csrc/qsync_cpu.cpp", "qsync_opt/cuda/qsync_kernels.cu",
                   "qsync_opt/cuda/qsync_kernels.h", "qsync_opt/ops/reference.py"):
        assert needed in entries, needed
    # Every subpackage of the checkout ships (a package missing from pyproject's list once
    # left the whole runtime out of the wheel).
    repo = Path(__file__).resolve().parents[1]
    for init in (repo / "qsync_opt").rglob("__init__.py"):
        rel = init.relative_to(repo).as_posix()
        if "__pycache__" not in rel:
            assert rel in entries, f"{rel} missing from the wheel: add it to pyproject's packages"
    top = {e.split("/", 1)[0] for e in entries}
    assert not {"models", "solvers", "cuda", "tests"} & top
    # the product only: no test code, nothing that unpickles (tests/support/product.py)
    with zipfile.ZipFile(whl) as zf:
        found = [r for e in entries if e.endswith(".py")
                 for src in [zf.read(e).decode()]
                 for r in find_test_code(e, src) + find_unpickling(e, src)]
    assert not found, "; ".join(found)
    assert top == {"qsync_opt", "qsync_opt-0.1.0.dist-info"}
    with zipfile.ZipFile(whl) as zf:
        top_level = zf.read("qsync_opt-0.1.0.dist-info/top_level.txt").decode().split()
        entry_points = zf.read("qsync_opt-0.1.0.dist-info/entry_points.txt").decode()
    assert top_level == ["qsync_opt"]
    assert "qsync-opt = qsync_opt.cli:main" in entry_points


def test_version_is_said_once() -> None:
    """The package's version (``qsync_opt.core.version``) is pyproject.toml's."""
    import tomllib

    import qsync_opt
    from qsync_opt.core.version import __version__

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert qsync_opt.__version__ == __version__ == project["version"]
