"""A run's story (:mod:`qsync_opt.runtime.story`) told: the lines ``qsync-opt report --run``
prints (:func:`story_lines`), the same as one JSON-able object (:func:`story_summary`) and
the figure (:func:`story_figure`: measured step time per group over the steps, the predicted
step time as steps, a mark at each membership change, re-plan and slowdown, a tick at each
checkpoint), written atomically, never through a link.

Every name the run's files hold (groups, reasons, paths) is printed with its control
characters escaped (:func:`~qsync_opt.core.errors.one_line`) and cut at
:data:`SHOWN_CHARS`."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qsync_opt.core.errors import OutputError, QsyncInputError, one_line
from qsync_opt.core.figures import new_figure, png_bytes
from qsync_opt.documents.outfolder import write_bytes
from qsync_opt.runtime.events import FIELDS
from qsync_opt.runtime.story import GroupFigures, Period, RunStory, texts

if TYPE_CHECKING:  # matplotlib is optional: its types only for the checker
    from matplotlib.axes import Axes

__all__ = ["SHOWN_CHARS", "check_figure_path", "story_figure", "story_lines", "story_summary"]

#: The most characters of a name, reason or path a line shows.
SHOWN_CHARS = 120
#: The most checkpoint steps a line lists (the first and last halves, the count between).
SHOWN_CHECKPOINTS = 12
#: A group's line with at most this many steps marks each step.
MARKED_POINTS = 60
#: The groups' line colours (matplotlib's tab10 less the marks' red, purple, brown, gray).
GROUP_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:olive", "tab:cyan", "tab:pink")


def _s(x: object) -> str:
    text = one_line(str(x))
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def _groups(groups: Iterable[object]) -> str:
    return ", ".join(_s(g) for g in groups) or "none"


# ----------------------------------------------------------------------------- lines


def story_lines(story: RunStory) -> list[str]:
    """What ``qsync-opt report --run`` prints (see the module docstring)."""
    out = [_head(story)]
    out += _period_lines(story.periods)
    out += _change_lines(story)
    out += _slowdown_lines(story.slowdowns)
    out += _figure_lines(story)
    out += [_checkpoint_line(story.checkpoints), _lost_line(story), _stop_line(story)]
    out += _left_out_lines(story)
    return out


def _head(story: RunStory) -> str:
    end = story.end_step
    steps = f"steps 0..{end - 1}" if end else "no step known"
    if story.periods and story.periods[0].first > 0:
        steps = f"steps {story.periods[0].first}..{end - 1 if end else '?'}"
    memberships = sum(1 for c in story.changes if c.kind == "membership")
    replans = len(story.changes) - memberships
    return (f"run {one_line(str(story.run))}: {steps}; {len(story.periods)} period(s), {memberships} "
            f"membership change(s), {replans} re-plan(s); {story.rows} metrics row(s) in "
            f"{story.metrics_files} rank file(s)")


def _period_lines(periods: list[Period]) -> list[str]:
    if not periods:
        return ["periods: none (no world event and no metrics row)"]
    out = ["periods (one membership each)"]
    for p in periods:
        world = f"world {p.world_size}" if p.world_size is not None else "world ?"
        solve = f"; solved in {p.solve_s:.3f} s" if p.solve_s else ""
        out.append(f"  steps {p.steps_text():<13} {p.cause:<10} {world:<9} groups "
                   f"{_groups(p.groups)}; predicted {_ms(p.predicted_step_ms)} ms/step{solve}")
        if p.notes:
            out.append(f"  {'':<19} plan: {'; '.join(_s(n) for n in p.notes)}")
    return out


def _change_lines(story: RunStory) -> list[str]:
    if not story.changes:
        return ["plan changes: none"]
    out = ["plan changes"]
    for c in story.changes:
        e = c.event
        ms = f"predicted {_ms(e['old_predicted_ms'])} -> {_ms(e['new_predicted_ms'])} ms/step"
        if c.kind == "membership":
            s = e["change_to_first_step_s"]
            first = "-" if s is None else f"{s:.2f}"
            old = _groups(e["old_groups"]) if e["old_groups"] is not None else "?"
            out.append(f"  step {c.step:<6} membership {old} -> {_groups(e['new_groups'])}"
                       f"{_reasons(e)}; {ms}; lost {e['lost_steps']} step(s); "
                       f"change to first step {first} s")
        else:
            solve = "-" if e["solve_s"] is None else f"{e['solve_s']:.3f}"
            why = f" ({_s(e['reason'])})" if e["reason"] else ""
            out.append(f"  step {c.step:<6} re-plan    {_factors(e)}{why}; {ms}; "
                       f"solve {solve} s")
            notes = texts(e.get("changes"))
            if notes:
                out.append(f"  {'':<19} plan: {'; '.join(_s(n) for n in notes)}")
    return out


def _reasons(e: dict[str, Any]) -> str:
    """A membership change's ``reasons`` (optional: why each world before it ended)."""
    why = texts(e.get("reasons"))
    return f" ({_s('; '.join(why))})" if why else ""


def _factors(e: dict[str, Any]) -> str:
    f = e["factors"]
    pairs = (list(f.items()) if isinstance(f, dict)
             else list(zip(e["groups"], f, strict=True)))
    shown = [f"{_s(g)} x{v:.2f}" if v is not None else f"{_s(g)} x?" for g, v in pairs]
    return ", ".join(shown) or _groups(e["groups"])


def _slowdown_lines(slowdowns: list[dict[str, Any]]) -> list[str]:
    if not slowdowns:
        return ["slowdowns: none"]
    out = ["slowdowns (injected)"]
    for e in slowdowns:
        old = "-" if e["old_factor"] is None else f"{e['old_factor']:.2f}"
        new = "-" if e["new_factor"] is None else f"{e['new_factor']:.2f}"
        out.append(f"  step {e['step']:<6} {_s(e['group'])}: stretch {old} -> {new}")
    return out


def _figure_lines(story: RunStory) -> list[str]:
    """Per phase the whole step (the slowest rank's median, ``(step)``) and each group."""
    out = ["predicted vs measured, ms (medians; ratio: measured/predicted, the whole step's "
           "slowest rank, a group's compute)",
           f"  {'steps':<15} {'group':<12} {'predicted':>9} {'compute':>9} {'step':>9} "
           f"{'ratio':>6}"]
    for i, p in enumerate(story.phases):
        step_ms = story.phase_step_ms[i]
        out.append(f"  {p.steps_text():<15} {'(step)':<12} {_ms(p.predicted_step_ms):>9} "
                   f"{'-':>9} {_ms(step_ms):>9} {_ratio(step_ms, p.predicted_step_ms):>6}")
        out += [_group_row(f) for f in story.figures if f.phase == i]
    if story.rows == 0:
        out.append("  no metrics row: nothing measured")
    return out


def _group_row(f: GroupFigures) -> str:
    ratio = "-" if f.ratio is None else f"{f.ratio:.2f}"
    return (f"  {'':<15} {_s(f.group):<12} {_ms(f.predicted_ms):>9} {_ms(f.compute_ms):>9} "
            f"{_ms(f.step_ms):>9} {ratio:>6}")


def _checkpoint_line(checkpoints: list[tuple[int, str]]) -> str:
    if not checkpoints:
        return "checkpoints: none"
    steps = [str(s) for s, _ in checkpoints]
    if len(steps) > SHOWN_CHECKPOINTS:
        half = SHOWN_CHECKPOINTS // 2
        steps = [*steps[:half], f"... ({len(checkpoints) - 2 * half} more)", *steps[-half:]]
    return (f"checkpoints: {len(checkpoints)} at step(s) {', '.join(steps)}; newest "
            f"{_s(checkpoints[-1][1])}")


def _lost_line(story: RunStory) -> str:
    lost = [(c.step, c.event["lost_steps"]) for c in story.changes
            if c.kind == "membership" and c.event["lost_steps"]]
    head = f"steps lost: {story.lost_steps}"
    if lost:
        head += " (" + ", ".join(f"{n} at the change of step {s}" for s, n in lost) + ")"
    beyond = story.beyond_checkpoint
    if beyond is None:
        tail = ("no checkpoint recorded: a resume would start again at step 0"
                if story.end_step else "no step known")
    elif beyond == 0:
        tail = f"0 beyond the last checkpoint (step {story.checkpoints[-1][0]})"
    else:
        tail = (f"{beyond} trained past the last checkpoint (step "
                f"{story.checkpoints[-1][0]}): a resume trains them again")
    return f"{head}; {tail}"


def _stop_line(story: RunStory) -> str:
    e = story.stop
    if e is not None:
        ckpt = f"; checkpoint {_s(e['checkpoint'])}" if e["checkpoint"] else "; no checkpoint"
        return f"stopped at step {e['step']}: {_s(e['reason'] or 'no reason given')}{ckpt}"
    if story.summary_steps is not None:
        return f"finished: summary.json says {story.summary_steps} step(s) (no stop event)"
    return "no stop recorded: the run was killed, or is still running"


def _left_out_lines(story: RunStory) -> list[str]:
    out = []
    if story.unanchored and story.checkpoints:
        out.append("worlds started where no checkpoint was recorded: step(s) "
                   + ", ".join(str(s) for s in story.unanchored[:10]))
    if story.missing_steps and story.rows:
        spans = [f"{a}" if a == b else f"{a}..{b}" for a, b in story.missing_steps[:10]]
        more = len(story.missing_steps) - len(spans)
        out.append("steps with no metrics row: " + ", ".join(spans)
                   + (f" and {more} more span(s)" if more else ""))
    parts = []
    if story.skipped_rows:
        parts.append(f"{story.skipped_rows} unreadable metrics line(s)")
    if story.skipped_events:
        parts.append(f"{story.skipped_events} event line(s) unreadable or with a missing or "
                     "bad field")
    if story.stale_rows:
        parts.append(f"{story.stale_rows} metrics row(s) outside their step's world (steps "
                     "trained again, or a rank that left)")
    if parts:
        out.append("left out: " + "; ".join(parts))
    return out


# ----------------------------------------------------------------------------- summary


def _period_doc(p: Period) -> dict[str, Any]:
    return {"first": p.first, "last": p.last, "groups": list(p.groups),
            "world_size": p.world_size, "predicted_step_ms": p.predicted_step_ms,
            "predicted_group_ms": p.predicted_group_ms, "cause": p.cause,
            "solve_s": p.solve_s, "plan_changes": list(p.notes)}


def _event_doc(e: dict[str, Any]) -> dict[str, Any]:
    keep = ("kind", "time", "step", *FIELDS[e["kind"]], "predicted_group_ms")
    # only the fields the reader checked (and a list of strings): the summary stays strict JSON
    doc = {k: e[k] for k in keep if k in e}
    for name in ("reasons", "changes"):
        if texts(e.get(name)):
            doc[name] = texts(e.get(name))
    return doc


def story_summary(story: RunStory) -> dict[str, Any]:
    """The story as one JSON-able object (every number finite: the reader kept no other)."""
    phases = []
    for i, p in enumerate(story.phases):
        doc = _period_doc(p)
        doc["measured_step_ms"] = story.phase_step_ms[i]
        doc["groups_measured"] = [
            {"group": f.group, "predicted_ms": f.predicted_ms, "compute_ms": f.compute_ms,
             "step_ms": f.step_ms, "ratio": f.ratio, "rows": f.rows}
            for f in story.figures if f.phase == i]
        phases.append(doc)
    return {
        "run": str(story.run), "end_step": story.end_step,
        "periods": [_period_doc(p) for p in story.periods], "phases": phases,
        "changes": [_event_doc(c.event) for c in story.changes],
        "slowdowns": [_event_doc(e) for e in story.slowdowns],
        "checkpoints": [{"step": s, "path": p} for s, p in story.checkpoints],
        "lost_steps": story.lost_steps, "beyond_last_checkpoint": story.beyond_checkpoint,
        "stop": _event_doc(story.stop) if story.stop is not None else None,
        "summary_steps": story.summary_steps, "metrics_files": story.metrics_files,
        "rows": story.rows, "skipped_rows": story.skipped_rows,
        "skipped_events": story.skipped_events, "stale_rows": story.stale_rows,
        "missing_steps": [list(x) for x in story.missing_steps],
        "unanchored_worlds": story.unanchored}


# ----------------------------------------------------------------------------- figure


def check_figure_path(path: str | os.PathLike[str], what: str = "--png") -> Path:
    """``path`` as a figure's file: refused when a link is planted there (never written
    through) or a folder is there."""
    p = Path(path)
    if p.is_symlink():
        raise OutputError(one_line(f"{what} {p}: is a symbolic link; the figure is never "
                                   "written through one: remove it, or name another file"))
    if p.is_dir():
        raise OutputError(one_line(f"{what} {p}: is a folder; name a file"))
    return p


def story_figure(story: RunStory, path: str | os.PathLike[str], what: str = "--png") -> Path:
    """Draw the story (see the module docstring) into ``path`` as a PNG: written atomically
    into its folder (made when missing), a link there refused. Returns the path."""
    target = check_figure_path(path, what)
    try:
        fig = new_figure((11.0, 5.0), layout="constrained")
    except ImportError:
        raise QsyncInputError(f"{what}: drawing needs matplotlib, which is not "
                              "installed") from None
    ax = fig.add_subplot(1, 1, 1)
    _draw_series(ax, story)
    _draw_marks(ax, story)
    ax.set_xlabel("step")
    ax.set_ylabel("step time, ms")
    ax.set_ylim(bottom=0)
    ax.set_title(f"run {_s(story.run.name or story.run)}: measured (lines) and predicted "
                 "(steps) step time", loc="left", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    data = png_bytes(fig)
    folder = target.parent if str(target.parent) else Path(".")
    return write_bytes(folder, target.name, data, what)


def _broken(points: list[tuple[int, float]]) -> tuple[list[float], list[float]]:
    """``points`` as x and y lists with a break (NaN) wherever steps are missing, so a
    group's line is not drawn across the steps it was away."""
    xs: list[float] = []
    ys: list[float] = []
    for s, v in points:
        if xs and s > xs[-1] + 1:
            xs.append(float("nan"))
            ys.append(float("nan"))
        xs.append(s)
        ys.append(v)
    return xs, ys


def _draw_series(ax: Axes, story: RunStory) -> None:
    """Each group's median step time per step; the predicted step time of each phase."""
    for i, (group, points) in enumerate(sorted(story.series.items())):
        px, py = _broken(points)
        ax.plot(px, py, linewidth=1.0, color=GROUP_COLORS[i % len(GROUP_COLORS)],
                marker="." if len(points) <= MARKED_POINTS else None,
                label=f"{_s(group)} measured")
    xs: list[float] = []
    ys: list[float] = []
    for p in story.phases:  # one step per phase; a gap where a phase has no prediction
        if p.predicted_step_ms is None:
            xs.append(float("nan"))
            ys.append(float("nan"))
            continue
        end = (p.last if p.last is not None else p.first) + 1
        xs += [p.first, end]
        ys += [p.predicted_step_ms, p.predicted_step_ms]
    if any(y == y for y in ys):  # a number that is not NaN
        ax.plot(xs, ys, color="black", linestyle="--", linewidth=1.2, label="predicted")


def _draw_marks(ax: Axes, story: RunStory) -> None:
    """A line at each membership change, re-plan and slowdown; a tick at each checkpoint."""
    styles = {"membership": ("tab:red", "-"), "replan": ("tab:purple", "--")}
    seen: set[str] = set()
    for c in story.changes:
        color, style = styles[c.kind]
        label = None if c.kind in seen else ("membership change" if c.kind == "membership"
                                             else "re-plan")
        seen.add(c.kind)
        ax.axvline(c.step, color=color, linestyle=style, linewidth=1.0, label=label)
    for i, e in enumerate(story.slowdowns):
        ax.axvline(e["step"], color="tab:brown", linestyle=":", linewidth=1.2,
                   label="slowdown" if i == 0 else None)
    if story.checkpoints:
        ax.plot([s for s, _ in story.checkpoints], [0.0] * len(story.checkpoints),
                linestyle="none", marker="|", markersize=14, color="tab:gray",
                label="checkpoint", clip_on=False)
