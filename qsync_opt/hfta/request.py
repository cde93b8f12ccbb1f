"""A sweep's request and its checks, which need no torch (the command line builds its
parser and checks the flags without importing the trainer): the seeds and values flags
parsed, how many models they make, and every setting checked before anything is built."""

from __future__ import annotations

import re
from dataclasses import dataclass

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.limits import parse_float
from qsync_opt.runtime.config import MAX_ABS_SEED
from qsync_opt.strategy.schedule import parse_schedule

__all__ = ["MAX_MODELS", "SweepRequest", "check_request", "parse_seeds", "parse_values"]


#: Models of one sweep (seeds x learning rates x weight decays).
MAX_MODELS = 4096


def parse_seeds(text: str) -> list[int]:
    """``0-7``, ``0,3,5`` or a mix (``0-3,8``): distinct seeds, in the order given, each
    within ``train --seed``'s bound (+-2^48: the export is a ``train`` run), ASCII digits,
    at most :data:`MAX_MODELS` of them."""
    out: list[int] = []
    seen: set[int] = set()
    for part in (p.strip() for p in str(text).split(",")):
        m = re.fullmatch(r"(-?[0-9]{1,20})(?:-(-?[0-9]{1,20}))?", part)
        if not m:
            raise QsyncInputError(f"--seeds: {part!r} is not a seed or a range A-B (e.g. 0-7)"
                                  " in ASCII digits")
        lo = int(m[1])
        hi = int(m[2]) if m[2] is not None else lo
        bad = next((v for v in (lo, hi) if abs(v) > MAX_ABS_SEED), None)
        if bad is not None:
            raise QsyncInputError(f"--seeds: expected seeds from {-MAX_ABS_SEED} to "
                                  f"{MAX_ABS_SEED}, got {bad}")
        if hi < lo or hi - lo >= MAX_MODELS or len(out) + hi - lo >= MAX_MODELS:
            raise QsyncInputError(f"--seeds: range {part!r} must go up, at most {MAX_MODELS} "
                                  "seeds in all")
        for s in range(lo, hi + 1):
            if s in seen:
                raise QsyncInputError(f"--seeds: seed {s} is given twice")
            seen.add(s)
            out.append(s)
    return out


def parse_values(text: str, flag: str, *, positive: bool) -> list[float]:
    """Comma-separated numbers, each finite (ASCII digits) and > 0 (``positive``) or >= 0;
    at most :data:`MAX_MODELS`."""
    vals: list[float] = []
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) > MAX_MODELS:
        raise QsyncInputError(f"{flag}: {len(parts)} values, more than {MAX_MODELS}")
    for part in parts:
        v = parse_float(part)  # ASCII digits, finite
        if v is None or (v <= 0 if positive else v < 0):
            raise QsyncInputError(f"{flag}: expected {'positive' if positive else 'non-negative'}"
                                  f" finite numbers, got {part!r}")
        vals.append(v)
    return vals


@dataclass(frozen=True)
class SweepRequest:
    """One sweep, its flags checked (:func:`run_sweep`): the models' seeds, learning rates
    and weight decays (every combination one model, seeds first) and how they train."""

    model: str
    seeds: list[int]
    lrs: list[float]
    wds: list[float]
    steps: int
    batch: int | None = None
    optimizer: str = "sgd"
    momentum: float | None = None  # SGD's: 0.9 when not given
    lr_schedule: str = "constant"
    inputs: str = "per_model"
    fuse: str = "measure"
    plan: str | None = None
    group: str | None = None
    eval_batches: int = 4
    device: str = "cpu"
    out: str | None = None
    export: bool = False


def check_request(req: SweepRequest) -> None:
    """Every setting of ``req`` checked before anything is built or trained (a seed beyond
    ``train``'s bound or ``--out`` a file were refused only after the training): how many
    models the seeds and values make, ``--export`` with ``--out``, the momentum with its
    optimizer, and the schedule at every learning rate. The output paths are checked by
    :func:`check_out` (``--out``, in :func:`run_sweep`) and the CLI (``--json``)."""
    n = len(req.seeds) * len(req.lrs) * len(req.wds)
    if n > MAX_MODELS:
        raise QsyncInputError(f"--seeds, --lr, --wd: {len(req.seeds)} x {len(req.lrs)} x "
                              f"{len(req.wds)} = {n} models, more than {MAX_MODELS}")
    if req.export and not req.out:
        raise QsyncInputError("--export: needs --out (the runs go into OUT/model{b})")
    if req.momentum is not None and req.optimizer != "sgd":
        raise QsyncInputError(f"--momentum: only with --optimizer sgd ({req.optimizer} has "
                              "its own moment estimates)")
    for lr in sorted(set(req.lrs)):
        try:
            parse_schedule(req.lr_schedule, lr, req.steps)
        except QsyncInputError as exc:
            raise QsyncInputError(f"--lr-schedule: {str(exc).partition(': ')[2]}") from None
