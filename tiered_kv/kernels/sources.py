"""Where the native CUDA sources live and how they are read for run-time compilation.

`native/` sits at the repository root (a checkout or an editable install); a regular install
ships the same files under `<prefix>/share/tiered_kv/native` (setup.py `data_files`).
`read_source` inlines the folder's own `#include "..."` files, so the text handed to NVRTC
is self-contained and cupy's on-disk kernel cache (keyed by the text) never serves a build
made from an older header.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from ..errors import LayoutError

HEADER_NAME = "tiered_kv_ops.h"
# one kernel per file; each file's C entry points (instantiations of that one kernel)
KERNEL_FILES = {
    # paged_decode: per dtype, one entry per group tile G (query heads per CTA) reading 16-byte
    # units, and one (G = 8) reading element by element for any other layout
    "paged_decode.cu": tuple(f"paged_decode_{variant}_{t}" for t in ("f32", "f16", "bf16")
                             for variant in ("g1", "g2", "g4", "g8", "scalar")),
    "merge_partitions.cu": ("merge_partitions_f32", "merge_partitions_f16", "merge_partitions_bf16"),
    "merge_states.cu": ("merge_states_f32", "merge_states_f16", "merge_states_bf16"),
    "gather_blocks.cu": ("gather_blocks",),
    "scatter_blocks.cu": ("scatter_blocks",),
    # compressed lower tiers: packed blocks expanded into the model's dtype where they land
    "dequant_blocks.cu": ("dequant_blocks_f32", "dequant_blocks_f16", "dequant_blocks_bf16"),
    # and the model's dtype packed where the blocks lie, on their way down into a compressed tier
    "quant_blocks.cu": ("quant_blocks_f32", "quant_blocks_f16", "quant_blocks_bf16"),
}

_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def native_dir() -> Path:
    """The folder holding the `.cu` files and `tiered_kv_ops.h`; LayoutError when none is found."""
    candidates = (
        Path(__file__).resolve().parents[2] / "native",  # checkout / editable install
        Path(sys.prefix) / "share" / "tiered_kv" / "native",  # regular install (data_files)
    )
    for folder in candidates:
        if (folder / HEADER_NAME).is_file():
            return folder
    raise LayoutError(
        f"native sources: no folder with {HEADER_NAME} among {', '.join(str(c) for c in candidates)}"
    )


def read_source(file_name: str, folder: Path | None = None) -> str:
    """The text of `file_name` with local includes inlined once each (`#pragma once` semantics)."""
    folder = native_dir() if folder is None else folder
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (folder / name).read_text(encoding="utf-8")
        text = text.replace("#pragma once", "")
        return _LOCAL_INCLUDE.sub(lambda match: expand(match.group(1)), text)

    return expand(file_name)
