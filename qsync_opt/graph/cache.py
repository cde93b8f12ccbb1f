"""Traced graphs kept on disk, so that a command does not trace the same model twice.

A built-in workload's graph depends only on code and settings, all in the key: the
package's version and every Python source of the package and its models
(:func:`~qsync_opt.core.modelspec.package_code_digest`), torch's and Python's versions, the
workload, the batch and the tracer's settings (``include_loss``, ``pin_head``, ``unpin``,
``tie``, ``method``, the graph's name). A workload whose code cannot be known in full (a
user's file, which may import other files; a workload made or changed outside the package's
registry) has no code digest and is never cached.

The files live in ``graphs/`` of the cache folder (:func:`qsync_opt.core.machine.cache_root`),
one per key, each holding its key beside the graph: a file whose key is not the one asked
for (copied, planted, or from a hash collision) is ignored. Files are written atomically and
read, written and deleted through no link (:mod:`qsync_opt.documents.outfolder`: a link planted in the
cache folder, or a ``graphs`` folder that is a link, is never followed). When a workload is
traced again after its code changed, its graphs made by the older code are deleted, so the
folder does not grow with every edit. A file that cannot be
read or parsed, or holds no valid graph, is traced again and replaced; a cache that cannot
be written costs only the next trace.

A lookup at no given batch (:func:`qsync_opt.graph.tracing.trace` of a built-in's name)
reads the workload's default batch from a small file of the same folder, written when the
workload was traced at its default batch (:func:`store_default_batch`), so that a cached
graph is found without importing the registry, the tracer or torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import stat
import sys
from collections.abc import Callable
from importlib import metadata

from qsync_opt.core.errors import OutputError, QsyncInputError
from qsync_opt.core.machine import cache_root
from qsync_opt.documents import outfolder
from qsync_opt.documents.io import parse_document, parse_text
from qsync_opt.documents.schemas import ModelGraph

log = logging.getLogger("qsync_opt.graph")

#: The layout of a cache file; a change of it changes every key.
FORMAT = 1
FOLDER = "graphs"
#: A cache file larger than this is not read (the largest built-in graph is a few MiB).
MAX_BYTES = 256 << 20


def _package_version() -> str:
    try:
        return metadata.version("qsync-opt")
    except metadata.PackageNotFoundError:
        return "unknown"


def torch_version() -> str:
    """torch's version as its distribution states it (``torch.__version__``), read without
    importing torch, so that a graph found in the cache costs no import of torch."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "unknown"


def cache_key(cache_name: str, code_digest: str, batch: int,
              settings: dict[str, object]) -> dict[str, object]:
    """Everything a traced graph depends on, as a JSON-able mapping."""
    return {"format": FORMAT, "package": _package_version(), "code": code_digest,
            "torch": torch_version(), "python": list(sys.version_info[:2]),
            "workload": cache_name, "batch": batch, "settings": settings}


def _stem(key: dict[str, object]) -> str:
    """The workload's name in a file name: its ASCII letters, digits and underscores."""
    return "".join(c for c in str(key["workload"])
                   if c.isascii() and (c.isalnum() or c == "_"))[:40]


def cache_file(key: dict[str, object]) -> str:
    """The file name of ``key`` in the cache folder: the workload's name, the code digest's
    first 8 digits, the batch, and a digest of the whole key."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return f"{_stem(key)}-{str(key['code'])[:8]}-b{key['batch']}-{digest}.json"


def _stored(key: dict[str, object], quiet: bool) -> dict[str, object] | None:
    """The JSON object filed under ``key`` (holding that key), or None (none there, or not
    usable: logged unless ``quiet``)."""
    name = cache_file(key)
    try:
        data = outfolder.read_bytes(cache_root(), f"{FOLDER}/{name}", what="graph cache")
    except (OutputError, OSError) as exc:
        if not quiet:
            log.warning("graph cache: %s not read (%s); tracing", name, exc)
        return None
    if data is None:
        return None
    try:
        if len(data) > MAX_BYTES:
            raise QsyncInputError(f"{len(data)} bytes, more than {MAX_BYTES}")
        stored = parse_text(data.decode("utf-8"), "JSON", name)
        if not isinstance(stored, dict) or stored.get("key") != key:
            raise QsyncInputError("it holds another key")
        return stored
    except (QsyncInputError, UnicodeDecodeError) as exc:
        if not quiet:
            log.warning("graph cache: %s unusable (%s); tracing again", name, exc)
        return None


def load_cached(key: dict[str, object], quiet: bool = False) -> ModelGraph | None:
    """The graph cached under ``key``, or None (none there, or not usable: logged unless
    ``quiet``, as for a lookup that a trace follows on a miss, which logs it)."""
    stored = _stored(key, quiet)
    if stored is None:
        return None
    try:
        return parse_document(stored.get("graph"), ModelGraph, cache_file(key))
    except QsyncInputError as exc:
        if not quiet:
            log.warning("graph cache: %s unusable (%s); tracing again", cache_file(key), exc)
        return None


def default_batch_key(cache_name: str, code_digest: str) -> dict[str, object]:
    """The key of a workload's default batch as its code states it (``"batch"`` is
    ``"default"``): what a lookup of a built-in at no given batch reads, without importing
    the registry (which imports torch)."""
    return {"format": FORMAT, "package": _package_version(), "code": code_digest,
            "python": list(sys.version_info[:2]), "workload": cache_name, "batch": "default"}


def load_default_batch(cache_name: str, code_digest: str) -> int | None:
    """The default batch recorded for the workload by this code, or None."""
    stored = _stored(default_batch_key(cache_name, code_digest), quiet=True)
    batch = stored.get("default_batch") if stored is not None else None
    return batch if isinstance(batch, int) and not isinstance(batch, bool) and batch > 0 else None


def store_default_batch(cache_name: str, code_digest: str, batch: int) -> None:
    """Record the workload's default batch (written atomically; a failure is logged at info
    level, never raised, as :func:`store`'s; it shares the graphs' prune)."""
    key = default_batch_key(cache_name, code_digest)
    if load_default_batch(cache_name, code_digest) == batch:
        return
    name = cache_file(key)
    text = json.dumps({"key": key, "default_batch": batch}) + "\n"
    try:
        outfolder.write_text(cache_root(), f"{FOLDER}/{name}", text, what="graph cache")
    except (OutputError, OSError) as exc:
        log.info("graph cache: %s not written (%s)", name, exc)


def store(key: dict[str, object], graph: ModelGraph) -> None:
    """Write ``graph`` under ``key``, atomically, then :func:`prune`; a failure is logged at
    info level, never raised and never printed: the cache only saves the next trace, and a
    command's output (one line on bad input) must not change because a cache could not be
    written (a full disk, a file-size limit, a read-only home)."""
    name = cache_file(key)
    text = json.dumps({"key": key, "graph": graph.model_dump(mode="json")}) + "\n"
    try:
        outfolder.write_text(cache_root(), f"{FOLDER}/{name}", text, what="graph cache")
    except (OutputError, OSError) as exc:
        log.info("graph cache: %s not written (%s)", name, exc)
        return
    try:
        prune(key)
    except (OutputError, OSError) as exc:
        log.info("graph cache: older graphs of %s not deleted (%s)", key["workload"], exc)


def prune(key: dict[str, object]) -> int:
    """Delete the workload's files made by other code (another code digest): the cache
    holds at most the current code's graphs of a workload once it is traced again. Only
    regular files are deleted, never a link. Returns how many."""
    own = f"{_stem(key)}-"
    current = f"{own}{str(key['code'])[:8]}-"
    gone = 0
    for name, st in outfolder.list_names(cache_root(), FOLDER, what="graph cache"):
        if (stat.S_ISREG(st.st_mode) and name.startswith(own) and name.endswith(".json")
                and not name.startswith(current)):
            gone += outfolder.remove(cache_root(), f"{FOLDER}/{name}", what="graph cache")
    return gone


def cached(key: dict[str, object], make: Callable[[], ModelGraph]) -> ModelGraph:
    """The graph under ``key`` from the cache, else ``make()``'s, then cached."""
    graph = load_cached(key)
    if graph is not None:
        log.info("graph cache: reusing %s", cache_file(key))
        return graph
    graph = make()
    store(key, graph)
    return graph
