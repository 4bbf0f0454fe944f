"""Chooses, once per process, which implementation of the native ops runs: CUDA or torch.

The CUDA path needs torch to see a GPU, cupy to import, and every `.cu` file to compile;
otherwise the torch reference (same signatures, same contracts) runs and the reason is kept
in `fallback_reason` and logged once, at INFO (at WARNING when CUDA and cupy are there but
the native sources fail to compile). `TIERED_KV_KERNELS=torch` forces the reference.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from . import reference

log = logging.getLogger(__name__)
FORCE_ENV = "TIERED_KV_KERNELS"


@dataclass(frozen=True)
class KernelOps:
    """The native ops of one backend; `backend` is "cuda" or "torch"."""

    backend: str
    fallback_reason: str | None
    paged_decode: Callable
    merge_states: Callable
    gather_blocks: Callable
    scatter_blocks: Callable
    dequant_blocks: Callable
    quant_blocks: Callable


def torch_ops(reason: str | None) -> KernelOps:
    return KernelOps("torch", reason, reference.paged_decode, reference.merge_states,
                     reference.gather_blocks, reference.scatter_blocks, reference.dequant_blocks,
                     reference.quant_blocks)


def cuda_unavailable_reason() -> str | None:
    """None when the CUDA path can run here, else why not (first line of the error)."""
    if os.environ.get(FORCE_ENV, "").strip().lower() == "torch":
        return f"{FORCE_ENV}=torch"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # ImportError, or a cupy built for another CUDA failing at import
        return f"cupy does not import ({type(exc).__name__}: {_first_line(exc)})"
    from . import cuda

    try:
        cuda.compile_all()
    except Exception as exc:
        return f"native sources do not compile or load ({type(exc).__name__}: {_first_line(exc)})"
    return None


def choose_ops() -> KernelOps:
    reason = cuda_unavailable_reason()
    if reason is not None:
        # a CUDA device whose native sources fail to build is a broken install; the rest is a choice
        level = logging.WARNING if reason.startswith("native sources") else logging.INFO
        log.log(level, "kernels: torch reference ops (%s)", reason)
        return torch_ops(reason)
    from . import cuda

    log.info("kernels: CUDA ops (cupy RawModule, native/*.cu)")
    return KernelOps("cuda", None, cuda.paged_decode, cuda.merge_states, cuda.gather_blocks, cuda.scatter_blocks,
                     cuda.dequant_blocks, cuda.quant_blocks)


_chosen: KernelOps | None = None
_choose_lock = threading.Lock()


def get_ops() -> KernelOps:
    """The process's ops, chosen on first use and kept."""
    global _chosen
    if _chosen is None:
        with _choose_lock:
            if _chosen is None:
                _chosen = choose_ops()
    return _chosen


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
