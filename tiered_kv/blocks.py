"""Token <-> block arithmetic, the byte layout of one block, and the tier ids. The one place that knows them.

A block holds `block_size` consecutive tokens of one sequence, K and V, for the layers of one
layer group (layer_groups.py: all of a full-attention model's layers; for a hybrid model, an
equal share of one attention kind's). Its canonical (record) layout is
`[num_layers, 2, num_kv_heads, block_size, head_dim]` with `num_layers` the layers per block: one
layer's K and V are contiguous (`layer_bytes`), so a tier can read or write a single layer of a block.

Tiers are small integers, ordered from fast to slow, so "down" is a larger id. `DROPPED` is the one
id of "no tier": the destination of an eviction (the block's data is discarded) and the tier of a
block whose data failed its checksum (it keeps its id, holds no slot, and must be recomputed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .compression import check_shape as shape_problem, packed_layer_bytes
from .errors import LayoutError
from .layer_groups import LayerGroups, layer_groups_from_config

HOT, WARM, COLD = 0, 1, 2
NUM_TIERS = 3
TIER_NAMES = ("hot", "warm", "cold")
DROPPED = -1  # no tier: an eviction's destination, a corrupt block's tier

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens (ceil division)."""
    return -(-num_tokens // block_size)


def tier_counts(placements) -> dict[int, int]:
    """Blocks per tier over `(tiers, slots)` pairs of int arrays (a block in several counts once
    per pair; DROPPED ones are not counted)."""
    counts: dict[int, int] = {}
    for tiers, _ in placements:
        for tier, count in enumerate(np.bincount(tiers[tiers >= 0], minlength=NUM_TIERS).tolist()):
            if count:
                counts[tier] = counts.get(tier, 0) + count
    return counts


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV cache the store serves: fixed for the store's lifetime once bound."""

    num_layers: int  # layers per block (the model's layers per layer group)
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype_name: str  # "float32" | "float16" | "bfloat16" | "float64"
    # how a tier stores the block (compression.py): "none" is the model's dtype, the store's own
    # layout; a compressed tier's layout (`stored`) packs each layer slice into fewer bytes
    compression: str = "none"

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype_name]

    @property
    def is_compressed(self) -> bool:
        return self.compression != "none"

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's K and V inside one block, as this layout stores them."""
        if self.compression != "none":
            return packed_layer_bytes(self.num_kv_heads, self.block_size, self.head_dim, self.compression)
        return self.model_layer_bytes

    @property
    def model_layer_bytes(self) -> int:
        """Bytes of one layer's K and V of one block in the model's dtype (what hot holds)."""
        return 2 * self.num_kv_heads * self.block_size * self.head_dim * self.dtype_bytes

    def stored(self, compression: str) -> KVLayout:
        """This layout as a tier with `compression` stores it (LayoutError when it cannot)."""
        if compression == self.compression:
            return self
        problem = shape_problem(compression, self.head_dim) if compression != "none" else None
        if problem is not None:
            raise LayoutError(f"compression {compression!r} cannot store this model's KV: {problem}")
        return replace(self, compression=compression)

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_size

    def record_shape(self) -> tuple[int, int, int, int, int]:
        """A block in the model's dtype (also of a compressed layout: what its tier reads out)."""
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)


def layout_from_model_config(model_config, block_size: int, dtype_name: str = "float32") -> KVLayout:
    """Read layers / KV heads / head_dim from a transformers config; errors name the missing field.
    `num_layers` is the layers per block: per layer group (model_layer_groups), all of a
    full-attention model's layers."""
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config

    def field(name: str, fallback: str | None = None):
        value = getattr(text_config, name, None)
        if value is None and fallback is not None:
            value = getattr(text_config, fallback, None)
        return value

    num_layers = field("num_hidden_layers")
    num_heads = field("num_attention_heads")
    num_kv_heads = field("num_key_value_heads") or num_heads
    head_dim = field("head_dim")
    hidden_size = field("hidden_size")
    if head_dim is None and hidden_size and num_heads:
        head_dim = hidden_size // num_heads
    for name, value in (("num_hidden_layers", num_layers), ("num_key_value_heads", num_kv_heads), ("head_dim", head_dim)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise LayoutError(
                f"model config field '{name}' is {value!r}; CacheBank needs a positive int "
                f"(from num_hidden_layers, num_key_value_heads or num_attention_heads, head_dim or hidden_size/num_attention_heads)"
            )
    groups = model_layer_groups(model_config)
    if dtype_name not in _DTYPE_BYTES:
        raise LayoutError(f"KV dtype {dtype_name!r} is not supported; allowed: {sorted(_DTYPE_BYTES)}")
    return KVLayout(groups.layers_per_group, num_kv_heads, head_dim, block_size, dtype_name)


def model_layer_groups(model_config) -> LayerGroups:
    """The layer groups (layer_groups.py) of a transformers model config; LayoutError naming the
    model type and the layer type for an attention kind the bank cannot serve."""
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    model_type = getattr(model_config, "model_type", None) or getattr(text_config, "model_type", None)
    return layer_groups_from_config(text_config, model_type)
