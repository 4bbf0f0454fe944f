"""A hybrid model (Gemma 3: sliding and full layer groups) over a compressed warm tier reads what
bench/quantizers.py's emulation reads (defect: "Gemma 3 loses far more through the bank than one
round trip of the codec"): teacher-forced in chunks, with hot holding the chunk and 2 more blocks
per layer group, every layer of every group reads

- the chunk and the 2 blocks before it exactly (the model's own K/V, bit for bit): hot's room is
  shared by the groups' blocks position by position, not taken from the first groups' newest
  blocks while the last groups keep older ones (all of a step's blocks are read at one store step,
  so LRU broke their ties by the order the step's touch listed them in);
- every older block as exactly one `decode(encode(block))` of the K/V the model gave it (never
  quantized twice, never a neighbour's or a misaligned token-0 row).
"""

from __future__ import annotations

import pytest
import torch
from helpers import VOCAB, rand_ids
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import tiered_kv
from tiered_kv.blocks import model_layer_groups
from tiered_kv.compression import MODES, codec

BS = 4
CHUNK = 4 * BS  # more blocks than SPARE: a step takes room from the last step's own blocks
SPARE = 2  # blocks hot holds per group beside the chunk's (bench/quality.py's HOT_SPARE_BLOCKS)
WINDOW = 32  # 8 blocks: a sliding group holds several blocks below hot


def hybrid_model():
    """Gemma 3 of 6 layers (5 sliding : 1 full: 6 layer groups of one layer), random weights."""
    torch.manual_seed(1234)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                              query_pre_attn_scalar=16, max_position_embeddings=1024)
    return Gemma3ForCausalLM(config).eval()


def _bank(model, mode: str, tmp_path):
    groups = len(model_layer_groups(model.config))
    config = {"block_size": BS,
              "hot": {"device": "cpu", "capacity_blocks": (CHUNK // BS + SPARE) * groups,
                      "high_watermark": 1.0, "low_watermark": 1.0},
              "warm": {"capacity_blocks": 256, "compression": mode},
              "cold": {"capacity_blocks": 0, "path": str(tmp_path)}, "scheduler": {"background": False},
              "compression": {"check_explicit": False}}
    return tiered_kv.CacheBank(model, config)


def _round_trip(block: torch.Tensor, mode: str) -> torch.Tensor:
    """One `decode(encode(x))` of a layer slice `[2, H, bs, D]`."""
    return codec.decode(codec.encode(block, mode), mode, block.shape[1], block.shape[2], block.shape[3], block.dtype)


def _teacher_forced_reads(model, bank, mode: str, num_tokens: int) -> list[str]:
    """Teacher-force `num_tokens` tokens through `bank` in chunks of CHUNK; returns, described, every
    block a layer read otherwise than the emulation reads it (exact in the last CHUNK + SPARE
    blocks, one round trip below; `none`: exact everywhere)."""
    given: dict[int, torch.Tensor] = {}  # layer -> [2, H, T, D]: every K/V the model gave the bank
    wrong: list[str] = []
    update = bank.update

    def watched(key_states, value_states, layer_idx, *args, **kwargs):
        new = torch.stack((key_states[0], value_states[0])).clone()
        given[layer_idx] = torch.cat((given[layer_idx], new), 2) if layer_idx in given else new
        keys, values = update(key_states, value_states, layer_idx, *args, **kwargs)
        got, true = torch.stack((keys[0], values[0])), given[layer_idx]
        total = true.shape[2]
        start = total - got.shape[2]
        hot_from = max(0, total - CHUNK - SPARE * BS)  # the emulation's hot window (a multiple of BS here)
        for b in range(start // BS, -(-total // BS)):
            lo, hi = max(b * BS, start), min((b + 1) * BS, total)
            read = got[:, :, lo - start:hi - start]
            if b * BS >= hot_from:
                expected, kind = true[:, :, lo:hi], "exact"
            else:
                block = true[:, :, b * BS:(b + 1) * BS]
                expected = (block if mode == "none" else _round_trip(block, mode))[:, :, lo - b * BS:hi - b * BS]
                kind = "one round trip"
            if not torch.equal(read, expected):
                wrong.append(f"{total} tokens, layer {layer_idx}, block {b}: not {kind} "
                             f"(max error {float((read - expected).abs().max()):.3g})")
        return keys, values

    bank.update = watched
    ids = rand_ids(7, num_tokens)
    with torch.no_grad():
        for start in range(0, num_tokens, CHUNK):
            model(input_ids=ids[:, start:start + CHUNK], cache=bank, use_cache=True)
    return wrong


@pytest.mark.parametrize("mode", MODES[1:])
def test_hybrid_model_reads_what_one_round_trip_gives(mode, tmp_path):
    model = hybrid_model()
    groups = model_layer_groups(model.config)
    assert len(groups) == 6 and groups.any_sliding and not groups.is_single_full
    bank = _bank(model, mode, tmp_path)
    try:
        wrong = _teacher_forced_reads(model, bank, mode, 8 * CHUNK)  # 4 windows
        assert bank.stats()["bank_blocks"]["warm"] > 0
    finally:
        bank.close()
    assert not wrong, f"{len(wrong)} blocks read otherwise than the emulation: {wrong[:8]}"


def test_uncompressed_warm_reads_exactly(tmp_path):
    """`none`: every block, in hot or warm, is the model's own K/V (the same check, no codec)."""
    model = hybrid_model()
    bank = _bank(model, "none", tmp_path)
    try:
        wrong = _teacher_forced_reads(model, bank, "none", 8 * CHUNK)
        assert bank.stats()["bank_blocks"]["warm"] > 0
    finally:
        bank.close()
    assert not wrong, wrong[:8]
