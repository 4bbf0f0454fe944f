"""Smoke test of bench/multiturn.py at its smallest size: a tiny random Llama, two turns, every placement."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "multiturn.py"
PLACEMENTS = ("hot", "warm", "cold", "warm-spill", "cold-spill")
DECODE_PLACEMENTS = ("hot", "warm-spill", "cold-spill")  # offloaded chats decode from hot
TURNS = 2


def test_multiturn_bench_tiny_all_placements(tmp_path):
    out_json = tmp_path / "result.json"
    command = [sys.executable, str(BENCH), "--tiny", "--turns", str(TURNS), "--first-turn-tokens", "256",
               "--tokens-per-turn", "16", "--max-new-tokens", "4", "--decode-context", "256",
               "--decode-tokens", "4", "--decode-repeats", "1", "--placement", "all",
               "--cold-dir", str(tmp_path / "cold"), "--json", str(out_json)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"

    result = json.loads(out_json.read_text())
    rows = result["turns"]
    assert sorted((r["placement"], r["turn"]) for r in rows) == sorted(
        (p, t) for p in PLACEMENTS for t in range(1, TURNS + 1))
    for row in rows:
        where = f"{row['placement']} turn {row['turn']}"
        assert row["ttft_bank_s"] > 0 and row["ttft_recompute_s"] > 0, where
        assert row["decode_bank_tok_s"] > 0 and row["decode_dynamic_tok_s"] > 0, where
        assert row["tokens_match"] is True, f"{where}: CacheBank tokens differ from DynamicCache"
        if row["turn"] > 1:
            assert row["reused_tokens"] == row["history_tokens"] - 1, where
            assert row["history_in_placement_tier"] is True, f"{where}: blocks {row['history_blocks_before_turn']}"
    assert {r["placement"] for r in result["decode_at_context"]} == set(DECODE_PLACEMENTS)
    for row in result["decode_at_context"]:
        assert row["decode_bank_tok_s"] > 0 and row["decode_dynamic_tok_s"] > 0, row["placement"]
        assert row["tokens_match"] is True, row["placement"]
    assert result["summary"]["tokens_match_everywhere"] is True
    assert "target" in proc.stdout
