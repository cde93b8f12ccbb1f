"""Online re-planning inside a running world, and injected slowdowns (the step loop's side).

:class:`OnlineControl` is handed to the :class:`~qsync_opt.job.steps.Trainer` and called
at every step boundary:

* :meth:`~OnlineControl.before_step`: the injected slowdowns due at this step
  (``TrainConfig.online.inject_slowdown``) change the group's stretch: the
  :class:`~qsync_opt.runtime.emulate.SlowdownHooks` factor of a multi-process rank (slept),
  the trainer's reported stretch in emulation (``Trainer.stretch``); rank 0 writes a
  ``slowdown`` event and a line.
* :meth:`~OnlineControl.after_step`: every rank's compute time of the step is shared (one
  all-reduce of a world-sized vector, each rank its own slot: the same numbers on every
  rank), a group's time is its slowest rank's, and the straggler detector
  (:mod:`qsync_opt.runtime.straggler`) decides, the same on every rank. On a fire, rank 0
  re-plans (the planner's re-plan, given as a :class:`Replanner`: the training packages
  never import the planner) with the fired groups' factors folded into the run's slowdown,
  and broadcasts the plan; every rank switches before the next step: precisions changed in
  place (:func:`~qsync_opt.ops.layers.switch_precisions`: modules, parameters, optimizer
  state and rounding seeds kept), the batch split moved (``Setup.batches``/``offsets``, the
  gradient weights), and the detector calibrates again. Rank 0 writes a ``replan`` event and
  a line. Rank 0 solves alone, so a solve's time limit or a tie cannot make ranks disagree.

A re-plan that finds no plan (the planner refuses) keeps the running plan and says why.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.documents.io import parse_document, to_json
from qsync_opt.documents.outfolder import read_bytes, write_text
from qsync_opt.documents.schemas import Plan
from qsync_opt.job.steps import Trainer
from qsync_opt.ops.layers import switch_precisions
from qsync_opt.runtime.config import TrainConfig
from qsync_opt.runtime.emulate import SlowdownHooks
from qsync_opt.runtime.events import EventLog, read_events
from qsync_opt.runtime.straggler import StragglerDetector

__all__ = ["OnlineControl", "Replanned", "Replanner", "ReplannerFactory"]


class Replanned(Protocol):
    """What a re-plan returns (:class:`qsync_opt.planner.replan.Replanned`)."""

    @property
    def plan(self) -> Plan: ...

    @property
    def predicted_step_ms(self) -> float: ...

    @property
    def predicted_group_ms(self) -> dict[str, float]: ...

    @property
    def solve_s(self) -> float: ...

    @property
    def changes(self) -> list[str]: ...


class Replanner(Protocol):
    """The planner's side (:class:`qsync_opt.planner.replan.ReplanCache`)."""

    def predict(self, plan: Plan, slowdown: Mapping[str, float] = ...
                ) -> tuple[float, dict[str, float]]: ...

    def replan(self, groups: Sequence[str], slowdown: Mapping[str, float] | None = ...,
               global_batch: int | None = ..., *, current: Plan | None = ...
               ) -> Replanned: ...


#: Builds the run's replanner on rank 0 (from the config and the plan it starts with).
ReplannerFactory = Callable[[TrainConfig, Plan], Replanner]


def normalised(factors: Mapping[str, float], groups: Sequence[str]) -> dict[str, float]:
    """The run's slowdown factors relative to its least slowed group (whose factor is 1;
    factors of 1 left out): the detector sees relative speeds, so a slowdown that went away
    shows as the other groups slower, and folded in here it gives the factors back."""
    least = min(factors.get(g, 1.0) for g in groups)
    return {g: f / least for g, f in factors.items() if f / least > 1.0 + 1e-12}


def _say(line: str) -> None:
    """A line of the run's log (stdout: the launcher shows it; a ``qsync-opt train:`` line
    would be taken for a rank's failure)."""
    sys.stdout.write(f"online: {line}\n")
    sys.stdout.flush()


class OnlineControl:
    """The online side of one process's trainer (module docstring). ``hooks``: each local
    replica's slowdown hooks (None where it has none: emulation, or no stretch ever)."""

    def __init__(self, trainer: Trainer, hooks: Sequence[SlowdownHooks | None],
                 factory: ReplannerFactory | None) -> None:
        self.tr = trainer
        self.cfg = trainer.cfg
        if self.cfg.online is None:
            raise QsyncInputError("online: the run's config has no online settings")
        self.spec = self.cfg.online
        self.hooks = list(hooks)
        self._seen = [0.0] * len(self.hooks)
        self.lead = 0 in trainer.ranks
        self.events = EventLog(self.cfg.out_dir) if self.lead else None
        self.groups = list(dict.fromkeys(self.cfg.rank_groups))
        self.world = self.cfg.world_size
        self.distributed = dist.is_available() and dist.is_initialized() and self.world > 1
        self.factors: dict[str, float] = {}  # the run's slowdowns, as the re-plans know them
        self.replanner: Replanner | None = None
        self.detector: StragglerDetector | None = None
        self.replans = 0
        if self.spec.replan == "auto":
            self._start_detector(factory)

    # ------------------------------------------------------------------ start

    def _start_detector(self, factory: ReplannerFactory | None) -> None:
        predicted: dict[str, float] | None = None
        error = None
        if self.lead:
            if factory is None:
                error = "--replan auto: this entry point has no planner (run qsync-opt train)"
            else:
                try:
                    self.replanner = factory(self.cfg, self.tr.s.plan)
                    _, predicted = self.replanner.predict(self.tr.s.plan, {})
                except QsyncInputError as exc:
                    error = f"--replan auto: {exc}"
        got = self._broadcast({"error": error, "predicted": predicted})
        if got["error"]:
            raise QsyncInputError(got["error"])
        self.detector = StragglerDetector(self.spec.rule(), got["predicted"])

    def _broadcast(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Rank 0's ``obj`` on every rank (as itself in one process)."""
        if not self.distributed:
            return obj
        # JSON bytes in a tensor (never a pickle): the length first, then the bytes
        dev = self.tr.device
        data = json.dumps(obj).encode("utf-8") if self.lead else b""
        n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
        dist.broadcast(n, src=0)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev) if self.lead
               else torch.zeros(int(n.item()), dtype=torch.uint8, device=dev))
        dist.broadcast(buf, src=0)
        got = json.loads(buf.cpu().numpy().tobytes().decode("utf-8"))
        assert isinstance(got, dict)
        return got

    # ------------------------------------------------------------------ a resume

    def resume(self, start: int) -> None:
        """A run resumed at step ``start``: the injected stretches due before it, and the
        plan the newest re-plan at or before it switched to (its recorded file), run again
        from ``start`` on; the detector calibrates afresh."""
        if start <= 0:
            return
        for g in self.groups:
            f = self.spec.stretch_at(g, start - 1, self.cfg.slowdown.get(g, 1.0))
            self.tr.stretch[g] = f
            for r, h in zip(self.tr.ranks, self.hooks, strict=True):
                if h is not None and self.cfg.rank_groups[r] == g:
                    h.factor = f
        done = [e for e in read_events(self.cfg.out_dir) if e["kind"] == "replan"
                and e["step"] <= start and isinstance(e.get("plan"), str)]
        if not done or self.detector is None:
            return
        data = read_bytes(self.cfg.out_dir, done[-1]["plan"], what="--out")
        if data is None:
            raise QsyncInputError(f"--replan auto: {done[-1]['plan']}, the plan of the re-plan "
                                  f"at step {done[-1]['step']}, is missing from the run's folder")
        plan = parse_document(json.loads(data), Plan, done[-1]["plan"])
        slow = done[-1].get("slowdown")
        self.factors = {str(g): float(f) for g, f in slow.items()} if isinstance(
            slow, dict) else {}
        self.switch(plan)
        predicted = None
        if self.lead and self.replanner is not None:
            predicted = self.replanner.predict(plan, self.factors)[1]
        self.detector.replanned(self._broadcast({"predicted": predicted})["predicted"])
        self.replans = len(done)
        if self.lead:
            _say(f"step {start}: resumed on {done[-1]['plan']} (the re-plan at step "
                 f"{done[-1]['step']})")

    # ------------------------------------------------------------------ injected slowdowns

    def before_step(self, step: int) -> None:
        """Apply the injected slowdowns that start at ``step``."""
        for inj in self.spec.inject_slowdown:
            if inj.step != step:
                continue
            g, new = inj.group, float(inj.factor)
            old = self.tr.stretch.get(g, 1.0)
            self.tr.stretch[g] = new
            for r, h in zip(self.tr.ranks, self.hooks, strict=True):
                if h is not None and self.cfg.rank_groups[r] == g:
                    h.factor = new
            if self.events is not None:
                self.events.write("slowdown", step, group=g, old_factor=old, new_factor=new)
                _say(f"step {step}: injected slowdown: group {g} stretched x{new:g} "
                     f"(was x{old:g})")

    # ------------------------------------------------------------------ detection

    def own_compute_ms(self) -> dict[int, float]:
        """Each local rank's compute of the last step: its slowdown hooks' count of its own
        forward and backward (stretch included, the wait for the gradient all-reduce
        excluded: under DDP every rank's backward ends when the slowest rank's does, so the
        metrics row's ``compute_ms`` cannot tell the straggler); without hooks (emulation)
        the metrics row's, which there is the replica's own."""
        out = dict(self.tr.last_compute_ms)
        for i, (r, h) in enumerate(zip(self.tr.ranks, self.hooks, strict=True)):
            if h is not None:
                total = h.measured_s + h.slept_s
                out[r] = (total - self._seen[i]) * 1e3
                self._seen[i] = total
        return out

    def measured(self) -> dict[str, float]:
        """This step's compute ms per group, its slowest rank's, the same on every rank."""
        vec = torch.zeros(self.world, dtype=torch.float64)
        for r, ms in self.own_compute_ms().items():
            vec[r] = ms
        if self.distributed:
            vec = self.tr.sync.sum_stats(vec)
        out: dict[str, float] = {}
        for r, g in enumerate(self.cfg.rank_groups):
            out[g] = max(out.get(g, 0.0), float(vec[r]))
        return out

    def after_step(self, step: int) -> None:
        """After ``step`` ran: share the measurements, detect, re-plan and switch."""
        if self.detector is None:
            return
        fire = self.detector.observe(step, self.measured())
        if fire is None:
            return
        factors = normalised({**self.factors, **{g: self.factors.get(g, 1.0) * f
                                                  for g, f in fire.factors.items()}},
                             self.groups)
        reply = self._broadcast(self._solve(step, fire.factors, factors) if self.lead else {})
        if reply.get("error"):
            self.detector.replanned(self.detector.predicted)  # calibrate again, go on
            return
        self.factors = factors
        self.switch(parse_document(reply["plan"], Plan, "re-plan"))
        self.detector.replanned(reply["predicted_group_ms"])
        self.replans += 1

    def _solve(self, step: int, fired: Mapping[str, float], factors: dict[str, float]
               ) -> dict[str, Any]:
        """Rank 0: the re-plan, its event and line; the reply every rank gets."""
        assert self.replanner is not None and self.events is not None
        plan = self.tr.s.plan
        old_ms, _ = self.replanner.predict(plan, factors)
        what = ", ".join(f"{g} x{f:.3f}" for g, f in sorted(fired.items()))
        reason = (f"slower than predicted for {self.spec.replan_window} consecutive steps "
                  f"(over {self.spec.replan_threshold:.0%}): {what}")
        try:
            res = self.replanner.replan(self.groups, factors, current=plan)
            got = sum(res.plan.groups[g].batch_per_device for g in self.cfg.rank_groups)
            if got != self.tr.s.global_batch:
                raise QsyncInputError(f"global_batch: the re-plan's is {got}, the run's "
                                      f"{self.tr.s.global_batch}")
        except QsyncInputError as exc:
            _say(f"step {step + 1}: no re-plan ({exc}); the running plan goes on")
            return {"error": str(exc)}
        name = f"plan.replan{self.replans + 1}.json"  # the run's record of the plan it ran
        write_text(self.cfg.out_dir, name, to_json(res.plan), what="--out")
        self.events.write(
            "replan", step + 1, groups=sorted(fired), factors=dict(fired), plan=name,
            old_predicted_ms=old_ms, new_predicted_ms=res.predicted_step_ms,
            predicted_group_ms=res.predicted_group_ms,
            solve_s=res.solve_s, reason=reason, slowdown=factors, changes=res.changes,
            batches={g: p.batch_per_device for g, p in res.plan.groups.items()})
        _say(f"step {step + 1}: re-planned in {res.solve_s:.3f} s ({reason}): predicted "
             f"{old_ms:.1f} -> {res.predicted_step_ms:.1f} ms per step"
             + "".join(f"; {c}" for c in res.changes))
        return {"error": None, "plan": json.loads(to_json(res.plan, indent=None)),
                "predicted_group_ms": res.predicted_group_ms}

    # ------------------------------------------------------------------ the switch

    def switch(self, plan: Plan) -> None:
        """Run ``plan`` from the next step on: precisions changed in place, the batch split
        moved (the global batch is the plan's, which a re-plan keeps)."""
        s = self.tr.s
        batches = [plan.groups[g].batch_per_device for g in self.cfg.rank_groups]
        if sum(batches) != s.global_batch:
            raise QsyncInputError(f"re-plan: global batch {sum(batches)}, the run's is "
                                  f"{s.global_batch}")
        for r, m in zip(self.tr.ranks, self.tr.models, strict=True):
            switch_precisions(m, plan.groups[self.cfg.rank_groups[r]].precisions)
        s.plan = plan
        s.batches = batches
        s.offsets = [sum(batches[:r]) for r in range(len(batches))]
        self.tr.sync.attach([batches[r] / s.global_batch for r in self.tr.ranks], self.tr.opts)

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
