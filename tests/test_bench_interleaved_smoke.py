"""Smoke test of bench/interleaved.py at its smallest size: two chats, two turns, both modes."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "interleaved.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_interleaved", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_interleaved_bench_smallest_size(tmp_path):
    out_json = tmp_path / "interleaved.json"
    argv = ["--chats", "2", "--context", "40", "--turns", "2", "--rounds", "2", "--steps", "2", "--settle-s", "10",
            "--json", str(out_json)]
    assert _load_bench().main(argv) == 0

    result = json.loads(out_json.read_text())
    assert [r["mode"] for r in result["modes"]] == ["mover", "no-mover"]
    for row in result["modes"]:
        where = row["mode"]
        assert row["logits_match"] is True, f"{where}: max logit diff {row['max_logit_diff']}"
        assert _positive(row["bank_step_s"]) and _positive(row["dynamic_step_s"]), where
        assert math.isclose(row["ratio"], row["dynamic_step_s"] / row["bank_step_s"]), where
        assert len(row["bank_samples_s"]) == len(row["dynamic_samples_s"]) == 2, where
        assert row["settled"] is True, where
        assert row["chat_blocks"] == 2 * 3, where  # 40 tokens: 3 blocks of 16 per chat
        for stage in ("after_fill", "after_settle", "after_rounds"):
            figures = row["layout"][stage]
            assert 0.0 <= figures["fragmentation"] <= 1.0, f"{where} {stage}"
            assert 0.0 < figures["contiguity_min"] <= figures["contiguity"] <= 1.0, f"{where} {stage}"
            assert figures["hot_used_blocks"] == 6, f"{where} {stage}"  # crops gave the decode blocks back
        assert len(row["bank_contiguity"]) == 2, where
    assert result["target_ratio"] == 0.95
    assert set(result["summary"]) == {"mover", "no-mover"}
    assert len(result["load_average_before"]) == 3 and len(result["load_average_after"]) == 3
