"""Just-in-time build of the C++ CPU kernels (qsync_opt/ops/csrc) into a cache.

Built once per (sources, torch version, CPU model) with torch.utils.cpp_extension and
loaded as the torch op library ``qsync_cpu``. Where no compiler works, :func:`load_cpu`
returns (False, reason), the reason is kept for :func:`qsync_opt.ops.available`, and one
warning is logged; the Python references then serve, unless ``QSYNC_REQUIRE_CPP`` is set
(then it raises :class:`CppBuildError`; the tests set it under ``CI=true``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from functools import lru_cache
from pathlib import Path

import torch

from .._env import cache_root, cpu_model

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
CFLAGS = ["-O3", "-ffp-contract=off", "-march=native", "-std=c++17"]


def cache_dir() -> Path:
    sources = sorted(CSRC.glob("*.cpp"))
    digest = hashlib.sha256()
    for src in sources:
        digest.update(src.read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(cpu_model().encode())
    return cache_root() / "cpu" / digest.hexdigest()[:16]


#: A build lock older than this is left by a process that died mid-build (torch's lock
#: would make every later load wait forever); a real build takes well under a minute.
STALE_LOCK_S = 600


def _clear_stale_lock(build: Path) -> None:
    lock = build / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing a stale build lock %s (%.0f s old; its builder died)", lock, age)
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


@lru_cache(maxsize=1)
def _load_cpu() -> tuple[bool, str]:
    if _flag("QSYNC_DISABLE_CPP"):
        return False, "disabled by QSYNC_DISABLE_CPP"
    try:
        from torch.utils import cpp_extension

        build = cache_dir()
        build.mkdir(parents=True, exist_ok=True)
        _clear_stale_lock(build)
        # Compile copies kept in the cache folder, so every checkout of the same sources
        # shares one build (ninja rebuilds when a source *path* changes).
        sources = []
        for src in sorted(CSRC.glob("*.cpp")):
            copy = build / src.name
            data = src.read_bytes()
            if not copy.exists() or copy.read_bytes() != data:
                tmp = copy.with_name(f".{copy.name}.{os.getpid()}.tmp")
                tmp.write_bytes(data)
                os.replace(tmp, copy)
            sources.append(str(copy))
        log.info("building the qsync C++ CPU kernels in %s (first use only)", build)
        cpp_extension.load(
            name="qsync_cpu_kernels",
            sources=sources,
            extra_cflags=CFLAGS,
            build_directory=str(build),
            is_python_module=False,
            verbose=False,
        )
        version = int(torch.ops.qsync_cpu.abi_version())
        if version != 1:
            return False, f"qsync_cpu ABI version {version}, expected 1"
        return True, f"compiled with {' '.join(CFLAGS)} ({cpu_model()})"
    except Exception as exc:  # no compiler, no ninja, a failed build: fall back, say why
        reason = f"{exc.__class__.__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        log.warning("qsync C++ CPU kernels unavailable, using the Python references (%s)", reason)
        return False, reason
