"""Just-in-time build of the C++ CPU kernels (qsync_opt/ops/csrc) into a cache.

Built once per (sources, torch version, CPU model) with torch.utils.cpp_extension and
loaded as the torch op library ``qsync_cpu``. Where no compiler works, :func:`load_cpu`
returns None, the reason is kept for :func:`qsync_opt.ops.available`, and one warning is
logged; the Python references then serve.
"""

from __future__ import annotations

import hashlib
import logging
import os
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


@lru_cache(maxsize=1)
def load_cpu() -> tuple[bool, str]:
    """(loaded, reason). Loads ``torch.ops.qsync_cpu``, compiling it on first use."""
    if os.environ.get("QSYNC_DISABLE_CPP", "") not in ("", "0"):
        return False, "disabled by QSYNC_DISABLE_CPP"
    try:
        from torch.utils import cpp_extension

        build = cache_dir()
        build.mkdir(parents=True, exist_ok=True)
        log.info("building the qsync C++ CPU kernels in %s (first use only)", build)
        cpp_extension.load(
            name="qsync_cpu_kernels",
            sources=[str(s) for s in sorted(CSRC.glob("*.cpp"))],
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
