"""Smoke test of bench/mainjob.py at its smallest size: one round, one mode, two new tokens a turn."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "mainjob.py"


def test_mainjob_bench_smallest_size(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HOME", str(tmp_path))  # (the default config's cold tier lives under ~)
    spec = importlib.util.spec_from_file_location("bench_mainjob", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "mainjob.json"
    result = module.main(["--modes", "merge", "--rounds", "1", "--max-new-tokens", "2", "--turns", "2",
                          "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    rates = result["decode_tokens_per_s"]
    assert set(rates) == {"default-merge", "bighot-merge"}
    assert all(math.isfinite(v) and v > 0 for v in rates.values())
    assert math.isclose(result["spilled_vs_all_hot"]["merge"], rates["default-merge"] / rates["bighot-merge"])
    assert result["bank_blocks"]["bighot-merge"]["warm"] == 0  # everything hot in the 2 GiB variant
