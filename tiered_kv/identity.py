"""Block identity: what a block's key names, so two blocks share a key only if their KV is equal.

A block's KV depends on the model (architecture, weights), the KV dtype, the block size, and
every token id from the start of the sequence up to the block's end. Its key is a chain:

    key_0 = H(fingerprint, ids of block 0)        key_i = H(key_{i-1}, ids of block i)

so equal keys mean equal model and equal whole prefix. `ModelFingerprint` digests the model
part: its config (as JSON, minus names and versions that do not change the KV), the KV dtype,
the block size, and either a user-given `model_id` or a digest of the weights. The weight digest
reads every parameter's name, shape and dtype and a strided sample of its values (at most
`SAMPLED_VALUES_PER_TENSOR` per tensor): two fine-tunes, or a base and an instruct model, differ
in every sampled tensor. A change to a handful of single weights could slip past a sample; pass
`model_id=` (e.g. a checkpoint hash) when that matters, or when hashing weights is too slow.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

KEY_BYTES = 16
SAMPLED_VALUES_PER_TENSOR = 4096
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


def weights_digest(model) -> bytes:
    """A digest of the model's parameters and buffers: names, shapes, dtypes and a strided sample."""
    import torch

    digest = hashlib.blake2b(digest_size=KEY_BYTES)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}".encode())
            flat = tensor.detach().reshape(-1)
            if flat.numel() == 0:
                continue
            stride = max(1, flat.numel() // SAMPLED_VALUES_PER_TENSOR)
            sample = flat[::stride][:SAMPLED_VALUES_PER_TENSOR].to("cpu", copy=True).contiguous()
            digest.update(sample.view(torch.uint8).numpy().tobytes() if sample.dtype == torch.bfloat16
                          else sample.numpy().tobytes())
    return digest.digest()


class ModelFingerprint:
    """The root of every block key for one model, KV dtype and block size.

    `weights_id` is the user's `model_id` (hashed) or `weights_digest(model)`; it is None for a
    bank built from a config alone, whose blocks are then kept private (never published)."""

    def __init__(self, model_config, block_size: int, weights_id: bytes | None):
        self.weights_id = weights_id
        self._base = f"tiered_kv/key-v1|{_config_text(model_config)}|block_size={block_size}|".encode()
        self._by_dtype: dict[str, bytes] = {}

    @property
    def is_shareable(self) -> bool:
        return self.weights_id is not None

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
        """From a model (weights digested unless `model_id` is given) or a config (shareable only
        with a `model_id`)."""
        is_model = hasattr(model_or_config, "named_parameters") and hasattr(model_or_config, "config")
        config = model_or_config.config if is_model else model_or_config
        if model_id is not None:
            if not isinstance(model_id, str) or not model_id:
                raise ValueError(f"model_id={model_id!r}: allowed a non-empty string naming the weights")
            weights_id = hashlib.blake2b(b"model_id|" + model_id.encode(), digest_size=KEY_BYTES).digest()
        elif is_model:
            weights_id = weights_digest(model_or_config)
        else:
            weights_id = None
        return cls(config, block_size, weights_id)
