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


def test_markdown_links_resolve() -> None:
    missing = []
    for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", p.read_text()):
            target = m.group(1)
            if "://" in target:
                continue
            if not (p.parent / target).exists():
                missing.append(f"{p.relative_to(ROOT)} -> {target}")
    assert missing == []
