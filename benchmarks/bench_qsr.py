"""Local SGD with the quadratic synchronisation rule (QSR) against DDP.

Per model, four sync modes at equal steps under one cosine schedule:

* ``ddp``: gradients all-reduced every step;
* ``local:H0``: parameters averaged every ``H0`` steps (QSR's ``h_base``);
* ``local:Hq``: a constant period with QSR's round count (``Hq = steps / rounds(QSR)``,
  rounded): the control the claim needs, since QSR's claim is quality at *equal*
  communication;
* ``qsr:alpha=A,h_base=H0``: H = max(H0, floor((A / lr)^2)) at each round's start.

Each mode is trained on two ranks of this CPU, every op at fp32, ``--seeds`` seeds in the
emulation (one process, both replicas: the same arithmetic as two processes, checked by
tests/sync/test_local_sgd.py) and ``--gloo-seeds`` of them also on two real gloo ranks
(``qsync-opt train --nproc 2``), where communication is measured: ``comm_ms`` (wall time
inside collectives, from the metrics rows), its share of the step time, the payload bytes
(``bytes_sent``) and the wall time. Held-out loss (and accuracy for a classifier) is the
emulation's, mean and 95% Student t interval over the seeds, and each mode minus DDP
paired per seed. Non-inferiority: a mode passes when the upper end of the 95% interval of
(mode - DDP) held-out loss is below ``--margin`` (stated before the runs in
docs/BENCHMARKS.md).

The replayer's prediction: ``replay --sync MODE`` for two ranks of this CPU, every op's time
profiled here (fp32, in context, one thread) and the all-reduce fitted on two gloo
processes, against the gloo runs' measured per-step time (mean ``step_ms`` from step 5,
slower rank: the mean, since a median would skip the rare sync steps); raw, with the
runtime factor that DDP's run sets (what the launched runtime adds per step, as
bench_prediction.py calibrates it), and with the factor ``local:H0``'s run sets (the same
runtime without the DDP wrapper, whose reducer and gloo thread share this CPU's cores with
backward). QSR's claim is also read directly: QSR minus ``local:Hq``, paired per seed.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_qsr.py --models digits_cnn tiny_gpt --seeds 5 --gloo-seeds 1 --dump F
    .venv/bin/python benchmarks/bench_qsr.py --report F     # the tables again, from F
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_accuracy import ci  # the benchmarks' one 95% t interval

from qsync_opt import load_cluster, trace
from qsync_opt.core.machine import cpu_model
from qsync_opt.job.rank import emulate
from qsync_opt.problem.plan import make_plan
from qsync_opt.replayer import Replayer, sync_model_for
from qsync_opt.runtime.config import TrainConfig
from qsync_opt.runtime.faults import NO_FAULTS
from qsync_opt.strategy.modes import parse_sync, rounds
from qsync_opt.strategy.schedule import parse_schedule

REPO = Path(__file__).resolve().parents[1]

#: Per model: steps, per-rank batch, optimizer, peak lr, schedule, QSR's alpha and h_base,
#: held-out batches, the non-inferiority margin in held-out loss (nats).
DEFAULTS: dict[str, dict[str, Any]] = {
    "digits_cnn": dict(steps=300, batch=32, optimizer="sgd", lr=0.1,
                       schedule="cosine:warmup=15", alpha=0.12, h_base=2, eval_batches=3,
                       margin=0.02),
    "tiny_gpt": dict(steps=200, batch=16, optimizer="adamw", lr=3e-3,
                     schedule="cosine:warmup=10", alpha=0.0045, h_base=2, eval_batches=8,
                     margin=0.02),
}


def modes_for(model: str, d: dict[str, Any]) -> dict[str, str]:
    qsr = f"qsr:alpha={d['alpha']:g},h_base={d['h_base']}"
    sched = parse_schedule(d["schedule"], d["lr"], d["steps"])
    n_qsr = len(rounds(parse_sync(qsr), sched, d["steps"]))
    hq = max(1, round(d["steps"] / n_qsr))
    return {"ddp": "ddp", f"local:{d['h_base']}": f"local:{d['h_base']}",
            f"local:{hq} (QSR's rounds)": f"local:{hq}", "qsr": qsr}


def _rows(out: Path, rank: int = 0) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / f"metrics.rank{rank}.jsonl").read_text().splitlines()]


def run_emulated(model: str, plan: Path, d: dict[str, Any], sync: str, seed: int,
                 out: Path) -> dict[str, Any]:
    cfg = TrainConfig(workload=model, plan_path=str(plan), rank_groups=["cpu", "cpu"],
                      steps=d["steps"], lr=d["lr"], lr_schedule=d["schedule"],
                      optimizer=d["optimizer"], momentum=0.9, seed=seed, out_dir=str(out),
                      emulate_dp=True, eval_batches=d["eval_batches"], sync=sync)
    s = emulate(cfg, faults=NO_FAULTS)
    rows = _rows(out)
    return {"eval_loss": s["eval_loss"], "eval_accuracy": s["eval_accuracy"],
            "rounds": sum(r["synced"] for r in rows),
            "bytes": sum(r["bytes_sent"] for r in rows)}


def run_gloo(model: str, d: dict[str, Any], sync: str, seed: int, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "qsync_opt.cli", "train", "--model", model, "--nproc", "2",
           "--batch", str(d["batch"]), "--steps", str(d["steps"]), "--lr", str(d["lr"]),
           "--lr-schedule", d["schedule"], "--optimizer", d["optimizer"], "--seed", str(seed),
           "--sync", sync, "--out", str(out), "--backend", "gloo", "--timeout", "300"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"gloo run failed ({model}, {sync}):\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    rows = _rows(out)
    step = sum(r["step_ms"] for r in rows)
    comm = sum(r["comm_ms"] for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    # the per-step time of a run whose syncs are rare is its mean (a median would skip the
    # sync steps), from step 5, of the slower rank
    mean_step = max(statistics.mean(r["step_ms"] for r in _rows(out, k)[5:]) for k in (0, 1))
    return {"rounds": sum(r["synced"] for r in rows), "bytes": sum(r["bytes_sent"] for r in rows),
            "comm_ms": comm, "comm_share": comm / step if step else float("nan"),
            "step_ms_mean": mean_step,
            "train_wall_s": summary["wall_s"], "launch_wall_s": wall,
            "eval_loss": summary["eval_loss"]}


def predictor(model: str, d: dict[str, Any], comm: Any) -> Any:
    """The replayer's per-step time of ``--sync MODE`` for this model on two ranks of this
    CPU: every op's time profiled here (in context, fp32, one thread), the all-reduce the
    alpha-beta fitted on two real gloo processes (``comm``)."""
    from qsync_opt.costs.tables import with_comm
    from qsync_opt.profile import profile_detailed

    g = trace(model, d["batch"])
    costs = with_comm(profile_detailed(model, d["batch"], device="cpu", precisions=["fp32"],
                                       threads=1, graph=g).table, g, comm)
    cluster = load_cluster(f"cpux2@{d['batch']}")
    opt = "adam" if d["optimizer"] in ("adam", "adamw") else "sgd"

    def step_ms(sync: str) -> float:
        rep = Replayer(g, cluster, costs, optimizer=opt,
                       sync=sync_model_for(sync, lr=d["lr"], lr_schedule=d["schedule"],
                                           steps=d["steps"]))
        return rep.simulate(rep.uniform("highest"), events=False).iteration_ms

    return step_ms


def fmt(m: float, h: float, digits: int) -> str:
    return f"{m:.{digits}f}" + ("" if math.isnan(h) else f" +- {h:.{digits}f}")


def report(model: str, doc: dict[str, Any], gloo: bool) -> None:
    """Print one model's tables from its figures (``doc``: ``settings`` and ``modes``, as
    ``--dump`` writes them): the modes against DDP, QSR against the constant period of the
    same round count, and the replayer's prediction against the gloo runs."""
    d, res = doc["settings"], doc["modes"]
    lossd = [r["eval_loss"] for r in res["ddp"]["emulated"]]
    clf = res["ddp"]["emulated"][0]["eval_accuracy"] is not None
    head = (f"  {'mode':<22} {'rounds':>6} {'MB sent':>8} {'comm ms':>9} {'share':>6} "
            f"{'wall s':>7} {'step ms':>8} {'pred ms':>8}  {'held-out loss':>16}"
            + (f"  {'accuracy':>16}" if clf else "") + "  loss - ddp (paired)   verdict")
    print(head)
    for name, r in res.items():
        e, g = r["emulated"], r["gloo"]
        loss = [x["eval_loss"] for x in e]
        m, h = ci(loss)
        dd, hh = ci([a - b for a, b in zip(loss, lossd, strict=True)])
        ok = name == "ddp" or (not math.isnan(hh) and dd + hh < d["margin"])

        def gm(k: str, g: list[dict[str, Any]] = g) -> float:
            return statistics.mean(x[k] for x in g) if g else float("nan")

        acc = ""
        if clf:
            am, ah = ci([x["eval_accuracy"] for x in e])
            acc = f"  {fmt(am, ah, 4):>16}"
        verdict = "(reference)" if name == "ddp" else (
            "non-inferior" if ok else "NOT shown non-inferior")
        print(f"  {name:<22} {e[0]['rounds']:>6} {e[0]['bytes'] / 1e6:>8.2f} "
              f"{gm('comm_ms'):>9.1f} {gm('comm_share'):>6.1%} {gm('train_wall_s'):>7.1f} "
              f"{gm('step_ms_mean'):>8.2f} {r['predicted_step_ms']:>8.2f}  "
              f"{fmt(m, h, 4):>16}{acc}  "
              + ("" if name == "ddp" else f"{fmt(dd, hh, 4):>18}") + f"   {verdict}")
        r["verdict"] = {"mean": dd, "half_width": hh, "non_inferior": ok}
    names = list(res)
    qsr, equal = names[-1], names[-2]  # modes_for's order: ..., local:Hq, qsr
    lq = [x["eval_loss"] for x in res[qsr]["emulated"]]
    le = [x["eval_loss"] for x in res[equal]["emulated"]]
    m, h = ci([a - b for a, b in zip(lq, le, strict=True)])
    print(f"  QSR's claim, at equal communication: {qsr} ({res[qsr]['emulated'][0]['rounds']} "
          f"rounds) - {equal} ({res[equal]['emulated'][0]['rounds']} rounds) held-out loss "
          f"{fmt(m, h, 4)} (paired): "
          + ("QSR better" if m + h < 0 else "QSR worse" if m - h > 0 else "no difference shown"))
    if not gloo:
        return
    meas = {n: statistics.mean(x["step_ms_mean"] for x in r["gloo"]) for n, r in res.items()}
    local0 = names[1]  # local:H0: the runtime without DDP, the local modes' own calibration
    f_ddp = meas["ddp"] / res["ddp"]["predicted_step_ms"]
    f_loc = meas[local0] / res[local0]["predicted_step_ms"]
    print("  replay --sync MODE against the measured per-step time (mean from step 5, slower "
          f"rank): raw; with the runtime factor x{f_ddp:.3f} DDP's run sets; with "
          f"x{f_loc:.3f} {local0}'s run sets (the same runtime without DDP)")
    for n, r in res.items():
        pred = r["predicted_step_ms"]
        e = (pred - meas[n]) / meas[n]
        ec = (pred * f_ddp - meas[n]) / meas[n]
        el = (pred * f_loc - meas[n]) / meas[n]
        print(f"    {n:<22} predicted {pred:7.2f} ms, measured {meas[n]:7.2f} ms: {e:+.1%}; "
              f"x ddp's factor {ec:+.1%}; x {local0}'s factor {el:+.1%}")
        r["prediction_error"], r["calibrated_error"], r["local_calibrated_error"] = e, ec, el


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(DEFAULTS), choices=list(DEFAULTS))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--gloo-seeds", type=int, default=1,
                    help="of the seeds, how many also run on two real gloo ranks")
    ap.add_argument("--steps", type=int, default=None, help="default: per model")
    ap.add_argument("--dump", type=Path, default=None, help="JSON of every figure")
    ap.add_argument("--report", type=Path, default=None,
                    help="print the tables of a --dump file again, training nothing")
    args = ap.parse_args(argv)
    if args.report:
        doc = json.loads(args.report.read_text())
        for model, m in doc.items():
            s = m["settings"]
            print(f"\n{model}: 2 ranks x {s['batch']}, {s['steps']} steps, {s['optimizer']} lr "
                  f"{s['lr']:g} {s['schedule']}; non-inferiority margin {s['margin']:g} nats")
            report(model, m, any(r["gloo"] for r in m["modes"].values()))
        return 0
    if args.seeds < 2:
        raise SystemExit("--seeds: expected at least 2 (a 95% interval)")
    torch.set_num_threads(1)
    print(f"machine: {cpu_model()}; torch threads 1; load average "
          f"{os.getloadavg()[0]:.2f} at the start")
    dump: dict[str, Any] = {}
    comm = None
    if args.gloo_seeds:
        from qsync_opt.profile.gloo import measure_comm_local

        comm = measure_comm_local(2)
        print(f"gloo all-reduce, 2 processes here: {comm.bandwidth_gb_per_s:.3g} GB/s, "
              f"{comm.latency_us:.3g} us per hop (fitted)")
    for model in args.models:
        d = dict(DEFAULTS[model])
        if args.steps:
            d["steps"] = args.steps
        modes = modes_for(model, d)
        print(f"\n{model}: 2 ranks x {d['batch']}, {d['steps']} steps, {d['optimizer']} lr "
              f"{d['lr']:g} {d['schedule']}, {args.seeds} seeds (emulated), "
              f"{args.gloo_seeds} on gloo; non-inferiority margin {d['margin']:g} nats")
        res: dict[str, dict[str, Any]] = {}
        step_ms = predictor(model, d, comm) if comm is not None else None
        with tempfile.TemporaryDirectory() as tmp:
            plan = Path(tmp) / "fp32.plan.json"
            make_plan(trace(model, d["batch"]), load_cluster(f"cpux2@{d['batch']}"), {}).save(plan)
            for name, sync in modes.items():
                emu = [run_emulated(model, plan, d, sync, s, Path(tmp) / f"e{name}{s}")
                       for s in range(args.seeds)]
                glo = [run_gloo(model, d, sync, s, Path(tmp) / f"g{name}{s}")
                       for s in range(args.gloo_seeds)]
                res[name] = {"sync": sync, "emulated": emu, "gloo": glo,
                             "predicted_step_ms": step_ms(sync) if step_ms else float("nan")}
                print(f"  {name}: done", flush=True)
        dump[model] = {"settings": d, "modes": res}
        report(model, dump[model], args.gloo_seeds > 0)
    if args.dump:
        args.dump.write_text(json.dumps(dump, indent=2, default=float) + "\n")
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
