"""What importing the command line costs: ``import qsync_opt``, ``import qsync_opt.cli`` and
``qsync-opt --help``, each in a fresh interpreter, as a user's shell starts them.

Per case: the median CPU time of the child (user + system, from ``getrusage``: on a loaded
machine the CPU time still says what the import costs, the wall time does not), the median
wall time, the modules the import leaves in ``sys.modules`` and whether torch or numpy is
among them. The load average is printed before and after.

``--baseline PYTHON`` runs the same cases with another installation's interpreter (an older
tree's ``.venv/bin/python``), its runs interleaved with this one's so that a change of load
falls on both alike.

    .venv/bin/python benchmarks/bench_import.py [--repeats 9] [--baseline OTHER/.venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

#: case -> the code a fresh interpreter runs (it prints what it imported as JSON).
CASES = {
    "import qsync_opt": "import qsync_opt",
    "import qsync_opt.cli": "import qsync_opt.cli",
    "qsync-opt --help": ("import contextlib, io\nfrom qsync_opt.cli import main\n"
                         "with contextlib.redirect_stdout(io.StringIO()):\n"
                         "    try:\n        main(['--help'])\n    except SystemExit:\n"
                         "        pass"),
}
REPORT = ("\nimport json, sys\nprint(json.dumps({'modules': len(sys.modules), "
          "'torch': 'torch' in sys.modules, 'numpy': 'numpy' in sys.modules}))")


def run_once(python: str, code: str) -> tuple[float, float, dict[str, object]]:
    """(CPU seconds, wall seconds, what it imported) of one fresh interpreter, run in an
    empty folder (``-c`` puts the working folder first on the path: a tree there would be
    imported instead of the interpreter's own installation)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as empty:
        out = subprocess.run([python, "-c", code + REPORT], capture_output=True, text=True,
                             check=True, cwd=empty,
                             env=dict(os.environ, OMP_NUM_THREADS="1")).stdout
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--baseline", default=None, metavar="PYTHON",
                    help="another installation's interpreter, timed interleaved")
    args = ap.parse_args()
    pythons = {"this": sys.executable}
    if args.baseline:
        pythons = {"baseline": args.baseline, **pythons}
    print(f"# load average before: {os.getloadavg()[0]:.2f}")
    for case, code in CASES.items():
        for python in pythons.values():  # one untimed run each: the file system's caches
            run_once(python, code)
        runs: dict[str, list[tuple[float, float, dict[str, object]]]] = {k: [] for k in pythons}
        for _ in range(args.repeats):
            for name, python in pythons.items():
                runs[name].append(run_once(python, code))
        for name, rs in runs.items():
            cpu = statistics.median(r[0] for r in rs)
            wall = statistics.median(r[1] for r in rs)
            seen = rs[-1][2]
            print(f"{name} | {case} | cpu {cpu:.3f} s | wall {wall:.3f} s | {seen['modules']} "
                  f"modules | torch {seen['torch']} | numpy {seen['numpy']}")
    print(f"# load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
