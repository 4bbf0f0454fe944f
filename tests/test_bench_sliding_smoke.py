"""bench/sliding.py at its smallest size: it runs, both caches give the same tokens, and the
figures it reports are the ones its README rows quote."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "sliding.py"


def test_sliding_bench_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_sliding", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "sliding.json"
    result = module.main(["--tiny", "--rounds", "1", "--json", str(out)])
    assert result["tokens_equal"] is True
    memory = result["memory"]
    assert memory["full_attention"] + memory["sliding_attention"] == memory["total"]
    block_share = 16 / 256  # the tiny run: 16-token blocks, 256 tokens
    assert 0 <= memory["share_of_full"] - memory["expected_share"] <= 2 * block_share * 5 / 6  # <= 2 blocks a layer
    assert result["decode"]["bank_ms"] > 0 and result["ttft"]["bank_from_cold_s"] > 0
    assert min(result["cold_blocks_before_turn"]) > 0  # the history really was in cold
    assert json.loads(out.read_text())["decode"] == result["decode"]
