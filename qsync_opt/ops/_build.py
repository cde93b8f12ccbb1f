"""Just-in-time build of the C++ CPU kernels (qsync_opt/ops/csrc) into a cache.

Built once per key and loaded as the torch op library ``qsync_cpu``. The key covers what
the library depends on: the sources, the compiler flags and ``$CXX``, the torch version and
its install folder, the interpreter and its venv (``sys.prefix``) and the CPU model, so two
venvs with the same sources never rebuild each other's library.

The build is atomic: it runs in a private folder ``<key>/tmp.<host>.<pid>.<random>`` and
that folder is renamed to ``<key>/lib`` when done, so a loader sees a complete library or
none (never a half-written ``.so``); a loader that finds ``lib`` loads it without building.
One builder at a time holds ``<key>/lock`` (its host and pid inside); the others wait for
it, at most :data:`MAX_WAIT_S`, re-checking while they wait: a lock whose owner process is
dead, or older than :data:`STALE_LOCK_S`, is removed (with one log line saying so). After
the wait a loader builds on its own (in its own private folder) instead of waiting longer.

Where no compiler works, :func:`load_cpu` returns (False, reason), the reason is kept for
:func:`qsync_opt.ops.available`, and one warning is logged; the Python references then
serve, unless ``QSYNC_REQUIRE_CPP`` is set (then it raises :class:`CppBuildError`; the tests
set it under ``CI=true``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch

from qsync_opt.core.machine import cache_root, cpu_model

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
CFLAGS = ["-O3", "-ffp-contract=off", "-march=native", "-std=c++17"]
LIB_NAME = "qsync_cpu_kernels"

#: A build lock older than this is left by a builder that hung or died (a real build
#: takes well under a minute); it is removed. A lock whose owner pid is gone goes at once.
STALE_LOCK_S = 600.0
#: The longest a loader waits for another process's build before building on its own.
MAX_WAIT_S = 300.0
#: A lock file still empty after this long was left by a builder that died creating it.
EMPTY_LOCK_S = 30.0
#: Poll interval while waiting for a lock.
POLL_S = 0.2
#: Private build folders of dead builders older than this are removed.
STALE_TMP_S = 3600.0


def cache_key() -> str:
    """What the built library depends on, hashed: sources, flags and compiler, torch
    (version and folder), the interpreter and its venv (``sys.prefix``), the CPU model."""
    digest = hashlib.sha256()
    for src in sorted(CSRC.glob("*.cpp")):
        digest.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    parts = [" ".join(CFLAGS), os.environ.get("CXX", ""), torch.__version__,
             os.path.realpath(os.path.dirname(torch.__file__)),
             os.path.realpath(sys.prefix), sys.version, sys.implementation.cache_tag or "",
             cpu_model()]
    for p in parts:
        digest.update(p.encode("utf-8", "surrogateescape") + b"\0")
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    """This interpreter's folder in the cache (holding ``lock``, ``lib`` and builds)."""
    return cache_root() / "cpu" / cache_key()


def _lib_file(folder: Path) -> Path:
    return folder / f"{LIB_NAME}.so"


def _owner(lock: Path) -> tuple[str, int] | None:
    """(host, pid) written in a lock file; None when it holds none (yet)."""
    try:
        text = lock.read_text().split()
    except (OSError, UnicodeDecodeError):
        return None
    if len(text) >= 2 and text[1].isdigit():
        return text[0], int(text[1])
    return None


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    except OSError:
        return True
    return True


def _stale_reason(lock: Path) -> str | None:
    """Why the lock is stale (its owner is dead, it is too old), or None."""
    try:
        st = lock.stat()
    except FileNotFoundError:
        return None
    age = time.time() - st.st_mtime
    owner = _owner(lock)
    if owner is not None and owner[0] == socket.gethostname() and not _pid_alive(owner[1]):
        return f"its builder (pid {owner[1]}) is dead"
    if age > STALE_LOCK_S:
        return f"{age:.0f} s old"
    if owner is None and age > EMPTY_LOCK_S:
        return f"empty and {age:.0f} s old (its builder died creating it)"
    return None


def _clear_stale_lock(build: Path) -> bool:
    """Remove ``build/lock`` if it is stale (see :func:`_stale_reason`), with one log line;
    a live builder's lock is kept. Returns whether one was removed."""
    lock = build / "lock"
    why = _stale_reason(lock)
    if why is None:
        return False
    try:
        ino = lock.stat().st_ino
        aside = lock.with_name(f"lock.stale.{os.getpid()}.{secrets.token_hex(4)}")
        os.rename(lock, aside)
    except OSError:
        return False  # another waiter removed it first
    if aside.stat().st_ino != ino:  # it was replaced by a new builder's lock meanwhile
        try:
            os.link(aside, lock)
        except OSError:
            pass
        aside.unlink(missing_ok=True)
        return False
    aside.unlink(missing_ok=True)
    log.warning("removed a stale qsync C++ build lock %s (%s)", lock, why)
    return True


def _try_lock(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{socket.gethostname()} {os.getpid()}\n")
    return True


def _clear_dead_builds(folder: Path) -> None:
    """Private build folders whose builder is dead (or that are very old) are removed."""
    host = socket.gethostname()
    for tmp in folder.glob("tmp.*"):
        parts = tmp.name.split(".")
        try:
            age = time.time() - tmp.stat().st_mtime
        except OSError:
            continue
        dead = (len(parts) >= 4 and parts[1] == host and parts[2].isdigit()
                and not _pid_alive(int(parts[2])) and int(parts[2]) != os.getpid())
        if dead or age > STALE_TMP_S:
            shutil.rmtree(tmp, ignore_errors=True)


def _compile(build: Path) -> None:
    """Compile the kernels into ``build`` (a private folder) with torch's cpp_extension."""
    from torch.utils import cpp_extension  # lazy: the optional C++ build's compiler

    sources = []
    for src in sorted(CSRC.glob("*.cpp")):
        copy = build / src.name
        copy.write_bytes(src.read_bytes())
        sources.append(str(copy))
    cpp_extension.load(name=LIB_NAME, sources=sources, extra_cflags=CFLAGS,
                       build_directory=str(build), is_python_module=False, verbose=False)


def build_library(folder: Path, compile_fn: Callable[[Path], None] | None = None,
                  max_wait_s: float | None = None) -> Path:
    """The library file for ``folder`` (a :func:`cache_dir`), built if need be: by this
    process when it gets the lock, else by the lock's holder, waited for at most
    ``max_wait_s`` (default :data:`MAX_WAIT_S`) with stale locks removed while waiting,
    then by this process on its own. The build is renamed into ``folder/lib`` in one step.
    """
    compile_fn = compile_fn or _compile
    wait = MAX_WAIT_S if max_wait_s is None else max_wait_s
    final = folder / "lib"
    if _lib_file(final).is_file():
        return _lib_file(final)
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    deadline = time.monotonic() + wait
    have_lock = False
    while True:
        if _lib_file(final).is_file():
            return _lib_file(final)
        if _try_lock(lock):
            have_lock = True
            break
        _clear_stale_lock(folder)
        if time.monotonic() >= deadline:
            log.warning("waited %.0f s for another process's qsync C++ build (lock %s); "
                        "building on our own", wait, lock)
            break
        time.sleep(POLL_S)
    try:
        if _lib_file(final).is_file():
            return _lib_file(final)
        _clear_dead_builds(folder)
        tmp = folder / f"tmp.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            log.info("building the qsync C++ CPU kernels in %s (first use only)", tmp)
            compile_fn(tmp)
            if not _lib_file(tmp).is_file():
                raise RuntimeError(f"the build left no {_lib_file(tmp).name}")
            try:
                os.rename(tmp, final)  # atomic; fails if another build got there first
            except OSError:
                if not _lib_file(final).is_file():
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return _lib_file(final)
    finally:
        if have_lock:
            lock.unlink(missing_ok=True)


class CppBuildError(RuntimeError):
    """The C++ kernels did not build or load while ``QSYNC_REQUIRE_CPP`` requires them."""


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def load_cpu() -> tuple[bool, str]:
    """(loaded, reason). Loads ``torch.ops.qsync_cpu``, compiling it on first use.

    With ``QSYNC_REQUIRE_CPP`` set (the test suite sets it under ``CI=true``) a build or load
    that fails raises :class:`CppBuildError` with the reason instead of falling back to the
    Python references; ``QSYNC_DISABLE_CPP`` still disables the kernels on purpose.
    """
    ok, reason = _load_cpu()
    if not ok and _flag("QSYNC_REQUIRE_CPP") and not _flag("QSYNC_DISABLE_CPP"):
        raise CppBuildError(f"the qsync C++ CPU kernels are required (QSYNC_REQUIRE_CPP) but "
                            f"did not load: {reason}")
    return ok, reason


def _loaded() -> bool:
    try:
        torch.ops.qsync_cpu.abi_version  # noqa: B018
    except Exception:
        return False
    return True


@lru_cache(maxsize=1)
def _load_cpu() -> tuple[bool, str]:
    if _flag("QSYNC_DISABLE_CPP"):
        return False, "disabled by QSYNC_DISABLE_CPP"
    try:
        lib = build_library(cache_dir())
        if not _loaded():  # (a build in this process has loaded it already)
            torch.ops.load_library(str(lib))
        version = int(torch.ops.qsync_cpu.abi_version())
        if version != 1:
            return False, f"qsync_cpu ABI version {version}, expected 1"
        return True, f"compiled with {' '.join(CFLAGS)} ({cpu_model()})"
    except Exception as exc:  # no compiler, no ninja, a failed build: fall back, say why
        text = str(exc).strip()
        reason = f"{exc.__class__.__name__}: {text.splitlines()[-1] if text else ''}"
        log.warning("qsync C++ CPU kernels unavailable, using the Python references (%s)", reason)
        return False, reason
