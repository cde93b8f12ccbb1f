"""The emulated link (``train --emulate-link``) on two gloo ranks: what a slow link adds to a
step, measured against the link's own figure.

For each strategy (DDP with FP32 gradients, DDP with fp16 gradients, Local SGD every 4
steps; a two-stage pipeline with 8-bit activations with ``--pipeline``) the same run (the
fp32 plan of ``--model`` on two ``cpu`` ranks, ``--steps`` steps) runs without a link and
with ``--emulate-link LINK``. Per strategy it prints, as means per step over the run (Local
SGD pays once a round), the bytes rank 0 handed the network, ``link_ms`` (the emulated time
charged to a rank's messages: the link's formula over their bytes, deterministic; the larger
of the two ranks', which differ in a pipeline: each pays what it receives), and over the
steps after the first the measured ``step_ms`` and ``comm_ms`` of rank 0 without and with the
link, and the step time the link added. The added time
should be about ``link_ms`` where the communication does not overlap compute, and less
where it does (DDP's buckets overlap backward).

    .venv/bin/python benchmarks/bench_link.py [--model digits_cnn] [--steps 20]
        [--link bw=0.05,latency_us=500] [--pipeline] [--deterministic] [--json OUT]

``--deterministic`` prints only the columns that do not depend on the machine (bytes and
``link_ms``): wall-clock columns need a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STRATEGIES: dict[str, tuple[str, ...]] = {
    "ddp fp32": (),
    "ddp fp16": ("--comm", "fp16"),
    "local:4": ("--sync", "local:4"),
}
PIPELINE = ("--pipeline-stages", "2", "--compress-act", "quant:8")


def _rows(out: Path, rank: int) -> list[dict[str, Any]]:
    text = (out / f"metrics.rank{rank}.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _run(model: str, steps: int, out: Path, extra: tuple[str, ...]
         ) -> list[list[dict[str, Any]]]:
    cmd = [sys.executable, "-m", "qsync_opt.cli", "train", "--model", model, "--nproc", "2",
           "--steps", str(steps), "--out", str(out), "--backend", "gloo", "--no-resume",
           "--progress-every", "0", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"bench_link: {' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    return [_rows(out, 0), _rows(out, 1)]


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [float(r[key]) for r in rows[1:] if r.get(key) is not None]
    return round(statistics.fmean(vals), 3) if vals else None


def _bytes(row: dict[str, Any]) -> int:
    if "bytes_sent" in row:
        return int(row["bytes_sent"])
    return int(row.get("act_bytes_sent", 0)) + int(row.get("grad_bytes_sent", 0))


def measure(model: str, steps: int, link: str, pipeline: bool) -> list[dict[str, Any]]:
    """One row per strategy (module docstring)."""
    strategies = dict(STRATEGIES)
    if pipeline:
        strategies["pipeline 2 stages, act quant:8"] = PIPELINE
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_link_") as tmp:
        for name, extra in strategies.items():
            plain = _run(model, steps, Path(tmp) / "plain", extra)[0]
            ranks = _run(model, steps, Path(tmp) / "slow", (*extra, "--emulate-link", link))
            slow = ranks[0]
            row: dict[str, Any] = {
                "strategy": name, "link": slow[0]["link"],
                "bytes_per_step": round(statistics.fmean(_bytes(r) for r in slow), 1),
                "link_ms_per_step": max(round(statistics.fmean(r["link_ms"] for r in rows), 3)
                                        for rows in ranks),
                "step_ms": _mean(plain, "step_ms"), "step_ms_link": _mean(slow, "step_ms"),
                "comm_ms": _mean(plain, "comm_ms"), "comm_ms_link": _mean(slow, "comm_ms")}
            if row["step_ms"] is not None and row["step_ms_link"] is not None:
                row["added_ms"] = round(row["step_ms_link"] - row["step_ms"], 3)
            out.append(row)
    return out


def _cell(key: str, value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.0f}" if key == "bytes_per_step" else f"{value:g}"


def table(rows: list[dict[str, Any]], deterministic: bool) -> str:
    keys = ["bytes_per_step", "link_ms_per_step"]
    if not deterministic:
        keys += ["step_ms", "step_ms_link", "added_ms", "comm_ms", "comm_ms_link"]
    lines = ["| strategy | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for r in rows:
        lines.append(f"| {r['strategy']} | "
                     + " | ".join(_cell(k, r.get(k)) for k in keys) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="digits_cnn")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--link", default="bw=0.05,latency_us=500")
    ap.add_argument("--pipeline", action="store_true")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = measure(args.model, args.steps, args.link, args.pipeline)
    print(f"{args.model}, 2 gloo ranks, {args.steps} steps, {rows[0]['link']}")
    print(table(rows, args.deterministic))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
