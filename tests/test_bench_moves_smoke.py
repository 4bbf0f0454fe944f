"""Smoke test of bench/moves.py at its smallest size: 8 tiny blocks, one round each way."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "moves.py"
DIRECTIONS = ("hot->warm", "warm->hot")


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_moves", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_moves_bench_smallest_size(tmp_path):
    out_json = tmp_path / "moves.json"
    argv = ["--blocks", "8", "--layers", "2", "--kv-heads", "1", "--head-dim", "8", "--block-size", "4",
            "--rounds", "1", "--json", str(out_json)]
    assert _load_bench().main(argv) == 0

    result = json.loads(out_json.read_text())
    assert result["blocks"] == 8 and result["rounds"] == 1
    assert result["layout"]["block_bytes"] == 2 * 2 * 1 * 4 * 8 * 4
    assert set(result["directions"]) == set(DIRECTIONS)
    for direction, row in result["directions"].items():
        for key in ("store_wall_s", "plain_wall_s", "ratio", "store_gbps", "plain_gbps"):
            assert _positive(row[key]), (direction, key)
        assert math.isclose(row["ratio"], row["plain_wall_s"] / row["store_wall_s"]), direction
        assert 0 <= row["store_in_copy_s"] <= row["store_wall_s"], direction
        assert math.isclose(row["store_own_s_per_block"] * 8, row["store_wall_s"] - row["store_in_copy_s"],
                            rel_tol=1e-6, abs_tol=1e-12), direction  # (one round: its own median)
        assert len(row["store_wall_samples_s"]) == len(row["plain_wall_samples_s"]) == 1, direction
    # the warm-up round and the timed one each moved every block through the store, each way
    assert result["store_bytes_moved"] == {d: 2 * 8 * result["layout"]["block_bytes"] for d in DIRECTIONS}
    summary = result["summary"]
    assert summary["bytes_intact"] is True and summary["consistent"] is True
    assert set(summary) >= {"ratio_met", "store_time_met", "ratio_target", "store_s_per_block_target"}
    assert len(result["load_average_before"]) == 3 and len(result["load_average_after"]) == 3
    assert result["cpu_count"] >= 1 and result["threads"] >= 1
