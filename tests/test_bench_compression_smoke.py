"""bench/compression.py at its smallest size: every section runs and reports the figures the
README quotes (capacity ratios, codec speed within its error bound, decode per mode beside none,
restore from cold per mode reading fewer bytes when packed)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "compression.py"
MODES = ("none", "fp8", "int8", "int4")


def test_compression_bench_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_compression", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "compression.json"
    result = module.main(["--tiny", "--rounds", "1", "--json", str(out)])
    capacity = result["capacity"]
    assert capacity["targets_met_float32"] is True
    assert capacity["float32"]["int4"]["ratio"] > capacity["float32"]["int8"]["ratio"] > 1.9
    assert all(result["codec"][m]["within_bound"] and result["codec"][m]["decode_gbs"] > 0 for m in MODES[1:])
    decode, restore = result["decode"], result["restore"]
    for mode in MODES:
        assert decode["bank_blocks_after_prefill"][mode]["warm"] > 0  # the history really was in warm
        assert decode[mode]["step_ms"] > 0 and restore[mode]["ttft_s"] > 0
        assert restore[mode]["reused_tokens"] == restore["context"]  # the whole history came back from cold
    assert decode["none"]["tokens_equal_none"] is True
    none_read = restore["none"]["cold_bytes_read"]
    for mode in MODES[1:]:  # a compressed cold tier reads its packed bytes: fewer than the model's
        assert 0 < restore[mode]["cold_bytes_read"] < none_read
    assert result["values"] == {"skipped": "needs the real model (not --tiny)"}
    assert json.loads(out.read_text())["capacity"] == capacity
