"""Smoke test of bench/blocksize.py at its smallest size: a tiny random Llama, block sizes 8/16/32."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "blocksize.py"
SIZES = (8, 16, 32)


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_blocksize", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_blocksize_bench_tiny(tmp_path):
    out_json = tmp_path / "blocksize.json"
    assert _load_bench().main(["--tiny", "--json", str(out_json)]) == 0

    result = json.loads(out_json.read_text())
    args = result["args"]
    assert (args["short_tokens"], args["long_tokens"], args["decode_tokens"], args["rounds"]) == (40, 160, 4, 2)
    assert result["tokens_match"] == {"short": True, "long": True} and result["rounds_done"] == 2
    assert len(result["load_average_before"]) == 3 and len(result["load_average_after"]) == 3
    banks = [r for r in result["rows"] if r["block_size"] is not None]
    assert sorted((r["chat"], r["block_size"]) for r in banks) == sorted(
        (chat, size) for chat in ("short", "long") for size in SIZES)
    for row in banks:
        where = f"{row['chat']} bs {row['block_size']}"
        size, context = row["block_size"], row["context_tokens"]
        assert _positive(row["decode_tok_s"]) and _positive(row["decode_dynamic_tok_s"]), where
        assert len(row["decode_samples_tok_s"]) == 2 and row["tokens_match"] is True, where
        # hot holds 1/4 of the long chat (40 tokens) whatever the block size
        assert row["hot_capacity_blocks"] == 40 // size, where
        # wasted slots: exact tail arithmetic, read from the bank; the chat grows 5 tokens a round
        lengths = [("prefill", context - 1, row["waste_after_prefill"])]
        lengths += [(f"round {r + 1}", context + 2 + 5 * (r + 1), w) for r, w in enumerate(row["waste_after_rounds"])]
        assert len(lengths) == 3, where
        for when, tokens, waste in lengths:
            slots = -(-tokens // size) * size
            assert (waste["tokens"], waste["slots"], waste["wasted_slots"]) == (tokens, slots, slots - tokens), \
                f"{where} {when}"
            assert math.isclose(waste["wasted_share"], (slots - tokens) / slots), f"{where} {when}"
        assert row["auto_pick"] == 8, where  # default classes: up to 512 tokens -> 8
    long_rows = {r["block_size"]: r for r in banks if r["chat"] == "long"}
    for size, row in long_rows.items():
        blocks = row["waste_after_rounds"][-1]["blocks"]
        assert blocks["hot"] == 40 // size and blocks["warm"] > 0, f"bs {size}: {blocks}"  # the long chat spilled
        assert row["warm_read_bytes_per_token"] > 0, f"bs {size}"
        # the prefill wrote the overflow straight into warm: nothing moved
        assert row["prefill"]["moved_bytes"]["total"] == 0, f"bs {size}"
    # 159 -> 171 tokens with hot full: the blocks opened at 160 and 168 each demote one (hot->warm)
    assert long_rows[8]["moved_bytes_total"]["hot->warm"] > 0 and long_rows[8]["moves_per_100_tokens"] > 0
