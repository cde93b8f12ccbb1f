"""Which implementation serves a device (the C++ CPU kernels, the CUDA kernels, the Python
references), the checks every op shares, and :func:`owned`: every op's outputs own their
memory."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from qsync_opt.ops._build import load_cpu

log = logging.getLogger(__name__)

__all__ = ["available", "check_float", "cuda_kernels", "default_bwd_dtype", "load_cpu", "owned",
           "shares_memory", "use_cpp"]


@lru_cache(maxsize=1)
def cuda_kernels() -> Any:
    if not torch.cuda.is_available():
        return None
    try:
        from qsync_opt.cuda.kernels import load  # lazy: the optional CUDA build

        return load()
    except Exception as exc:  # a missing or broken build: the references serve
        log.warning("qsync CUDA kernels unavailable (%s); using the Python references", exc)
        return None


def use_cpp(t: Tensor) -> bool:
    return t.device.type == "cpu" and load_cpu()[0]


def available() -> dict[str, str]:
    """Which implementation serves each device, and why where it is a fallback."""
    cpp, why = load_cpu()
    out = {"cpu": f"C++ kernels ({why})" if cpp else f"Python references ({why})"}
    if not torch.cuda.is_available():
        out["cuda"] = "no CUDA device in this torch"
    else:
        kernels = cuda_kernels()
        if kernels is not None:
            out["cuda"] = "CUDA kernels (qsync_opt.cuda, ctypes)"
        else:
            try:
                from qsync_opt.cuda.kernels import load_error  # lazy: the optional CUDA build

                reason = load_error() or "not loaded"
            except Exception as exc:
                reason = str(exc)
            out["cuda"] = f"Python references ({reason})"
    out["int_mm"] = "torch._int_mm (int8 x int8 -> int32)"
    return out


def default_bwd_dtype(device: torch.device) -> torch.dtype:
    """16-bit dtype of int8 ops' backward: bf16 on this CPU, fp16 on CUDA."""
    return torch.float16 if device.type == "cuda" else torch.bfloat16


def check_float(name: str, t: Tensor) -> None:
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name}: expected float32, float16 or bfloat16, got {t.dtype}")


# ----------------------------------------------------------------------------- aliasing


def shares_memory(a: Tensor, b: Tensor) -> bool:
    if a.device != b.device:
        return False
    sa, sb = a.untyped_storage(), b.untyped_storage()
    return sa.nbytes() > 0 and sb.nbytes() > 0 and sa.data_ptr() == sb.data_ptr()


def owned(outputs: Any, inputs: Sequence[Any]) -> Any:
    """The outputs of a custom op as tensors that own their memory: none is a view, none
    shares memory with an input or with another output.

    Every ``qsync::`` op returns through this. A view (``reshape`` of a GEMM result,
    ``permute().contiguous()``, which is a no-op on a 1x1 map, ``movedim`` over a size-1
    axis) would reach autograd as a view created inside a custom Function, and an in-place
    op on it (``ReLU(inplace=True)``) raises; an output aliasing an input (``x.to(x.dtype)``)
    breaks the op's schema. A view that spans its whole buffer is re-wrapped without a copy
    (nothing else holds that buffer); one aliasing an input or another output, or covering
    only part of its buffer, is copied.
    """
    single = isinstance(outputs, Tensor)
    outs = [outputs] if single else list(outputs)
    seen = [t for t in inputs if isinstance(t, Tensor)]
    for i, t in enumerate(outs):
        if not isinstance(t, Tensor):
            continue
        if any(shares_memory(t, o) for o in seen):
            t = t.clone(memory_format=torch.contiguous_format)
        elif t._is_view():
            storage = t.untyped_storage()
            if t.storage_offset() == 0 and storage.nbytes() == t.numel() * t.element_size() \
                    and t.is_contiguous():
                t = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                    storage, 0, t.shape, torch.empty(t.shape, device="meta").stride())
            else:
                t = t.clone(memory_format=torch.contiguous_format)
        outs[i] = t
        seen.append(t)
    return outs[0] if single else tuple(outs)
