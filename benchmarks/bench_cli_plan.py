"""Planning end to end from the command line: ``solve``, ``solve --joint-split`` and
``pareto``, each in a fresh process, as a user runs them.

Each case runs once first (the warm-up fills the indicator's and the graph cache, as a
user's first call does; its time is printed apart), then ``--repeats`` times; printed per
case: the median wall time and the median CPU time of the child (user + system, from
``getrusage``: on a loaded machine the CPU time still says what the command costs, the wall
time does not), and the joint split against the plain solve. The load average is printed
before and after: wall times mean something only where it was low.

``--baseline PATH`` times another installation's ``qsync-opt`` (an older tree's
``.venv/bin/qsync-opt``) on the same cases, its runs interleaved with this one's so that a
change of load falls on both alike. Each installation then runs with a cache folder of its
own (``XDG_CACHE_HOME``), a copy of this user's without the traced graphs: the graph cache is
keyed by the package's code, and two trees sharing one folder would delete each other's
graphs at every run, so that no run would be warm.

    .venv/bin/python benchmarks/bench_cli_plan.py [--repeats 5] [--baseline OTHER/.venv/bin/qsync-opt]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(sys.executable).parent / "qsync-opt"


@dataclass
class Timing:
    """The runs of one case with one executable: wall and child CPU seconds per run."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    warmup_wall: float | None = None

    def median(self, what: str) -> float:
        return statistics.median(getattr(self, what))


def cases(model: str, cluster: str, solver: str, out: Path) -> dict[str, list[str]]:
    """The three commands of the figure, writing into ``out``."""
    plan = ["solve", "--model", model, "--cluster", cluster, "--solver", solver]
    return {
        "solve": [*plan, "--out", str(out / "x.plan.json")],
        "joint split": [*plan, "--joint-split", "--out", str(out / "j.plan.json")],
        "pareto": ["pareto", "--model", model, "--cluster", cluster, "--out",
                   str(out / "f.json"), "--png", str(out / "f.png")],
    }


def run_once(exe: str, argv: list[str], env: dict[str, str] | None = None
             ) -> tuple[float, float]:
    """One fresh process of ``exe argv`` (in ``env``, default this one's): (wall seconds,
    its CPU seconds). A failure stops the benchmark with the command's last lines."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run([exe, *argv], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
        raise SystemExit(f"{exe} {' '.join(argv)}: exit {done.returncode}\n{tail}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def own_caches(exes: dict[str, str], tmp: Path) -> dict[str, dict[str, str] | None]:
    """Each executable's environment: with one, this one's; with several, each its own
    cache folder, a copy of this user's without ``graphs/`` (the indicator tables and the
    host's facts stay warm; each tree traces its graphs once, in its warm-up)."""
    if len(exes) == 1:
        return {who: None for who in exes}
    from qsync_opt.core.machine import cache_root

    envs: dict[str, dict[str, str] | None] = {}
    for who in exes:
        home = tmp / f"cache-{who}"
        if cache_root().is_dir():
            shutil.copytree(cache_root(), home / "qsync-opt", symlinks=True,
                            ignore=lambda folder, names: ["graphs"] if "graphs" in names else [])
        envs[who] = dict(os.environ, XDG_CACHE_HOME=str(home))
    return envs


def measure(exes: dict[str, str], commands: dict[str, list[str]], repeats: int,
            envs: dict[str, dict[str, str] | None]) -> dict[tuple[str, str], Timing]:
    """Every case with every executable: a warm-up, then ``repeats`` runs, interleaved."""
    out = {(who, case): Timing() for who in exes for case in commands}
    for case, argv in commands.items():
        for who, exe in exes.items():
            out[who, case].warmup_wall = run_once(exe, argv, envs[who])[0]
        for _ in range(repeats):
            for who, exe in exes.items():
                wall, cpu = run_once(exe, argv, envs[who])
                out[who, case].wall.append(wall)
                out[who, case].cpu.append(cpu)
    return out


def table(timings: dict[tuple[str, str], Timing], exes: dict[str, str], repeats: int
          ) -> list[str]:
    """The lines printed: per executable and case, medians and the joint-split ratio."""
    lines = [f"{'qsync-opt':10} {'case':12} {'wall s':>8} {'cpu s':>8} {'warm-up s':>10}"
             f"  (median of {repeats})"]
    for who in exes:
        for case in ("solve", "joint split", "pareto"):
            t = timings.get((who, case))
            if t is None:
                continue
            lines.append(f"{who:10} {case:12} {t.median('wall'):8.2f} {t.median('cpu'):8.2f} "
                         f"{t.warmup_wall or 0.0:10.2f}")
        plain, joint = timings.get((who, "solve")), timings.get((who, "joint split"))
        if plain and joint:
            lines.append(f"{who:10} joint split / solve: {joint.median('wall') / plain.median('wall'):.2f}x "
                         f"wall, {joint.median('cpu') / plain.median('cpu'):.2f}x cpu")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per case (default 5)")
    ap.add_argument("--exe", default=str(HERE), help="the qsync-opt timed (default: this "
                    "interpreter's)")
    ap.add_argument("--baseline", help="another qsync-opt to time the same way")
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--cluster", default="v100x16+t4x16")
    ap.add_argument("--solver", default="highs")
    ap.add_argument("--only", choices=["solve", "joint split", "pareto"], action="append",
                    help="time only this case (repeatable)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats: expected a positive integer, got {args.repeats}")
    exes = {"this": args.exe}
    if args.baseline:
        exes["baseline"] = args.baseline
    for who, exe in exes.items():
        if not os.access(exe, os.X_OK):
            ap.error(f"{'--exe' if who == 'this' else '--baseline'}: {exe} is not an "
                     "executable")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
          f"load before {os.getloadavg()[0]:.2f}; "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    with tempfile.TemporaryDirectory() as tmp:
        commands = cases(args.model, args.cluster, args.solver, Path(tmp))
        if args.only:
            commands = {k: v for k, v in commands.items() if k in args.only}
        timings = measure(exes, commands, args.repeats, own_caches(exes, Path(tmp)))
    for who, exe in exes.items():
        print(f"{who}: {exe}")
    print("\n".join(table(timings, exes, args.repeats)))
    print(f"load after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
