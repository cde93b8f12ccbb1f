"""The bad-input campaign: damaged documents of every schema fed to every command that reads them.

Each run takes a valid document (a cluster, a cost table, an indicator table, a plan, all
made by the CLI itself for digits_cnn), damages it in one place and runs, in this process, a
command that reads it. Damages: a leaf replaced by a hostile value (null, booleans, 0, -1,
10^30, 2^63, 1e308, Infinity, -Infinity, NaN, empty and multi-line strings, control and
bidi characters, lists, objects, unknown names), a key deleted, an unknown key added, the
text truncated, the document wrapped in deep nesting. Each run is classified:

- ``refused``: exit 2, one line (an infeasible problem may add indented findings), an output
  file that existed before left byte for byte;
- ``accepted``: exit 0 on a document that holds no non-finite number (the damage may be
  harmless: a changed name, an extra provenance key);
- ``wrongly accepted``: exit 0 on a document holding a non-finite number;
- ``traceback``: an exception escaped the command; ``other exit``: any other code, or exit 2
  with more than one line or a changed output; ``hang``: no answer within ``--timeout``.

    .venv/bin/python benchmarks/campaign.py [--per-case 40] [--seed 0] [--timeout 60]

tests/cli/test_campaign.py runs the same damages (fewer of them) and fails on anything but
``refused`` and ``accepted``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import random
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MODEL = "digits_cnn"
SENTINEL = "the output written before this run\n"

HOSTILE: list[Any] = [None, True, False, -1, 0, -0.0, 1e-300, 10**30, 2**63, 1e308,
                      math.inf, -math.inf, math.nan, "", "x\ny", "\x1b[2J", "1e-06", [], {},
                      [1, 2], {"a": 1}, "fp128", "cpu/0", "\u202e"]

#: schema -> commands reading a damaged file {F}; {O} an output that exists before the run,
#: {D} a run folder; the other schemas' valid files by name.
COMMANDS: dict[str, list[list[str]]] = {
    "cluster": [["estimate", "--model", MODEL, "--cluster", "{F}", "--out", "{O}"],
                ["solve", "--model", MODEL, "--cluster", "{F}", "--costs", "{costs}",
                 "--indicator", "{indicator}", "--solver", "highs", "--out", "{O}"]],
    "costs": [["solve", "--model", MODEL, "--cluster", "{cluster}", "--costs", "{F}",
               "--indicator", "{indicator}", "--solver", "highs", "--out", "{O}"],
              ["report", "--plan", "{plan}", "--costs", "{F}", "--png", "{O}"]],
    "indicator": [["solve", "--model", MODEL, "--cluster", "{cluster}", "--costs", "{costs}",
                   "--indicator", "{F}", "--solver", "highs", "--out", "{O}"]],
    "plan": [["report", "--plan", "{F}", "--png", "{O}"],
             ["replay", "--model", MODEL, "--plan", "{F}", "--trace", "{O}"],
             ["train", "--model", MODEL, "--plan", "{F}", "--dry-run", "--out", "{D}"]],
}
CASES = [(schema, i) for schema, cmds in COMMANDS.items() for i in range(len(cmds))]


def case_id(schema: str, index: int) -> str:
    return f"{schema}-{COMMANDS[schema][index][0]}"


def make_documents(folder: Path) -> dict[str, Path]:
    """Valid documents of every schema, made by the CLI itself."""
    from qsync_opt import cli, trace
    from qsync_opt.documents.io import save
    from qsync_opt.problem.synthetic import random_indicator

    cluster = {"schema_name": "ClusterSpec", "schema_version": 1,
               "groups": [{"name": "fast", "device": "cpu", "count": 1, "batch_per_device": 32},
                          {"name": "slow", "device": "cpu/2", "count": 1,
                           "batch_per_device": 32}]}
    (folder / "cluster.json").write_text(json.dumps(cluster))
    with contextlib.redirect_stdout(io.StringIO()):
        if cli.main(["estimate", "--model", MODEL, "--cluster", str(folder / "cluster.json"),
                     "--out", str(folder / "costs.json")]) != 0:
            raise RuntimeError("estimate failed on the valid cluster")
        save(random_indicator(trace(MODEL, 32), 0), folder / "indicator.json")
        if cli.main(["solve", "--model", MODEL, "--cluster", str(folder / "cluster.json"),
                     "--costs", str(folder / "costs.json"), "--indicator",
                     str(folder / "indicator.json"), "--solver", "highs",
                     "--out", str(folder / "plan.json")]) != 0:
            raise RuntimeError("solve failed on the valid documents")
    return {k: folder / f"{k}.json" for k in ("cluster", "costs", "indicator", "plan")}


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:4]):  # the first few items of long lists
            out += _paths(v, (*prefix, i))
    return out


def _at(doc: Any, path: tuple) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def damage(text: str, rng: random.Random) -> tuple[str, str, bool]:
    """(damaged text, what was done, whether it now holds a non-finite number)."""
    kind = rng.choice(["leaf", "leaf", "leaf", "leaf", "delete", "add", "truncate", "nest"])
    if kind == "truncate":
        at = rng.randrange(max(1, len(text)))
        return text[:at], f"truncated at {at}", False
    if kind == "nest":
        depth = rng.choice([50, 5000, 100_000])
        return "[" * depth + text + "]" * depth, f"nested {depth} deep", False
    doc = json.loads(text)
    path = rng.choice(_paths(doc))
    where = "/".join(map(str, path)) or "<root>"
    if kind == "delete":
        if not path:
            return "{}", "emptied", False
        parent = _at(doc, path[:-1])
        if isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent.pop(path[-1])
        return json.dumps(doc), f"deleted {where}", False
    if kind == "add":
        parent = _at(doc, path)
        if not isinstance(parent, dict):
            return json.dumps(doc), "unchanged", False
        key, value = rng.choice(["extra", "", "x\ny"]), rng.choice(HOSTILE)
        parent[key] = value
        return json.dumps(doc), f"added {where}/{key!r}={value!r}", False
    value = rng.choice(HOSTILE)
    doc = value if not path else doc
    if path:
        _at(doc, path[:-1])[path[-1]] = value
    nonfinite = isinstance(value, float) and not math.isfinite(value)
    return json.dumps(doc), f"{where}={value!r}", nonfinite


class Hang(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    def on_alarm(signum: int, frame: Any) -> None:
        raise Hang

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_one(argv: list[str], out: Path, nonfinite: bool, timeout_s: float) -> tuple[str, str]:
    """(class, stderr or traceback) of one command on one damaged document."""
    from qsync_opt import cli

    err, sink = io.StringIO(), io.StringIO()
    try:
        with _deadline(timeout_s), contextlib.redirect_stderr(err), \
                contextlib.redirect_stdout(sink):
            try:
                rc = cli.main(argv)
            except SystemExit as exc:  # argparse errors exit 2 themselves
                rc = exc.code if isinstance(exc.code, int) else 1
    except Hang:
        return "hang", err.getvalue()
    except BaseException:  # noqa: BLE001 - what the campaign counts
        return "traceback", traceback.format_exc()
    text = err.getvalue()
    if rc == 0:
        return ("wrongly accepted" if nonfinite else "accepted"), text
    lines = text.rstrip("\n").split("\n")
    one_line = (lines[0].startswith("qsync-opt") and "Traceback" not in text
                and all(x.startswith("  ") for x in lines[1:]))
    if rc == 2 and one_line and out.read_text() == SENTINEL:
        return "refused", text
    return "other exit", f"exit {rc}; output unchanged: {out.read_text() == SENTINEL}; {text}"


def campaign(docs: dict[str, Path], folder: Path, schema: str, index: int, n: int, seed: int,
             timeout_s: float) -> list[tuple[str, str, str]]:
    """``n`` damaged runs of one command: (class, damage, stderr) each."""
    rng = random.Random(f"{seed}-{schema}-{index}")
    text = docs[schema].read_text()
    rows = []
    for i in range(n):
        bad_text, what, nonfinite = damage(text, rng)
        bad = folder / f"bad-{schema}-{index}-{i}.json"
        bad.write_text(bad_text)
        out = folder / f"out-{schema}-{index}-{i}.bin"
        out.write_text(SENTINEL)
        fill = {"F": str(bad), "O": str(out), "D": str(folder / f"run-{schema}-{index}-{i}"),
                **{k: str(v) for k, v in docs.items()}}
        argv = [a.format(**fill) for a in COMMANDS[schema][index]]
        cls, detail = run_one(argv, out, nonfinite, timeout_s)
        rows.append((cls, what, detail))
    return rows


CLASSES = ["refused", "accepted", "wrongly accepted", "traceback", "other exit", "hang"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-case", type=int, default=40, help="damaged runs per command")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds before a run is a hang")
    ap.add_argument("--show", type=int, default=3, help="failures printed per command")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    total: Counter[str] = Counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        docs = make_documents(folder)
        print(f"{'command':>18} " + " ".join(f"{c:>16}" for c in CLASSES))
        failures = []
        for schema, index in CASES:
            rows = campaign(docs, folder, schema, index, args.per_case, args.seed, args.timeout)
            c = Counter(r[0] for r in rows)
            total.update(c)
            print(f"{case_id(schema, index):>18} " + " ".join(f"{c[k]:>16}" for k in CLASSES))
            bad = [r for r in rows if r[0] not in ("refused", "accepted")]
            failures += [(case_id(schema, index), *r) for r in bad[:args.show]]
        print(f"{'all':>18} " + " ".join(f"{total[k]:>16}" for k in CLASSES))
        n = sum(total.values())
        print(f"{n} runs: {total['refused']} refused in one line, {total['accepted']} accepted "
              f"(harmless damage), {n - total['refused'] - total['accepted']} failures; "
              f"{time.perf_counter() - t0:.0f} s")
        for case, cls, what, detail in failures:
            last = detail.strip().splitlines()[-1] if detail.strip() else ""
            print(f"  {case}: {cls}: {what[:80]}: {last[:160]}")
    return 0 if total["refused"] + total["accepted"] == sum(total.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
