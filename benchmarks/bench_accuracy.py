"""Accuracy of plans where plans really differ: a two-group hybrid trained under each plan,
many seeds.

Cluster. One strong and one weak group of one device each, both at ``--batch`` per rank:
by default this CPU and ``cpu/2`` (an emulated card half as fast), or with ``--cluster`` two
catalog cards (e.g. ``v100x1+t4x1``: the plans are chosen from the catalog's estimates for
those cards). ``--int4`` adds int4 to the menu of every group whose card has an INT4 peak
(the library's :func:`~qsync_opt.costs.devices.enable_int4`: the T4 becomes ``t4:int4``); each
group's menu is printed. The training is emulated on this CPU either way, single-process
data parallel (``TrainConfig(emulate_dp=True)``, mathematically the synchronous run).

Target. ``--target F`` sets ONE makespan target shared by every exact and greedy plan
(``prob.retarget``): low + F * (fp32 - low), where fp32 is the linear model's makespan with
every op at fp32 and low the smaller of the weak group's uniform lowest precision (UP) and
the smallest makespan any plan reaches (``solve.reachable_ms``; on small models casts can
make UP slower than fp32, then the fastest plan is the low end, and a note says so). F < 1
forces the weak group below fp32 but leaves it a choice. The solver's own default target
(the strong group at fp32, no straggler) and whether any plan reaches it are printed with
UP, fp32 and the target. Without ``--target`` and ``--int4`` the old study runs: the solver's
own default target (its lexicographic fallback when that is out of reach); with ``--int4``
the default is F = 0.5.

Plans. Every op at fp32 (reference); the weak group uniformly at its lowest precision (UP);
the exact plan (HiGHS) under each indicator of ``--methods`` (default curv qsync hessian
fisher: curv first, the best-ranking indicator, so the random plans match its plan's time),
each computed by ``indicate(model, 10, method, batch=--batch, cache=False)`` on the
workload's real data, afresh and timed; greedy at the same target, with QSync's own
indicator (qsync when among ``--methods``, else the first method's: the paper's allocator); ``--random-plans N`` distinct random weak-group plans (:func:`random_plans`) each
within ``--tol`` (1%) of the first exact plan's predicted makespan, verified and printed (a
SystemExit says so when fewer exist). Two methods giving the identical plan: it is trained
once and the result reused (printed).

Metrics (held-out, after the run). ``emulate``'s summary has ``eval_loss`` and
``eval_accuracy``: rank 0's replica in eval mode, *at rank 0's group's precisions*, on
``--eval-batches`` held-out batches of the global batch (2 x ``--batch`` samples), each
batch's mean loss weighted by its number of samples. For a causal LM (tiny_gpt) a batch's
loss is ``F.cross_entropy`` over all its (sequence, position) tokens and every batch has the
same number of tokens, so ``eval_loss`` is the mean per-token cross-entropy (nats) over
every held-out token; for a classifier (digits_cnn) the mean cross-entropy per image. Since
greedy may also lower the strong group (rank 0), that score would mix the plan's effect on
training with low-precision inference; so every plan's trained weights (``emulate``'s
checkpoint; all replicas hold the same weights) are re-scored here at fp32 on the very same
held-out batches, weighted the same way (the largest gap to ``eval_loss`` is printed).
Primary figure: for a causal LM the held-out perplexity ``exp(mean token CE)`` (with the
token CE; the untrained model's is printed once, for context); for a classifier the held-out
loss, with the accuracy. The held-out batches depend on the seed only, so every plan is
scored on the same data. Any registry workload with real data runs (``Workload.real_data``).

Statistics. Mean and 95% confidence interval over the seeds (Student t). Seeds are shared
across plans (same seed: same initial weights, same training batches, same held-out batches),
so each plan is compared with the reference *paired*: per seed the difference plan minus
reference, then the mean of those differences and its 95% t interval. "within noise" when
the interval contains 0; otherwise the difference and its interval are stated as beyond
noise. Each exact plan against the random plans: per seed the median of the N random plans'
metric, then exact minus that median, paired over seeds (mean, 95% t interval). The goal
(the exact plan loses less than random plans) holds for a method when that difference is negative and larger in size than the
interval's half-width; one verdict line per method. The same paired test compares the first
exact plan with greedy and UP. ``--dump FILE`` writes per-plan per-seed metrics, predicted
makespans, plan descriptions, indicator timings and the target as JSON.

    .venv/bin/python benchmarks/bench_accuracy.py --model digits_cnn --cluster v100x1+t4x1 --int4 --seeds 5
    .venv/bin/python benchmarks/bench_accuracy.py --model tiny_gpt --cluster v100x1+t4x1 --int4 --seeds 5 --dump acc.json
    .venv/bin/python benchmarks/bench_accuracy.py --model tiny_gpt --seeds 5
    .venv/bin/python benchmarks/bench_accuracy.py --model digits_cnn --seeds 5 --cluster v100x1+t4x1

Per-model defaults (override with the flags): digits_cnn and digits_resnet batch 32, 150
steps, SGD lr 0.05; tiny_gpt batch 16, 120 steps, Adam lr 1e-3; 8 held-out batches each.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import random
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from qsync_opt import estimate, parse_shorthand, trace
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.machine import cpu_model
from qsync_opt.core.precision import Precision
from qsync_opt.costs.devices import enable_int4
from qsync_opt.documents.schemas import ClusterSpec, Plan
from qsync_opt.indicator import METHODS, indicate
from qsync_opt.job.rank import emulate
from qsync_opt.planner.solve import InfeasibleError, reachable_ms, solve
from qsync_opt.problem.program import AllocationProblem
from qsync_opt.runtime.config import TrainConfig
from qsync_opt.strategy.schedule import parse_schedule

#: The switches (--float-gemm, --emulate-half) held for the whole run.
_MODES = contextlib.ExitStack()

#: Two-sided 95% Student t quantiles by sample size n (df = n - 1), when scipy is absent.
T95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306,
       10: 2.262, 11: 2.228, 12: 2.201, 13: 2.179, 14: 2.160, 15: 2.145, 16: 2.131,
       17: 2.120, 18: 2.110, 19: 2.101, 20: 2.093, 21: 2.086, 26: 2.060, 31: 2.042}

#: Per-model defaults: per-rank batch, steps, optimizer, learning rate, held-out batches.
DEFAULTS: dict[str, dict[str, Any]] = {
    "digits_cnn": {"batch": 32, "steps": 150, "optimizer": "sgd", "lr": 0.05, "eval_batches": 8},
    "digits_resnet": {"batch": 32, "steps": 150, "optimizer": "sgd", "lr": 0.05,
                      "eval_batches": 8},
    "tiny_gpt": {"batch": 16, "steps": 120, "optimizer": "adam", "lr": 1e-3, "eval_batches": 8},
}
FALLBACK: dict[str, Any] = {"batch": 32, "steps": 150, "optimizer": "sgd", "lr": 0.05, "eval_batches": 8}

REF = "reference fp32"
UP = "weak lowest (UP)"
GREEDY = "greedy"
DEFAULT_METHODS = ("curv", "qsync", "hessian", "fisher")
#: With --int4 and no --target: the target's fraction of the way from the low end to fp32.
INT4_FRACTION = 0.5


def t95(n: int) -> float:
    try:
        from scipy.stats import t as student_t

        return float(student_t.ppf(0.975, n - 1))
    except ImportError:
        return T95.get(n, T95[max(k for k in T95 if k <= n)] if n > 2 else float("nan"))


def ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% Student t interval (nan for one sample)."""
    m = statistics.mean(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, t95(len(xs)) * statistics.stdev(xs) / math.sqrt(len(xs))


def paired(xs: list[float], ys: list[float], digits: int) -> str:
    """Paired comparison of x against y (same seeds): mean of x - y, its 95% t interval."""
    d, h = ci([x - y for x, y in zip(xs, ys, strict=True)])
    if math.isnan(h):
        return f"{d:+.{digits}f} (one seed: no interval)"
    text = f"{d:+.{digits}f} +- {h:.{digits}f}"
    return f"within noise ({text})" if abs(d) <= h else f"{text} beyond noise"


def versus_median(xs: list[float], others: list[list[float]]) -> tuple[float, float]:
    """x minus, per seed, the median of ``others`` (each a per-seed list), paired over the
    seeds: the mean difference and the half-width of its 95% t interval."""
    meds = [statistics.median(col) for col in zip(*others, strict=True)]
    return ci([x - m for x, m in zip(xs, meds, strict=True)])


def goal_holds(d: float, h: float) -> bool:
    """The goal: the exact plan loses less (d < 0) by more than the 95% interval."""
    return not math.isnan(h) and d < 0 and abs(d) > h


def target_for(prob: AllocationProblem, fraction: float) -> dict[str, float]:
    """The makespans the target is placed between, and the target: low + fraction * (fp32 -
    low), low the smaller of UP's makespan and the smallest reachable one (when some group
    fits no plan, UP's)."""
    fp32 = prob.makespan_ms({g.name: [c.index(Precision.fp32) for c in g.choices]
                             for g in prob.groups})
    up = prob.makespan_ms(up_assignment(prob))
    fastest = reachable_ms(prob)
    low = min(up, fastest) if fastest is not None else up
    return {"fp32_ms": fp32, "up_ms": up, "fastest_ms": fastest if fastest is not None
            else float("nan"), "low_ms": low, "fraction": fraction,
            "target_ms": low + fraction * (fp32 - low)}


def up_assignment(prob: AllocationProblem) -> dict[str, list[int]]:
    """QSync's UP: the strong groups at their reference, the others at their lowest."""
    return {g.name: (list(g.reference) if g.name in prob.strong_groups else g.lowest())
            for g in prob.groups}


def random_plan(prob: AllocationProblem, target_ms: float, seed: int, tol: float = 0.01,
                walk: int = 2000, restarts: int = 20) -> dict[str, list[int]]:
    """A random weak-group assignment whose linear makespan is within ``tol`` of ``target_ms``.

    Independent uniform draws almost never land near a tight target (slow precisions and
    casts dominate), so this is a random walk: from a uniform random start, single-op changes
    are accepted when they do not move the makespan away from the target, then, once inside
    the band, ``walk`` more proposals wander within it. A walk stuck outside the band (no
    single change gets closer) starts again from a new random start, up to ``restarts``
    times. The strong groups stay at fp32. Where no assignment lies in the band it returns
    the closest it found (the caller checks).
    """
    rng = random.Random(seed)
    weak = [g for g in prob.groups if g.name not in prob.strong_groups]
    band = tol * target_ms
    best: dict[str, list[int]] | None = None
    best_dist = math.inf
    for _ in range(restarts):
        a = prob.reference_assignment()
        for g in weak:
            a[g.name] = [rng.randrange(len(c)) for c in g.choices]
        dist = abs(prob.makespan_ms(a) - target_ms)
        inside = 0
        for _ in range(200_000 // restarts):
            g = rng.choice(weak)
            u = rng.randrange(len(g.choices))
            b = dict(a)
            b[g.name] = list(a[g.name])
            b[g.name][u] = rng.randrange(len(g.choices[u]))
            if g.memory_bytes(b[g.name]) > g.capacity_bytes:
                continue
            d = abs(prob.makespan_ms(b) - target_ms)
            if d <= max(dist, band):
                a, dist = b, d
            if dist <= band:
                inside += 1
                if inside >= walk:
                    break
        if dist < best_dist:
            best, best_dist = a, dist
        if dist <= band:
            break
    assert best is not None
    return best


def key_of(assignment: dict[str, list[int]]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple(sorted((g, tuple(a)) for g, a in assignment.items()))


def random_plans(prob: AllocationProblem, target_ms: float, n: int, tol: float = 0.01,
                 tries: int = 20, exclude: set[Any] | None = None
                 ) -> list[tuple[int, dict[str, list[int]]]]:
    """``n`` distinct :func:`random_plan` assignments (seeds 0, 1, ...; a seed repeating an
    earlier plan is skipped, at most ``tries * n`` seeds), each verified within ``tol`` of
    ``target_ms``. SystemExit, with the reason, when a draw misses the band or fewer than
    ``n`` distinct plans turn up. Plans whose :func:`key_of` is in ``exclude`` (the exact
    plans) are skipped too: a random plan is compared with them, so it is never one."""
    out: list[tuple[int, dict[str, list[int]]]] = []
    seen: set[Any] = set(exclude or ())
    for seed in range(tries * n):
        a = random_plan(prob, target_ms, seed, tol)
        ms = prob.makespan_ms(a)
        if abs(ms - target_ms) > tol * target_ms:
            raise SystemExit(
                f"random plan seed {seed}: predicted makespan {ms:.4f} ms is "
                f"{(ms - target_ms) / target_ms:+.2%} from the target {target_ms:.4f} ms, "
                f"outside {tol:.0%} (the walk found no plan that close: the band holds few "
                "or none; use another --target or a larger --tol)")
        k = key_of(a)
        if k in seen:
            continue
        seen.add(k)
        out.append((seed, a))
        if len(out) == n:
            return out
    raise SystemExit(
        f"random plans: only {len(out)} distinct plan(s) within {tol:.0%} of "
        f"{target_ms:.4f} ms after {tries * n} seeds, {n} wanted (the band holds too few "
        "plans; use another --target, fewer --random-plans or a larger --tol)")


def fp32_eval(model: str, seed: int, global_batch: int, eval_batches: int,
              checkpoint: Path | None = None) -> tuple[float, float | None]:
    """Held-out (loss, accuracy or None) of fp32 weights, on the held-out batches ``emulate``
    scores for ``seed``, weighted as it weights them: the seed's initial weights, or the
    trained weights of ``checkpoint`` (``emulate``'s)."""
    from qsync_opt.models import TASK_CLASSIFICATION, compute_loss, get_workload

    from qsync_opt.job.rank import GlobalBatches, load_checkpoint

    wl = get_workload(model)
    torch.manual_seed(seed)
    net = wl.build().float()
    if checkpoint is not None:
        net.load_state_dict(load_checkpoint(checkpoint)["model"])
    net.eval()
    data = GlobalBatches(wl, seed, global_batch)
    tot, correct, n = 0.0, 0.0, 0
    with torch.no_grad():
        for inputs, targets in data.eval_batches(eval_batches):
            out = net(*inputs)
            assert targets is not None
            k = targets.shape[0]
            tot += float(compute_loss(wl, out, targets)) * k
            if wl.task == TASK_CLASSIFICATION:
                correct += float((out.argmax(-1) == targets).sum())
            n += k
    return tot / n, (correct / n if wl.task == TASK_CLASSIFICATION else None)


def training_key(args: argparse.Namespace, plan: Plan, seed: int, steps: int, lr: float,
                 optimizer: str, batch: int, eval_batches: int) -> str:
    """What decides one training's result, hashed: the ``--results`` file's key."""
    what = {"model": args.model, "seed": seed, "steps": steps, "lr": lr,
            "optimizer": optimizer, "batch": batch, "eval_batches": eval_batches,
            "float_gemm": bool(args.float_gemm), "emulate_half": bool(args.emulate_half),
            "precisions": {g: {op: Precision(p).value for op, p in sorted(gp.precisions.items())}
                           for g, gp in sorted(plan.groups.items())}}
    schedule = getattr(args, "lr_schedule", "constant")
    if schedule != "constant":  # absent from the key when constant: older results stay valid
        what["lr_schedule"] = schedule
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]


def parse_seed_range(text: str) -> range:
    """``A-B`` (inclusive) or ``A`` as a range of seeds."""
    try:
        a, _, b = text.partition("-")
        lo, hi = int(a), int(b or a)
    except ValueError:
        raise SystemExit(f"--train-seeds: expected A-B (two seeds, A <= B), got {text!r}") \
            from None
    if lo < 0 or hi < lo:
        raise SystemExit(f"--train-seeds: expected 0 <= A <= B, got {text!r}")
    return range(lo, hi + 1)


def read_results(path: Path | None) -> dict[str, dict[str, Any]]:
    """The trainings a ``--results`` file holds, by key (a torn last line is skipped)."""
    out: dict[str, dict[str, Any]] = {}
    if path is None or not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        out[row["key"]] = row
    return out


def at_batch(plan: Plan, batch: int) -> Plan:
    """``plan`` with every group at ``batch`` per device: its precisions were chosen at
    ``--plan-batch`` (the cost model's), the runtime trains the batch its plan file says."""
    groups = {n: gp.model_copy(update={"batch_per_device": batch})
              for n, gp in plan.groups.items()}
    cluster = plan.cluster.model_copy(update={"groups": [
        g.model_copy(update={"batch_per_device": batch}) for g in plan.cluster.groups]})
    return plan.model_copy(update={"groups": groups, "cluster": cluster})


def describe(plan: Plan) -> str:
    """Per group, how many ops run at each precision."""
    parts = []
    for name, gp in plan.groups.items():
        c = Counter(Precision(p).value for p in gp.precisions.values())
        parts.append(f"{name}: " + ", ".join(f"{k} {v}" for v, k in
                                             sorted(((v, k) for k, v in c.items()), reverse=True)))
    return "; ".join(parts)


def menus(prob: AllocationProblem) -> dict[str, list[str]]:
    """Per group, every precision some unit may take, most exact first."""
    out = {}
    for g in prob.groups:
        seen: list[str] = []
        for c in g.choices:
            seen += [p.value for p in c if p.value not in seen]
        out[g.name] = seen
    return out


def build_cluster(cluster: str | None, batch: int, int4: bool) -> tuple[str, ClusterSpec]:
    shorthand = "+".join(f"{part.split('@')[0]}@{batch}" for part in
                         (cluster or "cpux1+cpu/2x1").split("+"))
    spec = parse_shorthand(shorthand)
    if len(spec.groups) != 2 or any(gr.count != 1 for gr in spec.groups):
        raise SystemExit("--cluster: expected two groups of one device each, e.g. v100x1+t4x1")
    if int4:
        spec, got = enable_int4(spec)
        if not got:
            raise SystemExit(f"--int4: no group of {shorthand} is on a card with an INT4 peak "
                             "(T4, A10 or a derived CPU standing in for one)")
        shorthand = "+".join(f"{g.device}x{g.count}@{batch}" for g in spec.groups)
    return shorthand, spec


def exact_plan(prob: AllocationProblem, target_ms: float | None) -> Plan:
    try:
        if target_ms is None:
            return solve(prob, "highs", refine=0, compare_ties=False)[0]
        return solve(prob.retarget(target_ms, "bench_accuracy --target"), "highs",
                     mode="target", refine=0, compare_ties=False)[0]
    except InfeasibleError as e:
        raise SystemExit(f"exact plan at target {target_ms}: {e}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="digits_cnn")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=None, help="default: per model")
    ap.add_argument("--batch", type=int, default=None, help="per-rank batch; default: per model")
    ap.add_argument("--lr", type=float, default=None, help="default: per model")
    ap.add_argument("--optimizer", choices=["sgd", "adam"], default=None,
                    help="default: per model")
    ap.add_argument("--eval-batches", type=int, default=None, help="default: per model")
    ap.add_argument("--lr-schedule", default="constant", metavar="S",
                    help="train's --lr-schedule (constant, cosine[:warmup=W,final=F], "
                         "step:every=N[,gamma=G,warmup=W]); default %(default)s")
    ap.add_argument("--train-seeds", default=None, metavar="A-B",
                    help="train seeds A..B (inclusive) of every plan into --results and stop, "
                         "no report: two processes on two cores fill one study's results "
                         "file; the report is a later run with --seeds N that reads them back")
    ap.add_argument("--confirm-from", type=int, default=None, metavar="K",
                    help="also give the exact-vs-random verdict over seeds K..N-1 alone (a "
                         "confirmatory set of seeds added after a first look at 0..K-1)")
    ap.add_argument("--cluster", default=None,
                    help="two one-device groups whose catalog estimates choose the plans, e.g. "
                         "v100x1+t4x1 (default: cpux1+cpu/2x1, this CPU's own ratios); the "
                         "training is emulated on this CPU either way")
    ap.add_argument("--int4", action="store_true",
                    help="int4 on the menu of every group whose card has an INT4 peak (t4:int4)")
    ap.add_argument("--target", type=float, default=None, metavar="F",
                    help="target = low + F * (fp32 - low), low = min(UP, fastest plan); "
                         f"default: {INT4_FRACTION} with --int4, else the solver's own target")
    ap.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=METHODS,
                    help="indicators, one exact plan each (default: %(default)s)")
    ap.add_argument("--random-plans", type=int, default=5, metavar="N",
                    help="distinct random plans of the first exact plan's predicted makespan")
    ap.add_argument("--tol", type=float, default=0.01,
                    help="random plans' relative makespan tolerance (default 0.01)")
    ap.add_argument("--plan-batch", type=int, default=None, metavar="B",
                    help="per-rank batch the plans are chosen for (the cost model's; default "
                         "--batch): on these small models casts dominate at a small batch and "
                         "no target favours int4/int8; the plan is trained at --batch")
    ap.add_argument("--unpin-head", action="store_true",
                    help="let the classifier head / lm_head compete (more decision units)")
    ap.add_argument("--plans-only", action="store_true",
                    help="print the target and the plans, train nothing")
    ap.add_argument("--dump", type=Path, default=None, metavar="FILE",
                    help="JSON: per-plan per-seed metrics, predictions, target, timings")
    ap.add_argument("--results", type=Path, default=None, metavar="FILE.jsonl",
                    help="every finished training appended here as one JSON line, keyed by "
                         "what decides it (model, precisions, seed, steps, lr, optimizer, "
                         "batch, held-out batches, switches); a training already there is "
                         "read back, not run again: a study resumes across sessions")
    ap.add_argument("--emulate-half", action="store_true",
                    help="run 16-bit GEMMs and convolutions in fp32 on the 16-bit values, "
                         "results rounded to 16 bit (ops.emulated_half): a 16-bit GEMM with "
                         "fp32 accumulation up to the order of the adds, many times faster on "
                         "a CPU without fast fp16 / bf16 kernels; not bit for bit")
    ap.add_argument("--float-gemm", action="store_true",
                    help="run the integer GEMMs as bit-identical fp32 GEMMs "
                         "(ops.float_exact_gemm): same results, far faster on a CPU without "
                         "AMX-INT8 / AVX512-VNNI; wall times are then not the integer GEMM's")
    args = ap.parse_args(argv)
    train_seeds = parse_seed_range(args.train_seeds) if args.train_seeds else None
    if train_seeds is not None and args.results is None:
        raise SystemExit("--train-seeds: needs --results FILE.jsonl (where the trainings go)")
    if args.confirm_from is not None and not 0 < args.confirm_from < args.seeds - 1:
        raise SystemExit(f"--confirm-from: expected 1..{args.seeds - 2} (at least two "
                         f"seeds on each side of it), got {args.confirm_from}")
    if args.float_gemm:
        from qsync_opt import ops

        _MODES.enter_context(ops.float_exact_gemm())  # held to the end of the process
        print("integer GEMMs run as bit-identical fp32 GEMMs (--float-gemm)")
    if args.emulate_half:
        from qsync_opt import ops as _ops

        _MODES.enter_context(_ops.emulated_half())
        print("16-bit GEMMs emulated: fp32 arithmetic on 16-bit values, 16-bit results "
              "(--emulate-half)")
    if args.random_plans < 1:
        raise SystemExit("--random-plans: expected at least 1")
    methods = list(dict.fromkeys(args.methods))
    torch.set_num_threads(1)
    from qsync_opt.models import TASK_CAUSAL_LM, get_workload

    wl = get_workload(args.model)
    if not wl.real_data:
        raise SystemExit(f"--model {args.model}: no real data set (the study trains and "
                         "scores on real data)")
    d = DEFAULTS.get(args.model, FALLBACK)
    batch = args.batch or d["batch"]
    steps = args.steps or d["steps"]
    lr = args.lr or d["lr"]
    optimizer = args.optimizer or d["optimizer"]
    eval_batches = args.eval_batches if args.eval_batches is not None else d["eval_batches"]
    try:
        schedule = parse_schedule(args.lr_schedule, lr, steps)
    except QsyncInputError as e:
        raise SystemExit(f"--lr-schedule: {e}") from None
    args.lr_schedule = schedule.describe()  # canonical: the results key and the header
    lm = wl.task == TASK_CAUSAL_LM
    fraction = args.target if args.target is not None else (INT4_FRACTION if args.int4 else None)
    t_start = time.perf_counter()

    plan_batch = args.plan_batch or batch
    g = trace(args.model, plan_batch, pin_head=not args.unpin_head)
    shorthand, cluster = build_cluster(args.cluster, plan_batch, args.int4)
    rank_groups = [gr.name for gr in cluster.groups]
    costs = estimate(g, cluster)
    probs: dict[str, AllocationProblem] = {}
    ind_s: dict[str, float] = {}
    for m in methods:
        t0 = time.perf_counter()
        ind = indicate(args.model, 10, m, batch=batch, cache=False, graph=g)
        ind_s[m] = time.perf_counter() - t0
        probs[m] = AllocationProblem(g, cluster, costs, ind)
    prob = probs[methods[0]]
    print(f"machine: {cpu_model()}; torch threads {torch.get_num_threads()}")
    print(f"{args.model} on {shorthand}, {steps} steps, {optimizer} lr {lr:g}"
          + ("" if args.lr_schedule == "constant" else f" ({schedule.describe()})")
          + (f", {args.seeds} seeds" if train_seeds is None
             else f", seeds {args.train_seeds} (training only)")
          + f", emulated DP, {eval_batches} held-out batches of {2 * batch}; "
          f"{len(g.choosable_ops())} choosable ops"
          + ("" if plan_batch == batch else
             f"; plans chosen for {plan_batch} per rank, trained at {batch} per rank"))
    for name, menu in menus(prob).items():
        dev = prob.group(name).device
        strong = " (strong, held at fp32)" if name in prob.held_groups else ""
        print(f"menu of {name} ({dev}){strong}: {', '.join(menu)}")
    print("indicators (10 real batches of " + f"{batch}, not cached): "
          + ", ".join(f"{m} {s:.1f} s" for m, s in ind_s.items()))

    tg = target_for(prob, fraction if fraction is not None else 0.0)
    reach = "reached by" if tg["fastest_ms"] <= prob.target_ms * (1 + 1e-9) else "below"
    print(f"makespans (linear model): fp32 {tg['fp32_ms']:.4f} ms, UP {tg['up_ms']:.4f} ms, "
          f"fastest plan {tg['fastest_ms']:.4f} ms; solver's default target "
          f"{prob.target_ms:.4f} ms ({prob.target_source}), {reach} the fastest plan")
    if tg["up_ms"] > tg["low_ms"] * (1 + 1e-9):
        print(f"note: UP is not the fastest plan ({tg['up_ms']:.4f} > {tg['low_ms']:.4f} ms: "
              "casts and slow low precisions); the target's low end is the fastest plan")
    if tg["fp32_ms"] <= tg["low_ms"] * (1 + 1e-9):
        print("WARNING: no plan is faster than fp32; the target leaves no choice")
    if fraction is None:
        target_ms = None
        print("target: the solver's own (no --target, no --int4: the old study)")
    else:
        target_ms = tg["target_ms"]
        print(f"target: {target_ms:.4f} ms = low {tg['low_ms']:.4f} + {fraction:g} x (fp32 "
              f"{tg['fp32_ms']:.4f} - low), shared by every exact and greedy plan")

    plans: dict[str, Plan] = {
        REF: prob.make_plan({gm.name: [c.index(Precision.fp32) for c in gm.choices]
                             for gm in prob.groups}),
        UP: prob.make_plan(up_assignment(prob)),
    }
    exact_names = []
    for m in methods:
        plan = exact_plan(probs[m], target_ms)
        if target_ms is None:  # the first method's target is everyone's
            target_ms = float(plan.provenance["target_ms"])  # type: ignore[arg-type]
        plans[f"exact ({m})"] = plan
        exact_names.append(f"exact ({m})")
    first = exact_names[0]
    assert target_ms is not None
    gprob = probs["qsync"] if "qsync" in probs else prob
    greedy, _ = solve(gprob.retarget(target_ms, "bench_accuracy"), "greedy", mode="target",
                      refine=0, compare_ties=False)
    plans[GREEDY] = greedy
    exact_ms = prob.makespan_ms(prob.assignment(plans[first]))
    rand = random_plans(prob, exact_ms, args.random_plans, args.tol,
                        exclude={key_of(prob.assignment(plans[n])) for n in exact_names})
    rand_names = []
    for seed, a in rand:
        name = f"random {seed}"
        plans[name] = prob.make_plan(a)
        rand_names.append(name)

    # one training per distinct plan; the others reuse its results
    pred = {n: prob.makespan_ms(prob.assignment(p)) for n, p in plans.items()}
    trained_as: dict[str, str] = {}
    by_key: dict[Any, str] = {}
    for name, plan in plans.items():
        k = key_of(prob.assignment(plan))
        trained_as[name] = by_key.setdefault(k, name)

    print(f"plans (predicted makespan; target {target_ms:.4f} ms):")
    for name, plan in plans.items():
        same = f"  [identical to {trained_as[name]}: trained once]" \
            if trained_as[name] != name else ""
        print(f"  {name:>20} {pred[name]:9.4f} ms: {describe(plan)}{same}")
    print(f"random plans against {first}'s {exact_ms:.4f} ms (tolerance {args.tol:.0%}): "
          + ", ".join(f"{n} {pred[n]:.4f} ({(pred[n] - exact_ms) / exact_ms:+.2%})"
                      for n in rand_names))
    if args.plans_only:
        return 0
    u, _ = fp32_eval(args.model, 0, 2 * batch, eval_batches)
    if lm:
        print(f"untrained (seed 0 init, fp32): held-out token CE {u:.4f} nats, "
              f"perplexity {math.exp(u):.2f}")
    else:
        print(f"untrained (seed 0 init, fp32): held-out loss {u:.4f}")

    cache = read_results(args.results)
    loss: dict[str, list[float]] = {}
    acc: dict[str, list[float]] = {}
    wall: dict[str, list[float]] = {}
    rank0_gap: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, plan) in enumerate(plans.items()):
            if trained_as[name] != name:
                continue
            path = Path(tmp) / f"{i}.plan.json"
            at_batch(plan, batch).save(path)  # chosen at --plan-batch, trained at --batch
            for seed in (train_seeds if train_seeds is not None else range(args.seeds)):
                key = training_key(args, plan, seed, steps, lr, optimizer, batch,
                                   eval_batches)
                got = cache.get(key)
                if got is None:
                    cfg = TrainConfig(workload=args.model, plan_path=str(path),
                                      rank_groups=rank_groups, steps=steps, lr=lr,
                                      optimizer=optimizer, seed=seed,
                                      out_dir=str(Path(tmp) / f"{i}-{seed}"), emulate_dp=True,
                                      resume=False, eval_batches=eval_batches,
                                      lr_schedule=args.lr_schedule)
                    s = emulate(cfg)
                    if s["batches"] != [batch] * len(rank_groups):
                        raise SystemExit(f"trained at {s['batches']} per rank, not --batch "
                                         f"{batch}")
                    fp32, fp32_acc = fp32_eval(args.model, seed, 2 * batch, eval_batches,
                                               Path(cfg.out_dir) / "checkpoint.pt")
                    got = {"key": key, "plan": name, "seed": seed, "fp32_loss": fp32,
                           "fp32_accuracy": fp32_acc, "eval_loss": s["eval_loss"],
                           "wall_s": s["wall_s"], "batches": s["batches"]}
                    if args.results is not None:
                        with args.results.open("a", encoding="utf-8") as fh:
                            fh.write(json.dumps(got) + "\n")
                    cache[key] = got
                    print(f"  trained {name}, seed {seed}: {fp32:.4f} ({s['wall_s']:.0f} s)",
                          flush=True)
                s = {"eval_loss": got["eval_loss"], "wall_s": got["wall_s"]}
                fp32, fp32_acc = got["fp32_loss"], got["fp32_accuracy"]
                loss.setdefault(name, []).append(fp32)
                rank0_gap[name] = max(rank0_gap.get(name, 0.0),
                                      abs(float(s["eval_loss"]) - fp32))
                if fp32_acc is not None:
                    acc.setdefault(name, []).append(fp32_acc)
                wall.setdefault(name, []).append(float(s["wall_s"]))
    if train_seeds is not None:
        print(f"trained seeds {args.train_seeds} of every plan into {args.results}; the "
              "report: the same command with --seeds N and without --train-seeds "
              f"({time.perf_counter() - t_start:.0f} s)")
        return 0
    for name, src in trained_as.items():
        for table in (loss, acc, wall):
            if src in table:
                table[name] = table[src]
        rank0_gap.setdefault(name, rank0_gap[src])

    print()
    w = max(len(n) for n in plans)
    if lm:
        metric = {n: [math.exp(x) for x in xs] for n, xs in loss.items()}
        print(f"{'plan':>{w}} {'held-out perplexity':>21} {'token CE (nats)':>19} "
              f"{'predicted ms':>12} {'train s':>7}  perplexity vs reference (paired)")
        for name in plans:
            pm, ph = ci(metric[name])
            lo_m, lo_h = ci(loss[name])
            verdict = "" if name == REF else paired(metric[name], metric[REF], 3)
            print(f"{name:>{w}} {pm:10.3f} +- {ph:7.3f} {lo_m:8.4f} +- {lo_h:7.4f} "
                  f"{pred[name]:12.4f} {statistics.mean(wall[name]):7.1f}  {verdict}")
        print("per seed perplexity: " + "; ".join(
            f"{n}: " + " ".join(f"{x:.3f}" for x in metric[n]) for n in plans))
    else:
        metric = loss
        print(f"{'plan':>{w}} {'held-out loss':>19} {'accuracy':>17} {'predicted ms':>12} "
              f"{'train s':>7}  loss vs reference (paired) | accuracy vs reference (paired)")
        for name in plans:
            lo_m, lo_h = ci(loss[name])
            am, ah = ci(acc[name]) if acc.get(name) else (float("nan"), float("nan"))
            verdict = ("" if name == REF else paired(loss[name], loss[REF], 4) + " | "
                       + paired(acc[name], acc[REF], 4))
            print(f"{name:>{w}} {lo_m:8.4f} +- {lo_h:7.4f} {am:7.4f} +- {ah:6.4f} "
                  f"{pred[name]:12.4f} {statistics.mean(wall[name]):7.1f}  {verdict}")
        print("per seed loss: " + "; ".join(
            f"{n}: " + " ".join(f"{x:.4f}" for x in loss[n]) for n in plans))
        print("per seed accuracy: " + "; ".join(
            f"{n}: " + " ".join(f"{x:.4f}" for x in acc[n]) for n in plans))
    print("emulate's own eval_loss (rank 0's replica at its group's precisions) against the "
          "fp32 score, largest |difference| over seeds: "
          + ", ".join(f"{n} {rank0_gap[n]:.2g}" for n in plans))
    what = "perplexity" if lm else "loss"
    digits = 3 if lm else 4
    print(f"exact minus the median of the {len(rand_names)} random plans, paired per seed "
          f"(held-out {what}; negative: exact better):")
    verdicts = {}
    for name in exact_names:
        dd, hh = versus_median(metric[name], [metric[r] for r in rand_names])
        ok = goal_holds(dd, hh)
        verdicts[name] = {"mean": dd, "half_width": hh, "goal_holds": ok}
        interval = "no interval" if math.isnan(hh) else f"+- {hh:.{digits}f}"
        print(f"  {name} - median random: {dd:+.{digits}f} {interval}; goal "
              + ("HOLDS (exact loses less, beyond the 95% interval)" if ok else
                 "does not hold" + (" (exact worse)" if dd > 0 else
                                    " (within the 95% interval)")))
    if args.confirm_from is not None:
        k = args.confirm_from
        print(f"the same over seeds {k}..{args.seeds - 1} alone (the confirmatory seeds, "
              f"added after a first look at seeds 0..{k - 1}):")
        for name in exact_names:
            dd, hh = versus_median(metric[name][k:], [metric[r][k:] for r in rand_names])
            ok = goal_holds(dd, hh)
            verdicts[name]["confirmatory"] = {"from_seed": k, "mean": dd, "half_width": hh,
                                              "goal_holds": ok}
            print(f"  {name} - median random: {dd:+.{digits}f} +- {hh:.{digits}f}; goal "
                  + ("HOLDS" if ok else "does not hold"))
    print(f"{first} vs others, paired held-out {what} (exact minus other; negative: exact "
          "better):")
    for other in (*exact_names[1:], GREEDY, UP):
        print(f"  {first} - {other}: {paired(metric[first], metric[other], digits)}")
    total = time.perf_counter() - t_start
    print(f"total {total:.0f} s")
    if args.dump is not None:
        doc = {
            "model": args.model, "cluster": shorthand, "menus": menus(prob),
            "steps": steps, "batch": batch, "optimizer": optimizer, "lr": lr,
            "eval_batches": eval_batches, "seeds": list(range(args.seeds)),
            "methods": methods, "indicator_s": ind_s, "metric": what,
            "target": {**tg, "target_ms": target_ms, "fraction": fraction,
                       "solver_default_ms": prob.target_ms,
                       "solver_default_source": prob.target_source},
            "random": {"against": first, "makespan_ms": exact_ms, "tol": args.tol,
                       "seeds": [s for s, _ in rand]},
            "plans": {n: {"describe": describe(plans[n]), "predicted_ms": pred[n],
                          "trained_as": trained_as[n], "loss": loss[n],
                          "accuracy": acc.get(n), "metric": metric[n], "train_s": wall[n],
                          "precisions": {gname: {op: Precision(p).value for op, p in
                                                 gp.precisions.items()}
                                         for gname, gp in plans[n].groups.items()}}
                      for n in plans},
            "exact_vs_median_random": verdicts, "total_s": total,
        }
        args.dump.write_text(json.dumps(doc, indent=1, allow_nan=True))
        print(f"wrote {args.dump}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
