"""The cold tier's per-read work is proportional to the slots read, never to its capacity.

A 100 GiB cold tier has millions of slots; its per-slot arrays (`valid`, `checksums`, `_durable`,
`_generation`, `_header_live`) are sized by capacity. Each operation is run on two tiers that differ
only in capacity, with those arrays replaced by views that count every element an operation
materializes (tolist, iteration, fancy or scalar indexing, assignment, ufuncs and numpy functions);
the counts must be equal, and small. No timing: the work is counted.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from tiered_kv import CorruptBlockError
from tiered_kv.blocks import KVLayout
from tiered_kv.tiers import ColdTier
from tiered_kv.tiers.cold_files import open_cold_directory
from tiered_kv.tiers.compressed import CompressedColdTier

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype_name="float32")
SMALL, LARGE = 16, 4096  # slots; LARGE's file is preallocated (4 KiB records: 16 MiB)
KEY, ROOT = b"k" * 16, bytes.fromhex("a1" * 16)
PER_SLOT = ("valid", "checksums", "_durable", "_generation", "_header_live")


class _Counter:
    def __init__(self):
        self.lock = threading.Lock()
        self.elements = 0
        self.on = False

    def add(self, n: int) -> None:
        if self.on:
            with self.lock:
                self.elements += int(n)


class CountingArray(np.ndarray):
    """A view of a tier's per-slot array that counts the elements each access materializes
    (basic slicing makes a view: free; what is then read of the view is counted)."""

    counter: _Counter | None = None

    def __array_finalize__(self, obj):
        if self.counter is None:
            self.counter = getattr(obj, "counter", None)

    def _count(self, n) -> None:
        if self.counter is not None:
            self.counter.add(n)

    def __getitem__(self, key):
        result = super().__getitem__(key)
        if not isinstance(result, np.ndarray):
            self._count(1)  # a scalar
        elif not np.may_share_memory(result.view(np.ndarray), self.view(np.ndarray)):
            self._count(result.size)  # fancy or boolean indexing: a copy
        return result

    def __setitem__(self, key, value):
        target = np.ndarray.__getitem__(self, key)
        self._count(np.size(target))
        super().__setitem__(key, value)

    def __iter__(self):
        self._count(self.size)
        return super().__iter__()

    def tolist(self):
        self._count(self.size)
        return super().tolist()

    def copy(self, *args, **kwargs):
        self._count(self.size)
        return super().copy(*args, **kwargs)

    def astype(self, *args, **kwargs):
        self._count(self.size)
        return super().astype(*args, **kwargs)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        for x in inputs:
            if isinstance(x, CountingArray):
                self._count(x.size)
        plain = [x.view(np.ndarray) if isinstance(x, CountingArray) else x for x in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(x.view(np.ndarray) if isinstance(x, CountingArray) else x for x in kwargs["out"])
        return getattr(ufunc, method)(*plain, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        for x in list(args) + list(kwargs.values()):
            if isinstance(x, CountingArray):
                self._count(x.size)
        return super().__array_function__(func, types, args, kwargs)


def _counting(tier) -> _Counter:
    counter = _Counter()
    for name in PER_SLOT:
        view = getattr(tier, name).view(CountingArray)
        view.counter = counter
        setattr(tier, name, view)
    return counter


def _blocks(n: int, seed: int) -> torch.Tensor:
    return torch.randn((n, *LAYOUT.record_shape()), generator=torch.Generator().manual_seed(seed))


def _make(kind: str, num_slots: int, path):
    directory = open_cold_directory(str(path))
    if kind == "cold":
        tier = ColdTier(LAYOUT, num_slots, directory, backend="posix", fsync=False)
    else:
        tier = CompressedColdTier(LAYOUT.stored("int8"), num_slots, directory, backend="posix", fsync=False)
    # the same history in both: blocks at slots 0..5 (3 and 4 durable), slot 7 with layer 0 only
    tier.write_blocks(list(range(6)), _blocks(6, seed=1))
    tier.persist(3, KEY, ROOT)
    tier.persist(4, b"j" * 16, ROOT)
    tier.write_tokens(0, tier.token_index([7] * 4, [0, 1, 2, 3]),
                      torch.randn(2, LAYOUT.num_kv_heads, 4, LAYOUT.head_dim))
    tier.flush()
    return directory, tier


def _read_whole_blocks_of_tokens(tier):
    out = torch.empty(2, LAYOUT.num_kv_heads, 12, LAYOUT.head_dim)
    tier.read_tokens_into(1, tier.token_index([1] * 4 + [2] * 4 + [3] * 4, list(range(4)) * 3), out)


OPERATIONS = {
    # one layer's tokens: whole blocks in order, a partial block, scattered tokens
    "read_tokens_into whole blocks": _read_whole_blocks_of_tokens,
    "read_tokens partial": lambda t: t.read_tokens(2, t.token_index([4, 4], [1, 2])),
    "read_tokens scattered": lambda t: t.read_tokens(0, t.token_index([5, 0, 5, 7], [3, 1, 0, 2])),
    "read_blocks": lambda t: t.read_blocks([2, 3, 4, 0]),
    "verify": lambda t: t.verify([0, 3, 7]),
    "write_tokens": lambda t: t.write_tokens(
        1, t.token_index([1, 1], [2, 3]), torch.randn(2, LAYOUT.num_kv_heads, 2, LAYOUT.head_dim)),
    "write_blocks": lambda t: t.write_blocks([4, 8], _blocks(2, seed=2)),  # 4 was durable
    "persist": lambda t: t.persist(2, b"p" * 16, ROOT),
    "forget": lambda t: t.forget([3, 5]),
}


def _work(kind, operation, num_slots, path) -> int:
    directory, tier = _make(kind, num_slots, path)
    try:
        counter = _counting(tier)
        counter.on = True
        OPERATIONS[operation](tier)
        tier.flush()  # the writer thread's share of the operation counts too
        counter.on = False
        return counter.elements
    finally:
        tier.close()
        directory.close()


@pytest.mark.parametrize("operation", list(OPERATIONS))
@pytest.mark.parametrize("kind", ["cold", "compressed cold"])
def test_a_cold_operation_touches_per_slot_state_of_the_slots_it_uses_not_of_the_capacity(kind, operation, tmp_path):
    small = _work(kind, operation, SMALL, tmp_path / "small")
    large = _work(kind, operation, LARGE, tmp_path / "large")
    assert large == small, (f"{kind} {operation}: {large} per-slot elements touched with {LARGE} slots, "
                            f"{small} with {SMALL}: work grows with the tier's capacity")
    assert small <= 64 * LAYOUT.num_layers, f"{kind} {operation}: {small} elements for a handful of slots"


@pytest.mark.parametrize("kind", ["cold", "compressed cold"])
def test_a_read_of_a_large_tier_still_checks_each_slice_it_reads(kind, tmp_path):
    """Validity and checksum of every layer slice read: an unwritten or corrupt one raises
    CorruptBlockError naming its slot, never served."""
    directory, tier = _make(kind, LARGE, tmp_path / "cold")
    try:
        with pytest.raises(CorruptBlockError) as info:  # slot 7: layer 0 written, layer 1 never
            tier.read_tokens(1, tier.token_index([2, 7], [0, 1]))
        assert info.value.slot == 7
        tier.read_tokens(0, tier.token_index([2, 7], [0, 1]))  # layer 0 of slot 7 was written
        with pytest.raises(CorruptBlockError) as info:  # never written at all
            tier.read_tokens(0, tier.token_index([LARGE - 1], [0]))
        assert info.value.slot == LARGE - 1
        offset = 5 * tier.record_stride_bytes + 2 * tier.layout.layer_bytes + 3  # slot 5, layer 2
        with open(tier.file_path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x01]))
        tier.read_tokens(1, tier.token_index([5], [0]))  # its other layers still serve
        for index in (tier.token_index([5] * 4, [0, 1, 2, 3]), tier.token_index([4, 5], [3, 0])):
            with pytest.raises(CorruptBlockError) as info:
                tier.read_tokens(2, index)
            assert info.value.slot == 5
    finally:
        tier.close()
        directory.close()
