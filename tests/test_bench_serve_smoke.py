"""bench/serve.py at its smallest size: both modes run, every request answered, the figures finite."""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_serve_bench_smallest_size(tmp_path):
    out = tmp_path / "serve.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "serve.py"), "--users", "2", "--turns", "2",
                           "--new-tokens", "4", "--overhead-tokens", "8", "--rounds", "1", "--json", str(out)],
                          timeout=600, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    for mode in ("reuse", "no_reuse"):
        assert result[mode]["requests"] == 4 and result[mode]["failed"] == 0
        assert math.isfinite(result[mode]["later_ttft_p50_s"]) and result[mode]["later_ttft_p50_s"] > 0
    assert result["reuse"]["cached_share"] > 0 and result["no_reuse"]["cached_share"] == 0
    assert result["mismatched_conversations"] == []
    assert result["overhead"]["ratio_server_over_local"] > 0
