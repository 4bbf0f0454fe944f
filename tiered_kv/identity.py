"""Block identity: what a block's key names, so two blocks share a key only if their KV is equal.

A block's KV depends on the model (architecture, weights), the KV dtype, the block size, and
every token id from the start of the sequence up to the block's end. Its key is a chain:

    key_0 = H(fingerprint, ids of block 0)        key_i = H(key_{i-1}, ids of block i)

so equal keys mean equal model and equal whole prefix. `ModelFingerprint` digests the model
part: its config (as JSON, minus names and versions that do not change the KV), the KV dtype,
the block size, and the weights *as they act now*: a user-given `model_id` or a digest of the base
weights, plus the adapters (peft) that act (adapters.py). An adapter that is loaded but inactive or
disabled does not count, so a model under a disabled adapter shares blocks with the plain base
model, and never with the adapter's. The digests, and the `WeightsTracker` that computes them once
per model and follows changes (`forget(model)` after an in-place write it cannot see), are in
weights.py (importable from here as before).

A bank's own rows chain from the root they started under. `refresh_for_forward` (before each
forward of the bank's model) and `refresh_for_attach` give the bank the new root when the
weights changed: an empty bank takes it at once; a bank holding KV computed under the old
weights publishes and looks up nothing more (its next tokens' KV mixes both) until it is emptied,
and `attach()` empties it first (that KV is not what the current weights compute).
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from .weights import (KEY_BYTES, SAMPLED_VALUES_PER_TENSOR, Weights, WeightsTracker, adapter_digest,  # noqa: F401
                      forget, tracker_of, weights_digest)  # (the names identity.py had: weights.py since the split)

_IGNORED_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "architectures", "torch_dtype",
                                  "dtype", "use_cache", "_commit_hash", "_attn_implementation_autoset",
                                  "_attn_implementation", "output_attentions", "output_hidden_states",
                                  "return_dict"})


def chain_keys(previous_key: bytes, token_ids, block_size: int, first_block: int, num_blocks: int) -> list[bytes]:
    """Keys of blocks first_block .. first_block+num_blocks-1 of `token_ids`, chained from
    `previous_key` (the fingerprint for block 0, else the key of block first_block-1)."""
    ids = np.asarray(token_ids[first_block * block_size:(first_block + num_blocks) * block_size], dtype=np.int64)
    keys = []
    for i in range(num_blocks):
        digest = hashlib.blake2b(previous_key, digest_size=KEY_BYTES)
        digest.update(ids[i * block_size:(i + 1) * block_size].tobytes())
        previous_key = digest.digest()
        keys.append(previous_key)
    return keys


def _config_text(model_config) -> str:
    if hasattr(model_config, "to_dict"):
        data = model_config.to_dict()
    else:
        data = dict(vars(model_config))
    data = {k: v for k, v in data.items() if k not in _IGNORED_CONFIG_KEYS}
    return json.dumps(data, sort_keys=True, default=repr)


class ModelFingerprint:
    """The root of every block key for one model, KV dtype and block size.

    Built from a model, it follows the model's `WeightsTracker`: `weights` is the state it names
    (its `weights_id`: the user's `model_id` or the weights' digest, adapters included; None when
    the adapters cannot be identified). Built from a config alone, `weights_id` is the hashed
    `model_id` or None; a None `weights_id` keeps the bank's blocks private (never published).
    A stale fingerprint (`made_stale()`) names a bank whose rows hold KV of weights that no longer
    act: it shares nothing."""

    def __init__(self, model_config, block_size: int, weights_id: bytes | None, *,
                 tracker: WeightsTracker | None = None, weights: Weights | None = None):
        self._static_weights_id = weights_id
        self.tracker = tracker
        self.weights = weights
        self.is_stale = False
        self._base = f"tiered_kv/key-v1|{_config_text(model_config)}|block_size={block_size}|".encode()
        self._by_dtype: dict[str, bytes] = {}

    @property
    def weights_id(self) -> bytes | None:
        if self.is_stale:
            return None
        return self.weights.weights_id if self.weights is not None else self._static_weights_id

    @property
    def is_shareable(self) -> bool:
        return self.weights_id is not None

    def is_current(self, weights: Weights) -> bool:
        """Whether this fingerprint names `weights` (the tracker's latest) and may share."""
        mine = self.weights
        return not self.is_stale and mine is not None and (mine is weights or mine.identity == weights.identity)

    def _derived(self, weights: Weights | None, stale: bool) -> "ModelFingerprint":
        other = object.__new__(type(self))
        other._static_weights_id = self._static_weights_id
        other.tracker, other.weights, other.is_stale = self.tracker, weights, stale
        other._base, other._by_dtype = self._base, {}
        return other

    def under(self, weights: Weights) -> "ModelFingerprint":
        """This model's fingerprint under `weights` (the same config and block size)."""
        return self._derived(weights, stale=False)

    def made_stale(self) -> "ModelFingerprint":
        return self._derived(self.weights, stale=True)

    def root_key(self, dtype_name: str) -> bytes:
        """The key that block 0 chains from, for KV stored as `dtype_name`."""
        key = self._by_dtype.get(dtype_name)
        if key is None:
            digest = hashlib.blake2b(self._base + dtype_name.encode() + b"|", digest_size=KEY_BYTES)
            digest.update(self.weights_id or b"unshared")
            key = self._by_dtype[dtype_name] = digest.digest()
        return key

    @staticmethod
    def group_root(root: bytes, group_tag: bytes) -> bytes:
        """The root of one layer group's chain (layer_groups.py): a hybrid model's block holds one
        group's layers, so its key names the group as well as the model."""
        digest = hashlib.blake2b(root, digest_size=KEY_BYTES)
        digest.update(b"|layer-group|" + group_tag)
        return digest.digest()

    @classmethod
    def of(cls, model_or_config, block_size: int, model_id: str | None = None) -> "ModelFingerprint":
        """From a model (its tracked weights: digested once per model, `model_id` naming the base
        weights if given) or a config (shareable only with a `model_id`)."""
        is_model = hasattr(model_or_config, "named_parameters") and hasattr(model_or_config, "config")
        config = model_or_config.config if is_model else model_or_config
        if model_id is not None and (not isinstance(model_id, str) or not model_id):
            raise ValueError(f"model_id={model_id!r}: allowed a non-empty string naming the weights")
        if is_model:
            tracker = tracker_of(model_or_config, model_id)
            return cls(config, block_size, None, tracker=tracker, weights=tracker.check(full=True))
        weights_id = None if model_id is None else \
            hashlib.blake2b(b"model_id|" + model_id.encode(), digest_size=KEY_BYTES).digest()
        return cls(config, block_size, weights_id)


# ---- a bank follows its model's weights ------------------------------------------------------------
def refresh_for_forward(bank, module, input_ids) -> None:
    """Before a forward of `module` through `bank` (forward_watch): give the bank the root of the
    weights about to act. A decode step (one new token per row) checks O(1) flags; a prefill the
    whole version token. An empty bank takes the new root; a bank holding KV of other weights
    turns stale (publishes and looks up nothing until emptied): its next tokens' KV mixes both."""
    fingerprint = bank.fingerprint
    tracker = fingerprint.tracker
    if tracker is None or bank.closed:
        return
    model_ref = bank.model_ref
    if model_ref is None or model_ref() is not module:
        return
    decode = getattr(input_ids, "ndim", 0) == 2 and input_ids.shape[1] == 1
    weights = tracker.check(full=not decode)
    if weights is fingerprint.weights and not fingerprint.is_stale:
        return
    if fingerprint.is_current(weights):
        fingerprint.weights = weights  # the same state, found again
    elif bank.seq.num_tokens == 0:
        bank.fingerprint = fingerprint.under(weights)
    elif not fingerprint.is_stale:
        bank.fingerprint = fingerprint.made_stale()


def refresh_for_attach(bank) -> None:
    """At attach(): the bank reuses only KV of the weights acting now. If they changed since its
    rows began, it drops its rows (their KV is not what these weights compute) and takes the new root."""
    fingerprint = bank.fingerprint
    tracker = fingerprint.tracker
    if tracker is None:
        return
    weights = tracker.check(full=True)
    if fingerprint.is_current(weights):
        fingerprint.weights = weights
        return
    if bank.get_seq_length():
        bank.truncate(0)
    bank.fingerprint = fingerprint.under(weights)
