"""Plans: build a Plan document from per-group precisions, and check it against a graph.

Every command that reads a plan goes through :func:`plan_model` (which model the plan may be
traced from, checked before anything is imported), :func:`graph_for_plan` (the graph it was
made for) and :func:`check_plan` (the plan against that graph). A plan is data: it never
makes qsync-opt import a file. A plan whose ``workload`` is a user's ``PATH.py:FUNCTION``
is used only with the file the user passes (``--model``), whose sha256 must be the plan's
``workload_sha256``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from qsync_opt.core.errors import QsyncInputError, TraceError
from qsync_opt.core.modelspec import is_user_model, model_file_sha256
from qsync_opt.core.precision import Precision
from qsync_opt.costs.devices import get_device
from qsync_opt.costs.rules import allowed_on, check_plan_entry, check_tie
from qsync_opt.documents.schemas import (
    MAX_BATCH,
    ClusterSpec,
    GroupPlan,
    JSONScalar,
    ModelGraph,
    OpRole,
    Plan,
)
from qsync_opt.graph import TIE_MODES, trace
from qsync_opt.strategy.checks import check_strategy

if TYPE_CHECKING:  # annotations only: the model registry imports torch
    from qsync_opt.models.workload import Workload

#: Most samples per device a plan may give a group (beyond it no card's memory holds a
#: step): the schemas' one limit.
MAX_BATCH_PER_DEVICE = MAX_BATCH


def make_plan(
    graph: ModelGraph,
    cluster: ClusterSpec,
    precisions: Mapping[str, Mapping[str, Precision | str]],
    provenance: Mapping[str, JSONScalar] | None = None,
) -> Plan:
    """A Plan covering every choosable op of ``graph`` on every group of ``cluster``.

    Ops a group's mapping leaves out are written as fp32, so the file says everything.
    The provenance records the graph's batch and tie mode (``graph_batch``,
    ``graph_tie_mode``) unless ``provenance`` gives them.
    """
    cluster = cluster.with_default_batch(graph.batch_size)
    groups: dict[str, GroupPlan] = {}
    for g in cluster.groups:
        given = precisions.get(g.name, {})
        row: dict[str, Precision] = {}
        for op in graph.ops:
            if op.role == OpRole.choosable:
                try:
                    row[op.name] = Precision(given.get(op.name, Precision.fp32))
                except ValueError:
                    raise QsyncInputError(
                        f"plan: group {g.name}, op {op.name}: unknown precision "
                        f"{given.get(op.name)!r}") from None
        groups[g.name] = GroupPlan(batch_per_device=int(g.batch_per_device or graph.batch_size),
                                   precisions=row)
    prov = {"graph_batch": graph.batch_size, "graph_tie_mode": graph.tie_mode,
            **dict(provenance or {})}
    return Plan(workload=graph.workload, workload_sha256=graph.workload_sha256,
                graph_hash=graph.structure_hash(), cluster=cluster, groups=groups,
                provenance=prov)


def _shown(text: str) -> str:
    """A name from a file, for a one-line message: repr when it holds control characters."""
    return text if text.isprintable() else repr(text)


def plan_graph_difference(plan: Plan, graph: ModelGraph) -> str:
    """One line saying why ``plan`` does not belong to ``graph``: the ops that differ."""
    choosable = [o.name for o in graph.ops if o.role == OpRole.choosable]
    planned: list[str] = []
    for gp in plan.groups.values():
        planned = list(gp.precisions)
        break
    extra = [n for n in planned if n not in set(choosable)]
    missing = [n for n in choosable if n not in set(planned)]

    def few(names: list[str]) -> str:
        names = [_shown(n) for n in names]
        return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")

    parts = [f"plan: made for graph {_shown(plan.graph_hash)} ({_shown(plan.workload)}), not "
             f"{graph.structure_hash()} ({_shown(graph.workload)})"]
    if extra:
        parts.append(f"ops the graph lacks: {few(extra)}")
    if missing:
        parts.append(f"choosable ops the plan lacks: {few(missing)}")
    batch = plan.provenance.get("graph_batch")
    if (not extra and not missing and isinstance(batch, int) and not isinstance(batch, bool)
            and batch != graph.batch_size):
        parts.append(f"the batch differs (plan batch {batch}, graph batch {graph.batch_size}): "
                     f"trace the graph at batch {batch}")
    elif not extra and not missing:
        parts.append("same op names, different shapes, kinds or edges")
    return "; ".join(parts)


def check_plan(plan: Plan, graph: ModelGraph) -> None:
    """Refuse, in one line naming what is wrong, a plan that does not belong to ``graph``.

    The one check of every command that reads a plan (report, replay, train and its
    ``--dry-run``, and a Python caller's ``check_plan(Plan.load(path), graph)``): the graph's structure hash; every planned
    op exists in the graph and every choosable op is planned; a pinned op keeps its pin and a pass-through op is not set; a
    choosable op gets a precision the op allows and the group's card runs; ops of one tie
    group get one precision; each group's batch is at most :data:`MAX_BATCH_PER_DEVICE`;
    a version-2 plan's strategy is one the runtime runs on the plan's cluster
    (:func:`qsync_opt.strategy.checks.check_strategy`).
    """
    if plan.graph_hash != graph.structure_hash():
        raise QsyncInputError(plan_graph_difference(plan, graph))
    ops = {o.name: o for o in graph.ops}
    devices = {g.name: g.device for g in plan.cluster.groups}
    for gname, gp in plan.groups.items():
        where = f"plan: group {_shown(gname)}"
        if gp.batch_per_device > MAX_BATCH_PER_DEVICE:
            raise QsyncInputError(
                f"{where}: batch_per_device {gp.batch_per_device} is over the limit of "
                f"{MAX_BATCH_PER_DEVICE} samples per device")
        device = devices.get(gname, "")
        try:
            menu = set(get_device(device).precisions)
        except (KeyError, ValueError) as exc:
            raise QsyncInputError(f"{where}: device {_shown(device)}: "
                                  f"{exc.args[0] if exc.args else exc}") from None
        missing = [o.name for o in graph.choosable_ops() if o.name not in gp.precisions]
        if missing:
            raise QsyncInputError(
                f"{where} sets no precision for op {_shown(missing[0])}"
                + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                + " (a plan sets every choosable op of the graph)")
        ties: dict[str, tuple[str, Precision]] = {}
        for name, p in gp.precisions.items():
            op = ops.get(name)
            if op is None:
                raise QsyncInputError(f"{where} names op {_shown(name)}, which graph "
                                      f"{_shown(graph.workload)} lacks")
            p = Precision(p)
            if check_plan_entry(op, p, allowed_on(op, menu), where, _shown(name), device):
                continue
            if op.tie_group:
                check_tie(ties, op.tie_group, name, p, where, _shown)
    if plan.strategy is not None:
        check_strategy(plan.strategy, plan.cluster)


def _builtin(spec: str) -> Workload:
    """The built-in workload ``spec`` names (KeyError or ValueError when none)."""
    from qsync_opt.models import get_workload  # lazy: the model registry imports torch

    return get_workload(spec)


def _registry_name(spec: str) -> str | None:
    """The registry's own name of workload ``spec``; None when it names none."""
    try:
        return _builtin(spec).name
    except (KeyError, ValueError):
        return None


def plan_model(plan: Plan, model: str | None, flag: str = "--model") -> str | None:
    """Check, before anything is imported, that ``model`` (what the user passed as ``flag``;
    None: not given) may be traced for ``plan``, and return the sha256 its file must have
    (None for a registry workload). Refused in one line:

    - the plan names a user's Python file and no file is given: a plan never runs code;
    - the plan and ``model`` name different workloads (a registry name against a file,
      or two registry names);
    - the plan names a file but carries no ``workload_sha256``, or the given file's content
      has another hash (the file is read, not run).
    """
    wl = repr(plan.workload)
    if is_user_model(plan.workload):
        if model is None:
            raise QsyncInputError(
                f"plan: workload {wl} is a Python file, and a plan never makes qsync-opt run "
                f"code: pass that file yourself as {flag} PATH.py:FUNCTION (it is run, and its "
                f"sha256 must be the plan's workload_sha256)")
        if not is_user_model(model):
            raise QsyncInputError(
                f"{flag} {_shown(model)}: the plan was made for the model file {wl}, not a "
                f"built-in workload")
        if plan.workload_sha256 is None:
            raise QsyncInputError(
                f"plan: workload {wl} is a Python file but the plan has no workload_sha256 to "
                f"check {flag} {_shown(model)} against; make the plan again with this qsync-opt")
        digest = model_file_sha256(model)
        if digest != plan.workload_sha256:
            raise QsyncInputError(
                f"{flag} {_shown(model)}: not the file the plan was made from (sha256 "
                f"{digest[:16]}..., the plan's workload_sha256 {plan.workload_sha256[:16]}...); "
                f"nothing was run")
        return digest
    if model is None:
        return None
    if is_user_model(model):
        raise QsyncInputError(
            f"{flag} {_shown(model)}: the plan was made for the built-in workload {wl}, not a "
            f"model file")
    mine, theirs = _registry_name(model), _registry_name(plan.workload)
    if mine is None or mine != theirs:
        raise QsyncInputError(f"{flag} {_shown(model)}: the plan was made for model {wl}, not "
                              f"{model!r}")
    return None


def graph_for_plan(plan: Plan, model: str | None = None, flag: str = "--model", *,
                   workload: Any = None) -> ModelGraph:
    """The graph ``plan`` was made for, traced and checked (:func:`check_plan`).

    A registry workload is traced by its name in the registry; a user's file only as
    ``model`` (see :func:`plan_model`), after its hash is checked. The trace is at the
    plan's ``provenance.graph_batch`` and ``graph_tie_mode`` (plans that lack them: the
    workload's default batch, no ties); a plan made with the classifier head unpinned is
    recognised by a second trace. A registry workload's traces come from the graph cache
    (:mod:`qsync_opt.graph.cache`) once made. ``workload``: ``model``'s file already loaded (a
    :class:`~qsync_opt.models.user.UserWorkload` whose sha256 is the plan's), traced instead
    of importing the file again.
    """
    prov = plan.provenance
    batch = prov.get("graph_batch")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1
                              or batch > MAX_BATCH_PER_DEVICE):
        raise QsyncInputError(
            f"plan: provenance.graph_batch: expected an integer from 1 to "
            f"{MAX_BATCH_PER_DEVICE}, got {batch!r}")
    tie = prov.get("graph_tie_mode") or "none"
    if not isinstance(tie, str) or tie not in TIE_MODES:
        raise QsyncInputError(f"plan: provenance.graph_tie_mode: expected one of "
                              f"{', '.join(TIE_MODES)}, got {tie!r}")
    sha = plan_model(plan, model, flag)
    try:
        if sha is not None:
            assert model is not None
            if workload is None or getattr(workload, "sha256", None) != sha:
                # lazy: loading the file imports torch (only a plan made from a file needs it)
                from qsync_opt.models.resolve import load_user_workload

                workload = load_user_workload(model, sha256=sha)
            wl_ = workload
            graph = trace(wl_, batch, tie=tie)
            retrace = lambda pin, how: trace(wl_, batch, tie=tie, pin_head=pin,  # noqa: E731
                                             method=how, warn=False)
        else:
            try:
                wl = _builtin(plan.workload)
            except (KeyError, ValueError) as exc:
                raise QsyncInputError(f"model: {exc.args[0] if exc.args else exc}") from None
            graph = trace(wl, batch, tie=tie, name=plan.workload, cache=True)
            retrace = lambda pin, how: trace(wl, batch, tie=tie, pin_head=pin,  # noqa: E731
                                             name=plan.workload, method=how, warn=False,
                                             cache=True)
        if graph.structure_hash() != plan.graph_hash:
            # a plan made with --unpin-head, or with --tracer fx (a model whose default
            # trace goes through what fx keeps opaque): the graph it was made on
            for pin, how in ((False, "auto"), (True, "fx"), (False, "fx")):
                try:
                    other = retrace(pin, how)
                except TraceError:
                    continue
                if other.structure_hash() == plan.graph_hash:
                    graph = other
                    break
            else:
                raise QsyncInputError(plan_graph_difference(plan, graph))
    except QsyncInputError as exc:
        msg = str(exc)
        if sha is not None or msg.startswith(("plan:", flag)):
            raise  # about the user's own --model file, or already says it is the plan
        raise type(exc)(f"plan: workload {plan.workload!r}: {msg}") from None
    check_plan(plan, graph)
    return graph
