"""CUDA and C++ kernel sources (installed as ``qsync_opt.cuda``).

The sources ship inside the wheel because kernels are compiled where they run (nvcc for the
CUDA side behind a small C ABI loaded with ctypes; torch.utils.cpp_extension for the CPU
side). :func:`source_dir` is where the build steps find them.

CUDA side (fusions around ``torch._int_mm``; bit-exact with the CPU reference):

- ``qsync_kernels.h`` / ``qsync_kernels.cu``: the C ABI and the kernels (int8 quantize with
  round-to-nearest-even or counter-based stochastic rounding, dequantize, int32 GEMM
  rescale + bias + cast, and the rounding RNG itself).
- :mod:`qsync_opt.cuda.build`: compiles them with nvcc (no torch headers) into a cached
  ``libqsync_cuda.so``; ``python -m qsync_opt.cuda.build`` prints its path.
- :mod:`qsync_opt.cuda.kernels`: ``load()`` opens it with ctypes and wraps it for torch CUDA
  tensors, or returns None (reason in ``load_error()``) where it cannot run.

Importing this package imports neither of those modules: no torch, no nvcc.
"""

from __future__ import annotations

from pathlib import Path


def source_dir() -> Path:
    """Folder holding the kernel sources, in a checkout or an installed wheel."""
    return Path(__file__).resolve().parent
