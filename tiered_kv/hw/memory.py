"""Tier slabs: check that a slab fits before allocating it, then allocate it.

A slab too large for its memory must fail at start with a ConfigError naming the capacity key,
not inside torch's allocator mid-way, and never by the Linux OOM killer: with overcommit,
`torch.zeros` of more than the free RAM may be granted and the process killed while it zero-fills
the pages. So the bytes asked are compared first with what is available:
  host RAM (cpu slabs, pinned or not): MemAvailable from /proc/meminfo, lowered to the room left
      under a cgroup memory limit when one is set;
  a CUDA device: `torch.cuda.mem_get_info` (free) plus what torch's caching allocator holds but
      does not use.
An allocation that still fails (RuntimeError, MemoryError) becomes the same ConfigError.
"""

from __future__ import annotations

import math

import torch

from ..errors import ConfigError

_MEMINFO_PATH = "/proc/meminfo"
_CGROUP_LIMITS = (  # (limit file, usage file): cgroup v2, then v1
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (no limit) reads as None


def host_available_bytes() -> tuple[int | None, str]:
    """Bytes of host RAM a new allocation may take without swapping or being killed, and where
    that number came from; (None, reason) when this system does not say."""
    available, source = None, "unknown"
    try:
        with open(_MEMINFO_PATH, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available, source = int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
                    break
    except (OSError, ValueError, IndexError):
        pass
    for limit_path, usage_path in _CGROUP_LIMITS:
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None and limit < 2**60:
            room = max(0, limit - usage)
            if available is None or room < available:
                available, source = room, f"room under the cgroup limit {limit_path}"
            break
    return available, source


def device_available_bytes(device: torch.device) -> tuple[int | None, str]:
    """Bytes a new allocation on `device` may take, and where that number came from."""
    if device.type == "cpu":
        return host_available_bytes()
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        cached_bytes = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free_bytes + max(0, cached_bytes), "torch.cuda.mem_get_info (free) + torch's unused cache"
    return None, f"no free-memory query for device type {device.type!r}"


def check_fits(key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
               pin_memory: bool = False) -> None:
    """ConfigError naming `key` (e.g. 'hot.capacity'), the bytes asked and the bytes available
    when a slab of `shape` does not fit where it would live. Pinned slabs live in host RAM."""
    device = torch.device(device)
    slab_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    memory_name = "host RAM" if device.type == "cpu" or pin_memory else str(device)
    if slab_bytes:
        available_bytes, source = host_available_bytes() if pin_memory else device_available_bytes(device)
        if available_bytes is not None and slab_bytes > available_bytes:
            raise ConfigError(
                f"config key {key!r}: a slab of {slab_bytes} bytes does not fit in {memory_name}, which has "
                f"{available_bytes} bytes available ({source}); allowed: a capacity of at most the available "
                f"memory, less what the rest of the process needs"
            )


def allocate_slab(key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                  pin_memory: bool = False) -> torch.Tensor:
    """A zero-filled slab of `shape`, or ConfigError naming `key` (see check_fits)."""
    device = torch.device(device)
    check_fits(key, shape, dtype, device, pin_memory)
    slab_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    memory_name = "host RAM" if device.type == "cpu" or pin_memory else str(device)
    try:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    except (RuntimeError, MemoryError) as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"config key {key!r}: allocating a slab of {slab_bytes} bytes in {memory_name} failed ({first_line}); "
            "allowed: a capacity the memory there can hold"
        ) from None
