"""Smoke test of bench/metrics_overhead.py at its smallest size."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "metrics_overhead.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_metrics_overhead", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_metrics_overhead_bench_smallest_size(tmp_path):
    out_json = tmp_path / "metrics.json"
    assert _load_bench().main(["--context", "80", "--steps", "3", "--rounds", "1", "--json", str(out_json)]) == 0
    result = json.loads(out_json.read_text())
    rows = {row["placement"]: row for row in result["placements"]}
    assert set(rows) == {"hot", "offload"}
    for name, row in rows.items():
        assert row["tokens_equal"] is True, name
        assert row["off_counted_nothing"] is True, name
        on, off = row["tokens_per_s"]["on"], row["tokens_per_s"]["off"]
        assert all(math.isfinite(v) and v > 0 for v in (on, off)), name
        assert math.isclose(row["ratio_on_off"], on / off), name
        assert row["paired_ratio_on_off"] > 0, name
    # offload reads history out of warm at every step: gathered with hot's by one index per layer
    # (a CPU store's hot and paged warm share one slab), so no separate read is timed
    assert rows["offload"]["bank_blocks"]["warm"] > 0
    assert rows["offload"]["steps_by_read"]["gather"] > 0 and rows["offload"]["steps_by_read"]["staged"] == 0
    for name in ("hot", "offload"):  # neither reads a block out of a tier: nothing is timed per layer
        assert sum(rows[name]["read_observations_per_round"].values()) == 0, name
        assert rows[name]["ops_per_step"]["inc"] > 0, name
    assert 0 < rows["offload"]["estimated_share_of_step"] < 1
    assert set(result["summary"]) == {"target_ratio", "met", "tokens_equal_everywhere"}
