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


def test_docs_say_what_the_code_does_not_its_history() -> None:
    """No issue numbers in the README, docs/ or the library's source and docstrings: they say
    what the code does; the dated history lives in benchmarks/results/."""
    found = [f"{p.relative_to(ROOT)}:{i + 1}"
             for p in [*_pages(), *_library_files()]
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
                   "Compressed pipelines", "Fused training arrays (HFTA)"):
        assert system in heads
    for history in sorted((ROOT / "benchmarks" / "results").glob("history_*.md")):
        assert f"(../benchmarks/results/{history.name})" in text, history.name


def test_readme_headline_figures_come_from_benchmarks() -> None:
    """Five headline figures, each linked to its section of BENCHMARKS.md, and every number in
    them printed there."""
    readme = (ROOT / "README.md").read_text()
    bench = (ROOT / "docs" / "BENCHMARKS.md").read_text().replace(",", "")
    section = readme.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    bullets = re.split(r"\n- ", section)[1:]
    assert len(bullets) == 5
    for bullet in bullets:
        assert "](docs/BENCHMARKS.md#" in bullet
        prose = re.sub(r"\]\([^)]*\)", "]", bullet)
        for number in re.findall(r"\d[\d,]*(?:\.\d+)?", prose):
            assert number.replace(",", "") in bench, number
