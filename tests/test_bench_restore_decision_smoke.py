"""bench/restore.py at its smallest size: every case runs, tokens never change with the restore
decision, and the figures the README quotes are reported (no timing is asserted)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "restore.py"


def test_restore_bench_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_restore", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "restore.json"
    result = module.main(["--tiny", "--rounds", "1", "--json", str(out)])
    cases = {k: v for k, v in result["restore"].items() if isinstance(v, dict)}
    assert set(cases) == {f"{cold}/prefix{p}" for cold in ("cold_20MBps", "cold_unthrottled") for p in (32, 96)}
    for name, row in cases.items():
        assert row["tokens_equal"] is True, name
        assert min(row["always"], row["auto"], row["recompute"]) > 0 and row["auto_vs_best"] > 0, name
        stats = row["auto_restore_stats"]
        assert stats["mode"] == "auto" and stats["prefill_ms_per_token"] > 0 and stats["read_mb_per_s"]["cold"] > 0
    for engine in ("sync", "thread"):
        figures = result["background"][engine]
        assert figures["idle"]["ttft_s"] > 0 and figures["busy"]["ttft_s"] > 0 and figures["busy_over_idle_ttft"] > 0
    assert json.loads(out.read_text())["restore"].keys() == result["restore"].keys()
