"""CUDA and C++ kernel sources (installed as ``qsync_opt.cuda``).

The sources ship inside the wheel because kernels are compiled where they run (nvcc for the
CUDA side behind a small C ABI loaded with ctypes; torch.utils.cpp_extension for the CPU
side). The low-precision operator stage adds the kernels; :func:`source_dir` is where the
build steps find them.
"""

from __future__ import annotations

from pathlib import Path


def source_dir() -> Path:
    """Folder holding the kernel sources, in a checkout or an installed wheel."""
    return Path(__file__).resolve().parent
