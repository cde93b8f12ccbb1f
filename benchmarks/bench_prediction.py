"""Predicted against measured iteration time and peak memory on this CPU, from profiled costs.

Per model, at a small batch, one thread per process:

1. **Profile** once (``qsync_opt.profile``, the default in-context method): only *uniform*
   plans run (every choosable op at fp32, at bf16, at fp16, at int8, at int8_full).
2. **Plans**: uniform fp32, bf16 and int8; two mixed plans from the exact solver (HiGHS) at
   makespan targets a third and two thirds of the way from the fastest to the fp32
   iteration; two random mixed plans (each op fp32, bf16 or int8 at random, seeded). No
   mixed plan is ever profiled: their error is the honest figure ("held out"). The uniform
   plans were run by the profiler, so their error only shows the run-to-run drift.
3. **Measure**, single process: every plan's model is built once and the plans are stepped
   in interleaved rounds (forward, loss, backward, SGD step; median after warm-up), so a
   drift of the machine touches all plans alike. The noise is the fp32 plan built and timed
   twice in the same rounds. Peak memory: the live tensor bytes of one step, measured
   exactly with the profiler's allocator events (:mod:`qsync_opt.runtime.memory`).
4. **Two gloo processes** (``--gloo``): the all-reduce is fitted on a real 2-rank gloo group
   (alpha-beta), then ``qsync-opt train --nproc 2`` runs each of three plans and the median
   ``step_ms`` of the slower rank (compute, all-reduce and optimizer) is compared with the
   replayer's iteration for ``cpux2``.

    .venv/bin/python benchmarks/bench_prediction.py [--models digits_cnn,tiny_gpt,resnet18]
        [--repeats 15] [--gloo]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from qsync_opt.models import compute_loss, get_workload

from qsync_opt import Plan, parse_shorthand, trace
from qsync_opt._env import cpu_model, pin_malloc
from qsync_opt.precision import Precision
from qsync_opt.problem import AllocationProblem
from qsync_opt.profile import measure_comm_local, profile_detailed, spawn_local, with_comm
from qsync_opt.runtime import apply_plan
from qsync_opt.runtime.memory import measure_plan_memory, measure_step_memory
from qsync_opt.schemas import CommModel, CostTable
from qsync_opt.solve import _reachable_ms, solve
from qsync_opt.synthetic import random_indicator

BATCH = {"digits_cnn": 64, "tiny_gpt": 16, "resnet18": 8}
MIB = 1024 * 1024


class Runner:
    """A model built with one plan applied, its optimizer and fixed inputs."""

    def __init__(self, name: str, plan: Plan, batch: int) -> None:
        self.wl = get_workload(name)
        torch.manual_seed(0)
        self.model = self.wl.build().float().train()
        apply_plan(self.model, plan, "cpu")
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.inputs = self.wl.make_inputs(batch, torch.device("cpu"))
        self.targets = self.wl.make_targets(batch, torch.device("cpu"))

    def step(self) -> None:
        loss = compute_loss(self.wl, self.model(*self.inputs), self.targets)
        loss.backward()
        self.opt.step()

    def timed(self) -> float:
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        self.step()
        return (time.perf_counter() - t0) * 1e3


def interleaved(runners: dict[str, Runner], repeats: int, warmup: int = 3) -> dict[str, float]:
    samples: dict[str, list[float]] = {k: [] for k in runners}
    for r in range(warmup + repeats):
        for k, run in runners.items():
            t = run.timed()
            if r >= warmup:
                samples[k].append(t)
    return {k: statistics.median(v) for k, v in samples.items()}


def make_plans(prob: AllocationProblem, seed: int = 0) -> dict[str, Plan]:
    gm = prob.groups[0]

    def uniform(p: Precision) -> list[int]:
        return [c.index(p) if p in c else c.index(Precision.fp32) for c in gm.choices]

    plans = {f"uniform {p.value}": prob.make_plan({gm.name: uniform(p)})
             for p in (Precision.fp32, Precision.bf16, Precision.int8)}
    ref = prob.makespan_ms({gm.name: uniform(Precision.fp32)})
    lo = _reachable_ms(prob) or ref
    for frac in (1 / 3, 2 / 3):
        target = lo + frac * (ref - lo)
        try:
            plan, _ = solve(prob.retarget(target), "highs", refine=0, compare_ties=False)
            plans[f"solver @{target:.1f} ms"] = plan
        except Exception as exc:  # noqa: BLE001 - a benchmark row, not a crash
            print(f"  solver @{target:.1f} ms: no plan ({exc})")
    rng = random.Random(seed)
    pool = (Precision.fp32, Precision.bf16, Precision.int8)
    for k in range(2):
        a = [c.index(rng.choice([p for p in pool if p in c])) for c in gm.choices]
        plans[f"random mixed {k}"] = prob.make_plan({gm.name: a})
    return plans


def single_process(name: str, repeats: int) -> tuple[list[float], list[float], CostTable]:
    b = BATCH.get(name, 8)
    g = trace(name, b)
    prof = profile_detailed(name, b, device="cpu", repeats=repeats, threads=1)
    costs = prof.table
    prob = AllocationProblem(g, parse_shorthand(f"cpux1@{b}"), costs, random_indicator(g))
    plans = make_plans(prob)
    runners = {k: Runner(name, p, b) for k, p in plans.items()}
    runners["uniform fp32 (again)"] = Runner(name, plans["uniform fp32"], b)
    measured = interleaved(runners, repeats)
    n_a, n_b = measured["uniform fp32"], measured.pop("uniform fp32 (again)")
    runners.pop("uniform fp32 (again)")
    noise = abs(n_a - n_b) / min(n_a, n_b)
    print(f"\n== {name}, batch {b}: profiled in {prof.seconds:.1f} s (uniform plans only); "
          f"run-to-run noise {noise:.1%} (fp32 built and timed twice: {n_a:.2f} / {n_b:.2f} ms)")
    print(f"{'plan':>22} {'pred ms':>9} {'meas ms':>9} {'error':>7}   {'pred MiB':>9} "
          f"{'meas MiB':>9} {'error':>7}")
    t_err: list[float] = []
    m_err: list[float] = []
    for label, plan in plans.items():
        tl = prob.replayer.simulate(plan, events=False)
        pred = tl.iteration_ms
        pmem = tl.groups["cpu"].peak_memory_bytes
        mmem = measure_plan_memory(name, plan, b).peak_bytes
        meas = measured[label]
        e = (pred - meas) / meas
        em = (pmem - mmem) / mmem
        held = not label.startswith("uniform")
        if held:
            t_err.append(abs(e))
        m_err.append(abs(em))
        print(f"{label:>22} {pred:9.2f} {meas:9.2f} {e:+7.1%}   {pmem / MIB:9.2f} "
              f"{mmem / MIB:9.2f} {em:+7.1%}" + ("  (held out)" if held else ""))
    print(f"held-out mixed plans: time median |error| {statistics.median(t_err):.1%}, worst "
          f"{max(t_err):.1%} (noise {noise:.1%}); memory, all plans: median |error| "
          f"{statistics.median(m_err):.1%}, worst {max(m_err):.1%}")
    return t_err, m_err, costs


# ----------------------------------------------------------------------------- two processes


def _ddp_peaks(rank: int, name: str, b: int, plans: dict[str, str]) -> dict[str, int]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    wl = get_workload(name)
    out = {}
    for label, text in plans.items():
        torch.manual_seed(0)
        model = wl.build().float().train()
        apply_plan(model, Plan.model_validate_json(text), "cpu")
        ddp = DDP(model, forward_sync_buffers=False)  # the runtime's DDPSync wrapping
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        x = wl.make_inputs(b, torch.device("cpu"))
        y = wl.make_targets(b, torch.device("cpu"))

        def step(ddp: Any = ddp, opt: Any = opt, x: Any = x, y: Any = y) -> None:
            compute_loss(wl, ddp(*x), y).backward()
            opt.step()

        opt.zero_grad(set_to_none=True)
        step()
        opt.zero_grad(set_to_none=True)
        out[label] = measure_step_memory(model, step, optimizer=opt, extra=(*x, y)).peak_bytes
    return out


def ddp_peak_bytes(name: str, b: int, plans: dict[str, Plan]) -> dict[str, int]:
    """Rank 0's exact peak of one DDP step (2 gloo processes) per plan."""
    texts = {k: p.model_dump_json() for k, p in plans.items()}
    return spawn_local(_ddp_peaks, 2, name, b, texts)


def train_step_ms(name: str, plan: Plan, steps: int, tmp: Path, label: str) -> float:
    path = tmp / f"{label}.plan.json"
    plan.save(path)
    out = tmp / label
    cmd = [sys.executable, "-m", "qsync_opt.cli", "train", "--model", name, "--plan", str(path),
           "--nproc", "2", "--steps", str(steps), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    per_rank = []
    for r in (0, 1):
        rows = [json.loads(x) for x in (out / f"metrics.rank{r}.jsonl").read_text().splitlines()]
        per_rank.append(statistics.median(x["step_ms"] for x in rows[5:]))
    return max(per_rank)


def two_processes(name: str, costs: CostTable, steps: int, comm: CommModel
                  ) -> tuple[list[float], list[float]]:
    """Raw and runtime-calibrated |errors| of the held-out mixed plans, two gloo ranks.

    The single-process profile cannot see what the launched runtime adds per step (DDP's
    hooks and bucket copies, gloo's reduction work on the same cores, batch slicing, the
    finite check, metrics). One uniform fp32 run of the launcher measures it, as a factor
    on the prediction; the other plans are predicted with that factor.
    """
    b = BATCH.get(name, 8)
    g = trace(name, b)
    costs = with_comm(costs, g, comm)
    prob = AllocationProblem(g, parse_shorthand(f"cpux2@{b}"), costs, random_indicator(g))
    plans = make_plans(prob)
    keep = (["uniform fp32", "uniform bf16"] + [k for k in plans if k.startswith("solver")][:1]
            + ["random mixed 0"])
    raw_errs: list[float] = []
    cal_errs: list[float] = []
    mem_errs: list[float] = []
    print(f"\n== {name}, batch {b} per rank, 2 gloo processes (qsync-opt train --nproc 2, "
          f"{steps} steps, median step_ms of the slower rank from step 5); predicted all-reduce "
          f"{sum(prob.replayer.bucket_ms):.2f} ms in {len(prob.replayer.bucket_ms)} buckets, "
          f"stats + buffer syncs {prob.replayer.step_sync_ms:.2f} ms")
    print(f"{'plan':>22} {'pred ms':>9} {'meas ms':>9} {'error':>7} {'x runtime':>10} "
          f"{'error':>7}   {'pred MiB':>9} {'meas MiB':>9} {'error':>7}")
    factor = None
    peaks = ddp_peak_bytes(name, b, {k: plans[k] for k in keep})
    with tempfile.TemporaryDirectory() as d:
        for label in keep:
            tl = prob.replayer.simulate(plans[label], events=False)
            meas = train_step_ms(name, plans[label], steps, Path(d), label.replace(" ", "_"))
            pred = tl.iteration_ms
            if factor is None:
                factor = meas / pred  # the uniform fp32 run: the runtime's factor
            cal = pred * factor
            e, ec = (pred - meas) / meas, (cal - meas) / meas
            held = not label.startswith("uniform")
            if held:
                raw_errs.append(abs(e))
                cal_errs.append(abs(ec))
            tag = ("  (sets the runtime factor)" if label == "uniform fp32"
                   else "  (held out)" if held else "")
            pm = tl.groups["cpu"].peak_memory_bytes
            mm = peaks[label]
            mem_errs.append(abs(pm - mm) / mm)
            print(f"{label:>22} {pred:9.2f} {meas:9.2f} {e:+7.1%} {cal:10.2f} {ec:+7.1%}   "
                  f"{pm / MIB:9.2f} {mm / MIB:9.2f} {(pm - mm) / mm:+7.1%}{tag}")
    print(f"runtime factor (launched step / single-process prediction, uniform fp32): "
          f"x{factor:.3f}; memory: rank 0's exact peak of one DDP step, worst |error| "
          f"{max(mem_errs):.1%}")
    return raw_errs, cal_errs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="digits_cnn,tiny_gpt,resnet18")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--gloo", action="store_true", help="also two gloo processes")
    ap.add_argument("--steps", type=int, default=30, help="training steps per gloo run")
    ap.add_argument("--tables", default=None, help="folder: save each model's profiled "
                    "CostTable there, and with --gloo-only read them back")
    ap.add_argument("--gloo-only", action="store_true",
                    help="only the two-process part, from the tables in --tables")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    pin_malloc()
    print(f"machine: {cpu_model()}, torch {torch.__version__}, 1 thread per process, glibc "
          "malloc thresholds pinned (qsync_opt._env.pin_malloc)")
    t_all: list[float] = []
    m_all: list[float] = []
    tables: dict[str, CostTable] = {}
    folder = Path(args.tables) if args.tables else None
    for name in args.models.split(","):
        if args.gloo_only:
            if folder is None:
                ap.error("--gloo-only needs --tables")
            tables[name] = CostTable.load(folder / f"{name}.costs.json")
            continue
        t, m, tables[name] = single_process(name, args.repeats)
        if folder is not None:
            tables[name].save(folder / f"{name}.costs.json")
        t_all += t
        m_all += m
    if t_all:
        print(f"\nall models, single process: held-out time median |error| "
              f"{statistics.median(t_all):.1%}, worst {max(t_all):.1%}; memory median "
              f"{statistics.median(m_all):.1%}, worst {max(m_all):.1%}")
    if args.gloo or args.gloo_only:
        comm = measure_comm_local(2)
        print(f"\ngloo all-reduce, 2 processes on this machine: {comm.bandwidth_gb_per_s:.3g} "
              f"GB/s, {comm.latency_us:.3g} us per hop (fitted)")
        g_raw: list[float] = []
        g_cal: list[float] = []
        for name in args.models.split(","):
            r, c = two_processes(name, tables[name], args.steps, comm)
            g_raw += r
            g_cal += c
        if g_raw:
            print(f"\ntwo gloo processes, held-out mixed plans: median |error| "
                  f"{statistics.median(g_raw):.1%}, worst {max(g_raw):.1%} from the profile "
                  f"alone; {statistics.median(g_cal):.1%}, worst {max(g_cal):.1%} with the "
                  "runtime factor of one uniform fp32 launch")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
