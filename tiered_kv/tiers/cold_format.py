"""The cold tier's on-disk record format, version 1: where a record's bytes lie and what its header says.

Files (inside the store's ColdDirectory, named by `layout_signature`, which starts with the format
version, so a file of another version or layout is never opened, misread or deleted):
  `kv-v1-<16 hex>[-<n>].blocks`  block file n (none: 0), preallocated, one record per slot; each
                                 process on the directory holds one (flock) and only it writes there
  `kv-v1-<16 hex>[-<n>].index`   its durable index (sqlite3, WAL; see cold_index.py), made at the first
                                 persist; other processes read it (and the block file) read-only

Record of slot s, at s * record_stride_bytes (a multiple of 4096, so every record starts page aligned
for O_DIRECT / GPUDirect Storage):
  [0, block_bytes)                       the block `[L, 2, H, bs, D]`, C order, the layout's dtype
  [block_bytes, stride - header_bytes)   zeros
  [stride - header_bytes, stride)        the header (header_bytes = 512-byte multiple, 512 up to 48 layers)
The header sits in the record's tail, not in a page before the data: the data of slot s keeps lying at
s * stride (what tools and tests that flip cold bytes rely on) and a small block needs no extra page
(512 B of KV -> a 4 KiB record, as before). One is added only when the block fills its pages.

Header, little endian (`_PREFIX`, then L checksums, then one checksum of everything before it):
  magic b"TKVCOLD\\0", format version u32, header_bytes u32, num_layers, num_kv_heads, head_dim,
  block_size u32 each, dtype name 16 B (ASCII, NUL padded), slot u64, length in bytes u64 (= block_bytes),
  block key 16 B, root key 16 B (the model fingerprint the key chains from), then per layer slice
  checksum(record[layer]) u64, then checksum(header bytes so far) u64; the rest of the header is zeros.
A header is present only while its record is durable: a whole-record write zeroes it (same pwritev,
after the data), `persist` writes it.

Checksum: xxhash's XXH3-64 (`checksum`). Measured on this machine (2 cores) over a 256 KiB numpy buffer,
best of 5 x 2000 calls: zlib.crc32 4.1 GB/s, google-crc32c 8.6-10.7 GB/s, crc32c (hardware) 21.6 GB/s,
xxhash.xxh3_64 52 GB/s. XXH3 is the fastest by 2.4x, and python-xxhash is well kept (4.x, wheels for
every platform); it is not a CRC, but detects bit flips and torn writes as well for our purposes.
"""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from ..blocks import KVLayout

FORMAT_VERSION = 1  # records in the model's dtype (compression "none")
# compressed records: the v1 header + the compression's name, bytes in compression.CODEC_VERSION's layout.
# Version 2 held issue 21's layout (codec version 2): its files are never opened now (another file name,
# another header version), so its blocks are recomputed, never read as this layout.
COMPRESSED_FORMAT_VERSION = 3
RETIRED_FORMAT_VERSIONS = (2,)
FORMAT_VERSIONS = (FORMAT_VERSION, COMPRESSED_FORMAT_VERSION)
MAGIC = b"TKVCOLD\0"
ALIGN_BYTES = 4096
HEADER_ALIGN_BYTES = 512
_PREFIX = struct.Struct("<8sIIIIII16sQQ16s16s")
_COMPRESSION = struct.Struct("<8s")  # v3: follows the prefix; ASCII, NUL padded
_U64 = struct.Struct("<Q")
KEY_BYTES = 16


class FormatError(ValueError):
    """A header that is not a valid, matching version-1 header; the message says which field."""


def checksum(data) -> int:
    """XXH3-64 of a contiguous buffer (numpy array, bytes, memoryview): the one checksum of the format."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return xxhash.xxh3_64_intdigest(data)


def format_version(layout: KVLayout) -> int:
    """1 for records in the model's dtype, 3 for compressed ones (compression/)."""
    return COMPRESSED_FORMAT_VERSION if layout.is_compressed else FORMAT_VERSION


def layout_text(layout: KVLayout) -> str:
    """`LxHxDxBSxdtype` (v1), `LxHxDxBSxdtypexcompression` (v3): what an index's meta names."""
    text = f"{layout.num_layers}x{layout.num_kv_heads}x{layout.head_dim}x{layout.block_size}x{layout.dtype_name}"
    return f"{text}x{layout.compression}" if layout.is_compressed else text


def index_meta(layout: KVLayout) -> dict[str, str]:
    """The meta rows of an index of this layout's records (a file of another version is never read)."""
    return {"format_version": str(format_version(layout)), "layout": layout_text(layout)}


def layout_from_text(text: str) -> KVLayout:
    """Inverse of `layout_text`; ValueError when it is not one."""
    fields = text.split("x")
    if len(fields) not in (5, 6):
        raise ValueError(f"layout {text!r} is not LxHxDxBSxdtype[xcompression]")
    layout = KVLayout(*(int(v) for v in fields[:4]), fields[4])
    return layout.stored(fields[5]) if len(fields) == 6 else layout


def layout_signature(layout: KVLayout) -> str:
    """`v<format version>-<16 hex of the layout>`: names this layout's files in this format (a
    compressed layout's hash covers its compression, so no mode reads another's records)."""
    return f"v{format_version(layout)}-{hashlib.sha256(layout_text(layout).encode()).hexdigest()[:16]}"


def block_file_name(layout: KVLayout, number: int = 0) -> str:
    """Block file `number` of this layout: each process on a cold directory writes one of its own."""
    return f"kv-{layout_signature(layout)}{f'-{number}' if number else ''}.blocks"


def index_file_name(layout: KVLayout, number: int = 0) -> str:
    """The index of block file `number` (written only by the process that holds that file)."""
    return f"kv-{layout_signature(layout)}{f'-{number}' if number else ''}.index"


# kv-v<1|2>-<16 hex>[-<number>].<blocks | index | index-wal | index-shm>
FILE_NAME = re.compile(r"kv-(v[13]-[0-9a-f]{16})(?:-([1-9][0-9]{0,2}))?\.(blocks|index(?:-wal|-shm)?)")
MAX_FILES = 256  # block files per layout in one directory: processes writing it at once


def file_number(name: str) -> tuple[str, int, str] | None:
    """(layout signature `v<version>-<hex>`, file number, kind) of one of our file names, else None."""
    match = FILE_NAME.fullmatch(name)
    if match is None:
        return None
    return match.group(1), int(match.group(2) or 0), match.group(3)


def _prefix_bytes(layout: KVLayout) -> int:
    return _PREFIX.size + (_COMPRESSION.size if layout.is_compressed else 0)


def header_bytes(layout: KVLayout) -> int:
    used = _prefix_bytes(layout) + (layout.num_layers + 1) * _U64.size
    return -(-used // HEADER_ALIGN_BYTES) * HEADER_ALIGN_BYTES


def record_stride_bytes(layout: KVLayout) -> int:
    return -(-(layout.block_bytes + header_bytes(layout)) // ALIGN_BYTES) * ALIGN_BYTES


def header_offset_bytes(layout: KVLayout) -> int:
    """Where the header starts inside a record."""
    return record_stride_bytes(layout) - header_bytes(layout)


@dataclass(frozen=True)
class RecordHeader:
    slot: int
    key: bytes
    root: bytes
    checksums: tuple[int, ...]


def _check_key(name: str, value: bytes) -> bytes:
    if not isinstance(value, (bytes, bytearray)) or len(value) != KEY_BYTES:
        raise ValueError(f"cold record {name} must be {KEY_BYTES} bytes, got {value!r}")
    return bytes(value)


def pack_header(layout: KVLayout, slot: int, key: bytes, root: bytes, checksums) -> np.ndarray:
    """The header of slot `slot` as `header_bytes(layout)` uint8s, ready to write."""
    checksums = [int(c) for c in checksums]
    if len(checksums) != layout.num_layers:
        raise ValueError(f"cold slot {slot}: {len(checksums)} checksums for {layout.num_layers} layers")
    prefix = _PREFIX.pack(MAGIC, format_version(layout), header_bytes(layout), layout.num_layers,
                          layout.num_kv_heads, layout.head_dim, layout.block_size, layout.dtype_name.encode("ascii"),
                          slot, layout.block_bytes, _check_key("key", key), _check_key("root", root))
    if layout.is_compressed:
        prefix += _COMPRESSION.pack(layout.compression.encode("ascii"))
    body = prefix + b"".join(_U64.pack(c) for c in checksums)
    body += _U64.pack(checksum(body))
    page = np.zeros(header_bytes(layout), dtype=np.uint8)
    page[:len(body)] = np.frombuffer(body, dtype=np.uint8)
    return page


def unpack_header(layout: KVLayout, slot: int, page: np.ndarray) -> RecordHeader:
    """The header read from slot `slot`'s record; FormatError unless it is an intact version-1
    header of this layout (compression included), this slot and this length."""
    raw = np.ascontiguousarray(page).reshape(-1).view(np.uint8).tobytes()
    if len(raw) != header_bytes(layout):
        raise FormatError(f"header is {len(raw)} bytes, expected {header_bytes(layout)}")
    fields = _PREFIX.unpack_from(raw)
    magic, version, size, num_layers, num_kv_heads, head_dim, block_size, dtype, on_slot, length, key, root = fields
    if magic != MAGIC:
        raise FormatError("no record header (bad magic)")
    if version != format_version(layout):
        raise FormatError(f"format version {version}, expected {format_version(layout)}")
    prefix_size = _prefix_bytes(layout)
    if layout.is_compressed:
        found = _COMPRESSION.unpack_from(raw, _PREFIX.size)[0].rstrip(b"\0").decode("ascii", "replace")
        if found != layout.compression:
            raise FormatError(f"compression {found!r}, expected {layout.compression!r}")
    end = prefix_size + num_layers * _U64.size if num_layers == layout.num_layers else 0
    if not end or end + _U64.size > len(raw):
        raise FormatError(f"{num_layers} layers, expected {layout.num_layers}")
    if _U64.unpack_from(raw, end)[0] != checksum(raw[:end]):
        raise FormatError("header checksum mismatch")
    if raw[end + _U64.size:].strip(b"\0"):
        raise FormatError("nonzero bytes after the header checksum")
    found = (size, num_kv_heads, head_dim, block_size, dtype.rstrip(b"\0").decode("ascii", "replace"), length)
    expected = (header_bytes(layout), layout.num_kv_heads, layout.head_dim, layout.block_size, layout.dtype_name,
                layout.block_bytes)
    if found != expected:
        raise FormatError(f"layout (header bytes, heads, head_dim, block_size, dtype, length) {found}, "
                          f"expected {expected}")
    if on_slot != slot:
        raise FormatError(f"header names slot {on_slot}")
    checksums = tuple(_U64.unpack_from(raw, prefix_size + i * _U64.size)[0] for i in range(num_layers))
    return RecordHeader(slot, key, root, checksums)


def record_problem(layout: KVLayout, slot: int, data: bytes, key: bytes, root: bytes,
                   checksums: tuple[int, ...]) -> str | None:
    """Why `data` (the whole record read from slot `slot`, stride bytes) is not the record an index row
    names with `key`, `root` and `checksums`, or None when it is, intact."""
    stride = record_stride_bytes(layout)
    if len(data) < stride:
        return f"short record ({len(data)} of {stride} bytes: the file was cut)"
    page = np.frombuffer(data, dtype=np.uint8)
    try:
        header = unpack_header(layout, slot, page[header_offset_bytes(layout):stride])
    except FormatError as exc:
        return f"bad header: {exc}"
    if (header.key, header.root, header.checksums) != (key, root, tuple(checksums)):
        return "its header names another record"
    for layer in range(layout.num_layers):
        if checksum(page[layer * layout.layer_bytes:(layer + 1) * layout.layer_bytes]) != checksums[layer]:
            return f"layer {layer} failed its checksum (XXH3-64)"
    return None
