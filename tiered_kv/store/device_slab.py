"""What the compute device addresses directly: the views a prepared step (bank/plan.py) reads
and writes through, made once when the store binds, never per step.

- `DeviceSlab`: the paged tiers on the compute device that share one slab (hot; on a CPU store
  warm too: building.py puts both on one token axis). A block at (tier, slot) holds tokens
  `(first_slot[tier] + slot) * block_size ...` of every layer's view, so one index tensor
  addresses a row's tokens in all of them, and one gather per layer reads them.
- `kernel_sources`: per layer, the `(K, V)` block views of each tier the native paged decode
  kernel reads in place (hot, then warm when it is page-locked on CUDA or paged on CPU), in
  tag order: a tier's position is its tag in the kernel's block table.
"""

from __future__ import annotations

import numpy as np
import torch

from ..blocks import HOT, NUM_TIERS, WARM


class DeviceSlab:
    def __init__(self, tiers: list, device: torch.device, block_size: int):
        hot = tiers[HOT]
        self.device = torch.device(device)
        self.block_size = block_size
        whole = hot.whole_slab
        self.first_slot = np.full(NUM_TIERS + 1, -1, dtype=np.int64)  # (DROPPED, -1, indexes the last entry)
        for tier in (HOT, WARM):
            part = tiers[tier]
            if getattr(part, "whole_slab", None) is whole and part.num_slots:
                self.first_slot[tier] = part.first_slot
        num_layers, _, heads, num_tokens, dim = whole.shape
        self.whole = whole  # [L, 2, H, S, D]: the one tensor a compiled step's graph takes (bank/plan.py)
        self.num_tokens = num_tokens
        self.flat = whole.view(num_layers * 2, heads, num_tokens, dim)  # layer l's K at 2l, V at 2l + 1
        # (views made one by one, not by unbind: a view of a multi-view op may not be written in place)
        self.layers_kv = tuple(whole[layer] for layer in range(num_layers))  # [2, H, S, D]: what a token gather reads
        # [2, H, slots, block_size * D] per layer: what a block gather reads (a block's tokens of one
        # head are contiguous: whole blocks copy at memcpy speed)
        self.num_slots = num_tokens // block_size
        self.layers_blocks = tuple(kv.view(2, heads, self.num_slots, block_size * dim) for kv in self.layers_kv)
        # the same as rows, [2 * H * slots, block_size * D] and [2 * H * S, D] (K's heads, then V's): one
        # row's gather is an index_select along dim 0, about twice as fast on a CPU as along the slots' axis
        self.layers_block_rows = tuple(b.view(-1, block_size * dim) for b in self.layers_blocks)
        self.layers_token_rows = tuple(kv.view(-1, dim) for kv in self.layers_kv)
        self.layers_k = tuple(kv[0] for kv in self.layers_kv)  # [H, S, D]: what index_put_ writes
        self.layers_v = tuple(kv[1] for kv in self.layers_kv)
        self.layers_k1 = tuple(k.unsqueeze(0) for k in self.layers_k)  # [1, H, S, D]: what index_copy_ writes
        self.layers_v1 = tuple(v.unsqueeze(0) for v in self.layers_v)
        self.kernel_sources = _kernel_sources(tiers, self.device, num_layers)

    def block_positions(self, tiers: np.ndarray, slots: np.ndarray, num_tokens: int) -> np.ndarray | None:
        """The slab slots of the blocks holding a row's first `num_tokens` tokens (blocks at
        `tiers`/`slots`), or None when one of them is not on this slab."""
        num_blocks = -(-num_tokens // self.block_size)
        firsts = self.first_slot[tiers[:num_blocks]]
        if len(firsts) < num_blocks or (firsts < 0).any():
            return None
        return firsts + slots[:num_blocks]

    def token_positions(self, blocks: np.ndarray, start: int, end: int) -> np.ndarray:
        """The positions on the slab's token axis of tokens [start, end) of a row whose blocks are
        at slab slots `blocks`."""
        bs = self.block_size
        first, last = start // bs, -(-end // bs)
        positions = (blocks[first:last, None] * bs + np.arange(bs, dtype=np.int64)).reshape(-1)
        return positions[start - first * bs:end - first * bs]


def _kernel_sources(tiers: list, device: torch.device, num_layers: int) -> tuple:
    sources = []
    for layer in range(num_layers):
        views = []
        for tier in tiers[:2]:
            view = tier.kernel_view(layer, device) if tier is not None else None
            if view is None:
                break
            views.append(view)
        sources.append(tuple(views))
    return tuple(sources)


def is_run(positions: np.ndarray) -> bool:
    """Whether `positions` are consecutive and increasing (one slice of the token axis)."""
    return len(positions) > 0 and int(positions[-1]) - int(positions[0]) == len(positions) - 1 and \
        (len(positions) == 1 or bool((np.diff(positions) == 1).all()))


__all__ = ["DeviceSlab", "is_run"]
