"""Smoke test of bench/overhead.py at its smallest size: two short contexts, two idle chats."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "overhead.py"
CONTEXTS = (40, 64)  # 40 leaves a partly filled last block


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_overhead", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_overhead_bench_smallest_size(tmp_path):
    out_json = tmp_path / "overhead.json"
    argv = ["--contexts", ",".join(map(str, CONTEXTS)), "--idle-chats", "2", "--idle-tokens-per-chat", "32",
            "--rounds", "1", "--steps", "2", "--chunk-tokens", "32", "--json", str(out_json)]
    assert _load_bench().main(argv) == 0

    result = json.loads(out_json.read_text())
    assert [r["context_tokens"] for r in result["contexts"]] == list(CONTEXTS)
    for row in result["contexts"]:
        where = f"context {row['context_tokens']}"
        assert _positive(row["dynamic_step_s"]), where
        assert row["logits_match"] is True, f"{where}: max logit diff {row['max_logit_diff']}"
        assert set(row["stores"]) == {"alone", "idle2"}, where
        for name, store in row["stores"].items():
            assert _positive(store["bank_step_s"]), f"{where} {name}"
            assert _positive(store["speed_ratio"]), f"{where} {name}"
            assert math.isclose(store["speed_ratio"], row["dynamic_step_s"] / store["bank_step_s"]), f"{where} {name}"
        assert set(row["idle_slowdown"]) == {"idle2"}, where
        assert math.isfinite(row["idle_slowdown"]["idle2"]) and row["idle_slowdown"]["idle2"] > -1, where
        # every block hot; the idle store holds the other chats' blocks too
        blocks_per_context = -(-row["context_tokens"] // 16)
        assert row["bank_blocks"]["alone"] == {"hot": blocks_per_context, "warm": 0, "cold": 0}, where
        assert row["store_used_blocks"] == {"alone": blocks_per_context, "idle2": blocks_per_context + 2 * 2}, where
    assert result["cpu_count"] >= 1 and result["threads"] >= 1
    assert len(result["load_average_before"]) == 3 and len(result["load_average_after"]) == 3
    assert set(result["summary"]) == {"speed_target", "idle_target", "logits_match_everywhere"}
