"""Which compute device and host memory kind to use, decided once at start. What "auto" fell
back to is logged once per process at INFO (a CPU-only machine is normal)."""

from __future__ import annotations

import logging
import re

import torch

from ..errors import ConfigError
from ..logs import log_once

log = logging.getLogger(__name__)
_CUDA_RE = re.compile(r"^cuda(:\d+)?$")


def cuda_available() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception as exc:  # a broken driver must not break the CPU path
        log_once(log, logging.WARNING, "torch.cuda.is_available() failed (%s: %s); running as if there were no "
                 "CUDA device", type(exc).__name__, exc)
        return False


def resolve_device(spec: str) -> torch.device:
    """'auto' -> cuda when present else cpu; 'cuda[:N]' must exist."""
    if spec == "auto":
        if cuda_available():
            return torch.device("cuda", torch.cuda.current_device())
        log_once(log, logging.INFO, "no CUDA device (hot.device: auto): hot tier and compute on cpu")
        return torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if _CUDA_RE.match(spec):
        if not cuda_available():
            raise ConfigError(f"config key 'hot.device': got {spec!r} but no CUDA device is available; allowed here: 'auto', 'cpu'")
        device = torch.device(spec)
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"config key 'hot.device': got {spec!r}; allowed: cuda:0..cuda:{torch.cuda.device_count() - 1}"
            )
        return torch.device("cuda", index)
    raise ConfigError(f"config key 'hot.device': got {spec!r}; allowed: 'auto', 'cpu', 'cuda' or 'cuda:N'")


def resolve_pinned(spec: str, device: torch.device) -> bool:
    """Page-locked host memory only helps (and only works) with a CUDA device."""
    if spec == "auto":
        if device.type != "cuda":
            log_once(log, logging.INFO, "warm tier in pageable host memory (warm.pinned: auto page-locks it only "
                     "for a CUDA hot device; the hot device is %s)", device.type)
        return device.type == "cuda"
    if spec == "true":
        if device.type != "cuda":
            raise ConfigError("config key 'warm.pinned': got 'true' but the hot device is cpu; allowed here: 'auto', 'false'")
        return True
    return False
