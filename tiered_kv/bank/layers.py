"""The per-layer faces transformers' generic Cache code expects of a cache; state lives in the bank."""

from __future__ import annotations

from transformers.cache_utils import CacheLayerMixin


class BankLayer(CacheLayerMixin):
    """Per-layer face that transformers' generic Cache code expects; state lives in the bank."""

    is_sliding = False
    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, bank, layer_idx: int):
        super().__init__()
        self._bank = bank
        self.layer_idx = layer_idx
        group = bank.layer_groups.groups[bank.layer_groups.group_of_layer[layer_idx]]
        self.is_sliding = group.is_sliding  # transformers sizes the sliding masks on such a layer

    def lazy_initialization(self, key_states, value_states) -> None:  # state is allocated by the store
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        return self._bank.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._bank.get_mask_sizes(query_length, self.layer_idx)

    def get_seq_length(self) -> int:
        return self._bank.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return self._bank.batch_size


__all__ = ["BankLayer"]
