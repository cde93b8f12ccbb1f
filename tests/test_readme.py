"""The README's Python snippets run as written, and its commands exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_the_two_commands() -> None:
    text = README.read_text()
    assert "make demo" in text and "make test" in text
    assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs(index: int, capsys) -> None:
    exec(compile(SNIPPETS[index], f"README.md snippet {index}", "exec"), {})
    out = capsys.readouterr().out
    if "# [('0', 'choosable')" in SNIPPETS[index]:
        assert "[('0', 'choosable'), ('1', 'pass_through'), ('2', 'pinned')]" in out


def test_readme_cli_commands_parse() -> None:
    from qsync_opt.cli import build_parser

    parser = build_parser()
    shell = "\n".join(re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.S))
    lines = re.findall(r"^qsync-opt (.+?)(?:\s+#.*)?$", shell, flags=re.M)
    assert len(lines) >= 6
    for line in lines:
        argv = [a for a in line.split() if not a.startswith("[")]
        argv = [a for a in argv if not a.endswith("]")]
        parser.parse_args(argv)
