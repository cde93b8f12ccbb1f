"""The package's layers, asserted from its source.

Every module is parsed with :mod:`ast`; every import (module level and inside functions,
absolute and relative, ``from . import x`` resolving to the module ``x`` or to a name of the
package) becomes an edge of the import graph. The tests assert:

* every module sits in a package of ``PACKAGES`` (one row per package with its layer; a new
  package fails until it is placed) and docs/ARCHITECTURE.md draws the same table;
* each module imports only modules of its own layer or of lower ones, and no two packages
  import each other;
* the training packages never import the planner or a solver;
* the schema modules (``documents.schemas`` and the modules it names the documents from)
  import nothing of the package but the core's precisions, errors and device names,
  ``documents.files`` and each other;
* no module imports another module's private (underscore) name or a private module, nor
  reads one as ``module._name``, except ``PRIVATE_ALLOWED`` (exact: an entry that no longer
  occurs fails, so the list only shrinks);
* the graph has no cycles except ``CYCLES_ALLOWED`` (exact, each with its reason);
* only ``cli/`` builds an argparse parser.
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

#: One row per package, lowest layer first: (package, layer, what it holds). A module belongs
#: to the package that is its first name under ``qsync_opt`` (``""`` is the package's own
#: ``__init__``, its front); it may import modules of its own layer or of a lower one.
#: docs/ARCHITECTURE.md's table "The tree" says the same (``test_the_docs_draw_this_table``).
PACKAGES: list[tuple[str, int, str]] = [
    ("core", 0, "precisions, errors, units, limits, device names, this host, progress, the version"),
    ("documents", 1, "the pydantic documents, atomic files, io, output folders"),
    ("strategy", 2, "pure rules both sides read: sync modes and the QSR rule, learning-rate "
                    "schedules, DLCP's drop policy, the boundary codecs"),
    ("models", 3, "the workloads: one Workload protocol for built-in models and user files"),
    ("cuda", 3, "the CUDA kernels and their build"),
    ("ops", 3, "the quantized kernels and their references, op kinds and call names, the "
               "precision layers and per-call dispatch, decomposed attention"),
    ("graph", 4, "tracing and annotation to a ModelGraph, the cache of traced graphs"),
    ("costs", 5, "the device catalog, clusters, the roofline estimate, the batch model, the "
                 "CostTable algebra, the cost-and-memory rules"),
    ("profile", 6, "measured cost tables: ops alone and in context, the local gloo harness"),
    ("indicator", 6, "Omega per op and precision, and the GEMM calls it measures"),
    ("replayer", 7, "the step-time event loop: SyncModel, DDP's all-reduce, Local SGD and QSR"),
    ("netsim", 7, "the packet-level simulator of gradient traffic and its ns-3 references"),
    ("problem", 8, "the integer program's data, the evaluator, plans and their check, "
                   "synthetic instances"),
    ("runtime", 9, "the trainer's parts: config, prepare, data, scaler, checkpoints, metrics, "
                   "memory, emulation, faults, the watchdog"),
    ("sync", 10, "how replicas agree: DDP, Local SGD under QSR, the transport hook, DLCP masks"),
    ("pipeline", 10, "cuts, stages with compressed boundaries, one-process and distributed "
                     "runners, the step-time prediction"),
    ("hfta", 10, "horizontally fused training arrays and their sweep"),
    ("job", 11, "a training job: the launcher, each rank's entry point, the step loop"),
    ("solvers", 12, "one driver and the backends that translate the formulation and run "
                    "once; greedy and the baselines"),
    ("planner", 13, "the solve pipeline: modes, refinement, the joint split, diagnosis, "
                    "dominance, the Pareto sweep, plan figures"),
    ("cli", 14, "the commands' parsers (parsers/) and bodies, one module per family; the demo"),
    ("", 15, "the package's front: the names most callers need, re-exported"),
]
LAYER_OF_PACKAGE = {p: layer for p, layer, _ in PACKAGES}


def package_of(module: str) -> str:
    return module.split(".")[0]


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
LAYER_OF = {m: LAYER_OF_PACKAGE[package_of(m)] for m in MODULES
            if package_of(m) in LAYER_OF_PACKAGE}


def _where(module: str) -> str:
    return f"{MODULES[module].relative_to(ROOT)}"


def test_every_module_is_in_a_package_of_the_table() -> None:
    names = [p for p, _, _ in PACKAGES]
    assert len(names) == len(set(names)), "a package listed twice in PACKAGES"
    loose = sorted(_where(m) for m in MODULES if "." not in m and m and not
                   MODULES[m].name == "__init__.py")
    assert not loose, f"modules outside every package (put each into the package of its layer): {loose}"
    missing = sorted({package_of(m) for m in MODULES} - set(names))
    assert not missing, (f"packages not in the table: {missing}; add each to PACKAGES in "
                         "tests/test_architecture.py, in the lowest layer holding everything it "
                         "imports, and to docs/ARCHITECTURE.md's table")
    gone = sorted(set(names) - {package_of(m) for m in MODULES})
    assert not gone, f"PACKAGES names packages that do not exist: {gone}"


def _doc_table() -> list[tuple[str, int]]:
    """The rows ``| layer | `package/` | ... |`` of docs/ARCHITECTURE.md's section "The tree"."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## The tree", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].isdigit():
            name = cells[1].strip("`").removesuffix("/")
            rows.append(("" if name == "qsync_opt" else name, int(cells[0])))
    return rows


def test_the_docs_draw_this_table() -> None:
    """docs/ARCHITECTURE.md's table of packages is this one: same packages, same layers, in
    the same order."""
    assert _doc_table() == [(p, layer) for p, layer, _ in PACKAGES]


def test_packages_form_no_cycle() -> None:
    """Packages of one layer may import each other's modules, but never both ways."""
    edges = {(package_of(m), package_of(t)) for m, es in GRAPH.items() for t, _, _ in es
             if package_of(m) != package_of(t)}
    both = sorted((a, b) for a, b in edges if (b, a) in edges and a < b)
    assert not both, f"packages importing each other: {both}"


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
            if LAYER_OF.get(t, -1) > LAYER_OF.get(m, len(PACKAGES))}


def test_imports_go_down_the_layers() -> None:
    """No exceptions: a document saves and loads itself through ``files`` (below
    ``schemas``), and a caller checks a plan against its graph with ``plan.check_plan``."""
    found = sorted(layer_violations())
    assert not found, "imports into a higher layer: " + "; ".join(
        f"{_where(m)} imports {_full(t)} (layer {LAYER_OF[m]} -> {LAYER_OF[t]})"
        for m, t in found)


#: The packages that train, and the ones that plan: a run never needs a solver.
RUNNING = {"runtime", "sync", "pipeline", "hfta", "job"}
PLANNING = {"solvers", "planner"}


def test_training_never_imports_the_planner() -> None:
    bad = sorted((m, t) for m, es in GRAPH.items() for t, _, _ in es
                 if package_of(m) in RUNNING and package_of(t) in PLANNING)
    assert not bad, f"a training package imports the planner or a solver: {bad}"


#: The modules that define the documents; ``documents.schemas`` names them all.
SCHEMA_MODULES = {"documents.schemas", "documents.base", "documents.hardware",
                  "documents.opgraph", "documents.costing", "documents.solution",
                  "documents.jobstrategy"}


def test_schemas_imports_only_the_foundation() -> None:
    allowed = {"core.precision", "core.errors", "documents.files", "core.device_names"}
    allowed |= SCHEMA_MODULES
    for module in sorted(SCHEMA_MODULES):
        got = {t for t, _, _ in GRAPH[module]}
        assert got <= allowed, f"{module} imports {sorted(got - allowed)}"


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
    ("from ..core import errors\n", [("core.errors", None)]),
    ("from ..ops import _build\n", [("ops._build", None)]),
    ("from ..solvers import _private\n", [("solvers", "_private")]),
    ("from ..solvers.ilp import _add_group, PulpIlp\n",
     [("solvers.ilp", "_add_group"), ("solvers.ilp", None)]),
    ("def f():\n    from ..documents.io import load\n", [("documents.io", None)]),
    ("from . import dominance\n", [("planner.dominance", None)]),
    ("import qsync_opt.solvers.ilp as ilp\nilp._pulp()\n",
     [("solvers.ilp", None), ("solvers.ilp", "_pulp")]),
    ("from qsync_opt.solvers import ilp\nx = ilp._Program\n",
     [("solvers.ilp", None), ("solvers.ilp", "_Program")]),
    ("from .. import __version__\nimport torch\n", [("", None)]),
])
def test_the_parser_sees_every_kind_of_import(tmp_path: Path, source: str,
                                              expected: list[tuple[str, str | None]]) -> None:
    path = tmp_path / "mod.py"
    path.write_text(source)
    got = [(t, n) for t, n, _ in _edges("planner.frontier", path)]
    assert sorted(got, key=str) == sorted(expected, key=str)


def test_the_dependency_free_names_are_the_catalogs() -> None:
    """``device_names`` lists the catalog's names without importing it; ``devices`` refuses
    at import a catalog that differs, and both resolve every alias alike."""
    from qsync_opt.core import device_names
    from qsync_opt.costs import devices

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

    from qsync_opt.core.errors import SchemaVersionError
    from qsync_opt.documents.io import parse_document
    from qsync_opt.documents.schemas import ClusterSpec, header_problem

    problem = header_problem(header, ClusterSpec)
    assert problem is not None
    with pytest.raises(SchemaVersionError) as from_file:
        parse_document(dict(header), ClusterSpec, where="c.json")
    assert str(from_file.value) == f"c.json: {problem}"
    with pytest.raises(ValidationError, match="schema_") as from_object:
        ClusterSpec.model_validate(dict(header))
    assert problem in str(from_object.value)
