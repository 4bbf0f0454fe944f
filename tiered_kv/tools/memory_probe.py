"""Measuring memory, not estimating it: what `tiered-kv diagnose` reads its figures from.

- `tensor_bytes(t)`: a tensor's own bytes (numel x element size); None counts 0.
- `process_rss()`: the process's resident set now and its high-water mark, from
  /proc/self/status (VmRSS, VmHWM). Process-wide: it includes Python, the loaded libraries,
  every tensor and whatever the allocators keep cached after a free.
- `reset_rss_peak()`: resets VmHWM to the current RSS (writes "5" to /proc/self/clear_refs,
  Linux >= 4.0), so the next VmHWM is the peak over what ran in between.
- `LiveTensorBytes`: a TorchDispatchMode that counts the bytes of tensor storages created
  while it is active and still alive, and the peak of that count. It sees every aten op of the
  thread it runs in (not other threads), and counts a storage once however many views share it;
  a storage an op writes into (in place, `out=`) was not created by that op and is not counted.
  Tensor objects made outside aten ops (torch.from_numpy, wrapping in a Parameter) are not
  seen: a storage only they keep alive is counted as freed. A forward makes none of note.
  On CPU, where torch keeps no allocator statistics, this is the measured size of a forward's
  activations.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_STATUS_PATH = "/proc/self/status"
_CLEAR_REFS_PATH = "/proc/self/clear_refs"
_RESET_PEAK_RSS = "5"  # clear_refs: reset the peak resident set size (VmHWM)


def tensor_bytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class RssReading:
    rss_bytes: int | None  # VmRSS: resident now
    peak_bytes: int | None  # VmHWM: highest resident since start or the last reset_rss_peak()


def process_rss() -> RssReading:
    """VmRSS and VmHWM of this process; None for a figure this system does not give."""
    figures: dict[str, int] = {}
    try:
        with open(_STATUS_PATH, encoding="ascii") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "VmHWM"):
                    figures[name] = int(value.split()[0]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    return RssReading(figures.get("VmRSS"), figures.get("VmHWM"))


def reset_rss_peak() -> bool:
    """Make VmHWM start again from the current RSS; False when the kernel does not allow it."""
    try:
        with open(_CLEAR_REFS_PATH, "w", encoding="ascii") as f:
            f.write(_RESET_PEAK_RSS)
        return True
    except OSError:
        return False


class LiveTensorBytes(TorchDispatchMode):
    """Counts live bytes of the storages created under it: `live_bytes` now, `peak_bytes` most.

    A created storage is tracked until the last tensor object seen for it dies (a weakref
    finalizer per tensor): views of it returned by later ops keep it counted, as they keep
    it allocated. Storages that existed before (weights, the KV slabs) are never counted, even
    when an op returns a view of them or writes into them."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, list[int]] = {}  # storage address -> [bytes, tensor objects alive]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = None
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            address, num_bytes = storage.data_ptr(), storage.nbytes()
            if num_bytes == 0:
                continue
            entry = self._live.get(address)
            if entry is None:
                if inputs is None:
                    inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                              if isinstance(t, torch.Tensor)}
                if address in inputs:
                    continue  # written in place or a view of an input: not made here
                entry = self._live[address] = [num_bytes, 0]
                self.live_bytes += num_bytes
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            entry[1] += 1
            weakref.finalize(tensor, self._tensor_died, address)
        return out

    def _tensor_died(self, address: int) -> None:
        entry = self._live.get(address)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[address]
            self.live_bytes -= entry[0]
