"""Facts about this machine that several modules key their caches on."""

from __future__ import annotations

import ctypes
import os
import platform
import tempfile
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_root() -> Path:
    """qsync-opt's cache folder: $XDG_CACHE_HOME/qsync-opt (default ~/.cache/qsync-opt).

    A relative ``XDG_CACHE_HOME`` is ignored (the XDG spec says so: it would put the cache
    wherever the command runs); with no home folder either, a per-user temporary folder."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        try:
            base = str(Path.home() / ".cache")
        except (RuntimeError, KeyError):
            uid = os.getuid() if hasattr(os, "getuid") else 0
            base = os.path.join(tempfile.gettempdir(), f"qsync-opt-cache-{uid}")
    return Path(base) / "qsync-opt"


#: glibc mallopt parameters (malloc.h): M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64 bit)
TRIM_THRESHOLD = 1 << 30
_pinned: bool | None = None


def pin_malloc() -> bool:
    """Fix glibc's malloc thresholds in this process, so step times do not drift.

    By default glibc serves a large block (>= 128 KiB at first) with a fresh ``mmap``,
    page-faulted on first touch, and *raises* that threshold whenever such a block is freed:
    whether a 10 MiB im2col buffer costs ~3 ms of page faults depends on the allocation
    history of the process. Measured on this CPU (docs/BENCHMARKS.md), an int8 digits_cnn step
    took 16.7 ms in one process and 13.2 ms in another. Pinning the thresholds (mmap above
    32 MiB, trim above 1 GiB, the values ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``
    would set) makes the cost the same in every process: the profiler, the benchmarks and
    the training ranks call this. Returns whether it applied (glibc only; idempotent).
    """
    global _pinned
    if _pinned is not None:
        return _pinned
    _pinned = False
    if platform.system() != "Linux":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
              and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
        libc.mallopt(_M_TOP_PAD, 64 << 20)
        _pinned = bool(ok)
    except (OSError, AttributeError):
        _pinned = False
    return _pinned
