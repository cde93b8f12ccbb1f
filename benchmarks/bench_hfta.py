"""Fused training arrays on this CPU (or a GPU): throughput of B models trained as one job.

For every cell (model, B, batch per model) four ways of training B variants of the model
(different seeds, SGD lr 0.05 momentum 0.9, per-model inputs) are timed on the same steps:

* ``serial``: B standalone models, each with its own torch.optim.SGD, stepped one after
  another (what running the B jobs one by one does, per step);
* ``procs``: B separate processes, each training one standalone model at the same time
  (one torch thread each; the processes are started once per cell and run each round when
  the parent says, so rounds interleave with the other modes; start-up is not timed);
* ``fused``: the B-array with every op fused (qsync_opt.hfta: one kernel per op for all B)
  and FusedSGD;
* ``choice``: what the measured choice (qsync_opt.hfta.choice) runs: the B-array with each
  op fused or as B calls, whichever was faster in context, or, where the whole array did not
  beat them by ``ARRAY_MARGIN`` (5%, median of the start-up pairs, the array losing at most
  a quarter of them; a near tie timed again) and always at B=1, the standalone models one
  by one (its start-up measurement is timed apart and printed, not inside the throughput).

Each round runs the same number of timed steps of every mode (``--steps``, or more so that
a round of serial steps lasts ``--min-round-s``; after one warm-up step) in a shuffled order
(seeded per cell, so no mode always runs after the same one); ``--reps`` rounds; the figure
is samples per second (B x batch x steps / wall), the median over rounds with the spread
(min-max). Ratios are against ``serial``: of the medians, and (``paired``, cells run since
the rounds' times are kept in the dump) the median [min-max] of each round's own
choice/serial ratio, which a slow drift of the machine's speed does not move. One torch
thread in the parent (``--threads``); the bar it checks: ``choice`` at least 0.95x
``serial`` in every cell.

Cells whose B x batch exceeds ``--max-samples`` for the model are skipped (ResNet-18 at 32x32
costs about 1.7 GFLOP a sample forward and backward: a B=16 x 256 step would take minutes
here), and so are cells whose memory (:func:`cell_memory_bytes`) is more than this machine
has available; the output names each skipped cell and why. A resumed cell keeps the rounds
and steps it was run with; a row run with other rounds or steps says so.

``--device cuda`` runs every mode on the GPU (``procs``: B processes sharing the one card,
no MPS), each timed round waiting for the card's queue before and after (a CUDA kernel runs
after its launch returns), and checks the cell's memory against the card's free memory. It
is the paper's own setting: there fusion replaces B kernel launches a layer by one.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_hfta.py --dump benchmarks/results/hfta.json
    python3 benchmarks/bench_hfta.py --device cuda --B 1,4,16 --batches 16,256 --reps 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after an installed qsync_opt (a wheel's has the subpackages)

MODES = ("serial", "procs", "fused", "choice")


def _batches(wl: Any, seed: int, batch: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + seed)
    (x,) = wl.make_inputs(batch, torch.device("cpu"))
    out = []
    for _ in range(n):
        xi = torch.rand(x.shape, generator=g) if x.is_floating_point() else x
        yi = torch.randint(0, 10, (batch,), generator=g)
        out.append((xi, yi))
    return out


def _proc_worker(name: str, seed: int, batch: int, steps: int, reps: int,
                 ready: Any, start: Any, done: Any, q: Any, device: str = "cpu") -> None:
    torch.set_num_threads(1)
    import torch.nn.functional as F
    from qsync_opt.models import get_workload

    from qsync_opt.hfta.choice import sync

    parent = os.getppid()

    def orphaned() -> None:  # the parent died (killed for memory, say): leave, not hang
        while os.getppid() == parent:
            time.sleep(2)
        os._exit(1)

    import threading

    threading.Thread(target=orphaned, daemon=True).start()
    dev = torch.device(device)
    wl = get_workload(name)
    torch.manual_seed(seed)
    m = wl.build().train().to(dev)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    data = [(x.to(dev), y.to(dev)) for x, y in _batches(wl, seed, batch, 1)]

    def step() -> None:
        x, y = data[0]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(m(x), y).backward()
        opt.step()

    step()
    sync(dev)
    ready.wait()
    for _ in range(reps):
        start.wait()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        sync(dev)
        q.put(time.perf_counter() - t)
        done.wait()


class Procs:
    """B processes, one standalone model each, run a round when :meth:`round` is called."""

    def __init__(self, name: str, B: int, batch: int, steps: int, reps: int,
                 device: str = "cpu") -> None:
        ctx = mp.get_context("spawn")
        self.ready = ctx.Barrier(B + 1)
        self.start, self.done = ctx.Barrier(B + 1), ctx.Barrier(B + 1)
        self.q = ctx.Queue()
        self.ps = [ctx.Process(target=_proc_worker,
                               args=(name, s, batch, steps, reps, self.ready, self.start,
                                     self.done, self.q, device), daemon=True)
                   for s in range(B)]
        env_before = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        for p in self.ps:
            p.start()
        if env_before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = env_before
        self.B = B
        self.ready.wait(timeout=3600)  # every process built and warmed up: not timed

    def round(self) -> float:
        t = time.perf_counter()
        self.start.wait(timeout=3600)
        for _ in range(self.B):
            self.q.get(timeout=3600)
        wall = time.perf_counter() - t
        self.done.wait(timeout=3600)
        return wall

    def close(self) -> None:
        for p in self.ps:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


#: The parent's resident memory on a CPU against the tensors it holds at its peak: glibc's
#: heap keeps freed blocks (tensors under its mmap threshold, which grows to 32 MiB), so the
#: resident size runs over the live tensors. Measured on the development machine
#: (2026-12-04, ResNet-18 B=2 batch 64, the whole cell): 2.44 GiB resident at the peak
#: against 1.64 GiB of tensors by :func:`cell_memory_bytes`' count (1.89 GiB resident with
#: every block over 64 KiB mmapped, so returned when freed; that run's steps were 1.5x slower).
CPU_HEAP_FACTOR = 1.5


def cell_memory_bytes(name: str, B: int, batch: int, device: str = "cpu") -> int:
    """What a cell holds at its peak: one array step of B models (weights, gradients,
    momentum and the saved activations, qsync_opt.hfta.sweep.array_memory_bytes), the
    other three sets of B models the cell keeps (serial, the choice's array and its
    standalone exports: weights, gradients and momentum each), and a copy of the array's
    state that the choice's measurement restores; on a CPU x :data:`CPU_HEAP_FACTOR`.
    (Before the choice let go of each op's captured input once timed, it held them all
    through its whole-step timing: a B=8 batch-256 ResNet-18 cell estimated at 13.3 GiB was
    killed for memory at 24 GB.)"""
    from qsync_opt.graph import trace
    from qsync_opt.hfta.sweep import array_memory_bytes

    params = int(trace(name, 1).param_bytes)
    need = array_memory_bytes(name, batch, B, "sgd") + B * params * (3 * 3 + 1)
    return int(need * (CPU_HEAP_FACTOR if device == "cpu" else 1.0))


#: A ``procs`` worker's memory before its model: the interpreter with torch and the models
#: imported (230 MiB measured on the 2-core development machine, 2026-12-04).
PROC_BASE_BYTES = 256 * 2**20


def procs_memory_bytes(name: str, B: int, batch: int) -> int:
    """What the ``procs`` mode adds at its peak: B processes, each one model's step at
    ``batch`` on top of an interpreter with torch. (A B=16 batch-64 ResNet-18 cell, whose
    estimate counted only the parent, was killed for memory on a 24 GiB machine: 12.7 GB
    in the parent and 0.6-0.8 GB in each of the 16 workers.)"""
    from qsync_opt.hfta.sweep import array_memory_bytes

    return B * (PROC_BASE_BYTES + array_memory_bytes(name, batch, 1, "sgd"))


def cell(name: str, B: int, batch: int, steps: int, reps: int, min_round_s: float,
         device: str = "cpu", with_procs: bool = True) -> dict[str, Any]:
    import torch.nn.functional as F
    from qsync_opt.models import get_workload

    from qsync_opt.hfta.choice import measure_choice, sync
    from qsync_opt.hfta.convert import fuse
    from qsync_opt.hfta.optim import FusedSGD

    wl = get_workload(name)

    def models() -> list[torch.nn.Module]:
        out = []
        for s in range(B):
            torch.manual_seed(s)
            out.append(wl.build().train().to(dev))
        return out

    dev = torch.device(device)
    data = [tuple(t.to(dev) for t in _batches(wl, s, batch, 1)[0]) for s in range(B)]
    xs = torch.stack([d[0] for d in data])
    ys = torch.stack([d[1] for d in data])
    serial = models()
    sopts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in serial]

    def serial_step() -> None:
        for m, o, (x, y) in zip(serial, sopts, data, strict=True):
            o.zero_grad(set_to_none=True)
            F.cross_entropy(m(x), y).backward()
            o.step()

    def array_step(arr: Any, opt: Any) -> Any:
        def go() -> None:
            opt.zero_grad(set_to_none=True)
            out = arr(xs)
            F.cross_entropy(out.reshape(-1, out.shape[-1]), ys.reshape(-1),
                            reduction="none").view(B, -1).mean(1).sum().backward()
            opt.step()
        return go

    fused = fuse(models()).to(dev)
    fopt = FusedSGD(list(fused.parameters()), B, lr=0.05, momentum=0.9)
    chosen = fuse(models()).to(dev)
    copt = FusedSGD(list(chosen.parameters()), B, lr=0.05, momentum=0.9)
    t = time.perf_counter()
    choice = measure_choice(
        chosen, (xs,), lambda out: F.cross_entropy(out.reshape(-1, out.shape[-1]),
                                                   ys.reshape(-1), reduction="none")
        .view(B, -1).mean(1).sum(),
        lambda out, b: F.cross_entropy(out, ys[b]), reps=3)
    choice_s = time.perf_counter() - t
    standalone = [chosen.export(b).train() for b in range(B)]
    sa_opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in standalone]

    def standalone_step() -> None:  # the choice's fallback: the models one by one
        for m, o, (x, y) in zip(standalone, sa_opts, data, strict=True):
            o.zero_grad(set_to_none=True)
            F.cross_entropy(m(x), y).backward()
            o.step()
    steps_fn = {"serial": serial_step, "fused": array_step(fused, fopt),
                "choice": standalone_step if choice.separate else array_step(chosen, copt)}
    for fn in steps_fn.values():
        fn()  # warm-up
    sync(dev)
    t = time.perf_counter()
    serial_step()
    sync(dev)
    steps = max(steps, int(min_round_s / max(time.perf_counter() - t, 1e-6)) + 1)
    procs = Procs(name, B, batch, steps, reps, device) if with_procs else None
    modes = [m for m in MODES if with_procs or m != "procs"]
    times: dict[str, list[float]] = {m: [] for m in modes}
    try:
        rng = random.Random(B * 1000 + batch)
        for _ in range(reps):
            order = list(MODES)
            rng.shuffle(order)  # no mode always follows the same one (caches, allocator)
            for mode in order:
                if mode not in times:
                    continue
                if procs is not None and mode == "procs":
                    times[mode].append(procs.round())
                    continue
                sync(dev)
                t = time.perf_counter()
                for _ in range(steps):
                    steps_fn[mode]()
                sync(dev)  # a CUDA step's kernels run after its launches return
                times[mode].append(time.perf_counter() - t)
    finally:
        if procs is not None:
            procs.close()
    n = B * batch * steps
    res: dict[str, Any] = {"model": name, "B": B, "batch": batch, "steps": steps, "reps": reps,
                           "device": (torch.cuda.get_device_name(dev) if dev.type == "cuda"
                                      else "cpu"),
                           "threads": torch.get_num_threads(), "measured_choice": choice.to_json(),
                           "choice_summary": choice.summary(), "choice_s": round(choice_s, 2)}
    res["procs"] = None  # not run: B processes would not fit beside the cell
    for mode in modes:
        rates = [n / t for t in times[mode]]
        res[mode] = {"median": statistics.median(rates), "min": min(rates),
                     "max": max(rates), "rounds_s": [round(t, 6) for t in times[mode]]}
    # the choice against serial round by round (the two ran minutes apart at most, in the
    # same round: a slow drift of the machine's speed cancels in each round's ratio)
    paired = [s / c for s, c in zip(times["serial"], times["choice"], strict=True)]
    res["choice_paired"] = {"median": statistics.median(paired), "min": min(paired),
                            "max": max(paired)}
    return res


def paired(r: dict[str, Any]) -> str:
    """The median [min-max] of the rounds' choice/serial ratios ("-": a cell measured before
    the rounds were kept)."""
    p = r.get("choice_paired")
    return "-" if p is None else f"{p['median']:.2f} [{p['min']:.2f}-{p['max']:.2f}]"


def _available_bytes(device: str = "cpu") -> int:
    from qsync_opt.hfta.sweep import memory_capacity

    return memory_capacity(None, None, torch.device(device))[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="digits_cnn,resnet18_32")
    ap.add_argument("--B", default="1,2,4,8,16")
    ap.add_argument("--batches", default="4,16,64,256")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--min-round-s", type=float, default=0.5,
                    help="at least this long a round of serial steps (more steps if faster)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-samples", default="digits_cnn=4096,resnet18_32=64",
                    help="per model, the largest B x batch run (the rest are skipped)")
    ap.add_argument("--dump", help="append every cell's result here (JSON lines; resumes)")
    ap.add_argument("--device", default="cpu",
                    help="cpu (default) or cuda: where every mode trains (procs: B processes "
                         "sharing the one card)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    limits = {k: int(v) for k, v in (x.split("=") for x in args.max_samples.split(","))}
    done: dict[tuple[str, int, int], dict[str, Any]] = {}
    if args.dump and Path(args.dump).exists():
        for line in Path(args.dump).read_text().splitlines():
            r = json.loads(line)
            done[(r["model"], r["B"], r["batch"])] = r
    from qsync_opt.core.machine import cpu_model

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"--device {args.device}: no CUDA device in this torch ({torch.__version__})")
    where = (f"{torch.cuda.get_device_name(dev)} (torch {torch.__version__}), every mode on it"
             if dev.type == "cuda" else f"the CPU ({cpu_model()})")
    print(f"# load average {os.getloadavg()[0]:.2f}, {args.threads} thread(s) in the parent, "
          f"1 per process; {where}")
    for name in args.models.split(","):
        print(f"\n{name}: samples/s, median of {args.reps} rounds of at least {args.steps} "
              f"steps (a round at least {args.min_round_s:g} s) [min-max]; ratios against "
              "serial")
        print(f"  {'B':>3s} {'batch':>5s} {'serial':>22s} {'procs':>22s} {'fused':>22s} "
              f"{'choice':>22s}  fused/ser choice/ser  procs/ser  paired choice/ser  choice")
        for B in (int(b) for b in args.B.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                if B * batch > limits.get(name, 1 << 30):
                    print(f"  {B:3d} {batch:5d}  skipped (B x batch > {limits[name]})")
                    continue
                key = (name, B, batch)
                if key not in done:
                    need = cell_memory_bytes(name, B, batch, args.device)
                    extra = procs_memory_bytes(name, B, batch)
                    have = _available_bytes(args.device)
                    if need > have:
                        print(f"  {B:3d} {batch:5d}  skipped (needs {need / 2**30:.1f} GiB, "
                              f"this machine has {have / 2**30:.1f} GiB available)")
                        continue
                    if need + extra > have:
                        print(f"  {B:3d} {batch:5d}  procs not run (with B processes the cell "
                              f"needs {(need + extra) / 2**30:.1f} GiB, this machine has "
                              f"{have / 2**30:.1f} GiB available)", flush=True)
                    done[key] = cell(name, B, batch, args.steps, args.reps, args.min_round_s,
                                     args.device, with_procs=need + extra <= have)
                    if args.dump:
                        with open(args.dump, "a") as fh:
                            fh.write(json.dumps(done[key]) + "\n")
                r = done[key]

                def f(m: str, r: dict[str, Any] = r) -> str:
                    v = r[m]
                    if v is None:
                        return "not run"
                    return f"{v['median']:8.0f} [{v['min']:.0f}-{v['max']:.0f}]"

                s = r["serial"]["median"]
                print(f"  {B:3d} {batch:5d} {f('serial'):>22s} {f('procs'):>22s} "
                      f"{f('fused'):>22s} {f('choice'):>22s}  "
                      f"{r['fused']['median'] / s:9.2f} {r['choice']['median'] / s:10.2f} "
                      + (f"{r['procs']['median'] / s:10.2f}" if r["procs"] else f"{'-':>10s}")
                      + f"  {paired(r):>17s}  "
                      f"{r['choice_summary']}"
                      + ("" if r["reps"] == args.reps and r["steps"] >= args.steps
                         else f" [{r['reps']} rounds of {r['steps']} steps]"), flush=True)


if __name__ == "__main__":
    main()
