"""Smoke test of bench/gpu_check.py in --quick mode (tiny sizes on CPU): every section runs in
its own child process and records figures, and a part that cannot run here is an error in the
JSON, never a crash of the run."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
BANK_VARIANTS = ("bank", "bank_hooks_exact", "bank_hooks_merge", "bank_hot25_hooks_exact", "bank_hot25")


def _positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def test_gpu_check_quick_mode(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--sections", "env,decode,warm,cold",
                           "--out", str(out), "--scratch", str(tmp_path / "scratch")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check summary" in proc.stdout
    result = json.loads(out.read_text())
    sections = result["sections"]
    assert list(sections) == ["env", "decode", "warm", "cold"]
    for name, data in sections.items():
        assert data["status"] == "ok", f"{name}: {data.get('error')}\n{data.get('output_tail', '')}"

    env = sections["env"]
    assert env["backends"]["hot_device"] == "cpu" and env["backends"]["cold_backend"] == "posix"
    assert env["modules"]["tiered_kv"]["file"].startswith(str(BENCH.parents[1]))

    hooks_here = _importable("tiered_kv.hooks") and (BENCH.parents[1] / "tiered_kv" / "hooks").is_dir()
    for context, row in sections["decode"]["contexts"].items():
        assert _positive(row["dynamic"]["tokens_per_s"]), context
        for name in BANK_VARIANTS:
            value = row[name]
            if "hooks" in name and not hooks_here:
                assert "tiered_kv.hooks" in value["error"], f"{context} {name}: {value}"
                continue
            where = f"{context} {name}: {value.get('error')}"
            assert _positive(value["tokens_per_s"]), where
            assert value["tokens_equal_dynamic"] is True, where
            if name != "bank_hooks_merge":  # merge mode is exact to rounding, not bitwise
                assert value["logits_bitwise_equal"] is True, where
        assert row["bank_hot25"]["bank_blocks"]["warm"] > 0, context  # the budget put history in warm

    warm = sections["warm"]["summary"]
    assert warm["data_round_trip_equal"] is True
    assert _positive(warm["store_h2d_gb_per_s"]) and _positive(warm["plain_h2d_gb_per_s"])

    cold = sections["cold"]
    assert cold["tier_posix"]["disk"]["data_round_trip_equal"] is True
    assert cold["tier_posix"]["cached"]["data_round_trip_equal"] is True
    assert _positive(cold["summary"]["raw_posix_disk_gb_per_s"])
    assert "error" in cold["tier_kvikio"]  # kvikio needs a CUDA device
