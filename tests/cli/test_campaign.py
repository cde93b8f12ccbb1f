"""The bad-input campaign (benchmarks/campaign.py) as a test: malformed documents of every
schema fed to every command that reads them.

Whatever the damage, the command accepts the document (exit 0: the damage was harmless) or
refuses it with exit 2 and one line, leaving an output file that already existed byte for
byte; never a traceback, another exit code or a hang, and a non-finite number anywhere is
always refused. Each command gets hypothesis-chosen damages (seeds of the campaign's own
damage generator), so a failure shrinks to one damage and can be replayed by its seed.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers import load_benchmark
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

C = load_benchmark("campaign")


@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return C.make_documents(tmp_path_factory.mktemp("valid"))


@pytest.mark.parametrize(("schema", "index"), C.CASES, ids=[C.case_id(*c) for c in C.CASES])
@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_every_damaged_document_is_accepted_or_refused_in_one_line(
        schema: str, index: int, seed: int, docs: dict[str, Path], tmp_path: Path) -> None:
    text, what, nonfinite = C.damage(docs[schema].read_text(), random.Random(seed))
    bad = tmp_path / f"bad-{schema}.json"
    bad.write_text(text)
    out = tmp_path / "out.bin"
    out.write_text(C.SENTINEL)
    fill = {"F": str(bad), "O": str(out), "D": str(tmp_path / "run"),
            **{k: str(v) for k, v in docs.items()}}
    argv = [a.format(**fill) for a in C.COMMANDS[schema][index]]
    cls, detail = C.run_one(argv, out, nonfinite, timeout_s=120.0)
    assert cls in ("refused", "accepted"), f"{what}: {cls}: {detail[-1500:]}"


def test_the_damages_cover_every_kind() -> None:
    """The generator reaches every kind of damage, non-finite leaves among them."""
    text = '{"a": {"b": [1.5, 2.5]}, "c": "x"}'
    rng = random.Random(0)
    seen = [C.damage(text, rng) for _ in range(400)]
    kinds = {what.split(" ")[0] for _, what, _ in seen}
    assert {"truncated", "nested", "deleted", "added"} <= kinds
    assert any(nonfinite for _, _, nonfinite in seen)
    assert any("=" in what and not what.startswith("added") for _, what, _ in seen)


@pytest.mark.parametrize("name", ["", "\u202e", "no_such_op"])
@pytest.mark.parametrize("command", ["costs-solve", "costs-report"])
def test_a_cost_bucket_naming_an_unknown_op_is_one_line(name: str, command: str,
                                                        docs: dict[str, Path],
                                                        tmp_path: Path) -> None:
    """Found by the campaign: a bucket naming an op the graph lacks was a KeyError."""
    import json

    table = json.loads(docs["costs"].read_text())
    table["buckets"][0]["ops"][0] = name
    bad = tmp_path / "bad-costs.json"
    bad.write_text(json.dumps(table))
    out = tmp_path / "out.bin"
    out.write_text(C.SENTINEL)
    index = [C.case_id(*c) for c in C.CASES].index(command)
    fill = {"F": str(bad), "O": str(out), "D": str(tmp_path / "run"),
            **{k: str(v) for k, v in docs.items()}}
    argv = [a.format(**fill) for a in C.COMMANDS[C.CASES[index][0]][C.CASES[index][1]]]
    cls, detail = C.run_one(argv, out, False, timeout_s=120.0)
    assert cls == "refused", detail
    assert "buckets.0.ops" in detail
