"""Facts about this machine that several modules key their caches on."""

from __future__ import annotations

import os
import platform
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
    """qsync-opt's cache folder: $XDG_CACHE_HOME/qsync-opt (default ~/.cache/qsync-opt)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "qsync-opt"
