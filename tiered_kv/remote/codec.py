"""What a block looks like on the remote server: its key, and its value (header + bytes).

Key: `<key_prefix><layout signature>:<root hex>:<block key hex>`. The layout signature
(cold_format.layout_signature) starts with the format version and hashes layers x KV heads x
head_dim x block size x dtype; the root is the model fingerprint the block key chains from. So
a value of another format version, layout, dtype or block size lives under another key, and
two models of one shape (different fingerprints) never name each other's blocks.

Value: the durable cold tier's record header (cold_format.pack_header: magic, format version,
layout, dtype, length, block key, root, one XXH3 per layer, the header's own checksum),
followed by the block's bytes `[L, 2, H, bs, D]` in C order. Nothing is ever unpickled: `decode`
checks the length, the header, that it names this key and root, and every layer's checksum
before it returns the bytes; anything else is a miss with a reason.
"""

from __future__ import annotations

import numpy as np

from ..blocks import KVLayout
from ..compression import codec as compression_codec
from ..tiers import cold_format as fmt

REMOTE_SLOT = 0  # the header's slot field: a remote value belongs to no slot


def remote_key(prefix: str, layout: KVLayout, root: bytes, key: bytes) -> bytes:
    return f"{prefix}{fmt.layout_signature(layout)}:{root.hex()}:{key.hex()}".encode("ascii")


def value_bytes(layout: KVLayout) -> int:
    """Bytes of one value: the header and the block as `layout` stores it (packed when compressed)."""
    return fmt.header_bytes(layout) + layout.block_bytes


def encode(layout: KVLayout, key: bytes, root: bytes, block: np.ndarray) -> bytes:
    """The value of one block (`block`: its bytes in the model's dtype; packed here when `layout`
    is compressed, and the checksums cover the packed bytes)."""
    data = np.ascontiguousarray(block).reshape(-1).view(np.uint8)
    if layout.is_compressed:
        data = compression_codec.pack_block_bytes(layout, data)
    if data.size != layout.block_bytes:
        raise ValueError(f"remote value: block of {data.size} bytes, expected {layout.block_bytes}")
    layers = data.reshape(layout.num_layers, -1)
    header = fmt.pack_header(layout, REMOTE_SLOT, key, root, [fmt.checksum(layer) for layer in layers])
    return header.tobytes() + data.tobytes()


def decode(layout: KVLayout, key: bytes, root: bytes, value) -> tuple[np.ndarray | None, str]:
    """(the block's bytes as uint8 in the model's dtype, "") when `value` is an intact value of this
    key, root and layout (compression included); else (None, why not)."""
    if value is None:
        return None, "missing"
    header_size = fmt.header_bytes(layout)
    if len(value) != header_size + layout.block_bytes:
        return None, f"{len(value)} bytes, expected {header_size + layout.block_bytes}"
    raw = np.frombuffer(value, dtype=np.uint8)
    try:
        header = fmt.unpack_header(layout, REMOTE_SLOT, raw[:header_size])
    except fmt.FormatError as error:
        return None, f"bad header: {error}"
    if header.key != key or header.root != root:
        return None, "the header names another block or model"
    layers = raw[header_size:].reshape(layout.num_layers, -1)
    for layer, (data, expected) in enumerate(zip(layers, header.checksums)):
        if fmt.checksum(data) != expected:
            return None, f"layer {layer} fails its checksum"
    if layout.is_compressed:
        if not compression_codec.scales_finite(layout, layers):
            return None, "NaN or infinite scales"
        return compression_codec.unpack_block_bytes(layout, raw[header_size:]), ""
    return raw[header_size:], ""
