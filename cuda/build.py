"""Compile the CUDA kernels (every ``*.cu`` here) into ``libqsync_cuda.so`` with nvcc.

No torch headers are involved: the library exposes the C ABI of ``qsync_kernels.h`` and is
loaded with ctypes (:mod:`qsync_opt.cuda.kernels`), so any nvcc can build it for any torch.
The CUDA runtime is linked statically (nvcc's default), so the library needs only a driver.

The result is cached under ``$XDG_CACHE_HOME/qsync-opt/cuda/<key>/`` where the key hashes the
sources, the architectures, the nvcc flags and nvcc's version; a build whose library exists
is skipped. The library is written to a temporary name and moved into place atomically.

    python -m qsync_opt.cuda.build [--out DIR] [--arch 75 --arch 80 ...] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from qsync_opt.cuda import source_dir

log = logging.getLogger(__name__)

#: Real architectures compiled to SASS: Turing (T4) through Hopper. CUDA 13 has no sm_70, so
#: V100 is not covered (it runs torch's own fp16/fp32 kernels).
ARCHS: tuple[str, ...] = ("75", "80", "86", "89", "90")
#: PTX shipped besides the SASS, JIT-compiled by the driver on newer cards.
PTX_ARCH = "90"
LIB_NAME = "libqsync_cuda.so"
#: Next to the library: the build key it was compiled for (guards an explicit --out folder).
KEY_NAME = LIB_NAME + ".key"
NVCC_TIMEOUT_S = 1800
_STDERR_TAIL = 4000


class CudaBuildError(RuntimeError):
    """nvcc is missing or failed; the message carries the tail of its stderr."""


def find_nvcc() -> str | None:
    """nvcc from PATH, then ``$CUDA_HOME/bin``, then ``/usr/local/cuda/bin``; None if absent."""
    found = shutil.which("nvcc")
    if found:
        return found
    candidates = []
    cuda_home = os.environ.get("CUDA_HOME")
    if cuda_home:
        candidates.append(Path(cuda_home) / "bin" / "nvcc")
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    for cand in candidates:
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    return None


def _require_nvcc(nvcc: str | None) -> str:
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise CudaBuildError(
            "nvcc not found (looked on PATH, in $CUDA_HOME/bin and /usr/local/cuda/bin)"
        )
    return nvcc


def _check_archs(archs: Iterable[str]) -> tuple[str, ...]:
    out = tuple(str(a).strip() for a in archs)
    if not out:
        raise ValueError("archs must name at least one architecture")
    for a in out:
        if not a.isdigit():
            raise ValueError(f"arch {a!r} must be digits such as '80' (sm_80)")
    return out


def nvcc_command(
    sources: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    archs: Iterable[str] = ARCHS,
    nvcc: str | None = None,
) -> list[str]:
    """The nvcc command line compiling ``sources`` into the shared library ``out``.

    ``-fmad=false`` is part of the numerics contract (no FMA contraction; bit-exact with the
    CPU reference). Symbols stay hidden except the ``QSYNC_API`` entry points, and symbols of
    the static CUDA runtime are not re-exported, so the library never interposes on (or is
    interposed by) the CUDA runtime torch loads.
    """
    archs = _check_archs(archs)
    cmd = [
        nvcc or find_nvcc() or "nvcc",
        "-O3",
        "-shared",
        "-Xcompiler",
        "-fPIC",
        "-Xcompiler",
        "-fvisibility=hidden",
        "-Xlinker",
        "--exclude-libs,ALL",
        "-fmad=false",
        "-std=c++17",
    ]
    for a in archs:
        cmd += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    cmd += ["-gencode", f"arch=compute_{PTX_ARCH},code=compute_{PTX_ARCH}"]
    cmd += ["-o", str(out)]
    cmd += [str(s) for s in sources]
    return cmd


def nvcc_version(nvcc: str | None = None) -> str:
    """The output of ``nvcc --version`` (part of the cache key)."""
    nvcc = _require_nvcc(nvcc)
    proc = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise CudaBuildError(f"{nvcc} --version failed:\n{proc.stderr[-_STDERR_TAIL:]}")
    return proc.stdout.strip()


def cu_sources(folder: Path | None = None) -> list[Path]:
    """Every ``*.cu`` in the package folder, sorted."""
    return sorted((folder or source_dir()).glob("*.cu"))


def build_key(archs: Iterable[str] = ARCHS, nvcc: str | None = None) -> str:
    """Hash of the sources (``.cu`` and the headers they include), archs, flags and nvcc."""
    archs = _check_archs(archs)
    folder = source_dir()
    h = hashlib.sha256()
    files = sorted(p for pat in ("*.cu", "*.cuh", "*.h") for p in folder.glob(pat))
    for p in files:
        h.update(p.name.encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    h.update(" ".join(archs).encode() + b"\0")
    flags = nvcc_command(["SRC"], "OUT", archs, nvcc="nvcc")
    h.update(" ".join(flags).encode() + b"\0")
    h.update(nvcc_version(nvcc).encode())
    return h.hexdigest()[:16]


def default_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "qsync-opt" / "cuda"


def build(
    out_dir: str | os.PathLike[str] | None = None,
    archs: Iterable[str] = ARCHS,
    force: bool = False,
    nvcc: str | None = None,
) -> Path:
    """Compile the kernels into ``libqsync_cuda.so`` and return its path.

    ``out_dir`` defaults to ``$XDG_CACHE_HOME/qsync-opt/cuda/<key>/``. An existing library
    built for the same key is reused unless ``force``. Raises :class:`CudaBuildError` when
    nvcc is missing or fails.
    """
    nvcc = _require_nvcc(nvcc)
    archs = _check_archs(archs)
    sources = cu_sources()
    if not sources:
        raise CudaBuildError(f"no .cu sources in {source_dir()}")
    key = build_key(archs, nvcc)
    folder = Path(out_dir) if out_dir is not None else default_cache_root() / key
    lib = folder / LIB_NAME
    key_file = folder / KEY_NAME
    if not force and lib.is_file() and key_file.is_file():
        if key_file.read_text().strip() == key:
            log.debug("qsync CUDA library up to date: %s", lib)
            return lib
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{LIB_NAME}.{os.getpid()}.tmp"
    cmd = nvcc_command(sources, tmp, archs, nvcc=nvcc)
    log.info("building the qsync CUDA library (%s): %s", ",".join(archs), " ".join(cmd))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=NVCC_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        tmp.unlink(missing_ok=True)
        raise CudaBuildError(f"nvcc timed out after {NVCC_TIMEOUT_S} s") from exc
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = (proc.stderr or proc.stdout)[-_STDERR_TAIL:]
        raise CudaBuildError(f"nvcc failed with exit code {proc.returncode}:\n{tail}")
    os.replace(tmp, lib)
    key_tmp = folder / f".{KEY_NAME}.{os.getpid()}.tmp"
    key_tmp.write_text(key + "\n")
    os.replace(key_tmp, key_file)
    log.info("built %s in %.1f s", lib, time.perf_counter() - t0)
    return lib


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m qsync_opt.cuda.build",
        description="Compile the qsync CUDA kernels with nvcc and print the library's path.",
    )
    ap.add_argument("--out", metavar="DIR", help="output folder (default: the cache folder)")
    ap.add_argument(
        "--arch",
        action="append",
        metavar="XX",
        help=f"SM architecture such as 80; repeatable (default: {' '.join(ARCHS)})",
    )
    ap.add_argument("--force", action="store_true", help="rebuild even when up to date")
    args = ap.parse_args(argv)
    try:
        path = build(args.out, tuple(args.arch) if args.arch else ARCHS, force=args.force)
    except (CudaBuildError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
