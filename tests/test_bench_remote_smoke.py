"""Smoke test of bench/remote.py at its smallest size: a tiny random Llama, a 64-token prefix, one
round of each TTFT mode and one decode round per store, against a real redis-server."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from redis_servers import require_redis_binaries

BENCH = Path(__file__).resolve().parents[1] / "bench" / "remote.py"
PROMPT_TOKENS, SUFFIX_TOKENS, CHECK_TOKENS, NEW_TOKENS, BLOCK_SIZE = 64, 16, 4, 8, 16


def _positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_remote_bench_tiny(tmp_path):
    require_redis_binaries()
    out_json = tmp_path / "remote.json"
    command = [sys.executable, str(BENCH), "--tiny", "--prompt-tokens", str(PROMPT_TOKENS), "--suffix-tokens",
               str(SUFFIX_TOKENS), "--check-tokens", str(CHECK_TOKENS), "--new-tokens", str(NEW_TOKENS),
               "--rounds", "1", "--decode-rounds", "1", "--json", str(out_json)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    result = json.loads(out_json.read_text())
    prefix_blocks = PROMPT_TOKENS // BLOCK_SIZE

    # the first process wrote the whole prefix to the server and left durable cold records behind
    write = result["write"]
    assert write["flushed"] is True and write["remote_writes"] == prefix_blocks and write["remote_bytes_out"] > 0
    assert not write["remote_writes_dropped"] and not write["remote_errors"]
    assert result["server"]["after_write"]["keys"] == prefix_blocks
    assert result["cold_files"] and sum(result["cold_files"].values()) > 0
    assert "password" not in json.dumps(result["args"]).lower()

    runs = {run["mode"]: run for run in result["ttft_runs"]}
    assert sorted(runs) == ["cold", "recompute", "remote"] and len(result["ttft_runs"]) == 3
    reference = runs["recompute"]["tokens"]
    assert len(reference) == CHECK_TOKENS
    for mode, run in runs.items():
        assert _positive(run["ttft_s"]) and run["attach_s"] >= 0, mode
        assert run["context_tokens"] == PROMPT_TOKENS + SUFFIX_TOKENS, mode
        assert run["tokens"] == reference, mode  # reused KV gives exactly recompute's tokens
    assert runs["recompute"]["reused_tokens"] == 0
    assert runs["remote"]["reused_tokens"] == PROMPT_TOKENS and runs["cold"]["reused_tokens"] == PROMPT_TOKENS
    # the remote process got the prefix from the server only; the cold one from its files only
    assert runs["remote"]["remote_hits"] == prefix_blocks and runs["remote"]["remote_bytes_in"] > 0
    assert runs["remote"]["server_net_output_bytes"] >= runs["remote"]["remote_bytes_in"]
    assert runs["remote"]["cold_to_hot_bytes"] == 0
    assert runs["cold"]["remote_bytes_in"] == 0 and runs["cold"]["cold_to_hot_bytes"] > 0

    decode = result["decode"]
    assert sorted(r["variant"] for r in decode["rounds"]) == ["control", "off", "on"]
    for row in decode["rounds"]:
        assert _positive(row["tok_s"]), row["variant"]
        assert row["reused_tokens"] == PROMPT_TOKENS, row["variant"]  # the bank holds the prefix after warm-up
        assert (row["remote_writes"] > 0 and row["remote_bytes_out"] > 0) == (row["variant"] == "on"), row
    # the store wrote only in its "on" rounds (warm-up included): nothing while its writer was off
    on_writes = sum(r["remote_writes"] for r in decode["rounds"] + decode["warm_up"] if r["variant"] == "on")
    assert decode["remote"]["store"]["writes"] == on_writes

    summary = result["summary"]
    assert summary["tokens_equal"] is True and all(summary["tokens_equal_per_mode"].values())
    assert set(summary["ttft_s"]) == {"recompute", "remote", "cold"} and all(map(_positive, summary["ttft_s"].values()))
    ttft, ratios = summary["ttft_s"], summary["ratios"]
    assert math.isclose(ratios["recompute/remote"], ttft["recompute"] / ttft["remote"])
    assert math.isclose(ratios["cold/remote"], ttft["cold"] / ttft["remote"])
    assert summary["remote_bytes_in"] > 0 and summary["ttft_target"]["met"] is None  # too short to judge
    d = summary["decode"]
    assert _positive(d["on_tok_s"]) and _positive(d["off_tok_s"]) and _positive(d["control_tok_s"])
    assert math.isclose(d["ratio"], d["on_tok_s"] / d["off_tok_s"])
    assert len(d["paired_ratios"]) == 1 and len(d["control_paired_ratios"]) == 1
    assert d["writes_per_on_round"] > 0 and d["writes_off_total"] == 0
    assert isinstance(summary["decode_target"]["met"], bool)
    assert len(result["load_average_before"]) == 3 and len(result["load_average_after"]) == 3
    assert "generated tokens equal to recompute's in every process: yes" in proc.stdout
