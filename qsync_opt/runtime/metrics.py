"""What a run reports: a JSON line per step per rank, the progress bar and the summary.

``out_dir/metrics.rank{r}.jsonl`` holds one row per step of rank r (:func:`step_row`: step,
rank, group, loss, step_ms, compute_ms, sync_ms, bytes_allreduced, skipped, loss_scale;
accuracy for classification; ``state_sha256`` when asked). ``summary.json`` (and
``summary.rank{r}.json``) hold the final result, written atomically as strict JSON
(:func:`write_json`, non-finite numbers as null: :func:`clean`).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["MetricsWriter", "clean", "progress", "run_warnings", "state_hash", "step_row",
           "write_json"]


def state_hash(model: nn.Module) -> str:
    """sha256 over the state_dict (names, dtypes, shapes, bytes), in key order."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        t = v.detach().cpu().contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def step_row(*, step: int, rank: int, group: str, loss: float, compute_s: float,
             sync_s: float, nbytes: int, skipped: bool, loss_scale: float,
             lr: float | None = None, sync_round: int | None = None,
             synced: bool | None = None, comm_ms: float | None = None,
             bytes_sent: int | None = None, accuracy: float | None = None,
             state_sha256: str | None = None, extra: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    """One metrics row: times in ms (3 decimals), ``step_ms`` = compute + sync; the
    step's ``lr``, its ``sync_round``, whether the replicas ``synced`` after it, the wall time
    inside collectives (``comm_ms``) and the payload handed to them (``bytes_sent``) when
    given; ``accuracy`` and ``state_sha256`` only when given; ``extra``: a sync mode's own fields."""
    row: dict[str, Any] = {
        "step": step, "rank": rank, "group": group, "loss": loss,
        "step_ms": round((compute_s + sync_s) * 1000, 3),
        "compute_ms": round(compute_s * 1000, 3), "sync_ms": round(sync_s * 1000, 3),
        "bytes_allreduced": nbytes, "skipped": skipped, "loss_scale": loss_scale}
    for key, val in (("lr", lr), ("sync_round", sync_round), ("synced", synced),
                     ("comm_ms", comm_ms), ("bytes_sent", bytes_sent)):
        if val is not None:
            row[key] = val
    if accuracy is not None:
        row["accuracy"] = accuracy
    if state_sha256 is not None:
        row["state_sha256"] = state_sha256
    row.update(extra or {})  # a sync mode's own fields (dlcp: dropped_frac, dropped_by_layer)
    return row


class MetricsWriter:
    """Append-only JSON lines; on resume, lines of steps not covered by the checkpoint go."""

    def __init__(self, path: Path, start_step: int) -> None:
        # in the run's folder (path.parent): read, rewritten and appended to without ever
        # following a link there (qsync_opt.outfolder)
        from ..outfolder import append_text, read_bytes, write_text

        self.path = path
        old = read_bytes(path.parent, path.name)
        if old is not None:
            keep = []
            for line in old.decode("utf-8", errors="replace").splitlines():
                try:
                    row = json.loads(line)
                    if isinstance(row, dict) and row.get("step", 0) < start_step:
                        keep.append(line)
                except (json.JSONDecodeError, TypeError, RecursionError):
                    continue
            write_text(path.parent, path.name, "".join(k + "\n" for k in keep))  # a kill keeps them
        self.fh = append_text(path.parent, path.name)

    def write(self, row: dict[str, Any]) -> None:
        self.fh.write(json.dumps(row) + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


def progress(step: int, total: int, loss: float, enabled: bool) -> None:
    """A one-line progress bar on stderr (nothing when not ``enabled``)."""
    if not enabled:
        return
    width = 30
    done = int(width * step / total)
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total} loss {loss:.4f}")
    if step == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


#: A later loss above this many times the first step's (and at least 1 nat above it), or
#: not finite, is an exploded run (:func:`run_warnings`).
EXPLODED_FACTOR = 10.0


def run_warnings(steps: int, skipped: int, first_loss: float | None, final_loss: float,
                 eval_loss: float | None) -> list[str]:
    """What the summary warns of, loudly (its ``warnings``; the CLI's first line): most
    steps skipped (a non-finite loss or gradient: the model barely trained), or the loss
    exploded (the final or held-out loss not finite, or above :data:`EXPLODED_FACTOR` times
    the first step's loss)."""
    out = []
    if steps > 0 and 2 * skipped > steps:
        out.append(f"{skipped} of {steps} steps were skipped (non-finite loss or gradient): "
                   "the model barely trained; lower --lr, or run the overflowing fp16 ops "
                   "at bf16 or fp32")
    if first_loss is not None and math.isfinite(first_loss) and steps > skipped:
        later = [v for v in (final_loss, eval_loss) if v is not None]
        worst = max(later, key=lambda v: v if math.isfinite(v) else math.inf, default=None)
        if worst is not None and (not math.isfinite(worst) or (
                worst > EXPLODED_FACTOR * first_loss and worst > first_loss + 1.0)):
            shown = f"{worst:.4g}" if math.isfinite(worst) else "not finite"
            out.append(f"the loss exploded (first step {first_loss:.4g}, later {shown}): "
                       "lower --lr (the default suits the built-in workloads)")
    return out


def clean(x: Any) -> Any:
    """NaN/inf as None so the summary is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [clean(v) for v in x]
    return x


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as indented, key-sorted JSON, written atomically into the run's folder
    (``path.parent``), never through a link there."""
    from ..outfolder import write_text

    write_text(path.parent, path.name, json.dumps(obj, indent=2, sort_keys=True) + "\n")
