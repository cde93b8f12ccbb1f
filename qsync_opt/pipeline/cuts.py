"""Where a model is cut into pipeline stages (:mod:`qsync_opt.pipeline.stages` builds them).

:func:`split_stages` traces the model with ``torch.fx`` (the tracers' leaf rule:
:func:`qsync_opt.ops.kinds.is_leaf_module`) and cuts it where asked: a cut is a name of
the traced graph's module scopes (an op name such as ``conv2`` or ``fc1``, or a block such
as ``transformer.h.2``); the stage it starts begins at the first op inside that scope. With
``n_stages`` and no cuts, the cuts are balanced from per-op costs (the traced graph's
forward + backward FLOPs by default), balance first: over every point where the module
scope changes, the least largest stage cost (an exact linear-partition dynamic program);
then, among the splits whose largest stage is within :data:`BALANCE_SLACK` (10%) of that,
the one whose boundaries send the fewest bytes (from the shapes at the example inputs; the
number of tensors crossing without them), then the most even one (least sum of squared
stage costs). A point where an integer tensor or a Python value would cross is never cut.

:func:`stage_costs` sums per-op costs per stage; :func:`op_costs_from_table` and
:func:`plan_op_costs` read them from a cost table (one device, or a group at its plan).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch.fx as fx
from torch import Tensor, nn
from torch.fx.passes.shape_prop import ShapeProp

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.graph import trace
from qsync_opt.ops.kinds import is_leaf_module

__all__ = ["BALANCE_SLACK", "StageSplit", "op_costs_from_table", "plan_op_costs",
           "split_stages", "stage_costs", "trace_model"]


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return is_leaf_module(m)


def trace_model(model: nn.Module) -> fx.GraphModule:
    graph = _Tracer().trace(model)
    return fx.GraphModule(model, graph)


def _scope(node: fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.keys())[-1]) if stack else ""


def _in_scope(scope: str, name: str) -> bool:
    return scope == name or scope.startswith(name + ".")


@dataclass
class StageSplit:
    """Where the cuts fall: each compute node's stage, and the cut names."""

    gm: fx.GraphModule
    stage_of: dict[str, int]
    cuts: list[str]
    n_stages: int
    costs: list[float] = field(default_factory=list)  # per stage, the balancing's costs


def _compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]


def _crossing(nodes: list[fx.Node], i: int) -> int:
    """Values produced before position i (or inputs) and used at or after it."""
    pos = {n: k for k, n in enumerate(nodes)}
    live = set()
    for n in nodes[i:]:
        for a in n.all_input_nodes:
            if a.op == "get_attr":
                continue
            if a.op == "placeholder" or pos.get(a, len(nodes)) < i:
                live.add(a)
    return len(live)


def _default_costs(model: nn.Module, example: Any) -> dict[str, float]:
    """Forward + backward FLOPs of the module ops of the traced graph (functions cost 0)."""
    g = trace(model, example_inputs=example, include_loss=False)
    return {op.name: float(op.fwd_flops + op.bwd_flops) for op in g.ops}


def op_costs_from_table(table: Any, device: str, precision: str = "fp32", *,
                        part: str = "both") -> dict[str, float]:
    """Per-op forward + backward ms (``part="fwd"`` or ``"bwd"``: one of them) of one
    device at one precision, from a :class:`~qsync_opt.documents.schemas.CostTable`
    (``qsync_opt.estimate`` or a profile): the costs :func:`split_stages` balances instead
    of FLOPs, and :func:`stage_costs` sums per stage."""
    if part not in ("both", "fwd", "bwd"):
        raise QsyncInputError(f"part: expected both, fwd or bwd, got {part!r}")
    out: dict[str, float] = {}
    for e in table.entries:
        if e.device == device and e.precision.value == precision:
            ms = {"both": e.fwd_ms + e.bwd_ms, "fwd": e.fwd_ms, "bwd": e.bwd_ms}[part]
            out[e.op] = out.get(e.op, 0.0) + ms
    if not out:
        raise QsyncInputError(f"costs: the table has no {precision} entries for device "
                              f"{device!r}")
    return out


def plan_op_costs(table: Any, plan: Any, group: str, *, part: str = "both"
                  ) -> dict[str, float]:
    """Per-op ms of ``plan``'s group ``group`` on its device, each op at the precision the
    plan gives it there (fp32 where the plan or the table has none): a stage's costs in a
    pipeline whose stages run different plans on different cards."""
    if part not in ("both", "fwd", "bwd"):
        raise QsyncInputError(f"part: expected both, fwd or bwd, got {part!r}")
    spec = next((g for g in plan.cluster.groups if g.name == group), None)
    if spec is None:
        raise QsyncInputError(f"group: the plan has no group {group!r}")
    precisions = {op: getattr(p, "value", str(p))
                  for op, p in plan.groups[group].precisions.items()}
    mine = [e for e in table.entries if e.device == spec.device]
    sizes = sorted({e.batch_size for e in mine})
    at = spec.batch_per_device if spec.batch_per_device in sizes else (sizes or [0])[0]
    by: dict[tuple[str, str], float] = {}
    for e in mine:
        if e.batch_size == at:  # one batch's entries (the group's, else the smallest)
            ms = {"both": e.fwd_ms + e.bwd_ms, "fwd": e.fwd_ms, "bwd": e.bwd_ms}[part]
            key = (e.op, e.precision.value)
            by[key] = by.get(key, 0.0) + ms
    if not by:
        raise QsyncInputError(f"costs: the table has no entries for device {spec.device!r}")
    out: dict[str, float] = {}
    for op in {op for op, _ in by}:
        want = precisions.get(op, "fp32")
        out[op] = by.get((op, want), by.get((op, "fp32"), 0.0))
    return out


def _node_costs(nodes: list[fx.Node], costs: dict[str, float]) -> list[float]:
    """Each node's cost: a module op by its qualified name; a function op by the traced
    graph's name for it (its scope, its function's name, numbered per scope), else charged
    to the first node of its innermost enclosing module scope; ops of no module of the model
    (the loss) are not charged."""
    w = [0.0] * len(nodes)
    seen: dict[tuple[str, str], int] = {}
    first_in: dict[str, int] = {}
    left = dict(costs)
    for i, n in enumerate(nodes):
        scope = _scope(n)
        first_in.setdefault(scope, i)
        if n.op == "call_module":
            w[i] += left.pop(scope, 0.0)
            continue
        base = getattr(n.target, "__name__", str(n.target))
        k = seen.get((scope, base), 0)
        seen[(scope, base)] = k + 1
        name = (f"{scope}.{base}" if scope else base) + (f"_{k}" if k else "")
        w[i] += left.pop(name, 0.0)
    for name, c in left.items():
        scope = name.rpartition(".")[0]
        while scope and scope not in first_in:
            scope = scope.rpartition(".")[0]
        if scope:  # an op of no module of the model (the tracer's spliced loss) is not charged
            w[first_in[scope]] += c
    return w


#: Balanced cuts: a split whose largest stage is within this fraction of the least largest
#: stage possible counts as balanced; among those the cheapest boundaries win.
BALANCE_SLACK = 0.10


@dataclass
class _Crossings:
    """Per position ``i`` of the compute nodes: the bytes of the values produced before
    ``i`` and used at or after it (what a cut there sends forward, and its gradient back),
    and the first such value that is not a floating-point tensor (an integer tensor or a
    Python value: no boundary can carry it) or None."""

    nbytes: list[float]
    blocker: list[str | None]


def _crossings(gm: fx.GraphModule, nodes: list[fx.Node], example: Any) -> _Crossings | None:
    """The traced graph's shapes on meta tensors at ``example``; None without an example or
    where the shapes cannot be found (an op with no meta kernel). Linear in the graph: each
    value is live from after its producer to its last use."""
    if example is None:
        return None
    try:
        meta = copy.deepcopy(gm).to("meta")
        args = [t.to("meta") if isinstance(t, Tensor) else t
                for t in (example if isinstance(example, (tuple, list)) else (example,))]
        ShapeProp(meta).propagate(*args)
    except Exception:  # an op without a meta kernel: fall back to counting tensors
        return None
    sizes: dict[str, int] = {}
    floating: dict[str, bool] = {}
    for n in meta.graph.nodes:
        tm = n.meta.get("tensor_meta")
        ok = hasattr(tm, "shape") and hasattr(tm, "dtype")
        sizes[n.name] = math.prod(tm.shape) * tm.dtype.itemsize if ok else 0
        floating[n.name] = ok and tm.dtype.is_floating_point
    pos = {n: k for k, n in enumerate(nodes)}
    last: dict[fx.Node, int] = {}
    for k, n in enumerate(nodes):
        for a in n.all_input_nodes:
            if a in pos:  # placeholders and get_attr are every stage's: they never cross
                last[a] = k
    delta = [0.0] * (len(nodes) + 1)
    blocked: list[tuple[int, int, str]] = []  # (first, last position) a non-float is live
    for a, end in last.items():
        if end > pos[a]:
            delta[pos[a] + 1] += sizes.get(a.name, 0)
            delta[end + 1] -= sizes.get(a.name, 0)
            if not floating.get(a.name, False):
                blocked.append((pos[a] + 1, end, a.name))
    out = _Crossings([], [None] * len(nodes))
    run = 0.0
    for i in range(len(nodes)):
        run += delta[i]
        out.nbytes.append(run)
    for lo, hi, name in sorted(blocked, reverse=True):  # the earliest producer wins
        for i in range(lo, hi + 1):
            out.blocker[i] = name
    return out


def _partition(pts: list[int], n_stages: int, prefixes: list[list[float]],
               boundary: dict[int, float], cap: float | None) -> tuple[float, list[int]]:
    """Cut ``nodes`` at ``n_stages - 1`` of ``pts`` (an exact dynamic program, vectorised
    over the previous cut). Without ``cap``: the least largest stage cost. With it: every
    stage at most ``cap``, and the least (boundary cost, sum of squared stage costs),
    lexicographically."""
    m = len(pts)
    where = np.asarray(pts)
    bnd = np.array([boundary[p] if k else 0.0 for k, p in enumerate(pts[:-1])] + [0.0])
    first = np.full(m, np.inf)
    second = np.full(m, np.inf)
    first[0] = second[0] = 0.0
    backs = []
    for s in range(1, n_stages + 1):
        pre = np.asarray(prefixes[s - 1])[where]
        nfirst, nsecond = np.full(m, np.inf), np.full(m, np.inf)
        back = np.full(m, -1)
        for j in ([m - 1] if s == n_stages else range(s, m)):
            c = pre[j] - pre[:j]
            if cap is None:
                p1, p2 = np.maximum(first[:j], c), np.zeros(j)
            else:
                p1 = np.where(c <= cap, first[:j] + bnd[:j], np.inf)
                p2 = second[:j] + c * c
            if s > 1:
                p1[:s - 1] = np.inf  # the stages before need a point each
            least = p1.min()
            if not np.isfinite(least):
                continue
            k = int(np.argmin(np.where(p1 <= least + 1e-12, p2, np.inf)))
            nfirst[j], nsecond[j], back[j] = p1[k], p2[k], k
        first, second = nfirst, nsecond
        backs.append(back)
    j, cut_pos = m - 1, []
    for s in range(n_stages, 0, -1):
        i = int(backs[s - 1][j])
        if i > 0:
            cut_pos.append(pts[i])
        j = i
    return float(first[m - 1]), sorted(cut_pos)


def _balanced_cuts(nodes: list[fx.Node], n_stages: int,
                   costs: dict[str, float] | Sequence[dict[str, float]],
                   crossing: _Crossings | None = None) -> tuple[list[int], list[float]]:
    """Balance first: the least largest stage cost over every point where the scope
    changes; then, among the splits within :data:`BALANCE_SLACK` of it, the cheapest
    boundaries (``crossing``: the bytes a cut at each position sends; else the number of
    tensors crossing), then the most even stages. A point where a value that is not a
    floating-point tensor crosses is never a candidate."""
    per_stage = [costs] * n_stages if isinstance(costs, dict) else list(costs)
    if len(per_stage) != n_stages:
        raise QsyncInputError(f"stages: {n_stages} stages need as many cost tables, got "
                              f"{len(per_stage)}")
    cand = [i for i in range(1, len(nodes)) if _scope(nodes[i]) != _scope(nodes[i - 1])
            and (crossing is None or crossing.blocker[i] is None)]
    if not cand:
        raise QsyncInputError("stages: the traced model has no point to cut at")
    if len(cand) < n_stages - 1:
        raise QsyncInputError(f"stages: expected at most {len(cand) + 1} for this model, "
                              f"got {n_stages}")
    boundary = {i: (crossing.nbytes[i] if crossing is not None else float(_crossing(nodes, i)))
                for i in cand}
    prefixes = []
    for table in per_stage:
        prefix = [0.0]
        for x in _node_costs(nodes, table):
            prefix.append(prefix[-1] + x)
        prefixes.append(prefix)
    pts = [0, *cand, len(nodes)]
    least, _ = _partition(pts, n_stages, prefixes, boundary, None)
    _, cut_pos = _partition(pts, n_stages, prefixes, boundary,
                            least * (1 + BALANCE_SLACK) + 1e-12)
    bounds = [0, *cut_pos, len(nodes)]
    stage_costs = [prefixes[k][bounds[k + 1]] - prefixes[k][bounds[k]]
                   for k in range(n_stages)]
    return cut_pos, stage_costs


def _resolve(nodes: list[fx.Node], cut: str) -> int | None:
    """A cut's position: the first op in the scope it names, or the fx node it names."""
    hit = next((i for i, n in enumerate(nodes) if _in_scope(_scope(n), cut)), None)
    if hit is None:
        hit = next((i for i, n in enumerate(nodes) if n.name == cut), None)
    return hit


def _cut_name(nodes: list[fx.Node], p: int) -> str:
    """The shortest-reading name that resolves back to position ``p``: the op's scope or a
    parent block whose first op it is, else the fx node's own name."""
    parts = _scope(nodes[p]).split(".")
    for k in range(1, len(parts) + 1):
        name = ".".join(parts[:k])
        if name and _resolve(nodes, name) == p:
            return name
    return nodes[p].name


def split_stages(model: nn.Module, *, cuts: Sequence[str] | None = None,
                 n_stages: int | None = None,
                 costs: dict[str, float] | Sequence[dict[str, float]] | None = None,
                 example_inputs: Any = None) -> StageSplit:
    """Assign the traced model's nodes to stages (module docstring). ``costs``: op name ->
    cost for the balancing (default: traced FLOPs, which need ``example_inputs``), or one
    such table per stage (stages on different devices or precisions:
    :func:`plan_op_costs`), so a slower stage gets less of the model. With
    ``example_inputs`` the boundaries are weighed by the bytes that cross them (shapes on
    meta tensors), and a cut across which an integer tensor or a Python value would cross
    is refused (given) or never chosen (balanced). A stage may hold no parameters (a
    lone activation): it has nothing to step."""
    gm = trace_model(model)
    nodes = _compute_nodes(gm)
    stage_costs: list[float] = []
    if cuts:
        positions = []
        for c in cuts:
            hit = _resolve(nodes, c)
            if hit is None:
                scopes = sorted({_scope(n) for n in nodes if n.op == "call_module"})
                raise QsyncInputError(f"cuts: {c!r} names no op or block of the traced model "
                                      f"(ops: {', '.join(scopes[:6])}, ...)")
            if hit == 0:
                raise QsyncInputError(f"cuts: {c!r} is the model's first op; a cut starts a "
                                      "later stage")
            positions.append(hit)
        if positions != sorted(positions) or len(set(positions)) != len(positions):
            raise QsyncInputError(f"cuts: expected distinct cuts in forward order, got "
                                  f"{', '.join(cuts)}")
        if n_stages is not None and n_stages != len(cuts) + 1:
            raise QsyncInputError(f"stages: {n_stages} stages need {n_stages - 1} cuts, got "
                                  f"{len(cuts)}")
        crossing = _crossings(gm, nodes, example_inputs)
        for k, (c, p) in enumerate(zip(cuts, positions, strict=True)):
            if crossing is not None and crossing.blocker[p] is not None:
                raise QsyncInputError(
                    f"cuts: stage {k + 1} (from {c!r}) would receive "
                    f"{crossing.blocker[p]!r}, which is not a floating-point tensor (no "
                    "boundary carries integers or Python values); cut elsewhere")
        cut_names = list(cuts)
    else:
        if n_stages is None or n_stages < 1:
            raise QsyncInputError(f"stages: expected >= 1, got {n_stages}")
        if n_stages == 1:
            positions = []
        else:
            if costs is None:
                if example_inputs is None:
                    raise QsyncInputError("stages: balancing needs per-op costs or example "
                                          "inputs to trace them")
                costs = _default_costs(model, example_inputs)
            positions, stage_costs = _balanced_cuts(
                nodes, n_stages, costs, _crossings(gm, nodes, example_inputs))
        cut_names = [_cut_name(nodes, p) for p in positions]
    stage_of: dict[str, int] = {}
    for i, n in enumerate(nodes):
        stage_of[n.name] = sum(1 for p in positions if p <= i)
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            stage_of[n.name] = 0
        elif n.op == "get_attr":
            users = [stage_of.get(u.name, 0) for u in n.users]
            stage_of[n.name] = min(users) if users else 0
    return StageSplit(gm, stage_of, cut_names, len(positions) + 1, stage_costs)


def stage_costs(split: StageSplit, costs: dict[str, float]) -> list[float]:
    """Each stage's share of per-op ``costs`` (op name -> cost), ops placed as the split
    placed their nodes (ops outside the model, such as the loss, are left out)."""
    nodes = _compute_nodes(split.gm)
    out = [0.0] * split.n_stages
    for n, w in zip(nodes, _node_costs(nodes, costs), strict=True):
        out[split.stage_of[n.name]] += w
    return out
