"""Which layers of a model share blocks: the attention layout, as layer groups. Ids only, no torch.

transformers names each decoder layer's attention kind (`config.layer_types`, or inferred as
DynamicCache does: `get_layer_types_and_kwargs`). A bank serves two kinds:

- `full_attention`: every token stays (DynamicLayer);
- `sliding_attention` (and Llama 4's `chunked_attention`, which transformers caches the same way
  and masks differently): a layer of window `w` reads at most the last `w - 1` stored tokens
  (DynamicSlidingWindowLayer), so older ones are released, never moved down the tiers.

Layers of one kind (and window) are split into groups of `layers_per_group` layers, the same
size for every kind, so one block of the store — `block_size` tokens of `layers_per_group`
layers — fits every group and the store stays one slab per tier (vLLM's hybrid KV groups do the
same). A full-attention model is one group of all its layers: exactly the layout of before.
Each group is a sequence of its own in the store (its own block table per batch row, its own
chain keys: `key_tag` goes into the key root), so a sliding group frees the blocks that left
its window while a full group keeps them.

Any other kind (linear attention / Mamba state, KV-sharing "dummy" layers, ...) is refused with
a LayoutError naming the model type and the layer type, before anything is allocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import LayoutError

FULL, SLIDING = "full_attention", "sliding_attention"
_WINDOWED = ("sliding_attention", "chunked_attention")
SERVED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
MAX_GROUPS = 16  # above this many equal groups, groups take the smallest kind's size (the last ones padded)


@dataclass(frozen=True)
class LayerGroup:
    """Layers whose K/V share one block table per row. `window` is None for full attention."""

    index: int
    layer_type: str  # "full_attention" | "sliding_attention" | "chunked_attention"
    window: int | None
    layers: tuple[int, ...]  # model layer indices, in order; block layer j holds layers[j]

    @property
    def is_sliding(self) -> bool:
        return self.window is not None

    def kept_tokens(self, num_tokens: int) -> int:
        """Stored tokens a layer of this group reads with the next tokens (DynamicSlidingWindowLayer)."""
        return num_tokens if self.window is None else min(num_tokens, self.window - 1)

    def window_start_block(self, num_tokens: int, block_size: int) -> int:
        """The first block holding a token that the step after `num_tokens` tokens reads."""
        if self.window is None:
            return 0
        return max(0, (num_tokens - (self.window - 1)) // block_size)

    def first_needed_block(self, num_tokens: int, block_size: int) -> int:
        """The first block a row of `num_tokens` tokens keeps: for a sliding group its window's
        first, and one more before it, so that a later attach resuming at the last full block's
        boundary (at most a block earlier) still finds that point's window."""
        return max(0, self.window_start_block(num_tokens, block_size) - 1)

    @property
    def key_tag(self) -> bytes:
        return f"group={self.layer_type}|window={self.window}|layers={','.join(map(str, self.layers))}".encode()


@dataclass(frozen=True)
class LayerGroups:
    groups: tuple[LayerGroup, ...]
    layers_per_group: int
    num_layers: int
    group_of_layer: tuple[int, ...]  # model layer -> group index
    local_of_layer: tuple[int, ...]  # model layer -> its layer within the group's blocks
    layer_types: tuple[str, ...]  # per model layer

    @property
    def is_single_full(self) -> bool:
        """One full-attention group of every layer: the plain layout (keys as before groups existed)."""
        return len(self.groups) == 1 and not self.groups[0].is_sliding

    @property
    def any_sliding(self) -> bool:
        return any(g.is_sliding for g in self.groups)

    def blocks_held(self, num_tokens: int, num_tokens_before: int | None, block_size: int) -> int:
        """Blocks one sequence holds in all groups during a step from `num_tokens_before` to
        `num_tokens` tokens: a sliding group its window before the step and the new blocks it
        keeps (a long prefill's gap is not stored). None: a sequence at rest at `num_tokens`."""
        before = num_tokens if num_tokens_before is None else num_tokens_before
        held_before = -(-before // block_size)
        total = -(-num_tokens // block_size)
        return sum(held_before - g.first_needed_block(before, block_size)
                   + total - max(held_before, g.first_needed_block(num_tokens, block_size)) for g in self.groups)

    def __len__(self) -> int:
        return len(self.groups)


def _layer_kinds(text_config) -> tuple[list[str], list[int | None]]:
    """Per layer: its attention kind and window, as transformers' DynamicCache reads them."""
    num_layers = getattr(text_config, "num_hidden_layers", None)
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
        layer_types, kwargs = get_layer_types_and_kwargs(text_config)
        windows = [k.get("sliding_window") for k in kwargs]
    except (ImportError, AttributeError, TypeError):  # an older transformers, or a plain namespace config
        layer_types = getattr(text_config, "layer_types", None)
        window = getattr(text_config, "sliding_window", None)
        if layer_types is None:
            layer_types = [SLIDING if window is not None else FULL] * int(num_layers or 0)
        windows = [window if t in _WINDOWED else None for t in layer_types]
    layer_types, windows = list(layer_types), list(windows)
    if isinstance(num_layers, int) and len(layer_types) != num_layers:
        raise LayoutError(f"model config field 'layer_types' has {len(layer_types)} entries but "
                          f"num_hidden_layers={num_layers}; they must match")
    return layer_types, windows


def layer_groups_from_config(text_config, model_type: str | None = None) -> LayerGroups:
    """The bank's layer groups for a transformers (text) config; LayoutError for a layer kind the
    bank cannot serve, naming the model type and the layer type."""
    model_type = model_type or getattr(text_config, "model_type", None) or type(text_config).__name__
    layer_types, windows = _layer_kinds(text_config)
    if not layer_types:
        raise LayoutError(f"model type {model_type!r}: the config names no decoder layers (num_hidden_layers)")
    unserved = sorted({t for t in layer_types if t not in SERVED_LAYER_TYPES})
    if unserved:
        raise LayoutError(
            f"model type {model_type!r} has {unserved} layers; CacheBank serves only {list(SERVED_LAYER_TYPES)} "
            "(recurrent / linear-attention state and shared-KV layers hold no per-token KV blocks); nothing was allocated or patched")
    kinds: dict[tuple[str, int | None], list[int]] = {}
    for layer, (layer_type, window) in enumerate(zip(layer_types, windows)):
        if layer_type in _WINDOWED:
            if not isinstance(window, int) or isinstance(window, bool) or window < 1:
                raise LayoutError(f"model type {model_type!r}: layer {layer} is {layer_type!r} but its window "
                                  f"(sliding_window / attention_chunk_size) is {window!r}; allowed: an int >= 1")
        else:
            window = None
        kinds.setdefault((layer_type, window), []).append(layer)
    counts = [len(layers) for layers in kinds.values()]
    size = math.gcd(*counts)
    if sum(c // size for c in counts) > MAX_GROUPS:
        size = min(counts)
    groups, group_of, local_of = [], [0] * len(layer_types), [0] * len(layer_types)
    for (layer_type, window), layers in kinds.items():
        for start in range(0, len(layers), size):
            members = tuple(layers[start:start + size])
            for j, layer in enumerate(members):
                group_of[layer], local_of[layer] = len(groups), j
            groups.append(LayerGroup(len(groups), layer_type, window, members))
    return LayerGroups(tuple(groups), size, len(layer_types), tuple(group_of), tuple(local_of), tuple(layer_types))


__all__ = ["LayerGroup", "LayerGroups", "layer_groups_from_config", "SERVED_LAYER_TYPES", "FULL", "SLIDING"]
