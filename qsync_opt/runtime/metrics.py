"""What a run reports: a JSON line per step per rank, its progress and the summary.

``out_dir/metrics.rank{r}.jsonl`` holds one row per step of rank r (:func:`step_row`: step,
rank, group, loss, step_ms, compute_ms, sync_ms, bytes_allreduced, skipped, loss_scale;
accuracy for classification; ``state_sha256`` when asked). ``summary.json`` (and
``summary.rank{r}.json``) hold the final result, written atomically as strict JSON
(:func:`write_json`, non-finite numbers as null: :func:`clean`); its ``communication`` is
:func:`sync_totals` of the first rank's rows. Progress (:class:`StepProgress`): a bar on a
terminal, else a line every ``progress_every_s`` seconds.
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

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.progress import ProgressLog
from qsync_opt.documents.outfolder import append_text, read_bytes, write_text

__all__ = ["MetricsWriter", "StepProgress", "clean", "progress", "ranks_text",
           "run_warnings", "state_hash", "step_row", "sync_line", "sync_totals",
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
        # following a link there (qsync_opt.documents.outfolder)
        self.path = path
        old = read_bytes(path.parent, path.name)
        if old is not None:
            keep = []
            for line in old.decode("utf-8", errors="replace").splitlines():
                try:
                    row = json.loads(line)
                    if isinstance(row, dict) and row.get("step", 0) < start_step:
                        keep.append(line)
                except (ValueError, TypeError, RecursionError):  # ValueError: an int of
                    continue  # over 4,300 digits too, not only bad JSON
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


class StepProgress:
    """A training run's progress on stderr, from the process that reports it (rank 0): the
    bar on a terminal (``tty``), else a plain line every ``every_s`` seconds
    (:class:`qsync_opt.core.progress.ProgressLog`; 0: none), so a run under nohup or a batch
    scheduler shows it is alive. Other ranks pass ``report=False``."""

    def __init__(self, total: int, every_s: float, *, start: int = 0, report: bool = True,
                 tty: bool | None = None) -> None:
        self.total = total
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.report = report
        self.log = ProgressLog("train", total, every_s if report and not self.tty else 0.0,
                               start=start)

    def update(self, step: int, loss: float) -> None:
        if not self.report:
            return
        if self.tty:
            progress(step, self.total, loss, True)
        else:
            self.log.update(step, loss)


def sync_totals(path: Path) -> dict[str, Any] | None:
    """A run's communication from one rank's metrics rows (every step of the run, resumes
    included: the rows of the steps before a resume are kept): ``rounds`` (the steps after
    which the replicas synced), ``bytes_sent`` (what this rank handed its collectives),
    ``comm_ms`` (the wall time inside them) and ``steps``. None without such rows."""
    rounds = steps = nbytes = 0
    ms = 0.0
    try:
        data = read_bytes(path.parent, path.name)  # never through a link in the run's folder
        text = data.decode("utf-8", errors="replace") if data is not None else ""
    except (OSError, QsyncInputError):
        return None
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # bad JSON, or an int of over 4,300 digits
            continue
        if not isinstance(row, dict) or "bytes_sent" not in row:
            continue
        steps += 1
        rounds += bool(row.get("synced"))
        nbytes += int(row.get("bytes_sent") or 0)
        ms += float(row.get("comm_ms") or 0.0)
    if not steps:
        return None
    return {"rounds": rounds, "steps": steps, "bytes_sent": nbytes, "comm_ms": round(ms, 3)}


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
    write_text(path.parent, path.name, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def ranks_text(rank_groups: list[str], doc: dict[str, Any]) -> str:
    """The summary line's ranks: their groups and the data-parallel batches, or, for a
    pipeline (one batch through every stage), the global batch and its micro-batches."""
    groups = ", ".join(rank_groups)
    if doc.get("mode") != "pipeline":
        return f"{groups}; batches {doc.get('batches')}"
    sizes = doc.get("micro_batch_sizes") or []
    each = (f" of {sizes[0]}" if sizes and len(set(sizes)) == 1
            else f" of {', '.join(map(str, sizes))}" if sizes else "")
    m = doc.get("micro_batches")
    return (f"{groups} as {doc.get('world_size')} pipeline stages; global batch "
            f"{doc.get('global_batch')} in {m} micro-batch{'es' if m != 1 else ''}{each}")


def sync_line(doc: dict[str, Any]) -> str | None:
    """The data-parallel run's communication (summary.json's ``communication``): its sync
    rounds, the bytes one rank handed its collectives and the time inside them (and the
    emulated link's description when there was one). None for a single rank or a summary
    without it."""
    comm = doc.get("communication")
    if not isinstance(comm, dict) or (doc.get("world_size") or 0) < 2:
        return None
    try:
        rounds, steps = int(comm["rounds"]), int(comm["steps"])
        mb, ms = float(comm["bytes_sent"]) / 1e6, float(comm["comm_ms"])
    except (KeyError, TypeError, ValueError):
        return None
    how = doc.get("sync") or "ddp"
    if doc.get("comm") not in (None, "allreduce"):
        how += f", {doc.get('comm')}"
    link = doc.get("link")  # the emulated link, when the run had one
    return (f"  sync {how}: {rounds} round(s) in {steps} step(s), {mb:.2f} MB sent per rank, "
            f"{ms:.1f} ms in collectives" + (f" (link {link})" if isinstance(link, str) else ""))
