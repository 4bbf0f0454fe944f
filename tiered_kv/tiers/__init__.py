"""The three tiers. Each offers the same small batch interface over integer slots:

    num_slots                      capacity in blocks (preallocated at start)
    read_blocks(slots)   -> T[n, L, 2, H, bs, D]   whole blocks, for moves between tiers
    write_blocks(slots, data)
    token_index(slots, offsets)    an opaque index of token positions, built once per step
    read_tokens(layer, index)  -> T[2, H, t, D]    one layer's K/V of those tokens
    write_tokens(layer, index, kv)                 kv: T[2, H, t, D]
    flush(), close()

Hot (and, on a CPU store, warm) slabs are paged (paged.py): a run of consecutive slots is one
token range per layer, read as a view. Tiers never call up into the store; the store owns placement.
"""

from .cold import ColdTier
from .hot import HotTier
from .warm import PagedWarmTier, WarmTier

__all__ = ["HotTier", "WarmTier", "PagedWarmTier", "ColdTier"]
