"""Run folders as a training run leaves them, written row by row with the runtime's own
writers (:class:`~qsync_opt.runtime.events.EventLog`, :func:`~qsync_opt.runtime.metrics.step_row`
and :class:`~qsync_opt.runtime.metrics.MetricsWriter`, which drops a rank's rows of the steps
a resumed world trains again), for the tests of ``report --run``. The events are laid out as
an elastic run writes them: a ``world`` at each start (resumed from its first step, with the
re-solve's seconds), the ``membership`` change after it (with why the world before ended).

:func:`leave_and_return` is the story the tests assert figure by figure:

- steps 0..22: world of 3 (rank 0 ``v100``, ranks 1 and 2 ``t4``), predicted 100 ms a step
  (v100 90, t4 95); checkpoints at 10 and 20; at step 23 the t4 card is taken back
  without warning (a crash): the steps 20..22 are lost;
- steps 20..39: world of 1 (``v100``) resumed from step 20, predicted 80 ms (v100 80);
  checkpoint 30; a slowdown injected at step 30 (v100 stretched 1.0 -> 1.5), re-planned at
  step 35 (predicted 120 ms, v100 118); checkpoint 40;
- steps 40..49: the t4s return (graceful: 0 steps lost), world of 3 with other rank numbers
  (ranks 0 and 1 ``t4``, rank 2 ``v100``), predicted 100 ms; checkpoint 50 and the stop.

Compute and sync times (ms) per step ``s`` are chosen so that every step of a world takes
the same wall time on every rank and the medians are not the first value seen (see
:data:`LEAVE_AND_RETURN_FIGURES`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from qsync_opt.runtime.events import EventLog
from qsync_opt.runtime.metrics import MetricsWriter, step_row

#: (phase's steps, group) -> (predicted, median compute, median step) ms of the story.
LEAVE_AND_RETURN_FIGURES = {
    ("0..19", "v100"): (90.0, 89.0, 100.0), ("0..19", "t4"): (95.0, 97.0, 100.0),
    ("20..34", "v100"): (80.0, 81.0, 81.0), ("35..39", "v100"): (118.0, 119.0, 119.0),
    ("40..49", "t4"): (95.0, 95.0, 100.0), ("40..49", "v100"): (90.0, 91.0, 100.0),
}

#: ms of one step: (compute, sync) of step s
Times = Callable[[int], tuple[float, float]]


def write_rows(out: Path, rank: int, group: str, steps: Iterable[int], times: Times,
               start: int = 0) -> None:
    """Rank ``rank``'s rows of ``steps`` appended as a world that started at ``start`` would
    write them (its rows of steps from ``start`` on dropped first)."""
    writer = MetricsWriter(out / f"metrics.rank{rank}.jsonl", start)
    try:
        for s in steps:
            compute, sync = times(s)
            writer.write(step_row(step=s, rank=rank, group=group, loss=2.0 - s / 100,
                                  compute_s=compute / 1000, sync_s=sync / 1000, nbytes=4096,
                                  skipped=False, loss_scale=1.0))
    finally:
        writer.close()


def world(log: EventLog, step: int, groups: list[str], size: int, step_ms: float,
          group_ms: dict[str, float], solve_s: float = 0.0,
          changes: list[str] | None = None) -> None:
    """A world's event as an elastic run writes it (resumed from its first step; the
    re-solve's seconds, 0 for the launch plan)."""
    log.write("world", step, groups=groups, world_size=size, plan=f"plan.{step}.json",
              predicted_step_ms=step_ms, predicted_group_ms=group_ms, resumed_from=step,
              solve_s=solve_s, plan_changes=changes or ["the launch plan"])


def leave_and_return(out: Path) -> Path:
    """The story of the module docstring, written into ``out``; returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    with EventLog(out) as log:
        _first_world(out, log)
        _alone(out, log)
        _return(out, log)
    return out


def _first_world(out: Path, log: EventLog) -> None:
    world(log, 0, ["v100", "t4"], 3, 100.0, {"v100": 90.0, "t4": 95.0})
    write_rows(out, 0, "v100", range(23), lambda s: (88 + s % 3, 12 - s % 3))
    write_rows(out, 1, "t4", range(23), lambda s: (96, 4))
    write_rows(out, 2, "t4", range(23), lambda s: (98 + s % 2, 2 - s % 2))
    for step in (10, 20):
        log.write("checkpoint", step, path=f"ckpt/step-{step:08d}")


def _alone(out: Path, log: EventLog) -> None:
    world(log, 20, ["v100"], 1, 80.0, {"v100": 80.0}, solve_s=0.0042,
          changes=["groups gone: t4; planned over v100", "global batch 256 kept"])
    log.write("membership", 20, old_groups=["v100", "t4"], new_groups=["v100"],
              old_predicted_ms=100.0, new_predicted_ms=80.0, change_to_first_step_s=4.25,
              lost_steps=3, reasons=["a peer died: its collective failed"])
    write_rows(out, 0, "v100", range(20, 30), lambda s: (81, 0), start=20)
    log.write("checkpoint", 30, path="ckpt/step-00000030")
    log.write("slowdown", 30, group="v100", old_factor=1.0, new_factor=1.5)
    write_rows(out, 0, "v100", range(30, 35), lambda s: (120, 0), start=30)
    log.write("replan", 35, groups=["v100"], factors={"v100": 1.5}, old_predicted_ms=80.0,
              new_predicted_ms=120.0, solve_s=0.0123,
              reason="v100 1.50x slower than predicted for 5 steps",
              predicted_group_ms={"v100": 118.0}, changes=["v100: 12 ops fp32 -> fp16"])
    write_rows(out, 0, "v100", range(35, 40), lambda s: (119, 0), start=35)
    log.write("checkpoint", 40, path="ckpt/step-00000040")


def _return(out: Path, log: EventLog) -> None:
    world(log, 40, ["t4", "v100"], 3, 100.0, {"v100": 90.0, "t4": 95.0})
    log.write("membership", 40, old_groups=["v100"], new_groups=["v100", "t4"],
              old_predicted_ms=120.0, new_predicted_ms=100.0, change_to_first_step_s=2.5,
              lost_steps=0, reasons=["return of t4"])
    write_rows(out, 0, "t4", range(40, 50), lambda s: (94 + 2 * (s % 2), 6 - 2 * (s % 2)),
               start=40)
    write_rows(out, 1, "t4", range(40, 50), lambda s: (95, 5), start=40)
    write_rows(out, 2, "v100", range(40, 50), lambda s: (91, 9), start=40)
    log.write("checkpoint", 50, path="ckpt/step-00000050")
    log.write("stop", 50, reason="done", checkpoint="ckpt/step-00000050")
