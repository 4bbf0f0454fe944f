"""A bank's model bound to its store: the KV layout (heads, head_dim, dtype, device) every tier is
built for, checked against what a layer hands over, and whether a conversation fits at all. A bank
built from a model binds at once (`bind_model`): `compression: auto` is resolved on that model first
(compression/auto.py), since the tiers' layouts depend on it."""

from __future__ import annotations

import torch

from ..blocks import KVLayout
from ..errors import CapacityError, LayoutError

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64"}


def bind_kv(store, base: KVLayout, key_states: torch.Tensor) -> None:
    """Bind `store` to the layout of the K/V a layer hands over (LayoutError when it is not the
    model config's `base`, or not on the hot tier's device)."""
    _, num_heads, _, head_dim = key_states.shape
    if (num_heads, head_dim) != (base.num_kv_heads, base.head_dim):
        raise LayoutError(
            f"key_states have {num_heads} heads x {head_dim} dims but the model config says "
            f"num_key_value_heads={base.num_kv_heads}, head_dim={base.head_dim}")
    bind_dtype(store, base, key_states.dtype)
    if key_states.device != store.device:
        raise LayoutError(
            f"the model runs on {key_states.device} but the hot tier is on {store.device}; "
            f"set hot.device to '{key_states.device}' or move the model")


def bind_dtype(store, base: KVLayout, dtype: torch.dtype) -> None:
    """Bind `store` to the model's KV layout in `dtype` (a no-op once bound to the same)."""
    dtype_name = _DTYPE_NAMES.get(dtype)
    if dtype_name is None:
        raise LayoutError(f"KV dtype {dtype} is not supported; allowed: {list(_DTYPE_NAMES)}")
    layout = KVLayout(base.num_layers, base.num_kv_heads, base.head_dim, base.block_size, dtype_name)
    if store.layout != layout or store.dtype != dtype:  # (else bound already: every step after the first)
        store.bind(layout, dtype)


def bind_model(store, base: KVLayout, model, fingerprint, tokenizer=None, owns_store: bool = False) -> None:
    """Bind `store` to `model`'s KV layout, its compression settled on the model first (auto resolved,
    explicit lossy modes checked) unless it is bound already. A store the bank made is closed when
    that fails (ConfigError: auto without a tokenizer), so nothing of it is left behind."""
    dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype
    dtype_name = _DTYPE_NAMES.get(dtype)
    if not store.is_bound and dtype_name is not None:
        layout = KVLayout(base.num_layers, base.num_kv_heads, base.head_dim, base.block_size, dtype_name)
        root_hex = fingerprint.root_key(dtype_name).hex() if fingerprint.is_shareable else None
        try:
            store.compression.prepare(model, tokenizer, root_hex, layout)
        except BaseException:
            if owns_store:
                store.close()
            raise
    bind_dtype(store, base, dtype)


def check_fits(store, layer_groups, num_rows: int, num_tokens: int, num_tokens_before: int | None = None) -> None:
    """CapacityError when `num_rows` sequences of `num_tokens` cannot fit in all tiers at once.
    A sliding group holds its window once a step ended; during a step, its window before the
    step (`num_tokens_before`; None: what it keeps afterwards) and the new blocks it keeps."""
    if not store.is_bound:
        return
    block_size = store.config.block_size
    total_blocks = num_rows * layer_groups.blocks_held(num_tokens, num_tokens_before, block_size)
    if total_blocks > store.total_capacity_blocks:
        hot, warm, cold = store.capacities
        raise CapacityError(
            f"this conversation needs {total_blocks} blocks ({num_rows} x {num_tokens} tokens, "
            f"{block_size} tokens per block) but hot+warm+cold hold {store.total_capacity_blocks} blocks "
            f"(hot {hot}, warm {warm}, cold {cold}); nothing was written. "
            "Raise a tier's capacity or shorten the conversation")


__all__ = ["bind_kv", "bind_dtype", "bind_model", "check_fits"]
