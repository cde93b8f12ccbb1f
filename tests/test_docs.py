"""The repository stands alone: every document it cites is in it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():
        return [ROOT / p for p in out.stdout.split()]
    return [p for p in ROOT.rglob("*") if ".venv" not in p.parts and p.is_file()]


def _texts() -> list[tuple[Path, str]]:
    out = []
    for p in _tracked():
        if p.suffix in (".py", ".md", ".toml", ".sh", ".cu", ".h", ".cpp") or p.name in (
                "Makefile", "run"):
            if p.exists():
                out.append((p, p.read_text(errors="replace")))
    return out


def test_no_file_points_outside_the_repository() -> None:
    outside = "../" + "shared"  # spelled in two parts so this file does not match itself
    bad = [f"{p.relative_to(ROOT)}:{i + 1}"
           for p, text in _texts() for i, line in enumerate(text.splitlines())
           if outside in line]
    assert bad == []


def test_cited_docs_exist() -> None:
    """`docs/X.md`, `COSTS.md`, `DEVICES.md` mentioned anywhere name files of docs/."""
    missing = []
    for p, text in _texts():
        for m in re.finditer(r"(?:docs/)?\b([A-Z][A-Z_]+\.md)\b", text):
            name = m.group(1)
            if name in ("README.md",):
                continue
            if not (ROOT / "docs" / name).exists() and not (ROOT / name).exists():
                missing.append(f"{p.relative_to(ROOT)}: {name}")
    assert missing == []


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    body = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", body, flags=re.M)}


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_markdown_links_resolve() -> None:
    """Every relative link of the README and docs/ names a file that exists, and a `#section`
    names a heading of that page."""
    missing = []
    for p in _pages():
        for m in re.finditer(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", p.read_text()):
            target, anchor = m.group(1), m.group(2)
            if "://" in target or target.startswith("mailto:"):
                continue
            path = (p.parent / target) if target else p
            if not path.exists():
                missing.append(f"{p.relative_to(ROOT)} -> {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                missing.append(f"{p.relative_to(ROOT)} -> {target}#{anchor}")
    assert missing == []


def _library_files() -> list[Path]:
    return sorted(p for folder in ("qsync_opt", "solvers", "models", "cuda")
                  for p in (ROOT / folder).rglob("*") if p.suffix in {".py", ".cu", ".cpp", ".h"})


def _suite_files() -> list[Path]:
    return sorted(p for folder in ("tests", "benchmarks") for p in (ROOT / folder).rglob("*.py"))


def test_docs_say_what_the_code_does_not_its_history() -> None:
    """No issue numbers in the README, docs/, the library's source and docstrings, nor the
    tests' and benchmarks' docstrings and comments: they say what the code does or what a
    test checks; the dated history lives in benchmarks/results/."""
    found = [f"{p.relative_to(ROOT)}:{i + 1}"
             for p in [*_pages(), *_library_files(), *_suite_files()]
             for i, line in enumerate(p.read_text().splitlines())
             if re.search(r"\bissues? #?\d+|\bissue-\d+", line, flags=re.I)]
    assert found == []


def test_benchmarks_is_the_current_figures() -> None:
    """BENCHMARKS.md stays a page of current figures (at most about 600 lines), one section per
    system, and links its history in benchmarks/results/ rather than pasting it."""
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert len(text.splitlines()) <= 650
    heads = set(re.findall(r"^## (.+)$", text, flags=re.M))
    for system in ("Allocation and the solvers", "Local SGD and QSR", "DLCP and the packet simulator",
                   "Compressed pipelines", "Fused training arrays (HFTA)",
                   "Elastic hybrid training"):
        assert system in heads
    for history in sorted((ROOT / "benchmarks" / "results").glob("history_*.md")):
        assert f"(../benchmarks/results/{history.name})" in text, history.name


def test_readme_headline_figures_come_from_benchmarks() -> None:
    """Six headline figures, each linked to its section of BENCHMARKS.md, and every number in
    them printed there."""
    readme = (ROOT / "README.md").read_text()
    bench = (ROOT / "docs" / "BENCHMARKS.md").read_text().replace(",", "")
    section = readme.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    bullets = re.split(r"\n- ", section)[1:]
    assert len(bullets) == 6
    for bullet in bullets:
        assert "](docs/BENCHMARKS.md#" in bullet
        prose = re.sub(r"\]\([^)]*\)", "]", bullet)
        for number in re.findall(r"\d[\d,]*(?:\.\d+)?", prose):
            assert number.replace(",", "") in bench, number


def _library_packages() -> set[str]:
    """The first names under ``qsync_opt``: its sub-packages and the three mapped folders."""
    inner = {p.parent.name for p in (ROOT / "qsync_opt").glob("*/__init__.py")}
    return inner | {"solvers", "models", "cuda"}


def _dotted_names(text: str, packages: set[str]) -> set[str]:
    """The library names a page cites: every ``qsync_opt.x.y``, every backticked ``pkg.x``
    whose first name is a package of the library (``sync.replicas.make_sync``), and every
    name a ``from qsync_opt... import`` line of its code imports."""
    names = {m.rstrip(".") for m in re.findall(r"\bqsync_opt(?:\.[A-Za-z_]\w*)+", text)}
    for tok in re.findall(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`", text):
        if tok.split(".")[0] in packages:
            names.add(f"qsync_opt.{tok}")
    for m in re.finditer(r"^[ \t]*from (qsync_opt[\w.]*) import (\([^)]*\)|[^\n#]*)", text,
                         flags=re.M):
        for name in m.group(2).strip("()").replace("\n", " ").split(","):
            name = name.split(" as ")[0].strip()
            if name:
                names.add(f"{m.group(1)}.{name}")
    return names


def _resolves(dotted: str) -> bool:
    """``dotted`` is a module, or a name reached from the longest module that imports (a
    class's field counts: a pydantic model's or a dataclass's)."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and (module + ".").startswith(exc.name + "."):
                continue  # this prefix is no module: try a shorter one
            raise
        for attr in parts[i:]:
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
                continue
            fields = (getattr(obj, "model_fields", None) or getattr(obj, "__dataclass_fields__", None)
                      or getattr(obj, "__annotations__", {}))
            return attr in fields
        return True
    return False


def _py_paths(text: str, tops: set[str]) -> set[str]:
    """The ``folder/file.py`` paths a page names whose first folder is one of ``tops``
    (placeholders such as ``path/to/mine.py`` and other projects' files are not ours)."""
    return {m for m in re.findall(r"(?<![\w/.-])((?:[\w-]+/)+[\w-]+\.py)\b", text)
            if m.split("/")[0] in tops}


def test_the_name_scanners_find_what_a_page_cites() -> None:
    packages = {"sync", "strategy", "planner"}
    text = ("`sync.replicas.make_sync` and `runtime.sync`, `report.rounds`, qsync_opt.planner.solve.\n"
            "```python\nfrom qsync_opt.strategy.modes import (parse_sync,\n    parse_comm)\n"
            "from qsync_opt.planner.solve import solve as s  # note\n```\n"
            "see tests/test_docs.py, strategy/modes.py, path/to/mine.py and vidur/x.py")
    assert _dotted_names(text, packages) == {
        "qsync_opt.sync.replicas.make_sync", "qsync_opt.planner.solve", "qsync_opt.strategy.modes",
        "qsync_opt.strategy.modes.parse_sync", "qsync_opt.strategy.modes.parse_comm",
        "qsync_opt.planner.solve.solve"}
    assert _py_paths(text, {"tests", "strategy"}) == {"tests/test_docs.py", "strategy/modes.py"}
    assert _resolves("qsync_opt.strategy.modes.parse_sync")
    assert _resolves("qsync_opt.documents.schemas.Plan.groups")  # a pydantic field
    assert not _resolves("qsync_opt.runtime.sync")  # a module that moved
    assert not _resolves("qsync_opt.strategy.modes.no_such_name")


def test_every_library_name_the_pages_cite_exists() -> None:
    """Every dotted library name in the README and docs/ (``qsync_opt.x.y``, a backticked
    ``package.module.name``, a ``from qsync_opt... import`` line) imports or resolves: a
    module that moved or a name that was renamed fails here, naming the page."""
    packages = _library_packages()
    missing = [f"{p.relative_to(ROOT)}: {name}"
               for p in _pages() for name in sorted(_dotted_names(p.read_text(), packages))
               if not _resolves(name)]
    assert missing == []


def test_every_source_path_the_pages_cite_exists() -> None:
    """Every ``folder/file.py`` of the repository that the README and docs/ name exists (a
    path under one of the library's packages may be given from ``qsync_opt/``)."""
    packages = _library_packages()
    tops = {"qsync_opt", "solvers", "models", "cuda", "tests", "benchmarks", "examples",
            *packages}
    missing = [f"{p.relative_to(ROOT)}: {path}"
               for p in _pages() for path in sorted(_py_paths(p.read_text(), tops))
               if not ((ROOT / path).exists() or (ROOT / "qsync_opt" / path).exists())]
    assert missing == []


def test_every_test_the_pages_name_exists() -> None:
    """A ``tests/x.py::test_name`` the README or docs/ cite as the proof of a promise is a
    function or class of that file."""
    missing = []
    for p in _pages():
        for path, name in set(re.findall(r"\b(tests/[\w/]+\.py)::(\w+)", p.read_text())):
            source = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
            if not re.search(rf"^\s*(?:async )?(?:def|class) {name}\b", source, flags=re.M):
                missing.append(f"{p.relative_to(ROOT)}: {path}::{name}")
    assert missing == []


def test_every_test_name_the_pages_cite_is_a_test() -> None:
    """A backticked ``test_...`` name in the README or docs/ is a test function of tests/ (a
    test renamed or removed fails here, naming the page)."""
    defined = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        defined |= set(re.findall(r"^\s*(?:async )?def (test_\w+)", path.read_text(), flags=re.M))
    missing = [f"{p.relative_to(ROOT)}: {name}" for p in _pages()
               for name in sorted(set(re.findall(r"`(test_\w+)`", p.read_text())))
               if name not in defined]
    assert missing == []


#: A cross-reference in a docstring: ``:mod:`.x```, ``:func:`~.x.f``` (relative to the
#: module's package).
_RELATIVE_REF = re.compile(r":(mod|func|class|data|meth|attr):`~?(\.[\w.]+)`")


def _library_modules() -> dict[str, Path]:
    packages = {"qsync_opt": "qsync_opt", "solvers": "qsync_opt.solvers",
                "models": "qsync_opt.models", "cuda": "qsync_opt.cuda"}
    out = {}
    for folder, package in packages.items():
        for p in (ROOT / folder).rglob("*.py"):
            parts = list(p.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = p
    return out


def test_docstrings_point_at_modules_that_exist() -> None:
    """Every relative cross-reference in a library docstring (``:mod:`.layers```) names a
    module of its own package, or a name its package defines: one that moved is written in
    full."""
    modules = _library_modules()
    broken = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for role, ref in _RELATIVE_REF.findall(line):
                dots = len(ref) - len(ref.lstrip("."))
                base = package
                for _ in range(dots - 1):
                    base = base.rpartition(".")[0]
                first = ref.lstrip(".").split(".")[0]
                target = f"{base}.{ref.lstrip('.')}"
                if role == "mod":
                    ok = target in modules
                else:
                    ok = f"{base}.{first}" in modules or re.search(
                        rf"\b{first}\b", modules[base].read_text()) is not None
                if not ok:
                    broken.append(f"{path.relative_to(ROOT)}:{i}: {ref}")
    assert broken == []
