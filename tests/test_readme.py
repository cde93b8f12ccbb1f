"""The README's and docs/API.md's Python snippets run as written, and the commands of the README
and docs/CLI.md exist."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
API = ROOT / "docs" / "API.md"
CLI = ROOT / "docs" / "CLI.md"


def _blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(), flags=re.S)


SNIPPETS = [(p, i, code) for p in (README, API) for i, code in enumerate(_blocks(p, "python"))]


def test_readme_has_the_commands_and_one_example() -> None:
    text = README.read_text()
    for command in ("make demo", "make test", "make test-fast"):
        assert command in text
    assert len(_blocks(README, "python")) == 1
    assert len(_blocks(API, "python")) >= 8


def test_readme_is_a_front_door() -> None:
    """At most about 200 lines; a status table with a row and a doc per system; a map of docs/."""
    text = README.read_text()
    assert len(text.splitlines()) <= 220
    status = text.split("## Status", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in status.splitlines() if r.startswith("| ") and not r.startswith("| system")]
    assert len(rows) == 7  # allocation, Local SGD/QSR, DLCP, pipelines, HFTA, the strategy, elastic
    assert all("](docs/" in r for r in rows)
    docs_map = text.split("## The documents", 1)[1]
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in docs_map, page.name


@pytest.mark.parametrize("path,index,code", SNIPPETS,
                         ids=[f"{p.name}-{i}" for p, i, _ in SNIPPETS])
def test_snippet_runs(path: Path, index: int, code: str, capsys) -> None:
    exec(compile(code, f"{path.name} snippet {index}", "exec"), {})
    out = capsys.readouterr().out
    if "# [('0', 'choosable')" in code:
        assert "[('0', 'choosable'), ('1', 'pass_through'), ('2', 'pinned')]" in out


def _commands(path: Path) -> list[str]:
    shell = "\n".join(_blocks(path, "sh"))
    return re.findall(r"^qsync-opt (.+?)(?:\s+#.*)?$", shell, flags=re.M)


@pytest.mark.parametrize("path", [README, CLI], ids=["README.md", "CLI.md"])
def test_cli_commands_parse(path: Path) -> None:
    from qsync_opt.cli import build_parser

    parser = build_parser()
    lines = _commands(path)
    assert len(lines) >= 6
    for line in lines:
        argv = [a for a in line.split() if not a.startswith("[")]
        argv = [a for a in argv if not a.endswith("]")]
        parser.parse_args(argv)


def test_every_command_and_flag_is_in_the_cli_page() -> None:
    from qsync_opt.cli import build_parser

    text = CLI.read_text()
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, parser in sub.choices.items():
        if f"### qsync-opt {name}" not in text:
            missing.append(name)
        for action in parser._actions:
            flags = [f for f in action.option_strings if f.startswith("--") and f != "--help"]
            if flags and not any(f"`{f}" in text for f in flags):
                missing.append(f"{name} {flags[0]}")
    assert missing == []
