"""Blocks still being filled in a compressed tier ("open"), kept at full precision (compressed.py).

A compressed tier stores a block's layer slice as packed bytes whose key scales run per channel over
the block's tokens. Re-encoding a block from its own decoded bytes at every token write would
quantize its earlier tokens again and again (the error grows, and the bytes of a block written token
by token would differ from the same block written at once), and a reused slot's old bytes would
enter the new block's scales. So a tier keeps each block being filled here, in the model's dtype,
with which of its tokens are present, per layer:

- `write` puts a block's new tokens into its open copy and returns the slice the tier stores at once:
  the present tokens as written, each absent one a copy of a present one, so absent tokens never move
  a key channel's minimum or maximum: the stored bytes depend on the present tokens only, and moves
  (to cold, remote, durable records) read correctly encoded bytes at every moment.
- A write that starts at a block's first token starts the block: nothing of the slot's earlier bytes
  is kept. A write further in, to a layer the open copy does not hold yet (a block moved in whole, or
  one evicted from here), loads that layer's stored bytes first, decoded once (`load`).
- A layer is full once every token is present and its last token was written; once all layers are,
  the block closes: its bytes are exactly encode(block), what one whole write stores, and its copy goes.
- Token reads of an open layer take its present tokens from here, at full precision (`snapshot`, then
  `apply` after the packed bytes were decoded into the output).
- At most `max_open` blocks are open (those being written now: a chat's tail block each); beyond it
  the least recently written goes (its bytes are stored already). Writing a slot whole, or freeing
  it (`drop`), drops its copy.

Also here: where a token write or read of a compressed tier falls in its blocks (`block_writes`,
`warm_tokens`, `group_tokens`, `cold_span_start`), and `TokenWrite`, a cold write's values.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import torch

MAX_OPEN_BLOCKS = 64  # open blocks per tier: full-precision copies of blocks being written now


class _Open:
    """One open block: `data` `[L, 2, H, bs, D]`; per layer whether the copy holds it (`loaded`),
    which tokens are present, and whether its last token was written (`last`)."""

    __slots__ = ("data", "loaded", "present", "last")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        self.data = torch.empty(shape, dtype=dtype)
        self.loaded = np.zeros(shape[0], dtype=bool)
        self.present = np.zeros((shape[0], shape[3]), dtype=bool)
        self.last = np.zeros(shape[0], dtype=bool)

    def full(self, layer: int) -> bool:
        return bool(self.last[layer]) and bool(self.present[layer].all())

    def closed(self) -> bool:
        return bool(self.last.all()) and bool(self.present.all())


def absent_filled(data: torch.Tensor, present: np.ndarray) -> torch.Tensor:
    """`data` `[2, H, bs, D]` with each absent token replaced by the nearest present one before it
    (else the first present one): the same per-channel minimum and maximum as the present tokens."""
    if present.all():
        return data
    have = np.where(present, np.arange(len(present)), -1)
    nearest = np.maximum.accumulate(have)
    nearest[nearest < 0] = int(np.argmax(present))
    return data[:, :, torch.from_numpy(nearest)]


class OpenBlocks:
    """The open blocks of one tier (see the module docstring). `lock` guards them; a tier holds it
    around `write` and storing what it returns, so a reader never sees a layer full before its bytes
    are stored."""

    def __init__(self, layout, dtype: torch.dtype, max_open: int = MAX_OPEN_BLOCKS):
        self.shape = (layout.num_layers, 2, layout.num_kv_heads, layout.block_size, layout.head_dim)
        self.dtype = dtype
        self.max_open = max(1, max_open)
        self.lock = threading.Lock()
        self._blocks: OrderedDict[int, _Open] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, slot: int) -> bool:
        return slot in self._blocks

    def open_among(self, slots: np.ndarray) -> np.ndarray:
        """Which of `slots` have an open block (a mask)."""
        if not self._blocks:
            return np.zeros(len(slots), dtype=bool)
        with self.lock:
            keys = np.fromiter(self._blocks, dtype=np.int64, count=len(self._blocks))
        return np.isin(slots, keys)

    def write(self, slot: int, layer: int, offsets: torch.Tensor, values: torch.Tensor, load) -> torch.Tensor:
        """Tokens `values` `[2, H, c, D]` at `offsets` of the block in `slot`, layer `layer` (under
        `lock`); returns its slice to store `[2, H, bs, D]`. `load()`: the layer's stored slice
        decoded, or None when the slot holds none."""
        bs = self.shape[3]
        values = values.to(self.dtype)
        starts = bool((offsets == 0).any())
        block = self._blocks.get(slot)
        if block is None:
            if starts and len(offsets) == bs and torch.equal(offsets.sort().values, torch.arange(bs)):
                whole = torch.empty(self.shape[1:], dtype=self.dtype)  # a whole block: nothing to keep open
                whole[:, :, offsets] = values
                return whole
            if len(self._blocks) >= self.max_open:
                self._blocks.popitem(last=False)  # the least recently written: its bytes are stored
            block = self._blocks[slot] = _Open(self.shape, self.dtype)
        else:
            self._blocks.move_to_end(slot)
        if starts:  # the block starts here: nothing before it in the slot is kept
            block.present[layer] = False
            block.last[layer] = False
        elif not block.loaded[layer]:
            before = load()
            if before is not None:
                block.data[layer].copy_(before)
                block.present[layer] = True
        block.loaded[layer] = True
        data = block.data[layer]
        data[:, :, offsets] = values
        block.present[layer, offsets.numpy()] = True
        block.last[layer] |= bool((offsets == bs - 1).any())
        piece = absent_filled(data, block.present[layer])
        if block.closed():
            del self._blocks[slot]
        return piece

    def snapshot(self, layer: int, slots: np.ndarray) -> list[tuple[int, torch.Tensor, np.ndarray]]:
        """`(slot, [2, H, bs, D] copy, present mask)` of each open layer among `slots`: taken before
        the packed bytes are read, so a block that closes meanwhile still reads right."""
        if not self._blocks:
            return []
        with self.lock:
            layer_open = [(slot, block) for slot, block in self._blocks.items()
                          if block.loaded[layer] and not block.full(layer)]
            if not layer_open:
                return []
            wanted = np.isin(np.array([slot for slot, _ in layer_open], dtype=np.int64), slots)
            return [(slot, block.data[layer].clone(), block.present[layer].copy())
                    for (slot, block), want in zip(layer_open, wanted) if want]

    @staticmethod
    def apply(out: torch.Tensor, patches, locate) -> None:
        """The snapshot's present tokens into `out` `[2, H, n, D]`; `locate(slot)`: (positions in
        `out`, offsets in the block) of its tokens there, as int64 arrays."""
        for slot, data, present in patches:
            positions, offsets = locate(slot)
            keep = present[offsets]
            if keep.any():
                at = torch.from_numpy(np.ascontiguousarray(positions[keep])).to(out.device)
                out[:, :, at] = data[:, :, torch.from_numpy(np.ascontiguousarray(offsets[keep]))].to(out.device,
                                                                                                       out.dtype)

    def drop(self, slots) -> None:
        """The slots were written whole or freed: their open blocks go."""
        if not self._blocks:
            return
        with self.lock:
            for slot in slots:
                self._blocks.pop(int(slot), None)

    def clear(self) -> None:
        with self.lock:
            self._blocks.clear()


def block_writes(index, values: torch.Tensor, bs: int, is_open) -> tuple[list[int], torch.Tensor | None, list]:
    """A compressed warm tier's token write split into whole blocks with no open block (their slots
    and values `[n, 2, H, bs, D]`, encoded at once) and the rest: `(slot, offsets, values)` per block."""
    parts = []
    if index[0] == "blocks":
        block_slots, first, count = index[1].numpy(), index[2], index[3]
        lo = -(-first // bs)  # the whole blocks inside the span: [lo, hi)
        hi = max(lo, (first + count) // bs)
        for b in sorted({0, len(block_slots) - 1} - set(range(lo, hi))):
            p0, p1 = max(first, b * bs), min(first + count, (b + 1) * bs)
            if p0 < p1:
                parts.append((int(block_slots[b]), torch.arange(p0 - b * bs, p1 - b * bs),
                              values[:, :, p0 - first:p1 - first]))
        whole = values[:, :, lo * bs - first:hi * bs - first].unflatten(2, (hi - lo, bs)).permute(2, 0, 1, 3, 4)
        opened = is_open(block_slots[lo:hi])
        for i in np.flatnonzero(opened):
            parts.append((int(block_slots[lo + i]), torch.arange(bs), whole[i]))
        keep = np.flatnonzero(~opened)
        return block_slots[lo:hi][keep].tolist(), whole[torch.from_numpy(keep)] if len(keep) else None, parts
    slots, offsets = index[1], index[2]
    for slot in torch.unique(slots).tolist():
        positions = torch.nonzero(slots == slot).flatten()
        parts.append((slot, offsets[positions], values[:, :, positions]))
    return [], None, parts


def warm_tokens(index, slot: int, bs: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions in the request, offsets in the block) of the tokens a warm token_index reads in `slot`."""
    if index[0] == "blocks":
        block_slots, first, count = index[1].numpy(), index[2], index[3]
        spans = [np.arange(max(first, b * bs), min(first + count, (b + 1) * bs))
                 for b in np.flatnonzero(block_slots == slot)]
        tokens = np.concatenate(spans) if spans else np.zeros(0, dtype=np.int64)
        return tokens - first, tokens % bs
    positions = np.flatnonzero(index[1].numpy() == slot)
    return positions, index[2].numpy()[positions]


def group_tokens(items) -> tuple[np.ndarray, np.ndarray]:
    """(positions in the request, offsets in the block) of one block's group of a cold token_index:
    `(first position, first offset, count)` or a list of `(position, offset)`."""
    if isinstance(items, tuple):
        position, offset, count = items
        return np.arange(position, position + count), np.arange(offset, offset + count)
    pairs = np.asarray(items, dtype=np.int64).reshape(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def cold_span_start(entries: list, block_size: int, num_tokens: int) -> int | None:
    """The offset in its first block where a cold token index's tokens start, when they run through
    its blocks in order (each block from where the last ended, every block but the first and last
    whole, all `num_tokens` of them); else None."""
    position = 0
    for i, (_, items) in enumerate(entries):
        if not isinstance(items, tuple):
            return None
        at, offset, count = items
        last = i == len(entries) - 1
        if at != position or (i and offset) or (not last and offset + count != block_size):
            return None
        position += count
    return entries[0][1][1] if entries and position == num_tokens else None


class TokenWrite:
    """A cold token write as CompressedColdTier._put_tokens takes it (through ColdTier.write_tokens):
    the layer, the values `[2, H, t, D]` in the model's dtype, and the slot of each block's first position."""

    __slots__ = ("layer", "values", "slot_at")

    def __init__(self, layer: int, values: torch.Tensor, slot_at: dict[int, int]):
        self.layer, self.values, self.slot_at = layer, values, slot_at
