"""bench/durability.py runs at its smallest size and reports both settings."""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_durability_bench_smallest_size(tmp_path):
    out = tmp_path / "durability.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "durability.py"), "--context-tokens", "64",
                    "--idle-tokens", "64", "--decode-tokens", "32", "--rounds", "1", "--json", str(out)],
                   check=True, timeout=300, cwd=ROOT, capture_output=True)
    result = json.loads(out.read_text())
    assert {row["fsync"] for row in result["rows"]} == {True, False}
    for row in result["rows"]:
        assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0
        assert row["hot_to_cold_bytes"] > 0  # the idle chat's verified blocks really went to cold
    assert result["ratio_fsync_true_over_false"] > 0
    write_behind = result["write_behind"]
    assert {row["setting"] for row in write_behind["rows"]} == {"on", "off", "off_again"}
    assert all(row["copies_after_flush"] > 0 for row in write_behind["rows"] if row["setting"] == "on")
    assert all(row["copies_after_flush"] == 0 for row in write_behind["rows"] if row["setting"] != "on")
    assert write_behind["ratio_on_over_off"] > 0 and write_behind["ratio_aa_off_again_over_off"] > 0
