"""Smoke test of bench/restart.py at its smallest size: a tiny random Llama, 64 tokens, one repeat."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "restart.py"
CONTEXT_TOKENS, NEW_TOKENS = 64, 16


def _positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_restart_bench_tiny(tmp_path):
    out_json = tmp_path / "restart.json"
    command = [sys.executable, str(BENCH), "--tiny", "--context-tokens", str(CONTEXT_TOKENS), "--repeats", "1",
               "--cold-dir", str(tmp_path / "cold"), "--json", str(out_json)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"

    result = json.loads(out_json.read_text())
    # the build process left its block file behind, and the parent did not delete a --cold-dir it was given
    assert result["block_files"] and all(size > 0 for size in result["block_files"].values())
    assert all(Path(path).is_file() for path in result["block_files"])
    assert result["build"]["bank_blocks_before_close"]["cold"] == -(-CONTEXT_TOKENS // 16)
    assert sorted(r["phase"] for r in result["runs"]) == ["reattach", "recompute"]
    for run in result["runs"]:
        assert _positive(run["ttft_s"]), run["phase"]
        assert run["context_tokens"] == CONTEXT_TOKENS + NEW_TOKENS, run["phase"]
        assert isinstance(run["reused_tokens"], int) and 0 <= run["reused_tokens"] < run["context_tokens"]
    summary = result["summary"]
    assert _positive(summary["ttft_reattach_s"]) and _positive(summary["ttft_recompute_s"])
    assert math.isclose(summary["ttft_ratio"], summary["ttft_recompute_s"] / summary["ttft_reattach_s"])
    assert isinstance(summary["reused_tokens_min"], int)  # 0 until the durable cold tier lands
    assert summary["first_tokens_equal"] is True
    assert len({r["first_token"] for r in result["runs"]}) == 1
    assert len(result["raw_reads"]) == 1 and _positive(result["raw_reads"][0]["bytes_per_s"])
    assert len(result["load_average_before"]) == 3 and len(result["load_average_after"]) == 3
    assert "first generated token equal in every process: yes" in proc.stdout
