"""The shape of the code, counted: long modules, long functions, hidden imports, untyped
seams, document lengths and duplicated blocks of the tree it runs in.

    python benchmarks/code_shape.py [--repo DIR] [--json] [--list]

The library is the four folders installed as ``qsync_opt`` (``qsync_opt/``, ``solvers/``,
``models/``, ``cuda/``); every count but the document lengths and the duplicated blocks is
of the library's ``.py`` files, read with ``ast`` (nothing is imported or run).

- ``modules_over_700``: library modules of more than 700 lines.
- ``functions_over_80`` / ``functions_over_100``: library functions (methods and nested
  functions too, each counted on its own) spanning more than 80 / 100 lines, from the
  ``def`` line to the last line of the body (decorators not counted).
- ``function_imports``: ``import`` statements inside a function body (at any depth, in an
  ``if`` or ``try`` too); ``function_imports_optional``: those of them whose module is an
  optional dependency (``ns3``/``ns``, ``matplotlib``, ``transformers``, the CUDA build:
  ``torch.utils.cpp_extension`` and the package's own ``cuda`` folder).
- ``any_parameters``: parameters (``*args`` and ``**kwargs`` included) annotated ``Any``
  (``Any``, ``typing.Any`` or the string ``"Any"``).
- ``readme_lines``, ``benchmarks_doc_lines``: lines of README.md and docs/BENCHMARKS.md.
- ``duplicate_pairs``: pairs of places in the whole tree sharing six or more lines (the same
  lines or lines of the same shape), as the ``duplicates`` command counts them where it is on
  the PATH (``null`` where it is not, or with ``--no-tool``).
- ``duplicate_pairs_window_hash``: this script's own count, always made, of the ``.py`` files
  under the library, ``tests/`` and ``benchmarks/``: each line with its comment cut and its
  white space folded; blank lines, lone punctuation and import lines dropped; every window
  of six such lines hashed; a pair is a maximal run of windows equal in two places (a window
  standing in more than eight places is too common to count, a run overlapping itself is
  not a copy). It sees only identical lines, so it counts fewer than the command: compare
  each count only with itself.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

LIBRARY = ("qsync_opt", "solvers", "models", "cuda")
MODULE_LIMIT = 700
FUNCTION_LIMITS = (80, 100)
# The optional dependencies a function may import where it needs them (module prefixes).
OPTIONAL = ("ns3", "ns", "matplotlib", "transformers", "torch.utils.cpp_extension")
# The package's own CUDA build, however it is named from inside the library.
CUDA_BUILD = re.compile(r"^(qsync_opt\.)?cuda(\.|$)")
WINDOW = 6
TOO_COMMON = 8
DUPLICATES_SECONDS = 120


@dataclass
class Shape:
    """Every count, and the places behind the short lists."""

    modules_over_700: int = 0
    functions_over_80: int = 0
    functions_over_100: int = 0
    function_imports: int = 0
    function_imports_optional: int = 0
    any_parameters: int = 0
    readme_lines: int = 0
    benchmarks_doc_lines: int = 0
    duplicate_pairs: int | None = None
    duplicate_pairs_window_hash: int = 0
    library_modules: int = 0
    library_lines: int = 0
    long_modules: list[str] = field(default_factory=list)
    long_functions: list[str] = field(default_factory=list)
    imports_by_module: dict[str, int] = field(default_factory=dict)
    any_by_module: dict[str, int] = field(default_factory=dict)


def library_files(repo: Path) -> list[Path]:
    """The library's ``.py`` files, sorted (build outputs and caches left out)."""
    files: list[Path] = []
    for top in LIBRARY:
        root = repo / top
        if root.is_dir():
            files += [p for p in root.rglob("*.py") if "__pycache__" not in p.parts]
    return sorted(files)


def line_count(path: Path) -> int:
    if not path.is_file():
        return 0
    return len(path.read_text(encoding="utf-8").splitlines())


FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


def _functions(tree: ast.AST) -> Iterator[tuple[str, FunctionNode]]:
    """Every function with its dotted name (``Class.method``, ``outer.inner``)."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, FunctionNode]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, FunctionNode):
                name = f"{prefix}{child.name}"
                yield name, child
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def _imports_in_functions(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements whose nearest enclosing scope is a function."""

    def walk(node: ast.AST, in_function: bool) -> Iterator[ast.Import | ast.ImportFrom]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom) and in_function:
                yield child
            if isinstance(child, FunctionNode | ast.Lambda):
                yield from walk(child, True)
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, False)
            else:
                yield from walk(child, in_function)

    yield from walk(tree, False)


def _imported_modules(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: the names may be modules themselves (from .. import cuda)
        return [base] + [f"{base}.{alias.name}".lstrip(".") for alias in node.names]
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def is_optional(node: ast.Import | ast.ImportFrom) -> bool:
    """Whether the import is of an optional dependency (or of the CUDA build)."""
    for module in _imported_modules(node):
        if any(module == p or module.startswith(p + ".") for p in OPTIONAL):
            return True
        if CUDA_BUILD.match(module):
            return True
    return False


def _is_any(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    if isinstance(annotation, ast.Name):
        return annotation.id == "Any"
    if isinstance(annotation, ast.Attribute):
        return annotation.attr == "Any" and isinstance(annotation.value, ast.Name)
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return annotation.value.strip() == "Any"
    return False


def _parameters(fn: FunctionNode) -> list[ast.arg]:
    a = fn.args
    extra = [x for x in (a.vararg, a.kwarg) if x is not None]
    return [*a.posonlyargs, *a.args, *a.kwonlyargs, *extra]


def count_library(repo: Path, shape: Shape) -> None:
    """The module, function, import and annotation counts of the library."""
    lo, hi = FUNCTION_LIMITS
    for path in library_files(repo):
        rel = path.relative_to(repo).as_posix()
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        shape.library_modules += 1
        shape.library_lines += lines
        if lines > MODULE_LIMIT:
            shape.modules_over_700 += 1
            shape.long_modules.append(f"{rel} {lines}")
        tree = ast.parse(text, filename=rel)
        any_here = 0
        for name, fn in _functions(tree):
            span = (fn.end_lineno or fn.lineno) - fn.lineno + 1
            if span > lo:
                shape.functions_over_80 += 1
                shape.long_functions.append(f"{rel}:{fn.lineno} {name} {span}")
            if span > hi:
                shape.functions_over_100 += 1
            any_here += sum(_is_any(p.annotation) for p in _parameters(fn))
        if any_here:
            shape.any_by_module[rel] = any_here
        shape.any_parameters += any_here
        imports = list(_imports_in_functions(tree))
        if imports:
            shape.imports_by_module[rel] = len(imports)
        shape.function_imports += len(imports)
        shape.function_imports_optional += sum(is_optional(i) for i in imports)
    shape.long_modules.sort(key=lambda s: -int(s.rsplit(" ", 1)[1]))
    shape.long_functions.sort(key=lambda s: -int(s.rsplit(" ", 1)[1]))


# --- duplicated blocks ---------------------------------------------------------------------

_SKIP = re.compile(r"^(import |from \S+ import |[\W_]*$)")


def _normalised(text: str) -> list[tuple[int, str]]:
    """(line number, line) for the lines that count: comments cut, white space folded."""
    kept = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = " ".join(raw.split("#", 1)[0].split()) if "#" in raw else " ".join(raw.split())
        if line and not _SKIP.match(line):
            kept.append((number, line))
    return kept


def window_hash_pairs(repo: Path) -> int:
    """The pairs of places sharing six or more counted lines (see the module's doc)."""
    roots = [*LIBRARY, "tests", "benchmarks"]
    files = sorted(
        p for top in roots if (repo / top).is_dir()
        for p in (repo / top).rglob("*.py") if "__pycache__" not in p.parts
    )
    places: dict[bytes, list[tuple[int, int]]] = defaultdict(list)
    keys: list[list[bytes]] = []
    for index, path in enumerate(files):
        lines = [line for _, line in _normalised(path.read_text(encoding="utf-8"))]
        own = [
            hashlib.blake2b("\n".join(lines[i : i + WINDOW]).encode(), digest_size=12).digest()
            for i in range(len(lines) - WINDOW + 1)
        ]
        keys.append(own)
        for start, key in enumerate(own):
            places[key].append((index, start))
    pairs = 0
    for where in places.values():
        if len(where) < 2 or len(where) > TOO_COMMON:
            continue
        for i, (fa, sa) in enumerate(where):
            for fb, sb in where[i + 1 :]:
                if _continues(keys, places, (fa, sa), (fb, sb)):
                    continue  # a pair is counted once, at the first window of its run
                if fa == fb and _overlaps(keys[fa], sa, sb):
                    continue  # a run overlapping itself (repeated lines) is not a copy
                pairs += 1
    return pairs


def _continues(keys: list[list[bytes]], places: dict[bytes, list[tuple[int, int]]],
               a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether the windows before ``a`` and ``b`` are a counted pair too."""
    (fa, sa), (fb, sb) = a, b
    if sa == 0 or sb == 0 or keys[fa][sa - 1] != keys[fb][sb - 1]:
        return False
    return 2 <= len(places[keys[fa][sa - 1]]) <= TOO_COMMON


def _overlaps(own: list[bytes], sa: int, sb: int) -> bool:
    """Whether the run of equal windows from ``sa`` and ``sb`` (one file) overlaps itself."""
    first, second = min(sa, sb), max(sa, sb)
    run = 1
    while second + run < len(own) and own[first + run] == own[second + run]:
        run += 1
    return second <= first + run - 1 + WINDOW - 1


_PAIRS = re.compile(r"^(\d+) pairs? of places")


def duplicates_command_pairs(repo: Path) -> int | None:
    """The pair count of the ``duplicates`` command, or None where it cannot say."""
    command = shutil.which("duplicates")
    if command is None:
        return None
    try:
        done = subprocess.run(
            [command, "--repo", str(repo), "--most", "1", "--seconds", str(DUPLICATES_SECONDS)],
            capture_output=True, text=True, timeout=DUPLICATES_SECONDS + 30, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    out = done.stdout.splitlines()
    if any(line.startswith("incomplete:") for line in out) or not out:
        return None
    if out[0].startswith("no duplicates"):
        return 0
    match = _PAIRS.match(out[0])
    return int(match.group(1)) if match else None


def measure(repo: Path, use_tool: bool = True) -> Shape:
    shape = Shape()
    count_library(repo, shape)
    shape.readme_lines = line_count(repo / "README.md")
    shape.benchmarks_doc_lines = line_count(repo / "docs" / "BENCHMARKS.md")
    shape.duplicate_pairs = duplicates_command_pairs(repo) if use_tool else None
    shape.duplicate_pairs_window_hash = window_hash_pairs(repo)
    return shape


COUNTS = (
    "modules_over_700", "functions_over_80", "functions_over_100", "function_imports",
    "function_imports_optional", "any_parameters", "readme_lines", "benchmarks_doc_lines",
    "duplicate_pairs", "duplicate_pairs_window_hash", "library_modules", "library_lines",
)


def _text(value: object) -> str:
    return "null" if value is None else str(value)


def render(shape: Shape, with_lists: bool) -> str:
    """The counts one per line (``name: value``), then, with ``with_lists``, the places."""
    out = [f"{name}: {_text(getattr(shape, name))}" for name in COUNTS]
    if with_lists:
        out += ["", f"long_modules ({len(shape.long_modules)}):"]
        out += [f"  {m}" for m in shape.long_modules]
        out += ["", f"long_functions ({len(shape.long_functions)}):"]
        out += [f"  {f}" for f in shape.long_functions]
        for title, counts in (("function_imports_by_module", shape.imports_by_module),
                              ("any_parameters_by_module", shape.any_by_module)):
            ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
            out += ["", f"{title} ({len(ranked)}):"]
            out += [f"  {name} {n}" for name, n in ranked]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the tree to count (default: this repository)")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.add_argument("--list", action="store_true",
                        help="after the counts, the long modules and functions and the "
                             "function-level imports per module")
    parser.add_argument("--no-tool", action="store_true",
                        help="leave the duplicates command out (duplicate_pairs: null)")
    args = parser.parse_args(argv)
    if not args.repo.is_dir():
        print(f"code_shape: --repo: {args.repo} is not a folder", file=sys.stderr)
        return 2
    shape = measure(args.repo.resolve(), use_tool=not args.no_tool)
    if args.json:
        print(json.dumps(asdict(shape), indent=1, sort_keys=True))
    else:
        sys.stdout.write(render(shape, args.list))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
