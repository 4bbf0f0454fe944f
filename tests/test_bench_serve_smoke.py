"""bench/serve.py at its smallest size: both engines answer every request, the figures are finite."""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_serve_bench_smallest_size(tmp_path):
    out = tmp_path / "serve.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "serve.py"), "--users", "2", "--turns", "2",
                           "--new-tokens", "4", "--overhead-tokens", "8", "--rounds", "1", "--stream-users", "2",
                           "--stream-tokens", "12", "--warmup-tokens", "2", "--long-prompt-tokens", "200",
                           "--modes", "batched,per_request,no_reuse", "--json", str(out)],
                          timeout=600, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    for mode in ("batched", "per_request", "no_reuse"):
        assert result[mode]["requests"] == 4 and result[mode]["failed"] == 0
        assert math.isfinite(result[mode]["later_ttft_p50_s"]) and result[mode]["later_ttft_p50_s"] > 0
        assert result[mode]["total_decode_tok_s"] > 0 and result[mode]["decode_union_s"] > 0
    assert result["batched"]["cached_share"] > 0 and result["no_reuse"]["cached_share"] == 0
    assert set(result["mismatched_conversations"]) == {"batched", "per_request"}
    assert all(math.isfinite(v) and v > 0 for v in result["ratios"].values()) and len(result["ratios"]) == 4
    streams = result["streams"]
    assert streams["with_long_prompt"]["long_prompt_tokens"] >= 150
    assert math.isfinite(streams["gap_p95_ratio"]) and streams["alone"]["gaps"] > 0
    assert result["overhead"]["ratio_server_over_local"] > 0


def test_batch_equality_bench_smallest_size(tmp_path):
    out = tmp_path / "equality.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "batch_equality.py"), "--conversations", "2",
                           "--new-tokens", "4", "--identical", "2", "--json", str(out)],
                          timeout=600, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    for layout in ("packed", "rect"):
        figures = result[layout]
        assert figures["rows"] == 2 and 0 <= figures["share_equal"] <= 1
        assert math.isfinite(figures["max_abs_logit_diff"]) and figures["batched_decode_tok_s"] > 0
        assert figures["batch_of_one"]["max_abs_logit_diff"] == 0.0  # a batch of one runs its bank alone
        assert figures["identical_rows"]["share_equal"] == 1.0
