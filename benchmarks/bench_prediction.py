"""Predicted against measured iteration time and peak memory on this CPU, from profiled costs.

Per model, at a small batch, one thread per process:

1. **Profile** once (``qsync_opt.profile``, the default in-context method): only *uniform*
   plans run (every choosable op at fp32, at bf16, at fp16, at int8, at int8_full).
2. **Plans**: uniform fp32, bf16 and int8; mixed plans from the exact solver (HiGHS) at
   makespan targets a third and two thirds of the way from the fastest to the fp32
   iteration; two random mixed plans (each op fp32, bf16 or int8, seeded). Duplicates are
   dropped (said so); a plan is "held out" only when it is really mixed (two precisions at
   least), and no mixed plan is ever profiled.
3. **Measure**, single process: every plan is timed in each of ``--processes`` fresh
   processes (forward, loss, backward, SGD step; interleaved rounds; median after warm-up).
   The spread of one plan across processes is the run-to-run noise, and errors are given
   with their range over processes. Peak memory: the live tensor bytes of one step, measured
   exactly with the profiler's allocator events (:mod:`qsync_opt.runtime.memory`).
4. **Two gloo processes** (``--gloo``): the all-reduce is fitted on a real 2-rank gloo group
   (alpha-beta), then ``qsync-opt train --nproc 2`` runs each of four plans
   ``--gloo-repeats`` times, interleaved; the median ``step_ms`` of the slower rank is
   compared with the replayer's iteration for ``cpux2``, and rank 0's peak memory is measured
   inside the rank (``--measure-memory``).
5. **Memory on workloads the memory model was not fitted on** (``--memory-models``, default
   resnet50 at batch 2): one process and inside rank 0 of two gloo ranks.

    .venv/bin/python benchmarks/bench_prediction.py [--models digits_cnn,tiny_gpt,resnet18]
        [--repeats 15] [--processes 3] [--gloo] [--gloo-repeats 2] [--memory-models resnet50@2]
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

import torch
from qsync_opt.models import compute_loss, get_workload

from qsync_opt import Plan, estimate, parse_shorthand, trace
from qsync_opt.core.machine import cpu_model, pin_malloc
from qsync_opt.core.precision import Precision
from qsync_opt.documents.schemas import CommModel, CostTable
from qsync_opt.planner.solve import reachable_ms, solve
from qsync_opt.problem.program import AllocationProblem, ProblemOptions
from qsync_opt.problem.synthetic import random_indicator
from qsync_opt.profile import measure_comm_local, profile_detailed, with_comm
from qsync_opt.runtime import apply_plan
from qsync_opt.runtime.memory import measure_plan_memory

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


def is_mixed(assignment: list[int], choices: list[list[Precision]]) -> bool:
    """At least two precisions among the group's choosable units."""
    return len({ch[k] for ch, k in zip(choices, assignment, strict=True)}) > 1


def make_plans(prob: AllocationProblem, seed: int = 0, n_random: int = 2
               ) -> tuple[dict[str, Plan], set[str]]:
    """Distinct plans (duplicates dropped, said so) and the labels of the held-out ones:
    every mixed plan (two precisions at least) is held out; uniform plans are not."""
    gm = prob.groups[0]
    choices = [list(c) for c in gm.choices]

    def uniform(p: Precision) -> list[int]:
        return [c.index(p) if p in c else c.index(Precision.fp32) for c in choices]

    plans: dict[str, Plan] = {}
    seen: dict[tuple[int, ...], str] = {}
    held: set[str] = set()

    def add(label: str, a: list[int], plan: Plan | None = None) -> bool:
        key = tuple(a)
        if key in seen:
            print(f"  {label}: the same plan as {seen[key]}, dropped")
            return False
        seen[key] = label
        plans[label] = plan if plan is not None else prob.make_plan({gm.name: a})
        if is_mixed(a, choices):
            held.add(label)
        return True

    for p in (Precision.fp32, Precision.bf16, Precision.int8):
        add(f"uniform {p.value}", uniform(p))
    ref = prob.makespan_ms({gm.name: uniform(Precision.fp32)})
    lo = reachable_ms(prob) or ref
    for frac in (1 / 3, 2 / 3):
        target = lo + frac * (ref - lo)
        try:
            plan, _ = solve(prob.retarget(target), "highs", refine=0, compare_ties=False)
        except Exception as exc:  # noqa: BLE001 - a benchmark row, not a crash
            print(f"  solver @{target:.1f} ms: no plan ({exc})")
            continue
        a = prob.assignment(plan)[gm.name]
        if not is_mixed(a, choices):
            print(f"  solver @{target:.1f} ms: a uniform plan, not held out")
        add(f"solver @{target:.1f} ms", a, plan)
    rng = random.Random(seed)
    pool = (Precision.fp32, Precision.bf16, Precision.int8)
    made, tries = 0, 0
    while made < n_random and tries < 200:  # random plans that are mixed and new
        tries += 1
        a = [c.index(rng.choice([p for p in pool if p in c])) for c in choices]
        if is_mixed(a, choices) and tuple(a) not in seen:
            add(f"random mixed {made}", a)
            made += 1
    return plans, held


def measure_child(spec_path: str) -> int:
    """``--child SPEC``: one fresh process times every plan of SPEC (interleaved rounds) and
    prints ``{label: median ms}`` as JSON."""
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    pin_malloc()
    runners = {k: Runner(spec["name"], Plan.model_validate_json(t), spec["batch"])
               for k, t in spec["plans"].items()}
    print(json.dumps(interleaved(runners, spec["repeats"])))
    return 0


def measure_processes(name: str, b: int, plans: dict[str, Plan], repeats: int, processes: int
                      ) -> dict[str, list[float]]:
    """Each plan's median step in each of ``processes`` fresh processes (run one after the
    other; in each, the plans interleaved)."""
    out: dict[str, list[float]] = {k: [] for k in plans}
    with tempfile.TemporaryDirectory() as d:
        spec = Path(d) / "spec.json"
        spec.write_text(json.dumps({"name": name, "batch": b, "repeats": repeats,
                                    "plans": {k: p.model_dump_json() for k, p in plans.items()}}))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for _ in range(processes):
            res = subprocess.run([sys.executable, __file__, "--child", str(spec)], check=True,
                                 capture_output=True, text=True, env=env)
            for k, v in json.loads(res.stdout.strip().splitlines()[-1]).items():
                out[k].append(float(v))
    return out


def single_process(name: str, repeats: int, processes: int = 3
                   ) -> tuple[list[float], list[float], CostTable]:
    b = BATCH.get(name, 8)
    g = trace(name, b)
    prof = profile_detailed(name, b, device="cpu", repeats=repeats, threads=1)
    costs = prof.table
    prob = AllocationProblem(g, parse_shorthand(f"cpux1@{b}"), costs, random_indicator(g),
                             ProblemOptions(lower_reference=True))
    plans, held = make_plans(prob)
    runs = measure_processes(name, b, plans, repeats, processes)
    med = {k: statistics.median(v) for k, v in runs.items()}
    noise = max((max(v) - min(v)) / med[k] for k, v in runs.items())
    print(f"\n== {name}, batch {b}: profiled in {prof.seconds:.1f} s (uniform plans only); "
          f"{len(plans)} distinct plans, {len(held)} mixed (held out), each timed in "
          f"{processes} fresh processes; run-to-run noise: same plan, different processes, up "
          f"to {noise:.1%}")
    print(f"{'plan':>22} {'pred ms':>9} {'meas ms':>9} {'range ms':>13} {'error':>7} "
          f"{'error range':>15}   {'pred MiB':>9} {'meas MiB':>9} {'error':>7}")
    t_err: list[float] = []
    m_err: list[float] = []
    for label, plan in plans.items():
        tl = prob.replayer.simulate(plan, events=False)
        pred = tl.iteration_ms
        pmem = tl.groups["cpu"].peak_memory_bytes
        mmem = measure_plan_memory(name, plan, b).peak_bytes
        meas, lo, hi = med[label], min(runs[label]), max(runs[label])
        e = (pred - meas) / meas
        e_lo, e_hi = (pred - hi) / hi, (pred - lo) / lo
        em = (pmem - mmem) / mmem
        if label in held:
            t_err.append(abs(e))
        m_err.append(abs(em))
        print(f"{label:>22} {pred:9.2f} {meas:9.2f} {f'{lo:.2f}-{hi:.2f}':>13} {e:+7.1%} "
              f"{f'{e_lo:+.1%}..{e_hi:+.1%}':>15}   {pmem / MIB:9.2f} {mmem / MIB:9.2f} "
              f"{em:+7.1%}" + ("  (held out)" if label in held else ""))
    if t_err:
        print(f"held-out mixed plans: time median |error| {statistics.median(t_err):.1%}, "
              f"worst {max(t_err):.1%} (noise up to {noise:.1%}); ", end="")
    print(f"memory, all plans: median |error| {statistics.median(m_err):.1%}, worst "
          f"{max(m_err):.1%}")
    return t_err, m_err, costs


# ----------------------------------------------------------------------------- two processes


def train_run(name: str, plan: Plan, steps: int, tmp: Path, label: str,
              memory_step: int | None = None) -> tuple[float, int | None]:
    """``qsync-opt train --nproc 2``: the slower rank's median ``step_ms`` (from step 5, the
    measured step left out) and rank 0's exact peak of step ``memory_step``, measured inside
    the rank (``--measure-memory``)."""
    path = tmp / f"{label}.plan.json"
    plan.save(path)
    out = tmp / label
    cmd = [sys.executable, "-m", "qsync_opt.cli", "train", "--model", name, "--plan", str(path),
           "--nproc", "2", "--steps", str(steps), "--out", str(out), "--no-resume"]
    if memory_step is not None:
        cmd += ["--measure-memory", str(memory_step)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    per_rank = []
    for r in (0, 1):
        rows = [json.loads(x) for x in (out / f"metrics.rank{r}.jsonl").read_text().splitlines()]
        timed = [x["step_ms"] for x in rows[5:] if x["step"] != memory_step]
        per_rank.append(statistics.median(timed) if timed else float("nan"))
    peak = None
    if memory_step is not None:
        peak = json.loads((out / "summary.rank0.json").read_text())["memory"]["peak_bytes"]
    return max(per_rank), peak


def two_processes(name: str, costs: CostTable, steps: int, comm: CommModel, repeats: int = 2
                  ) -> tuple[list[float], list[float]]:
    """Raw and runtime-calibrated |errors| of the held-out mixed plans, two gloo ranks.

    The single-process profile cannot see what the launched runtime adds per step (DDP's
    hooks and bucket copies, gloo's reduction work on the same cores, batch slicing, the
    finite check, metrics). The uniform fp32 launches measure it, as a factor on the
    prediction; the other plans are predicted with that factor. Every plan is launched
    ``repeats`` times, the plans interleaved; peak memory is measured inside rank 0 of the
    first launch of each plan.
    """
    b = BATCH.get(name, 8)
    g = trace(name, b)
    costs = with_comm(costs, g, comm)
    prob = AllocationProblem(g, parse_shorthand(f"cpux2@{b}"), costs, random_indicator(g),
                             ProblemOptions(lower_reference=True))
    plans, held = make_plans(prob)
    keep = (["uniform fp32", "uniform bf16"]
            + [k for k in plans if k.startswith("solver") and k in held][:1]
            + [k for k in plans if k.startswith("random") and k in held][:1])
    raw_errs: list[float] = []
    cal_errs: list[float] = []
    mem_errs: list[float] = []
    print(f"\n== {name}, batch {b} per rank, 2 gloo processes (qsync-opt train --nproc 2, "
          f"{steps} steps, median step_ms of the slower rank from step 5; {repeats} launches "
          f"per plan, interleaved); predicted all-reduce {sum(prob.replayer.bucket_ms):.2f} ms "
          f"in {len(prob.replayer.bucket_ms)} buckets, stats + buffer syncs "
          f"{prob.replayer.step_sync_ms:.2f} ms")
    print(f"{'plan':>22} {'pred ms':>9} {'meas ms':>9} {'range ms':>13} {'error':>7} "
          f"{'x runtime':>10} {'error':>7}   {'pred MiB':>9} {'in-rank MiB':>11} {'error':>7}")
    times: dict[str, list[float]] = {k: [] for k in keep}
    peaks: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as d:
        for rep in range(repeats):
            for label in keep:
                t, peak = train_run(name, plans[label], steps, Path(d),
                                    f"{label.replace(' ', '_')}_{rep}",
                                    memory_step=3 if rep == 0 else None)
                times[label].append(t)
                if peak is not None:
                    peaks[label] = peak
    pred_fp32 = prob.replayer.simulate(plans["uniform fp32"], events=False).iteration_ms
    factor = statistics.median(times["uniform fp32"]) / pred_fp32
    for label in keep:
        tl = prob.replayer.simulate(plans[label], events=False)
        meas = statistics.median(times[label])
        pred = tl.iteration_ms
        cal = pred * factor
        e, ec = (pred - meas) / meas, (cal - meas) / meas
        if label in held:
            raw_errs.append(abs(e))
            cal_errs.append(abs(ec))
        tag = ("  (sets the runtime factor)" if label == "uniform fp32"
               else "  (held out)" if label in held else "")
        pm = tl.groups["cpu"].peak_memory_bytes
        mm = peaks[label]
        mem_errs.append(abs(pm - mm) / mm)
        rng = f"{min(times[label]):.2f}-{max(times[label]):.2f}"
        print(f"{label:>22} {pred:9.2f} {meas:9.2f} {rng:>13} {e:+7.1%} {cal:10.2f} {ec:+7.1%}"
              f"   {pm / MIB:9.2f} {mm / MIB:11.2f} {(pm - mm) / mm:+7.1%}{tag}")
    print(f"runtime factor (launched step / single-process prediction, uniform fp32): "
          f"x{factor:.3f}; memory: rank 0's exact peak of step 3 measured inside "
          f"`qsync-opt train`, worst |error| {max(mem_errs):.1%}")
    return raw_errs, cal_errs


def memory_only(name: str, batch: int, steps: int = 4) -> list[float]:
    """Peak memory of a workload the memory model's constants were not fitted on: estimated
    costs (time is not checked), the fp32 activation flow of the runtime; the exact peak of
    one step in one process and inside rank 0 of a two-rank launch."""
    g = trace(name, batch)
    base = None
    errs: list[float] = []
    for world in (1, 2):
        cl = parse_shorthand(f"cpux{world}@{batch}")
        costs = estimate(g, cl).model_copy(update={"activation_flow": "fp32"})
        prob = AllocationProblem(g, cl, costs, random_indicator(g),
                             ProblemOptions(lower_reference=True))
        if base is None:
            made, _ = make_plans(prob, n_random=1)
            # fp32 and one mixed plan: bf16 and int8 steps of a large model are slow on a CPU
            # without AMX, and memory needs no repeats
            base = {k: prob.assignment(p)["cpu"] for k, p in made.items()
                    if k in ("uniform fp32", "random mixed 0")}
        where = "one process" if world == 1 else "2 gloo ranks, inside rank 0"
        print(f"\n== {name}, batch {batch}, memory only ({where}; a workload the memory "
              "model was not fitted on)")
        print(f"{'plan':>22} {'pred MiB':>9} {'meas MiB':>9} {'error':>7}")
        with tempfile.TemporaryDirectory() as d:
            for label, a in base.items():
                plan = prob.make_plan({"cpu": a})
                pm = prob.replayer.simulate(plan, events=False).groups["cpu"].peak_memory_bytes
                if world == 1:
                    mm: int | None = measure_plan_memory(name, plan, batch).peak_bytes
                else:
                    _, mm = train_run(name, plan, steps, Path(d), label.replace(" ", "_"),
                                      memory_step=2)
                assert mm is not None
                errs.append(abs(pm - mm) / mm)
                print(f"{label:>22} {pm / MIB:9.2f} {mm / MIB:9.2f} {(pm - mm) / mm:+7.1%}")
    print(f"{name}: worst |memory error| {max(errs):.1%}")
    return errs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="digits_cnn,tiny_gpt,resnet18")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--processes", type=int, default=3,
                    help="fresh processes timing every plan, one after the other (default 3)")
    ap.add_argument("--gloo", action="store_true", help="also two gloo processes")
    ap.add_argument("--steps", type=int, default=30, help="training steps per gloo run")
    ap.add_argument("--gloo-repeats", type=int, default=2, help="launches per plan (default 2)")
    ap.add_argument("--memory-models", default="resnet50@2",
                    help="workloads the memory model was not fitted on, as NAME@BATCH; memory "
                         "only ('' to skip)")
    ap.add_argument("--tables", default=None, help="folder: save each model's profiled "
                    "CostTable there, and with --gloo-only read them back")
    ap.add_argument("--gloo-only", action="store_true",
                    help="only the two-process part, from the tables in --tables")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return measure_child(args.child)
    torch.set_num_threads(1)
    pin_malloc()
    print(f"machine: {cpu_model()}, torch {torch.__version__}, 1 thread per process, glibc "
          f"malloc thresholds pinned (qsync_opt.core.machine.pin_malloc); load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores at the start")
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
        t, m, tables[name] = single_process(name, args.repeats, args.processes)
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
            r, c = two_processes(name, tables[name], args.steps, comm, args.gloo_repeats)
            g_raw += r
            g_cal += c
        if g_raw:
            print(f"\ntwo gloo processes, held-out mixed plans: median |error| "
                  f"{statistics.median(g_raw):.1%}, worst {max(g_raw):.1%} from the profile "
                  f"alone; {statistics.median(g_cal):.1%}, worst {max(g_cal):.1%} with the "
                  "runtime factor of the uniform fp32 launches")
    for spec in filter(None, args.memory_models.split(",")):
        name, _, b = spec.partition("@")
        memory_only(name, int(b or 2))
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
