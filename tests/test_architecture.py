"""The package's layers, asserted from its source (issue 17, "Acyclic layers, enforced").

Every module is parsed with :mod:`ast`; every import (module level and inside functions,
absolute and relative, ``from . import x`` resolving to the module ``x`` or to a name of the
package) becomes an edge of the import graph. The tests assert:

* each module imports only modules of its own layer or of lower ones (``LAYERS``, every
  module placed explicitly; a new module fails until it is placed);
* ``runtime/`` never imports ``solvers/``;
* ``schemas`` imports nothing of the package but ``precision``, ``errors``, ``files`` and
  ``device_names``;
* no module imports another module's private (underscore) name or a private module, nor
  reads one as ``module._name``, except ``PRIVATE_ALLOWED`` (exact: an entry that no longer
  occurs fails, so the list only shrinks);
* the graph has no cycles except ``CYCLES_ALLOWED`` (exact, each with its reason).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> the package it is installed as (pyproject's package-dir)
SOURCE_DIRS = {"qsync_opt": "qsync_opt", "solvers": "qsync_opt.solvers",
               "models": "qsync_opt.models", "cuda": "qsync_opt.cuda"}

#: Lowest layer first. A module may import modules of its own layer or of a lower one.
#: Names are relative to ``qsync_opt`` ("" is the package itself).
LAYERS: list[tuple[str, list[str]]] = [
    ("foundation", ["precision", "errors", "units", "machine", "device_names", "progress",
                    "limits", "files"]),
    ("schemas", ["schemas"]),
    ("io", ["io", "outfolder"]),
    # torch modules and kernels that know nothing of plans: the workloads, the C++ ops
    ("workloads and kernels", [
        "user_model", "models", "models.workload", "models.samples", "models.resolve",
        "models.layers", "models.bert", "models.digits_cnn",
        "models.digits_resnet", "models.gpt2", "models.resnet",
        "models.tiny_gpt", "models.vgg", "models.vit", "cuda", "cuda.build", "cuda.kernels", "ops", "ops._build",
        "ops.reference", "ops.rounding", "ops.backends", "ops.quantize", "ops.intmm",
        "ops.int8", "ops.int4", "ops.fakequant", "attention"]),
    ("graph, devices, costs", [
        "graph", "graph.annotate", "graph.capture", "graph.fallback", "graph.kinds",
        "graph.naming", "graph.recording", "graph.tracing", "graph.cache",
        "devices", "rules", "costs", "cluster", "batchmodel", "profile.tables",
        "profile.timing", "profile.gloo",
        # the sync rules (QSR's rule, learning-rate schedules): pure, read by the replayer
        "runtime.schedule", "runtime.syncmode", "runtime.dlcp", "runtime.compress",
        # the packet simulator's core: pure Python, imports nothing of the package
        "netsim", "netsim.topology", "netsim.rack", "netsim.engine", "netsim.traffic", "netsim.ns3leafspine",
         "netsim.ns3ref"]),
    ("precision layers", ["runtime.gemm", "runtime.dispatch", "runtime.layers",
                          "profile.builders"]),
    ("indicator, replayer", ["indicator", "indicator.errormodel", "indicator.terms",
                              "indicator.curv", "indicator.memory", "indicator.tables",
                              "indicator.compute", "indicator_calls", "replayer", "replayer.sync", "replayer.timeline",
                             "replayer.prepared", "replayer.loop", "replayer.incremental",
                             "replayer.pipeline",
                             "plan", "synthetic", "profile_context", "profile",
                             "profile.orchestrate", "summaries", "",
                             "netsim.cluster"]),
    ("runtime", ["runtime", "runtime.apply", "runtime.config", "runtime.emulate",
                 "runtime.memory", "runtime.watchdog", "runtime.launch", "runtime.faults",
                 "runtime.scaler", "runtime.sync", "runtime.data", "runtime.metrics",
                 "runtime.checkpoint", "runtime.prepare", "runtime.trainer", "runtime.train",
                 "runtime.commhooks", "runtime.pipecuts", "runtime.pipeline",
                 "runtime.pipedist", "runtime.pipetrain", "runtime.pipepredict",
                 "runtime.pipescale", "runtime.gather",
                 "runtime.rankfail"]),
    # fused training arrays: the fused operators over the precision layers, the array's
    # trainer over the runtime's data and schedules
    ("hfta", ["hfta", "hfta.ops", "hfta.optim", "hfta.convert", "hfta.functional",
              "hfta.choice", "hfta.trainer", "hfta.sweep"]),
    ("problem", ["problem", "evaluator"]),
    ("solvers", ["solvers", "solvers.base", "solvers.timing", "solvers.checks",
                 "solvers.report", "solvers.parts", "solvers.memo", "solvers.driver",
                 "solvers.formulation", "splits", "solvers.pulp_model", "solvers.fastest",
                 "solvers.warmstart", "solvers.baselines", "solvers.integers", "solvers.cpsat",
                 "solvers.acceptance", "solvers.greedy", "solvers.ilp", "solvers.additive",
                 "solvers.relaxation",
                 "diagnose"]),
    ("solve", ["solve", "dominance"]),
    ("frontier, report", ["frontier", "report", "demo"]),
    ("cli", ["cli", "cli.__main__", "cli.args", "cli.demo", "cli.info", "cli.model",
             "cli.planning", "cli.netsim", "cli.profile", "cli.report", "cli.sweep", "cli.train"]),
]

#: Cross-module private imports kept, exactly: (importer, imported, name) -> the step that
#: removes it. ``name`` None: the private module itself.
PRIVATE_ALLOWED: dict[tuple[str, str, str | None], str] = {
    ("ops.backends", "ops._build", None): "the ops' backend module re-exports its build "
                                          "module's load_cpu (everyone else imports it from "
                                          "qsync_opt.ops)",
}

#: Import cycles kept, exactly: frozenset of the cycle's modules -> why.
CYCLES_ALLOWED: dict[frozenset[str], str] = {}


def _short(module: str) -> str:
    return "" if module == "qsync_opt" else module.removeprefix("qsync_opt.")


def _modules() -> dict[str, Path]:
    """Every module of the package, by its installed name relative to ``qsync_opt``."""
    out: dict[str, Path] = {}
    for folder, package in SOURCE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[_short(".".join([package, *parts]))] = path
    return out


MODULES = _modules()


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _full(short: str) -> str:
    return "qsync_opt" + ("." + short if short else "")


def _resolve(dotted: str) -> str | None:
    """The deepest module of the package that ``dotted`` (absolute) names, or None."""
    if not (dotted == "qsync_opt" or dotted.startswith("qsync_opt.")):
        return None
    while dotted:
        if _short(dotted) in MODULES:
            return _short(dotted)
        dotted = dotted.rpartition(".")[0]
    return None


def _edges(module: str, path: Path) -> list[tuple[str, str | None, int]]:
    """The module's imports of the package: (imported, private name read, line); the name
    is set where the module takes an underscore name from the imported one (``from m import
    _x``, or ``m._x`` on a module bound by an import)."""
    tree = ast.parse(path.read_text(), str(path))
    package = _full(module) if path.name == "__init__.py" else _full(module).rpartition(".")[0]
    found: list[tuple[str, str | None, int]] = []
    bound: dict[str, str] = {}  # local name -> module it is bound to by an import
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name)
                if target is None:
                    continue
                found.append((target, None, node.lineno))
                if alias.asname:
                    bound[alias.asname] = _short(alias.name) if _short(alias.name) in MODULES \
                        else target
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = base + ("." + node.module if node.module else "")
            else:
                source = node.module or ""
            target = _resolve(source)
            if target is None:
                continue
            for alias in node.names:
                sub = _short(source + "." + alias.name)
                if sub in MODULES and (source + "." + alias.name).startswith("qsync_opt"):
                    found.append((sub, None, node.lineno))
                    bound[alias.asname or alias.name] = sub
                else:
                    found.append((target, alias.name if _is_private(alias.name) else None,
                                  node.lineno))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and _is_private(node.attr)):
            found.append((bound[node.value.id], node.attr, node.lineno))
    return [(t, n, line) for t, n, line in found if t != module]


GRAPH: dict[str, list[tuple[str, str | None, int]]] = {
    m: _edges(m, p) for m, p in MODULES.items()}
LAYER_OF = {m: i for i, (_, ms) in enumerate(LAYERS) for m in ms}


def _where(module: str) -> str:
    return f"{MODULES[module].relative_to(ROOT)}"


def test_every_module_is_placed_once() -> None:
    placed = [m for _, ms in LAYERS for m in ms]
    twice = sorted({m for m in placed if placed.count(m) > 1})
    assert not twice, f"placed in two layers: {twice}"
    missing = sorted(set(MODULES) - set(placed))
    assert not missing, (
        f"modules not in the layer table: {[_where(m) for m in missing]}; add each to "
        "LAYERS in tests/test_architecture.py, in the lowest layer holding everything it imports")
    gone = sorted(set(placed) - set(MODULES))
    assert not gone, f"LAYERS names modules that do not exist: {gone}"


#: What building a command-line parser calls (argparse's API).
_PARSER_CALLS = {"ArgumentParser", "add_subparsers", "add_parser", "add_argument",
                 "add_argument_group", "add_mutually_exclusive_group"}


#: Modules outside ``cli/`` that build a parser, exactly: module -> why.
PARSERS_ALLOWED: dict[str, str] = {
    "cuda.build": "the build tool `python -m qsync_opt.cuda.build` (nvcc), not a qsync-opt "
                  "command: the wheel's CUDA build step, run where no CLI is installed yet",
}


def test_only_the_cli_builds_parsers() -> None:
    """Every command's parser is registered by its module in ``cli/``; the library (every
    other module) builds none, so each command's flags live in one place."""
    found, allowed = [], set()
    for name, path in MODULES.items():
        if name == "cli" or name.startswith("cli."):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if called in _PARSER_CALLS and name in PARSERS_ALLOWED:
                    allowed.add(name)
                elif called in _PARSER_CALLS:
                    found.append(f"{_where(name)}:{node.lineno} calls {called}")
    assert not found, "a parser built outside cli/: " + "; ".join(found)
    assert allowed == set(PARSERS_ALLOWED), "PARSERS_ALLOWED lists modules that build none"


def layer_violations() -> set[tuple[str, str]]:
    return {(m, t) for m, es in GRAPH.items() for t, _, _ in es
            if LAYER_OF.get(t, -1) > LAYER_OF.get(m, len(LAYERS))}


def test_imports_go_down_the_layers() -> None:
    """No exceptions: a document saves and loads itself through ``files`` (below
    ``schemas``), and a caller checks a plan against its graph with ``plan.check_plan``."""
    found = sorted(layer_violations())
    assert not found, "imports into a higher layer: " + "; ".join(
        f"{_where(m)} imports {_full(t)} ({LAYERS[LAYER_OF[m]][0]} -> {LAYERS[LAYER_OF[t]][0]})"
        for m, t in found)


def test_runtime_never_imports_solvers() -> None:
    bad = sorted((m, t) for m, es in GRAPH.items() for t, _, _ in es
                 if (m == "runtime" or m.startswith("runtime."))
                 and (t == "solvers" or t.startswith("solvers.")))
    assert not bad, f"runtime imports solvers: {bad}"


def test_schemas_imports_only_the_foundation() -> None:
    allowed = {"precision", "errors", "files", "device_names"}
    got = {t for t, _, _ in GRAPH["schemas"]}
    assert got <= allowed, f"schemas imports {sorted(got - allowed)}"


def private_imports() -> set[tuple[str, str, str | None]]:
    out: set[tuple[str, str, str | None]] = set()
    for m, es in GRAPH.items():
        for t, name, _ in es:
            if name is not None:
                out.add((m, t, name))
            elif any(_is_private(part) for part in t.split(".")):
                out.add((m, t, None))
    return out


def test_no_cross_module_private_imports() -> None:
    found = private_imports()
    new = sorted(found - set(PRIVATE_ALLOWED), key=str)
    assert not new, "private names imported across modules: " + "; ".join(
        f"{_where(m)} takes {_full(t)}" + (f".{n}" if n else " (a private module)")
        for m, t, n in new)
    stale = sorted(set(PRIVATE_ALLOWED) - found, key=str)
    assert not stale, f"PRIVATE_ALLOWED lists imports that no longer occur (remove): {stale}"


def cycles() -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    succ: dict[str, set[str]] = defaultdict(set)
    for m, es in GRAPH.items():
        succ[m] |= {t for t, _, _ in es}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: set[frozenset[str]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.add(frozenset(comp))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    found = cycles()
    new = [sorted(c) for c in found - set(CYCLES_ALLOWED)]
    assert not new, f"import cycles (function-level imports included): {sorted(new)}"
    stale = [sorted(c) for c in set(CYCLES_ALLOWED) - found]
    assert not stale, f"CYCLES_ALLOWED lists cycles that no longer occur (remove): {stale}"


@pytest.mark.parametrize("source, expected", [
    ("from . import errors\n", [("errors", None)]),
    ("from .ops import _build\n", [("ops._build", None)]),
    ("from .solvers import _private\n", [("solvers", "_private")]),
    ("from .solvers.ilp import _add_group, PulpIlp\n",
     [("solvers.ilp", "_add_group"), ("solvers.ilp", None)]),
    ("def f():\n    from .io import load\n", [("io", None)]),
    ("import qsync_opt.solvers.ilp as ilp\nilp._pulp()\n",
     [("solvers.ilp", None), ("solvers.ilp", "_pulp")]),
    ("from .solvers import ilp\nx = ilp._Program\n",
     [("solvers.ilp", None), ("solvers.ilp", "_Program")]),
    ("from . import __version__\nimport torch\n", [("", None)]),
])
def test_the_parser_sees_every_kind_of_import(tmp_path: Path, source: str,
                                              expected: list[tuple[str, str | None]]) -> None:
    path = tmp_path / "mod.py"
    path.write_text(source)
    got = [(t, n) for t, n, _ in _edges("frontier", path)]
    assert sorted(got, key=str) == sorted(expected, key=str)


def test_the_dependency_free_names_are_the_catalogs() -> None:
    """``device_names`` lists the catalog's names without importing it; ``devices`` refuses
    at import a catalog that differs, and both resolve every alias alike."""
    from qsync_opt import device_names, devices

    assert device_names.CATALOG_NAMES == tuple(devices.CATALOG)
    assert devices.canonical_name is device_names.canonical_name
    for alias, name in device_names.ALIASES.items():
        assert devices.get_device(alias).name == name


@pytest.mark.parametrize("header", [
    {"schema_name": "Plan"}, {"schema_name": None}, {"schema_version": 2},
    {"schema_version": True}, {"schema_version": 1.0}, {"schema_version": None},
    {"schema_version": "1"}])
def test_the_header_is_checked_once_for_files_and_objects(header: dict) -> None:
    """A bad header reads the same through io (a file's JSON) and through the schema's own
    validator (an object): one check, ``schemas.header_problem``."""
    from pydantic import ValidationError

    from qsync_opt.errors import SchemaVersionError
    from qsync_opt.io import parse_document
    from qsync_opt.schemas import ClusterSpec, header_problem

    problem = header_problem(header, ClusterSpec)
    assert problem is not None
    with pytest.raises(SchemaVersionError) as from_file:
        parse_document(dict(header), ClusterSpec, where="c.json")
    assert str(from_file.value) == f"c.json: {problem}"
    with pytest.raises(ValidationError, match="schema_") as from_object:
        ClusterSpec.model_validate(dict(header))
    assert problem in str(from_object.value)
